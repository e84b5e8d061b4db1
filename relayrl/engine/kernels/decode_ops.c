/* The small ops of a CPU engine's decode step between its linears, fp32: a residual add with the RMSNorm after it,
 * and the rotary embedding of the step's queries and keys.
 *
 * Why: at a decode step each runs on a few rows ([rows x 576] for SmolLM2-135M), where PyTorch's cost is the op
 * dispatch, not the arithmetic: torch's RMSNorm took ~40 us per call at 16 rows as AVX2 and the rotary embedding
 * about ten ops per layer (slices, muls, cat): with SiLU and the residual adds, ~9 ms of a ~47 ms step at 16 rows
 * (docs/benchmarks.md, "Rollout speed"). Here each is one call, one pass per row.
 *
 *   add_rms_norm:  h += delta (when given); y = w * (h * r), r = 1 / sqrt(mean(h^2) + eps) per row
 *   rope_qk:       per head of q and k, in place, Hugging Face's rotate-half form with c = cos, s = sin per row:
 *                  t[j] = t[j] c[j] - t[j + D/2] s[j],  t[j + D/2] = t[j + D/2] c[j] + t[j] s[j],  j < D/2
 *
 * h, delta and y are [rows x d] contiguous; q is [rows x heads*D] and k [rows x kv_heads*D] with row strides q_s, k_s;
 * cos and sin are [rows x D/2] contiguous.
 */
#include <math.h>
#include <stdint.h>

#define PARALLEL_FROM 65536 /* elements: below this a fork/join costs more than the pass */

void relayrl_add_rms_norm(int64_t rows, int64_t d, float *h, const float *delta, const float *w, float eps, float *y,
                          int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * d >= PARALLEL_FROM)
    for (int64_t i = 0; i < rows; ++i) {
        float *hi = h + i * d, *yi = y + i * d;
        if (delta)
            for (int64_t j = 0; j < d; ++j) hi[j] += delta[i * d + j];
        float s = 0.f;
        for (int64_t j = 0; j < d; ++j) s += hi[j] * hi[j];
        const float r = 1.f / sqrtf(s / (float)d + eps);
        for (int64_t j = 0; j < d; ++j) yi[j] = w[j] * (hi[j] * r);
    }
}

static inline void rotate(float *t, const float *c, const float *s, int64_t half) {
    for (int64_t j = 0; j < half; ++j) {
        const float a = t[j], b = t[j + half];
        t[j] = a * c[j] - b * s[j];
        t[j + half] = b * c[j] + a * s[j];
    }
}

void relayrl_rope_qk(int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim, float *q, int64_t q_s, float *k,
                     int64_t k_s, const float *cos, const float *sin, int threads) {
    const int64_t half = dim / 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * (heads + kv_heads) * dim >= PARALLEL_FROM)
    for (int64_t i = 0; i < rows; ++i) {
        const float *c = cos + i * half, *s = sin + i * half;
        for (int64_t h = 0; h < heads; ++h) rotate(q + i * q_s + h * dim, c, s, half);
        for (int64_t h = 0; h < kv_heads; ++h) rotate(k + i * k_s + h * dim, c, s, half);
    }
}
