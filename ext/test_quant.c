/* The vector path of ext/quant.h (NEON on aarch64, AVX2 on x86-64) against its scalar
 * reference, outside Python: every type, rows 1..8, widths of one and several blocks, on
 * random blocks whose f16 scales are finite; and qm_range (the entry for a parallel region
 * already running: base + x W^T into rows ldy floats apart) against qm_rows. Prints one line
 * per type and exits non-zero on a mismatch or where this CPU has no vector path (nothing
 * would have been compared).
 *
 *   aarch64-linux-gnu-gcc -O2 -Iext -o test_quant ext/test_quant.c -lm
 *   qemu-aarch64-static -L /usr/aarch64-linux-gnu ./test_quant
 *   gcc -O2 -Iext -o test_quant ext/test_quant.c -lm && ./test_quant
 * (tests/test_quant.py runs both.)
 */
#include <math.h>
#include <stdio.h>

#include "quant.h"

static uint32_t rng_state = 12345u;

static uint32_t rng(void) {  /* xorshift32 */
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 17;
    rng_state ^= rng_state << 5;
    return rng_state;
}

static float uniform(void) { return (float)(rng() >> 8) / 16777216.0f * 2.0f - 1.0f; }

/* The f16 bits of a normal small number (0.001 <= |v| < 0.06), by hand: sign, exponent,
   10 mantissa bits. */
static void put_half(uint8_t *p, float v) {
    uint16_t h = 0;
    if (v != 0.0f) {
        int e;
        float m = frexpf(fabsf(v), &e);  /* v = m 2^e, m in [0.5, 1) */
        h = (uint16_t)(((e - 1 + 15) << 10) | ((int)((m * 2.0f - 1.0f) * 1024.0f) & 0x3ff));
        if (v < 0) h |= 0x8000;
    }
    p[0] = (uint8_t)h; p[1] = (uint8_t)(h >> 8);
}

/* Offsets of each type's f16 scales in a block (-1: none); F16's and BF16's every value. */
static const int scale_at[QM_TYPES][2] = {
    {0, -1}, {0, -1}, {0, 2}, {0, 2}, {208, -1}, {0, -1}, {0, -1}, {0, -1}, {0, 2}, {80, 82},
    {108, -1}, {0, 2}, {0, -1}, {0, -1}};

/* A small value of either sign as the block's f16 scale, or for BF16 as its bf16 weight. */
static void put_scale(int type, uint8_t *p) {
    float v = (0.001f + 0.05f * fabsf(uniform())) * (rng() & 1 ? 1.0f : -1.0f);
    if (type == QM_BF16) {
        uint32_t bits;
        memcpy(&bits, &v, 4);
        p[0] = (uint8_t)(bits >> 16); p[1] = (uint8_t)(bits >> 24);
    } else {
        put_half(p, v);
    }
}

static int check(int type, int k, int rows, uint8_t *w, float *x, float *xs, int n) {
    float got[8 * 4], want[8 * 4];
    int bb = qm_block_bytes[type], nbl = n * k / qm_block[type];
    for (int i = 0; i < n * k / qm_block[type] * bb; i++) w[i] = (uint8_t)rng();
    for (int b = 0; b < nbl; b++)
        for (int s = 0; s < 2; s++)
            if (scale_at[type][s] >= 0) put_scale(type, w + b * bb + scale_at[type][s]);
    for (int i = 0; i < rows * k; i++) x[i] = uniform();
    qm_xsum(x, k, rows, xs);
    qm_use_simd(1);
    qm_rows(type, w, x, got, n, k, rows, 1);
    {  /* the in-region entry: base + x W^T into rows ldy = n + 3 floats apart */
        enum { LDY = 4 + 3 };
        float base[8 * LDY], team[8 * LDY];
        for (int i = 0; i < rows * LDY; i++) base[i] = team[i] = uniform();
        qm_range(type, w, x, qm_needs_xsum(type) ? xs : NULL, team, base, n + 3, k, rows, 0, n);
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < n + 3; j++) {
                int at = r * LDY + j;
                float expect = j < n ? base[at] + got[r * n + j] : base[at];
                if (team[at] != expect) {
                    printf("type %d k %d rows %d row %d column %d: range %g, not %g\n", type,
                           k, rows, r, j, team[at], expect);
                    return 1;
                }
            }
    }
    qm_use_simd(0);
    qm_rows(type, w, x, want, n, k, rows, 1);
    for (int i = 0; i < rows * n; i++) {
        float mag = 0.0f, row[256];
        for (int b = 0; b < k / qm_block[type]; b++) {  /* sum |w| |x| for the bound */
            qm_deq[type](w + ((i % n) * (k / qm_block[type]) + b) * bb, row);
            for (int j = 0; j < qm_block[type]; j++)
                mag += fabsf(row[j] * x[(i / n) * k + b * qm_block[type] + j]);
        }
        if (!(fabsf(got[i] - want[i]) <= 1e-5f * mag + 1e-30f)) {
            printf("type %d k %d rows %d output %d: vector %g scalar %g\n", type, k, rows, i,
                   got[i], want[i]);
            return 1;
        }
    }
    return 0;
}

int main(void) {
    static uint8_t w[4 * 768 * 2];
    static float x[8 * 768], xs[8 * 768 / 32];
    int failed = 0;
    qm_init();
    if (!qm_simd_available()) {
        printf("no vector path on this CPU\n");
        return 2;
    }
    printf("path %s\n", qm_use_simd(1));
    for (int type = 0; type < QM_TYPES; type++) {
        int block = qm_block[type], bad = 0, cases = 0;
        int widths[3] = {block > 1 ? block : 13, block > 1 ? 3 * block : 100, 768};
        for (int wi = 0; wi < 3; wi++)
            for (int rows = 1; rows <= 8; rows++, cases++)
                bad += check(type, widths[wi], rows, w, x, xs, 4);
        printf("%s: %d cases, %d mismatches\n", qm_names[type], cases, bad);
        failed |= bad;
    }
    return failed ? 1 : 0;
}
