/* y = x @ W^T for the few rows of a decode step (1-64), fp32, on CPUs.
 *
 * Why: at a decode step the engine's linears multiply a handful of rows by weights that do not fit in any cache
 * (SmolLM2-135M: 430 MB of fp32 layer weights per step). BLAS libraries tuned for large products ran them at
 * 5-6 GB/s of weight traffic on a 2-core AMD EPYC (Zen 3) that reads 18 GB/s, and at 8-48 rows they ran at a fifth
 * to a half of their own rate on large products. Two loops here:
 *  - 1-4 rows (memory-bound): each weight row is loaded once, in order (one sequential stream the hardware
 *    prefetcher follows), and multiplied with every row of x, which sits in L1;
 *  - 5-64 rows (compute-bound): register tiles of J x rows by R weight rows (12 accumulators; each loaded vector
 *    feeds 3-4 FMAs), over chunks of 48 weight rows split between threads; each weight tile stays in L1 while every
 *    block of x rows passes, the next tile's weight rows prefetched from memory.
 *
 *   x [m, k] (row stride x_s), w [n, k] contiguous, y [m, n] contiguous; m <= 64.
 * Output columns are split between threads by weight rows, so no two threads write the same element.
 */
#include <stdint.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define MAX_ROWS 64
#define FEW 4      /* rows up to which the streaming loop runs */
#define CHUNK 48   /* weight rows per task of the tiled loop: a multiple of every tile's R (8, 6, 4, 3) */

static inline float dot_tail(const float *a, const float *b, int64_t from, int64_t k) {
    float s = 0.f;
    for (int64_t c = from; c < k; ++c) s += a[c] * b[c];
    return s;
}

#if defined(__AVX2__) && defined(__FMA__)
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* weight rows n0..n1 times M (a constant after inlining) rows of x: one weight load feeds M FMAs */
static inline __attribute__((always_inline)) void stream_rows(const int M, int64_t n0, int64_t n1, int64_t k,
                                                               const float *x, int64_t x_s, const float *w,
                                                               float *y, int64_t n) {
    for (int64_t r = n0; r < n1; ++r) {
        const float *wr = w + r * k;
        __m256 acc[FEW];
        for (int j = 0; j < M; ++j) acc[j] = _mm256_setzero_ps();
        int64_t c = 0;
        for (; c + 8 <= k; c += 8) {
            const __m256 wv = _mm256_loadu_ps(wr + c);
            for (int j = 0; j < M; ++j) acc[j] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + j * x_s + c), acc[j]);
        }
        for (int j = 0; j < M; ++j) y[j * n + r] = hsum(acc[j]) + dot_tail(wr, x + j * x_s, c, k);
    }
}

/* J x rows by R weight rows (constants after inlining), all J*R accumulators in registers: 16 ymm registers hold
 * 12 accumulators plus the vectors being multiplied. J >= 4 keeps R weight vectors and loads x one row at a time;
 * smaller J keeps the J x vectors and loads one weight vector at a time. */
static inline __attribute__((always_inline)) void tile(const int J, const int R, int64_t k, const float *x,
                                                       int64_t x_s, const float *w, float *y, int64_t n) {
    __m256 acc[FEW][8];
    for (int j = 0; j < J; ++j)
        for (int r = 0; r < R; ++r) acc[j][r] = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + 8 <= k; c += 8) {
        if ((c & 15) == 0) /* one cache line of each of the next tile's weight rows (from memory on a first pass) */
            for (int r = 0; r < R; ++r) _mm_prefetch((const char *)(w + (R + r) * k + c), _MM_HINT_T0);
        if (J >= 4) {
            __m256 wv[8];
            for (int r = 0; r < R; ++r) wv[r] = _mm256_loadu_ps(w + r * k + c);
            for (int j = 0; j < J; ++j) {
                const __m256 xv = _mm256_loadu_ps(x + j * x_s + c);
                for (int r = 0; r < R; ++r) acc[j][r] = _mm256_fmadd_ps(xv, wv[r], acc[j][r]);
            }
        } else {
            __m256 xv[FEW];
            for (int j = 0; j < J; ++j) xv[j] = _mm256_loadu_ps(x + j * x_s + c);
            for (int r = 0; r < R; ++r) {
                const __m256 wv = _mm256_loadu_ps(w + r * k + c);
                for (int j = 0; j < J; ++j) acc[j][r] = _mm256_fmadd_ps(xv[j], wv, acc[j][r]);
            }
        }
    }
    for (int j = 0; j < J; ++j)
        for (int r = 0; r < R; ++r) y[j * n + r] = hsum(acc[j][r]) + dot_tail(w + r * k, x + j * x_s, c, k);
}
#else
static inline void stream_rows(const int M, int64_t n0, int64_t n1, int64_t k, const float *x, int64_t x_s,
                               const float *w, float *y, int64_t n) {
    for (int64_t r = n0; r < n1; ++r)
        for (int j = 0; j < M; ++j) y[j * n + r] = dot_tail(w + r * k, x + j * x_s, 0, k);
}

static inline void tile(const int J, const int R, int64_t k, const float *x, int64_t x_s, const float *w, float *y,
                        int64_t n) {
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < J; ++j) y[j * n + r] = dot_tail(w + r * k, x + j * x_s, 0, k);
}
#endif

/* the widest tile at J x rows within 12 accumulators */
#define RMAX(J) ((J) == 1 ? 8 : (J) == 2 ? 6 : (J) == 3 ? 4 : 3)
/* R weight rows at J x rows: a full tile, or an edge of fewer rows one weight row at a time (only at a matrix's
 * end, since CHUNK is a multiple of every RMAX; the sums are the same either way) */
#define TILE(J)                                                                                                   \
    do {                                                                                                          \
        if (R == RMAX(J)) tile(J, RMAX(J), k, xb, x_s, wb, yb, n);                                                \
        else for (int64_t e = 0; e < R; ++e) tile(J, 1, k, xb, x_s, wb + e * k, yb + e, n);                       \
    } while (0)

/* Blocks of 4 x rows run with the weight tiles (3 rows) outer: a tile comes from memory once and stays in L1 while
 * every block passes (1.06-1.13x the blocks-outer order at 8-24 rows, even at 32-48, 0.94x at 64, which the engine's
 * measured row limit rarely reaches). The last 1-3 x rows, if any, run with the widest tile their count allows. */
static void tiled_chunk(int64_t m, int64_t n0, int64_t n1, int64_t k, const float *x, int64_t x_s, const float *w,
                        float *y, int64_t n) {
    const int64_t full = m / FEW * FEW;
    for (int64_t r0 = n0; r0 < n1; r0 += RMAX(FEW)) {
        const int64_t R = n1 - r0 < RMAX(FEW) ? n1 - r0 : RMAX(FEW);
        const float *wb = w + r0 * k;
        for (int64_t j0 = 0; j0 < full; j0 += FEW) {
            const float *xb = x + j0 * x_s;
            float *yb = y + j0 * n + r0;
            TILE(FEW);
        }
    }
    if (full == m) return;
    const int64_t J = m - full, rmax = RMAX(J);
    const float *xb = x + full * x_s;
    for (int64_t r0 = n0; r0 < n1; r0 += rmax) {
        const int64_t R = n1 - r0 < rmax ? n1 - r0 : rmax;
        const float *wb = w + r0 * k;
        float *yb = y + full * n + r0;
        switch (J) {
        case 1: TILE(1); break;
        case 2: TILE(2); break;
        default: TILE(3); break;
        }
    }
}

#define MAX_MATS 4  /* weights per multi call: a layer's q, k and v, or its gate and up */

/* The weight rows [n0, n1) of one matrix, at a row count known as a constant inside each case. */
static void run_chunk(int64_t m, int64_t n0, int64_t n1, int64_t k, const float *x, int64_t x_s, const float *w,
                      float *y, int64_t n) {
    switch (m) { /* a constant row count: the accumulators stay in registers */
    case 1: stream_rows(1, n0, n1, k, x, x_s, w, y, n); break;
    case 2: stream_rows(2, n0, n1, k, x, x_s, w, y, n); break;
    case 3: stream_rows(3, n0, n1, k, x, x_s, w, y, n); break;
    case 4: stream_rows(4, n0, n1, k, x, x_s, w, y, n); break;
    default: tiled_chunk(m, n0, n1, k, x, x_s, w, y, n); break;
    }
}

/* y[i] = x @ w[i]^T for `count` weights that share x (a decode layer's q, k and v projections; its gate and up):
 * one parallel region and one call from Python instead of one per weight, the threads sharing every matrix's chunks.
 * Each matrix is cut at the same boundaries as alone, so each output equals the single call's bit for bit. */
int relayrl_skinny_multi_f32(int64_t m, int64_t k, const float *x, int64_t x_s, int count, const float *const *w,
                             float *const *y, const int64_t *n, int threads) {
    if (m > MAX_ROWS || m < 1 || count < 1 || count > MAX_MATS) return 1;
    /* weight rows per task: at 1-4 rows 16 (37 KB of a 576-wide matrix), else CHUNK (a multiple of every tile) */
    const int64_t chunk = m <= FEW ? 16 : CHUNK;
    int64_t first[MAX_MATS + 1] = {0}; /* first task of each matrix */
    for (int i = 0; i < count; ++i) first[i + 1] = first[i] + (n[i] + chunk - 1) / chunk;
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (int64_t t = 0; t < first[count]; ++t) {
        int i = 0;
        while (t >= first[i + 1]) ++i;
        const int64_t n0 = (t - first[i]) * chunk, n1 = n0 + chunk < n[i] ? n0 + chunk : n[i];
        run_chunk(m, n0, n1, k, x, x_s, w[i], y[i], n[i]);
    }
    return 0;
}

int relayrl_skinny_linear_f32(int64_t m, int64_t n, int64_t k, const float *x, int64_t x_s, const float *w,
                              float *y, int threads) {
    return relayrl_skinny_multi_f32(m, k, x, x_s, 1, &w, &y, &n, threads);
}
