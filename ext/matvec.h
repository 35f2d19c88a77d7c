/* Few-row products y = x W^T for decode: x (rows, k) and W (n, k) row-major float32, y (rows, n).
 *
 * Decode multiplies 1 to 8 activation rows by every weight, so it is bound by reading the
 * weights; CPU BLAS runs such thin products far below that bound. Here each pass reads four
 * weight rows once and multiplies them with up to three activation rows held in vector
 * accumulators, so W is read once per three rows and never leaves cache between them.
 *
 * A pass reads four rows of k floats, a short stretch when k is small, which the hardware
 * prefetcher follows badly; for rows shorter than MV_SHORT_ROW the pass also prefetches the
 * memory MV_AHEAD floats ahead of it, so the matrix streams in order. Longer rows prefetch
 * the next pass's four rows with locality 2 (prefetcht1: for L2, not L1, whose few
 * outstanding misses seem to limit the stream): with only the hardware prefetcher, a
 * three-row pass, slowed by its arithmetic, waited for memory instead of overlapping with it
 * (bin/bench-step measures it).
 *
 * Every output y[r][j] is summed in the same order whatever the number of rows or threads
 * (eight lanes of partial sums over k, then the lanes, then the tail), so a row's result
 * does not depend on the batch it travels in. Threads split the output columns (OpenMP).
 * On x86-64 AVX2+FMA versions are chosen once (mv_init) where the CPU has both.
 */
#include <stddef.h>
#include <string.h>

typedef float mv_v8 __attribute__((vector_size(32)));

#if defined(__x86_64__) && defined(__GNUC__)
#define MV_X86 1
#endif

#define MV_COLS 4      /* weight rows per pass */
#define MV_GROUP 3     /* activation rows per pass */
#define MV_COLS_PER_TASK 64
#define MV_SHORT_ROW 1024 /* rows shorter than this are prefetched by hand */
#define MV_AHEAD 2048     /* floats ahead of the pass that the prefetch reads */

static inline mv_v8 mv_load(const float *p) { mv_v8 v; memcpy(&v, p, sizeof v); return v; }

static inline float mv_lanes(mv_v8 v) {
    float s = 0.0f;
    for (int l = 0; l < 8; l++) s += v[l];
    return s;
}

/* y[r][j] for r < R (R <= MV_GROUP) and j in [j0, j1); inlined with R a constant, so the
   accumulators live in registers. */
static inline __attribute__((always_inline)) void mv_group(
        const float *w, const float *x, float *y, const float *base, ptrdiff_t n, ptrdiff_t k,
        int R, ptrdiff_t j0, ptrdiff_t j1) {
    ptrdiff_t j = j0, kv = k - k % 8;
    int short_rows = k < MV_SHORT_ROW;
    for (; j + MV_COLS <= j1; j += MV_COLS) {
        mv_v8 acc[MV_COLS][MV_GROUP];
        memset(acc, 0, sizeof acc);
        const float *w0 = w + j * k;
        const float *ahead = w0 + (short_rows ? MV_AHEAD : MV_COLS * k);
        for (ptrdiff_t i = 0; i < kv; i += 8) {
            if (short_rows) {
                __builtin_prefetch(ahead + 4 * i);
                __builtin_prefetch(ahead + 4 * i + 16);
            } else {  /* the next pass, into L2 */
                __builtin_prefetch(ahead + 4 * i, 0, 2);
                __builtin_prefetch(ahead + 4 * i + 16, 0, 2);
            }
            mv_v8 xv[MV_GROUP];  /* R activation vectors, then one weight vector at a time:
                                    12 accumulators + 3 + 1 fit 16 vector registers */
            for (int r = 0; r < R; r++) xv[r] = mv_load(x + r * k + i);
            for (int q = 0; q < MV_COLS; q++) {
                mv_v8 wq = mv_load(w0 + q * k + i);
                for (int r = 0; r < R; r++) acc[q][r] += wq * xv[r];
            }
        }
        for (int q = 0; q < MV_COLS; q++)
            for (int r = 0; r < R; r++) {
                float s = mv_lanes(acc[q][r]);
                for (ptrdiff_t i = kv; i < k; i++) s += w0[q * k + i] * x[r * k + i];
                y[r * n + j + q] = base ? base[r * n + j + q] + s : s;
            }
    }
    for (; j < j1; j++)
        for (int r = 0; r < R; r++) {
            mv_v8 acc1 = {0};
            const float *wj = w + j * k;
            for (ptrdiff_t i = 0; i < kv; i += 8) acc1 += mv_load(wj + i) * mv_load(x + r * k + i);
            float s = mv_lanes(acc1);
            for (ptrdiff_t i = kv; i < k; i++) s += wj[i] * x[r * k + i];
            y[r * n + j] = base ? base[r * n + j] + s : s;
        }
}

#define MV_GROUP_FN(name, R, attrs)                                                        \
    attrs static void name(const float *w, const float *x, float *y, const float *base,    \
                           ptrdiff_t n, ptrdiff_t k, ptrdiff_t j0, ptrdiff_t j1) {         \
        mv_group(w, x, y, base, n, k, R, j0, j1);                                          \
    }
MV_GROUP_FN(mv_group1, 1, )
MV_GROUP_FN(mv_group2, 2, )
MV_GROUP_FN(mv_group3, 3, )
#ifdef MV_X86
MV_GROUP_FN(mv_group1_avx2, 1, __attribute__((target("avx2,fma"))))
MV_GROUP_FN(mv_group2_avx2, 2, __attribute__((target("avx2,fma"))))
MV_GROUP_FN(mv_group3_avx2, 3, __attribute__((target("avx2,fma"))))
#endif

typedef void (*mv_group_fn)(const float *, const float *, float *, const float *, ptrdiff_t,
                            ptrdiff_t, ptrdiff_t, ptrdiff_t);

static mv_group_fn fns[4];

/* Choose the kernels for 1, 2 and 3 rows on this CPU, AVX2 with FMA where it has both; once,
   before any product (the module's import). */
static void mv_init(void) {
    fns[1] = mv_group1; fns[2] = mv_group2; fns[3] = mv_group3;
#ifdef MV_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        fns[1] = mv_group1_avx2; fns[2] = mv_group2_avx2; fns[3] = mv_group3_avx2;
    }
#endif
}

/* Columns [j0, j1) of y for every row, each added to base's where base is not NULL (base
   may be y itself). */
static inline void mv_range(const float *w, const float *x, float *y, const float *base,
                            ptrdiff_t n, ptrdiff_t k, int rows, ptrdiff_t j0, ptrdiff_t j1) {
    for (int r = 0; r < rows; r += MV_GROUP) {
        int R = rows - r < MV_GROUP ? rows - r : MV_GROUP;
        fns[R](w, x + r * k, y + r * n, base ? base + r * n : NULL, n, k, j0, j1);
    }
}

/* The t-th task's columns. */
static inline void mv_task(const float *w, const float *x, float *y, const float *base,
                           ptrdiff_t n, ptrdiff_t k, int rows, ptrdiff_t t) {
    ptrdiff_t j0 = t * MV_COLS_PER_TASK;
    ptrdiff_t j1 = j0 + MV_COLS_PER_TASK < n ? j0 + MV_COLS_PER_TASK : n;
    mv_range(w, x, y, base, n, k, rows, j0, j1);
}

static inline void mv_rows(const float *w, const float *x, float *y, ptrdiff_t n, ptrdiff_t k,
                           int rows, int threads) {
    ptrdiff_t tasks = (n + MV_COLS_PER_TASK - 1) / MV_COLS_PER_TASK;
    if (threads > 1) {  /* one thread outside a region: a team of one costs system calls */
        #pragma omp parallel for num_threads(threads) schedule(static)
        for (ptrdiff_t t = 0; t < tasks; t++) mv_task(w, x, y, NULL, n, k, rows, t);
    } else {
        for (ptrdiff_t t = 0; t < tasks; t++) mv_task(w, x, y, NULL, n, k, rows, t);
    }
}

/* y = base + x W^T (base NULL: y = x W^T) for the threads of a parallel region already
   running (every thread calls it; it ends with the team's barrier); outside one, the
   calling thread does all of it. */
static inline void mv_rows_team(const float *w, const float *x, float *y, const float *base,
                                ptrdiff_t n, ptrdiff_t k, int rows) {
    ptrdiff_t tasks = (n + MV_COLS_PER_TASK - 1) / MV_COLS_PER_TASK;
    #pragma omp for schedule(static)
    for (ptrdiff_t t = 0; t < tasks; t++) mv_task(w, x, y, base, n, k, rows, t);
}
