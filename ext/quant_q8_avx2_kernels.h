/* The integer kernels of quant_q8_avx2.h by type, included there once per variant with
 * QK(name) naming this variant's functions, QK_ATTR its target attribute and QK_VNNI 1 where
 * AVX512-VNNI's vpdpbusd / vpdpwssd (on 256-bit vectors) fuse a product with its pair sums
 * and its accumulation, 0 for AVX2's vpmaddubsw + vpmaddwd + vpaddd. The sums are the same
 * integers either way (no step saturates: see quant_q8_avx2.h).
 */
#define QK_ALWAYS QK_ATTR static inline __attribute__((always_inline))
/* A loop over a row's (or an x8 group's) blocks prefetches the bytes QK_AHEAD past each
   block, as quant_simd.h's loops do QS_AHEAD past theirs: one thread streams 1.06-1.18x
   faster (AVX512 EPYC, bin/bench-quant --dots x8,q8 --rows 1: Q4_K x8 28-30 -> 33-36 GB/s,
   Q6_K 27-28 -> 29-31); 8 KB measured a little faster than 2 or 4 and as fast as 16. */
#define QK_AHEAD 8192
QK_ALWAYS void QK(ahead)(const uint8_t *at, int bytes) {
    for (int i = 0; i < bytes; i += 64) __builtin_prefetch(at + QK_AHEAD + i);
}

/* Eight int32 sums of four products each: unsigned bytes u by signed bytes y. */
QK_ALWAYS __m256i QK(madd_us)(__m256i u, __m256i y) {
#if QK_VNNI
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, y);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, y), _mm256_set1_epi16(1));
#endif
}

/* One 32-weight block b against R rows, into acc (one vector per row) and mins (Q4_1's and
   Q5_1's m * s). */
QK_ALWAYS void QK(blk32)(int type, const uint8_t *blk, const qm_act *a, ptrdiff_t k,
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
        __m256i p = QK(madd_us)(u, is_signed ? _mm256_sign_epi8(y, x) : y);
        __m256 d = _mm256_set1_ps(dw * a->d32[r * nb + b]);
        acc[r] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(p), acc[r]);
    }
    if (has_min) {
        QA_UNROLL
        for (int r = 0; r < R; r++) mins[r] = fmaf(dm[1], a->s32[r * nb + b], mins[r]);
    }
}

/* The 32-weight types against R <= 4 rows: even and odd blocks in two accumulators per row
   (two chains, each half as long). */
QK_ALWAYS void QK(dot32_4)(int type, const uint8_t *w, const qm_act *a, ptrdiff_t k, const int R,
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
    for (; b + 1 < nb; b += 2) {
        QK(ahead)(w + b * bb, 2 * bb);
        QK(blk32)(type, w + b * bb, a, k, b, R, even, mins_even);
        QK(blk32)(type, w + (b + 1) * bb, a, k, b + 1, R, odd, mins_odd);
    }
    for (; b < nb; b++) QK(blk32)(type, w + b * bb, a, k, b, R, even, mins_even);
    QA_UNROLL
    for (int r = 0; r < R; r++)
        s[r] = qa_hsum(_mm256_add_ps(even[r], odd[r])) + (mins_even[r] + mins_odd[r]);
}

/* The 32-weight types against R rows, at most 4 at a time: a row's sums are the same, bit for
   bit, whatever rows share its pass (a verified draft's logits are those of a lone row). */
QK_ALWAYS void QK(dot32)(int type, const uint8_t *w, const qm_act *a, ptrdiff_t k, const int R,
                        float *s) {
    if (R <= 4) {
        QK(dot32_4)(type, w, a, k, R, s);
        return;
    }
    qm_act rest = qm_act_from(a, k, 4);
    QK(dot32_4)(type, w, a, k, 4, s);
    QK(dot32_4)(type, w, &rest, k, R - 4, s + 4);
}

/* sumi[r] += (q by row r's 32 quants at y + at) by the 16-bit scales sc, for R rows; q
   unsigned, or (signs not NULL) the magnitudes of signed quants whose signs *signs carries. */
QK_ALWAYS void QK(rows_k)(const qm_act *a, ptrdiff_t k, ptrdiff_t at, const int R, __m256i q,
                         const __m256i *signs, __m256i sc, __m256i *sumi) {
    QA_UNROLL
    for (int r = 0; r < R; r++) {
        __m256i y = qa_load(a->qk + r * k + at);
        if (signs) y = _mm256_sign_epi8(y, *signs);
#if QK_VNNI
        sumi[r] = _mm256_dpwssd_epi32(sumi[r], _mm256_maddubs_epi16(q, y), sc);
#else
        sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(_mm256_maddubs_epi16(q, y), sc));
#endif
    }
}

#define QK_SPLIT 2  /* rows up to which a block's products run in two chains of sums */

/* The sums sub-block i of a block adds to: the odd ones' apart where R <= QK_SPLIT (a lone
   row's one chain of vpdpwssd waits on its latency), joined before the scaling (QK_JOIN);
   integer sums, so the result is the same. */
QK_ALWAYS __m256i *QK(chain)(__m256i *sumi, const int R, int i) {
    return R <= QK_SPLIT && (i & 1) ? sumi + QM_IGROUP : sumi;
}

QK_ALWAYS void QK(join)(__m256i *sumi, const int R) {
    if (R > QK_SPLIT) return;
    QA_UNROLL
    for (int r = 0; r < R; r++) {
        sumi[r] = _mm256_add_epi32(sumi[r], sumi[QM_IGROUP + r]);
        sumi[QM_IGROUP + r] = _mm256_setzero_si256();
    }
}

/* The block's sums scaled into acc: qa_scale_k's, or qa_scale_k8's (wide: acc one vector). */
#define QK_SCALE(a, k, b, R, dw, mw, mins16, sumi, acc)                                     \
    (QK(join)(sumi, R), wide ? qa_scale_k8(a, k, b, R, dw, mw, mins16, sumi, acc)          \
                             : qa_scale_k(a, k, b, R, dw, mw, mins16, sumi, acc))

/* Q4_K (five = 0) or Q5_K block b: per 64 weights the two sub-blocks' quants unpacked once
   and their scales picked, then every row's products by them; the sums scaled and the mins
   taken by the 16-sums (bsums), each sub-block's minimum twice. */
QK_ALWAYS void QK(blk_k45)(const uint8_t *blk, const qm_act *a, ptrdiff_t k, ptrdiff_t b,
                          const int R, const int wide, int five, __m256i *sumi, __m256 *acc) {
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
        QK(rows_k)(a, k, 256 * b + 64 * c, R, lo, NULL, qa_lane16(scales, 2 * c),
                   QK(chain)(sumi, R, 0));
        QK(rows_k)(a, k, 256 * b + 64 * c + 32, R, hi, NULL, qa_lane16(scales, 2 * c + 1),
                   QK(chain)(sumi, R, 1));
    }
    QK_SCALE(a, k, b, R, QS_HALF(blk), QS_HALF(blk + 2), &mins16, sumi, acc);
}

/* Q6_K block b: the offset (32 by each scale by its 16-sum) first; per 32 weights their
   six-bit quants (0..63) unpacked once and their two int8 scales picked, then every row's
   products; the sums scaled. */
QK_ALWAYS void QK(blk_q6_k)(const uint8_t *blk, const qm_act *a, ptrdiff_t k, ptrdiff_t b,
                           const int R, const int wide, __m256i *sumi, __m256 *acc) {
    const __m256i low4 = _mm256_set1_epi8(0xF), high2 = _mm256_set1_epi8(0x30);
    __m128i scales8 = _mm_loadu_si128((const __m128i *)(blk + 192));
    qa_offset_k(a, k, b, R, _mm256_cvtepi8_epi16(scales8), 5, sumi);
    QA_UNROLL
    for (int i = 0; i < 8; i++) {  /* weights 32 i ..: sub-blocks 2i and 2i + 1 */
        int half = i / 4, g = i % 4;
        __m256i l = qa_load(blk + 64 * half + 32 * (g % 2));
        __m256i lo = _mm256_and_si256(g < 2 ? l : _mm256_srli_epi16(l, 4), low4);
        __m256i hb = qa_load(blk + 128 + 32 * half);  /* bits 2g, 2g + 1 to bits 4, 5 */
        __m256i h = _mm256_and_si256(g == 0 ? _mm256_slli_epi16(hb, 4)
                                     : g == 1 ? _mm256_slli_epi16(hb, 2)
                                     : g == 2 ? hb : _mm256_srli_epi16(hb, 2), high2);
        __m256i q = _mm256_or_si256(lo, h);
        QK(rows_k)(a, k, 256 * b + 32 * i, R, q, NULL, qa_pick2(scales8, i),
                   QK(chain)(sumi, R, i));
    }
    QK_SCALE(a, k, b, R, QS_HALF(blk + 208), 0.0f, NULL, sumi, acc);
}

/* Q2_K block b: per 32 weights their 2-bit quants unpacked once and their two 4-bit scales
   picked, then every row's products; the sums scaled and the 4-bit mins (one per 16
   weights) taken by the 16-sums. */
QK_ALWAYS void QK(blk_q2_k)(const uint8_t *blk, const qm_act *a, ptrdiff_t k, ptrdiff_t b,
                           const int R, const int wide, __m256i *sumi, __m256 *acc) {
    const __m256i low2 = _mm256_set1_epi8(3);
    const __m128i low4 = _mm_set1_epi8(0xF);
    __m128i packed = _mm_loadu_si128((const __m128i *)blk);
    __m128i scales8 = _mm_and_si128(packed, low4);
    __m256i mins16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), low4));
    QA_UNROLL
    for (int i = 0; i < 8; i++) {  /* weights 32 i ..: bits 2 (i % 4) of 32 bytes */
        __m256i bits = qa_load(blk + 16 + 32 * (i / 4));
        __m256i q = _mm256_and_si256(_mm256_srli_epi16(bits, 2 * (i % 4)), low2);
        QK(rows_k)(a, k, 256 * b + 32 * i, R, q, NULL, qa_pick2(scales8, i),
                   QK(chain)(sumi, R, i));
    }
    QK_SCALE(a, k, b, R, QS_HALF(blk + 80), QS_HALF(blk + 82), &mins16, sumi, acc);
}

/* Q3_K block b, its quants as 4 + q (0..7: two low bits and the third times 4): the offset
   (4 by each scale by its 16-sum) first; per 32 weights the quants unpacked once and their
   two scales picked, then every row's products; the sums scaled. */
QK_ALWAYS void QK(blk_q3_k)(const uint8_t *blk, const qm_act *a, ptrdiff_t k, ptrdiff_t b,
                           const int R, const int wide, __m256i *sumi, __m256 *acc) {
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
        QK(rows_k)(a, k, 256 * b + 32 * i, R, q, NULL, qa_pick2(scales8, i),
                   QK(chain)(sumi, R, i));
    }
    QK_SCALE(a, k, b, R, QS_HALF(blk + 108), 0.0f, NULL, sumi, acc);
}

/* IQ4_XS block b: per 32 weights the values their nibbles index (magnitudes and signs
   apart) and their scale picked once, then every row's products; the sums scaled. */
QK_ALWAYS void QK(blk_iq4_xs)(const uint8_t *blk, const qm_act *a, ptrdiff_t k, ptrdiff_t b,
                             const int R, const int wide, __m256i *sumi, __m256 *acc) {
    const __m256i values = _mm256_broadcastsi128_si256(
        _mm_loadu_si128((const __m128i *)qm_iq4nl));
    __m256i scales = qa_scales_iq4_xs(blk);
    QA_UNROLL
    for (int ib = 0; ib < 8; ib++) {
        __m256i x = _mm256_shuffle_epi8(values, qa_nibbles(blk + 8 + 16 * ib));
        __m256i sc = _mm256_permutevar8x32_epi32(scales, _mm256_set1_epi32(ib));
        QK(rows_k)(a, k, 256 * b + 32 * ib, R, _mm256_sign_epi8(x, x), &x, sc,
                   QK(chain)(sumi, R, ib));
    }
    QK_SCALE(a, k, b, R, QS_HALF(blk), 0.0f, NULL, sumi, acc);
}

/* The 256-weight types against R rows: per block, its quants against every row into int32
   sums (sumi), scaled into acc at the block's end. */
QK_ALWAYS void QK(dot_k)(int type, const uint8_t *w, const qm_act *a, ptrdiff_t k, const int R,
                        const int wide, float *s) {
    const int bb = qm_block_bytes[type];
    __m256 acc[QM_IGROUP];
    __m256i sumi[2 * QM_IGROUP];  /* two chains (QK_SPLIT) */
    QA_UNROLL
    for (int r = 0; r < QM_IGROUP; r++) {
        acc[r] = _mm256_setzero_ps();
        sumi[r] = sumi[QM_IGROUP + r] = _mm256_setzero_si256();
    }
    for (ptrdiff_t b = 0; b < k / 256; b++) {
        const uint8_t *blk = w + b * bb;
        QK(ahead)(blk, bb);
        switch (type) {
        case QM_Q2_K: QK(blk_q2_k)(blk, a, k, b, R, wide, sumi, acc); break;
        case QM_Q3_K: QK(blk_q3_k)(blk, a, k, b, R, wide, sumi, acc); break;
        case QM_Q4_K: QK(blk_k45)(blk, a, k, b, R, wide, 0, sumi, acc); break;
        case QM_Q5_K: QK(blk_k45)(blk, a, k, b, R, wide, 1, sumi, acc); break;
        case QM_Q6_K: QK(blk_q6_k)(blk, a, k, b, R, wide, sumi, acc); break;
        default: QK(blk_iq4_xs)(blk, a, k, b, R, wide, sumi, acc);
        }
    }
    float lanes[QM_IGROUP];
    if (wide) _mm256_storeu_ps(lanes, acc[0]);
    QA_UNROLL
    for (int r = 0; r < R; r++) s[r] = wide ? lanes[r] : qa_hsum(acc[r]);
}

/* acc plus, per 32-bit lane, the four products of unsigned bytes u by signed bytes y. */
QK_ALWAYS __m256i QK(dp)(__m256i acc, __m256i u, __m256i y) {
#if QK_VNNI
    return _mm256_dpbusd_epi32(acc, u, y);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, y),
                                                   _mm256_set1_epi16(1)));
#endif
}

/* activation rows per pass over a group's quants: Q4_K's (its three sums a row), the 32-weight
   types' (one a row; with AVX512VL's 32 vector registers, all 8) */
#define QK_X8_PASS (QK_VNNI ? 4 : 2)
#define QK_X8_PASS32 (QK_VNNI ? 8 : 2)

/* acc plus, per 32-bit lane, the four products of unsigned bytes u by the four signed bytes
   at y (the same in every lane): with VNNI one vpdpbusd whose memory operand broadcasts them
   (GCC loads the broadcast apart, an instruction more for each). */
QK_ALWAYS __m256i QK(dp_at)(__m256i acc, __m256i u, const int8_t *y) {
#if QK_VNNI
    __asm__("vpdpbusd %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*(const qa_four_bytes *)y));
    return acc;
#else
    int32_t four;
    memcpy(&four, y, 4);
    return QK(dp)(acc, u, _mm256_set1_epi32(four));
#endif
}

/* Row r's minimum sums of block b by the 8 rows' sub-block minimums (mp: the four pairs'):
   lane i = sum over sub-blocks j of m_j[i] (bsums[2 j] + bsums[2 j + 1]). */
QK_ALWAYS __m256i QK(x8_mins)(const qm_act *a, ptrdiff_t k, ptrdiff_t b, int r,
                              const __m256i *mp) {
    __m256i bs32 = _mm256_madd_epi16(qa_load(a->bsums + r * (k / 16) + 16 * b),
                                     _mm256_set1_epi16(1));
    __m256i pairs = _mm256_packs_epi32(bs32, bs32);  /* 32-bit lanes 0 1 4 5: (B0 B1)..(B6 B7) */
    __m256i m = _mm256_madd_epi16(mp[0], _mm256_permutevar8x32_epi32(pairs, _mm256_set1_epi32(0)));
    m = _mm256_add_epi32(m, _mm256_madd_epi16(mp[1], _mm256_permutevar8x32_epi32(
                                                  pairs, _mm256_set1_epi32(1))));
    m = _mm256_add_epi32(m, _mm256_madd_epi16(mp[2], _mm256_permutevar8x32_epi32(
                                                  pairs, _mm256_set1_epi32(4))));
    return _mm256_add_epi32(m, _mm256_madd_epi16(mp[3], _mm256_permutevar8x32_epi32(
                                                     pairs, _mm256_set1_epi32(5))));
}

/* Q4_K's 64 weights c of block b in a group (g at the block) against R rows, into the rows'
   int32 sums by the sub-blocks' scales (lane i: weight row i). */
QK_ALWAYS void QK(x8_q4k_64)(const uint8_t *g, const qm_act *a, ptrdiff_t k, ptrdiff_t b,
                             int c, const int R, __m256i *isum) {
    const __m256i low4 = _mm256_set1_epi8(0xF);
    __m256i lo_s[QK_X8_PASS], hi_s[QK_X8_PASS];
    QA_UNROLL
    for (int r = 0; r < R; r++) lo_s[r] = hi_s[r] = _mm256_setzero_si256();
    QA_UNROLL
    for (int t = 0; t < 8; t++) {
        __m256i bits = qa_load(g + 160 + 32 * (8 * c + t));
        __m256i lo = _mm256_and_si256(bits, low4);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), low4);
        QA_UNROLL
        for (int r = 0; r < R; r++) {
            const int8_t *y = a->qk + r * k + 256 * b + 64 * c + 4 * t;
            lo_s[r] = QK(dp_at)(lo_s[r], lo, y);
            hi_s[r] = QK(dp_at)(hi_s[r], hi, y + 32);
        }
    }
    __m256i sc_lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(g + 32 + 16 * c)));
    __m256i sc_hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(g + 40 + 16 * c)));
    QA_UNROLL
    for (int r = 0; r < R; r++)
        isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(_mm256_mullo_epi32(lo_s[r], sc_lo),
                                                             _mm256_mullo_epi32(hi_s[r], sc_hi)));
}

/* Q4_K's x8 group g against R <= QK_X8_PASS activation rows: s[8 r + i]. */
QK_ALWAYS void QK(x8_q4k_pass)(const uint8_t *g, const qm_act *a, ptrdiff_t k, const int R,
                               float *s) {
    const ptrdiff_t nb = k / 256;
    __m256 acc[QK_X8_PASS];
    QA_UNROLL
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (ptrdiff_t b = 0; b < nb; b++, g += QM_X8_Q4K) {
        QK(ahead)(g, QM_X8_Q4K);
        __m256i isum[QK_X8_PASS], mp[4];
        QA_UNROLL
        for (int r = 0; r < R; r++) isum[r] = _mm256_setzero_si256();
        QA_UNROLL
        for (int c = 0; c < 4; c++) QK(x8_q4k_64)(g, a, k, b, c, R, isum);
        QA_UNROLL
        for (int p = 0; p < 4; p++)
            mp[p] = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(g + 96 + 16 * p)));
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g));
        __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 16)));
        QA_UNROLL
        for (int r = 0; r < R; r++) {
            __m256 dy = _mm256_set1_ps(a->dk[r * (nb + 1) + b]);
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, dy), _mm256_cvtepi32_ps(isum[r]), acc[r]);
            acc[r] = _mm256_fnmadd_ps(_mm256_mul_ps(dmin, dy),
                                      _mm256_cvtepi32_ps(QK(x8_mins)(a, k, b, r, mp)), acc[r]);
        }
    }
    QA_UNROLL
    for (int r = 0; r < R; r++) _mm256_storeu_ps(s + QM_X8 * r, acc[r]);
}

/* isum[r] += the 8 rows' 4 unsigned quants q (one row a lane) by row r's 4 activations at
   y + r k, for R rows. */
QK_ALWAYS void QK(x8_chunk)(__m256i q, const int8_t *y, ptrdiff_t k, const int R,
                            __m256i *isum) {
    QA_UNROLL
    for (int r = 0; r < R; r++) isum[r] = QK(dp_at)(isum[r], q, y + r * k);
}

/* The same for 4 signed quants x a lane: their magnitudes by the activations with their signs
   (AVX2's vpmaddubsw would saturate on Q8_0's quants plus 128). */
QK_ALWAYS void QK(x8_chunk_signed)(__m256i x, const int8_t *y, ptrdiff_t k, const int R,
                                   __m256i *isum) {
    __m256i u = _mm256_sign_epi8(x, x);
    QA_UNROLL
    for (int r = 0; r < R; r++) {
        int32_t four;
        memcpy(&four, y + r * k, 4);
        isum[r] = QK(dp)(isum[r], u, _mm256_sign_epi8(_mm256_set1_epi32(four), x));
    }
}

/* IQ4_NL's values (signed), or plus 128 as unsigned bytes where the VNNI kernels take them so,
   in both lanes: a nibble's value is one vpshufb. */
QK_ALWAYS __m256i QK(x8_values)(void) {
    __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qm_iq4nl));
    return QK_VNNI ? _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80)) : v;
}

/* isum[r] += 4 values of the 8 rows (x8_values', one row a lane) by row r's 4 activations at
   y + r k: unsigned with VNNI, signed on AVX2. */
QK_ALWAYS void QK(x8_chunk_values)(__m256i v, const int8_t *y, ptrdiff_t k, const int R,
                                   __m256i *isum) {
    if (QK_VNNI)
        QK(x8_chunk)(v, y, k, R, isum);
    else
        QK(x8_chunk_signed)(v, y, k, R, isum);
}

/* The fifth bits of 32 nibbles (Q5_0's or Q5_1's x8 mask at m: bit j for byte j) as 16 in
   those bytes. */
QK_ALWAYS __m256i QK(x8_fifth)(const uint8_t *m) {
    int32_t bits;
    memcpy(&bits, m, 4);
    const __m256i spread = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                             0x0101010101010101, 0x0000000000000000);
    const __m256i others = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);
    __m256i bytes = _mm256_or_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(bits), spread), others);
    return _mm256_and_si256(_mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1)),
                            _mm256_set1_epi8(0x10));
}

/* A 32-weight type's x8 group g against R <= QK_X8_PASS32 activation rows: s[8 r + i]. The
   quants enter unsigned (Q4_0's, Q4_1's, Q5_0's and Q5_1's as stored, Q8_0's and IQ4_NL's
   values plus 128 with VNNI, whose sums of four products do not saturate), their offset (8,
   16, 128) taken off the integer sums by each row's quant sums; AVX2's Q8_0 and IQ4_NL signed
   (x8_chunk_signed); Q4_1's and Q5_1's minimum by its activation sums. IQ4_NL's nibbles index
   its 16 values in one byte shuffle, as ggml's kernels do. */
QK_ALWAYS void QK(x8_32_pass)(int type, const uint8_t *g, const qm_act *a, ptrdiff_t k,
                              const int R, float *s) {
    const ptrdiff_t nb = k / 32;
    const int xb = qm_x8_block_bytes(type), at = qm_x8_scales32(type);
    const int offset = type == QM_Q8_0 || type == QM_IQ4_NL ? (QK_VNNI ? 128 : 0)
                       : type == QM_Q4_0 ? 8 : type == QM_Q5_0 ? 16 : 0;
    const __m256i low4 = _mm256_set1_epi8(0xF), flip = _mm256_set1_epi8((char)0x80);
    const __m256i values = QK(x8_values)();
    __m256 acc[QK_X8_PASS32];
    QA_UNROLL
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (ptrdiff_t b = 0; b < nb; b++, g += xb) {
        QK(ahead)(g, xb);
        __m256i isum[QK_X8_PASS32];
        QA_UNROLL
        for (int r = 0; r < R; r++) isum[r] = _mm256_setzero_si256();
        if (type == QM_Q8_0) {
            QA_UNROLL
            for (int t = 0; t < 8; t++) {
                const int8_t *y = a->q32 + 32 * b + 4 * t;
                if (QK_VNNI)
                    QK(x8_chunk)(_mm256_xor_si256(qa_load(g + at + 32 * t), flip), y, k, R,
                                 isum);
                else
                    QK(x8_chunk_signed)(qa_load(g + at + 32 * t), y, k, R, isum);
            }
        } else {
            QA_UNROLL
            for (int t = 0; t < 4; t++) {
                __m256i bits = qa_load(g + at + 32 * t);
                __m256i lo = _mm256_and_si256(bits, low4);
                __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), low4);
                if (qm_fifth_bits(type)) {
                    lo = _mm256_or_si256(lo, QK(x8_fifth)(g + at + 128 + 8 * t));
                    hi = _mm256_or_si256(hi, QK(x8_fifth)(g + at + 132 + 8 * t));
                }
                const int8_t *y = a->q32 + 32 * b + 4 * t;
                if (type == QM_IQ4_NL) {
                    QK(x8_chunk_values)(_mm256_shuffle_epi8(values, lo), y, k, R, isum);
                    QK(x8_chunk_values)(_mm256_shuffle_epi8(values, hi), y + 16, k, R, isum);
                    continue;
                }
                QK(x8_chunk)(lo, y, k, R, isum);
                QK(x8_chunk)(hi, y + 16, k, R, isum);
            }
        }
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g));
        QA_UNROLL
        for (int r = 0; r < R; r++) {
            if (offset)
                isum[r] = _mm256_sub_epi32(isum[r], _mm256_set1_epi32(offset * a->i32[r * nb + b]));
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(a->d32[r * nb + b])),
                                     _mm256_cvtepi32_ps(isum[r]), acc[r]);
            if (at == 32)  /* Q4_1's and Q5_1's minimum */
                acc[r] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 16))),
                                         _mm256_set1_ps(a->s32[r * nb + b]), acc[r]);
        }
    }
    QA_UNROLL
    for (int r = 0; r < R; r++) _mm256_storeu_ps(s + QM_X8 * r, acc[r]);
}

/* IQ4_XS's x8 group g against R <= QK_X8_PASS activation rows: s[8 r + i]. Per 64 weights,
   each sub-block's values (x8_values) against every row, its sums by its scales; with VNNI
   the values' 128 leaves the sums by the scales times the activations' 32-sums (x8_mins). */
QK_ALWAYS void QK(x8_iq4xs_pass)(const uint8_t *g, const qm_act *a, ptrdiff_t k, const int R,
                                 float *s) {
    const ptrdiff_t nb = k / 256;
    const __m256i low4 = _mm256_set1_epi8(0xF), values = QK(x8_values)();
    __m256 acc[QK_X8_PASS];
    QA_UNROLL
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (ptrdiff_t b = 0; b < nb; b++, g += QM_X8_IQ4XS) {
        QK(ahead)(g, QM_X8_IQ4XS);
        __m256i isum[QK_X8_PASS], pairs[4];
        QA_UNROLL
        for (int r = 0; r < R; r++) isum[r] = _mm256_setzero_si256();
        QA_UNROLL
        for (int c = 0; c < 4; c++) {
            __m256i sub[2][QK_X8_PASS];
            QA_UNROLL
            for (int r = 0; r < R; r++) sub[0][r] = sub[1][r] = _mm256_setzero_si256();
            QA_UNROLL
            for (int t = 0; t < 8; t++) {
                __m256i bits = qa_load(g + 80 + 32 * (8 * c + t));
                __m256i lo = _mm256_shuffle_epi8(values, _mm256_and_si256(bits, low4));
                __m256i hi = _mm256_shuffle_epi8(
                    values, _mm256_and_si256(_mm256_srli_epi16(bits, 4), low4));
                const int8_t *y = a->qk + 256 * b + 64 * c + 32 * (t / 4) + 4 * (t % 4);
                QK(x8_chunk_values)(lo, y, k, R, sub[t / 4]);
                QK(x8_chunk_values)(hi, y + 16, k, R, sub[t / 4]);
            }
            pairs[c] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(g + 16 + 16 * c)));
            __m256i even = _mm256_madd_epi16(pairs[c], _mm256_set1_epi32(1));
            __m256i odd = _mm256_madd_epi16(pairs[c], _mm256_set1_epi32(1 << 16));
            QA_UNROLL
            for (int r = 0; r < R; r++)
                isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(
                    _mm256_mullo_epi32(sub[0][r], even), _mm256_mullo_epi32(sub[1][r], odd)));
        }
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g));
        QA_UNROLL
        for (int r = 0; r < R; r++) {
            if (QK_VNNI)
                isum[r] = _mm256_sub_epi32(isum[r],
                                           _mm256_slli_epi32(QK(x8_mins)(a, k, b, r, pairs), 7));
            __m256 dy = _mm256_set1_ps(a->dk[r * (nb + 1) + b]);
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, dy), _mm256_cvtepi32_ps(isum[r]), acc[r]);
        }
    }
    QA_UNROLL
    for (int r = 0; r < R; r++) _mm256_storeu_ps(s + QM_X8 * r, acc[r]);
}

/* A pass function of the x8 kernels called with R fixed, QK_X8_PASS rows at a time (each
   row's sums its own: the same bits whatever rows share a pass). */
#if QK_VNNI
#define QK_X8_ROWS4(CALL)                                                                     \
    if (n == 1) CALL(1); else if (n == 2) CALL(2); else if (n == 3) CALL(3); else CALL(4)
#define QK_X8_ROWS8(CALL)                                                                     \
    switch (n) {                                                                            \
    case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break;                 \
    case 4: CALL(4); break; case 5: CALL(5); break; case 6: CALL(6); break;                 \
    case 7: CALL(7); break; default: CALL(8);                                               \
    }
#else
#define QK_X8_ROWS4(CALL) if (n == 1) CALL(1); else CALL(2)
#define QK_X8_ROWS8(CALL) QK_X8_ROWS4(CALL)
#endif
#define QK_X8_BY_ROWS(name, CALL, PASS, ROWS)                                                 \
    QK_ATTR static void QK(name)(const uint8_t *g, const qm_act *a, ptrdiff_t k, int R,       \
                                 float *s) {                                                  \
        for (int r0 = 0; r0 < R; r0 += PASS) {                                               \
            qm_act at = qm_act_from(a, k, r0);                                               \
            int n = R - r0 < PASS ? R - r0 : PASS;                                           \
            float *out = s + QM_X8 * r0;                                                     \
            ROWS(CALL);                                                                      \
        }                                                                                    \
    }
#define QK_X8_Q4_0(R_) QK(x8_32_pass)(QM_Q4_0, g, &at, k, R_, out)
#define QK_X8_Q4_1(R_) QK(x8_32_pass)(QM_Q4_1, g, &at, k, R_, out)
#define QK_X8_Q8_0(R_) QK(x8_32_pass)(QM_Q8_0, g, &at, k, R_, out)
#define QK_X8_Q5_0(R_) QK(x8_32_pass)(QM_Q5_0, g, &at, k, R_, out)
#define QK_X8_Q5_1(R_) QK(x8_32_pass)(QM_Q5_1, g, &at, k, R_, out)
#define QK_X8_IQ4_NL(R_) QK(x8_32_pass)(QM_IQ4_NL, g, &at, k, R_, out)
#define QK_X8_Q4_K(R_) QK(x8_q4k_pass)(g, &at, k, R_, out)
#define QK_X8_IQ4_XS(R_) QK(x8_iq4xs_pass)(g, &at, k, R_, out)
QK_X8_BY_ROWS(x8_q4_0, QK_X8_Q4_0, QK_X8_PASS32, QK_X8_ROWS8)
QK_X8_BY_ROWS(x8_q4_1, QK_X8_Q4_1, QK_X8_PASS32, QK_X8_ROWS8)
QK_X8_BY_ROWS(x8_q8_0, QK_X8_Q8_0, QK_X8_PASS32, QK_X8_ROWS8)
QK_X8_BY_ROWS(x8_q5_0, QK_X8_Q5_0, QK_X8_PASS32, QK_X8_ROWS8)
QK_X8_BY_ROWS(x8_q5_1, QK_X8_Q5_1, QK_X8_PASS32, QK_X8_ROWS8)
QK_X8_BY_ROWS(x8_iq4_nl, QK_X8_IQ4_NL, QK_X8_PASS32, QK_X8_ROWS8)
QK_X8_BY_ROWS(x8_q4k, QK_X8_Q4_K, QK_X8_PASS, QK_X8_ROWS4)
QK_X8_BY_ROWS(x8_iq4xs, QK_X8_IQ4_XS, QK_X8_PASS, QK_X8_ROWS4)
#undef QK_X8_Q4_0
#undef QK_X8_Q4_1
#undef QK_X8_Q8_0
#undef QK_X8_Q5_0
#undef QK_X8_Q5_1
#undef QK_X8_IQ4_NL
#undef QK_X8_Q4_K
#undef QK_X8_IQ4_XS
#undef QK_X8_ROWS4
#undef QK_X8_ROWS8
#undef QK_X8_BY_ROWS

#define QK_Q8_0(R_) QK(dot32)(QM_Q8_0, w, a, k, R_, s)
#define QK_Q4_0(R_) QK(dot32)(QM_Q4_0, w, a, k, R_, s)
#define QK_Q4_1(R_) QK(dot32)(QM_Q4_1, w, a, k, R_, s)
#define QK_Q5_0(R_) QK(dot32)(QM_Q5_0, w, a, k, R_, s)
#define QK_Q5_1(R_) QK(dot32)(QM_Q5_1, w, a, k, R_, s)
#define QK_IQ4_NL(R_) QK(dot32)(QM_IQ4_NL, w, a, k, R_, s)
#define QK_Q2_K(R_) QK(dot_k)(QM_Q2_K, w, a, k, R_, 0, s)
#define QK_Q2_K_W(R_) QK(dot_k)(QM_Q2_K, w, a, k, R_, 1, s)
#define QK_Q3_K(R_) QK(dot_k)(QM_Q3_K, w, a, k, R_, 0, s)
#define QK_Q3_K_W(R_) QK(dot_k)(QM_Q3_K, w, a, k, R_, 1, s)
#define QK_Q4_K(R_) QK(dot_k)(QM_Q4_K, w, a, k, R_, 0, s)
#define QK_Q4_K_W(R_) QK(dot_k)(QM_Q4_K, w, a, k, R_, 1, s)
#define QK_Q5_K(R_) QK(dot_k)(QM_Q5_K, w, a, k, R_, 0, s)
#define QK_Q5_K_W(R_) QK(dot_k)(QM_Q5_K, w, a, k, R_, 1, s)
#define QK_Q6_K(R_) QK(dot_k)(QM_Q6_K, w, a, k, R_, 0, s)
#define QK_Q6_K_W(R_) QK(dot_k)(QM_Q6_K, w, a, k, R_, 1, s)
#define QK_IQ4_XS(R_) QK(dot_k)(QM_IQ4_XS, w, a, k, R_, 0, s)
#define QK_IQ4_XS_W(R_) QK(dot_k)(QM_IQ4_XS, w, a, k, R_, 1, s)
#define QK_BY_ROWS(name, CALL) QM_BY_ROWS(QK_ATTR, QK(name), CALL)
QK_BY_ROWS(q8_0, QK_Q8_0)
QK_BY_ROWS(q4_0, QK_Q4_0)
QK_BY_ROWS(q4_1, QK_Q4_1)
QK_BY_ROWS(q5_0, QK_Q5_0)
QK_BY_ROWS(q5_1, QK_Q5_1)
QK_BY_ROWS(iq4_nl, QK_IQ4_NL)
QK_BY_ROWS(q2_k, QK_Q2_K)
QK_BY_ROWS(q3_k, QK_Q3_K)
QK_BY_ROWS(q4_k, QK_Q4_K)
QK_BY_ROWS(q5_k, QK_Q5_K)
QK_BY_ROWS(q6_k, QK_Q6_K)
QK_BY_ROWS(iq4_xs, QK_IQ4_XS)
QK_BY_ROWS(q2_k_w, QK_Q2_K_W)
QK_BY_ROWS(q3_k_w, QK_Q3_K_W)
QK_BY_ROWS(q4_k_w, QK_Q4_K_W)
QK_BY_ROWS(q5_k_w, QK_Q5_K_W)
QK_BY_ROWS(q6_k_w, QK_Q6_K_W)
QK_BY_ROWS(iq4_xs_w, QK_IQ4_XS_W)

/* This variant's integer kernels by type (NULL: none; that type multiplies in float32). */
static const qm_idot_fn QK(table)[QM_TYPES] = {
    QK(q8_0), QK(q4_0), QK(q4_1), QK(q4_k), QK(q6_k), NULL, NULL, QK(q5_0), QK(q5_1),
    QK(q2_k), QK(q3_k), QK(q5_k), QK(iq4_nl), QK(iq4_xs)};
/* Its wide kernels (the 256-weight types'). */
static const qm_idot_fn QK(wtable)[QM_TYPES] = {
    NULL, NULL, NULL, QK(q4_k_w), QK(q6_k_w), NULL, NULL, NULL, NULL,
    QK(q2_k_w), QK(q3_k_w), QK(q5_k_w), NULL, QK(iq4_xs_w)};
/* Its x8 kernels (qm_pack_x8's layout). */
static const qm_x8_fn QK(x8table)[QM_TYPES] = {
    [QM_Q4_K] = QK(x8_q4k), [QM_Q4_0] = QK(x8_q4_0), [QM_Q4_1] = QK(x8_q4_1),
    [QM_Q8_0] = QK(x8_q8_0), [QM_Q5_0] = QK(x8_q5_0), [QM_Q5_1] = QK(x8_q5_1),
    [QM_IQ4_NL] = QK(x8_iq4_nl), [QM_IQ4_XS] = QK(x8_iq4xs)};

#undef QK_Q8_0
#undef QK_Q4_0
#undef QK_Q4_1
#undef QK_Q5_0
#undef QK_Q5_1
#undef QK_IQ4_NL
#undef QK_Q2_K
#undef QK_Q2_K_W
#undef QK_Q3_K
#undef QK_Q3_K_W
#undef QK_Q4_K
#undef QK_Q4_K_W
#undef QK_Q5_K
#undef QK_Q5_K_W
#undef QK_Q6_K
#undef QK_Q6_K_W
#undef QK_IQ4_XS
#undef QK_IQ4_XS_W
#undef QK_BY_ROWS
#undef QK_X8_PASS
#undef QK_X8_PASS32
#undef QK_SCALE
#undef QK_SPLIT
#undef QK_ALWAYS
#undef QK_AHEAD
