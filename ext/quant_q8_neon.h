/* The integer kernels of quant_q8.h on aarch64 with the dot-product instruction sdot
 * (vdotq_s32: four int8 by int8 products summed into each int32 lane; optional in Armv8.2,
 * standard from Armv8.4): a block's quants unpacked once to signed bytes (offsets taken off,
 * IQ4's values looked up with tbl), then each activation row's sums taken by sdot; where the
 * type has one scale per 16 or 32 weights, the sums of four such groups are gathered into
 * one vector (pairwise adds) and multiplied by the four scales together. Per block the int32
 * sums are converted to float once and scaled by the weight's and the row's scales; minimums
 * are taken from the activations' block sums (Q8_1's s, Q8_K's bsums).
 *
 * Only these functions are compiled for armv8.2-a+dotprod (the rest of the module builds for
 * plain armv8-a); quant.h uses the table only where the CPU has the instruction
 * (qn_dotprod: HWCAP_ASIMDDP on Linux), else the float32 NEON kernels multiply every type.
 * Included by quant.h on aarch64 only.
 *
 * Bounds: weights are at most 127 in magnitude (IQ4's values), activations 127, so one
 * sdot lane gathers at most 4 * 127 * 127; a block's scaled sum (IQ4_XS: 8 sub-blocks,
 * scales to 32, 32 products each) stays under 2^28.
 */
#if defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#endif

#if defined(__clang__)
#define QN_ATTR __attribute__((target("dotprod")))
#else
#define QN_ATTR __attribute__((target("arch=armv8.2-a+dotprod")))
#endif
#define QN_ALWAYS QN_ATTR static inline __attribute__((always_inline))
#define QN_UNROLL _Pragma("GCC unroll 8")

/* Whether this CPU has the dot-product instructions. */
static int qn_dotprod(void) {
#if defined(__ARM_FEATURE_DOTPROD)
    return 1;
#elif defined(__linux__)
    return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#else
    return 0;
#endif
}

QN_ALWAYS uint8x16_t qn_shr(uint8x16_t v, int n) { return vshlq_u8(v, vdupq_n_s8((int8_t)-n)); }

/* Sums of a0's and a1's 32 bytes by the 32 activations at y, four lanes. */
QN_ALWAYS int32x4_t qn_dot2(int8x16_t a0, int8x16_t a1, const int8_t *y) {
    return vdotq_s32(vdotq_s32(vdupq_n_s32(0), a0, vld1q_s8(y)), a1, vld1q_s8(y + 16));
}

/* Bits 0..15 (*lo) and 16..31 (*hi) of the 32 bits at p as bytes, 0xFF where set. */
QN_ALWAYS void qn_bits(const uint8_t *p, uint8x16_t *lo, uint8x16_t *hi) {
    static const uint8_t pick[32] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                     2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3};
    static const uint8_t bit[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    uint32_t v;
    memcpy(&v, p, 4);
    uint8x16_t bytes = vreinterpretq_u8_u32(vdupq_n_u32(v)), mask = vld1q_u8(bit);
    *lo = vtstq_u8(vqtbl1q_u8(bytes, vld1q_u8(pick)), mask);
    *hi = vtstq_u8(vqtbl1q_u8(bytes, vld1q_u8(pick + 16)), mask);
}

/* A 32-weight block's quants as signed bytes (offsets taken off, IQ4_NL's values looked
   up; Q4_1's and Q5_1's unsigned): weights 0..15 in q[0], 16..31 in q[1]. */
QN_ALWAYS void qn_unpack32(int type, const uint8_t *blk, int8x16_t *q) {
    if (type == QM_Q8_0) {
        q[0] = vld1q_s8((const int8_t *)blk + 2);
        q[1] = vld1q_s8((const int8_t *)blk + 18);
        return;
    }
    uint8x16_t raw = vld1q_u8(blk + qm_nibbles_at(type)), bits_lo, bits_hi;
    uint8x16_t lo = vandq_u8(raw, vdupq_n_u8(0xF)), hi = vshrq_n_u8(raw, 4);
    if (type == QM_Q4_0) {
        lo = vsubq_u8(lo, vdupq_n_u8(8));
        hi = vsubq_u8(hi, vdupq_n_u8(8));
    } else if (type == QM_Q5_0) {  /* q - 16: the low bits, less 16 where the fifth is clear */
        qn_bits(blk + 2, &bits_lo, &bits_hi);
        lo = vorrq_u8(lo, vbicq_u8(vdupq_n_u8(0xF0), bits_lo));
        hi = vorrq_u8(hi, vbicq_u8(vdupq_n_u8(0xF0), bits_hi));
    } else if (type == QM_Q5_1) {
        qn_bits(blk + 4, &bits_lo, &bits_hi);
        lo = vorrq_u8(lo, vandq_u8(bits_lo, vdupq_n_u8(0x10)));
        hi = vorrq_u8(hi, vandq_u8(bits_hi, vdupq_n_u8(0x10)));
    } else if (type == QM_IQ4_NL) {
        int8x16_t values = vld1q_s8(qm_iq4nl);
        q[0] = vqtbl1q_s8(values, lo);
        q[1] = vqtbl1q_s8(values, hi);
        return;
    }
    q[0] = vreinterpretq_s8_u8(lo);
    q[1] = vreinterpretq_s8_u8(hi);
}

/* One 32-weight block b against R rows, into acc (one vector per row) and mins (Q4_1's and
   Q5_1's m * s). */
QN_ALWAYS void qn_blk32(int type, const uint8_t *blk, const qm_act *a, ptrdiff_t k,
                        ptrdiff_t b, const int R, float32x4_t *acc, float *mins) {
    const ptrdiff_t nb = k / 32;
    int8x16_t q[2];
    qn_unpack32(type, blk, q);
    float dw = QS_HALF(blk);
    QN_UNROLL
    for (int r = 0; r < R; r++) {
        int32x4_t p = qn_dot2(q[0], q[1], a->q32 + r * k + 32 * b);
        acc[r] = vfmaq_n_f32(acc[r], vcvtq_f32_s32(p), dw * a->d32[r * nb + b]);
    }
    if (type == QM_Q4_1 || type == QM_Q5_1) {
        float m = QS_HALF(blk + 2);
        QN_UNROLL
        for (int r = 0; r < R; r++) mins[r] = fmaf(m, a->s32[r * nb + b], mins[r]);
    }
}

/* The 32-weight types against R <= 4 rows: even and odd blocks in two accumulators per row
   (two chains, each half as long). */
QN_ALWAYS void qn_dot32_4(int type, const uint8_t *w, const qm_act *a, ptrdiff_t k, const int R,
                          float *s) {
    const int bb = qm_block_bytes[type];
    const ptrdiff_t nb = k / 32;
    float32x4_t even[QM_IGROUP], odd[QM_IGROUP];
    float mins_even[QM_IGROUP], mins_odd[QM_IGROUP];
    QN_UNROLL
    for (int r = 0; r < R; r++) {
        even[r] = odd[r] = vdupq_n_f32(0.0f);
        mins_even[r] = mins_odd[r] = 0.0f;
    }
    ptrdiff_t b = 0;
    for (; b + 1 < nb; b += 2) {
        qn_blk32(type, w + b * bb, a, k, b, R, even, mins_even);
        qn_blk32(type, w + (b + 1) * bb, a, k, b + 1, R, odd, mins_odd);
    }
    for (; b < nb; b++) qn_blk32(type, w + b * bb, a, k, b, R, even, mins_even);
    QN_UNROLL
    for (int r = 0; r < R; r++)
        s[r] = vaddvq_f32(vaddq_f32(even[r], odd[r])) + (mins_even[r] + mins_odd[r]);
}

/* The 32-weight types against R rows, at most 4 at a time: a row's sums are the same, bit for
   bit, whatever rows share its pass (a verified draft's logits are those of a lone row). */
QN_ALWAYS void qn_dot32(int type, const uint8_t *w, const qm_act *a, ptrdiff_t k, const int R,
                        float *s) {
    if (R <= 4) {
        qn_dot32_4(type, w, a, k, R, s);
        return;
    }
    qm_act rest = qm_act_from(a, k, 4);
    qn_dot32_4(type, w, a, k, 4, s);
    qn_dot32_4(type, w, &rest, k, R - 4, s + 4);
}

/* -- the 256-weight types ------------------------------------------------------------------ */

/* sumi[r] += row r's sums with the weights q, by their scales sc: q holds 4 groups of g
   vectors (g = 1: groups of 16 weights, g = 2: of 32), each with its lane of sc; row r's
   activations from a->qk + r k + at. */
QN_ALWAYS void qn_rows_k(const qm_act *a, ptrdiff_t k, ptrdiff_t at, const int R,
                         const int8x16_t *q, const int g, int32x4_t sc, int32x4_t *sumi) {
    QN_UNROLL
    for (int r = 0; r < R; r++) {
        const int8_t *y = a->qk + r * k + at;
        int32x4_t p[4];
        QN_UNROLL
        for (int i = 0; i < 4; i++)
            p[i] = g == 2 ? qn_dot2(q[2 * i], q[2 * i + 1], y + 32 * i)
                          : vdotq_s32(vdupq_n_s32(0), q[i], vld1q_s8(y + 16 * i));
        int32x4_t groups = vpaddq_s32(vpaddq_s32(p[0], p[1]), vpaddq_s32(p[2], p[3]));
        sumi[r] = vmlaq_s32(sumi[r], groups, sc);
    }
}

/* Row r's mins by its 16-sums of block b: one min per 16 (m16 = 2 vectors) or per 32 (1). */
QN_ALWAYS int qn_mins(const int16_t *bs, const int16x8_t *mins, const int m16) {
    int16x8_t lo = vld1q_s16(bs), hi = vld1q_s16(bs + 8);
    if (m16 == 1) {  /* the pairs of 16-sums under each 32 */
        int16x8_t pairs = vpaddq_s16(lo, hi);
        return vaddvq_s32(vmlal_high_s16(vmull_s16(vget_low_s16(pairs), vget_low_s16(mins[0])),
                                         pairs, mins[0]));
    }
    int32x4_t m = vmull_s16(vget_low_s16(lo), vget_low_s16(mins[0]));
    m = vmlal_high_s16(m, lo, mins[0]);
    m = vmlal_s16(m, vget_low_s16(hi), vget_low_s16(mins[1]));
    return vaddvq_s32(vmlal_high_s16(m, hi, mins[1]));
}

/* R rows' accumulators cleared (fmin's where not NULL). */
QN_ALWAYS void qn_clear(const int R, float32x4_t *acc, int32x4_t *sumi, float *fmin) {
    QN_UNROLL
    for (int r = 0; r < R; r++) {
        acc[r] = vdupq_n_f32(0.0f);
        sumi[r] = vdupq_n_s32(0);
        if (fmin) fmin[r] = 0.0f;
    }
}

/* Block b's end for R rows: acc[r] += dw dy sumi[r] and fmin[r] += mw dy (its mins by the
   16-sums, where m16 is not 0), then sumi cleared. */
QN_ALWAYS void qn_scale_k(const qm_act *a, ptrdiff_t k, ptrdiff_t b, const int R, float dw,
                          float mw, const int16x8_t *mins, const int m16, int32x4_t *sumi,
                          float32x4_t *acc, float *fmin) {
    const ptrdiff_t nb = k / 256;
    QN_UNROLL
    for (int r = 0; r < R; r++) {
        float dy = a->dk[r * (nb + 1) + b];
        acc[r] = vfmaq_n_f32(acc[r], vcvtq_f32_s32(sumi[r]), dw * dy);
        if (m16) fmin[r] += mw * dy * (float)qn_mins(a->bsums + r * (k / 16) + 16 * b, mins, m16);
        sumi[r] = vdupq_n_s32(0);
    }
}

/* Four lanes of int32 from bytes 4i .. 4i + 3 of v (signed). */
QN_ALWAYS void qn_widen_s8(int8x16_t v, int32x4_t *out) {
    int16x8_t lo = vmovl_s8(vget_low_s8(v)), hi = vmovl_high_s8(v);
    out[0] = vmovl_s16(vget_low_s16(lo));
    out[1] = vmovl_high_s16(lo);
    out[2] = vmovl_s16(vget_low_s16(hi));
    out[3] = vmovl_high_s16(hi);
}

/* Q4_K's (and Q5_K's) eight 6-bit scales (bytes 0..7) and mins (8..15) of its 12 packed
   bytes, unpacked with 32-bit operations. */
QN_ALWAYS int8x16_t qn_scales_k4(const uint8_t *packed) {
    uint32_t t[4], out[4];
    memcpy(t, packed, 12);
    const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, low2 = 0x03030303;
    out[0] = t[0] & low6;
    out[1] = (t[2] & low4) | (((t[0] >> 6) & low2) << 4);
    out[2] = t[1] & low6;
    out[3] = ((t[2] >> 4) & low4) | (((t[1] >> 6) & low2) << 4);
    return vreinterpretq_s8_u32(vld1q_u32(out));
}

/* Q4_K (five = 0) or Q5_K against R rows: per 128 weights four sub-blocks' quants unpacked
   once, then every row's sums by their four scales; per block the mins by the pairs of
   16-sums. */
QN_ALWAYS void qn_dot_k45(const uint8_t *w, const qm_act *a, ptrdiff_t k, const int R,
                          float *s, const int five) {
    const int bb = five ? 176 : 144;
    const uint8x16_t low4 = vdupq_n_u8(0xF), one = vdupq_n_u8(1), two = vdupq_n_u8(2);
    float32x4_t acc[QM_IGROUP];
    int32x4_t sumi[QM_IGROUP];
    float fmin[QM_IGROUP];
    qn_clear(R, acc, sumi, fmin);
    for (ptrdiff_t b = 0; b < k / 256; b++) {
        const uint8_t *blk = w + b * bb, *qs = blk + (five ? 48 : 16);
        int8x16_t sm = qn_scales_k4(blk + 4);
        int32x4_t sc[4];
        qn_widen_s8(sm, sc);  /* scales (at most 63) in sc[0], sc[1] */
        int16x8_t mins = vmovl_high_s8(sm);
        uint8x16_t h[2] = {vld1q_u8(blk + 16), vld1q_u8(blk + 32)};
        for (int c = 0; c < 2; c++) {
            int8x16_t q[8];
            QN_UNROLL
            for (int p = 0; p < 2; p++) {  /* sub-blocks 4c + 2p (low nibbles), 4c + 2p + 1 */
                QN_UNROLL
                for (int i = 0; i < 2; i++) {
                    uint8x16_t raw = vld1q_u8(qs + 64 * c + 32 * p + 16 * i);
                    uint8x16_t lo = vandq_u8(raw, low4), hi = vshrq_n_u8(raw, 4);
                    if (five) {
                        lo = vorrq_u8(lo, vshlq_n_u8(vandq_u8(h[i], one), 4));
                        hi = vorrq_u8(hi, vshlq_n_u8(vandq_u8(h[i], two), 3));
                        h[i] = vshrq_n_u8(h[i], 2);
                    }
                    q[4 * p + i] = vreinterpretq_s8_u8(lo);
                    q[4 * p + 2 + i] = vreinterpretq_s8_u8(hi);
                }
            }
            qn_rows_k(a, k, 256 * b + 128 * c, R, q, 2, sc[c], sumi);
        }
        qn_scale_k(a, k, b, R, QS_HALF(blk), QS_HALF(blk + 2), &mins, 1, sumi, acc, fmin);
    }
    QN_UNROLL
    for (int r = 0; r < R; r++) s[r] = vaddvq_f32(acc[r]) - fmin[r];
}

/* Q6_K against R rows: per 64 weights their six-bit quants less 32 unpacked once, then every
   row's sums by their four int8 scales. */
QN_ALWAYS void qn_dot_q6_k(const uint8_t *w, const qm_act *a, ptrdiff_t k, const int R,
                           float *s) {
    const uint8x16_t low4 = vdupq_n_u8(0xF), low2 = vdupq_n_u8(3);
    float32x4_t acc[QM_IGROUP];
    int32x4_t sumi[QM_IGROUP];
    qn_clear(R, acc, sumi, NULL);
    for (ptrdiff_t b = 0; b < k / 256; b++) {
        const uint8_t *blk = w + b * 210;
        int32x4_t sc[4];
        qn_widen_s8(vld1q_s8((const int8_t *)blk + 192), sc);
        for (int half = 0; half < 2; half++) {
            const uint8_t *ql = blk + 64 * half, *qh = blk + 128 + 32 * half;
            QN_UNROLL
            for (int gp = 0; gp < 2; gp++) {  /* weights 64 gp ..: g = 2 gp, 2 gp + 1 */
                int8x16_t q[4];
                QN_UNROLL
                for (int i = 0; i < 4; i++) {  /* 16 weights: g = 2 gp + i / 2, l from 16 (i % 2) */
                    int g = 2 * gp + i / 2;
                    uint8x16_t l = vld1q_u8(ql + 32 * (g % 2) + 16 * (i % 2));
                    uint8x16_t lo = g < 2 ? vandq_u8(l, low4) : vshrq_n_u8(l, 4);
                    uint8x16_t hb = vandq_u8(qn_shr(vld1q_u8(qh + 16 * (i % 2)), 2 * g), low2);
                    q[i] = vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(lo, vshlq_n_u8(hb, 4))),
                                    vdupq_n_s8(32));
                }
                qn_rows_k(a, k, 256 * b + 128 * half + 64 * gp, R, q, 1, sc[2 * half + gp], sumi);
            }
        }
        qn_scale_k(a, k, b, R, QS_HALF(blk + 208), 0.0f, NULL, 0, sumi, acc, NULL);
    }
    QN_UNROLL
    for (int r = 0; r < R; r++) s[r] = vaddvq_f32(acc[r]);
}

/* Q2_K against R rows: per 64 weights their two-bit quants unpacked once, then every row's
   sums by their four 4-bit scales; per block the mins (one per 16) by the 16-sums. */
QN_ALWAYS void qn_dot_q2_k(const uint8_t *w, const qm_act *a, ptrdiff_t k, const int R,
                           float *s) {
    const uint8x16_t low2 = vdupq_n_u8(3);
    float32x4_t acc[QM_IGROUP];
    int32x4_t sumi[QM_IGROUP];
    float fmin[QM_IGROUP];
    qn_clear(R, acc, sumi, fmin);
    for (ptrdiff_t b = 0; b < k / 256; b++) {
        const uint8_t *blk = w + b * 84;
        uint8x16_t packed = vld1q_u8(blk);
        int32x4_t sc[4];
        qn_widen_s8(vreinterpretq_s8_u8(vandq_u8(packed, vdupq_n_u8(0xF))), sc);
        uint8x16_t m = vshrq_n_u8(packed, 4);
        int16x8_t mins[2] = {vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(m))),
                             vreinterpretq_s16_u16(vmovl_high_u8(m))};
        for (int n = 0; n < 2; n++) {
            uint8x16_t raw[2] = {vld1q_u8(blk + 16 + 32 * n), vld1q_u8(blk + 32 + 32 * n)};
            QN_UNROLL
            for (int jp = 0; jp < 2; jp++) {  /* weights 128 n + 64 jp ..: j = 2 jp, 2 jp + 1 */
                int8x16_t q[4];
                QN_UNROLL
                for (int i = 0; i < 4; i++)
                    q[i] = vreinterpretq_s8_u8(
                        vandq_u8(qn_shr(raw[i % 2], 2 * (2 * jp + i / 2)), low2));
                qn_rows_k(a, k, 256 * b + 128 * n + 64 * jp, R, q, 1, sc[2 * n + jp], sumi);
            }
        }
        qn_scale_k(a, k, b, R, QS_HALF(blk + 80), QS_HALF(blk + 82), mins, 2, sumi, acc, fmin);
    }
    QN_UNROLL
    for (int r = 0; r < R; r++) s[r] = vaddvq_f32(acc[r]) - fmin[r];
}

/* Q3_K's sixteen 6-bit scales less 32 of its 12 packed bytes, with 32-bit operations. */
QN_ALWAYS int8x16_t qn_scales_q3_k(const uint8_t *packed) {
    uint32_t t[3], out[4];
    memcpy(t, packed, 12);
    const uint32_t low4 = 0x0f0f0f0f, low2 = 0x03030303;
    out[0] = (t[0] & low4) | ((t[2] & low2) << 4);
    out[1] = (t[1] & low4) | (((t[2] >> 2) & low2) << 4);
    out[2] = ((t[0] >> 4) & low4) | (((t[2] >> 4) & low2) << 4);
    out[3] = ((t[1] >> 4) & low4) | (((t[2] >> 6) & low2) << 4);
    return vsubq_s8(vreinterpretq_s8_u32(vld1q_u32(out)), vdupq_n_s8(32));
}

/* Q3_K against R rows: per 64 weights their quants (two low bits, less 4 where the high
   bit is clear) unpacked once, then every row's sums by their four scales. */
QN_ALWAYS void qn_dot_q3_k(const uint8_t *w, const qm_act *a, ptrdiff_t k, const int R,
                           float *s) {
    const uint8x16_t low2 = vdupq_n_u8(3), four = vdupq_n_u8(4);
    float32x4_t acc[QM_IGROUP];
    int32x4_t sumi[QM_IGROUP];
    qn_clear(R, acc, sumi, NULL);
    for (ptrdiff_t b = 0; b < k / 256; b++) {
        const uint8_t *blk = w + b * 110;
        int32x4_t sc[4];
        qn_widen_s8(qn_scales_q3_k(blk + 96), sc);
        uint8x16_t hm[2] = {vld1q_u8(blk), vld1q_u8(blk + 16)};
        for (int n = 0; n < 2; n++) {
            uint8x16_t raw[2] = {vld1q_u8(blk + 32 + 32 * n), vld1q_u8(blk + 48 + 32 * n)};
            QN_UNROLL
            for (int jp = 0; jp < 2; jp++) {
                int8x16_t q[4];
                QN_UNROLL
                for (int i = 0; i < 4; i++) {
                    int j = 2 * jp + i / 2;
                    uint8x16_t set = vtstq_u8(hm[i % 2], vdupq_n_u8((uint8_t)(1 << (4 * n + j))));
                    uint8x16_t v = vandq_u8(qn_shr(raw[i % 2], 2 * j), low2);
                    q[i] = vreinterpretq_s8_u8(vsubq_u8(v, vbicq_u8(four, set)));
                }
                qn_rows_k(a, k, 256 * b + 128 * n + 64 * jp, R, q, 1, sc[2 * n + jp], sumi);
            }
        }
        qn_scale_k(a, k, b, R, QS_HALF(blk + 108), 0.0f, NULL, 0, sumi, acc, NULL);
    }
    QN_UNROLL
    for (int r = 0; r < R; r++) s[r] = vaddvq_f32(acc[r]);
}

/* IQ4_XS against R rows: per 128 weights four sub-blocks' values looked up once, then every
   row's sums by their four scales. */
QN_ALWAYS void qn_dot_iq4_xs(const uint8_t *w, const qm_act *a, ptrdiff_t k, const int R,
                             float *s) {
    const int8x16_t values = vld1q_s8(qm_iq4nl);
    const uint8x16_t low4 = vdupq_n_u8(0xF);
    float32x4_t acc[QM_IGROUP];
    int32x4_t sumi[QM_IGROUP];
    qn_clear(R, acc, sumi, NULL);
    for (ptrdiff_t b = 0; b < k / 256; b++) {
        const uint8_t *blk = w + b * 136;
        int32_t scales[8];
        QN_UNROLL
        for (int ib = 0; ib < 8; ib++) scales[ib] = qm_scale_iq4_xs(blk, ib);
        for (int c = 0; c < 2; c++) {
            int8x16_t q[8];
            QN_UNROLL
            for (int i = 0; i < 4; i++) {
                uint8x16_t raw = vld1q_u8(blk + 8 + 64 * c + 16 * i);
                q[2 * i] = vqtbl1q_s8(values, vandq_u8(raw, low4));
                q[2 * i + 1] = vqtbl1q_s8(values, vshrq_n_u8(raw, 4));
            }
            qn_rows_k(a, k, 256 * b + 128 * c, R, q, 2, vld1q_s32(scales + 4 * c), sumi);
        }
        qn_scale_k(a, k, b, R, QS_HALF(blk), 0.0f, NULL, 0, sumi, acc, NULL);
    }
    QN_UNROLL
    for (int r = 0; r < R; r++) s[r] = vaddvq_f32(acc[r]);
}

#define QN_BY_ROWS(name, CALL) QM_BY_ROWS(QN_ATTR, name, CALL)
#define QN_Q8_0(R_) qn_dot32(QM_Q8_0, w, a, k, R_, s)
#define QN_Q4_0(R_) qn_dot32(QM_Q4_0, w, a, k, R_, s)
#define QN_Q4_1(R_) qn_dot32(QM_Q4_1, w, a, k, R_, s)
#define QN_Q5_0(R_) qn_dot32(QM_Q5_0, w, a, k, R_, s)
#define QN_Q5_1(R_) qn_dot32(QM_Q5_1, w, a, k, R_, s)
#define QN_IQ4_NL(R_) qn_dot32(QM_IQ4_NL, w, a, k, R_, s)
#define QN_Q2_K(R_) qn_dot_q2_k(w, a, k, R_, s)
#define QN_Q3_K(R_) qn_dot_q3_k(w, a, k, R_, s)
#define QN_Q4_K(R_) qn_dot_k45(w, a, k, R_, s, 0)
#define QN_Q5_K(R_) qn_dot_k45(w, a, k, R_, s, 1)
#define QN_Q6_K(R_) qn_dot_q6_k(w, a, k, R_, s)
#define QN_IQ4_XS(R_) qn_dot_iq4_xs(w, a, k, R_, s)
QN_BY_ROWS(qn_q8_0, QN_Q8_0)
QN_BY_ROWS(qn_q4_0, QN_Q4_0)
QN_BY_ROWS(qn_q4_1, QN_Q4_1)
QN_BY_ROWS(qn_q5_0, QN_Q5_0)
QN_BY_ROWS(qn_q5_1, QN_Q5_1)
QN_BY_ROWS(qn_iq4_nl, QN_IQ4_NL)
QN_BY_ROWS(qn_q2_k, QN_Q2_K)
QN_BY_ROWS(qn_q3_k, QN_Q3_K)
QN_BY_ROWS(qn_q4_k, QN_Q4_K)
QN_BY_ROWS(qn_q5_k, QN_Q5_K)
QN_BY_ROWS(qn_q6_k, QN_Q6_K)
QN_BY_ROWS(qn_iq4_xs, QN_IQ4_XS)

/* The NEON integer kernels by type (F16 and BF16 have none: they multiply in float32). */
static const qm_idot_fn qm_itable_neon[QM_TYPES] = {
    qn_q8_0, qn_q4_0, qn_q4_1, qn_q4_k, qn_q6_k, NULL, NULL, qn_q5_0, qn_q5_1, qn_q2_k,
    qn_q3_k, qn_q5_k, qn_iq4_nl, qn_iq4_xs};
/* The integer variant of this path (a list, as quant_q8_avx2.h's). */
static const qm_ivariant qm_ivariants[] = {{"neon-dotprod", qm_itable_neon, NULL, qn_dotprod}};
#define QM_IVARIANTS 1
