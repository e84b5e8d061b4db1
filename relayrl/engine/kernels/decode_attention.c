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
 * With AVX2 and D a multiple of 8, a block's scores take 4 keys x up to 3 query heads per pass (12 accumulators in
 * registers, the keys loaded once for all of them) and its weighted values up to 3 heads x 32 dimensions per pass:
 * the scalar loops spent their time on one dependent sum per (key, head) and on the accumulators' round trips
 * through memory, and ran at ~12 GB/s of fp32 rows where the machine reads more.
 * Returns 0, or 1 when G or D exceed the stack buffers (the caller then uses SDPA).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
/* glibc's libmvec has vector expf (1 ulp from the true value in each ISA's variant); declared `simd` so the loops
 * calling it vectorise without -ffast-math (relayrl/common/cbuild.py says why that flag is gone). */
#if defined(__x86_64__) && defined(__GLIBC__)
float expf(float) __attribute__((simd("notinbranch")));
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VEC 1
#else
#define VEC 0
#endif

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

/* ---- one block of nb <= BLOCK keys/values: scalar versions (any D), then AVX2 ones (D % 8 == 0) -------------- */
#define DEFINE_BLOCK_SCALAR(SUF, TC, CLOAD)                                                                    \
    static void scores_scalar_##SUF(int64_t G, int64_t D, float (*qf)[MAX_D], const TC *kb, int64_t j0,       \
                                    int64_t nb, float (*s)[BLOCK]) {                                           \
        float row[MAX_D];                                                                                      \
        for (int64_t j = j0; j < nb; ++j) {                                                                    \
            for (int64_t d = 0; d < D; ++d) row[d] = CLOAD(kb + j * D + d);                                    \
            for (int64_t g = 0; g < G; ++g) {                                                                  \
                float dot = 0.f;                                                                               \
                for (int64_t d = 0; d < D; ++d) dot += qf[g][d] * row[d];                                      \
                s[g][j] = dot;                                                                                 \
            }                                                                                                  \
        }                                                                                                      \
    }                                                                                                          \
    static void values_scalar_##SUF(int64_t G, int64_t D, float (*s)[BLOCK], const TC *vb, int64_t nb,         \
                                    float (*acc)[MAX_D]) {                                                     \
        float row[MAX_D];                                                                                      \
        for (int64_t j = 0; j < nb; ++j) {                                                                     \
            for (int64_t d = 0; d < D; ++d) row[d] = CLOAD(vb + j * D + d);                                    \
            for (int64_t g = 0; g < G; ++g) {                                                                  \
                const float w = s[g][j];                                                                       \
                for (int64_t d = 0; d < D; ++d) acc[g][d] += w * row[d];                                       \
            }                                                                                                  \
        }                                                                                                      \
    }

DEFINE_BLOCK_SCALAR(f32, float, f32_load)
DEFINE_BLOCK_SCALAR(bf16, uint16_t, bf16_load)

#if VEC
static inline __m256 vload_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 vload_bf16(const uint16_t *p) { /* 8 bf16 -> 8 fp32: the bits move up by 16 */
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline __m128 sum4(__m256 a, __m256 b, __m256 c, __m256 d) { /* [sum a, sum b, sum c, sum d] */
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

#define DEFINE_BLOCK_VEC(SUF, TC, VLOAD)                                                                       \
    /* s[g0 + g][j..j+3] for NG (a constant after inlining) heads: each key chunk loaded once for all of them */\
    static inline __attribute__((always_inline)) void scores4_##SUF(const int NG, int64_t g0, int64_t D,       \
                                                                    float (*qf)[MAX_D], const TC *kr,          \
                                                                    float *s0, float *s1, float *s2) {         \
        __m256 a[3][4];                                                                                        \
        for (int g = 0; g < NG; ++g)                                                                           \
            for (int r = 0; r < 4; ++r) a[g][r] = _mm256_setzero_ps();                                         \
        for (int64_t c = 0; c < D; c += 8) {                                                                   \
            const __m256 k0 = VLOAD(kr + c), k1 = VLOAD(kr + D + c), k2 = VLOAD(kr + 2 * D + c),               \
                         k3 = VLOAD(kr + 3 * D + c);                                                           \
            for (int g = 0; g < NG; ++g) {                                                                     \
                const __m256 q = _mm256_loadu_ps(qf[g0 + g] + c);                                              \
                a[g][0] = _mm256_fmadd_ps(q, k0, a[g][0]);                                                     \
                a[g][1] = _mm256_fmadd_ps(q, k1, a[g][1]);                                                     \
                a[g][2] = _mm256_fmadd_ps(q, k2, a[g][2]);                                                     \
                a[g][3] = _mm256_fmadd_ps(q, k3, a[g][3]);                                                     \
            }                                                                                                  \
        }                                                                                                      \
        float *out[3] = {s0, s1, s2};                                                                          \
        for (int g = 0; g < NG; ++g) _mm_storeu_ps(out[g], sum4(a[g][0], a[g][1], a[g][2], a[g][3]));          \
    }                                                                                                          \
    static void scores_##SUF(int64_t G, int64_t D, float (*qf)[MAX_D], const TC *kb, int64_t nb,               \
                             float (*s)[BLOCK]) {                                                              \
        if (D % 8) { scores_scalar_##SUF(G, D, qf, kb, 0, nb, s); return; }                                   \
        int64_t j = 0;                                                                                         \
        for (; j + 4 <= nb; j += 4)                                                                            \
            for (int64_t g0 = 0; g0 < G; g0 += 3) {                                                            \
                const TC *kr = kb + j * D;                                                                     \
                switch (G - g0 < 3 ? G - g0 : 3) {                                                             \
                case 1: scores4_##SUF(1, g0, D, qf, kr, s[g0] + j, 0, 0); break;                               \
                case 2: scores4_##SUF(2, g0, D, qf, kr, s[g0] + j, s[g0 + 1] + j, 0); break;                   \
                default: scores4_##SUF(3, g0, D, qf, kr, s[g0] + j, s[g0 + 1] + j, s[g0 + 2] + j);             \
                }                                                                                              \
            }                                                                                                  \
        scores_scalar_##SUF(G, D, qf, kb, j, nb, s); /* the last nb % 4 keys */                                \
    }                                                                                                          \
    /* acc[g0 + g][d0 .. d0 + 8 ND) += sum_j s[g0 + g][j] v[j][...]: NG x ND accumulators stay in registers */ \
    static inline __attribute__((always_inline)) void values_tile_##SUF(const int NG, const int ND, int64_t g0,\
                                                                        int64_t d0, int64_t D,                 \
                                                                        float (*s)[BLOCK], const TC *vb,       \
                                                                        int64_t nb, float (*acc)[MAX_D]) {     \
        __m256 a[3][4];                                                                                        \
        for (int g = 0; g < NG; ++g)                                                                           \
            for (int x = 0; x < ND; ++x) a[g][x] = _mm256_loadu_ps(acc[g0 + g] + d0 + 8 * x);                  \
        for (int64_t j = 0; j < nb; ++j) {                                                                     \
            __m256 v[4];                                                                                       \
            for (int x = 0; x < ND; ++x) v[x] = VLOAD(vb + j * D + d0 + 8 * x);                                \
            for (int g = 0; g < NG; ++g) {                                                                     \
                const __m256 w = _mm256_set1_ps(s[g0 + g][j]);                                                 \
                for (int x = 0; x < ND; ++x) a[g][x] = _mm256_fmadd_ps(w, v[x], a[g][x]);                      \
            }                                                                                                  \
        }                                                                                                      \
        for (int g = 0; g < NG; ++g)                                                                           \
            for (int x = 0; x < ND; ++x) _mm256_storeu_ps(acc[g0 + g] + d0 + 8 * x, a[g][x]);                  \
    }                                                                                                          \
    static void values_##SUF(int64_t G, int64_t D, float (*s)[BLOCK], const TC *vb, int64_t nb,                \
                             float (*acc)[MAX_D]) {                                                            \
        if (D % 8) { values_scalar_##SUF(G, D, s, vb, nb, acc); return; }                                      \
        for (int64_t g0 = 0; g0 < G; g0 += 3)                                                                  \
            for (int64_t d0 = 0; d0 < D; d0 += 32) {                                                           \
                const int ng = G - g0 < 3 ? G - g0 : 3, nd = (D - d0) / 8 < 4 ? (D - d0) / 8 : 4;              \
                switch (ng * 4 + nd) {                                                                         \
                case 5: values_tile_##SUF(1, 1, g0, d0, D, s, vb, nb, acc); break;                             \
                case 6: values_tile_##SUF(1, 2, g0, d0, D, s, vb, nb, acc); break;                             \
                case 7: values_tile_##SUF(1, 3, g0, d0, D, s, vb, nb, acc); break;                             \
                case 8: values_tile_##SUF(1, 4, g0, d0, D, s, vb, nb, acc); break;                             \
                case 9: values_tile_##SUF(2, 1, g0, d0, D, s, vb, nb, acc); break;                             \
                case 10: values_tile_##SUF(2, 2, g0, d0, D, s, vb, nb, acc); break;                            \
                case 11: values_tile_##SUF(2, 3, g0, d0, D, s, vb, nb, acc); break;                            \
                case 12: values_tile_##SUF(2, 4, g0, d0, D, s, vb, nb, acc); break;                            \
                case 13: values_tile_##SUF(3, 1, g0, d0, D, s, vb, nb, acc); break;                            \
                case 14: values_tile_##SUF(3, 2, g0, d0, D, s, vb, nb, acc); break;                            \
                case 15: values_tile_##SUF(3, 3, g0, d0, D, s, vb, nb, acc); break;                            \
                default: values_tile_##SUF(3, 4, g0, d0, D, s, vb, nb, acc);                                   \
                }                                                                                              \
            }                                                                                                  \
    }

DEFINE_BLOCK_VEC(f32, float, vload_f32)
DEFINE_BLOCK_VEC(bf16, uint16_t, vload_bf16)
#else
#define scores_f32(G, D, qf, kb, nb, s) scores_scalar_f32(G, D, qf, kb, 0, nb, s)
#define scores_bf16(G, D, qf, kb, nb, s) scores_scalar_bf16(G, D, qf, kb, 0, nb, s)
#define values_f32 values_scalar_f32
#define values_bf16 values_scalar_bf16
#endif

/* ---- one layer of one decode step ---------------------------------------------------------------------------- */
#define DEFINE_DECODE_ATTENTION(NAME, T, LOAD, STORE, TC, CSUF, CSTORE)                                       \
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
            float qf[MAX_G][MAX_D], acc[MAX_G][MAX_D], s[MAX_G][BLOCK], m[MAX_G], l[MAX_G];                   \
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
                scores_##CSUF(G, D, qf, kc + start * D, nb, s);                                               \
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
                values_##CSUF(G, D, s, vc + start * D, nb, acc); /* weighted values */                        \
            }                                                                                                 \
            for (int64_t g = 0; g < G; ++g) {                                                                 \
                T *og = out + (i * kvh * G + h * G + g) * D;                                                  \
                const float inv = 1.f / l[g];                                                                 \
                for (int64_t d = 0; d < D; ++d) og[d] = STORE(acc[g][d] * inv);                               \
            }                                                                                                 \
        }                                                                                                     \
        return 0;                                                                                             \
    }

DEFINE_DECODE_ATTENTION(relayrl_decode_attention_bf16, uint16_t, bf16_load, bf16_store, uint16_t, bf16, bf16_store)
DEFINE_DECODE_ATTENTION(relayrl_decode_attention_f32, float, f32_load, f32_store, float, f32, f32_store)
DEFINE_DECODE_ATTENTION(relayrl_decode_attention_f32_bf16kv, float, f32_load, f32_store, uint16_t, bf16, bf16_store)
