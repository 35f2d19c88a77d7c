/* The 32-weight types' x8 kernels on 512-bit vectors (AVX512F, BW, VL and VNNI): two adjacent
 * x8 groups (16 weight rows) a pass, one group's lanes in each half of a zmm register, so that
 * each activation row's four bytes, broadcast to all 16 lanes, multiply both groups in one
 * vpdpbusd where the 256-bit kernels take two. Every lane's operations are those of
 * quant_q8_avx2_kernels.h's x8_32_pass (the same integer sums, scaled by the same float
 * operations), so a weight row's result is bit for bit the 256-bit kernel's; only where a CPU
 * runs 512-bit vectors at full width (AMD Zen 5, Intel's server cores) does it save time.
 * Included once from quant_q8_avx2.h, after the VNNI kernels (qv_), whose helpers it takes.
 */
#define QZ_ATTR __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
#define QZ_ALWAYS QZ_ATTR static inline __attribute__((always_inline))

/* 16 weight rows in two x8 groups: their 32 bytes at offset `at` of each as one vector. */
QZ_ALWAYS __m512i qz_pair(const uint8_t *g0, const uint8_t *g1, ptrdiff_t at) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(qa_load(g0 + at)), qa_load(g1 + at), 1);
}

/* The two groups' eight f16 scales at offset `at` of each as 16 floats. */
QZ_ALWAYS __m512 qz_halves(const uint8_t *g0, const uint8_t *g1, ptrdiff_t at) {
    __m256i h = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(g0 + at))),
        _mm_loadu_si128((const __m128i *)(g1 + at)), 1);
    return _mm512_cvtph_ps(h);
}

/* acc plus, per 32-bit lane, the four products of unsigned bytes u by the four signed bytes
   at y, broadcast to every lane by the memory operand. */
QZ_ALWAYS __m512i qz_dp_at(__m512i acc, __m512i u, const int8_t *y) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*(const qa_four_bytes *)y));
    return acc;
}

QZ_ALWAYS void qz_chunk(__m512i q, const int8_t *y, ptrdiff_t k, const int R, __m512i *isum) {
    QA_UNROLL
    for (int r = 0; r < R; r++) isum[r] = qz_dp_at(isum[r], q, y + r * k);
}

/* Two groups' fifth bits (qv_x8_fifth of each) as one vector. */
QZ_ALWAYS __m512i qz_fifth(const uint8_t *g0, const uint8_t *g1, ptrdiff_t at) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(qv_x8_fifth(g0 + at)),
                              qv_x8_fifth(g1 + at), 1);
}

/* qv_x8_32_pass on groups g0 and g1 (each a block at a time) against R <= 8 activation rows:
   s[16 r + i], i < 8 g0's rows, 8 <= i < 16 g1's. */
QZ_ALWAYS void qz_x16_32_pass(int type, const uint8_t *g0, const uint8_t *g1, const qm_act *a,
                              ptrdiff_t k, const int R, float *s) {
    const ptrdiff_t nb = k / 32;
    const int xb = qm_x8_block_bytes(type), at = qm_x8_scales32(type);
    const int offset = type == QM_Q8_0 || type == QM_IQ4_NL ? 128
                       : type == QM_Q4_0 ? 8 : type == QM_Q5_0 ? 16 : 0;
    const __m512i low4 = _mm512_set1_epi8(0xF), flip = _mm512_set1_epi8((char)0x80);
    const __m512i values = _mm512_broadcast_i32x4(_mm256_castsi256_si128(qv_x8_values()));
    __m512 acc[QM_IGROUP];
    QA_UNROLL
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (ptrdiff_t b = 0; b < nb; b++, g0 += xb, g1 += xb) {
        __m512i isum[QM_IGROUP];
        QA_UNROLL
        for (int r = 0; r < R; r++) isum[r] = _mm512_setzero_si512();
        if (type == QM_Q8_0) {
            QA_UNROLL
            for (int t = 0; t < 8; t++)
                qz_chunk(_mm512_xor_si512(qz_pair(g0, g1, at + 32 * t), flip),
                         a->q32 + 32 * b + 4 * t, k, R, isum);
        } else {
            QA_UNROLL
            for (int t = 0; t < 4; t++) {
                __m512i bits = qz_pair(g0, g1, at + 32 * t);
                __m512i lo = _mm512_and_si512(bits, low4);
                __m512i hi = _mm512_and_si512(_mm512_srli_epi16(bits, 4), low4);
                if (qm_fifth_bits(type)) {
                    lo = _mm512_or_si512(lo, qz_fifth(g0, g1, at + 128 + 8 * t));
                    hi = _mm512_or_si512(hi, qz_fifth(g0, g1, at + 132 + 8 * t));
                }
                if (type == QM_IQ4_NL) {
                    lo = _mm512_shuffle_epi8(values, lo);
                    hi = _mm512_shuffle_epi8(values, hi);
                }
                const int8_t *y = a->q32 + 32 * b + 4 * t;
                qz_chunk(lo, y, k, R, isum);
                qz_chunk(hi, y + 16, k, R, isum);
            }
        }
        __m512 d = qz_halves(g0, g1, 0);
        QA_UNROLL
        for (int r = 0; r < R; r++) {
            if (offset)
                isum[r] = _mm512_sub_epi32(isum[r], _mm512_set1_epi32(offset * a->i32[r * nb + b]));
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(a->d32[r * nb + b])),
                                     _mm512_cvtepi32_ps(isum[r]), acc[r]);
            if (at == 32)  /* Q4_1's and Q5_1's minimum */
                acc[r] = _mm512_fmadd_ps(qz_halves(g0, g1, 16),
                                         _mm512_set1_ps(a->s32[r * nb + b]), acc[r]);
        }
    }
    QA_UNROLL
    for (int r = 0; r < R; r++) _mm512_storeu_ps(s + 2 * QM_X8 * r, acc[r]);
}

/* The rows' 32-sums of block b paired as qv_x8_mins takes them, by the two groups' sub-block
   minimums (mp: each pair of sub-blocks' 16 minimums, g0's then g1's): lane i row i's. */
QZ_ALWAYS __m512i qz_mins(const qm_act *a, ptrdiff_t k, ptrdiff_t b, int r, const __m512i *mp) {
    __m256i bs32 = _mm256_madd_epi16(qa_load(a->bsums + r * (k / 16) + 16 * b),
                                     _mm256_set1_epi16(1));
    __m256i pairs = _mm256_packs_epi32(bs32, bs32);  /* 32-bit lanes 0 1 4 5: (B0 B1)..(B6 B7) */
    static const int lane[4] = {0, 1, 4, 5};
    __m512i m = _mm512_setzero_si512();
    QA_UNROLL
    for (int p = 0; p < 4; p++) {
        __m256i pair = _mm256_permutevar8x32_epi32(pairs, _mm256_set1_epi32(lane[p]));
        m = _mm512_add_epi32(m, _mm512_madd_epi16(mp[p], _mm512_broadcast_i64x4(pair)));
    }
    return m;
}

/* The two groups' eight bytes at offset `at` of each as 16 int32 lanes. */
QZ_ALWAYS __m512i qz_bytes(const uint8_t *g0, const uint8_t *g1, ptrdiff_t at) {
    return _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)(g0 + at)),
                                                   _mm_loadl_epi64((const __m128i *)(g1 + at))));
}

/* qv_x8_q4k_pass on groups g0 and g1 against R <= 4 activation rows: s[16 r + i]. */
QZ_ALWAYS void qz_x16_q4k_pass(const uint8_t *g0, const uint8_t *g1, const qm_act *a,
                               ptrdiff_t k, const int R, float *s) {
    const ptrdiff_t nb = k / 256;
    const __m512i low4 = _mm512_set1_epi8(0xF);
    __m512 acc[4];
    QA_UNROLL
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (ptrdiff_t b = 0; b < nb; b++, g0 += QM_X8_Q4K, g1 += QM_X8_Q4K) {
        __m512i isum[4], mp[4];
        QA_UNROLL
        for (int r = 0; r < R; r++) isum[r] = _mm512_setzero_si512();
        QA_UNROLL
        for (int c = 0; c < 4; c++) {
            __m512i lo_s[4], hi_s[4];
            QA_UNROLL
            for (int r = 0; r < R; r++) lo_s[r] = hi_s[r] = _mm512_setzero_si512();
            QA_UNROLL
            for (int t = 0; t < 8; t++) {
                __m512i bits = qz_pair(g0, g1, 160 + 32 * (8 * c + t));
                __m512i lo = _mm512_and_si512(bits, low4);
                __m512i hi = _mm512_and_si512(_mm512_srli_epi16(bits, 4), low4);
                QA_UNROLL
                for (int r = 0; r < R; r++) {
                    const int8_t *y = a->qk + r * k + 256 * b + 64 * c + 4 * t;
                    lo_s[r] = qz_dp_at(lo_s[r], lo, y);
                    hi_s[r] = qz_dp_at(hi_s[r], hi, y + 32);
                }
            }
            __m512i sc_lo = qz_bytes(g0, g1, 32 + 16 * c), sc_hi = qz_bytes(g0, g1, 40 + 16 * c);
            QA_UNROLL
            for (int r = 0; r < R; r++)
                isum[r] = _mm512_add_epi32(isum[r],
                                           _mm512_add_epi32(_mm512_mullo_epi32(lo_s[r], sc_lo),
                                                            _mm512_mullo_epi32(hi_s[r], sc_hi)));
        }
        QA_UNROLL
        for (int p = 0; p < 4; p++)
            mp[p] = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_cvtepu8_epi16(
                    _mm_loadu_si128((const __m128i *)(g0 + 96 + 16 * p)))),
                _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(g1 + 96 + 16 * p))), 1);
        __m512 d = qz_halves(g0, g1, 0), dmin = qz_halves(g0, g1, 16);
        QA_UNROLL
        for (int r = 0; r < R; r++) {
            __m512 dy = _mm512_set1_ps(a->dk[r * (nb + 1) + b]);
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, dy), _mm512_cvtepi32_ps(isum[r]), acc[r]);
            acc[r] = _mm512_fnmadd_ps(_mm512_mul_ps(dmin, dy),
                                      _mm512_cvtepi32_ps(qz_mins(a, k, b, r, mp)), acc[r]);
        }
    }
    QA_UNROLL
    for (int r = 0; r < R; r++) _mm512_storeu_ps(s + 2 * QM_X8 * r, acc[r]);
}

QZ_ATTR static void qz_x16_q4k(const uint8_t *g0, const uint8_t *g1, const qm_act *a,
                               ptrdiff_t k, int R, float *s) {
    for (int r0 = 0; r0 < R; r0 += 4) {
        qm_act at = qm_act_from(a, k, r0);
        float *out = s + 2 * QM_X8 * r0;
        switch (R - r0) {
        case 1: qz_x16_q4k_pass(g0, g1, &at, k, 1, out); break;
        case 2: qz_x16_q4k_pass(g0, g1, &at, k, 2, out); break;
        case 3: qz_x16_q4k_pass(g0, g1, &at, k, 3, out); break;
        default: qz_x16_q4k_pass(g0, g1, &at, k, 4, out);
        }
    }
}

#define QZ_X16(name, T)                                                                       \
    QZ_ATTR static void name(const uint8_t *g0, const uint8_t *g1, const qm_act *a,           \
                             ptrdiff_t k, int R, float *s) {                                  \
        switch (R) {                                                                        \
        case 1: qz_x16_32_pass(T, g0, g1, a, k, 1, s); break;                               \
        case 2: qz_x16_32_pass(T, g0, g1, a, k, 2, s); break;                               \
        case 3: qz_x16_32_pass(T, g0, g1, a, k, 3, s); break;                               \
        case 4: qz_x16_32_pass(T, g0, g1, a, k, 4, s); break;                               \
        case 5: qz_x16_32_pass(T, g0, g1, a, k, 5, s); break;                               \
        case 6: qz_x16_32_pass(T, g0, g1, a, k, 6, s); break;                               \
        case 7: qz_x16_32_pass(T, g0, g1, a, k, 7, s); break;                               \
        default: qz_x16_32_pass(T, g0, g1, a, k, 8, s);                                     \
        }                                                                                   \
    }
QZ_X16(qz_x16_q4_0, QM_Q4_0)
QZ_X16(qz_x16_q4_1, QM_Q4_1)
QZ_X16(qz_x16_q8_0, QM_Q8_0)
QZ_X16(qz_x16_q5_0, QM_Q5_0)
QZ_X16(qz_x16_q5_1, QM_Q5_1)
QZ_X16(qz_x16_iq4_nl, QM_IQ4_NL)
#undef QZ_X16

/* Whether this CPU runs the 512-bit kernels (the VNNI variant's flags and AVX512F and BW). */
static inline int qz_usable(void) {
    return qa_vnni() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
}
