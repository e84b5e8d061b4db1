/* RMSNorm and SwiGLU, forward and backward, for training on CPUs (fp32).
 *
 * Why: PyTorch runs each as a chain of elementwise ops, forward and backward: an RMSNorm's backward is about ten
 * passes over [tokens x hidden] (pow, mean, rsqrt, muls, a column sum for the weight), SwiGLU's silu and its
 * backward each evaluate an exp at accurate-libm cost. At a 700-token micro-batch of SmolLM2-135M a norm's forward
 * and backward took 1.1-2.8 ms and a SwiGLU's 3.3-3.7 ms as AVX2, where one pass over their data is ~0.1-0.3 ms.
 * Here each is one pass per row: rows split between threads, the norm's weight gradient summed per thread and
 * added once.
 *
 *   rms_norm_fwd:  y = w * (x * r),  r = 1 / sqrt(mean(x^2) + eps) per row (r saved for the backward)
 *   rms_norm_bwd:  dx = r * (dy*w - x * r^2 * mean(dy*w*x)),  dw += sum over rows of dy * x * r
 *   swiglu_fwd:    y = silu(g) * u = g * sigmoid(g) * u
 *   swiglu_bwd:    du = dy * g * s,  dg = dy * u * s * (1 + g * (1 - s)),  s = sigmoid(g)
 *
 * All arrays contiguous, rows x d; dw has d entries and is accumulated into (the caller zeroes it).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
/* glibc's libmvec has vector expf (1 ulp from the true value in each ISA's variant); declared `simd` so the loops
 * calling it vectorise without -ffast-math (relayrl/common/cbuild.py says why that flag is gone). */
#if defined(__x86_64__) && defined(__GLIBC__)
float expf(float) __attribute__((simd("notinbranch")));
#endif

void relayrl_rms_norm_fwd(int64_t rows, int64_t d, const float *x, const float *w, float eps, float *y, float *r,
                          int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < rows; ++i) {
        const float *xi = x + i * d;
        float *yi = y + i * d;
        float s = 0.f;
        for (int64_t j = 0; j < d; ++j) s += xi[j] * xi[j];
        const float ri = 1.f / sqrtf(s / (float)d + eps);
        r[i] = ri;
        for (int64_t j = 0; j < d; ++j) yi[j] = w[j] * (xi[j] * ri);
    }
}

/* Returns 1 if the per-thread weight-gradient buffer cannot be allocated (nothing written then). */
int relayrl_rms_norm_bwd(int64_t rows, int64_t d, const float *dy, const float *x, const float *w, const float *r,
                         float *dx, float *dw, int threads) {
    if (threads < 1) threads = 1;
    float *part = calloc((size_t)threads * (size_t)d, sizeof(float));
    if (!part) return 1;
    int used = 1;
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num();
        if (t == 0) used = omp_get_num_threads();
        float *pw = part + (int64_t)t * d;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < rows; ++i) {
            const float *dyi = dy + i * d, *xi = x + i * d;
            float *dxi = dx + i * d;
            const float ri = r[i];
            float dot = 0.f;
            for (int64_t j = 0; j < d; ++j) dot += dyi[j] * w[j] * xi[j];
            const float c = dot * ri * ri / (float)d;
            for (int64_t j = 0; j < d; ++j) {
                dxi[j] = ri * (dyi[j] * w[j] - xi[j] * c);
                pw[j] += dyi[j] * (xi[j] * ri);
            }
        }
    }
    for (int t = 0; t < used; ++t)
        for (int64_t j = 0; j < d; ++j) dw[j] += part[(int64_t)t * d + j];
    free(part);
    return 0;
}

/* sigmoid(g) with exp's argument kept finite: the kernels are built assuming no inf operands (-ffinite-math-only),
 * so 1 / (1 + exp(-g)) must not meet exp's overflow. Below -80 sigmoid is < 2e-35, so the products with it stay ~0
 * as they should; exp(80) is far from fp32's limit (exp(88.7)). The division is a true one: a reciprocal estimate
 * (what -ffast-math allowed) made s = 1 - 6e-8 for large g on AVX-512 and g * (1 - s) 6e-4 off. */
static inline float sigmoid(float g) { return 1.f / (1.f + expf(-fmaxf(g, -80.f))); }

void relayrl_swiglu_fwd(int64_t n, const float *g, const float *u, float *y, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < n; ++i) y[i] = g[i] * sigmoid(g[i]) * u[i];
}

void relayrl_swiglu_bwd(int64_t n, const float *dy, const float *g, const float *u, float *dg, float *du,
                        int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < n; ++i) {
        const float s = sigmoid(g[i]);
        du[i] = dy[i] * (g[i] * s);
        dg[i] = dy[i] * u[i] * s * (1.f + g[i] * (1.f - s));
    }
}
