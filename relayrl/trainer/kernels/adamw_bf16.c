/* The trainer's bf16 kernels: one AdamW step with bf16 moments, and stochastic rounding of fp32 into bf16.
 *
 * One AdamW step with bf16 moments, fused: each element's weight, gradient and two moments are read once and
 * written once (the PyTorch version makes ~15 passes over fp32 working copies and draws its rounding noise with
 * torch.randint). Math in fp32, as relayrl/trainer/optim.py's Bf16StateAdamW:
 *   m = m + (1 - beta1) (g - m)              stored rounded to nearest even
 *   v = beta2 v + (1 - beta2) g^2            stored rounded stochastically (unbiased: see optim.py)
 *   w = w (1 - lr wd) - step_size m / (sqrt(v) / bc2_sqrt + eps)
 * Weights and gradients are fp32 (relayrl_adamw_bf16) or bf16 (relayrl_adamw_bf16_weights: model.train_dtype
 * bfloat16). A bf16 weight is stored rounded stochastically too: an update at RL learning rates (~lr per step) is
 * far below half a bf16 step of the weight (2^-9 of it), so rounded to nearest almost no weight would move.
 * The rounding noise is a hash of (seed, element index): the same for any thread count, and a resumed run
 * (same seed per step and parameter) rounds as the straight one did. */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* branch-free (a select, not a jump), so that the loop below vectorises on AVX2 as well as on AVX-512 */
static inline uint16_t nan_or(uint32_t u, uint32_t rounded) {
    const int nan = (u & 0x7fffffffu) > 0x7f800000u;
    return (uint16_t)(nan ? ((u >> 16) | 0x40u) : (rounded >> 16));
}

static inline uint16_t to_bf16_nearest(float f) {
    const uint32_t u = f32_bits(f);
    return nan_or(u, u + 0x7fffu + ((u >> 16) & 1u));
}

static inline uint16_t to_bf16_stochastic(float f, uint32_t noise16) {
    const uint32_t u = f32_bits(f);
    return nan_or(u, u + noise16);
}

/* a bijective 32-bit integer hash (lowbias32): distinct indices give distinct, well-mixed values */
static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

#define BLOCK 4096
#define GOLDEN 0x9e3779b9u

/* One element's step in fp32: m and v updated in place, the new weight returned. */
static inline float update(float wi, float gi, float *mi, float *vi, float a1, float beta2, float a2, float decay,
                           float step_size, float bc2_sqrt, float eps) {
    *mi = *mi + a1 * (gi - *mi);
    *vi = *vi * beta2 + a2 * gi * gi;
    return wi * decay - step_size * (*mi / (sqrtf(*vi) / bc2_sqrt + eps));
}

/* elements [start, start + len) with 32-bit arithmetic inside: the index only feeds the noise hash, which
 * wraps past 2^32 elements (repeating noise is harmless) */
static void block(int64_t start, int len, float *restrict w, const float *restrict g, uint16_t *restrict m,
                  uint16_t *restrict v, float a1, float beta2, float a2, float decay, float step_size,
                  float bc2_sqrt, float eps, uint32_t seed) {
    const uint32_t base = (uint32_t)start * GOLDEN + seed;
    for (int j = 0; j < len; j++) {
        const int64_t i = start + j;
        float mi = bf16_to_f32(m[i]), vi = bf16_to_f32(v[i]);
        w[i] = update(w[i], g[i], &mi, &vi, a1, beta2, a2, decay, step_size, bc2_sqrt, eps);
        m[i] = to_bf16_nearest(mi);
        v[i] = to_bf16_stochastic(vi, mix32(base + (uint32_t)j * GOLDEN) >> 16);
    }
}

/* the same with bf16 weights and gradients; the weight's noise is hashed once more from v's, so the two roundings
 * of an element are independent */
static void block_bf16_weights(int64_t start, int len, uint16_t *restrict w, const uint16_t *restrict g,
                               uint16_t *restrict m, uint16_t *restrict v, float a1, float beta2, float a2,
                               float decay, float step_size, float bc2_sqrt, float eps, uint32_t seed) {
    const uint32_t base = (uint32_t)start * GOLDEN + seed;
    for (int j = 0; j < len; j++) {
        const int64_t i = start + j;
        float mi = bf16_to_f32(m[i]), vi = bf16_to_f32(v[i]);
        const float wi = update(bf16_to_f32(w[i]), bf16_to_f32(g[i]), &mi, &vi, a1, beta2, a2, decay, step_size,
                                bc2_sqrt, eps);
        const uint32_t h = mix32(base + (uint32_t)j * GOLDEN);
        m[i] = to_bf16_nearest(mi);
        v[i] = to_bf16_stochastic(vi, h >> 16);
        w[i] = to_bf16_stochastic(wi, mix32(h ^ 0x5bd1e995u) >> 16);
    }
}

/* the step over n elements in blocks, threads splitting the blocks; w and g are bf16 when bf16_weights, else fp32 */
static void adamw(int64_t n, void *w, const void *g, uint16_t *m, uint16_t *v, float lr, float beta1, float beta2,
                  float eps, float wd, float step_size, float bc2_sqrt, uint32_t seed, int threads, int bf16_weights) {
    const float a1 = 1.0f - beta1, a2 = 1.0f - beta2, decay = 1.0f - lr * wd;
    const int64_t blocks = (n + BLOCK - 1) / BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t start = b * BLOCK;
        const int len = (int)(n - start < BLOCK ? n - start : BLOCK);
        if (bf16_weights)
            block_bf16_weights(start, len, w, g, m, v, a1, beta2, a2, decay, step_size, bc2_sqrt, eps, seed);
        else
            block(start, len, w, g, m, v, a1, beta2, a2, decay, step_size, bc2_sqrt, eps, seed);
    }
}

void relayrl_adamw_bf16(int64_t n, float *w, const float *g, uint16_t *m, uint16_t *v, float lr, float beta1,
                        float beta2, float eps, float wd, float step_size, float bc2_sqrt, uint32_t seed,
                        int threads) {
    adamw(n, w, g, m, v, lr, beta1, beta2, eps, wd, step_size, bc2_sqrt, seed, threads, 0);
}

void relayrl_adamw_bf16_weights(int64_t n, uint16_t *w, const uint16_t *g, uint16_t *m, uint16_t *v, float lr,
                                float beta1, float beta2, float eps, float wd, float step_size, float bc2_sqrt,
                                uint32_t seed, int threads) {
    adamw(n, w, g, m, v, lr, beta1, beta2, eps, wd, step_size, bc2_sqrt, seed, threads, 1);
}

/* dst (bf16) <- src (fp32) rounded up or down at random, E[dst] = src: a bf16 copy of fp32 master weights that
 * moves with them even where one update is below half a bf16 step (rounded to nearest it would stay put). The
 * noise is the AdamW kernel's hash of (seed, index): the same for any thread count. */
void relayrl_round_bf16(int64_t n, const float *src, uint16_t *dst, uint32_t seed, int threads) {
    const int64_t blocks = (n + BLOCK - 1) / BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t start = b * BLOCK;
        const int len = (int)(n - start < BLOCK ? n - start : BLOCK);
        const uint32_t base = (uint32_t)start * GOLDEN + seed;
        for (int j = 0; j < len; j++)
            dst[start + j] = to_bf16_stochastic(src[start + j], mix32(base + (uint32_t)j * GOLDEN) >> 16);
    }
}
