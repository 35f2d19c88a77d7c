/* Products y = x W^T with W held in ggml's quantized blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, F16,
 * BF16, Q5_0, Q5_1, Q2_K, Q3_K, Q5_K, IQ4_NL, IQ4_XS; the layouts are ggml-common.h's, described
 * in mdiedge/model/quant.py, whose TYPES table holds each one's enum value below and is checked
 * against qm_names, qm_block and qm_block_bytes when the modules are imported), x (rows, k)
 * and y (rows, n) float32, in one of two modes (mdiedge.base.cpudot):
 *
 * - q8 (dot != 0; quant_q8.h): x quantized to 8 bits per block once per product and
 *   multiplied with the weights' quants in integer dot products, as llama.cpp's CPU path does;
 *   a type without an integer kernel on this CPU takes the float32 path below;
 * - f32 (the exact path, and the Jetson rule where asked): each block's quants are widened to
 *   float32 in registers and multiplied with the float32 activations, as follows. A
 * block's scale is applied once to the block's partial sum, d * sum(q * x) rather than
 * sum((d * q) * x); a block's minimum (Q4_1, Q4_K, Q5_1, Q5_K) is applied to the sum of the
 * activations under the block, computed once per call (qm_xsum); Q2_K's minimum (one per 16
 * weights) is taken into its widened weights instead.
 *
 * Per type there is a plain scalar reference (qm_dot_scalar: the block de-quantized as
 * ggml's dequantize_row_<type> does, then a sequential dot product) and a vector path written
 * once in GCC vector extensions (quant_simd.h), compiled for AVX2+FMA+F16C on x86-64 and for
 * NEON on aarch64; qm_init picks the vector path where the CPU has it, qm_use_simd(0) forces
 * the scalar one (tests compare them). Threads (OpenMP) split the output columns; every
 * output is computed in the same order whatever the rows beside it or the thread count.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { QM_Q8_0, QM_Q4_0, QM_Q4_1, QM_Q4_K, QM_Q6_K, QM_F16, QM_BF16, QM_Q5_0, QM_Q5_1, QM_Q2_K,
       QM_Q3_K, QM_Q5_K, QM_IQ4_NL, QM_IQ4_XS, QM_TYPES };

static const char *const qm_names[QM_TYPES] = {
    "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K", "F16", "BF16", "Q5_0", "Q5_1", "Q2_K", "Q3_K",
    "Q5_K", "IQ4_NL", "IQ4_XS"};
static const int qm_block[QM_TYPES] = {             /* weights per block */
    32, 32, 32, 256, 256, 1, 1, 32, 32, 256, 256, 256, 32, 256};
static const int qm_block_bytes[QM_TYPES] = {       /* bytes per block */
    34, 18, 20, 144, 210, 2, 2, 22, 24, 84, 110, 176, 18, 136};
/* IQ4_NL's and IQ4_XS's sixteen values (ggml's kvalues_iq4nl) */
static const int8_t qm_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                    1, 13, 25, 38, 53, 69, 89, 113};

#define QM_GROUP 4           /* activation rows per pass over a weight row */
#define QM_COLS_PER_TASK 16  /* output columns per OpenMP task (a multiple of QM_X8) */
/* qm_rows's tasks widen up to this while every thread keeps QM_TASKS_EACH of them: each task
   reads every row of x once more, so a many-row product of a wide x (Qwen2.5's down: 512
   rows of 8960, 4.6 MB, past a core's L2) reads it from L3 a quarter as often as 16 columns
   would (0-10% less time at 2 threads on the test machine, the same at 1) */
#define QM_WIDE_COLS 64
#define QM_TASKS_EACH 4
#define QM_SUB 32            /* activations summed per entry of qm_xsum */
/* A weight row QM_AHEAD_ROWS ahead is prefetched by hand while the rows between are short
   (QM_AHEAD_ROWS rows under QM_PREFETCH_BELOW bytes): the CPU's own prefetcher follows a
   short stretch badly (as ext/matvec.h found). Reading past the matrix's end is harmless
   (a prefetch does not fault). */
#define QM_AHEAD_ROWS 8
#define QM_PREFETCH_BELOW 16384

/* One weight row against R activation rows (x rows of k floats, xs rows of k / QM_SUB sums):
   s[r] = sum_i W[i] x[r][i]. */
typedef void (*qm_dot_fn)(const uint8_t *w, const float *x, const float *xs, ptrdiff_t k,
                          float *s);

/* An IEEE half at p (little-endian) as float, exactly, in portable C. */
static inline float qm_half(const uint8_t *p) {
    uint32_t h = (uint32_t)p[0] | ((uint32_t)p[1] << 8);
    uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else {  /* zero or subnormal: man * 2^-24 */
        float f = (float)man * 5.9604644775390625e-8f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Q4_K's j-th 6-bit scale and min of a block's 12 packed bytes (ggml's get_scale_min_k4). */
static inline void qm_scale_min_k4(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63; *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* -- the scalar reference: one block de-quantized as ggml's dequantize_row_<type> --------- */

static void qm_deq_q8_0(const uint8_t *b, float *y) {
    float d = qm_half(b);
    for (int i = 0; i < 32; i++) y[i] = d * (float)(int8_t)b[2 + i];
}

static void qm_deq_q4_0(const uint8_t *b, float *y) {
    float d = qm_half(b);
    for (int i = 0; i < 16; i++) {
        y[i] = d * (float)((b[2 + i] & 0xF) - 8);
        y[i + 16] = d * (float)((b[2 + i] >> 4) - 8);
    }
}

static void qm_deq_q4_1(const uint8_t *b, float *y) {
    float d = qm_half(b), m = qm_half(b + 2);
    for (int i = 0; i < 16; i++) {
        y[i] = d * (float)(b[4 + i] & 0xF) + m;
        y[i + 16] = d * (float)(b[4 + i] >> 4) + m;
    }
}

static void qm_deq_q4_k(const uint8_t *b, float *y) {
    float d = qm_half(b), dmin = qm_half(b + 2);
    const uint8_t *scales = b + 4, *q = b + 16;
    for (int j = 0; j < 4; j++, q += 32, y += 64) {
        int sc, m;
        qm_scale_min_k4(2 * j, scales, &sc, &m);
        float d1 = d * sc, m1 = dmin * m;
        qm_scale_min_k4(2 * j + 1, scales, &sc, &m);
        float d2 = d * sc, m2 = dmin * m;
        for (int l = 0; l < 32; l++) y[l] = d1 * (float)(q[l] & 0xF) - m1;
        for (int l = 0; l < 32; l++) y[32 + l] = d2 * (float)(q[l] >> 4) - m2;
    }
}

static void qm_deq_q6_k(const uint8_t *b, float *y) {
    float d = qm_half(b + 208);
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    for (int half = 0; half < 2; half++, ql += 64, qh += 32, sc += 8, y += 128) {
        for (int l = 0; l < 32; l++) {
            int is = l / 16;
            int q1 = (int)((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
            int q2 = (int)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
            int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            y[l] = d * sc[is] * q1;
            y[l + 32] = d * sc[is + 2] * q2;
            y[l + 64] = d * sc[is + 4] * q3;
            y[l + 96] = d * sc[is + 6] * q4;
        }
    }
}

static void qm_deq_f16(const uint8_t *b, float *y) { y[0] = qm_half(b); }

static void qm_deq_bf16(const uint8_t *b, float *y) {
    uint32_t bits = ((uint32_t)b[0] | ((uint32_t)b[1] << 8)) << 16;
    memcpy(y, &bits, 4);
}

static inline uint32_t qm_u32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

/* Q5_0 {f16 d; uint8 qh[4]; uint8 qs[16]}: bit i of qh is weight i's fifth bit. */
static void qm_deq_q5_0(const uint8_t *b, float *y) {
    float d = qm_half(b);
    uint32_t qh = qm_u32(b + 2);
    for (int j = 0; j < 16; j++) {
        int x0 = (int)((b[6 + j] & 0xF) | (((qh >> j) & 1) << 4)) - 16;
        int x1 = (int)((b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16;
        y[j] = d * (float)x0;
        y[j + 16] = d * (float)x1;
    }
}

/* Q5_1 {f16 d, m; uint8 qh[4]; uint8 qs[16]} */
static void qm_deq_q5_1(const uint8_t *b, float *y) {
    float d = qm_half(b), m = qm_half(b + 2);
    uint32_t qh = qm_u32(b + 4);
    for (int j = 0; j < 16; j++) {
        int x0 = (int)((b[8 + j] & 0xF) | (((qh >> j) & 1) << 4));
        int x1 = (int)((b[8 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
        y[j] = d * (float)x0 + m;
        y[j + 16] = d * (float)x1 + m;
    }
}

/* Q2_K {uint8 scales[16]; uint8 qs[64]; f16 d, dmin}: per half of 128 weights, weight
   32 j + l takes bits 2j of qs[l]; one 4-bit scale and 4-bit min per 16 weights. */
static void qm_deq_q2_k(const uint8_t *b, float *y) {
    const uint8_t *q = b + 16;
    float d = qm_half(b + 80), dmin = qm_half(b + 82);
    for (int n = 0; n < 2; n++, q += 32)
        for (int j = 0; j < 4; j++)
            for (int h = 0; h < 2; h++, y += 16) {
                int sc = b[8 * n + 2 * j + h];
                float dl = d * (float)(sc & 0xF), ml = dmin * (float)(sc >> 4);
                for (int l = 0; l < 16; l++)
                    y[l] = dl * (float)((q[16 * h + l] >> (2 * j)) & 3) - ml;
            }
}

/* Q3_K's sixteen 6-bit scales, less 32, from its 12 packed bytes. */
static inline void qm_scales_q3_k(const uint8_t *s, int *out) {
    for (int j = 0; j < 16; j++) {
        int low = j < 8 ? s[j] & 0xF : s[j - 8] >> 4;
        int high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        out[j] = (low | (high << 4)) - 32;
    }
}

/* Q3_K {uint8 hmask[32]; uint8 qs[64]; uint8 scales[12]; f16 d}: as Q2_K's low bits, and
   bit 4 n + j of hmask[l] the third (a clear bit subtracts 4). */
static void qm_deq_q3_k(const uint8_t *b, float *y) {
    const uint8_t *hm = b, *q = b + 32;
    float d = qm_half(b + 108);
    int sc[16];
    qm_scales_q3_k(b + 96, sc);
    for (int n = 0; n < 2; n++, q += 32)
        for (int j = 0; j < 4; j++)
            for (int h = 0; h < 2; h++, y += 16) {
                float dl = d * (float)sc[8 * n + 2 * j + h];
                for (int l = 16 * h; l < 16 * h + 16; l++) {
                    int v = ((q[l] >> (2 * j)) & 3) - (((hm[l] >> (4 * n + j)) & 1) ? 0 : 4);
                    y[l - 16 * h] = dl * (float)v;
                }
            }
}

/* Q5_K {f16 d, dmin; uint8 scales[12]; uint8 qh[32]; uint8 qs[128]}: Q4_K's, with bits 2c
   and 2c + 1 of qh[l] the fifth bits of sub-blocks 2c and 2c + 1. */
static void qm_deq_q5_k(const uint8_t *b, float *y) {
    float d = qm_half(b), dmin = qm_half(b + 2);
    const uint8_t *scales = b + 4, *qh = b + 16, *q = b + 48;
    for (int c = 0; c < 4; c++, q += 32, y += 64) {
        int sc, m;
        qm_scale_min_k4(2 * c, scales, &sc, &m);
        float d1 = d * sc, m1 = dmin * m;
        qm_scale_min_k4(2 * c + 1, scales, &sc, &m);
        float d2 = d * sc, m2 = dmin * m;
        for (int l = 0; l < 32; l++) {
            y[l] = d1 * (float)((q[l] & 0xF) | (((qh[l] >> (2 * c)) & 1) << 4)) - m1;
            y[32 + l] = d2 * (float)((q[l] >> 4) | (((qh[l] >> (2 * c + 1)) & 1) << 4)) - m2;
        }
    }
}

/* IQ4_NL {f16 d; uint8 qs[16]}: Q4_0's nibbles index qm_iq4nl. */
static void qm_deq_iq4_nl(const uint8_t *b, float *y) {
    float d = qm_half(b);
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)qm_iq4nl[b[2 + j] & 0xF];
        y[j + 16] = d * (float)qm_iq4nl[b[2 + j] >> 4];
    }
}

/* IQ4_XS's 6-bit scale of sub-block ib, less 32. */
static inline int qm_scale_iq4_xs(const uint8_t *b, int ib) {
    int high = ((b[2] | (b[3] << 8)) >> (2 * ib)) & 3;
    return (((b[4 + ib / 2] >> (4 * (ib % 2))) & 0xF) | (high << 4)) - 32;
}

/* IQ4_XS {f16 d; uint16 scales_h; uint8 scales_l[4]; uint8 qs[128]}: eight IQ4_NL-like
   sub-blocks of 32, each scaled by d (scale - 32). */
static void qm_deq_iq4_xs(const uint8_t *b, float *y) {
    float d = qm_half(b);
    const uint8_t *qs = b + 8;
    for (int ib = 0; ib < 8; ib++, qs += 16, y += 32) {
        float dl = d * (float)qm_scale_iq4_xs(b, ib);
        for (int j = 0; j < 16; j++) {
            y[j] = dl * (float)qm_iq4nl[qs[j] & 0xF];
            y[j + 16] = dl * (float)qm_iq4nl[qs[j] >> 4];
        }
    }
}

typedef void (*qm_deq_fn)(const uint8_t *, float *);
static const qm_deq_fn qm_deq[QM_TYPES] = {
    qm_deq_q8_0, qm_deq_q4_0, qm_deq_q4_1, qm_deq_q4_k, qm_deq_q6_k, qm_deq_f16, qm_deq_bf16,
    qm_deq_q5_0, qm_deq_q5_1, qm_deq_q2_k, qm_deq_q3_k, qm_deq_q5_k, qm_deq_iq4_nl,
    qm_deq_iq4_xs};

/* The reference dot of one weight row with R activation rows. */
static inline void qm_dot_scalar(int type, const uint8_t *w, const float *x, ptrdiff_t k,
                                 int R, float *s) {
    float block[256];
    int bk = qm_block[type], bb = qm_block_bytes[type];
    for (int r = 0; r < R; r++) s[r] = 0.0f;
    for (ptrdiff_t b = 0; b < k / bk; b++) {
        qm_deq[type](w + b * bb, block);
        for (int r = 0; r < R; r++) {
            const float *xr = x + r * k + b * bk;
            float acc = s[r];
            for (int i = 0; i < bk; i++) acc += block[i] * xr[i];
            s[r] = acc;
        }
    }
}

#define QM_SCALAR_FN(T, R)                                                                  \
    static void qm_scalar_##T##_##R(const uint8_t *w, const float *x, const float *xs,     \
                                    ptrdiff_t k, float *s) {                               \
        (void)xs;                                                                          \
        qm_dot_scalar(T, w, x, k, R, s);                                                   \
    }
#define QM_SCALAR_TYPE(T) \
    QM_SCALAR_FN(T, 1) QM_SCALAR_FN(T, 2) QM_SCALAR_FN(T, 3) QM_SCALAR_FN(T, 4)
QM_SCALAR_TYPE(0) QM_SCALAR_TYPE(1) QM_SCALAR_TYPE(2) QM_SCALAR_TYPE(3) QM_SCALAR_TYPE(4)
QM_SCALAR_TYPE(5) QM_SCALAR_TYPE(6) QM_SCALAR_TYPE(7) QM_SCALAR_TYPE(8) QM_SCALAR_TYPE(9)
QM_SCALAR_TYPE(10) QM_SCALAR_TYPE(11) QM_SCALAR_TYPE(12) QM_SCALAR_TYPE(13)
#define QM_SCALAR_ROW(T) {NULL, qm_scalar_##T##_1, qm_scalar_##T##_2, qm_scalar_##T##_3, \
                          qm_scalar_##T##_4}
static const qm_dot_fn qm_scalar[QM_TYPES][QM_GROUP + 1] = {
    QM_SCALAR_ROW(0), QM_SCALAR_ROW(1), QM_SCALAR_ROW(2), QM_SCALAR_ROW(3), QM_SCALAR_ROW(4),
    QM_SCALAR_ROW(5), QM_SCALAR_ROW(6), QM_SCALAR_ROW(7), QM_SCALAR_ROW(8), QM_SCALAR_ROW(9),
    QM_SCALAR_ROW(10), QM_SCALAR_ROW(11), QM_SCALAR_ROW(12), QM_SCALAR_ROW(13)};

/* -- the vector paths ------------------------------------------------------------------- */

typedef float qs_f8 __attribute__((vector_size(32)));
typedef float qs_f4 __attribute__((vector_size(16)));
typedef int32_t qs_i32 __attribute__((vector_size(32)));
typedef int8_t qs_i8x16 __attribute__((vector_size(16)));
typedef uint8_t qs_u8x16 __attribute__((vector_size(16)));

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define QS_ATTR __attribute__((target("avx2,fma,f16c")))
#define QS(name) name##_avx2
/* The f16 at p as float: moved in from a general register (vmovd), where _cvtsh_ss's
   vpinsrw costs twice the uops. */
#define QS_HALF(p) _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128((p)[0] | ((p)[1] << 8))))
/* The two f16 at p (a block's d and m) as the first two of four lanes, in one conversion. */
QS_ATTR static inline qs_f4 qm_half2_avx2(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return (qs_f4)_mm_cvtph_ps(_mm_cvtsi32_si128(v));
}
#define QS_HALF2(p) qm_half2_avx2(p)
#define QS_BYTES_U(p) ((qs_i32)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define QS_BYTES_S(p) ((qs_i32)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define QS_FLOAT(v) __builtin_convertvector(v, qs_f8)
/* Eight f16 (F16 weights) or bf16 (BF16) at p as eight float lanes. */
#define QS_HALF8(p) ((qs_f8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p))))
#define QS_BF16_8(p) \
    ((qs_f8)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
/* Sixteen int8 lanes as two vectors of eight floats, from registers. */
QS_ATTR static inline void qm_widen16_avx2(qs_i8x16 v, qs_f8 *out) {
    __m128i m = (__m128i)v;
    out[0] = (qs_f8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(m));
    out[1] = (qs_f8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(m, m)));
}
#define QS_WIDEN16(v, out) qm_widen16_avx2(v, out)
#include "quant_simd.h"
#define QM_SIMD_NAME "avx2"
#define QM_SIMD_TABLE qs_table_avx2
#elif defined(__aarch64__) && defined(__GNUC__)
#include <arm_neon.h>
#define QS_ATTR
#define QS(name) name##_neon
static inline float qm_half_neon(const uint8_t *p) { __fp16 h; memcpy(&h, p, 2); return (float)h; }
/* two NEON registers of four lanes as one eight-lane vector, and back (GCC converts a
   generic eight-lane vector one lane at a time) */
typedef union { qs_i32 v; int32x4_t h[2]; } qm_i32_neon;
typedef union { qs_f8 v; float32x4_t h[2]; } qm_f8_neon;
static inline qs_i32 qm_bytes_u_neon(const uint8_t *p) {
    uint16x8_t h = vmovl_u8(vld1_u8(p));
    qm_i32_neon u = {.h = {vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(h))),
                           vreinterpretq_s32_u32(vmovl_high_u16(h))}};
    return u.v;
}
static inline qs_i32 qm_bytes_s_neon(const uint8_t *p) {
    int16x8_t h = vmovl_s8(vld1_s8((const int8_t *)p));
    qm_i32_neon u = {.h = {vmovl_s16(vget_low_s16(h)), vmovl_high_s16(h)}};
    return u.v;
}
static inline qs_f8 qm_float_neon(qs_i32 v) {
    qm_i32_neon in = {.v = v};
    qm_f8_neon out = {.h = {vcvtq_f32_s32(in.h[0]), vcvtq_f32_s32(in.h[1])}};
    return out.v;
}
#define QS_HALF(p) qm_half_neon(p)
#define QS_HALF2(p) ((qs_f4){qm_half_neon(p), qm_half_neon((p) + 2), 0.0f, 0.0f})
#define QS_BYTES_U(p) qm_bytes_u_neon(p)
#define QS_BYTES_S(p) qm_bytes_s_neon(p)
#define QS_FLOAT(v) qm_float_neon(v)
static inline qs_f8 qm_half8_neon(const uint8_t *p) {
    float16x8_t h = vld1q_f16((const __fp16 *)p);
    qm_f8_neon out = {.h = {vcvt_f32_f16(vget_low_f16(h)), vcvt_high_f32_f16(h)}};
    return out.v;
}
static inline qs_f8 qm_bf16_8_neon(const uint8_t *p) {
    uint16x8_t h = vld1q_u16((const uint16_t *)p);
    qm_f8_neon out = {.h = {vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(h), 16)),
                            vreinterpretq_f32_u32(vshll_high_n_u16(h, 16))}};
    return out.v;
}
static inline void qm_widen16_neon(qs_i8x16 v, qs_f8 *out) {
    int8x16_t m = (int8x16_t)v;
    int16x8_t lo = vmovl_s8(vget_low_s8(m)), hi = vmovl_high_s8(m);
    qm_f8_neon a = {.h = {vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))),
                          vcvtq_f32_s32(vmovl_high_s16(lo))}};
    qm_f8_neon b = {.h = {vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))),
                          vcvtq_f32_s32(vmovl_high_s16(hi))}};
    out[0] = a.v;
    out[1] = b.v;
}
#define QS_WIDEN16(v, out) qm_widen16_neon(v, out)
#define QS_HALF8(p) qm_half8_neon(p)
#define QS_BF16_8(p) qm_bf16_8_neon(p)
#include "quant_simd.h"
#define QM_SIMD_NAME "neon"
#define QM_SIMD_TABLE qs_table_neon
#endif

#include "quant_q8.h"
#if defined(__x86_64__) && defined(__GNUC__)
#include "quant_q8_avx2.h"
#elif defined(__aarch64__) && (defined(__clang__) || __GNUC__ >= 8)
#include "quant_q8_neon.h"
#endif

static qm_dot_fn qm_fns[QM_TYPES][QM_GROUP + 1];
static qm_idot_fn qm_ifns[QM_TYPES];  /* the integer kernels (NULL: the type has none here) */
static qm_idot_fn qm_wfns[QM_TYPES];  /* the wide ones (NULL: the type's qm_ifns serves) */
static qm_x8_fn qm_x8fns[QM_TYPES];   /* the x8 layout's (NULL: none; qm_pack_x8) */
static const char *qm_path = "scalar", *qm_ipath = "scalar";
/* The q8 mode's activation quantizers in use: the scalar ones (quant_q8.h) or the vector
   path's, which write the same bytes. */
typedef void (*qm_quantize_fn)(const float *x, ptrdiff_t k, int R, const qm_act *a);
static qm_quantize_fn qm_quantize32_fn = qm_quantize32, qm_quantize256_fn = qm_quantize256;

/* Whether this CPU runs the vector path compiled here. */
static int qm_simd_available(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
           && __builtin_cpu_supports("f16c");
#elif defined(QM_SIMD_TABLE)
    return 1;
#else
    return 0;
#endif
}

/* Whether this CPU runs integer variant i of the vector path (0: none there). */
static int qm_ivariant_usable(int i) {
#ifdef QM_IVARIANTS
    return i >= 0 && i < QM_IVARIANTS && qm_simd_available()
           && (qm_ivariants[i].usable == NULL || qm_ivariants[i].usable());
#else
    (void)i;
    return 0;
#endif
}

/* Use the integer kernels of variant i (usable), or none on the vector path (i < 0: the types
   multiply in float32 there); qm_use_simd(1) first. Tests compare each variant. */
static void qm_use_ivariant(int i) {
    memset(qm_ifns, 0, sizeof qm_ifns);
    memset(qm_wfns, 0, sizeof qm_wfns);
    memset(qm_x8fns, 0, sizeof qm_x8fns);
    qm_ipath = "float32";
#ifdef QM_IVARIANTS
    if (qm_ivariant_usable(i)) {
        memcpy(qm_ifns, qm_ivariants[i].table, sizeof qm_ifns);
        if (qm_ivariants[i].wide) memcpy(qm_wfns, qm_ivariants[i].wide, sizeof qm_wfns);
        if (qm_ivariants[i].x8) memcpy(qm_x8fns, qm_ivariants[i].x8, sizeof qm_x8fns);
        qm_ipath = qm_ivariants[i].name;
    }
#endif
}

/* Use the vector path (on != 0, where available) with its best integer variant, or the
   scalar references; returns the name of the path now used. Not while a product runs. */
static const char *qm_use_simd(int on) {
    memcpy(qm_fns, qm_scalar, sizeof qm_fns);
    memcpy(qm_ifns, qm_iscalar, sizeof qm_ifns);
    memset(qm_wfns, 0, sizeof qm_wfns);
    memcpy(qm_x8fns, qm_x8scalar, sizeof qm_x8fns);
    qm_path = qm_ipath = "scalar";
    qm_quantize32_fn = qm_quantize32;
    qm_quantize256_fn = qm_quantize256;
#ifdef QM_SIMD_TABLE
    if (on && qm_simd_available()) {
        memcpy(qm_fns, QM_SIMD_TABLE, sizeof qm_fns);
#ifdef QM_QUANTIZE32_SIMD
        qm_quantize32_fn = QM_QUANTIZE32_SIMD;
        qm_quantize256_fn = QM_QUANTIZE256_SIMD;
#endif
        qm_path = QM_SIMD_NAME;
        int best = -1;
#ifdef QM_IVARIANTS
        for (int i = 0; i < QM_IVARIANTS; i++)
            if (qm_ivariant_usable(i)) best = i;
#endif
        qm_use_ivariant(best);
    }
#endif
    return qm_path;
}

static void qm_init(void) { qm_use_simd(1); }

/* Whether the type's kernels read qm_xsum's sums (types with a per-block minimum). */
static inline int qm_needs_xsum(int type) {
    return type == QM_Q4_1 || type == QM_Q4_K || type == QM_Q5_1 || type == QM_Q5_K;
}

/* xs[r][b] = sum of x[r][QM_SUB b .. QM_SUB b + QM_SUB), for k a multiple of QM_SUB. */
static inline void qm_xsum(const float *x, ptrdiff_t k, int rows, float *xs) {
    ptrdiff_t nb = k / QM_SUB;
    for (int r = 0; r < rows; r++)
        for (ptrdiff_t b = 0; b < nb; b++) {
            float s = 0.0f;
            for (int i = 0; i < QM_SUB; i++) s += x[r * k + b * QM_SUB + i];
            xs[r * nb + b] = s;
        }
}

/* Whether the type is multiplied by the integer kernels where the q8 mode asks for them:
   it has an activation form and a kernel on the path in use (the scalar references all). */
static inline int qm_q8_usable(int type) {
    return qm_act_form(type) != 0 && qm_ifns[type] != NULL;
}

/* Whether the q8 mode multiplies a ``type`` matrix in the x8 layout where it has one. */
static inline int qm_x8_usable(int type) {
    return type >= 0 && type < QM_TYPES && qm_q8_usable(type) && qm_x8fns[type] != NULL;
}

/* What a product's kernels read besides x: qm_xsum's sums (xs, NULL where no float32 kernel
   of a type with a minimum reads them) and, where q8, x quantized (act). */
typedef struct {
    const float *xs;
    qm_act act;
    int q8;
    int wide;  /* the wide kernels where a type has them (qm_rows's QM_DOT_WIDE) */
} qm_input;

/* Floats of the memory qm_input_fill takes for rows of k: the sums, then the quantized rows. */
static inline size_t qm_input_floats(ptrdiff_t k, int rows) {
    return (size_t)rows * (size_t)(k / QM_SUB + 1) + qm_act_bytes(k, rows) / sizeof(float) + 1;
}

static void qm_quantize_row(const float *x, ptrdiff_t k, int r, const qm_act *a, int form32,
                            int form256) {
    qm_act row = qm_act_from(a, k, r);
    if (form32) qm_quantize32_fn(x + r * k, k, 1, &row);
    if (form256) qm_quantize256_fn(x + r * k, k, 1, &row);
}

/* x's rows quantized into a's forms (form32, form256), the rows split among threads (each
   row's quants are its own). One thread works outside any OpenMP region: a region whose if
   clause fails still starts a team of one, and its closing barrier is a system call (a
   node's step quantizes its rows four times a block). */
static void qm_quantize_rows(const float *x, ptrdiff_t k, int rows, const qm_act *a,
                             int form32, int form256, int threads) {
    if (threads > 1 && rows > 1) {
        #pragma omp parallel for num_threads(threads) schedule(static)
        for (int r = 0; r < rows; r++) qm_quantize_row(x, k, r, a, form32, form256);
    } else {
        for (int r = 0; r < rows; r++) qm_quantize_row(x, k, r, a, form32, form256);
    }
}

/* in made for x (rows of k) and products of the ``count`` types: the q8 mode (dot != 0)
   quantizes x into each activation form a usable type reads (on ``threads``); the sums are
   taken where a float32 kernel reads them. mem: qm_input_floats(k, rows) floats. */
static void qm_input_fill(qm_input *in, const int *types, int count, int dot, const float *x,
                          ptrdiff_t k, int rows, float *mem, int threads) {
    int form32 = 0, form256 = 0, sums = 0;
    for (int i = 0; i < count; i++) {
        if (types[i] < 0) continue;  /* a float32 matrix */
        if (dot && qm_q8_usable(types[i])) {
            form32 |= qm_act_form(types[i]) == 32;
            form256 |= qm_act_form(types[i]) == 256;
        } else {
            sums |= qm_needs_xsum(types[i]);
        }
    }
    in->xs = NULL;
    in->q8 = form32 || form256;
    in->wide = 0;
    if (sums) {
        qm_xsum(x, k, rows, mem);
        in->xs = mem;
    }
    if (in->q8) {
        qm_act_at(&in->act, mem + (ptrdiff_t)rows * (k / QM_SUB + 1), k, rows);
        qm_quantize_rows(x, k, rows, &in->act, form32, form256, threads);
    }
}

/* in's rows from r0 on (rows of k). */
static inline qm_input qm_input_from(const qm_input *in, ptrdiff_t k, int r0) {
    qm_input out = *in;
    if (in->xs) out.xs = in->xs + r0 * (k / QM_SUB);
    if (in->q8) out.act = qm_act_from(&in->act, k, r0);
    return out;
}

/* Prefetch the weight row QM_AHEAD_ROWS ahead of row j while the rows are short. */
static inline void qm_ahead(const uint8_t *w, ptrdiff_t rb, ptrdiff_t j) {
    if (rb * QM_AHEAD_ROWS < QM_PREFETCH_BELOW) {
        const char *ahead = (const char *)(w + (j + QM_AHEAD_ROWS) * rb);
        for (ptrdiff_t i = 0; i < rb; i += 64) __builtin_prefetch(ahead + i);
    }
}

/* qm_range's integer path: QM_IGROUP rows per pass over a weight row. */
static inline void qm_irange(int type, const uint8_t *w, const qm_input *in, float *y,
                             const float *base, ptrdiff_t ldy, ptrdiff_t k, int rows,
                             ptrdiff_t j0, ptrdiff_t j1) {
    ptrdiff_t rb = k / qm_block[type] * qm_block_bytes[type];
    float s[QM_IGROUP];
    const int wide = in->wide && qm_wfns[type] != NULL;
    float dk8[wide ? QM_IGROUP * (k / 256) : 1];
    qm_idot_fn dot = wide ? qm_wfns[type] : qm_ifns[type];
    for (int r0 = 0; r0 < rows; r0 += QM_IGROUP) {
        int R = rows - r0 < QM_IGROUP ? rows - r0 : QM_IGROUP;
        qm_act act = qm_act_from(&in->act, k, r0);
        if (wide) qm_act_dk8(&act, k, R, dk8);
        for (ptrdiff_t j = j0; j < j1; j++) {
            if (r0 == 0) qm_ahead(w, rb, j);
            dot(w + j * rb, &act, k, R, s);
            for (int r = 0; r < R; r++) {
                ptrdiff_t at = (r0 + r) * ldy + j;
                y[at] = base ? base[at] + s[r] : s[r];
            }
        }
    }
}

/* Columns [j0, j1) of every row of y, whose rows are ldy floats apart (base's too; added to
   base's where base is not NULL); in: qm_input_fill's for x (NULL: nothing read). */
static inline void qm_range(int type, const uint8_t *w, const float *x, const qm_input *in,
                            float *y, const float *base, ptrdiff_t ldy, ptrdiff_t k, int rows,
                            ptrdiff_t j0, ptrdiff_t j1) {
    if (in && in->q8 && qm_q8_usable(type)) {
        qm_irange(type, w, in, y, base, ldy, k, rows, j0, j1);
        return;
    }
    const float *xs = in ? in->xs : NULL;
    ptrdiff_t rb = k / qm_block[type] * qm_block_bytes[type], nb = k / QM_SUB;
    float s[QM_GROUP];
    for (int r0 = 0; r0 < rows; r0 += QM_GROUP) {
        int R = rows - r0 < QM_GROUP ? rows - r0 : QM_GROUP;
        qm_dot_fn dot = qm_fns[type][R];
        for (ptrdiff_t j = j0; j < j1; j++) {
            if (r0 == 0) qm_ahead(w, rb, j);  /* see QM_AHEAD_ROWS */
            dot(w + j * rb, x + r0 * k, xs ? xs + r0 * nb : NULL, k, s);
            for (int r = 0; r < R; r++) {
                ptrdiff_t at = (r0 + r) * ldy + j;
                y[at] = base ? base[at] + s[r] : s[r];
            }
        }
    }
}

/* qm_irange on the x8 layout: x8 the groups (qm_pack_x8), j0 and j1 multiples of QM_X8. */
static inline void qm_irange_x8(int type, const uint8_t *x8, const qm_input *in, float *y,
                                const float *base, ptrdiff_t ldy, ptrdiff_t k, int rows,
                                ptrdiff_t j0, ptrdiff_t j1) {
    size_t group = qm_x8_bytes(type, k);
    float s[QM_IGROUP * QM_X8];
    for (int r0 = 0; r0 < rows; r0 += QM_IGROUP) {
        int R = rows - r0 < QM_IGROUP ? rows - r0 : QM_IGROUP;
        qm_act act = qm_act_from(&in->act, k, r0);
        for (ptrdiff_t j = j0; j < j1; j += QM_X8) {
            qm_x8fns[type](x8 + (size_t)(j / QM_X8) * group, &act, k, R, s);
            for (int r = 0; r < R; r++) {
                ptrdiff_t at = (r0 + r) * ldy + j;
                if (base)  /* one pass of QM_X8 lanes each: a vector where it vectorizes */
                    for (int i = 0; i < QM_X8; i++) y[at + i] = base[at + i] + s[QM_X8 * r + i];
                else
                    memcpy(y + at, s + QM_X8 * r, QM_X8 * sizeof(float));
            }
        }
    }
}

/* qm_range of a matrix held twice, its rows at w and (x8 not NULL) in the x8 layout: the
   latter where the q8 mode multiplies it and the columns are whole groups. */
static inline void qm_range_x8(int type, const uint8_t *w, const uint8_t *x8, const float *x,
                               const qm_input *in, float *y, const float *base, ptrdiff_t ldy,
                               ptrdiff_t k, int rows, ptrdiff_t j0, ptrdiff_t j1) {
    if (x8 && in && in->q8 && qm_x8_usable(type) && j0 % QM_X8 == 0 && j1 % QM_X8 == 0)
        qm_irange_x8(type, x8, in, y, base, ldy, k, rows, j0, j1);
    else
        qm_range(type, w, x, in, y, base, ldy, k, rows, j0, j1);
}

static inline void qm_task(int type, const uint8_t *w, const uint8_t *x8, const float *x,
                           const qm_input *in, float *y, ptrdiff_t ldy, ptrdiff_t n,
                           ptrdiff_t k, int rows, ptrdiff_t cols, ptrdiff_t t) {
    ptrdiff_t j0 = t * cols, j1 = j0 + cols < n ? j0 + cols : n;
    qm_range_x8(type, w, x8, x, in, y, NULL, ldy, k, rows, j0, j1);
}

/* Columns per task of qm_rows: QM_COLS_PER_TASK doubled up to QM_WIDE_COLS while each of
   ``threads`` threads keeps at least QM_TASKS_EACH tasks. */
static inline ptrdiff_t qm_task_cols(ptrdiff_t n, int threads) {
    ptrdiff_t cols = QM_COLS_PER_TASK;
    while (cols < QM_WIDE_COLS && n / (2 * cols) >= (ptrdiff_t)threads * QM_TASKS_EACH)
        cols *= 2;
    return cols;
}

#define QM_DOT_Q8 1    /* qm_rows's dot: the step's integer kernels */
#define QM_DOT_WIDE 2  /* the wide ones where a type has them (a prefill's products) */

/* y = x W^T on `threads` threads, y's rows ldy floats apart (ldy >= n: y may be a stretch of
   columns of a wider array); W is n rows of k weights of `type` at w, and (x8 not NULL) the
   same in the x8 layout (qm_pack_x8), which the q8 mode reads where it can; dot: 0 float32,
   QM_DOT_Q8 or QM_DOT_WIDE. Returns 0, or -1 where the activations' sums or quants cannot be
   allocated. Tasks of whole x8 groups (QM_COLS_PER_TASK and its doublings). */
static inline int qm_rows_into_x8(int type, const uint8_t *w, const uint8_t *x8, const float *x,
                                  float *y, ptrdiff_t ldy, ptrdiff_t n, ptrdiff_t k, int rows,
                                  int threads, int dot) {
    float *mem = malloc(sizeof(float) * qm_input_floats(k, rows));
    if (!mem) return -1;
    qm_input in;
    qm_input_fill(&in, &type, 1, dot, x, k, rows, mem, threads);
    in.wide = dot == QM_DOT_WIDE;
    ptrdiff_t cols = qm_task_cols(n, threads), tasks = (n + cols - 1) / cols;
    if (threads > 1) {  /* one thread outside a region, as qm_quantize_rows */
        #pragma omp parallel for num_threads(threads) schedule(static)
        for (ptrdiff_t t = 0; t < tasks; t++)
            qm_task(type, w, x8, x, &in, y, ldy, n, k, rows, cols, t);
    } else {
        for (ptrdiff_t t = 0; t < tasks; t++)
            qm_task(type, w, x8, x, &in, y, ldy, n, k, rows, cols, t);
    }
    free(mem);
    return 0;
}

/* qm_rows_into_x8 of a matrix held only as rows. */
static inline int qm_rows_into(int type, const uint8_t *w, const float *x, float *y,
                               ptrdiff_t ldy, ptrdiff_t n, ptrdiff_t k, int rows, int threads,
                               int dot) {
    return qm_rows_into_x8(type, w, NULL, x, y, ldy, n, k, rows, threads, dot);
}

/* qm_rows_into with y's rows n floats apart (y contiguous). */
static inline int qm_rows(int type, const uint8_t *w, const float *x, float *y, ptrdiff_t n,
                          ptrdiff_t k, int rows, int threads, int dot) {
    return qm_rows_into(type, w, x, y, n, n, k, rows, threads, dot);
}

/* out (count, k) = the de-quantized rows w[0 .. count) (w points at the first). */
static inline void qm_dequant(int type, const uint8_t *w, ptrdiff_t k, ptrdiff_t count,
                              float *out, int threads) {
    ptrdiff_t bk = qm_block[type], bb = qm_block_bytes[type], nb = k / bk;
    if (threads > 1) {  /* one thread outside a region, as qm_quantize_rows */
        #pragma omp parallel for num_threads(threads) schedule(static)
        for (ptrdiff_t i = 0; i < count * nb; i++) qm_deq[type](w + i * bb, out + i * bk);
    } else {
        for (ptrdiff_t i = 0; i < count * nb; i++) qm_deq[type](w + i * bb, out + i * bk);
    }
}
