/* y = x @ W^T for a few rows of x (a decode step's tail), fp32, on CPUs: W is streamed from memory once.
 *
 * Why: at a decode step with few running sequences the engine's linears are matrix-vector products over weights
 * that do not fit in cache (SmolLM2-135M: 430 MB of fp32 layer weights per step). BLAS libraries tuned for large
 * products ran them at 5-6 GB/s of weight traffic on a 2-core AMD EPYC (Zen 3) that reads 18 GB/s, so a step with
 * 1-16 rows cost about as much as one with 64. Here every weight row is loaded once and multiplied with all
 * rows of x, which sit in L1: the product runs at the speed memory delivers the weights.
 *
 *   x [m, k] (row stride x_s), w [n, k] contiguous, y [m, n] contiguous; m <= 32 (blocks of 8 rows).
 * Output rows are split between threads by weight rows, so no two threads write the same element.
 */
#include <stdint.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define MB 8

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

/* weight rows n0..n1 times m (a constant after inlining) rows of x: one weight load feeds m FMAs */
static inline __attribute__((always_inline)) void rows_block(const int64_t m, int64_t n0, int64_t n1, int64_t k,
                                                             const float *x, int64_t x_s, const float *w, float *y,
                                                             int64_t n) {
    for (int64_t r = n0; r < n1; ++r) {
        const float *wr = w + r * k;
        __m256 acc[MB];
        for (int64_t j = 0; j < m; ++j) acc[j] = _mm256_setzero_ps();
        int64_t c = 0;
        for (; c + 8 <= k; c += 8) {
            const __m256 wv = _mm256_loadu_ps(wr + c);
            for (int64_t j = 0; j < m; ++j) acc[j] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + j * x_s + c), acc[j]);
        }
        for (int64_t j = 0; j < m; ++j) y[j * n + r] = hsum(acc[j]) + dot_tail(wr, x + j * x_s, c, k);
    }
}
#else
static inline __attribute__((always_inline)) void rows_block(const int64_t m, int64_t n0, int64_t n1, int64_t k,
                                                             const float *x, int64_t x_s, const float *w, float *y,
                                                             int64_t n) {
    for (int64_t r = n0; r < n1; ++r)
        for (int64_t j = 0; j < m; ++j) y[j * n + r] = dot_tail(w + r * k, x + j * x_s, 0, k);
}
#endif

int relayrl_skinny_linear_f32(int64_t m, int64_t n, int64_t k, const float *x, int64_t x_s, const float *w,
                              float *y, int threads) {
    if (m > 4 * MB) return 1;
    const int64_t chunk = 16; /* weight rows per task: 37 KB of a 576-wide matrix; the threads share evenly */
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (int64_t n0 = 0; n0 < n; n0 += chunk) {
        const int64_t n1 = n0 + chunk < n ? n0 + chunk : n;
        for (int64_t j0 = 0; j0 < m; j0 += MB) {
            const float *xb = x + j0 * x_s;
            float *yb = y + j0 * n;
            switch (m - j0 < MB ? m - j0 : MB) { /* a constant row count: the accumulators stay in registers */
            case 1: rows_block(1, n0, n1, k, xb, x_s, w, yb, n); break;
            case 2: rows_block(2, n0, n1, k, xb, x_s, w, yb, n); break;
            case 3: rows_block(3, n0, n1, k, xb, x_s, w, yb, n); break;
            case 4: rows_block(4, n0, n1, k, xb, x_s, w, yb, n); break;
            case 5: rows_block(5, n0, n1, k, xb, x_s, w, yb, n); break;
            case 6: rows_block(6, n0, n1, k, xb, x_s, w, yb, n); break;
            case 7: rows_block(7, n0, n1, k, xb, x_s, w, yb, n); break;
            default: rows_block(8, n0, n1, k, xb, x_s, w, yb, n); break;
            }
        }
    }
    return 0;
}
