/* The vector path of ext/quant.h, written once in GCC vector extensions and included once per
 * instruction set with QS_ATTR (the target attribute), QS(name) (the suffixed name) and
 * QS_HALF(p) (an f16 at p as float), QS_BYTES_U(p) and QS_BYTES_S(p) (the eight bytes at p
 * as eight int32 lanes, unsigned or signed) and QS_FLOAT(v) (int32 lanes to float) defined:
 * QS_HALF2(p) (the two f16 at p as the first two lanes of four): AVX2+FMA+F16C on x86-64,
 * NEON on aarch64.
 *
 * Eight weights at a time are widened from their bytes to eight float32 lanes
 * (vpmovzxbd + vcvtdq2ps on AVX2, uxtl/sxtl twice + scvtf on NEON) and
 * multiplied into per-block partial sums; a block's partial sum is scaled once into the row's
 * accumulator. Up to QM_GROUP activation rows share each widened weight. Each row's sums are
 * formed in the same order whatever R is, so a row's result does not depend on its batch.
 */

QS_ATTR static inline qs_f8 QS(qs_x)(const float *p) { qs_f8 v; memcpy(&v, p, 32); return v; }
/* Eight bytes at p widened to eight int32 lanes first (one vpmovzxbd from memory on AVX2:
   one shuffle for sixteen nibbles), then cut into nibbles and bit fields with 32-bit lane
   operations, then converted to float. */
QS_ATTR static inline qs_i32 QS(qs_bu)(const uint8_t *p) { return QS_BYTES_U(p); }
QS_ATTR static inline qs_i32 QS(qs_bs)(const uint8_t *p) { return QS_BYTES_S(p); }
QS_ATTR static inline qs_f8 QS(qs_f)(qs_i32 v) { return QS_FLOAT(v); }

QS_ATTR static inline qs_f8 QS(qs_splat)(float v) { return (qs_f8){v, v, v, v, v, v, v, v}; }

/* The eight lanes summed as a tree: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)). */
QS_ATTR static inline float QS(qs_lanes)(qs_f8 v) {
    return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}

/* Four vectors of widened weights against 32 activations from xr: the block's partial sum. */
QS_ATTR static inline qs_f8 QS(qs_dot32)(const qs_f8 *f, const float *xr) {
    return (f[0] * QS(qs_x)(xr) + f[1] * QS(qs_x)(xr + 8))
         + (f[2] * QS(qs_x)(xr + 16) + f[3] * QS(qs_x)(xr + 24));
}

/* Four vectors of widened weights against 32 activations from xr as one chain of products
   (four operations where qs_dot32's tree takes five). */
QS_ATTR static inline qs_f8 QS(qs_chain32)(const qs_f8 *f, const float *xr) {
    qs_f8 p = f[0] * QS(qs_x)(xr);
    p += f[1] * QS(qs_x)(xr + 8);
    p += f[2] * QS(qs_x)(xr + 16);
    return p + f[3] * QS(qs_x)(xr + 24);
}

/* v kept in memory, its lanes to be read back as splats: the empty asm keeps the store (GCC
   otherwise splats each lane from the register with two shuffles, where a broadcast load
   costs none). */
#define QS_IN_MEMORY(v) __asm__ volatile("" : "+m"(v))

#define QS_ALWAYS QS_ATTR static inline __attribute__((always_inline))
/* Loops over the R <= QM_GROUP rows unrolled whole, so each row's accumulators stay in
   registers (GCC otherwise keeps an array of them in memory: a store and a load a block). */
#define QS_UNROLL _Pragma("GCC unroll 4")

/* Each loop over a row's weights prefetches QS_AHEAD bytes past those in hand: without it,
   rows wider than about 4096 weights streamed from memory at half the speed of narrower ones
   (AVX512 EPYC, one thread, bin/bench-quant --dots f32 --rows 1: Q6_K 1536 x 8960 6.8 GB/s,
   8960 x 1536 13.1; Q8_0 9.9 and 26): the CPU's own prefetch did not keep ahead of that
   stream. With it both run as the narrow rows do (Q6_K: 840 bytes ahead recovered part of
   it, 3.4 and 6.7 KB all).
   Past the matrix's end a prefetch is harmless (it does not fault); NEON runs the same code,
   not measured there. */
#define QS_AHEAD 4096
QS_ALWAYS void QS(qs_ahead)(const uint8_t *at, int bytes) {
    for (int i = 0; i < bytes; i += 64) __builtin_prefetch(at + QS_AHEAD + i);
}

/* The 32-weight types (Q8_0, Q4_0, Q4_1) add even blocks into one accumulator per row and odd
   blocks into another, summed at the end: two chains of additions, each half as long, so a
   short row (k of a few hundred) is not bound by one chain's latency. */
QS_ALWAYS void QS(qs_blk_q8_0)(const uint8_t *blk, const float *x, ptrdiff_t k, qs_f8 *acc,
                               int R) {
    qs_f8 f[4], d = QS(qs_splat)(QS_HALF(blk));
    for (int t = 0; t < 4; t++) f[t] = QS(qs_f)(QS(qs_bs)(blk + 2 + 8 * t));
    QS_UNROLL
    for (int r = 0; r < R; r++) acc[r] += d * QS(qs_chain32)(f, x + r * k);
}

QS_ALWAYS void QS(qs_blk_q4_0)(const uint8_t *blk, const float *x, ptrdiff_t k, qs_f8 *acc,
                               int R) {
    qs_i32 a = QS(qs_bu)(blk + 2), c = QS(qs_bu)(blk + 10);
    qs_f8 f[4], d = QS(qs_splat)(QS_HALF(blk));
    f[0] = QS(qs_f)((a & 15) - 8); f[1] = QS(qs_f)((c & 15) - 8);
    f[2] = QS(qs_f)((a >> 4) - 8); f[3] = QS(qs_f)((c >> 4) - 8);
    QS_UNROLL
    for (int r = 0; r < R; r++) acc[r] += d * QS(qs_dot32)(f, x + r * k);
}

/* Q4_1's minimum: m * the sum of x under the block (xs, one per row, nb apart), in lane 1
   of mins (the block's d and m converted together are lanes 0 and 1 of one vector, which
   multiplies the sum whole: lane 0 is ignored). */
QS_ALWAYS void QS(qs_blk_q4_1)(const uint8_t *blk, const float *x, const float *xs,
                               ptrdiff_t k, ptrdiff_t nb, qs_f8 *acc, qs_f4 *mins, int R) {
    qs_i32 a = QS(qs_bu)(blk + 4), c = QS(qs_bu)(blk + 12);
    qs_f4 dm = QS_HALF2(blk);
    qs_f8 f[4], d = QS(qs_splat)(dm[0]);
    f[0] = QS(qs_f)(a & 15); f[1] = QS(qs_f)(c & 15);
    f[2] = QS(qs_f)(a >> 4); f[3] = QS(qs_f)(c >> 4);
    QS_UNROLL
    for (int r = 0; r < R; r++) {
        acc[r] += d * QS(qs_dot32)(f, x + r * k);
        float sum = xs[r * nb];
        mins[r] += dm * (qs_f4){sum, sum, sum, sum};
    }
}

/* A Q5_0 or Q5_1 block's 32 five-bit quants (less `offset`) as four vectors: assembled as 32
   bytes in two byte vectors (nibbles from the 16 bytes at qs; each of qh's four bytes spread
   over eight lanes by one byte shuffle, masked to its lane's bit and compared, giving 16 where
   the fifth bit is set, or for offset 16 taking 16 off where it is clear), then widened to
   floats from the registers. */
QS_ALWAYS void QS(qs_five)(const uint8_t *qh_at, const uint8_t *qs, int offset, qs_f8 *f) {
    const qs_u8x16 spread_lo = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1};
    const qs_u8x16 spread_hi = {2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3};
    const qs_u8x16 bit = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    qs_u8x16 qh = {0}, q;
    memcpy(&qh, qh_at, 4);
    memcpy(&q, qs, 16);
    qs_u8x16 lo = (qs_u8x16)((__builtin_shuffle(qh, spread_lo) & bit) == bit);
    qs_u8x16 hi = (qs_u8x16)((__builtin_shuffle(qh, spread_hi) & bit) == bit);
    qs_i8x16 first, second;
    if (offset == 16) {  /* q - 16: the low bits less 16 where the fifth bit is clear */
        first = (qs_i8x16)((q & 15) - (~lo & 16));
        second = (qs_i8x16)((q >> 4) - (~hi & 16));
    } else {
        first = (qs_i8x16)((q & 15) | (lo & 16)) - (int8_t)offset;
        second = (qs_i8x16)((q >> 4) | (hi & 16)) - (int8_t)offset;
    }
    QS_WIDEN16(first, f);
    QS_WIDEN16(second, f + 2);
}

QS_ALWAYS void QS(qs_blk_q5_0)(const uint8_t *blk, const float *x, ptrdiff_t k, qs_f8 *acc,
                               int R) {
    qs_f8 f[4], d = QS(qs_splat)(QS_HALF(blk));
    QS(qs_five)(blk + 2, blk + 6, 16, f);
    QS_UNROLL
    for (int r = 0; r < R; r++) acc[r] += d * QS(qs_chain32)(f, x + r * k);
}

QS_ALWAYS void QS(qs_blk_q5_1)(const uint8_t *blk, const float *x, const float *xs,
                               ptrdiff_t k, ptrdiff_t nb, qs_f8 *acc, qs_f4 *mins, int R) {
    qs_f4 dm = QS_HALF2(blk);
    qs_f8 f[4], d = QS(qs_splat)(dm[0]);
    QS(qs_five)(blk + 4, blk + 8, 0, f);
    QS_UNROLL
    for (int r = 0; r < R; r++) {
        acc[r] += d * QS(qs_dot32)(f, x + r * k);
        float sum = xs[r * nb];
        mins[r] += dm * (qs_f4){sum, sum, sum, sum};
    }
}

/* IQ4_NL's and IQ4_XS's 16 bytes of nibbles at qs looked up in qm_iq4nl (one byte shuffle
   each: pshufb, tbl), widened from the registers into four vectors. */
QS_ALWAYS void QS(qs_iq4)(const uint8_t *qs, qs_f8 *f) {
    const qs_i8x16 table = {-127, -104, -83, -65, -49, -35, -22, -10,
                            1, 13, 25, 38, 53, 69, 89, 113};
    qs_u8x16 q;
    memcpy(&q, qs, 16);
    qs_i8x16 lo = __builtin_shuffle(table, (qs_i8x16)(q & 15));
    qs_i8x16 hi = __builtin_shuffle(table, (qs_i8x16)(q >> 4));
    QS_WIDEN16(lo, f);
    QS_WIDEN16(hi, f + 2);
}

QS_ALWAYS void QS(qs_blk_iq4_nl)(const uint8_t *blk, const float *x, ptrdiff_t k, qs_f8 *acc,
                                 int R) {
    qs_f8 f[4], d = QS(qs_splat)(QS_HALF(blk));
    QS(qs_iq4)(blk + 2, f);
    QS_UNROLL
    for (int r = 0; r < R; r++) acc[r] += d * QS(qs_dot32)(f, x + r * k);
}

/* Q8_0 {f16 d; int8 qs[32]} and Q4_0 {f16 d; uint8 qs[16]}: sum_b d_b * (q . x). */
#define QS_TWO_CHAINS(T, BB)                                                                  \
QS_ALWAYS void QS(qs_##T)(const uint8_t *w, const float *x, ptrdiff_t k, float *s, int R) {  \
    qs_f8 even[QM_GROUP] = {{0}}, odd[QM_GROUP] = {{0}};                                      \
    ptrdiff_t nb = k / 32, b = 0;                                                             \
    for (; b + 2 <= nb; b += 2) {                                                             \
        QS(qs_ahead)(w + b * BB, 2 * BB);                                                     \
        QS(qs_blk_##T)(w + b * BB, x + b * 32, k, even, R);                                   \
        QS(qs_blk_##T)(w + (b + 1) * BB, x + (b + 1) * 32, k, odd, R);                        \
    }                                                                                         \
    if (b < nb) QS(qs_blk_##T)(w + b * BB, x + b * 32, k, even, R);                           \
    QS_UNROLL                                                                                 \
    for (int r = 0; r < R; r++) s[r] = QS(qs_lanes)(even[r] + odd[r]);                        \
}
QS_TWO_CHAINS(q8_0, 34)
QS_TWO_CHAINS(q4_0, 18)
QS_TWO_CHAINS(q5_0, 22)
QS_TWO_CHAINS(iq4_nl, 18)

/* Q4_1 {f16 d, m; uint8 qs[16]} and Q5_1 {f16 d, m; uint8 qh[4]; uint8 qs[16]}:
   sum_b d_b * (q . x) + m_b * sum(x under b). */
#define QS_TWO_CHAINS_MIN(T, BB)                                                             \
QS_ALWAYS void QS(qs_##T)(const uint8_t *w, const float *x, const float *xs, ptrdiff_t k,   \
                          float *s, int R) {                                                \
    qs_f8 even[QM_GROUP] = {{0}}, odd[QM_GROUP] = {{0}};                                    \
    qs_f4 mins_even[QM_GROUP] = {{0}}, mins_odd[QM_GROUP] = {{0}};                          \
    ptrdiff_t nb = k / 32, b = 0;                                                           \
    for (; b + 2 <= nb; b += 2) {                                                           \
        QS(qs_ahead)(w + b * BB, 2 * BB);                                                   \
        QS(qs_blk_##T)(w + b * BB, x + b * 32, xs + b, k, nb, even, mins_even, R);          \
        QS(qs_blk_##T)(w + (b + 1) * BB, x + (b + 1) * 32, xs + b + 1, k, nb, odd, mins_odd, \
                       R);                                                                  \
    }                                                                                       \
    if (b < nb) QS(qs_blk_##T)(w + b * BB, x + b * 32, xs + b, k, nb, even, mins_even, R);  \
    QS_UNROLL                                                                               \
    for (int r = 0; r < R; r++)                                                             \
        s[r] = QS(qs_lanes)(even[r] + odd[r]) + (mins_even[r][1] + mins_odd[r][1]);         \
}
QS_TWO_CHAINS_MIN(q4_1, 20)
QS_TWO_CHAINS_MIN(q5_1, 24)

/* Sixteen 6-bit values packed as Q4_K's and Q5_K's scales (ggml's get_scale_min_k4, four
   bytes at a time as ggml's vec_dot does it): the eight scales times d and the eight mins
   times dmin, each as eight lanes. */
QS_ALWAYS void QS(qs_scales_k4)(const uint8_t *blk, qs_f8 *scale, qs_f8 *minimum) {
    uint64_t u01;
    uint32_t u2;
    memcpy(&u01, blk + 4, 8);
    memcpy(&u2, blk + 12, 4);
    uint32_t u0 = (uint32_t)u01, u1 = (uint32_t)(u01 >> 32);
    uint64_t scales = (u0 & 0x3f3f3f3fu)
        | (uint64_t)((u2 & 0x0f0f0f0fu) | (((u0 >> 6) & 0x03030303u) << 4)) << 32;
    uint64_t mins = (u1 & 0x3f3f3f3fu)
        | (uint64_t)(((u2 >> 4) & 0x0f0f0f0fu) | (((u1 >> 6) & 0x03030303u) << 4)) << 32;
    uint8_t bytes[16];
    memcpy(bytes, &scales, 8);
    memcpy(bytes + 8, &mins, 8);
    qs_f4 dm = QS_HALF2(blk);
    *scale = QS(qs_splat)(dm[0]) * QS(qs_f)(QS(qs_bu)(bytes));
    *minimum = QS(qs_splat)(dm[1]) * QS(qs_f)(QS(qs_bu)(bytes + 8));
}

/* Q4_K {f16 d, dmin; uint8 scales[12]; uint8 qs[128]}: per 32 bytes of qs, the low nibbles
   are sub-block 2c and the high ones 2c + 1; w = d sc q - dmin m. The eight mins of a block
   times the eight sums of x under its sub-blocks are one vector product per row. */
QS_ALWAYS void QS(qs_q4_k_block)(const uint8_t *blk, const float *x, const float *xs,
                                 ptrdiff_t k, ptrdiff_t b, int R, qs_f8 *even, qs_f8 *odd,
                                 qs_f8 *mins) {
    ptrdiff_t nb = k / 32;
    qs_f8 scale, minimum;
    QS(qs_scales_k4)(blk, &scale, &minimum);
    QS_IN_MEMORY(scale);
    for (int c = 0; c < 4; c++) {
        qs_f8 lo[4], hi[4], d0 = QS(qs_splat)(scale[2 * c]);
        qs_f8 d1 = QS(qs_splat)(scale[2 * c + 1]);
        for (int t = 0; t < 4; t++) {
            qs_i32 q = QS(qs_bu)(blk + 16 + 32 * c + 8 * t);
            lo[t] = QS(qs_f)(q & 15);
            hi[t] = QS(qs_f)(q >> 4);
        }
        QS_UNROLL
        for (int r = 0; r < R; r++) {
            const float *xr = x + r * k + b * 256 + 64 * c;
            even[r] += d0 * QS(qs_chain32)(lo, xr);
            odd[r] += d1 * QS(qs_chain32)(hi, xr + 32);
        }
    }
    QS_UNROLL
    for (int r = 0; r < R; r++) mins[r] += minimum * QS(qs_x)(xs + r * nb + b * 8);
}

QS_ALWAYS void QS(qs_q4_k)(const uint8_t *w, const float *x, const float *xs, ptrdiff_t k,
                           float *s, int R) {
    qs_f8 even[QM_GROUP] = {{0}}, odd[QM_GROUP] = {{0}}, mins[QM_GROUP] = {{0}};
    for (ptrdiff_t b = 0; b < k / 256; b++) {
        QS(qs_ahead)(w + b * 144, 144);
        QS(qs_q4_k_block)(w + b * 144, x, xs, k, b, R, even, odd, mins);
    }
    QS_UNROLL
    for (int r = 0; r < R; r++) s[r] = QS(qs_lanes)(even[r] + odd[r]) - QS(qs_lanes)(mins[r]);
}

/* Q6_K {uint8 ql[128], qh[64]; int8 scales[16]; f16 d}: per half of 128 weights and l < 32,
   weights l, l + 32, l + 64, l + 96 take ql[l] low, ql[l + 32] low, ql[l] high, ql[l + 32]
   high for their four low bits and successive bit pairs of qh[l] for the top two; one
   scale per 16 weights, taken times d as vectors once per block. The 6-bit quants of a
   quarter (32 weights) are assembled 32 bytes at a time, then widened from the registers
   (from memory instead, a store and four loads, costs more: the loads wait on the store). */
typedef uint8_t qs_u8 __attribute__((vector_size(32)));

QS_ATTR static inline qs_u8 QS(qs_u8_load)(const uint8_t *p) {
    qs_u8 v;
    memcpy(&v, p, 32);
    return v;
}

/* The 32 bytes of v shifted as sixteen 16-bit lanes (one instruction where a byte shift takes
   several on AVX2; the caller masks off the bits that crossed from the neighbour byte). */
typedef uint16_t qs_u16 __attribute__((vector_size(32)));
QS_ATTR static inline qs_u8 QS(qs_shl16)(qs_u8 v, int n) { return (qs_u8)((qs_u16)v << n); }
QS_ATTR static inline qs_u8 QS(qs_shr16)(qs_u8 v, int n) { return (qs_u8)((qs_u16)v >> n); }

QS_ALWAYS void QS(qs_q6_k)(const uint8_t *w, const float *x, ptrdiff_t k, float *s, int R) {
    qs_f8 acc[2][QM_GROUP] = {{{0}}};  /* two chains: even and odd sixteens */
    for (ptrdiff_t b = 0; b < k / 256; b++) {
        const uint8_t *blk = w + b * 210;
        QS(qs_ahead)(blk, 210);
        qs_f8 d = QS(qs_splat)(QS_HALF(blk + 208));
        qs_f8 scale[2] = {d * QS(qs_f)(QS(qs_bs)(blk + 192)),
                          d * QS(qs_f)(QS(qs_bs)(blk + 200))};  /* the sixteens' d sc */
        QS_IN_MEMORY(scale);
        for (int half = 0; half < 2; half++) {
            const uint8_t *ql = blk + 64 * half, *qh = blk + 128 + 32 * half;
            qs_u8 a = QS(qs_u8_load)(ql), c = QS(qs_u8_load)(ql + 32), h = QS(qs_u8_load)(qh);
            qs_u8 q[4] = {(a & 15) | (QS(qs_shl16)(h, 4) & 48),
                          (c & 15) | (QS(qs_shl16)(h, 2) & 48),
                          (QS(qs_shr16)(a, 4) & 15) | (h & 48),
                          (QS(qs_shr16)(c, 4) & 15) | (QS(qs_shr16)(h, 2) & 48)};
            for (int quarter = 0; quarter < 4; quarter++) {
                qs_u8 centered = q[quarter] - 32;  /* as int8: q - 32 */
                qs_i8x16 halves[2];
                memcpy(halves, &centered, 32);
                qs_f8 f[4];
                QS_WIDEN16(halves[0], f);
                QS_WIDEN16(halves[1], f + 2);
                qs_f8 d0 = QS(qs_splat)(scale[half][2 * quarter]);
                qs_f8 d1 = QS(qs_splat)(scale[half][2 * quarter + 1]);
                QS_UNROLL
                for (int r = 0; r < R; r++) {
                    const float *xr = x + r * k + b * 256 + 128 * half + 32 * quarter;
                    qs_f8 p0 = f[0] * QS(qs_x)(xr), p1 = f[2] * QS(qs_x)(xr + 16);
                    p0 += f[1] * QS(qs_x)(xr + 8);
                    p1 += f[3] * QS(qs_x)(xr + 24);
                    acc[0][r] += d0 * p0;
                    acc[1][r] += d1 * p1;
                }
            }
        }
    }
    QS_UNROLL
    for (int r = 0; r < R; r++) s[r] = QS(qs_lanes)(acc[0][r] + acc[1][r]);
}

/* Q5_K {f16 d, dmin; uint8 scales[12]; uint8 qh[32]; uint8 qs[128]}: Q4_K's, with bit 2c
   (2c + 1) of qh[l] the fifth bit of sub-block 2c's (2c + 1's) weight l. */
QS_ALWAYS void QS(qs_q5_k)(const uint8_t *w, const float *x, const float *xs, ptrdiff_t k,
                           float *s, int R) {
    qs_f8 even[QM_GROUP] = {{0}}, odd[QM_GROUP] = {{0}};
    float mins[QM_GROUP] = {0};
    ptrdiff_t nb = k / 32;
    for (ptrdiff_t b = 0; b < k / 256; b++) {
        const uint8_t *blk = w + b * 176;
        QS(qs_ahead)(blk, 176);
        float d = QS_HALF(blk), dmin = QS_HALF(blk + 2);
        qs_i32 high[4];
        for (int t = 0; t < 4; t++) high[t] = QS(qs_bu)(blk + 16 + 8 * t);
        for (int c = 0; c < 4; c++) {
            int sc0, m0, sc1, m1;
            qm_scale_min_k4(2 * c, blk + 4, &sc0, &m0);
            qm_scale_min_k4(2 * c + 1, blk + 4, &sc1, &m1);
            qs_f8 lo[4], hi[4], d0 = QS(qs_splat)(d * sc0), d1 = QS(qs_splat)(d * sc1);
            for (int t = 0; t < 4; t++) {
                qs_i32 q = QS(qs_bu)(blk + 48 + 32 * c + 8 * t);
                lo[t] = QS(qs_f)((q & 15) | (((high[t] >> (2 * c)) & 1) << 4));
                hi[t] = QS(qs_f)((q >> 4) | (((high[t] >> (2 * c + 1)) & 1) << 4));
            }
            float dm0 = dmin * m0, dm1 = dmin * m1;
            QS_UNROLL
            for (int r = 0; r < R; r++) {
                const float *xr = x + r * k + b * 256 + 64 * c;
                even[r] += d0 * QS(qs_dot32)(lo, xr);
                odd[r] += d1 * QS(qs_dot32)(hi, xr + 32);
                const float *sr = xs + r * nb + b * 8 + 2 * c;
                mins[r] -= dm0 * sr[0] + dm1 * sr[1];
            }
        }
    }
    QS_UNROLL
    for (int r = 0; r < R; r++) s[r] = QS(qs_lanes)(even[r] + odd[r]) + mins[r];
}

/* Q2_K {uint8 scales[16]; uint8 qs[64]; f16 d, dmin}: per half of 128 weights, the 32 bytes of
   qs widened once and each bit pair cut from them; a sixteen's min (dmin * (scale >> 4)) is
   taken into its widened weights, w = dl q - ml, as the reference has them. */
QS_ALWAYS void QS(qs_q2_k)(const uint8_t *w, const float *x, ptrdiff_t k, float *s, int R) {
    qs_f8 acc[2][QM_GROUP] = {{{0}}};  /* two chains: even and odd sixteens */
    for (ptrdiff_t b = 0; b < k / 256; b++) {
        const uint8_t *blk = w + b * 84;
        QS(qs_ahead)(blk, 84);
        float d = QS_HALF(blk + 80), dmin = QS_HALF(blk + 82);
        for (int n = 0; n < 2; n++) {
            qs_i32 q[4];
            for (int t = 0; t < 4; t++) q[t] = QS(qs_bu)(blk + 16 + 32 * n + 8 * t);
            for (int j = 0; j < 4; j++) {
                int s0 = blk[8 * n + 2 * j], s1 = blk[8 * n + 2 * j + 1];
                qs_f8 d0 = QS(qs_splat)(d * (float)(s0 & 15));
                qs_f8 m0 = QS(qs_splat)(dmin * (float)(s0 >> 4));
                qs_f8 d1 = QS(qs_splat)(d * (float)(s1 & 15));
                qs_f8 m1 = QS(qs_splat)(dmin * (float)(s1 >> 4));
                qs_f8 f[4];
                for (int t = 0; t < 4; t++) {
                    qs_f8 v = QS(qs_f)((q[t] >> (2 * j)) & 3);
                    f[t] = t < 2 ? d0 * v - m0 : d1 * v - m1;
                }
                QS_UNROLL
                for (int r = 0; r < R; r++) {
                    const float *xr = x + r * k + b * 256 + 128 * n + 32 * j;
                    acc[0][r] += f[0] * QS(qs_x)(xr) + f[1] * QS(qs_x)(xr + 8);
                    acc[1][r] += f[2] * QS(qs_x)(xr + 16) + f[3] * QS(qs_x)(xr + 24);
                }
            }
        }
    }
    QS_UNROLL
    for (int r = 0; r < R; r++) s[r] = QS(qs_lanes)(acc[0][r] + acc[1][r]);
}

/* Q3_K {uint8 hmask[32]; uint8 qs[64]; uint8 scales[12]; f16 d}: Q2_K's bit pairs, the third
   bit from hmask (widened once per block), q = (low | high << 2) - 4; one scale per 16. */
QS_ALWAYS void QS(qs_q3_k)(const uint8_t *w, const float *x, ptrdiff_t k, float *s, int R) {
    qs_f8 acc[2][QM_GROUP] = {{{0}}};
    for (ptrdiff_t b = 0; b < k / 256; b++) {
        const uint8_t *blk = w + b * 110;
        QS(qs_ahead)(blk, 110);
        float d = QS_HALF(blk + 108);
        int sc[16];
        qm_scales_q3_k(blk + 96, sc);
        qs_i32 hm[4];
        for (int t = 0; t < 4; t++) hm[t] = QS(qs_bu)(blk + 8 * t);
        for (int n = 0; n < 2; n++) {
            qs_i32 q[4];
            for (int t = 0; t < 4; t++) q[t] = QS(qs_bu)(blk + 32 + 32 * n + 8 * t);
            for (int j = 0; j < 4; j++) {
                qs_f8 f[4];
                for (int t = 0; t < 4; t++)
                    f[t] = QS(qs_f)((((q[t] >> (2 * j)) & 3)
                                     | (((hm[t] >> (4 * n + j)) & 1) << 2)) - 4);
                qs_f8 d0 = QS(qs_splat)(d * (float)sc[8 * n + 2 * j]);
                qs_f8 d1 = QS(qs_splat)(d * (float)sc[8 * n + 2 * j + 1]);
                QS_UNROLL
                for (int r = 0; r < R; r++) {
                    const float *xr = x + r * k + b * 256 + 128 * n + 32 * j;
                    acc[0][r] += d0 * (f[0] * QS(qs_x)(xr) + f[1] * QS(qs_x)(xr + 8));
                    acc[1][r] += d1 * (f[2] * QS(qs_x)(xr + 16) + f[3] * QS(qs_x)(xr + 24));
                }
            }
        }
    }
    QS_UNROLL
    for (int r = 0; r < R; r++) s[r] = QS(qs_lanes)(acc[0][r] + acc[1][r]);
}

/* IQ4_XS {f16 d; uint16 scales_h; uint8 scales_l[4]; uint8 qs[128]}: eight sub-blocks of 32
   as IQ4_NL's, each scaled by d (scale - 32); even and odd sub-blocks in two chains. */
QS_ALWAYS void QS(qs_iq4_xs)(const uint8_t *w, const float *x, ptrdiff_t k, float *s, int R) {
    qs_f8 acc[2][QM_GROUP] = {{{0}}};
    for (ptrdiff_t b = 0; b < k / 256; b++) {
        const uint8_t *blk = w + b * 136;
        QS(qs_ahead)(blk, 136);
        float d = QS_HALF(blk);
        for (int ib = 0; ib < 8; ib++) {
            qs_f8 f[4], dl = QS(qs_splat)(d * (float)qm_scale_iq4_xs(blk, ib));
            QS(qs_iq4)(blk + 8 + 16 * ib, f);
            QS_UNROLL
            for (int r = 0; r < R; r++)
                acc[ib & 1][r] += dl * QS(qs_dot32)(f, x + r * k + b * 256 + 32 * ib);
        }
    }
    QS_UNROLL
    for (int r = 0; r < R; r++) s[r] = QS(qs_lanes)(acc[0][r] + acc[1][r]);
}

/* F16 and BF16 rows of any width: sixteen weights at a time in two chains, eight more, then
   one at a time (the reference's own conversion) for the last k % 8. */
#define QS_FLOATS(T, WIDEN8, ONE)                                                          \
QS_ALWAYS void QS(qs_##T)(const uint8_t *w, const float *x, ptrdiff_t k, float *s, int R) { \
    qs_f8 even[QM_GROUP] = {{0}}, odd[QM_GROUP] = {{0}};                                   \
    float tail[QM_GROUP] = {0};                                                            \
    ptrdiff_t i = 0;                                                                       \
    for (; i + 16 <= k; i += 16) {                                                         \
        QS(qs_ahead)(w + 2 * i, 32);                                                       \
        qs_f8 f0 = WIDEN8(w + 2 * i), f1 = WIDEN8(w + 2 * i + 16);                         \
        QS_UNROLL                                                                          \
        for (int r = 0; r < R; r++) {                                                      \
            even[r] += f0 * QS(qs_x)(x + r * k + i);                                       \
            odd[r] += f1 * QS(qs_x)(x + r * k + i + 8);                                    \
        }                                                                                  \
    }                                                                                      \
    if (i + 8 <= k) {                                                                      \
        qs_f8 f0 = WIDEN8(w + 2 * i);                                                      \
        QS_UNROLL                                                                          \
        for (int r = 0; r < R; r++) even[r] += f0 * QS(qs_x)(x + r * k + i);               \
        i += 8;                                                                            \
    }                                                                                      \
    for (; i < k; i++) {                                                                   \
        float one;                                                                         \
        ONE(w + 2 * i, &one);                                                              \
        QS_UNROLL                                                                          \
        for (int r = 0; r < R; r++) tail[r] += one * x[r * k + i];                         \
    }                                                                                      \
    QS_UNROLL                                                                              \
    for (int r = 0; r < R; r++) s[r] = QS(qs_lanes)(even[r] + odd[r]) + tail[r];           \
}
QS_FLOATS(f16, QS_HALF8, qm_deq_f16)
QS_FLOATS(bf16, QS_BF16_8, qm_deq_bf16)

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
#define QS_CALL_F16(R) QS(qs_f16)(w, x, k, s, R)
#define QS_CALL_BF16(R) QS(qs_bf16)(w, x, k, s, R)
#define QS_CALL_Q5_0(R) QS(qs_q5_0)(w, x, k, s, R)
#define QS_CALL_Q5_1(R) QS(qs_q5_1)(w, x, xs, k, s, R)
#define QS_CALL_Q2_K(R) QS(qs_q2_k)(w, x, k, s, R)
#define QS_CALL_Q3_K(R) QS(qs_q3_k)(w, x, k, s, R)
#define QS_CALL_Q5_K(R) QS(qs_q5_k)(w, x, xs, k, s, R)
#define QS_CALL_IQ4_NL(R) QS(qs_iq4_nl)(w, x, k, s, R)
#define QS_CALL_IQ4_XS(R) QS(qs_iq4_xs)(w, x, k, s, R)
QS_TYPE(q8_0, QS_CALL_Q8_0)
QS_TYPE(q4_0, QS_CALL_Q4_0)
QS_TYPE(q4_1, QS_CALL_Q4_1)
QS_TYPE(q4_k, QS_CALL_Q4_K)
QS_TYPE(q6_k, QS_CALL_Q6_K)
QS_TYPE(f16, QS_CALL_F16)
QS_TYPE(bf16, QS_CALL_BF16)
QS_TYPE(q5_0, QS_CALL_Q5_0)
QS_TYPE(q5_1, QS_CALL_Q5_1)
QS_TYPE(q2_k, QS_CALL_Q2_K)
QS_TYPE(q3_k, QS_CALL_Q3_K)
QS_TYPE(q5_k, QS_CALL_Q5_K)
QS_TYPE(iq4_nl, QS_CALL_IQ4_NL)
QS_TYPE(iq4_xs, QS_CALL_IQ4_XS)

#define QS_ROW(T) {NULL, QS(qs_##T##_1), QS(qs_##T##_2), QS(qs_##T##_3), QS(qs_##T##_4)}
static const qm_dot_fn QS(qs_table)[QM_TYPES][QM_GROUP + 1] = {
    QS_ROW(q8_0), QS_ROW(q4_0), QS_ROW(q4_1), QS_ROW(q4_k), QS_ROW(q6_k), QS_ROW(f16),
    QS_ROW(bf16), QS_ROW(q5_0), QS_ROW(q5_1), QS_ROW(q2_k), QS_ROW(q3_k), QS_ROW(q5_k),
    QS_ROW(iq4_nl), QS_ROW(iq4_xs)};
