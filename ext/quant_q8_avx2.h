/* The integer kernels of quant_q8.h on AVX2 (x86-64): a block's quants unpacked to bytes once
 * (unsigned, or signed with their magnitudes and signs apart), then for each activation row
 * vpmaddubsw (unsigned bytes by signed bytes, pairs summed to 16 bits) and vpmaddwd (pairs to
 * 32 bits, by one or by the sub-block's scale), the block's int32 sums converted to float once
 * and scaled by the weight's and the row's scales. Included by quant_q8.h on x86-64 only.
 *
 * Bounds: a pair of 6-bit (Q6_K) or smaller quants by 8-bit activations (|y| <= 127) sums to
 * at most 2 * 63 * 127 < 32767, so vpmaddubsw never saturates.
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

/* Eight int32 sums of four products each: unsigned bytes u by signed bytes y. */
QA_ALWAYS __m256i qa_madd_us(__m256i u, __m256i y) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, y), _mm256_set1_epi16(1));
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

/* One 32-weight block b against R rows, into acc (one vector per row) and mins (Q4_1's and
   Q5_1's m * s). */
QA_ALWAYS void qa_blk32(int type, const uint8_t *blk, const qm_act *a, ptrdiff_t k,
                        ptrdiff_t b, const int R, __m256 *acc, float *mins) {
    const ptrdiff_t nb = k / 32;
    const int has_min = type == QM_Q4_1 || type == QM_Q5_1;
    __m256i u, x = _mm256_setzero_si256();
    int is_signed = qa_unpack32(type, blk, &u, &x);
    qs_f4 dm = has_min ? QS_HALF2(blk) : (qs_f4){QS_HALF(blk), 0.0f, 0.0f, 0.0f};
    float dw = dm[0];
    QA_UNROLL
    for (int r = 0; r < R; r++) {
        __m256i y = qa_load(a->q32 + r * k + 32 * b);
        __m256i p = qa_madd_us(u, is_signed ? _mm256_sign_epi8(y, x) : y);
        __m256 d = _mm256_set1_ps(dw * a->d32[r * nb + b]);
        acc[r] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(p), acc[r]);
    }
    if (has_min) {
        QA_UNROLL
        for (int r = 0; r < R; r++) mins[r] += dm[1] * a->s32[r * nb + b];
    }
}

/* The 32-weight types against R rows: even and odd blocks in two accumulators per row (two
   chains, each half as long) where R <= 4. */
QA_ALWAYS void qa_dot32(int type, const uint8_t *w, const qm_act *a, ptrdiff_t k, const int R,
                        float *s) {
    const int bb = qm_block_bytes[type];
    const ptrdiff_t nb = k / 32;
    __m256 even[QM_IGROUP], odd[QM_IGROUP];
    float mins_even[QM_IGROUP], mins_odd[QM_IGROUP];
    QA_UNROLL
    for (int r = 0; r < R; r++) {
        even[r] = odd[r] = _mm256_setzero_ps();
        mins_even[r] = mins_odd[r] = 0.0f;
    }
    ptrdiff_t b = 0;
    if (R <= 4)
        for (; b + 1 < nb; b += 2) {
            qa_blk32(type, w + b * bb, a, k, b, R, even, mins_even);
            qa_blk32(type, w + (b + 1) * bb, a, k, b + 1, R, odd, mins_odd);
        }
    for (; b < nb; b++) qa_blk32(type, w + b * bb, a, k, b, R, even, mins_even);
    QA_UNROLL
    for (int r = 0; r < R; r++)
        s[r] = qa_hsum(_mm256_add_ps(even[r], odd[r])) + (mins_even[r] + mins_odd[r]);
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

/* acc[r] += dw dy sumi[r] - mw dy m (m the row's mins by the pairs of its 16-sums, where
   mins is not NULL) for R rows of block b, then sumi cleared. */
QA_ALWAYS void qa_scale_k(const qm_act *a, ptrdiff_t k, ptrdiff_t b, const int R, float dw,
                          float mw, const __m128i *mins, __m256i *sumi, __m256 *acc) {
    const ptrdiff_t nb = k / 256;
    QA_UNROLL
    for (int r = 0; r < R; r++) {
        float dy = a->dk[r * (nb + 1) + b];
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * dy), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
        if (mins) {
            __m256i bs = qa_load(a->bsums + r * (k / 16) + 16 * b);
            __m128i pairs = _mm_hadd_epi16(_mm256_castsi256_si128(bs),
                                           _mm256_extracti128_si256(bs, 1));
            __m256i m = _mm256_zextsi128_si256(_mm_madd_epi16(*mins, pairs));
            acc[r] = _mm256_fnmadd_ps(_mm256_set1_ps(mw * dy), _mm256_cvtepi32_ps(m), acc[r]);
        }
        sumi[r] = _mm256_setzero_si256();
    }
}

/* sumi[r] += (q by row r's 32 quants at y + at) by the 16-bit scales sc, for R rows. */
QA_ALWAYS void qa_rows_k(const qm_act *a, ptrdiff_t k, ptrdiff_t at, const int R, __m256i q,
                         __m256i sc, __m256i *sumi) {
    QA_UNROLL
    for (int r = 0; r < R; r++)
        sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(
            _mm256_maddubs_epi16(q, qa_load(a->qk + r * k + at)), sc));
}

/* Q4_K (five = 0) or Q5_K against R rows: per 64 weights the two sub-blocks' quants unpacked
   once and their scales picked, then every row's products by them; per block the sums
   scaled and the mins taken by the pairs of 16-sums (bsums) under each sub-block. */
QA_ALWAYS void qa_dot_k45(const uint8_t *w, const qm_act *a, ptrdiff_t k, const int R,
                          float *s, int five) {
    const int bb = five ? 176 : 144;
    const ptrdiff_t nb = k / 256;
    const __m256i low4 = _mm256_set1_epi8(0xF), one = _mm256_set1_epi8(1);
    __m256 acc[QM_IGROUP];
    __m256i sumi[QM_IGROUP];
    QA_UNROLL
    for (int r = 0; r < R; r++) { acc[r] = _mm256_setzero_ps(); sumi[r] = _mm256_setzero_si256(); }
    for (ptrdiff_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * bb, *qs = blk + (five ? 48 : 16);
        __m128i sm = qa_scales_k4(blk + 4);
        __m256i scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));
        __m128i mins = _mm_cvtepu8_epi16(_mm_unpackhi_epi64(sm, sm));
        for (int c = 0; c < 4; c++) {
            __m256i bits = qa_load(qs + 32 * c);
            __m256i lo = _mm256_and_si256(bits, low4);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), low4);
            if (five) {
                __m256i hb = qa_load(blk + 16);
                __m256i h0 = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * c), one);
                __m256i h1 = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * c + 1), one);
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(h0, 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(h1, 4));
            }
            qa_rows_k(a, k, 256 * b + 64 * c, R, lo, qa_lane16(scales, 2 * c), sumi);
            qa_rows_k(a, k, 256 * b + 64 * c + 32, R, hi, qa_lane16(scales, 2 * c + 1), sumi);
        }
        qa_scale_k(a, k, b, R, QS_HALF(blk), QS_HALF(blk + 2), &mins, sumi, acc);
    }
    QA_UNROLL
    for (int r = 0; r < R; r++) s[r] = qa_hsum(acc[r]);
}

/* Q6_K against R rows: per 32 weights their six-bit quants (0..63) unpacked once and their
   two int8 scales picked, then every row's products; per block 32 * scale * bsum taken off
   for the offset, and the sums scaled. */
QA_ALWAYS void qa_dot_q6_k(const uint8_t *w, const qm_act *a, ptrdiff_t k, const int R,
                           float *s) {
    const ptrdiff_t nb = k / 256;
    const __m256i low4 = _mm256_set1_epi8(0xF), low2 = _mm256_set1_epi8(3);
    __m256 acc[QM_IGROUP];
    __m256i sumi[QM_IGROUP];
    QA_UNROLL
    for (int r = 0; r < R; r++) { acc[r] = _mm256_setzero_ps(); sumi[r] = _mm256_setzero_si256(); }
    for (ptrdiff_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * 210;
        __m128i scales8 = _mm_loadu_si128((const __m128i *)(blk + 192));
        __m256i sc16 = _mm256_cvtepi8_epi16(scales8);
        QA_UNROLL
        for (int r = 0; r < R; r++)  /* the offset first: -32 scale bsum */
            sumi[r] = _mm256_sub_epi32(sumi[r], _mm256_slli_epi32(_mm256_madd_epi16(
                sc16, qa_load(a->bsums + r * (k / 16) + 16 * b)), 5));
        for (int i = 0; i < 8; i++) {  /* weights 32 i ..: sub-blocks 2i and 2i + 1 */
            int half = i / 4, g = i % 4;
            __m256i l = qa_load(blk + 64 * half + 32 * (g % 2));
            __m256i lo = _mm256_and_si256(g < 2 ? l : _mm256_srli_epi16(l, 4), low4);
            __m256i h = _mm256_and_si256(
                _mm256_srli_epi16(qa_load(blk + 128 + 32 * half), 2 * g), low2);
            __m256i q = _mm256_or_si256(lo, _mm256_slli_epi16(h, 4));
            __m128i pick = _mm_set_epi8(2 * i + 1, 2 * i + 1, 2 * i + 1, 2 * i + 1, 2 * i + 1,
                                        2 * i + 1, 2 * i + 1, 2 * i + 1, 2 * i, 2 * i, 2 * i,
                                        2 * i, 2 * i, 2 * i, 2 * i, 2 * i);
            __m256i sc = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales8, pick));
            qa_rows_k(a, k, 256 * b + 32 * i, R, q, sc, sumi);
        }
        qa_scale_k(a, k, b, R, QS_HALF(blk + 208), 0.0f, NULL, sumi, acc);
    }
    QA_UNROLL
    for (int r = 0; r < R; r++) s[r] = qa_hsum(acc[r]);
}

/* One function per type with R fixed in each branch (the loops over rows unrolled). */
#define QA_BY_ROWS(name, CALL)                                                                \
    QA_ATTR static void name(const uint8_t *w, const qm_act *a, ptrdiff_t k, int R, float *s) { \
        switch (R) {                                                                          \
        case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break;               \
        case 4: CALL(4); break; case 5: CALL(5); break; case 6: CALL(6); break;               \
        case 7: CALL(7); break; default: CALL(8); break;                                      \
        }                                                                                     \
    }
#define QA_Q8_0(R_) qa_dot32(QM_Q8_0, w, a, k, R_, s)
#define QA_Q4_0(R_) qa_dot32(QM_Q4_0, w, a, k, R_, s)
#define QA_Q4_1(R_) qa_dot32(QM_Q4_1, w, a, k, R_, s)
#define QA_Q5_0(R_) qa_dot32(QM_Q5_0, w, a, k, R_, s)
#define QA_Q5_1(R_) qa_dot32(QM_Q5_1, w, a, k, R_, s)
#define QA_IQ4_NL(R_) qa_dot32(QM_IQ4_NL, w, a, k, R_, s)
#define QA_Q4_K(R_) qa_dot_k45(w, a, k, R_, s, 0)
#define QA_Q5_K(R_) qa_dot_k45(w, a, k, R_, s, 1)
#define QA_Q6_K(R_) qa_dot_q6_k(w, a, k, R_, s)
QA_BY_ROWS(qa_q8_0, QA_Q8_0)
QA_BY_ROWS(qa_q4_0, QA_Q4_0)
QA_BY_ROWS(qa_q4_1, QA_Q4_1)
QA_BY_ROWS(qa_q5_0, QA_Q5_0)
QA_BY_ROWS(qa_q5_1, QA_Q5_1)
QA_BY_ROWS(qa_iq4_nl, QA_IQ4_NL)
QA_BY_ROWS(qa_q4_k, QA_Q4_K)
QA_BY_ROWS(qa_q5_k, QA_Q5_K)
QA_BY_ROWS(qa_q6_k, QA_Q6_K)

/* The AVX2 integer kernels by type (NULL: none here; that type multiplies in float32). */
static const qm_idot_fn qm_itable_avx2[QM_TYPES] = {
    qa_q8_0, qa_q4_0, qa_q4_1, qa_q4_k, qa_q6_k, NULL, NULL, qa_q5_0, qa_q5_1, NULL, NULL,
    qa_q5_k, qa_iq4_nl, NULL};
#define QM_ITABLE qm_itable_avx2
