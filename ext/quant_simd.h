/* The vector path of ext/quant.h, written once in GCC vector extensions and included once per
 * instruction set with QS_ATTR (the target attribute), QS(name) (the suffixed name) and
 * QS_HALF(p) (an f16 at p as float), QS_WIDEN_U(v) and QS_WIDEN_S(v, off) (the eight bytes
 * of a 64-bit word as eight floats, unsigned, or signed less off) defined: AVX2+FMA+F16C
 * on x86-64, NEON on aarch64.
 *
 * Eight weights at a time are widened from their bytes to eight float32 lanes
 * (vpmovzxbd + vcvtdq2ps on AVX2, uxtl/sxtl twice + ucvtf/scvtf on NEON) and
 * multiplied into per-block partial sums; a block's partial sum is scaled once into the row's
 * accumulator. Up to QM_GROUP activation rows share each widened weight. Each row's sums are
 * formed in the same order whatever R is, so a row's result does not depend on its batch.
 */

QS_ATTR static inline qs_f8 QS(qs_x)(const float *p) { qs_f8 v; memcpy(&v, p, 32); return v; }
/* Nibbles and bit fields are cut from eight bytes held as one 64-bit word (x86 has no
   byte-wise vector shift: GCC would shift each byte on its own), then widened to floats. */
#define QS_NIB 0x0F0F0F0F0F0F0F0FULL
#define QS_BYTES(m) (0x0101010101010101ULL * (m))
QS_ATTR static inline uint64_t QS(qs_word)(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}
/* Eight bytes (a 64-bit word) as eight floats: unsigned, or signed less `off`. */
QS_ATTR static inline qs_f8 QS(qs_u)(uint64_t v) { return QS_WIDEN_U(v); }
QS_ATTR static inline qs_f8 QS(qs_s)(uint64_t v, int off) { return QS_WIDEN_S(v, off); }

QS_ATTR static inline float QS(qs_lanes)(qs_f8 v) {
    float s = 0.0f;
    for (int l = 0; l < 8; l++) s += v[l];
    return s;
}

/* Four vectors of widened weights against 32 activations from xr: the block's partial sum. */
QS_ATTR static inline qs_f8 QS(qs_dot32)(const qs_f8 *f, const float *xr) {
    return (f[0] * QS(qs_x)(xr) + f[1] * QS(qs_x)(xr + 8))
         + (f[2] * QS(qs_x)(xr + 16) + f[3] * QS(qs_x)(xr + 24));
}

#define QS_ALWAYS QS_ATTR static inline __attribute__((always_inline))

/* Q8_0 {f16 d; int8 qs[32]} and Q4_0 {f16 d; uint8 qs[16]}: sum_b d_b * (q . x). */
QS_ALWAYS void QS(qs_q8_0)(const uint8_t *w, const float *x, ptrdiff_t k, float *s, int R) {
    qs_f8 acc[QM_GROUP] = {{0}};
    for (ptrdiff_t b = 0; b < k / 32; b++) {
        const uint8_t *blk = w + b * 34;
        qs_f8 f[4], d = (qs_f8){0} + QS_HALF(blk);
        for (int t = 0; t < 4; t++) f[t] = QS(qs_s)(QS(qs_word)(blk + 2 + 8 * t), 0);
        for (int r = 0; r < R; r++) acc[r] += d * QS(qs_dot32)(f, x + r * k + b * 32);
    }
    for (int r = 0; r < R; r++) s[r] = QS(qs_lanes)(acc[r]);
}

QS_ALWAYS void QS(qs_q4_0)(const uint8_t *w, const float *x, ptrdiff_t k, float *s, int R) {
    qs_f8 acc[QM_GROUP] = {{0}};
    for (ptrdiff_t b = 0; b < k / 32; b++) {
        const uint8_t *blk = w + b * 18;
        uint64_t lo = QS(qs_word)(blk + 2), hi = QS(qs_word)(blk + 10);
        qs_f8 f[4], d = (qs_f8){0} + QS_HALF(blk);
        f[0] = QS(qs_s)(lo & QS_NIB, 8); f[1] = QS(qs_s)(hi & QS_NIB, 8);
        f[2] = QS(qs_s)((lo >> 4) & QS_NIB, 8); f[3] = QS(qs_s)((hi >> 4) & QS_NIB, 8);
        for (int r = 0; r < R; r++) acc[r] += d * QS(qs_dot32)(f, x + r * k + b * 32);
    }
    for (int r = 0; r < R; r++) s[r] = QS(qs_lanes)(acc[r]);
}

/* Q4_1 {f16 d, m; uint8 qs[16]}: sum_b d_b * (q . x) + m_b * sum(x under b). */
QS_ALWAYS void QS(qs_q4_1)(const uint8_t *w, const float *x, const float *xs, ptrdiff_t k,
                           float *s, int R) {
    qs_f8 acc[QM_GROUP] = {{0}};
    float mins[QM_GROUP] = {0};
    ptrdiff_t nb = k / 32;
    for (ptrdiff_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * 20;
        uint64_t lo = QS(qs_word)(blk + 4), hi = QS(qs_word)(blk + 12);
        qs_f8 f[4], d = (qs_f8){0} + QS_HALF(blk);
        float m = QS_HALF(blk + 2);
        f[0] = QS(qs_u)(lo & QS_NIB); f[1] = QS(qs_u)(hi & QS_NIB);
        f[2] = QS(qs_u)((lo >> 4) & QS_NIB); f[3] = QS(qs_u)((hi >> 4) & QS_NIB);
        for (int r = 0; r < R; r++) {
            acc[r] += d * QS(qs_dot32)(f, x + r * k + b * 32);
            mins[r] += m * xs[r * nb + b];
        }
    }
    for (int r = 0; r < R; r++) s[r] = QS(qs_lanes)(acc[r]) + mins[r];
}

/* Q4_K {f16 d, dmin; uint8 scales[12]; uint8 qs[128]}: per 32 bytes of qs, the low nibbles
   are sub-block 2c and the high ones 2c + 1; w = d sc q - dmin m. */
QS_ALWAYS void QS(qs_q4_k)(const uint8_t *w, const float *x, const float *xs, ptrdiff_t k,
                           float *s, int R) {
    qs_f8 acc[QM_GROUP] = {{0}};
    float mins[QM_GROUP] = {0};
    ptrdiff_t nb = k / 32;
    for (ptrdiff_t b = 0; b < k / 256; b++) {
        const uint8_t *blk = w + b * 144;
        float d = QS_HALF(blk), dmin = QS_HALF(blk + 2);
        for (int c = 0; c < 4; c++) {
            int sc0, m0, sc1, m1;
            qm_scale_min_k4(2 * c, blk + 4, &sc0, &m0);
            qm_scale_min_k4(2 * c + 1, blk + 4, &sc1, &m1);
            qs_f8 lo[4], hi[4], d0 = (qs_f8){0} + d * sc0, d1 = (qs_f8){0} + d * sc1;
            for (int t = 0; t < 4; t++) {
                uint64_t q = QS(qs_word)(blk + 16 + 32 * c + 8 * t);
                lo[t] = QS(qs_u)(q & QS_NIB);
                hi[t] = QS(qs_u)((q >> 4) & QS_NIB);
            }
            float dm0 = dmin * m0, dm1 = dmin * m1;
            for (int r = 0; r < R; r++) {
                const float *xr = x + r * k + b * 256 + 64 * c;
                acc[r] += d0 * QS(qs_dot32)(lo, xr);
                acc[r] += d1 * QS(qs_dot32)(hi, xr + 32);
                const float *sr = xs + r * nb + b * 8 + 2 * c;
                mins[r] -= dm0 * sr[0] + dm1 * sr[1];
            }
        }
    }
    for (int r = 0; r < R; r++) s[r] = QS(qs_lanes)(acc[r]) + mins[r];
}

/* Q6_K {uint8 ql[128], qh[64]; int8 scales[16]; f16 d}: per half of 128 weights and l < 32,
   weights l, l + 32, l + 64, l + 96 take ql[l] low, ql[l + 32] low, ql[l] high, ql[l + 32]
   high for their four low bits and successive bit pairs of qh[l] for the top two; one
   scale per 16 weights. */
QS_ALWAYS void QS(qs_q6_k)(const uint8_t *w, const float *x, ptrdiff_t k, float *s, int R) {
    qs_f8 acc[QM_GROUP] = {{0}};
    for (ptrdiff_t b = 0; b < k / 256; b++) {
        const uint8_t *blk = w + b * 210;
        float d = QS_HALF(blk + 208);
        for (int half = 0; half < 2; half++) {
            const uint8_t *ql = blk + 64 * half, *qh = blk + 128 + 32 * half;
            const int8_t *sc = (const int8_t *)(blk + 192) + 8 * half;
            for (int l = 0; l < 32; l += 16) {
                qs_f8 f[4][2];  /* [quarter][eight of sixteen] */
                for (int e = 0; e < 2; e++) {
                    uint64_t a = QS(qs_word)(ql + l + 8 * e);
                    uint64_t c = QS(qs_word)(ql + l + 32 + 8 * e);
                    uint64_t h = QS(qs_word)(qh + l + 8 * e), top = QS_BYTES(0x30);
                    f[0][e] = QS(qs_s)((a & QS_NIB) | ((h << 4) & top), 32);
                    f[1][e] = QS(qs_s)((c & QS_NIB) | ((h << 2) & top), 32);
                    f[2][e] = QS(qs_s)(((a >> 4) & QS_NIB) | (h & top), 32);
                    f[3][e] = QS(qs_s)(((c >> 4) & QS_NIB) | ((h >> 2) & top), 32);
                }
                for (int r = 0; r < R; r++) {
                    const float *xr = x + r * k + b * 256 + 128 * half + l;
                    for (int q = 0; q < 4; q++) {
                        qs_f8 ds = (qs_f8){0} + d * sc[l / 16 + 2 * q];
                        acc[r] += ds * (f[q][0] * QS(qs_x)(xr + 32 * q)
                                        + f[q][1] * QS(qs_x)(xr + 32 * q + 8));
                    }
                }
            }
        }
    }
    for (int r = 0; r < R; r++) s[r] = QS(qs_lanes)(acc[r]);
}

/* The kernels for R = 1 .. QM_GROUP rows (R a constant once inlined). */
#define QS_FN(T, R, call)                                                                   \
    QS_ATTR static void QS(qs_##T##_##R)(const uint8_t *w, const float *x, const float *xs, \
                                          ptrdiff_t k, float *s) {                         \
        (void)xs;                                                                          \
        call;                                                                              \
    }
#define QS_TYPE(T, call_R)                                                                  \
    QS_FN(T, 1, call_R(1)) QS_FN(T, 2, call_R(2)) QS_FN(T, 3, call_R(3)) QS_FN(T, 4, call_R(4))
#define QS_CALL_Q8_0(R) QS(qs_q8_0)(w, x, k, s, R)
#define QS_CALL_Q4_0(R) QS(qs_q4_0)(w, x, k, s, R)
#define QS_CALL_Q4_1(R) QS(qs_q4_1)(w, x, xs, k, s, R)
#define QS_CALL_Q4_K(R) QS(qs_q4_k)(w, x, xs, k, s, R)
#define QS_CALL_Q6_K(R) QS(qs_q6_k)(w, x, k, s, R)
QS_TYPE(q8_0, QS_CALL_Q8_0)
QS_TYPE(q4_0, QS_CALL_Q4_0)
QS_TYPE(q4_1, QS_CALL_Q4_1)
QS_TYPE(q4_k, QS_CALL_Q4_K)
QS_TYPE(q6_k, QS_CALL_Q6_K)

#define QS_ROW(T) {NULL, QS(qs_##T##_1), QS(qs_##T##_2), QS(qs_##T##_3), QS(qs_##T##_4)}
static const qm_dot_fn QS(qs_table)[QM_TYPES][QM_GROUP + 1] = {
    QS_ROW(q8_0), QS_ROW(q4_0), QS_ROW(q4_1), QS_ROW(q4_k), QS_ROW(q6_k)};
