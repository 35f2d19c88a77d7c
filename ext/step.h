/* One decoder block's decode step, compiled: 1..8 rows, one new token each, float32 on the CPU.
 *
 * A decode step of a small model is bound by dispatch, not by memory: each of a block's
 * twenty-odd torch operations costs microseconds of Python and allocation around a few
 * microseconds of arithmetic. Here the whole block (RMSNorm, fused Q/K/V product, RoPE,
 * the KV cache write, grouped-query attention over the row's cache, output product and
 * residual, RMSNorm, fused gate/up product, SwiGLU, down product and residual) is one call
 * with the GIL released. The products are matvec.h's few-row kernel.
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

/* Q and K of every row roped at its position, K and V written to the row's cache slot, then
   each query head attends over the row's keys [0, position]; att (R, q_dim). */
static void st_attend(const st_block *b, float *qkv, float *att, float *scores, int R,
                      const long long *slots, const long long *pos, int threads) {
    ptrdiff_t hd = b->head_dim, q_dim = b->n_heads * hd, kv_dim = b->n_kv * hd;
    ptrdiff_t width = q_dim + 2 * kv_dim, group = b->n_heads / b->n_kv, longest = 0;
    for (int r = 0; r < R; r++) {
        float *row = qkv + r * width;
        const float *c = b->cos + pos[r] * hd, *s = b->sin + pos[r] * hd;
        for (ptrdiff_t h = 0; h < b->n_heads + b->n_kv; h++) st_rope(row + h * hd, c, s, hd);
        for (ptrdiff_t h = 0; h < b->n_kv; h++) {
            ptrdiff_t at = ((slots[r] * b->n_kv + h) * b->max_seq + pos[r]) * hd;
            memcpy(b->k + at, row + q_dim + h * hd, hd * sizeof(float));
            memcpy(b->v + at, row + q_dim + kv_dim + h * hd, hd * sizeof(float));
        }
        if (pos[r] + 1 > longest) longest = pos[r] + 1;
    }
    ptrdiff_t tasks = (ptrdiff_t)R * b->n_heads;
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && tasks > 1)
    for (ptrdiff_t t = 0; t < tasks; t++) {
        ptrdiff_t r = t / b->n_heads, h = t % b->n_heads, g = h / group;
        ptrdiff_t base = (slots[r] * b->n_kv + g) * b->max_seq * hd;
        st_head(qkv + r * width + h * hd, b->k + base, b->v + base, att + r * q_dim + h * hd,
                scores + t * longest, pos[r] + 1, hd);
    }
}

/* out = block(x) for R rows; returns 0, or -1 when scratch memory cannot be had. */
static int st_block_step(const st_block *b, const float *x, float *out, int R,
                         const long long *slots, const long long *pos, int threads) {
    ptrdiff_t dim = b->dim, hd = b->head_dim, q_dim = b->n_heads * hd;
    ptrdiff_t width = q_dim + 2 * b->n_kv * hd, hidden = b->hidden, longest = 0;
    for (int r = 0; r < R; r++)
        if (pos[r] + 1 > longest) longest = pos[r] + 1;
    size_t floats = (size_t)R * (dim + width + q_dim + dim + 3 * hidden)
                    + (size_t)R * b->n_heads * longest;
    float *h = malloc(floats * sizeof(float));
    if (h == NULL) return -1;
    float *qkv = h + R * dim, *att = qkv + R * width, *o = att + R * q_dim;
    float *gu = o + R * dim, *act = gu + R * 2 * hidden, *scores = act + R * hidden;
    for (int r = 0; r < R; r++) st_rmsnorm(x + r * dim, b->attn_norm, h + r * dim, dim, b->eps);
    mv_rows(b->qkv, h, qkv, width, dim, R, threads);
    st_attend(b, qkv, att, scores, R, slots, pos, threads);
    mv_rows(b->wo, att, o, dim, q_dim, R, threads);
    for (ptrdiff_t i = 0; i < R * dim; i++) out[i] = x[i] + o[i];
    for (int r = 0; r < R; r++)
        st_rmsnorm(out + r * dim, b->mlp_norm, h + r * dim, dim, b->eps);
    mv_rows(b->gate_up, h, gu, 2 * hidden, dim, R, threads);
    for (int r = 0; r < R; r++)
        for (ptrdiff_t i = 0; i < hidden; i++) {
            float g = gu[r * 2 * hidden + i], u = gu[r * 2 * hidden + hidden + i];
            act[r * hidden + i] = g / (1.0f + expf(-g)) * u;
        }
    mv_rows(b->down, act, o, dim, hidden, R, threads);
    for (ptrdiff_t i = 0; i < R * dim; i++) out[i] += o[i];
    free(h);
    return 0;
}
