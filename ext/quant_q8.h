/* Integer dot products of quantized weights with 8-bit activations (the ``q8`` CPU dot mode,
 * as llama.cpp's CPU path multiplies): each activation row is quantized once per product,
 * then each weight block's quants are multiplied with the row's 8-bit quants in integer
 * arithmetic, and the block's sum is scaled once by the weight's and the activation's
 * scales. Included by quant.h.
 *
 * Activations take two forms, each made only where a product's types read it:
 *  - 32-blocks (for Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL: ggml's Q8_0 and Q8_1): per 32
 *    values a float scale d = max|x| / 127, quants round(x / d), and s = d * their sum
 *    (Q8_1's, read by the types with a minimum);
 *  - 256-blocks (for the K-quants and IQ4_XS: ggml's Q8_K): per 256 values d = -max / 127
 *    (max the value of largest magnitude, so it becomes -127), quants round(x / d) capped at
 *    127, and the sum of each 16 quants (bsums, read for a minimum or an offset).
 *  The scales stay float32 (ggml rounds Q8_0's and Q8_1's to f16).
 *
 * Per type there is a scalar reference (qm_iblk_<type>: one block's integer sums, then its
 * scales) and vector paths (quant_q8_avx2.h, quant_q8_neon.h with the dot-product
 * instructions) checked against it; a type whose vector path this CPU lacks is multiplied by
 * the float32 kernels instead (qm_q8_usable), so q8 never makes a product slower.
 */

#define QM_IGROUP 8  /* activation rows per pass over a weight row (integer kernels) */

/* Quantized activations of R rows of k (pointers at row 0; a row r's data at r * k,
   r * (k / 32), r * (k / 256), r * (k / 16)). */
typedef struct {
    const int8_t *q32;     /* 32-blocks' quants (R, k) */
    const float *d32;      /* their scales (R, k / 32) */
    const float *s32;      /* d * the sum of each block's quants (R, k / 32) */
    const int8_t *qk;      /* 256-blocks' quants (R, k) */
    const float *dk;       /* their scales (R, k / 256) */
    const int16_t *bsums;  /* sums of each 16 quants (R, k / 16) */
    const float *dk8;      /* the wide kernels' dk: by block, 8 rows' (0 past R); qm_act_dk8 */
    const int32_t *i32;    /* the sum of each 32-block's quants (R, k / 32): the x8 kernels' */
} qm_act;

/* One weight row against R <= QM_IGROUP quantized activation rows: s[r] = sum_i W[i] x[r][i]. */
typedef void (*qm_idot_fn)(const uint8_t *w, const qm_act *a, ptrdiff_t k, int R, float *s);

/* 8 interleaved weight rows (a group g of the x8 layout, see qm_pack_x8) against R <=
   QM_IGROUP activation rows: s[8 r + i] = weight row i by activation row r. */
typedef void (*qm_x8_fn)(const uint8_t *g, const qm_act *a, ptrdiff_t k, int R, float *s);

/* A vector path's integer kernels: its name, the kernels by type, its wide kernels by type
   (NULL: none), and whether this CPU runs them (NULL: wherever the vector path runs).
   A wide kernel is a 256-weight type's for products of many rows (qm_rows's QM_DOT_WIDE):
   it scales 8 rows' block sums in one vector, where the step's kernels scale each row's;
   a row's result is its own either way, but the two kinds round it differently. Its x8
   kernels by type (NULL: none) multiply the x8 layout's groups. */
typedef struct {
    const char *name;
    const qm_idot_fn *table;
    const qm_idot_fn *wide;
    int (*usable)(void);
    const qm_x8_fn *x8;
} qm_ivariant;

/* A vector kernel ``name`` (a qm_idot_fn, ATTR its target attribute) that calls CALL(R) with
   R fixed in each branch, so that the loops over rows unroll whole. */
#define QM_BY_ROWS(ATTR, name, CALL)                                                          \
    ATTR static void name(const uint8_t *w, const qm_act *a, ptrdiff_t k, int R, float *s) { \
        switch (R) {                                                                        \
        case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break;             \
        case 4: CALL(4); break; case 5: CALL(5); break; case 6: CALL(6); break;             \
        case 7: CALL(7); break; default: CALL(8); break;                                    \
        }                                                                                   \
    }

/* Which activation form a type's integer kernel reads: 32 or 256 (0: none, F16 and BF16). */
static inline int qm_act_form(int type) {
    switch (type) {
    case QM_Q8_0: case QM_Q4_0: case QM_Q4_1: case QM_Q5_0: case QM_Q5_1: case QM_IQ4_NL:
        return 32;
    case QM_Q2_K: case QM_Q3_K: case QM_Q4_K: case QM_Q5_K: case QM_Q6_K: case QM_IQ4_XS:
        return 256;
    default:
        return 0;
    }
}

/* Bytes of the quantized activations of R rows of k, either form (k a multiple of 32). */
static inline size_t qm_act_bytes(ptrdiff_t k, int R) {
    size_t per_row = 2 * (size_t)k + 12 * (size_t)(k / 32) + 4 * (size_t)(k / 256 + 1)
                     + 2 * (size_t)(k / 16);
    return (size_t)R * per_row + 64;
}

/* The arrays of a qm_act laid out in mem (qm_act_bytes(k, R) bytes, float-aligned). */
static inline void qm_act_at(qm_act *a, void *mem, ptrdiff_t k, int R) {
    float *f = (float *)mem;
    a->d32 = f;
    a->s32 = f + (ptrdiff_t)R * (k / 32);
    a->i32 = (const int32_t *)(a->s32 + (ptrdiff_t)R * (k / 32));
    a->dk = (const float *)(a->i32 + (ptrdiff_t)R * (k / 32));
    a->bsums = (const int16_t *)(a->dk + (ptrdiff_t)R * (k / 256 + 1));
    a->q32 = (const int8_t *)(a->bsums + (ptrdiff_t)R * (k / 16));
    a->qk = a->q32 + (ptrdiff_t)R * k;
}

/* a's rows from r0 on. */
static inline qm_act qm_act_from(const qm_act *a, ptrdiff_t k, int r0) {
    qm_act b = {a->q32 + r0 * k, a->d32 + r0 * (k / 32), a->s32 + r0 * (k / 32),
                a->qk + r0 * k, a->dk + r0 * (k / 256 + 1), a->bsums + r0 * (k / 16), NULL,
                a->i32 + r0 * (k / 32)};
    return b;
}

/* a->dk8 pointed at dk8 (QM_IGROUP (k / 256) floats), filled with a's R rows' 256-block
   scales, block by block, for the wide kernels. */
static inline void qm_act_dk8(qm_act *a, ptrdiff_t k, int R, float *dk8) {
    ptrdiff_t nb = k / 256;
    for (ptrdiff_t b = 0; b < nb; b++)
        for (int r = 0; r < QM_IGROUP; r++)
            dk8[QM_IGROUP * b + r] = r < R ? a->dk[r * (nb + 1) + b] : 0.0f;
    a->dk8 = dk8;
}

/* v rounded to the nearest integer, halves away from zero (roundf), in plain arithmetic. */
static inline int qm_round(float v) { return (int)(v + (v >= 0.0f ? 0.5f : -0.5f)); }

/* A block's inverse scale, or 0 where it overflowed (the block's largest magnitude below
   127 / FLT_MAX): such a block quantizes to zeros, where its products would be infinite. */
static inline float qm_finite_or_zero(float inv) { return isinf(inv) ? 0.0f : inv; }

/* The 32-block form of R rows of x (k a multiple of 32). */
static void qm_quantize32(const float *x, ptrdiff_t k, int R, const qm_act *a) {
    int8_t *q = (int8_t *)a->q32;
    float *d = (float *)a->d32, *s = (float *)a->s32;
    int32_t *sums = (int32_t *)a->i32;
    for (ptrdiff_t b = 0; b < (ptrdiff_t)R * (k / 32); b++) {
        const float *xb = x + 32 * b;
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) amax = fabsf(xb[i]) > amax ? fabsf(xb[i]) : amax;
        float db = amax / 127.0f, inv = qm_finite_or_zero(db != 0.0f ? 1.0f / db : 0.0f);
        int sum = 0;
        for (int i = 0; i < 32; i++) {
            int v = qm_round(xb[i] * inv);
            q[32 * b + i] = (int8_t)v;
            sum += v;
        }
        d[b] = db;
        s[b] = db * (float)sum;
        sums[b] = sum;
    }
}

/* The 256-block form of R rows of x (k a multiple of 256). */
static void qm_quantize256(const float *x, ptrdiff_t k, int R, const qm_act *a) {
    int8_t *q = (int8_t *)a->qk;
    int16_t *bs = (int16_t *)a->bsums;
    float *d = (float *)a->dk;
    ptrdiff_t per_row = k / 256;
    for (int r = 0; r < R; r++)
        for (ptrdiff_t b = 0; b < per_row; b++) {
            const float *xb = x + r * k + 256 * b;
            int8_t *qb = q + r * k + 256 * b;
            float amax = 0.0f, max = 0.0f;
            for (int i = 0; i < 256; i++)
                if (fabsf(xb[i]) > amax) { amax = fabsf(xb[i]); max = xb[i]; }
            float inv = qm_finite_or_zero(amax != 0.0f ? -127.0f / max : 0.0f);
            for (int i = 0; i < 256; i++) {
                int v = qm_round(inv * xb[i]);
                qb[i] = (int8_t)(v > 127 ? 127 : v);
            }
            for (int j = 0; j < 16; j++) {
                int sum = 0;
                for (int i = 0; i < 16; i++) sum += qb[16 * j + i];
                bs[r * (k / 16) + 16 * b + j] = (int16_t)sum;
            }
            d[r * (per_row + 1) + b] = inv != 0.0f ? 1.0f / inv : 0.0f;
        }
}

/* -- the scalar reference: one block of row r's activations, block index b ---------------- */

#define QM_Y32(a, r, k, b) ((a)->q32 + (r) * (k) + 32 * (b))
#define QM_D32(a, r, k, b) ((a)->d32[(r) * ((k) / 32) + (b)])
#define QM_S32(a, r, k, b) ((a)->s32[(r) * ((k) / 32) + (b)])
#define QM_YK(a, r, k, b) ((a)->qk + (r) * (k) + 256 * (b))
#define QM_DK(a, r, k, b) ((a)->dk[(r) * ((k) / 256 + 1) + (b)])
#define QM_BS(a, r, k, b) ((a)->bsums + (r) * ((k) / 16) + 16 * (b))

typedef float (*qm_iblk_fn)(const uint8_t *blk, const qm_act *a, int r, ptrdiff_t k,
                            ptrdiff_t b);

static float qm_iblk_q8_0(const uint8_t *blk, const qm_act *a, int r, ptrdiff_t k, ptrdiff_t b) {
    const int8_t *y = QM_Y32(a, r, k, b);
    int sum = 0;
    for (int i = 0; i < 32; i++) sum += (int8_t)blk[2 + i] * y[i];
    return qm_half(blk) * QM_D32(a, r, k, b) * (float)sum;
}

/* Where a 32-weight block's nibbles start, and its fifth bits (0 where none). */
static inline int qm_nibbles_at(int type) {
    switch (type) {
    case QM_Q4_1: return 4;
    case QM_Q5_0: return 6;
    case QM_Q5_1: return 8;
    default: return 2;  /* Q4_0, IQ4_NL */
    }
}

/* The 32 quants of a 32-weight block (Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL) as ints, offset
   taken off (Q4_0 8, Q5_0 16) or looked up (IQ4_NL). */
static void qm_quants32(int type, const uint8_t *blk, int *v) {
    const uint8_t *qs = blk + qm_nibbles_at(type);
    uint32_t qh = type == QM_Q5_0 ? qm_u32(blk + 2) : type == QM_Q5_1 ? qm_u32(blk + 4) : 0;
    int offset = type == QM_Q4_0 ? 8 : type == QM_Q5_0 ? 16 : 0;
    for (int j = 0; j < 16; j++) {
        int lo = (qs[j] & 0xF) | (int)(((qh >> j) & 1) << 4);
        int hi = (qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1) << 4);
        v[j] = type == QM_IQ4_NL ? qm_iq4nl[lo] : lo - offset;
        v[j + 16] = type == QM_IQ4_NL ? qm_iq4nl[hi] : hi - offset;
    }
}

static int qm_sum32(const int *v, const int8_t *y) {
    int sum = 0;
    for (int i = 0; i < 32; i++) sum += v[i] * y[i];
    return sum;
}

#define QM_IBLK32(name, T, HAS_MIN)                                                           \
    static float qm_iblk_##name(const uint8_t *blk, const qm_act *a, int r, ptrdiff_t k,    \
                                ptrdiff_t b) {                                              \
        int v[32];                                                                          \
        qm_quants32(T, blk, v);                                                             \
        float dot = qm_half(blk) * QM_D32(a, r, k, b) * (float)qm_sum32(v, QM_Y32(a, r, k, b)); \
        return HAS_MIN ? dot + qm_half(blk + 2) * QM_S32(a, r, k, b) : dot;                \
    }
QM_IBLK32(q4_0, QM_Q4_0, 0)
QM_IBLK32(q4_1, QM_Q4_1, 1)
QM_IBLK32(q5_0, QM_Q5_0, 0)
QM_IBLK32(q5_1, QM_Q5_1, 1)
QM_IBLK32(iq4_nl, QM_IQ4_NL, 0)

/* Q4_K and Q5_K: sum over eight sub-blocks of 32 of d sc_j sum(q y) - dmin m_j sum(y). */
static float qm_iblk_k45(const uint8_t *blk, const qm_act *a, int r, ptrdiff_t k, ptrdiff_t b,
                         int five) {
    const uint8_t *qh = blk + 16, *q = blk + (five ? 48 : 16);
    const int8_t *y = QM_YK(a, r, k, b);
    const int16_t *bs = QM_BS(a, r, k, b);
    int dots = 0, mins = 0;
    for (int j = 0; j < 8; j++) {
        int sc, m, sum = 0;
        qm_scale_min_k4(j, blk + 4, &sc, &m);
        for (int l = 0; l < 32; l++) {
            int v = j % 2 ? q[32 * (j / 2) + l] >> 4 : q[32 * (j / 2) + l] & 0xF;
            if (five) v |= ((qh[l] >> j) & 1) << 4;
            sum += v * y[32 * j + l];
        }
        dots += sc * sum;
        mins += m * (bs[2 * j] + bs[2 * j + 1]);
    }
    float dy = QM_DK(a, r, k, b);
    return qm_half(blk) * dy * (float)dots - qm_half(blk + 2) * dy * (float)mins;
}

static float qm_iblk_q4_k(const uint8_t *blk, const qm_act *a, int r, ptrdiff_t k, ptrdiff_t b) {
    return qm_iblk_k45(blk, a, r, k, b, 0);
}

static float qm_iblk_q5_k(const uint8_t *blk, const qm_act *a, int r, ptrdiff_t k, ptrdiff_t b) {
    return qm_iblk_k45(blk, a, r, k, b, 1);
}

/* Q6_K: d sum over 16 sub-blocks of 16 of sc_j (sum(q y) - 32 sum(y)). */
static float qm_iblk_q6_k(const uint8_t *blk, const qm_act *a, int r, ptrdiff_t k, ptrdiff_t b) {
    const uint8_t *ql = blk, *qh = blk + 128;
    const int8_t *sc = (const int8_t *)(blk + 192), *y = QM_YK(a, r, k, b);
    const int16_t *bs = QM_BS(a, r, k, b);
    int total = 0;
    for (int half = 0; half < 2; half++, ql += 64, qh += 32, y += 128)
        for (int g = 0; g < 4; g++)       /* 32 weights: ql's low (g even) or high nibbles */
            for (int h = 0; h < 2; h++) { /* 16 of them, one scale */
                int sum = 0;
                for (int l = 16 * h; l < 16 * h + 16; l++) {
                    int lo = g < 2 ? ql[l + 32 * (g % 2)] & 0xF : ql[l + 32 * (g % 2)] >> 4;
                    int v = lo | (((qh[l] >> (2 * g)) & 3) << 4);
                    sum += v * y[32 * g + l];
                }
                int j = 8 * half + 2 * g + h;
                total += sc[j] * (sum - 32 * bs[j]);
            }
    return qm_half(blk + 208) * QM_DK(a, r, k, b) * (float)total;
}

/* Q2_K: d sum of sc_j sum(q y) - dmin sum of m_j sum(y), sixteen sub-blocks of 16. */
static float qm_iblk_q2_k(const uint8_t *blk, const qm_act *a, int r, ptrdiff_t k, ptrdiff_t b) {
    const uint8_t *q = blk + 16;
    const int8_t *y = QM_YK(a, r, k, b);
    const int16_t *bs = QM_BS(a, r, k, b);
    int dots = 0, mins = 0;
    for (int n = 0; n < 2; n++, q += 32)
        for (int j = 0; j < 4; j++)
            for (int h = 0; h < 2; h++) {
                int s = 8 * n + 2 * j + h, sum = 0;
                for (int l = 0; l < 16; l++)
                    sum += ((q[16 * h + l] >> (2 * j)) & 3) * y[16 * s + l];
                dots += (blk[s] & 0xF) * sum;
                mins += (blk[s] >> 4) * bs[s];
            }
    float dy = QM_DK(a, r, k, b);
    return qm_half(blk + 80) * dy * (float)dots - qm_half(blk + 82) * dy * (float)mins;
}

/* Q3_K: d sum of (scale_j - 32) sum(q y), q from two low bits and the third (clear: -4). */
static float qm_iblk_q3_k(const uint8_t *blk, const qm_act *a, int r, ptrdiff_t k, ptrdiff_t b) {
    const uint8_t *hm = blk, *q = blk + 32;
    const int8_t *y = QM_YK(a, r, k, b);
    int sc[16], total = 0;
    qm_scales_q3_k(blk + 96, sc);
    for (int n = 0; n < 2; n++, q += 32)
        for (int j = 0; j < 4; j++)
            for (int h = 0; h < 2; h++) {
                int s = 8 * n + 2 * j + h, sum = 0;
                for (int l = 16 * h; l < 16 * h + 16; l++) {
                    int v = ((q[l] >> (2 * j)) & 3) - (((hm[l] >> (4 * n + j)) & 1) ? 0 : 4);
                    sum += v * y[16 * s + l - 16 * h];
                }
                total += sc[s] * sum;
            }
    return qm_half(blk + 108) * QM_DK(a, r, k, b) * (float)total;
}

/* IQ4_XS: d sum over eight sub-blocks of 32 of (scale - 32) sum(value y). */
static float qm_iblk_iq4_xs(const uint8_t *blk, const qm_act *a, int r, ptrdiff_t k,
                            ptrdiff_t b) {
    const uint8_t *qs = blk + 8;
    const int8_t *y = QM_YK(a, r, k, b);
    int total = 0;
    for (int ib = 0; ib < 8; ib++, qs += 16, y += 32) {
        int sum = 0;
        for (int j = 0; j < 16; j++)
            sum += qm_iq4nl[qs[j] & 0xF] * y[j] + qm_iq4nl[qs[j] >> 4] * y[j + 16];
        total += qm_scale_iq4_xs(blk, ib) * sum;
    }
    return qm_half(blk) * QM_DK(a, r, k, b) * (float)total;
}

static const qm_iblk_fn qm_iblk[QM_TYPES] = {
    qm_iblk_q8_0, qm_iblk_q4_0, qm_iblk_q4_1, qm_iblk_q4_k, qm_iblk_q6_k, NULL, NULL,
    qm_iblk_q5_0, qm_iblk_q5_1, qm_iblk_q2_k, qm_iblk_q3_k, qm_iblk_q5_k, qm_iblk_iq4_nl,
    qm_iblk_iq4_xs};

/* The reference integer dot of one weight row with R quantized activation rows. */
static inline void qm_idot_scalar(int type, const uint8_t *w, const qm_act *a, ptrdiff_t k,
                                  int R, float *s) {
    int bk = qm_block[type], bb = qm_block_bytes[type];
    for (int r = 0; r < R; r++) {
        float acc = 0.0f;
        for (ptrdiff_t b = 0; b < k / bk; b++) acc += qm_iblk[type](w + b * bb, a, r, k, b);
        s[r] = acc;
    }
}

#define QM_ISCALAR(T)                                                                       \
    static void qm_iscalar_##T(const uint8_t *w, const qm_act *a, ptrdiff_t k, int R,      \
                               float *s) {                                                 \
        qm_idot_scalar(T, w, a, k, R, s);                                                  \
    }
QM_ISCALAR(0) QM_ISCALAR(1) QM_ISCALAR(2) QM_ISCALAR(3) QM_ISCALAR(4) QM_ISCALAR(7)
QM_ISCALAR(8) QM_ISCALAR(9) QM_ISCALAR(10) QM_ISCALAR(11) QM_ISCALAR(12) QM_ISCALAR(13)
static const qm_idot_fn qm_iscalar[QM_TYPES] = {
    qm_iscalar_0, qm_iscalar_1, qm_iscalar_2, qm_iscalar_3, qm_iscalar_4, NULL, NULL,
    qm_iscalar_7, qm_iscalar_8, qm_iscalar_9, qm_iscalar_10, qm_iscalar_11, qm_iscalar_12,
    qm_iscalar_13};

/* -- Q4_K in groups of 8 interleaved rows (the x8 layout, qm_pack_x8) ----------------------
 *
 * A product's 8 consecutive weight rows are stored block by block together: per 256-weight
 * block, QM_X8_Q4K bytes:
 *   0   the 8 rows' d (f16), 16 their dmin (f16);
 *   32  sub-block j's 6-bit scale of row i at 32 + 8 j + i (bytes);
 *   96  sub-blocks 2p and 2p + 1's minimums of row i at 96 + 16 p + 2 i (+ 1), a pair;
 *   160 quants: for each 64 weights c and each 4 bytes t of their 32, the 8 rows' 4 bytes
 *       (row i's qs[32 c + 4 t ..]) at 160 + 32 (8 c + t) + 4 i.
 * A vector kernel then multiplies 4 bytes of an activation by the same 4 bytes of all 8 rows
 * in one instruction, each row in its own 32-bit lane, and scales the 8 rows' sums in one
 * vector: none of the per-row horizontal sums and scale picking of the row-by-row kernels
 * (the layout llama.cpp's repacked Q4_K takes for the same reason). The scalar reference
 * computes each row exactly as qm_iblk_q4_k does. */
#define QM_X8 8
#define QM_X8_Q4K 1184

/* IQ4_XS in the x8 layout, per 256-weight block, QM_X8_IQ4XS bytes:
 *   0   the 8 rows' d (f16);
 *   16  sub-blocks 2p and 2p + 1's scales (scale - 32, int8) of row i at 16 + 16 p + 2 i (+ 1);
 *   80  quants as Q4_K's: row i's qs[32 c + 4 t ..] at 80 + 32 (8 c + t) + 4 i (sub-block 2 c's
 *       16 bytes for t < 4, then 2 c + 1's). */
#define QM_X8_IQ4XS 1104

/* The 32-weight types' x8 layout, per block of a group: the 8 rows' d (f16), for Q4_1 and Q5_1
   their m (f16), then the quants, 4 bytes of each row at a time: for Q4_0, Q4_1, Q5_0, Q5_1
   and IQ4_NL (nibbles)
   row i's qs[4 t ..] at 32 t + 4 i past the scales (t = 0..3: the low nibbles weights 4 t..,
   the high ones 16 + 4 t..), for Q8_0 (bytes) row i's qs[4 t ..] likewise (t = 0..7). Q5_0's
   and Q5_1's fifth bits follow the quants (at f = 144, 160), a 32-bit mask per 32 nibbles, as
   the nibbles lie: the low nibbles' of t at f + 8 t, the high ones' at f + 4 + 8 t, bit 4 i + m
   the fifth bit of row i's weight 4 t + m (16 + 4 t + m). */
static inline int qm_x8_scales32(int type) {
    return type == QM_Q4_1 || type == QM_Q5_1 ? 32 : 16;
}

/* Whether a 32-weight type holds fifth bits (qh, after d and m). */
static inline int qm_fifth_bits(int type) { return type == QM_Q5_0 || type == QM_Q5_1; }

/* Bytes of one block of a group of the x8 layout (0: the type has none). */
static inline int qm_x8_block_bytes(int type) {
    switch (type) {
    case QM_Q4_K: return QM_X8_Q4K;
    case QM_IQ4_XS: return QM_X8_IQ4XS;
    case QM_Q4_0: case QM_Q4_1: case QM_IQ4_NL: return qm_x8_scales32(type) + 128;
    case QM_Q5_0: case QM_Q5_1: return qm_x8_scales32(type) + 128 + 32;
    case QM_Q8_0: return 16 + 256;
    default: return 0;
    }
}

/* Bytes of one group of QM_X8 rows of k weights of ``type`` in the x8 layout (0: none). */
static inline size_t qm_x8_bytes(int type, ptrdiff_t k) {
    return (size_t)(k / qm_block[type]) * (size_t)qm_x8_block_bytes(type);
}

/* The group block of rows w[0..8) (rb bytes apart), block b, into dst (QM_X8_Q4K bytes). */
static void qm_pack_q4k_block(const uint8_t *w, ptrdiff_t rb, ptrdiff_t b, uint8_t *dst) {
    for (int i = 0; i < QM_X8; i++) {
        const uint8_t *blk = w + i * rb + b * 144;
        memcpy(dst + 2 * i, blk, 2);
        memcpy(dst + 16 + 2 * i, blk + 2, 2);
        for (int j = 0; j < 8; j++) {
            int sc, m;
            qm_scale_min_k4(j, blk + 4, &sc, &m);
            dst[32 + 8 * j + i] = (uint8_t)sc;
            dst[96 + 16 * (j / 2) + 2 * i + (j % 2)] = (uint8_t)m;
        }
        for (int c = 0; c < 4; c++)
            for (int t = 0; t < 8; t++)
                memcpy(dst + 160 + 32 * (8 * c + t) + 4 * i, blk + 16 + 32 * c + 4 * t, 4);
    }
}

/* The same for IQ4_XS (QM_X8_IQ4XS bytes). */
static void qm_pack_iq4xs_block(const uint8_t *w, ptrdiff_t rb, ptrdiff_t b, uint8_t *dst) {
    for (int i = 0; i < QM_X8; i++) {
        const uint8_t *blk = w + i * rb + b * 136;
        memcpy(dst + 2 * i, blk, 2);
        for (int j = 0; j < 8; j++)
            dst[16 + 16 * (j / 2) + 2 * i + (j % 2)] = (uint8_t)(int8_t)qm_scale_iq4_xs(blk, j);
        for (int c = 0; c < 4; c++)
            for (int t = 0; t < 8; t++)
                memcpy(dst + 80 + 32 * (8 * c + t) + 4 * i, blk + 8 + 32 * c + 4 * t, 4);
    }
}

/* The same for a 32-weight type's block (bb bytes a row's). */
static void qm_pack32_block(int type, const uint8_t *w, ptrdiff_t rb, ptrdiff_t b,
                            uint8_t *dst) {
    int bb = qm_block_bytes[type], at = qm_x8_scales32(type), quants = type == QM_Q8_0 ? 8 : 4;
    if (qm_fifth_bits(type)) memset(dst + at + 128, 0, 32);
    for (int i = 0; i < QM_X8; i++) {
        const uint8_t *blk = w + i * rb + b * bb;
        memcpy(dst + 2 * i, blk, 2);
        if (at == 32) memcpy(dst + 16 + 2 * i, blk + 2, 2);
        for (int t = 0; t < quants; t++)
            memcpy(dst + at + 32 * t + 4 * i, blk + (bb - 4 * quants) + 4 * t, 4);
        if (!qm_fifth_bits(type)) continue;
        uint32_t qh = qm_u32(blk + (at == 32 ? 4 : 2));  /* after d (and m) */
        for (int t = 0; t < 8; t++) {  /* mask t: nibbles t / 2's low (t even) or high */
            uint32_t bits = (qh >> (t % 2 ? 16 + 4 * (t / 2) : 4 * (t / 2))) & 0xF;
            dst[at + 128 + 4 * t + i / 2] |= (uint8_t)(bits << (4 * (i % 2)));
        }
    }
}

/* out = the n rows of k weights at w (n a multiple of QM_X8) in the x8 layout: group g's
   blocks at out + g qm_x8_bytes(type, k). Returns 0, or -1 for a type without one. */
static inline int qm_pack_x8(int type, const uint8_t *w, ptrdiff_t n, ptrdiff_t k, uint8_t *out,
                             int threads) {
    if (qm_x8_bytes(type, k) == 0 || n % QM_X8) return -1;
    ptrdiff_t bk = qm_block[type], nb = k / bk, rb = nb * qm_block_bytes[type];
    size_t xb = (size_t)qm_x8_block_bytes(type);
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (ptrdiff_t g = 0; g < n / QM_X8; g++)
        for (ptrdiff_t b = 0; b < nb; b++) {
            uint8_t *dst = out + (size_t)(g * nb + b) * xb;
            if (type == QM_Q4_K) qm_pack_q4k_block(w + g * QM_X8 * rb, rb, b, dst);
            else if (type == QM_IQ4_XS) qm_pack_iq4xs_block(w + g * QM_X8 * rb, rb, b, dst);
            else qm_pack32_block(type, w + g * QM_X8 * rb, rb, b, dst);
        }
    return 0;
}

/* Row i's block of a 32-weight type back from a group block g into blk (the scalar
   reference multiplies it as the row kernels' reference does). */
static void qm_unpack32_block(int type, const uint8_t *g, int i, uint8_t *blk) {
    int bb = qm_block_bytes[type], at = qm_x8_scales32(type), quants = type == QM_Q8_0 ? 8 : 4;
    memcpy(blk, g + 2 * i, 2);
    if (at == 32) memcpy(blk + 2, g + 16 + 2 * i, 2);
    for (int t = 0; t < quants; t++)
        memcpy(blk + (bb - 4 * quants) + 4 * t, g + at + 32 * t + 4 * i, 4);
    if (!qm_fifth_bits(type)) return;
    uint32_t qh = 0;
    for (int t = 0; t < 8; t++) {
        uint32_t bits = (g[at + 128 + 4 * t + i / 2] >> (4 * (i % 2))) & 0xF;
        qh |= bits << (t % 2 ? 16 + 4 * (t / 2) : 4 * (t / 2));
    }
    for (int j = 0; j < 4; j++) blk[(at == 32 ? 4 : 2) + j] = (uint8_t)(qh >> (8 * j));
}

/* The 32-weight types' scalar reference: each row as qm_iblk computes it, block by block. */
static void qm_x8_scalar32(int type, const uint8_t *g, const qm_act *a, ptrdiff_t k, int R,
                           float *s) {
    ptrdiff_t nb = k / 32, xb = qm_x8_block_bytes(type);
    uint8_t blk[34];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < QM_X8; i++) {
            float acc = 0.0f;
            for (ptrdiff_t b = 0; b < nb; b++) {
                qm_unpack32_block(type, g + b * xb, i, blk);
                acc += qm_iblk[type](blk, a, r, k, b);
            }
            s[QM_X8 * r + i] = acc;
        }
}

#define QM_X8SCALAR32(T, name)                                                                \
    static void qm_x8_scalar_##name(const uint8_t *g, const qm_act *a, ptrdiff_t k, int R,   \
                                    float *s) {                                              \
        qm_x8_scalar32(T, g, a, k, R, s);                                                    \
    }
QM_X8SCALAR32(QM_Q4_0, q4_0)
QM_X8SCALAR32(QM_Q4_1, q4_1)
QM_X8SCALAR32(QM_Q8_0, q8_0)
QM_X8SCALAR32(QM_Q5_0, q5_0)
QM_X8SCALAR32(QM_Q5_1, q5_1)
QM_X8SCALAR32(QM_IQ4_NL, iq4_nl)

/* The scalar reference: each row as qm_iblk_q4_k computes it, block by block. */
static void qm_x8_scalar_q4k(const uint8_t *g, const qm_act *a, ptrdiff_t k, int R, float *s) {
    ptrdiff_t nb = k / 256;
    for (int r = 0; r < R; r++)
        for (int i = 0; i < QM_X8; i++) {
            float acc = 0.0f;
            for (ptrdiff_t b = 0; b < nb; b++) {
                const uint8_t *blk = g + b * QM_X8_Q4K;
                const int8_t *y = QM_YK(a, r, k, b);
                const int16_t *bs = QM_BS(a, r, k, b);
                int dots = 0, mins = 0;
                for (int j = 0; j < 8; j++) {
                    int sum = 0, c = j / 2;
                    for (int l = 0; l < 32; l++) {
                        uint8_t q = blk[160 + 32 * (8 * c + l / 4) + 4 * i + l % 4];
                        sum += (j % 2 ? q >> 4 : q & 0xF) * y[32 * j + l];
                    }
                    dots += blk[32 + 8 * j + i] * sum;
                    mins += blk[96 + 16 * c + 2 * i + j % 2] * (bs[2 * j] + bs[2 * j + 1]);
                }
                float dy = QM_DK(a, r, k, b);
                acc += qm_half(blk + 2 * i) * dy * (float)dots
                       - qm_half(blk + 16 + 2 * i) * dy * (float)mins;
            }
            s[QM_X8 * r + i] = acc;
        }
}

/* Row i's IQ4_XS block back from a group block g into blk (136 bytes). */
static void qm_unpack_iq4xs_block(const uint8_t *g, int i, uint8_t *blk) {
    memcpy(blk, g + 2 * i, 2);
    unsigned high = 0;
    memset(blk + 4, 0, 4);
    for (int j = 0; j < 8; j++) {
        int ls = (int8_t)g[16 + 16 * (j / 2) + 2 * i + (j % 2)] + 32;  /* 6 bits */
        blk[4 + j / 2] |= (uint8_t)((ls & 0xF) << (4 * (j % 2)));
        high |= (unsigned)(ls >> 4) << (2 * j);
    }
    blk[2] = (uint8_t)high;
    blk[3] = (uint8_t)(high >> 8);
    for (int c = 0; c < 4; c++)
        for (int t = 0; t < 8; t++)
            memcpy(blk + 8 + 32 * c + 4 * t, g + 80 + 32 * (8 * c + t) + 4 * i, 4);
}

/* The scalar reference: each row's blocks back from the groups, multiplied as the rows'
   reference multiplies them (qm_iblk). */
static void qm_x8_scalar_iq4xs(const uint8_t *g, const qm_act *a, ptrdiff_t k, int R,
                               float *s) {
    uint8_t blk[136];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < QM_X8; i++) {
            float acc = 0.0f;
            for (ptrdiff_t b = 0; b < k / 256; b++) {
                qm_unpack_iq4xs_block(g + b * QM_X8_IQ4XS, i, blk);
                acc += qm_iblk[QM_IQ4_XS](blk, a, r, k, b);
            }
            s[QM_X8 * r + i] = acc;
        }
}

static const qm_x8_fn qm_x8scalar[QM_TYPES] = {
    [QM_Q4_K] = qm_x8_scalar_q4k, [QM_Q4_0] = qm_x8_scalar_q4_0, [QM_Q4_1] = qm_x8_scalar_q4_1,
    [QM_Q8_0] = qm_x8_scalar_q8_0, [QM_Q5_0] = qm_x8_scalar_q5_0,
    [QM_Q5_1] = qm_x8_scalar_q5_1, [QM_IQ4_NL] = qm_x8_scalar_iq4_nl,
    [QM_IQ4_XS] = qm_x8_scalar_iq4xs};
