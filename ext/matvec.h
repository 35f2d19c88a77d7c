/* Few-row products y = x W^T for decode: x (rows, k) and W (n, k) row-major float32, y (rows, n).
 *
 * Decode multiplies 1 to 8 activation rows by every weight, so it is bound by reading the
 * weights; CPU BLAS runs such thin products far below that bound. Here each pass reads four
 * weight rows once and multiplies them with up to three activation rows held in vector
 * accumulators, so W is read once per three rows and never leaves cache between them.
 *
 * Every output y[r][j] is summed in the same order whatever the number of rows or threads
 * (eight lanes of partial sums over k, then the lanes, then the tail), so a row's result
 * does not depend on the batch it travels in. Threads split the output columns (OpenMP).
 * On x86-64 an AVX2+FMA clone is chosen at load time where the CPU has it.
 */
#include <stddef.h>
#include <string.h>

typedef float mv_v8 __attribute__((vector_size(32)));

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MV_CLONES __attribute__((target_clones("avx2,fma", "default")))
#else
#define MV_CLONES
#endif

#define MV_COLS 4      /* weight rows per pass */
#define MV_GROUP 3     /* activation rows per pass */
#define MV_COLS_PER_TASK 64

static inline mv_v8 mv_load(const float *p) { mv_v8 v; memcpy(&v, p, sizeof v); return v; }

static inline float mv_lanes(mv_v8 v) {
    float s = 0.0f;
    for (int l = 0; l < 8; l++) s += v[l];
    return s;
}

/* y[r][j] for r < R (R <= MV_GROUP) and j in [j0, j1). */
MV_CLONES
static void mv_group(const float *w, const float *x, float *y, ptrdiff_t n, ptrdiff_t k,
                     int R, ptrdiff_t j0, ptrdiff_t j1) {
    ptrdiff_t j = j0, kv = k - k % 8;
    for (; j + MV_COLS <= j1; j += MV_COLS) {
        mv_v8 acc[MV_COLS][MV_GROUP];
        memset(acc, 0, sizeof acc);
        const float *w0 = w + j * k;
        for (ptrdiff_t i = 0; i < kv; i += 8) {
            mv_v8 a = mv_load(w0 + i), b = mv_load(w0 + k + i);
            mv_v8 c = mv_load(w0 + 2 * k + i), d = mv_load(w0 + 3 * k + i);
            for (int r = 0; r < R; r++) {
                mv_v8 xv = mv_load(x + r * k + i);
                acc[0][r] += a * xv; acc[1][r] += b * xv;
                acc[2][r] += c * xv; acc[3][r] += d * xv;
            }
        }
        for (int q = 0; q < MV_COLS; q++)
            for (int r = 0; r < R; r++) {
                float s = mv_lanes(acc[q][r]);
                for (ptrdiff_t i = kv; i < k; i++) s += w0[q * k + i] * x[r * k + i];
                y[r * n + j + q] = s;
            }
    }
    for (; j < j1; j++)
        for (int r = 0; r < R; r++) {
            mv_v8 acc1 = {0};
            const float *wj = w + j * k;
            for (ptrdiff_t i = 0; i < kv; i += 8) acc1 += mv_load(wj + i) * mv_load(x + r * k + i);
            float s = mv_lanes(acc1);
            for (ptrdiff_t i = kv; i < k; i++) s += wj[i] * x[r * k + i];
            y[r * n + j] = s;
        }
}

static void mv_rows(const float *w, const float *x, float *y, ptrdiff_t n, ptrdiff_t k,
                    int rows, int threads) {
    ptrdiff_t tasks = (n + MV_COLS_PER_TASK - 1) / MV_COLS_PER_TASK;
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (ptrdiff_t t = 0; t < tasks; t++) {
        ptrdiff_t j0 = t * MV_COLS_PER_TASK;
        ptrdiff_t j1 = j0 + MV_COLS_PER_TASK < n ? j0 + MV_COLS_PER_TASK : n;
        for (int r = 0; r < rows; r += MV_GROUP) {
            int R = rows - r < MV_GROUP ? rows - r : MV_GROUP;
            mv_group(w, x + r * k, y + r * n, n, k, R, j0, j1);
        }
    }
}
