/* One decoder block's decode step, compiled: 1..8 rows, one new token each, float32 on the CPU.
 *
 * A decode step of a small model is bound by dispatch, not by memory: each of a block's
 * twenty-odd torch operations costs microseconds of Python and allocation around a few
 * microseconds of arithmetic. Here the whole block (RMSNorm, fused Q/K/V product, RoPE,
 * the KV cache write, grouped-query attention over the row's cache, output product and
 * residual, RMSNorm, fused gate/up product, SwiGLU, down product and residual) is one call
 * with the GIL released, and a node's consecutive blocks run in one call and one OpenMP
 * parallel region (st_blocks_step). The products are matvec.h's few-row kernel.
 *
 * Every row is computed alone (its own norm, attention and products), so a row's result
 * does not depend on the rows beside it or on the thread count, as with matvec.h.
 *
 * Layouts (row-major): x, out (R, dim); qkv (q_dim + 2 kv_dim, dim); wo (dim, q_dim);
 * gate_up (2 hidden, dim); down (dim, hidden); k, v caches (slots, kv_heads, max_seq,
 * head_dim); cos, sin (rope_len, head_dim) in the "rotate half" layout.
 */
#include <math.h>
#include <stdlib.h>

#include "matvec.h"

typedef struct {
    const float *attn_norm, *qkv, *wo, *mlp_norm, *gate_up, *down, *cos, *sin;
    float *k, *v;
    ptrdiff_t dim, n_heads, n_kv, head_dim, hidden, n_slots, max_seq;
    float eps;
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

/* One query head over keys [0, len) of its KV head: out (head_dim); scores (len) scratch.
   Dot products in eight lanes, then the lanes, then the tail (as matvec.h sums). */
static inline __attribute__((always_inline)) void st_head_body(
        const float *q, const float *k, const float *v, float *out, float *scores,
        ptrdiff_t len, ptrdiff_t hd) {
    ptrdiff_t hv = hd - hd % 8;
    float scale = 1.0f / sqrtf((float)hd), top = -INFINITY, sum = 0.0f;
    for (ptrdiff_t t = 0; t < len; t++) {
        const float *kt = k + t * hd;
        mv_v8 acc = {0};
        for (ptrdiff_t i = 0; i < hv; i += 8) acc += mv_load(q + i) * mv_load(kt + i);
        float s = mv_lanes(acc);
        for (ptrdiff_t i = hv; i < hd; i++) s += q[i] * kt[i];
        scores[t] = s * scale;
        if (scores[t] > top) top = scores[t];
    }
    for (ptrdiff_t t = 0; t < len; t++) {
        scores[t] = expf(scores[t] - top);
        sum += scores[t];
    }
    for (ptrdiff_t i = 0; i < hd; i++) out[i] = 0.0f;
    for (ptrdiff_t t = 0; t < len; t++) {
        float p = scores[t] / sum;
        const float *vt = v + t * hd;
        for (ptrdiff_t i = 0; i < hd; i++) out[i] += p * vt[i];
    }
}

typedef void (*st_head_fn)(const float *, const float *, const float *, float *, float *,
                           ptrdiff_t, ptrdiff_t);
#define ST_HEAD_FN(name, attrs)                                                              \
    attrs static void name(const float *q, const float *k, const float *v, float *out,      \
                           float *scores, ptrdiff_t len, ptrdiff_t hd) {                     \
        st_head_body(q, k, v, out, scores, len, hd);                                         \
    }
ST_HEAD_FN(st_head_base, )
#ifdef MV_X86
ST_HEAD_FN(st_head_avx2, __attribute__((target("avx2,fma"))))
#endif
static st_head_fn st_head = st_head_base;

/* matvec.h's kernels and the attention head for this CPU; once, before any step. */
static void st_init(void) {
    mv_init();
#ifdef MV_X86
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) st_head = st_head_avx2;
#endif
}

/* Q and K of every row roped at its position, K and V written to the row's cache slot. */
static void st_rope_write(const st_block *b, float *qkv, int R, const long long *slots,
                          const long long *pos) {
    ptrdiff_t hd = b->head_dim, q_dim = b->n_heads * hd, kv_dim = b->n_kv * hd;
    ptrdiff_t width = q_dim + 2 * kv_dim;
    for (int r = 0; r < R; r++) {
        float *row = qkv + r * width;
        const float *c = b->cos + pos[r] * hd, *s = b->sin + pos[r] * hd;
        for (ptrdiff_t h = 0; h < b->n_heads + b->n_kv; h++) st_rope(row + h * hd, c, s, hd);
        for (ptrdiff_t h = 0; h < b->n_kv; h++) {
            ptrdiff_t at = ((slots[r] * b->n_kv + h) * b->max_seq + pos[r]) * hd;
            memcpy(b->k + at, row + q_dim + h * hd, hd * sizeof(float));
            memcpy(b->v + at, row + q_dim + kv_dim + h * hd, hd * sizeof(float));
        }
    }
}

/* Scratch of one step: normed rows, Q/K/V, attention, a product, gate/up, SwiGLU, scores. */
typedef struct {
    float *h, *qkv, *att, *o, *gu, *act, *scores;
    ptrdiff_t longest;  /* the furthest row's keys: positions + 1 */
} st_scratch;

static size_t st_scratch_floats(const st_block *b, int R, ptrdiff_t longest) {
    ptrdiff_t q_dim = b->n_heads * b->head_dim, width = q_dim + 2 * b->n_kv * b->head_dim;
    return (size_t)R * (2 * b->dim + width + q_dim + 3 * b->hidden + b->n_heads * longest);
}

static void st_scratch_at(st_scratch *s, const st_block *b, int R, float *base) {
    ptrdiff_t q_dim = b->n_heads * b->head_dim, width = q_dim + 2 * b->n_kv * b->head_dim;
    s->h = base;
    s->qkv = s->h + R * b->dim;
    s->att = s->qkv + R * width;
    s->o = s->att + R * q_dim;
    s->gu = s->o + R * b->dim;
    s->act = s->gu + R * 2 * b->hidden;
    s->scores = s->act + R * b->hidden;
}

/* out = block(x) for R rows. Every thread of the team calls it: the products, attention
   heads and element-wise loops are shared out, the norms and RoPE run on one thread, and
   each phase ends with the team's barrier. */
static void st_block_team(const st_block *b, const float *x, float *out, int R,
                          const long long *slots, const long long *pos, const st_scratch *s) {
    ptrdiff_t dim = b->dim, hd = b->head_dim, q_dim = b->n_heads * hd, hidden = b->hidden;
    ptrdiff_t width = q_dim + 2 * b->n_kv * hd, group = b->n_heads / b->n_kv;
    ptrdiff_t heads = (ptrdiff_t)R * b->n_heads;
    #pragma omp single
    for (int r = 0; r < R; r++) st_rmsnorm(x + r * dim, b->attn_norm, s->h + r * dim, dim, b->eps);
    mv_rows_team(b->qkv, s->h, s->qkv, width, dim, R);
    #pragma omp single
    st_rope_write(b, s->qkv, R, slots, pos);
    #pragma omp for schedule(static)
    for (ptrdiff_t t = 0; t < heads; t++) {
        ptrdiff_t r = t / b->n_heads, h = t % b->n_heads;
        ptrdiff_t base = (slots[r] * b->n_kv + h / group) * b->max_seq * hd;
        st_head(s->qkv + r * width + h * hd, b->k + base, b->v + base, s->att + r * q_dim + h * hd,
                s->scores + t * s->longest, pos[r] + 1, hd);
    }
    mv_rows_team(b->wo, s->att, s->o, dim, q_dim, R);
    #pragma omp single
    for (int r = 0; r < R; r++) {
        for (ptrdiff_t i = r * dim; i < (r + 1) * dim; i++) out[i] = x[i] + s->o[i];
        st_rmsnorm(out + r * dim, b->mlp_norm, s->h + r * dim, dim, b->eps);
    }
    mv_rows_team(b->gate_up, s->h, s->gu, 2 * hidden, dim, R);
    #pragma omp for schedule(static)
    for (ptrdiff_t e = 0; e < R * hidden; e++) {
        ptrdiff_t r = e / hidden, i = e % hidden;
        float g = s->gu[r * 2 * hidden + i], u = s->gu[r * 2 * hidden + hidden + i];
        s->act[e] = g / (1.0f + expf(-g)) * u;
    }
    mv_rows_team(b->down, s->act, s->o, dim, hidden, R);
    #pragma omp for schedule(static)
    for (ptrdiff_t i = 0; i < R * dim; i++) out[i] += s->o[i];
}

/* out = the n blocks of bs applied to x one after another, in one parallel region of
   ``threads``; returns 0, or -1 when scratch memory cannot be had. */
static int st_blocks_step(const st_block *bs, int n, const float *x, float *out, int R,
                          const long long *slots, const long long *pos, int threads) {
    ptrdiff_t longest = 0;
    for (int r = 0; r < R; r++)
        if (pos[r] + 1 > longest) longest = pos[r] + 1;
    size_t floats = 0, bytes = (size_t)R * bs[0].dim * sizeof(float);
    for (int i = 0; i < n; i++) {
        size_t need = st_scratch_floats(&bs[i], R, longest);
        if (need > floats) floats = need;
    }
    float *cur = malloc(bytes + floats * sizeof(float));
    if (cur == NULL) return -1;
    float *base = cur + (size_t)R * bs[0].dim;
    memcpy(cur, x, bytes);
    #pragma omp parallel num_threads(threads) if (threads > 1)
    for (int i = 0; i < n; i++) {
        st_scratch s;
        st_scratch_at(&s, &bs[i], R, base);
        s.longest = longest;
        st_block_team(&bs[i], cur, out, R, slots, pos, &s);
        if (i + 1 < n) {
            #pragma omp single
            memcpy(cur, out, bytes);
        }
    }
    free(cur);
    return 0;
}

static int st_block_step(const st_block *b, const float *x, float *out, int R,
                         const long long *slots, const long long *pos, int threads) {
    return st_blocks_step(b, 1, x, out, R, slots, pos, threads);
}
