/* A mixture of experts as a block's feed-forward in the decode step (Mixtral, Qwen3-MoE),
 * included by step.h, as mdiedge/model/moe.py computes it: per row, the router's logits,
 * their softmax, the top_k probabilities (the lowest expert first among equal ones), those
 * renormalized to sum one where the block says so, and the sum over the chosen experts, in
 * ascending expert order, of each one's gated feed-forward times its weight.
 *
 * Each row is routed alone, and the experts' products run once per chosen expert over the
 * rows it got (gathered, each row still computed alone by the kernels, so a row's result
 * depends neither on the rows beside it nor on the thread count). Three barriers: the
 * router's product (its columns shared out), every chosen expert's gate/up columns (one
 * task per expert and stretch of columns), and their down products with the weighted sum
 * into x (one stretch of x's columns per thread, every expert in it); one more with a
 * sandwich norm. Every thread routes the rows for itself from the shared logits, so the
 * routing adds no barrier.
 */

/* One thread's routing of R rows, n = R top_k assignments (row r's j-th expert is
   assignment r top_k + j, the row's experts in ascending order): ids and weights; ``order``
   the assignments grouped by expert (stable: rows in order) and ``slot`` each assignment's
   place in it; ``groups`` experts chosen, group g expert ``expert[g]`` with places
   [first[g], first[g + 1]); ``gathered`` the assignments' rows of h in group order. */
typedef struct {
    float *probs, *w, *gathered;
    int *ids, *slot, *order, *first, *expert;
    int groups;
} st_route;

static void st_route_at(st_route *rt, const st_block *b, int R, const st_scratch *s) {
    ptrdiff_t n = st_ffn_rows(b, R);
    float *base = s->route + (ptrdiff_t)st_thread() * s->route_floats;
    rt->probs = base;
    rt->w = rt->probs + b->n_experts;
    rt->ids = (int *)(rt->w + n);
    rt->slot = rt->ids + n;
    rt->order = rt->slot + n;
    rt->expert = rt->order + n;
    rt->first = rt->expert + n;  /* n + 1 */
    rt->gathered = (float *)(rt->first + n + 1);
}

/* Row ``logits`` (E) to its k experts ``ids`` (ascending) and weights ``w``; p (E) scratch. */
static void st_route_row(const float *logits, ptrdiff_t E, ptrdiff_t k, int renormalize,
                         float *p, int *ids, float *w) {
    float top = -INFINITY, sum = 0.0f;
    for (ptrdiff_t e = 0; e < E; e++) top = logits[e] > top ? logits[e] : top;
    for (ptrdiff_t e = 0; e < E; e++) sum += p[e] = expf(logits[e] - top);
    for (ptrdiff_t e = 0; e < E; e++) p[e] /= sum;
    float chosen = 0.0f;
    for (ptrdiff_t j = 0; j < k; j++) {
        ptrdiff_t best = -1;
        for (ptrdiff_t e = 0; e < E; e++)
            if (p[e] >= 0.0f && (best < 0 || p[e] > p[best])) best = e;
        if (best < 0) best = j;  /* every probability NaN: any expert, the row is NaN */
        ids[j] = (int)best;
        chosen += w[j] = p[best];
        p[best] = -1.0f;  /* taken */
    }
    for (ptrdiff_t j = 0; j < k && renormalize; j++) w[j] /= chosen;
    for (ptrdiff_t j = 1; j < k; j++)  /* ascending experts, the order of the sum */
        for (ptrdiff_t i = j; i > 0 && ids[i - 1] > ids[i]; i--) {
            int id = ids[i];
            float wi = w[i];
            ids[i] = ids[i - 1], w[i] = w[i - 1];
            ids[i - 1] = id, w[i - 1] = wi;
        }
}

/* This thread's routing of R rows (``logits`` R by E) into rt, the rows of h gathered. */
static void st_route_rows(const st_block *b, const float *logits, const float *h, int R,
                          st_route *rt) {
    ptrdiff_t E = b->n_experts, k = b->top_k, n = R * k, dim = b->dim;
    for (int r = 0; r < R; r++)
        st_route_row(logits + r * E, E, k, b->renormalize, rt->probs, rt->ids + r * k,
                     rt->w + r * k);
    for (ptrdiff_t a = 0; a < n; a++) {  /* a stable insertion sort by expert */
        ptrdiff_t i = a;
        for (; i > 0 && rt->ids[rt->order[i - 1]] > rt->ids[a]; i--)
            rt->order[i] = rt->order[i - 1];
        rt->order[i] = (int)a;
    }
    rt->groups = 0;
    for (ptrdiff_t i = 0; i < n; i++) {
        int a = rt->order[i];
        rt->slot[a] = (int)i;
        if (i == 0 || rt->ids[a] != rt->ids[rt->order[i - 1]]) {
            rt->expert[rt->groups] = rt->ids[a];
            rt->first[rt->groups++] = (int)i;
        }
        memcpy(rt->gathered + i * dim, h + (a / k) * dim, dim * sizeof(float));
    }
    rt->first[rt->groups] = (int)n;
}

/* Columns [j0, j1) of x (or of o, with a sandwich norm) += the weighted sum of every row's
   experts' down products (ydown, in group order), ascending experts. */
static void st_expert_sum_cols(const st_block *b, const st_route *rt, const float *ydown,
                               float *dest, int add, int R, ptrdiff_t j0, ptrdiff_t j1) {
    ptrdiff_t k = b->top_k, dim = b->dim;
    for (int r = 0; r < R; r++)
        for (ptrdiff_t c = j0; c < j1; c++) {
            float fed = 0.0f;
            for (ptrdiff_t j = 0; j < k; j++) {
                ptrdiff_t a = r * k + j;
                fed += ydown[rt->slot[a] * dim + c] * rt->w[a];
            }
            dest[r * dim + c] = add ? dest[r * dim + c] + fed : fed;
        }
}

/* x += the mixture of experts of h (R rows normed), for the team (see the top). */
static void st_moe_team(const st_block *b, const float *h, float *x, int R,
                        const st_scratch *s) {
    ptrdiff_t E = b->n_experts, dim = b->dim, hidden = b->hidden, n = st_ffn_rows(b, R);
    int team = st_team();
    st_product_team(&b->router, h, s->logits, NULL, E, dim, R, s);
    st_route rt;
    st_route_at(&rt, b, R, s);
    st_route_rows(b, s->logits, h, R, &rt);
    if (b->expert_counts && st_thread() == 0)
        for (ptrdiff_t a = 0; a < n; a++) b->expert_counts[rt.ids[a]]++;
    qm_input in;
    st_input(b->expert_gate_up, E, rt.gathered, dim, (int)n, s, &in);
    #pragma omp for schedule(static)  /* a stretch of one expert's columns per task */
    for (int t = 0; t < rt.groups * team; t++) {
        int g = t / team, part = t % team, at = rt.first[g], rows = rt.first[g + 1] - at;
        qm_input at_rows = qm_input_from(&in, dim, at);
        st_gated_cols(&b->expert_gate_up[rt.expert[g]], ST_SILU, rt.gathered + at * dim,
                      &at_rows, s->gu + at * 2 * hidden,
                      s->act + at * hidden, hidden, dim, rows, st_split(hidden, team, part),
                      st_split(hidden, team, part + 1));
    }
    st_input(b->expert_down, E, s->act, hidden, (int)n, s, &in);
    float *dest = b->post_mlp_norm ? s->o : x;
    #pragma omp for schedule(static)  /* one stretch of x's columns per thread */
    for (int t = 0; t < team; t++) {
        ptrdiff_t j0 = st_split(dim, team, t), j1 = st_split(dim, team, t + 1);
        for (int g = 0; g < rt.groups; g++) {
            int at = rt.first[g], rows = rt.first[g + 1] - at;
            qm_input at_rows = qm_input_from(&in, hidden, at);
            st_product_cols(&b->expert_down[rt.expert[g]], s->act + at * hidden,
                            &at_rows, s->ydown + at * dim, NULL,
                            dim, hidden, rows, j0, j1);
        }
        st_expert_sum_cols(b, &rt, s->ydown, dest, b->post_mlp_norm == NULL, R, j0, j1);
    }
    if (b->post_mlp_norm) st_add_normed_team(b->post_mlp_norm, s->o, x, R, dim, b->eps);
}
