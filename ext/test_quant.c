/* The vector paths of ext/quant.h (NEON on aarch64, AVX2 on x86-64) against their scalar
 * references, outside Python, on random blocks whose f16 scales are finite:
 *  - the float32 kernels: every type, rows 1..8, widths of one and several blocks; and
 *    qm_range (the entry for a parallel region already running: base + x W^T into rows ldy
 *    floats apart) against qm_rows;
 *  - the integer kernels (the q8 dot mode: AVX2, or NEON where the CPU has sdot): every type
 *    with one on this path, rows 1..8, widths of one and several blocks (96 for the 32-weight
 *    types), activations quantized by qm_quantize32 / qm_quantize256; and qm_rows's q8 mode
 *    against the kernel (exactly) and against the float32 mode (within the quantization's
 *    error);
 *  - the x8 layout (qm_pack_x8: Q4_K, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS, Q8_0), scalar
 *    and each vector variant with x8 kernels: qm_rows_into_x8 against qm_rows on the rows.
 * Prints one line per type and test; exits non-zero on a mismatch, where this CPU has no
 * vector path (2: nothing would have been compared), or where it has integer kernels and
 * none ran.
 *
 *   aarch64-linux-gnu-gcc -O2 -Iext -o test_quant ext/test_quant.c -lm
 *   qemu-aarch64-static -cpu max -L /usr/aarch64-linux-gnu ./test_quant
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

enum { N = 4, MAX_K = 4352, MAX_ROWS = 11 };  /* weight rows, widths (the last past 4096), activation rows */

/* n rows of k random weights of type (scales set by put_scale) and rows of k random x. */
static void fill(int type, int k, int rows, uint8_t *w, float *x, int n) {
    int bb = qm_block_bytes[type], nbl = n * k / qm_block[type];
    for (int i = 0; i < nbl * bb; i++) w[i] = (uint8_t)rng();
    for (int b = 0; b < nbl; b++)
        for (int s = 0; s < 2; s++)
            if (scale_at[type][s] >= 0) put_scale(type, w + b * bb + scale_at[type][s]);
    for (int i = 0; i < rows * k; i++) x[i] = uniform();
}

/* sum |W[j][i] x[r][i]| of output i = r n + j (the bound of its rounding error), or where
   rms the root of sum (W[j][i] x[r][i])^2 (the size of x's rounding error's effect there, by
   the rounding's relative size); x: the activations as the kernels read them. */
static float magnitude(int type, const uint8_t *w, const float *x, int k, int n, int i,
                       int rms) {
    int bk = qm_block[type], bb = qm_block_bytes[type];
    float mag = 0.0f, row[256];
    for (int b = 0; b < k / bk; b++) {
        qm_deq[type](w + ((i % n) * (k / bk) + b) * bb, row);
        for (int j = 0; j < bk; j++) {
            float p = row[j] * x[(i / n) * k + b * bk + j];
            mag += rms ? p * p : fabsf(p);
        }
    }
    return rms ? sqrtf(mag) : mag;
}

/* qm_range into rows ldy = n + 3 floats apart, over a random base: base + got where j < n. */
static int check_range(int type, int k, int rows, const uint8_t *w, const float *x,
                       const float *got, int n) {
    enum { LDY = N + 3 };
    static float mem[MAX_ROWS * (MAX_K + 64)];
    float base[8 * LDY], team[8 * LDY];
    qm_input in;
    qm_input_fill(&in, &type, 1, 0, x, k, rows, mem, 1);
    for (int i = 0; i < rows * LDY; i++) base[i] = team[i] = uniform();
    qm_range(type, w, x, &in, team, base, n + 3, k, rows, 0, n);
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < n + 3; j++) {
            int at = r * LDY + j;
            float expect = j < n ? base[at] + got[r * n + j] : base[at];
            if (team[at] != expect) {
                printf("type %d k %d rows %d row %d column %d: range %g, not %g\n", type, k,
                       rows, r, j, team[at], expect);
                return 1;
            }
        }
    return 0;
}

/* The float32 kernels: vector against scalar, and qm_range against qm_rows. */
static int check(int type, int k, int rows, uint8_t *w, float *x, int n) {
    float got[8 * N], want[8 * N];
    fill(type, k, rows, w, x, n);
    qm_use_simd(1);
    qm_rows(type, w, x, got, n, k, rows, 1, 0);
    if (check_range(type, k, rows, w, x, got, n)) return 1;
    qm_use_simd(0);
    qm_rows(type, w, x, want, n, k, rows, 1, 0);
    for (int i = 0; i < rows * n; i++)
        if (!(fabsf(got[i] - want[i]) <= 1e-5f * magnitude(type, w, x, k, n, i, 0) + 1e-30f)) {
            printf("type %d k %d rows %d output %d: vector %g scalar %g\n", type, k, rows, i,
                   got[i], want[i]);
            return 1;
        }
    return 0;
}

/* x's rows as the integer kernels read them: quantized into act, and de-quantized into xq. */
static void quantize(int type, const float *x, int k, int rows, qm_act *act, void *mem,
                     float *xq) {
    qm_act_at(act, mem, k, rows);
    if (qm_act_form(type) == 32) {
        qm_quantize32(x, k, rows, act);
        for (int i = 0; i < rows * k; i++) xq[i] = act->q32[i] * act->d32[i / 32];
    } else {
        qm_quantize256(x, k, rows, act);
        for (int i = 0; i < rows * k; i++)
            xq[i] = act->qk[i] * act->dk[(i / k) * (k / 256 + 1) + (i % k) / 256];
    }
}

static int ivariant = -1;  /* the integer variant under test (-1: the best) */

/* The vector path (simd != 0) with the integer variant under test, or the scalar one. */
static void use_path(int simd) {
    qm_use_simd(simd);
    if (simd && ivariant >= 0) qm_use_ivariant(ivariant);
}

static int wide = 0;  /* the kinds of integer kernel under test: the step's (0) or the wide */

/* One integer kernel (qm_ifns[type], or qm_wfns[type] where wide, of the path use_path(simd)
   picks) over n weight rows: out[r n + j]. */
static void idot(int simd, int type, const uint8_t *w, const qm_act *act, int k, int rows,
                 int n, float *out) {
    static float dk8[QM_IGROUP * MAX_K];
    float s[QM_IGROUP];
    use_path(simd);
    qm_idot_fn dot = simd && wide ? qm_wfns[type] : qm_ifns[type];
    qm_act in = *act;
    if (simd && wide) qm_act_dk8(&in, k, rows, dk8);
    for (int j = 0; j < n; j++) {
        dot(w + j * (k / qm_block[type] * qm_block_bytes[type]), &in, k, rows, s);
        for (int r = 0; r < rows; r++) out[r * n + j] = s[r];
    }
}

/* Whether each of the rows' outputs (got, of the vector kernel) is, bit for bit, the row's
   alone: a row's sums must not depend on the rows beside it. Returns 1 on a difference. */
static int rows_alone(int type, const uint8_t *w, const qm_act *act, int k, int rows, int n,
                      const float *got) {
    float alone[N];
    for (int r = 0; r < rows; r++) {
        qm_act one = qm_act_from(act, k, r);
        idot(1, type, w, &one, k, 1, n, alone);
        for (int j = 0; j < n; j++)
            if (alone[j] != got[r * n + j]) {
                printf("type %d k %d rows %d row %d output %d: %g among the rows, %g alone%s\n",
                       type, k, rows, r, j, got[r * n + j], alone[j], wide ? " (wide)" : "");
                return 1;
            }
    }
    return 0;
}

/* qm_rows's q8 mode (QM_DOT_WIDE where wide; rows may pass QM_IGROUP): got, where rows <=
   QM_IGROUP the kernel's own outputs (equal), and within 3e-2 of each output's size
   (magnitude's rms: 8-bit rounding moves it by about 0.4 %) of the float32 mode. */
static int check_q8_rows(int type, int k, int rows, const uint8_t *w, const float *x,
                         const float *got, int n) {
    float q8[MAX_ROWS * N], f32[MAX_ROWS * N];
    use_path(1);
    qm_rows(type, w, x, q8, n, k, rows, 1, wide ? QM_DOT_WIDE : QM_DOT_Q8);
    qm_rows(type, w, x, f32, n, k, rows, 1, 0);
    for (int i = 0; i < rows * n; i++) {
        float size = magnitude(type, w, x, k, n, i, 1);
        if ((rows <= QM_IGROUP && q8[i] != got[i]) || !(fabsf(q8[i] - f32[i]) <= 3e-2f * size)) {
            printf("type %d k %d rows %d output %d: qm_rows q8 %g, kernel %g, f32 %g (size %g)\n",
                   type, k, rows, i, q8[i], rows <= QM_IGROUP ? got[i] : q8[i], f32[i], size);
            return 1;
        }
    }
    return 0;
}

/* The integer kernel of the vector path against the scalar reference's, and qm_rows's q8
   mode. */
static int check_int(int type, int k, int rows, uint8_t *w, float *x, int n) {
    static float mem[MAX_ROWS * MAX_K];  /* qm_act_bytes(MAX_K, MAX_ROWS) and more */
    static float xq[MAX_ROWS * MAX_K];
    float got[MAX_ROWS * N], want[MAX_ROWS * N];
    qm_act act;
    fill(type, k, rows, w, x, n);
    if (rows <= QM_IGROUP) {
        quantize(type, x, k, rows, &act, mem, xq);
        idot(1, type, w, &act, k, rows, n, got);
        if (rows_alone(type, w, &act, k, rows, n, got)) return 1;
        idot(0, type, w, &act, k, rows, n, want);
        for (int i = 0; i < rows * n; i++)
            if (!(fabsf(got[i] - want[i]) <= 1e-5f * magnitude(type, w, xq, k, n, i, 0) + 1e-30f)) {
                printf("type %d k %d rows %d output %d: integer vector %g scalar %g\n", type, k,
                       rows, i, got[i], want[i]);
                return 1;
            }
    }
    return check_q8_rows(type, k, rows, w, x, got, n);
}

/* The integer kernels of every type that has one in variant ivariant; returns the
   mismatches, or 1 where none ran. */
static int check_variant(uint8_t *w, float *x) {
    int failed = 0, ran = 0;
    const char *name = qm_ipath;
    for (int type = 0; type < QM_TYPES; type++) {
        int block = qm_block[type], bad = 0, cases = 0;
        use_path(1);
        if (!qm_act_form(type) || !qm_ifns[type]) {
            printf("%s integer: none in %s (float32)\n", qm_names[type], name);
            continue;
        }
        int widths[3] = {block, 3 * block, block == 32 ? MAX_K : 2 * block};
        for (int wi = 0; wi < 3; wi++)
            for (int rows = 1; rows <= MAX_ROWS; rows += rows == QM_IGROUP ? 3 : 1, cases++)
                bad += check_int(type, widths[wi], rows, w, x, N);
        printf("%s integer %s: %d cases, %d mismatches\n", qm_names[type], name, cases, bad);
        failed |= bad;
        ran++;
        if (!qm_wfns[type]) continue;
        wide = 1, bad = cases = 0;
        for (int wi = 0; wi < 3; wi++)
            for (int rows = 1; rows <= MAX_ROWS; rows += rows == QM_IGROUP ? 3 : 1, cases++)
                bad += check_int(type, widths[wi], rows, w, x, N);
        wide = 0;
        printf("%s integer %s wide: %d cases, %d mismatches\n", qm_names[type], name, cases,
               bad);
        failed |= bad;
    }
    if (!ran) printf("no integer kernel ran in %s\n", name);
    return failed || !ran;
}

enum { X8_ROWS = 16 };  /* weight rows of the x8 checks: two groups */

/* Whether the x8 kernels' outputs must equal the rows' kernels' bit for bit: the scalar
   references (each row the same reference), and Q4_K's vector kernels (a block's sums
   scaled as the wide kernels do); the 32-weight types' vector x8 kernels scale a block's
   integer sum once where the row kernels scale each lane's, within rounding. */
static int exact_x8(int simd, int type) { return !simd || type == QM_Q4_K; }

/* A type's x8 layout (qm_pack_x8) on the path in use (simd: the vector path's integer
   variant under test, else the scalar reference): qm_rows_into_x8 against qm_rows's q8 mode
   on the rows (exact_x8; on a vector path its wide kernels where the type has them), rows
   1..MAX_ROWS, widths of one and more blocks. Returns the mismatches. */
static int check_x8_type(int simd, int type) {
    static uint8_t w[X8_ROWS * MAX_K / 32 * 34], packed[X8_ROWS * MAX_K / 32 * 34 * 2];
    static float x[MAX_ROWS * MAX_K], got[MAX_ROWS * X8_ROWS], want[MAX_ROWS * X8_ROWS];
    int bad = 0, cases = 0, dot = simd ? QM_DOT_WIDE : QM_DOT_Q8, block = qm_block[type];
    const char *name = simd ? qm_ipath : "scalar";
    for (int k = block; k <= MAX_K; k += block > 32 ? block : 5 * block)
        for (int rows = 1; rows <= MAX_ROWS; rows++, cases++) {
            fill(type, k, rows, w, x, X8_ROWS);
            qm_pack_x8(type, w, X8_ROWS, k, packed, 1);
            qm_rows_into_x8(type, w, packed, x, got, X8_ROWS, X8_ROWS, k, rows, 1, dot);
            qm_rows(type, w, x, want, X8_ROWS, k, rows, 1, dot);
            for (int i = 0; i < rows * X8_ROWS; i++) {
                float size = magnitude(type, w, x, k, X8_ROWS, i, 1);
                if (exact_x8(simd, type) ? got[i] != want[i]
                                         : !(fabsf(got[i] - want[i]) <= 1e-5f * size)) {
                    printf("%s x8 %s k %d rows %d output %d: %g, rows' kernels %g\n",
                           qm_names[type], name, k, rows, i, got[i], want[i]);
                    bad++;
                    break;
                }
            }
        }
    printf("%s x8 %s: %d cases, %d mismatches\n", qm_names[type], name, cases, bad);
    return bad;
}

static int check_x8(int simd) {
    int bad = 0;
    use_path(simd);
    for (int type = 0; type < QM_TYPES; type++) {
        use_path(simd);
        if (qm_x8_usable(type)) bad += check_x8_type(simd, type);
        else if (qm_x8_bytes(type, 256)) printf("%s x8: none in %s\n", qm_names[type],
                                                simd ? qm_ipath : "scalar");
    }
    return bad;
}

/* Every integer variant this CPU runs against the scalar references. */
static int check_integer(const char *path, uint8_t *w, float *x) {
    int failed = 0, ran = 0;
#ifdef QM_IVARIANTS
    for (ivariant = 0; ivariant < QM_IVARIANTS; ivariant++) {
        if (!qm_ivariant_usable(ivariant)) {
            printf("integer variant %s: not on this CPU\n", qm_ivariants[ivariant].name);
            continue;
        }
        use_path(1);
        failed |= check_variant(w, x);
        failed |= check_x8(1);
        ran++;
    }
    ivariant = -1;
#endif
    if (!ran) printf("no integer kernels on this CPU's path %s\n", path);
    return failed;
}

/* Row r's values for the quantizer check: random, then edge cases by row (every value a
   half-way product, zeros, the largest magnitude negative and repeated with either sign,
   blocks of magnitudes below 127 / FLT_MAX). */
static void quantizer_rows(float *x, int k, int rows) {
    for (int i = 0; i < rows * k; i++) x[i] = uniform() * (1.0f + (float)(rng() % 100));
    for (int i = 0; i < k; i++) {
        if (rows > 1)  /* with 127 the largest, each product is the value: n + 0.5 */
            x[k + i] = i % 64 == 0 ? 127.0f : (float)((int)(rng() % 254) - 127) + 0.5f;
        if (rows > 2) x[2 * k + i] = i % 37 < 20 ? 0.0f : uniform();
        if (rows > 3) x[3 * k + i] = i % 50 == 7 ? -3.0f : i % 50 == 9 ? 3.0f : uniform();
        if (rows > 4 && i < 256)  /* blocks too small for a finite inverse scale */
            x[4 * k + i] = i % 5 == 0 ? 1e-38f : i % 5 == 1 ? -1e-39f : 0.0f;
    }
}

/* The vector path's activation quantizers against the scalar ones: every byte, scale and
   sum equal. */
static int check_quantizers(void) {
    enum { K = 1024, R = 5 };
    static float x[R * K];
    static float mem_v[(R * K * 3) / 4 + R * K], mem_s[(R * K * 3) / 4 + R * K];
    qm_act v, s;
    quantizer_rows(x, K, R);
    qm_act_at(&v, mem_v, K, R);
    qm_act_at(&s, mem_s, K, R);
    memset(mem_v, 0, sizeof mem_v);
    memset(mem_s, 0, sizeof mem_s);
    qm_use_simd(1);
    qm_quantize32_fn(x, K, R, &v);
    qm_quantize256_fn(x, K, R, &v);
    qm_use_simd(0);
    qm_quantize32_fn(x, K, R, &s);
    qm_quantize256_fn(x, K, R, &s);
    qm_use_simd(1);
    int bad = memcmp(mem_v, mem_s, qm_act_bytes(K, R)) != 0;
    printf("activation quantizers: %s\n", bad ? "mismatch" : "equal");
    return bad;
}

int main(void) {
    static uint8_t w[N * MAX_K * 2];
    static float x[MAX_ROWS * MAX_K];
    int failed = 0;
    qm_init();
    if (!qm_simd_available()) {
        printf("no vector path on this CPU\n");
        return 2;
    }
    const char *path = qm_use_simd(1);
    printf("path %s\n", path);
    for (int type = 0; type < QM_TYPES; type++) {
        int block = qm_block[type], bad = 0, cases = 0;
        int widths[3] = {block > 1 ? block : 13, block > 1 ? 3 * block : 100, MAX_K};
        for (int wi = 0; wi < 3; wi++)
            for (int rows = 1; rows <= 8; rows++, cases++)
                bad += check(type, widths[wi], rows, w, x, N);
        printf("%s: %d cases, %d mismatches\n", qm_names[type], cases, bad);
        failed |= bad;
    }
    failed |= check_integer(path, w, x);
    failed |= check_x8(0);
    failed |= check_quantizers();
    return failed ? 1 : 0;
}
