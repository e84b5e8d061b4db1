/* Decode-step attention over relayrl's slot KV cache (relayrl/engine/kv_cache.py), for CPUs.
 *
 * One call handles one layer of one decode step: every running sequence i (slot i) brings one new token.
 * For each (sequence, KV head) the new key/value is written at position pos[i] of the slot, then the G query
 * heads that share the KV head (grouped-query attention) attend over positions 0..pos[i] with an online
 * softmax. Each key and value row is read from memory once and converted to fp32 once for all G queries;
 * PyTorch's SDPA kernel spends most of its time on per-(sequence, head) overhead at this shape (a 3 x 64
 * query block), which is what made attention 61% of a decode step.
 *
 * Layouts (strides in elements, the last dimension contiguous):
 *   q      [n, kvh * G, D]   row stride q_sn, head stride q_sh
 *   k_new  [n, kvh, D]       row stride k_sn, head stride k_sh (v_new: v_sn, v_sh)
 *   cache  [slots, kvh, M, D] slot stride c_ss, head stride c_sh, position stride D (k_cache, v_cache)
 *   out    [n, kvh * G, D]   contiguous
 * q, k_new, v_new and out are in the model's dtype (T); the cache may be narrower (TC: an fp32 model over a bf16
 * cache holds twice the tokens in the same memory and reads half the bytes per step); its rows are widened to fp32
 * once, as they are read.
 * Returns 0, or 1 when G or D exceed the stack buffers (the caller then uses SDPA).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 32
#define MAX_G 16
#define MAX_D 256

static inline float bf16_load(const uint16_t *p) {
    uint32_t u = (uint32_t)(*p) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t bf16_store(float f) { /* round to nearest even, as torch's float -> bfloat16 */
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float f32_load(const float *p) { return *p; }
static inline float f32_store(float f) { return f; }

#define DEFINE_DECODE_ATTENTION(NAME, T, LOAD, STORE, TC, CLOAD, CSTORE)                                     \
    int NAME(int64_t n, int64_t kvh, int64_t G, int64_t D, const T *q, int64_t q_sn, int64_t q_sh,            \
             const T *k_new, int64_t k_sn, int64_t k_sh, const T *v_new, int64_t v_sn, int64_t v_sh,          \
             TC *k_cache, TC *v_cache,                                                                        \
             int64_t c_ss, int64_t c_sh, const int64_t *pos, float scale, T *out, int threads) {              \
        if (G > MAX_G || D > MAX_D) return 1;                                                                 \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(threads)")                                 \
        for (int64_t t = 0; t < n * kvh; ++t) {                                                               \
            const int64_t i = t / kvh, h = t % kvh, p = pos[i];                                               \
            TC *kc = k_cache + i * c_ss + h * c_sh, *vc = v_cache + i * c_ss + h * c_sh;                      \
            const T *kn = k_new + i * k_sn + h * k_sh, *vn = v_new + i * v_sn + h * v_sh;                     \
            for (int64_t d = 0; d < D; ++d) { /* the step's key/value, in the cache's dtype */                \
                kc[p * D + d] = CSTORE(LOAD(kn + d));                                                         \
                vc[p * D + d] = CSTORE(LOAD(vn + d));                                                         \
            }                                                                                                 \
            float qf[MAX_G][MAX_D], acc[MAX_G][MAX_D], s[MAX_G][BLOCK], m[MAX_G], l[MAX_G], row[MAX_D];       \
            for (int64_t g = 0; g < G; ++g) {                                                                 \
                const T *qg = q + i * q_sn + (h * G + g) * q_sh;                                              \
                for (int64_t d = 0; d < D; ++d) {                                                             \
                    qf[g][d] = LOAD(qg + d) * scale;                                                          \
                    acc[g][d] = 0.f;                                                                          \
                }                                                                                             \
                m[g] = -FLT_MAX;                                                                              \
                l[g] = 0.f;                                                                                   \
            }                                                                                                 \
            for (int64_t start = 0; start <= p; start += BLOCK) {                                             \
                const int64_t nb = (p + 1 - start) < BLOCK ? (p + 1 - start) : BLOCK;                         \
                for (int64_t j = 0; j < nb; ++j) { /* scores of the block's keys */                           \
                    const TC *kr = kc + (start + j) * D;                                                      \
                    for (int64_t d = 0; d < D; ++d) row[d] = CLOAD(kr + d);                                   \
                    for (int64_t g = 0; g < G; ++g) {                                                         \
                        float dot = 0.f;                                                                      \
                        for (int64_t d = 0; d < D; ++d) dot += qf[g][d] * row[d];                             \
                        s[g][j] = dot;                                                                        \
                    }                                                                                         \
                }                                                                                             \
                for (int64_t g = 0; g < G; ++g) { /* online softmax: rescale what came before */              \
                    float mx = m[g], sum = 0.f;                                                               \
                    for (int64_t j = 0; j < nb; ++j) mx = s[g][j] > mx ? s[g][j] : mx;                        \
                    const float corr = expf(m[g] - mx);                                                       \
                    for (int64_t j = 0; j < nb; ++j) {                                                        \
                        s[g][j] = expf(s[g][j] - mx);                                                         \
                        sum += s[g][j];                                                                       \
                    }                                                                                         \
                    l[g] = l[g] * corr + sum;                                                                 \
                    m[g] = mx;                                                                                \
                    for (int64_t d = 0; d < D; ++d) acc[g][d] *= corr;                                        \
                }                                                                                             \
                for (int64_t j = 0; j < nb; ++j) { /* weighted values */                                      \
                    const TC *vr = vc + (start + j) * D;                                                      \
                    for (int64_t d = 0; d < D; ++d) row[d] = CLOAD(vr + d);                                   \
                    for (int64_t g = 0; g < G; ++g) {                                                         \
                        const float w = s[g][j];                                                              \
                        for (int64_t d = 0; d < D; ++d) acc[g][d] += w * row[d];                              \
                    }                                                                                         \
                }                                                                                             \
            }                                                                                                 \
            for (int64_t g = 0; g < G; ++g) {                                                                 \
                T *og = out + (i * kvh * G + h * G + g) * D;                                                  \
                const float inv = 1.f / l[g];                                                                 \
                for (int64_t d = 0; d < D; ++d) og[d] = STORE(acc[g][d] * inv);                               \
            }                                                                                                 \
        }                                                                                                     \
        return 0;                                                                                             \
    }

DEFINE_DECODE_ATTENTION(relayrl_decode_attention_bf16, uint16_t, bf16_load, bf16_store, uint16_t, bf16_load, bf16_store)
DEFINE_DECODE_ATTENTION(relayrl_decode_attention_f32, float, f32_load, f32_store, float, f32_load, f32_store)
DEFINE_DECODE_ATTENTION(relayrl_decode_attention_f32_bf16kv, float, f32_load, f32_store, uint16_t, bf16_load, bf16_store)
