/* The integer kernels of quant_q8.h on AVX2 (x86-64): a block's quants unpacked to bytes once
 * (unsigned, or signed with their magnitudes and signs apart), then for each activation row
 * vpmaddubsw (unsigned bytes by signed bytes, pairs summed to 16 bits) and vpmaddwd (pairs to
 * 32 bits, by one or by the sub-block's scale), the block's int32 sums converted to float once
 * and scaled by the weight's and the row's scales. Included by quant_q8.h on x86-64 only.
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

/* sumi[r] += (q by row r's 32 quants at y + at) by the 16-bit scales sc, for R rows; q
   unsigned, or (signs not NULL) the magnitudes of signed quants whose signs *signs carries. */
QA_ALWAYS void qa_rows_k(const qm_act *a, ptrdiff_t k, ptrdiff_t at, const int R, __m256i q,
                         const __m256i *signs, __m256i sc, __m256i *sumi) {
    QA_UNROLL
    for (int r = 0; r < R; r++) {
        __m256i y = qa_load(a->qk + r * k + at);
        if (signs) y = _mm256_sign_epi8(y, *signs);
        sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(_mm256_maddubs_epi16(q, y), sc));
    }
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

/* Q4_K (five = 0) or Q5_K block b: per 64 weights the two sub-blocks' quants unpacked once
   and their scales picked, then every row's products by them; the sums scaled and the mins
   taken by the 16-sums (bsums), each sub-block's minimum twice. */
QA_ALWAYS void qa_blk_k45(const uint8_t *blk, const qm_act *a, ptrdiff_t k, ptrdiff_t b,
                          const int R, int five, __m256i *sumi, __m256 *acc) {
    const __m256i low4 = _mm256_set1_epi8(0xF), one = _mm256_set1_epi8(1);
    const uint8_t *qs = blk + (five ? 48 : 16);
    __m128i sm = qa_scales_k4(blk + 4);
    __m256i scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));
    __m256i mins16 = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(sm, sm));
    QA_UNROLL
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
        qa_rows_k(a, k, 256 * b + 64 * c, R, lo, NULL, qa_lane16(scales, 2 * c), sumi);
        qa_rows_k(a, k, 256 * b + 64 * c + 32, R, hi, NULL, qa_lane16(scales, 2 * c + 1), sumi);
    }
    qa_scale_k(a, k, b, R, QS_HALF(blk), QS_HALF(blk + 2), &mins16, sumi, acc);
}

/* Q6_K block b: the offset (32 by each scale by its 16-sum) first; per 32 weights their
   six-bit quants (0..63) unpacked once and their two int8 scales picked, then every row's
   products; the sums scaled. */
QA_ALWAYS void qa_blk_q6_k(const uint8_t *blk, const qm_act *a, ptrdiff_t k, ptrdiff_t b,
                           const int R, __m256i *sumi, __m256 *acc) {
    const __m256i low4 = _mm256_set1_epi8(0xF), low2 = _mm256_set1_epi8(3);
    __m128i scales8 = _mm_loadu_si128((const __m128i *)(blk + 192));
    qa_offset_k(a, k, b, R, _mm256_cvtepi8_epi16(scales8), 5, sumi);
    QA_UNROLL
    for (int i = 0; i < 8; i++) {  /* weights 32 i ..: sub-blocks 2i and 2i + 1 */
        int half = i / 4, g = i % 4;
        __m256i l = qa_load(blk + 64 * half + 32 * (g % 2));
        __m256i lo = _mm256_and_si256(g < 2 ? l : _mm256_srli_epi16(l, 4), low4);
        __m256i h = _mm256_and_si256(
            _mm256_srli_epi16(qa_load(blk + 128 + 32 * half), 2 * g), low2);
        __m256i q = _mm256_or_si256(lo, _mm256_slli_epi16(h, 4));
        qa_rows_k(a, k, 256 * b + 32 * i, R, q, NULL, qa_pick2(scales8, i), sumi);
    }
    qa_scale_k(a, k, b, R, QS_HALF(blk + 208), 0.0f, NULL, sumi, acc);
}

/* Q2_K block b: per 32 weights their 2-bit quants unpacked once and their two 4-bit scales
   picked, then every row's products; the sums scaled and the 4-bit mins (one per 16
   weights) taken by the 16-sums. */
QA_ALWAYS void qa_blk_q2_k(const uint8_t *blk, const qm_act *a, ptrdiff_t k, ptrdiff_t b,
                           const int R, __m256i *sumi, __m256 *acc) {
    const __m256i low2 = _mm256_set1_epi8(3);
    const __m128i low4 = _mm_set1_epi8(0xF);
    __m128i packed = _mm_loadu_si128((const __m128i *)blk);
    __m128i scales8 = _mm_and_si128(packed, low4);
    __m256i mins16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), low4));
    QA_UNROLL
    for (int i = 0; i < 8; i++) {  /* weights 32 i ..: bits 2 (i % 4) of 32 bytes */
        __m256i bits = qa_load(blk + 16 + 32 * (i / 4));
        __m256i q = _mm256_and_si256(_mm256_srli_epi16(bits, 2 * (i % 4)), low2);
        qa_rows_k(a, k, 256 * b + 32 * i, R, q, NULL, qa_pick2(scales8, i), sumi);
    }
    qa_scale_k(a, k, b, R, QS_HALF(blk + 80), QS_HALF(blk + 82), &mins16, sumi, acc);
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

/* Q3_K block b, its quants as 4 + q (0..7: two low bits and the third times 4): the offset
   (4 by each scale by its 16-sum) first; per 32 weights the quants unpacked once and their
   two scales picked, then every row's products; the sums scaled. */
QA_ALWAYS void qa_blk_q3_k(const uint8_t *blk, const qm_act *a, ptrdiff_t k, ptrdiff_t b,
                           const int R, __m256i *sumi, __m256 *acc) {
    const __m256i low2 = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
    __m128i scales8 = qa_scales_q3_k(blk + 96);
    __m256i hmask = qa_load(blk);
    qa_offset_k(a, k, b, R, _mm256_cvtepi8_epi16(scales8), 2, sumi);
    QA_UNROLL
    for (int i = 0; i < 8; i++) {  /* weights 32 i ..: bits 2 (i % 4) of 32 bytes, bit i */
        __m256i bits = qa_load(blk + 32 + 32 * (i / 4));
        __m256i lo = _mm256_and_si256(_mm256_srli_epi16(bits, 2 * (i % 4)), low2);
        __m256i at2 = i < 2 ? _mm256_slli_epi16(hmask, 2 - i) : _mm256_srli_epi16(hmask, i - 2);
        __m256i q = _mm256_or_si256(lo, _mm256_and_si256(at2, four));
        qa_rows_k(a, k, 256 * b + 32 * i, R, q, NULL, qa_pick2(scales8, i), sumi);
    }
    qa_scale_k(a, k, b, R, QS_HALF(blk + 108), 0.0f, NULL, sumi, acc);
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

/* IQ4_XS block b: per 32 weights the values their nibbles index (magnitudes and signs
   apart) and their scale picked once, then every row's products; the sums scaled. */
QA_ALWAYS void qa_blk_iq4_xs(const uint8_t *blk, const qm_act *a, ptrdiff_t k, ptrdiff_t b,
                             const int R, __m256i *sumi, __m256 *acc) {
    const __m256i values = _mm256_broadcastsi128_si256(
        _mm_loadu_si128((const __m128i *)qm_iq4nl));
    __m256i scales = qa_scales_iq4_xs(blk);
    QA_UNROLL
    for (int ib = 0; ib < 8; ib++) {
        __m256i x = _mm256_shuffle_epi8(values, qa_nibbles(blk + 8 + 16 * ib));
        __m256i sc = _mm256_permutevar8x32_epi32(scales, _mm256_set1_epi32(ib));
        qa_rows_k(a, k, 256 * b + 32 * ib, R, _mm256_sign_epi8(x, x), &x, sc, sumi);
    }
    qa_scale_k(a, k, b, R, QS_HALF(blk), 0.0f, NULL, sumi, acc);
}

/* The 256-weight types against R rows: per block, its quants against every row into int32
   sums (sumi), scaled into acc at the block's end. */
QA_ALWAYS void qa_dot_k(int type, const uint8_t *w, const qm_act *a, ptrdiff_t k, const int R,
                        float *s) {
    const int bb = qm_block_bytes[type];
    __m256 acc[QM_IGROUP];
    __m256i sumi[QM_IGROUP];
    QA_UNROLL
    for (int r = 0; r < R; r++) { acc[r] = _mm256_setzero_ps(); sumi[r] = _mm256_setzero_si256(); }
    for (ptrdiff_t b = 0; b < k / 256; b++) {
        const uint8_t *blk = w + b * bb;
        switch (type) {
        case QM_Q2_K: qa_blk_q2_k(blk, a, k, b, R, sumi, acc); break;
        case QM_Q3_K: qa_blk_q3_k(blk, a, k, b, R, sumi, acc); break;
        case QM_Q4_K: qa_blk_k45(blk, a, k, b, R, 0, sumi, acc); break;
        case QM_Q5_K: qa_blk_k45(blk, a, k, b, R, 1, sumi, acc); break;
        case QM_Q6_K: qa_blk_q6_k(blk, a, k, b, R, sumi, acc); break;
        default: qa_blk_iq4_xs(blk, a, k, b, R, sumi, acc);
        }
    }
    QA_UNROLL
    for (int r = 0; r < R; r++) s[r] = qa_hsum(acc[r]);
}

#define QA_BY_ROWS(name, CALL) QM_BY_ROWS(QA_ATTR, name, CALL)
#define QA_Q8_0(R_) qa_dot32(QM_Q8_0, w, a, k, R_, s)
#define QA_Q4_0(R_) qa_dot32(QM_Q4_0, w, a, k, R_, s)
#define QA_Q4_1(R_) qa_dot32(QM_Q4_1, w, a, k, R_, s)
#define QA_Q5_0(R_) qa_dot32(QM_Q5_0, w, a, k, R_, s)
#define QA_Q5_1(R_) qa_dot32(QM_Q5_1, w, a, k, R_, s)
#define QA_IQ4_NL(R_) qa_dot32(QM_IQ4_NL, w, a, k, R_, s)
#define QA_Q2_K(R_) qa_dot_k(QM_Q2_K, w, a, k, R_, s)
#define QA_Q3_K(R_) qa_dot_k(QM_Q3_K, w, a, k, R_, s)
#define QA_Q4_K(R_) qa_dot_k(QM_Q4_K, w, a, k, R_, s)
#define QA_Q5_K(R_) qa_dot_k(QM_Q5_K, w, a, k, R_, s)
#define QA_Q6_K(R_) qa_dot_k(QM_Q6_K, w, a, k, R_, s)
#define QA_IQ4_XS(R_) qa_dot_k(QM_IQ4_XS, w, a, k, R_, s)
QA_BY_ROWS(qa_q8_0, QA_Q8_0)
QA_BY_ROWS(qa_q4_0, QA_Q4_0)
QA_BY_ROWS(qa_q4_1, QA_Q4_1)
QA_BY_ROWS(qa_q5_0, QA_Q5_0)
QA_BY_ROWS(qa_q5_1, QA_Q5_1)
QA_BY_ROWS(qa_iq4_nl, QA_IQ4_NL)
QA_BY_ROWS(qa_q2_k, QA_Q2_K)
QA_BY_ROWS(qa_q3_k, QA_Q3_K)
QA_BY_ROWS(qa_q4_k, QA_Q4_K)
QA_BY_ROWS(qa_q5_k, QA_Q5_K)
QA_BY_ROWS(qa_q6_k, QA_Q6_K)
QA_BY_ROWS(qa_iq4_xs, QA_IQ4_XS)

/* The AVX2 integer kernels by type (NULL: none here; that type multiplies in float32). */
static const qm_idot_fn qm_itable_avx2[QM_TYPES] = {
    qa_q8_0, qa_q4_0, qa_q4_1, qa_q4_k, qa_q6_k, NULL, NULL, qa_q5_0, qa_q5_1, qa_q2_k, qa_q3_k,
    qa_q5_k, qa_iq4_nl, qa_iq4_xs};
#define QM_ITABLE qm_itable_avx2
