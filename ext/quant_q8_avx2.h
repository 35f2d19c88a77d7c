/* The integer kernels of quant_q8.h on AVX2 (x86-64): a block's quants unpacked to bytes once
 * (unsigned, or signed with their magnitudes and signs apart), then for each activation row
 * vpmaddubsw (unsigned bytes by signed bytes, pairs summed to 16 bits) and vpmaddwd (pairs to
 * 32 bits, by one or by the sub-block's scale), the block's int32 sums converted to float once
 * and scaled by the weight's and the row's scales; with AVX512-VNNI, vpdpbusd and vpdpwssd
 * fuse those steps (the kernel bodies: quant_q8_avx2_kernels.h, compiled once per variant).
 * Included by quant_q8.h on x86-64 only.
 *
 * The 256-weight types keep per-row int32 sums over a block (vpmaddwd by the sub-blocks'
 * scales), converted and scaled once per block; their minimums (Q4_K, Q5_K, Q2_K) and offsets
 * (Q6_K's 32, Q3_K's 4: quants stored unsigned as offset + q) come from the 16-sums (bsums).
 *
 * Bounds: a pair of 6-bit (Q6_K) or smaller quants by 8-bit activations (|y| <= 127) sums to
 * at most 2 * 63 * 127 < 32767, and a pair of signed magnitudes up to 127 (IQ4_NL's, IQ4_XS's)
 * to 2 * 127 * 127 < 32767, so vpmaddubsw never saturates.
 */
#define QA_ATTR __attribute__((target("avx2,fma,f16c")))
#define QA_ALWAYS QA_ATTR static inline __attribute__((always_inline))
#define QA_UNROLL _Pragma("GCC unroll 8")

QA_ALWAYS float qa_hsum(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

QA_ALWAYS __m256i qa_load(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* The 16 bytes at p as 32 nibbles: the low ones (weights 0..15), then the high ones. */
QA_ALWAYS __m256i qa_nibbles(const uint8_t *p) {
    __m128i t = _mm_loadu_si128((const __m128i *)p);
    __m256i v = _mm256_insertf128_si256(_mm256_castsi128_si256(t), _mm_srli_epi16(t, 4), 1);
    return _mm256_and_si256(v, _mm256_set1_epi8(0xF));
}

/* 0xFF in byte i where bit i of the 32 bits at p is set. */
QA_ALWAYS __m256i qa_bits(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    const __m256i spread = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                             0x0101010101010101LL, 0);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)v), spread);
    return _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
}

/* A 32-weight block's quants as bytes: unsigned (Q4_1, Q5_1) in *u, or signed (Q8_0, Q4_0,
   Q5_0, IQ4_NL) as their magnitudes in *u and themselves in *x (signs for vpsignb). */
QA_ALWAYS int qa_unpack32(int type, const uint8_t *blk, __m256i *u, __m256i *x) {
    const __m128i values = _mm_loadu_si128((const __m128i *)qm_iq4nl);
    switch (type) {
    case QM_Q4_1: *u = qa_nibbles(blk + 4); return 0;
    case QM_Q5_1:
        *u = _mm256_or_si256(qa_nibbles(blk + 8),
                             _mm256_and_si256(qa_bits(blk + 4), _mm256_set1_epi8(0x10)));
        return 0;
    case QM_Q8_0: *x = qa_load(blk + 2); break;
    case QM_Q4_0: *x = _mm256_sub_epi8(qa_nibbles(blk + 2), _mm256_set1_epi8(8)); break;
    case QM_Q5_0:  /* q - 16: the low bits, less 16 where the fifth bit is clear */
        *x = _mm256_or_si256(qa_nibbles(blk + 6),
                             _mm256_andnot_si256(qa_bits(blk + 2), _mm256_set1_epi8((char)0xF0)));
        break;
    default:  /* IQ4_NL */
        *x = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(values), qa_nibbles(blk + 2));
    }
    *u = _mm256_sign_epi8(*x, *x);
    return 1;
}

/* Q4_K's (and Q5_K's) eight 6-bit scales (bytes 0..7) and mins (8..15) of its 12 packed
   bytes, unpacked with 32-bit operations. */
QA_ALWAYS __m128i qa_scales_k4(const uint8_t *packed) {
    uint32_t t[4];
    memcpy(t, packed, 12);
    const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, low2 = 0x03030303;
    uint32_t mins_hi = ((t[2] >> 4) & low4) | (((t[1] >> 6) & low2) << 4);
    uint32_t mins_lo = t[1] & low6;
    uint32_t scales_hi = (t[2] & low4) | (((t[0] >> 6) & low2) << 4);
    uint32_t scales_lo = t[0] & low6;
    return _mm_set_epi32((int)mins_hi, (int)mins_lo, (int)scales_hi, (int)scales_lo);
}

/* Lane pattern picking 16-bit lane j of a 128-bit half into every lane. */
QA_ALWAYS __m256i qa_lane16(__m256i v, int j) {
    return _mm256_shuffle_epi8(v, _mm256_set1_epi16((short)((2 * j) | ((2 * j + 1) << 8))));
}

/* acc[r] += dw dy sumi[r] - mw dy m (m the row's 16-sums by mins16, one 16-bit minimum per
   16 weights, where mins16 is not NULL) for R rows of block b, then sumi cleared. */
QA_ALWAYS void qa_scale_k(const qm_act *a, ptrdiff_t k, ptrdiff_t b, const int R, float dw,
                          float mw, const __m256i *mins16, __m256i *sumi, __m256 *acc) {
    const ptrdiff_t nb = k / 256;
    QA_UNROLL
    for (int r = 0; r < R; r++) {
        float dy = a->dk[r * (nb + 1) + b];
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * dy), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
        if (mins16) {
            __m256i m = _mm256_madd_epi16(*mins16, qa_load(a->bsums + r * (k / 16) + 16 * b));
            acc[r] = _mm256_fnmadd_ps(_mm256_set1_ps(mw * dy), _mm256_cvtepi32_ps(m), acc[r]);
        }
        sumi[r] = _mm256_setzero_si256();
    }
}

/* Each of R vectors' eight int32 lanes summed into lane r of one vector (lanes R.. 0). */
QA_ALWAYS __m256i qa_pairs(__m256i a, __m256i b) {  /* a0+a2 b0+b2 a1+a3 b1+b3 | the same */
    return _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
}
QA_ALWAYS __m256i qa_lanes8(const __m256i *v, const int R) {
    const __m256i z = _mm256_setzero_si256();
    __m256i t0 = qa_pairs(v[0], R > 1 ? v[1] : z);
    __m256i t1 = R > 2 ? qa_pairs(v[2], R > 3 ? v[3] : z) : z;
    __m256i t2 = R > 4 ? qa_pairs(v[4], R > 5 ? v[5] : z) : z;
    __m256i t3 = R > 6 ? qa_pairs(v[6], R > 7 ? v[7] : z) : z;
    __m256i u0 = _mm256_add_epi32(_mm256_unpacklo_epi64(t0, t1), _mm256_unpackhi_epi64(t0, t1));
    __m256i u1 = _mm256_add_epi32(_mm256_unpacklo_epi64(t2, t3), _mm256_unpackhi_epi64(t2, t3));
    return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20),
                            _mm256_permute2x128_si256(u0, u1, 0x31));
}

/* qa_scale_k for the wide kernels: lane r of *acc8 (row r) += dy (dw S - mw M), S the sum
   of sumi[r]'s lanes and M of row r's 16-sums by mins16, dy from a->dk8; sumi cleared. */
QA_ALWAYS void qa_scale_k8(const qm_act *a, ptrdiff_t k, ptrdiff_t b, const int R, float dw,
                           float mw, const __m256i *mins16, __m256i *sumi, __m256 *acc8) {
    __m256 dy = _mm256_loadu_ps(a->dk8 + QM_IGROUP * b);
    __m256i sums = qa_lanes8(sumi, R);
    *acc8 = _mm256_fmadd_ps(_mm256_mul_ps(dy, _mm256_set1_ps(dw)), _mm256_cvtepi32_ps(sums),
                            *acc8);
    if (mins16) {
        __m256i m[QM_IGROUP];
        QA_UNROLL
        for (int r = 0; r < R; r++)
            m[r] = _mm256_madd_epi16(*mins16, qa_load(a->bsums + r * (k / 16) + 16 * b));
        *acc8 = _mm256_fnmadd_ps(_mm256_mul_ps(dy, _mm256_set1_ps(mw)),
                                 _mm256_cvtepi32_ps(qa_lanes8(m, R)), *acc8);
    }
    QA_UNROLL
    for (int r = 0; r < R; r++) sumi[r] = _mm256_setzero_si256();
}

/* sumi[r] -= 2^shift (the 16-bit scales sc16, one per 16 weights, by row r's 16-sums of
   block b), for R rows: the offset of quants stored as 2^shift + q. */
QA_ALWAYS void qa_offset_k(const qm_act *a, ptrdiff_t k, ptrdiff_t b, const int R,
                           __m256i sc16, const int shift, __m256i *sumi) {
    QA_UNROLL
    for (int r = 0; r < R; r++)
        sumi[r] = _mm256_sub_epi32(sumi[r], _mm256_slli_epi32(_mm256_madd_epi16(
            sc16, qa_load(a->bsums + r * (k / 16) + 16 * b)), shift));
}

/* The 16-bit scales of weights 32 i .. 32 i + 31 from sixteen int8 ones (one per 16
   weights): scale 2 i in the low 128 bits, 2 i + 1 in the high ones. */
QA_ALWAYS __m256i qa_pick2(__m128i scales8, int i) {
    __m128i pick = _mm_add_epi8(_mm_set1_epi8((char)(2 * i)),
                                _mm_set_epi64x(0x0101010101010101LL, 0));
    return _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales8, pick));
}

/* Q3_K's sixteen 6-bit scales less 32 as int8 from its 12 packed bytes: the low four bits
   of scales 0..7 and (>> 4) 8..15 in bytes 0..7, the high two in bytes 8..11. */
QA_ALWAYS __m128i qa_scales_q3_k(const uint8_t *packed) {
    uint32_t t[3];
    memcpy(t, packed, 12);
    const uint32_t low4 = 0x0f0f0f0f, low2 = 0x03030303;
    __m128i lo = _mm_set_epi32((int)((t[1] >> 4) & low4), (int)((t[0] >> 4) & low4),
                               (int)(t[1] & low4), (int)(t[0] & low4));
    __m128i hi = _mm_set_epi32((int)((t[2] >> 6) & low2), (int)((t[2] >> 4) & low2),
                               (int)((t[2] >> 2) & low2), (int)(t[2] & low2));
    return _mm_sub_epi8(_mm_or_si128(lo, _mm_slli_epi16(hi, 4)), _mm_set1_epi8(32));
}

/* IQ4_XS's eight 6-bit scales less 32: scale ib in both 16-bit halves of 32-bit lane ib. */
QA_ALWAYS __m256i qa_scales_iq4_xs(const uint8_t *blk) {
    uint16_t high;
    uint32_t low;
    memcpy(&high, blk + 2, 2);
    memcpy(&low, blk + 4, 4);
    __m256i lo = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)low),
                                                    _mm256_set_epi32(28, 24, 20, 16, 12, 8, 4, 0)),
                                  _mm256_set1_epi32(0xF));
    __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(high),
                                                    _mm256_set_epi32(14, 12, 10, 8, 6, 4, 2, 0)),
                                  _mm256_set1_epi32(3));
    __m256i sc = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)),
                                  _mm256_set1_epi32(32));
    const __m256i twice = _mm256_set_epi64x(0x0D0C0D0C09080908LL, 0x0504050401000100LL,
                                            0x0D0C0D0C09080908LL, 0x0504050401000100LL);
    return _mm256_shuffle_epi8(sc, twice);
}

/* The activation quantizers (quant_q8.h's qm_quantize32 and qm_quantize256) on AVX2, their
   bytes, scales and sums bit for bit the scalar ones': the same products and the same halves
   added (the target has no FMA, so none is contracted), truncated as C's cast truncates.
   A decode step of 8 SmolLM2 rows spent 6% of its time in the scalar ones, 2% in these. */
#define QQ_ATTR __attribute__((target("avx2")))
#define QQ_ALWAYS QQ_ATTR static inline __attribute__((always_inline))

/* The largest of v's lanes (none a NaN). */
QQ_ALWAYS float qq_max(__m256 v) {
    __m128 h = _mm_max_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    h = _mm_max_ps(_mm_movehl_ps(h, h), h);
    h = _mm_max_ss(_mm_movehdup_ps(h), h);
    return _mm_cvtss_f32(h);
}

QQ_ALWAYS int qq_isum(__m256i v) {
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
    return _mm_cvtsi128_si32(h);
}

/* |x| of 8 lanes. The callers take maxps(|x|, top): it gives its second operand where the
   first is a NaN, so a NaN is passed over, as the scalar loop's comparison passes it over. */
QQ_ALWAYS __m256 qq_abs(__m256 x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x); }

/* qm_round of x * inv's lanes: x * inv plus a half of its sign, truncated. */
QQ_ALWAYS __m256i qq_round(__m256 x, __m256 inv) {
    __m256 v = _mm256_mul_ps(x, inv);
    __m256 half = _mm256_or_ps(_mm256_and_ps(v, _mm256_set1_ps(-0.0f)), _mm256_set1_ps(0.5f));
    return _mm256_cvttps_epi32(_mm256_add_ps(v, half));
}

/* The 32 int32 lanes of q[0..3] (each -128..127) as 32 bytes in order. */
QQ_ALWAYS __m256i qq_bytes(const __m256i *q) {
    __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                       _mm256_packs_epi32(q[2], q[3]));
    return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* Reached through qm_quantize32_fn only; noipa: GCC 12 at -O3 dropped the stores of a direct
   call's specialized copy (seen by review, not on the pointer's path). */
#if defined(__clang__)
#define QQ_ENTRY QQ_ATTR static __attribute__((noinline))
#else
#define QQ_ENTRY QQ_ATTR static __attribute__((noipa))
#endif

QQ_ENTRY void qq_quantize32(const float *x, ptrdiff_t k, int R, const qm_act *a) {
    int8_t *q = (int8_t *)a->q32;
    float *d = (float *)a->d32, *s = (float *)a->s32;
    int32_t *sums = (int32_t *)a->i32;
    for (ptrdiff_t b = 0; b < (ptrdiff_t)R * (k / 32); b++) {
        __m256 v[4], top = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(x + 32 * b + 8 * j);
            top = _mm256_max_ps(qq_abs(v[j]), top);
        }
        float db = qq_max(top) / 127.0f, inv = qm_finite_or_zero(db != 0.0f ? 1.0f / db : 0.0f);
        __m256i qi[4], total = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            qi[j] = qq_round(v[j], _mm256_set1_ps(inv));
            total = _mm256_add_epi32(total, qi[j]);
        }
        _mm256_storeu_si256((__m256i *)(q + 32 * b), qq_bytes(qi));
        int sum = qq_isum(total);
        d[b] = db;
        s[b] = db * (float)sum;
        sums[b] = sum;
    }
}

/* The first of the 256 values at xb whose magnitude is amax (> 0, one of them). */
QQ_ALWAYS float qq_first_of(const float *xb, float amax) {
    const __m256 want = _mm256_set1_ps(amax);
    for (int j = 0;; j++) {
        __m256 v = _mm256_loadu_ps(xb + 8 * j);
        int hit = _mm256_movemask_ps(_mm256_cmp_ps(qq_abs(v), want, _CMP_EQ_OQ));
        if (hit) return xb[8 * j + __builtin_ctz((unsigned)hit)];
    }
}

/* One 256-block at xb into qb, its 16-sums bs and its scale *d. */
QQ_ALWAYS void qq_block256(const float *xb, int8_t *qb, int16_t *bs, float *d) {
    __m256 top = _mm256_setzero_ps();
    for (int j = 0; j < 32; j++) top = _mm256_max_ps(qq_abs(_mm256_loadu_ps(xb + 8 * j)), top);
    float amax = qq_max(top);
    float inv = qm_finite_or_zero(amax != 0.0f ? -127.0f / qq_first_of(xb, amax) : 0.0f);
    for (int c = 0; c < 8; c++) {
        __m256i qi[4];
        for (int j = 0; j < 4; j++)
            qi[j] = _mm256_min_epi32(qq_round(_mm256_loadu_ps(xb + 32 * c + 8 * j),
                                              _mm256_set1_ps(inv)), _mm256_set1_epi32(127));
        _mm256_storeu_si256((__m256i *)(qb + 32 * c), qq_bytes(qi));
        bs[2 * c] = (int16_t)qq_isum(_mm256_add_epi32(qi[0], qi[1]));
        bs[2 * c + 1] = (int16_t)qq_isum(_mm256_add_epi32(qi[2], qi[3]));
    }
    *d = inv != 0.0f ? 1.0f / inv : 0.0f;
}

QQ_ENTRY void qq_quantize256(const float *x, ptrdiff_t k, int R, const qm_act *a) {
    ptrdiff_t per_row = k / 256;
    for (int r = 0; r < R; r++)
        for (ptrdiff_t b = 0; b < per_row; b++) {
            qq_block256(x + r * k + 256 * b, (int8_t *)a->qk + r * k + 256 * b,
                        (int16_t *)a->bsums + r * (k / 16) + 16 * b,
                        (float *)a->dk + r * (per_row + 1) + b);
        }
}
#define QM_QUANTIZE32_SIMD qq_quantize32
#define QM_QUANTIZE256_SIMD qq_quantize256

typedef int32_t qa_four_bytes __attribute__((may_alias));  /* 4 activation bytes, read whole */

/* The kernels, twice: AVX2, and AVX512-VNNI on 256-bit vectors where the CPU has it (the
   same sums with a third fewer instructions; measured on AMD Zen 4, 512 rows, one thread:
   the K-quants' products 1.6-1.8x, the 32-weight types' 1.15-1.2x). */
#define QK(name) qa_##name
#define QK_ATTR QA_ATTR
#define QK_VNNI 0
#include "quant_q8_avx2_kernels.h"
#undef QK
#undef QK_ATTR
#undef QK_VNNI
#define QK(name) qv_##name
#define QK_ATTR __attribute__((target("avx2,fma,f16c,avx512vnni,avx512vl")))
#define QK_VNNI 1
#include "quant_q8_avx2_kernels.h"
#undef QK
#undef QK_ATTR
#undef QK_VNNI

/* Whether this CPU runs the VNNI variant (AVX512-VNNI and AVX512VL, beyond AVX2). */
static inline int qa_vnni(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
}

/* The integer variants of this path, best last: name, kernels by type, wide kernels by type,
   whether it runs, x8 kernels by type. */
static const qm_ivariant qm_ivariants[] = {
    {"avx2", qa_table, qa_wtable, NULL, qa_x8table},
    {"avx2+avx512vnni", qv_table, qv_wtable, qa_vnni, qv_x8table},
};
#define QM_IVARIANTS 2
