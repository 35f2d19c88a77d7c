/* One decoder block's decode step, compiled: 1..STEP_ROWS (32) rows, one new token each, float32
 * on the CPU.
 *
 * A decode step of a small model is bound by dispatch, not by memory: each of a block's
 * twenty-odd torch operations costs microseconds of Python and allocation around a few
 * microseconds of arithmetic. Here the whole block (RMSNorm, fused Q/K/V product, RoPE,
 * the KV cache write, grouped-query attention over the row's cache, output product and
 * residual, RMSNorm, fused gate/up product, SwiGLU, down product and residual; and where a
 * family has them, the Q/K/V bias, per-head Q and K norms, sandwich norms, GeGLU, another
 * attention scale and a sliding window, a mixture of experts in place of the feed-forward
(step_moe.h): st_block's optional parts) is one call
 * with the GIL released, and a node's consecutive blocks run in one call and one OpenMP
 * parallel region (st_blocks_step) with six barriers per block. The products are matvec.h's
 * few-row kernel; attention sums eight keys' dot products at once and takes their exp eight
 * lanes at a time.
 *
 * Every row is computed alone (its own norm, attention and products), so a row's result
 * does not depend on the rows beside it or on the thread count, as with matvec.h.
 *
 * Layouts (row-major): x, out (R, dim); qkv (q_dim + 2 kv_dim, dim); wo (dim, q_dim);
 * gate_up (2 hidden, dim); down (dim, hidden); k, v caches (slots, kv_heads, max_seq,
 * head_dim); cos, sin (rope_len, head_dim) in the "rotate half" layout.
 *
 * Each of the four matrices (and the head of st_logits) is float32 (its type ST_FLOAT) or
 * held in ggml's quantized blocks (its type one of quant.h's QM_*: uint8 rows of whole
 * blocks), multiplied by quant.h's kernels inside the same parallel region. A quantized
 * matrix may be stacked from up to ST_PARTS parts, each with its own rows and type (Q, K and
 * V of a GGUF file as the file holds them, Q6_K beside Q4_K included): one product over all
 * their rows, each part read where it lies, nothing copied. The activation sums those
 * kernels read for a block's minimum (qm_xsum) are taken by each thread for itself, as the
 * norms are, so a quantized product adds no barrier.
 */
#include <math.h>
#include <stdlib.h>

#include "matvec.h"
#include "quant.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#define ST_FLOAT (-1) /* a matrix's type: float32, not quantized */
#define ST_PARTS 3     /* the most parts of one stacked matrix */
#define ST_MAX_HEAD_DIM 512 /* of a block whose Q and K come in RoPE pairs (qk_pairs) */
#define ST_KV_CHUNK 32      /* half keys or values widened to float at a time */
#define ST_GROUP_AT_ONCE 16 /* query heads of one KV head a task attends over half keys */
#define ST_QUERIES_AT_ONCE 64 /* queries (a row's query head) a task attends over half keys */

/* A matrix of n[0] + ... + n[parts - 1] rows stacked from its parts: one float32 part (type
   ST_FLOAT), or 1..ST_PARTS parts of quantized blocks (their QM_* types). */
typedef struct {
    const void *w[ST_PARTS];
    int t[ST_PARTS];
    ptrdiff_t n[ST_PARTS];
    int parts;
    const void *x8[ST_PARTS];  /* a part also in the x8 layout (qm_pack_x8), else NULL */
} st_matrix;

#define ST_SILU 0      /* an activation: SwiGLU, silu(gate) * up */
#define ST_GELU_TANH 1 /* GeGLU, gelu(gate) * up, gelu in its tanh approximation */

/* A block's tensors and shape. The optional parts, NULL (0) where the block has none: a bias
   added to the Q/K/V product (q_dim + 2 kv_dim); RMSNorm weights (head_dim) of each head of Q
   and of K, after the bias and before RoPE; "sandwich" norms (dim) of the attention's and
   the feed-forward's outputs before each is added to x; attn_scale, the scores' factor (0:
   1 / sqrt(head_dim)); window, the keys a row attends (0: all, else the last ``window``
   positions up to its own); qk_pairs, the product's Q and K heads in llama.cpp's RoPE-pair
   order (half, 2), put in the "rotate half" order (2, half) first; kv_half, the caches k and v
   hold IEEE halves (rounded to nearest even as written, widened exactly as read). With
   n_experts > 0 the feed-forward is a mixture of experts (step_moe.h) instead of gate_up and
   down: the router (n_experts, dim), each expert's gate_up (2 hidden, dim) and down (dim,
   hidden), top_k of them per row, their weights renormalized to sum one where
   ``renormalize``; expert_counts (n_experts) NULL or counting the rows routed to each
   expert. */
typedef struct {
    const float *attn_norm, *mlp_norm, *cos, *sin;
    st_matrix qkv, wo, gate_up, down;
    void *k, *v;  /* float, or IEEE halves (uint16_t) where kv_half */
    ptrdiff_t dim, n_heads, n_kv, head_dim, hidden, n_slots, max_seq;
    float eps;
    const float *qkv_bias, *q_norm, *k_norm, *post_attn_norm, *post_mlp_norm;
    int activation;
    float attn_scale;
    ptrdiff_t window;
    int qk_pairs;
    int kv_half;
    ptrdiff_t n_experts, top_k;
    int renormalize;
    st_matrix router;
    const st_matrix *expert_gate_up, *expert_down;
    long long *expert_counts;
} st_block;

/* y = w * (x / sqrt(mean(x^2) + eps)), as RMSNorm computes it (x scaled, then weighted). */
static void st_rmsnorm(const float *x, const float *w, float *y, ptrdiff_t n, float eps) {
    float lanes[8] = {0};
    ptrdiff_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) lanes[l] += x[i + l] * x[i + l];
    float ss = 0.0f;
    for (int l = 0; l < 8; l++) ss += lanes[l];
    for (; i < n; i++) ss += x[i] * x[i];
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (i = 0; i < n; i++) y[i] = w[i] * (x[i] * inv);
}

/* x (head_dim) rotated in place: x * cos + rotate_half(x) * sin. */
static void st_rope(float *x, const float *cos, const float *sin, ptrdiff_t hd) {
    ptrdiff_t half = hd / 2;
    for (ptrdiff_t i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

typedef int st_i8 __attribute__((vector_size(32)));

#ifdef __clang__
#define ST_EVEN(a, b) __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14)
#define ST_ODD(a, b) __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15)
#else
#define ST_EVEN(a, b) __builtin_shuffle(a, b, (st_i8){0, 2, 4, 6, 8, 10, 12, 14})
#define ST_ODD(a, b) __builtin_shuffle(a, b, (st_i8){1, 3, 5, 7, 9, 11, 13, 15})
#endif

/* Lanes summed pairwise: ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)). */
static inline float st_pairwise(mv_v8 a) {
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

/* Lane j of the result: st_pairwise(a[j]), the eight sums in three rounds of pair adds. */
#define ST_PAIR(a, b) (ST_EVEN(a, b) + ST_ODD(a, b))
static inline __attribute__((always_inline)) mv_v8 st_pairwise8(const mv_v8 a[8]) {
    mv_v8 p[4], q[2];
    for (int i = 0; i < 4; i++) p[i] = ST_PAIR(a[2 * i], a[2 * i + 1]);
    for (int i = 0; i < 2; i++) q[i] = ST_PAIR(p[2 * i], p[2 * i + 1]);
    return ST_PAIR(q[0], q[1]);
}

/* exp of eight lanes, each lane on its own (Cephes' expf: 2^n e^r, |r| <= ln2 / 2, a
   degree-6 polynomial; within 2 ulp of expf). Lanes below -87.3 give about 1e-38. */
static inline __attribute__((always_inline)) mv_v8 st_exp8(mv_v8 x) {
    const float magic = 12582912.0f;  /* 1.5 * 2^23: adding it rounds to an integer */
    const mv_v8 lo = {-87.3f, -87.3f, -87.3f, -87.3f, -87.3f, -87.3f, -87.3f, -87.3f};
    const mv_v8 hi = {88.3f, 88.3f, 88.3f, 88.3f, 88.3f, 88.3f, 88.3f, 88.3f};
    st_i8 below = x < lo, above = x > hi, xb, lb, hb;  /* lanes of -1 where so (NaN: neither) */
    memcpy(&xb, &x, sizeof x);
    memcpy(&lb, &lo, sizeof lo);
    memcpy(&hb, &hi, sizeof hi);
    xb = (below & lb) | (above & hb) | (~(below | above) & xb);
    memcpy(&x, &xb, sizeof xb);
    mv_v8 z = x * 1.44269504088896341f + magic;
    mv_v8 n = z - magic;
    mv_v8 r = x - n * 0.693359375f + n * 2.12194440e-4f;
    mv_v8 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    st_i8 bits;
    memcpy(&bits, &z, sizeof z);
    bits = (bits - 0x4B400000 + 127) << 23;  /* z's low bits are n: 2^n as a float */
    mv_v8 scale;
    memcpy(&scale, &bits, sizeof bits);
    return p * scale;
}

/* out[0 .. 8C) += sum over t < len of p[t] v[t * hd ...], C vectors in registers. */
static inline __attribute__((always_inline)) void st_weigh(
        const float *v, const float *p, float *out, ptrdiff_t len, ptrdiff_t hd, int C) {
    mv_v8 acc[8];
    for (int c = 0; c < C; c++) acc[c] = mv_load(out + 8 * c);
    for (ptrdiff_t t = 0; t < len; t++)
        for (int c = 0; c < C; c++) acc[c] += p[t] * mv_load(v + t * hd + 8 * c);
    for (int c = 0; c < C; c++) memcpy(out + 8 * c, &acc[c], sizeof acc[c]);
}

/* q . k_t over the head's first hv values, in eight lanes (st_tail adds the rest). */
static inline __attribute__((always_inline)) mv_v8 st_dot_lanes(
        const float *q, const float *kt, ptrdiff_t hv) {
    mv_v8 acc = {0};
    for (ptrdiff_t i = 0; i < hv; i += 8) acc += mv_load(q + i) * mv_load(kt + i);
    return acc;
}

static inline __attribute__((always_inline)) float st_tail(
        const float *q, const float *kt, ptrdiff_t hv, ptrdiff_t hd) {
    float s = 0.0f;
    for (ptrdiff_t i = hv; i < hd; i++) s += q[i] * kt[i];
    return s;
}

/* scores[t] = q . k_t * scale for t < len, eight keys at a time (each key's sum the same
   wherever it falls); returns the largest. */
static inline __attribute__((always_inline)) float st_scores(
        const float *q, const float *k, float *scores, ptrdiff_t len, ptrdiff_t hd, float scale) {
    ptrdiff_t hv = hd - hd % 8, t = 0;
    mv_v8 tops = {-INFINITY, -INFINITY, -INFINITY, -INFINITY,
                  -INFINITY, -INFINITY, -INFINITY, -INFINITY};
    for (; t + 8 <= len; t += 8) {
        mv_v8 acc[8] = {{0}};  /* each key's lanes summed as st_dot_lanes sums them */
        for (ptrdiff_t i = 0; i < hv; i += 8) {
            mv_v8 qi = mv_load(q + i);  /* once for the 8 keys */
            for (int j = 0; j < 8; j++) acc[j] += qi * mv_load(k + (t + j) * hd + i);
        }
        mv_v8 s = st_pairwise8(acc);
        if (hv < hd)  /* lanes written one by one, then read whole: a store-forwarding stall */
            for (int j = 0; j < 8; j++) s[j] += st_tail(q, k + (t + j) * hd, hv, hd);
        s *= scale;
        memcpy(scores + t, &s, sizeof s);
        for (int j = 0; j < 8; j++) tops[j] = s[j] > tops[j] ? s[j] : tops[j];  /* vmaxps */
    }
    float top = -INFINITY;
    for (int j = 0; j < 8; j++) top = tops[j] > top ? tops[j] : top;
    for (; t < len; t++) {
        const float *kt = k + t * hd;
        scores[t] = (st_pairwise(st_dot_lanes(q, kt, hv)) + st_tail(q, kt, hv, hd)) * scale;
        top = scores[t] > top ? scores[t] : top;
    }
    return top;
}

/* scores[t] = exp(scores[t] - top) for t < len, eight at a time; returns their sum (eight
   lanes of partial sums, then the lanes pairwise). */
static inline __attribute__((always_inline)) float st_exps(float *scores, ptrdiff_t len,
                                                           float top) {
    mv_v8 sum = {0};
    ptrdiff_t t = 0;
    for (; t + 8 <= len; t += 8) {  /* whole vectors: no copy of a variable length */
        mv_v8 e = st_exp8(mv_load(scores + t) - top);
        memcpy(scores + t, &e, sizeof e);
        sum += e;
    }
    if (t < len) {
        ptrdiff_t n = len - t;
        mv_v8 s = {0};
        memcpy(&s, scores + t, n * sizeof(float));
        mv_v8 e = st_exp8(s - top);
        for (ptrdiff_t j = n; j < 8; j++) e[j] = 0.0f;
        memcpy(scores + t, &e, n * sizeof(float));
        sum += e;
    }
    return st_pairwise(sum);
}

/* out (hd) += sum over t < len of p_t v_t, in order of t, eight vectors of out at a time in
   registers (a sum through memory would wait on its own store at every key; eight chains of
   additions keep the FMA units busy where four wait on their latency). */
static inline __attribute__((always_inline)) void st_weigh_all(
        const float *v, const float *p, float *out, ptrdiff_t len, ptrdiff_t hd) {
    ptrdiff_t hv = hd - hd % 8, i0 = 0;
    for (; i0 + 64 <= hv; i0 += 64) st_weigh(v + i0, p, out + i0, len, hd, 8);
    for (; i0 + 32 <= hv; i0 += 32) st_weigh(v + i0, p, out + i0, len, hd, 4);
    for (; i0 < hv; i0 += 8) st_weigh(v + i0, p, out + i0, len, hd, 1);
    for (ptrdiff_t i = hv; i < hd; i++) {
        float o = out[i];
        for (ptrdiff_t t = 0; t < len; t++) o += p[t] * v[t * hd + i];
        out[i] = o;
    }
}

/* One query head over keys [0, len) of its KV head, scores scaled by ``scale``: out
   (head_dim); scores (len) scratch. */
static inline __attribute__((always_inline)) void st_head_body(
        const float *q, const float *k, const float *v, float *out, float *scores,
        ptrdiff_t len, ptrdiff_t hd, float scale) {
    float top = st_scores(q, k, scores, len, hd, scale);
    float inv = 1.0f / st_exps(scores, len, top);
    for (ptrdiff_t t = 0; t < len; t++) scores[t] *= inv;
    memset(out, 0, hd * sizeof(float));
    st_weigh_all(v, scores, out, len, hd);
}

/* x as an IEEE half, rounded to nearest even (beyond 65504 infinity, NaN a quiet NaN), as
   numpy's astype(float16) and F16C's vcvtps2ph round it. */
static inline uint16_t st_half_of(float x) {
    uint32_t u, a;
    memcpy(&u, &x, 4);
    uint32_t sign = (u >> 16) & 0x8000u;
    a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  /* 65520 and up round up */
    if (a < 0x38800000u) {  /* below 2^-14: a subnormal half or zero, rounded by the FPU */
        float f;
        memcpy(&f, &a, 4);
        f += 0.5f;  /* its last bit is 2^-24, the subnormal halves' step */
        memcpy(&a, &f, 4);
        return (uint16_t)(sign | (a - 0x3f000000u));
    }
    a += ((uint32_t)(15 - 127) << 23) + 0xfffu + ((a >> 13) & 1u);
    return (uint16_t)(sign | (a >> 13));
}

static void st_halves(const float *x, uint16_t *h, ptrdiff_t n) {
    for (ptrdiff_t i = 0; i < n; i++) h[i] = st_half_of(x[i]);
}

/* f[0 .. n) = the halves h[0 .. n), exactly. */
typedef void (*st_widen_fn)(const uint16_t *, float *, ptrdiff_t);
static void st_widen_base(const uint16_t *h, float *f, ptrdiff_t n) {
    for (ptrdiff_t i = 0; i < n; i++) f[i] = qm_half((const uint8_t *)(h + i));
}
#ifdef MV_X86
__attribute__((target("avx2,fma,f16c"))) static void st_widen_f16c(const uint16_t *h, float *f,
                                                                   ptrdiff_t n) {
    ptrdiff_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
    for (; i < n; i++) f[i] = qm_half((const uint8_t *)(h + i));
}
#endif
/* One query of st_heads_half: a query head of one row, its output and scores (scratch), and
   how many keys from the first it attends. */
typedef struct {
    const float *q;
    float *out, *scores;
    ptrdiff_t len;
} st_query;

/* Queries qs[0 .. n) of one KV head over its half keys and values, each as st_head_body over
   their float values (the same sums in the same order), ST_KV_CHUNK keys or values widened
   into ``wide`` (ST_KV_CHUNK hd floats) at a time, once for all n: the query heads of a row
   and the rows of one sample that share the head's keys (all but the last few). */
static inline __attribute__((always_inline)) void st_heads_half_body(
        const st_query *qs, ptrdiff_t n, const uint16_t *k, const uint16_t *v, float *wide,
        ptrdiff_t hd, float scale, st_widen_fn widen) {
    float tops[ST_QUERIES_AT_ONCE];
    ptrdiff_t longest = 0;
    for (ptrdiff_t i = 0; i < n; i++) {
        tops[i] = -INFINITY;
        longest = qs[i].len > longest ? qs[i].len : longest;
    }
    for (ptrdiff_t t = 0; t < longest; t += ST_KV_CHUNK) {
        widen(k + t * hd, wide, (longest - t < ST_KV_CHUNK ? longest - t : ST_KV_CHUNK) * hd);
        for (ptrdiff_t i = 0; i < n; i++) {
            ptrdiff_t keys = qs[i].len - t < ST_KV_CHUNK ? qs[i].len - t : ST_KV_CHUNK;
            if (keys <= 0) continue;
            float top = st_scores(qs[i].q, wide, qs[i].scores + t, keys, hd, scale);
            tops[i] = top > tops[i] ? top : tops[i];
        }
    }
    for (ptrdiff_t i = 0; i < n; i++) {
        float *p = qs[i].scores, inv = 1.0f / st_exps(p, qs[i].len, tops[i]);
        for (ptrdiff_t t = 0; t < qs[i].len; t++) p[t] *= inv;
        memset(qs[i].out, 0, hd * sizeof(float));
    }
    for (ptrdiff_t t = 0; t < longest; t += ST_KV_CHUNK) {
        widen(v + t * hd, wide, (longest - t < ST_KV_CHUNK ? longest - t : ST_KV_CHUNK) * hd);
        for (ptrdiff_t i = 0; i < n; i++) {
            ptrdiff_t keys = qs[i].len - t < ST_KV_CHUNK ? qs[i].len - t : ST_KV_CHUNK;
            if (keys > 0) st_weigh_all(wide, qs[i].scores + t, qs[i].out, keys, hd);
        }
    }
}

typedef void (*st_heads_half_fn)(const st_query *, ptrdiff_t, const uint16_t *,
                                 const uint16_t *, float *, ptrdiff_t, float);
#define ST_HEADS_HALF_FN(name, attrs, widen)                                                 \
    attrs static void name(const st_query *qs, ptrdiff_t n, const uint16_t *k,               \
                           const uint16_t *v, float *wide, ptrdiff_t hd, float scale) {      \
        st_heads_half_body(qs, n, k, v, wide, hd, scale, widen);                             \
    }
ST_HEADS_HALF_FN(st_heads_half_base, , st_widen_base)
#ifdef MV_X86
ST_HEADS_HALF_FN(st_heads_half_avx2, __attribute__((target("avx2,fma"))), st_widen_f16c)
#endif
static st_heads_half_fn st_heads_half = st_heads_half_base;
static st_widen_fn st_widen = st_widen_base;  /* st_heads_half's, apart (tests) */

typedef void (*st_head_fn)(const float *, const float *, const float *, float *, float *,
                           ptrdiff_t, ptrdiff_t, float);
#define ST_HEAD_FN(name, attrs)                                                              \
    attrs static void name(const float *q, const float *k, const float *v, float *out,      \
                           float *scores, ptrdiff_t len, ptrdiff_t hd, float scale) {        \
        st_head_body(q, k, v, out, scores, len, hd, scale);                                  \
    }
ST_HEAD_FN(st_head_base, )
#ifdef MV_X86
ST_HEAD_FN(st_head_avx2, __attribute__((target("avx2,fma"))))
#endif
static st_head_fn st_head = st_head_base;

/* activation(g) * u in eight lanes: silu(g) = g / (1 + e^-g), or gelu's tanh approximation
   (torch's gelu(approximate="tanh"), 0.5 g (1 + tanh y)) as the same g / (1 + e^-2y), which
   equals it and keeps its relative precision where tanh y nears -1. */
static inline __attribute__((always_inline)) mv_v8 st_act8(int activation, mv_v8 g, mv_v8 u) {
    const float beta = 0.7978845608028654f, kappa = 0.044715f;  /* sqrt(2 / pi) */
    mv_v8 y = activation == ST_GELU_TANH ? (g + kappa * (g * g * g)) * (2.0f * beta) : g;
    return g / (1.0f + st_exp8(-y)) * u;
}

/* a[j0 .. j1) = activation(g) * u there, eight at a time; the last few through the same
   lanes (zero-padded), so a value does not depend on where a thread's columns end. */
static inline __attribute__((always_inline)) void st_act_body(
        int activation, const float *g, const float *u, float *a, ptrdiff_t j0, ptrdiff_t j1) {
    ptrdiff_t i = j0;
    for (; i + 8 <= j1; i += 8) {
        mv_v8 v = st_act8(activation, mv_load(g + i), mv_load(u + i));
        memcpy(a + i, &v, sizeof v);
    }
    if (i < j1) {
        float gt[8] = {0}, ut[8] = {0}, at[8];
        memcpy(gt, g + i, sizeof(float) * (size_t)(j1 - i));
        memcpy(ut, u + i, sizeof(float) * (size_t)(j1 - i));
        mv_v8 v = st_act8(activation, mv_load(gt), mv_load(ut));
        memcpy(at, &v, sizeof v);
        memcpy(a + i, at, sizeof(float) * (size_t)(j1 - i));
    }
}

typedef void (*st_act_fn)(int, const float *, const float *, float *, ptrdiff_t, ptrdiff_t);
#define ST_ACT_FN(name, attrs)                                                               \
    attrs static void name(int activation, const float *g, const float *u, float *a,         \
                           ptrdiff_t j0, ptrdiff_t j1) {                                     \
        st_act_body(activation, g, u, a, j0, j1);                                            \
    }
ST_ACT_FN(st_act_base, )
#ifdef MV_X86
ST_ACT_FN(st_act_avx2, __attribute__((target("avx2,fma"))))
#endif
static st_act_fn st_act_cols = st_act_base;  /* st_init picks this CPU's */

/* matvec.h's and quant.h's kernels, the attention head and the activation for this CPU; once,
   before any step. */
static void st_init(void) {
    mv_init();
    qm_init();
#ifdef MV_X86
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        st_head = st_head_avx2;
        st_act_cols = st_act_avx2;
        if (__builtin_cpu_supports("f16c")) {
            st_heads_half = st_heads_half_avx2;
            st_widen = st_widen_f16c;
        }
    }
#endif
}

/* Each of ``heads`` heads of hd (in place) normed by RMSNorm of weights w. */
static void st_head_norms(float *x, const float *w, ptrdiff_t heads, ptrdiff_t hd, float eps) {
    for (ptrdiff_t h = 0; h < heads; h++) st_rmsnorm(x + h * hd, w, x + h * hd, hd, eps);
}

/* Each of ``heads`` heads of hd (in place) from the RoPE-pair order, values (i, 0) and (i, 1) of
   pair i side by side, into the "rotate half" order: all (i, 0), then all (i, 1). */
static void st_unpair(float *x, ptrdiff_t heads, ptrdiff_t hd) {
    float pairs[ST_MAX_HEAD_DIM];
    for (ptrdiff_t h = 0; h < heads; h++, x += hd) {
        memcpy(pairs, x, hd * sizeof(float));
        for (ptrdiff_t i = 0; i < hd / 2; i++) {
            x[i] = pairs[2 * i];
            x[i + hd / 2] = pairs[2 * i + 1];
        }
    }
}

/* Every row's Q/K/V (Q and K put in order where in pairs) with the bias added and Q and K
   normed per head (where the block has them), Q and K roped at the row's position, K and V
   written to the row's cache slot (rounded to halves where kv_half). */
static void st_rope_write(const st_block *b, float *qkv, int R, const long long *slots,
                          const long long *pos) {
    ptrdiff_t hd = b->head_dim, q_dim = b->n_heads * hd, kv_dim = b->n_kv * hd;
    ptrdiff_t width = q_dim + 2 * kv_dim;
    for (int r = 0; r < R; r++) {
        float *row = qkv + r * width;
        const float *c = b->cos + pos[r] * hd, *s = b->sin + pos[r] * hd;
        if (b->qk_pairs) st_unpair(row, b->n_heads + b->n_kv, hd);
        if (b->qkv_bias)
            for (ptrdiff_t i = 0; i < width; i++) row[i] += b->qkv_bias[i];
        if (b->q_norm) st_head_norms(row, b->q_norm, b->n_heads, hd, b->eps);
        if (b->k_norm) st_head_norms(row + q_dim, b->k_norm, b->n_kv, hd, b->eps);
        for (ptrdiff_t h = 0; h < b->n_heads + b->n_kv; h++) st_rope(row + h * hd, c, s, hd);
        for (ptrdiff_t h = 0; h < b->n_kv; h++) {
            ptrdiff_t at = ((slots[r] * b->n_kv + h) * b->max_seq + pos[r]) * hd;
            const float *k = row + q_dim + h * hd, *v = row + q_dim + kv_dim + h * hd;
            if (b->kv_half) {
                st_halves(k, (uint16_t *)b->k + at, hd);
                st_halves(v, (uint16_t *)b->v + at, hd);
            } else {
                memcpy((float *)b->k + at, k, hd * sizeof(float));
                memcpy((float *)b->v + at, v, hd * sizeof(float));
            }
        }
    }
}

/* Scratch of one step: each thread's normed rows, Q/K/V, attention, a product's output
   before its sandwich norm, gate/up, SwiGLU, scores, each thread's activation sums for
   quantized products (qm_xsum) and, for a mixture of experts, each thread's routing
   (step_moe.h's st_route), the router's logits and the experts' down products; each thread's
   keys or values widened from halves (ST_KV_CHUNK of them). */
typedef struct {
    float *h, *qkv, *att, *o, *gu, *act, *scores, *xs, *route, *logits, *ydown, *wide;
    ptrdiff_t longest;  /* the furthest row's keys: positions + 1 */
    ptrdiff_t xs_floats, route_floats;  /* one thread's share of xs, of route */
    int dot;  /* the q8 mode (quant.h's integer kernels) where not 0 */
} st_scratch;

/* The feed-forward's rows: R, or with experts R top_k (one per row and chosen expert). */
static ptrdiff_t st_ffn_rows(const st_block *b, int R) {
    return (ptrdiff_t)R * (b->n_experts > 0 ? b->top_k : 1);
}

/* One thread's product inputs (qm_input_fill's sums and quantized rows): the feed-forward's
   rows of the widest product input. */
static ptrdiff_t st_xs_floats(const st_block *b, int R) {
    ptrdiff_t widest = b->dim, q_dim = b->n_heads * b->head_dim;
    if (q_dim > widest) widest = q_dim;
    if (b->hidden > widest) widest = b->hidden;
    return (ptrdiff_t)qm_input_floats(widest, (int)st_ffn_rows(b, R));
}

/* One thread's routing: probabilities (n_experts), weights, five int arrays of the
   assignments and the assigned rows gathered (st_route_at). */
static ptrdiff_t st_route_floats(const st_block *b, int R) {
    ptrdiff_t n = st_ffn_rows(b, R);
    return b->n_experts > 0 ? b->n_experts + 7 * n + 1 + n * b->dim : 0;
}

static size_t st_scratch_floats(const st_block *b, int R, ptrdiff_t longest, int threads) {
    ptrdiff_t q_dim = b->n_heads * b->head_dim, width = q_dim + 2 * b->n_kv * b->head_dim;
    ptrdiff_t ffn = st_ffn_rows(b, R);
    size_t experts = b->n_experts > 0 ? (size_t)(R * b->n_experts + ffn * b->dim) : 0;
    return (size_t)R * ((threads + 1) * b->dim + width + q_dim + b->n_heads * longest)
           + (size_t)ffn * 3 * b->hidden
           + (size_t)threads * (st_xs_floats(b, R) + st_route_floats(b, R)) + experts
           + (size_t)threads * ST_KV_CHUNK * b->head_dim;
}

static void st_scratch_at(st_scratch *s, const st_block *b, int R, int threads, float *base) {
    ptrdiff_t q_dim = b->n_heads * b->head_dim, width = q_dim + 2 * b->n_kv * b->head_dim;
    ptrdiff_t ffn = st_ffn_rows(b, R);
    s->xs_floats = st_xs_floats(b, R);
    s->route_floats = st_route_floats(b, R);
    s->h = base;
    s->qkv = s->h + (ptrdiff_t)threads * R * b->dim;
    s->att = s->qkv + R * width;
    s->o = s->att + R * q_dim;
    s->gu = s->o + R * b->dim;
    s->act = s->gu + ffn * 2 * b->hidden;
    s->scores = s->act + ffn * b->hidden;
    s->xs = s->scores + R * b->n_heads * s->longest;
    s->route = s->xs + (ptrdiff_t)threads * s->xs_floats;
    s->logits = s->route + (ptrdiff_t)threads * s->route_floats;
    s->ydown = s->logits + R * b->n_experts;
    s->wide = s->ydown + (b->n_experts > 0 ? ffn * b->dim : 0);
}

static int st_thread(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

static int st_team(void) {
#ifdef _OPENMP
    return omp_get_num_threads();
#else
    return 1;
#endif
}

/* Where the t-th of ``parts`` stretches of n columns starts, a multiple of MV_COLS. */
static ptrdiff_t st_split(ptrdiff_t n, int parts, int t) {
    return t >= parts ? n : n * t / parts / MV_COLS * MV_COLS;
}

/* in: what quant.h's kernels of the ``count`` matrices ms read of x (R rows of k) besides x,
   made in this thread's own part of the scratch (qm_input_fill). */
static void st_input(const st_matrix *ms, ptrdiff_t count, const float *x, ptrdiff_t k, int R,
                     const st_scratch *s, qm_input *in) {
    int types[64], n = 0;
    for (ptrdiff_t i = 0; i < count; i++)
        for (int p = 0; p < ms[i].parts && n < 64; p++)
            if (ms[i].t[p] != ST_FLOAT) {
                int seen = 0;
                for (int j = 0; j < n; j++) seen |= types[j] == ms[i].t[p];
                if (!seen) types[n++] = ms[i].t[p];
            }
    qm_input_fill(in, types, n, s->dot, x, k, R, s->xs + (ptrdiff_t)st_thread() * s->xs_floats,
                  1);
}

/* Columns [j0, j1) of y = base + x W^T (base NULL: y = x W^T) for every row, W (n, k) the
   stacked matrix m, y's rows n floats apart; each part does its own columns. */
static void st_product_cols(const st_matrix *m, const float *x, const qm_input *in, float *y,
                            const float *base, ptrdiff_t n, ptrdiff_t k, int R, ptrdiff_t j0,
                            ptrdiff_t j1) {
    if (m->t[0] == ST_FLOAT) {
        mv_range((const float *)m->w[0], x, y, base, n, k, R, j0, j1);
        return;
    }
    ptrdiff_t first = 0;
    for (int p = 0; p < m->parts; first += m->n[p], p++) {
        ptrdiff_t a = j0 > first ? j0 - first : 0, b = j1 - first;
        if (b > m->n[p]) b = m->n[p];
        if (a < b)
            qm_range_x8(m->t[p], (const uint8_t *)m->w[p], (const uint8_t *)m->x8[p], x, in,
                        y + first, base ? base + first : NULL, n, k, R, a, b);
    }
}

/* y = base + x W^T (base NULL: y = x W^T), W (n, k) the stacked matrix m, for the team
   (every thread calls it; it ends with the team's barrier): QM_COLS_PER_TASK columns of one
   part per task, one loop over every part's tasks. */
static void st_product_team(const st_matrix *m, const float *x, float *y, const float *base,
                            ptrdiff_t n, ptrdiff_t k, int R, const st_scratch *s) {
    if (m->t[0] == ST_FLOAT) {
        mv_rows_team((const float *)m->w[0], x, y, base, n, k, R);
        return;
    }
    qm_input in;
    st_input(m, 1, x, k, R, s, &in);
    ptrdiff_t tasks = 0;
    for (int p = 0; p < m->parts; p++)
        tasks += (m->n[p] + QM_COLS_PER_TASK - 1) / QM_COLS_PER_TASK;
    #pragma omp for schedule(static)
    for (ptrdiff_t t = 0; t < tasks; t++) {
        ptrdiff_t task = t, first = 0;
        int p = 0;
        for (;; first += m->n[p], p++) {  /* the part holding task t, and its first column */
            ptrdiff_t count = (m->n[p] + QM_COLS_PER_TASK - 1) / QM_COLS_PER_TASK;
            if (task < count) break;
            task -= count;
        }
        ptrdiff_t j0 = first + task * QM_COLS_PER_TASK, end = first + m->n[p];
        ptrdiff_t j1 = j0 + QM_COLS_PER_TASK < end ? j0 + QM_COLS_PER_TASK : end;
        st_product_cols(m, x, &in, y, base, n, k, R, j0, j1);
    }
}

/* gate/up products (gate_up, 2 hidden by dim, into gu) of hidden columns [j0, j1) and act =
   activation(gate) * up of them, for R rows h; in as st_input's of h. */
static void st_gated_cols(const st_matrix *gate_up, int activation, const float *h,
                          const qm_input *in, float *gu, float *act, ptrdiff_t hidden,
                          ptrdiff_t dim, int R, ptrdiff_t j0, ptrdiff_t j1) {
    st_product_cols(gate_up, h, in, gu, NULL, 2 * hidden, dim, R, j0, j1);
    st_product_cols(gate_up, h, in, gu, NULL, 2 * hidden, dim, R, hidden + j0, hidden + j1);
    for (int r = 0; r < R; r++) {
        const float *g = gu + r * 2 * hidden;
        st_act_cols(activation, g, g + hidden, act + r * hidden, j0, j1);
    }
}

/* out (rows, hidden) = activation(gate) * up of both = [gate | up] (rows, 2 hidden), the
   rows shared among ``threads``: a prefill's feed-forward, in the step's lanes. */
static void st_act_rows(int activation, const float *both, float *out, ptrdiff_t rows,
                        ptrdiff_t hidden, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows > 1)
    for (ptrdiff_t r = 0; r < rows; r++) {
        const float *g = both + r * 2 * hidden;
        st_act_cols(activation, g, g + hidden, out + r * hidden, 0, hidden);
    }
}

/* x += RMSNorm(o) (weights w) for R rows of dim, the norm written over o; rows shared out,
   ending with the team's barrier. */
static void st_add_normed_team(const float *w, float *o, float *x, int R, ptrdiff_t dim,
                               float eps) {
    #pragma omp for schedule(static)
    for (int r = 0; r < R; r++) {
        st_rmsnorm(o + r * dim, w, o + r * dim, dim, eps);
        for (ptrdiff_t i = 0; i < dim; i++) x[r * dim + i] += o[r * dim + i];
    }
}

/* x += the product of m with a (R rows of k) for the team: straight into x, or, with a
   sandwich norm ``post`` (NULL: none), through o and the norm (one more barrier). */
static void st_residual_team(const st_matrix *m, const float *post, const float *a, float *x,
                             ptrdiff_t dim, ptrdiff_t k, int R, const st_block *b,
                             const st_scratch *s) {
    if (post == NULL) {
        st_product_team(m, a, x, x, dim, k, R, s);
        return;
    }
    st_product_team(m, a, s->o, NULL, dim, k, R, s);
    st_add_normed_team(post, s->o, x, R, dim, b->eps);
}

/* x += the dense feed-forward of h (R rows normed): the gate/up columns shared out, one
   stretch per thread (one barrier), then the down product (one, and one more with a
   sandwich norm). */
static void st_dense_team(const st_block *b, const float *h, float *x, int R,
                          const st_scratch *s) {
    ptrdiff_t dim = b->dim, hidden = b->hidden;
    int team = st_team();
    qm_input in;
    st_input(&b->gate_up, 1, h, dim, R, s, &in);
    #pragma omp for schedule(static)  /* one stretch of columns per thread */
    for (int t = 0; t < team; t++)
        st_gated_cols(&b->gate_up, b->activation, h, &in, s->gu, s->act, hidden, dim, R,
                      st_split(hidden, team, t), st_split(hidden, team, t + 1));
    st_residual_team(&b->down, b->post_mlp_norm, s->act, x, dim, hidden, R, b, s);
}

#include "step_moe.h"

/* The first key row r attends (past a sliding window's start). */
static ptrdiff_t st_first_key(const st_block *b, const long long *pos, int r) {
    return b->window && pos[r] >= b->window ? pos[r] + 1 - b->window : 0;
}

/* How many query-head parts a KV head's task of the attention over half caches is cut into:
   as few as keep every thread busy (``kv_tasks`` tasks before the cut), so that a chunk of
   keys is widened once for many; at most ST_GROUP_AT_ONCE heads a part. */
static ptrdiff_t st_group_parts(ptrdiff_t group, ptrdiff_t kv_tasks, int threads) {
    ptrdiff_t parts = (threads + kv_tasks - 1) / kv_tasks;
    ptrdiff_t fewest = (group + ST_GROUP_AT_ONCE - 1) / ST_GROUP_AT_ONCE;
    if (parts < fewest) parts = fewest;
    return parts < group ? parts : group;
}

/* Whether row r attends over row r - 1's keys: the same sample, from the same first key. */
static int st_same_keys(const st_block *b, const long long *slots, const long long *pos, int r) {
    return slots[r] == slots[r - 1] && st_first_key(b, pos, r) == st_first_key(b, pos, r - 1);
}

/* The rows of the attention over half caches, in pieces that attend over the same keys: runs
   of consecutive rows of one sample from the same first key (a verified draft's, a prompt
   chunk's), each cut into at least ``cuts`` pieces and pieces of at most ``most`` rows.
   Piece p is rows starts[p] .. starts[p + 1]; returns how many (starts: R + 1 ints). */
static int st_row_pieces(const st_block *b, int R, const long long *slots, const long long *pos,
                         int cuts, int most, int *starts) {
    int count = 0;
    for (int r0 = 0, r1; r0 < R; r0 = r1) {
        for (r1 = r0 + 1; r1 < R && st_same_keys(b, slots, pos, r1); r1++) {}
        int len = r1 - r0, m = (len + most - 1) / most;
        if (m < cuts) m = cuts;
        if (m > len) m = len;
        for (int j = 0; j < m; j++) starts[count++] = r0 + len * j / m;
    }
    starts[count] = R;
    return count;
}

/* How many runs st_row_pieces finds. */
static int st_row_runs(const st_block *b, int R, const long long *slots, const long long *pos) {
    int runs = R > 0;
    for (int r = 1; r < R; r++) runs += !st_same_keys(b, slots, pos, r);
    return runs;
}

/* The team's attention of R rows over half caches (st_block_team's, where kv_half): a task
   takes one KV head of a piece of rows (st_row_pieces: as few as leave no thread idle; each
   thread works them out alike) and some of its query heads (st_group_parts). */
static void st_attend_half_team(const st_block *b, int R, const long long *slots,
                                const long long *pos, const st_scratch *s, float scale) {
    ptrdiff_t hd = b->head_dim, q_dim = b->n_heads * hd, group = b->n_heads / b->n_kv;
    ptrdiff_t width = q_dim + 2 * b->n_kv * hd, team = st_team();
    ptrdiff_t kv_runs = (ptrdiff_t)st_row_runs(b, R, slots, pos) * b->n_kv;
    int cuts = team > 1 ? (int)((2 * team + kv_runs - 1) / kv_runs) : 1;
    int most = ST_QUERIES_AT_ONCE / (int)(group < ST_GROUP_AT_ONCE ? group : ST_GROUP_AT_ONCE);
    int starts[R + 1];
    ptrdiff_t pieces = st_row_pieces(b, R, slots, pos, cuts, most, starts);
    ptrdiff_t parts = st_group_parts(group, pieces * b->n_kv, (int)team);
    #pragma omp for schedule(static)
    for (ptrdiff_t t = 0; t < pieces * b->n_kv * parts; t++) {
        ptrdiff_t piece = t / (b->n_kv * parts), kv = t / parts % b->n_kv, part = t % parts;
        ptrdiff_t h0 = kv * group + part * group / parts;
        ptrdiff_t h1 = kv * group + (part + 1) * group / parts, n = 0;
        int r0 = starts[piece], first = (int)st_first_key(b, pos, r0);
        st_query qs[ST_QUERIES_AT_ONCE];
        for (int r = r0; r < starts[piece + 1]; r++)
            for (ptrdiff_t h = h0; h < h1; h++, n++)
                qs[n] = (st_query){s->qkv + r * width + h * hd, s->att + r * q_dim + h * hd,
                                   s->scores + (r * b->n_heads + h) * s->longest,
                                   pos[r] + 1 - first};
        ptrdiff_t at = ((slots[r0] * b->n_kv + kv) * b->max_seq + first) * hd;
        st_heads_half(qs, n, (const uint16_t *)b->k + at, (const uint16_t *)b->v + at,
                      s->wide + (ptrdiff_t)st_thread() * ST_KV_CHUNK * hd, hd, scale);
    }
}

/* x = block(x) for R rows, in place. Every thread of the team calls it: each normalizes
   the rows for itself (its own copy, no wait), the products, attention heads and the
   gate/up columns are shared out, the bias, Q/K norms, RoPE and the cache write run on one
   thread, and each shared phase ends with the team's barrier: six per block, and one more
   for each sandwich norm. */
static void st_block_team(const st_block *b, float *x, int R, const long long *slots,
                          const long long *pos, const st_scratch *s) {
    ptrdiff_t dim = b->dim, hd = b->head_dim, q_dim = b->n_heads * hd;
    ptrdiff_t width = q_dim + 2 * b->n_kv * hd, group = b->n_heads / b->n_kv;
    ptrdiff_t heads = (ptrdiff_t)R * b->n_heads;
    float scale = b->attn_scale > 0.0f ? b->attn_scale : 1.0f / sqrtf((float)hd);
    float *h = s->h + (ptrdiff_t)st_thread() * R * dim;
    for (int r = 0; r < R; r++) st_rmsnorm(x + r * dim, b->attn_norm, h + r * dim, dim, b->eps);
    st_product_team(&b->qkv, h, s->qkv, NULL, width, dim, R, s);
    #pragma omp single
    st_rope_write(b, s->qkv, R, slots, pos);
    if (b->kv_half)
        st_attend_half_team(b, R, slots, pos, s, scale);
    else {
        #pragma omp for schedule(static)
        for (ptrdiff_t t = 0; t < heads; t++) {
            ptrdiff_t r = t / b->n_heads, hh = t % b->n_heads;
            ptrdiff_t first = st_first_key(b, pos, (int)r);
            ptrdiff_t at = ((slots[r] * b->n_kv + hh / group) * b->max_seq + first) * hd;
            st_head(s->qkv + r * width + hh * hd, (const float *)b->k + at,
                    (const float *)b->v + at, s->att + r * q_dim + hh * hd,
                    s->scores + t * s->longest, pos[r] + 1 - first, hd, scale);
        }
    }
    st_residual_team(&b->wo, b->post_attn_norm, s->att, x, dim, q_dim, R, b, s);  /* attention */
    for (int r = 0; r < R; r++) st_rmsnorm(x + r * dim, b->mlp_norm, h + r * dim, dim, b->eps);
    if (b->n_experts > 0)
        st_moe_team(b, h, x, R, s);
    else
        st_dense_team(b, h, x, R, s);
}

/* The n blocks of bs applied to x (R rows, in place) by each thread of the team, or by the
   calling thread alone outside one. */
static void st_blocks_team(const st_block *bs, int n, float *x, int R, const long long *slots,
                           const long long *pos, int threads, int dot, ptrdiff_t longest,
                           float *base) {
    for (int i = 0; i < n; i++) {
        st_scratch s;
        s.longest = longest;
        s.dot = dot;
        st_scratch_at(&s, &bs[i], R, threads, base);
        st_block_team(&bs[i], x, R, slots, pos, &s);
    }
}

/* out = the n blocks of bs applied to x one after another, in one parallel region of
   ``threads``; returns 0, or -1 when scratch memory cannot be had. */
static int st_blocks_step(const st_block *bs, int n, const float *x, float *out, int R,
                          const long long *slots, const long long *pos, int threads, int dot) {
    ptrdiff_t longest = 0;
    for (int r = 0; r < R; r++)
        if (pos[r] + 1 > longest) longest = pos[r] + 1;
    size_t floats = 0;
    for (int i = 0; i < n; i++) {
        size_t need = st_scratch_floats(&bs[i], R, longest, threads);
        if (need > floats) floats = need;
    }
    float *base = malloc(floats * sizeof(float));
    if (base == NULL) return -1;
    memmove(out, x, (size_t)R * bs[0].dim * sizeof(float));
    if (threads > 1) {
        #pragma omp parallel num_threads(threads)
        st_blocks_team(bs, n, out, R, slots, pos, threads, dot, longest, base);
    } else {  /* no team: the worksharing runs on this thread and its barriers make no call */
        st_blocks_team(bs, n, out, R, slots, pos, threads, dot, longest, base);
    }
    free(base);
    return 0;
}

/* out = head(norm(x)) for R rows: the model's final RMSNorm and its head product (vocab, dim),
   the head float32 (head_t ST_FLOAT) or quantized, and then also in the x8 layout where
   head_x8 is not NULL, in one call of ``threads``; returns 0, or -1 when scratch memory cannot
   be had. */
static int st_logits(const float *x, const float *norm, float eps, const void *head,
                     const void *head_x8, int head_t, float *out, ptrdiff_t dim,
                     ptrdiff_t vocab, int R, int threads, int dot) {
    float *h = malloc((size_t)R * dim * sizeof(float));
    if (h == NULL) return -1;
    for (int r = 0; r < R; r++) st_rmsnorm(x + r * dim, norm, h + r * dim, dim, eps);
    int status = 0;
    if (head_t == ST_FLOAT)
        mv_rows((const float *)head, h, out, vocab, dim, R, threads);
    else
        status = qm_rows_into_x8(head_t, (const uint8_t *)head, (const uint8_t *)head_x8, h,
                                 out, vocab, vocab, dim, R, threads, dot);
    free(h);
    return status;
}

static int st_block_step(const st_block *b, const float *x, float *out, int R,
                         const long long *slots, const long long *pos, int threads, int dot) {
    return st_blocks_step(b, 1, x, out, R, slots, pos, threads, dot);
}
