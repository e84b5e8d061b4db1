/* Training attention over shared-prompt rows (relayrl/models/segments.py), forward and backward, for CPUs.
 *
 * A row is [prompt, response 1, ..., response G] (relayrl/trainer/packer.py): a prompt query at position i sees
 * keys 0..i; a query at position i of a response starting at `start` sees the row's prompt keys 0..P-1 and its
 * own keys start..i; positions in no segment (padding) produce zeros. The same computation with PyTorch ops
 * gathers every response's keys into padded buckets and runs ~20 small ops per bucket and layer, which made
 * attention a third of a training step at the README job's shapes although its arithmetic is a few percent
 * (docs/benchmarks.md). Here each (row, KV head) is one task: it reads the row's keys and values in place, works
 * in fp32 and writes only its own outputs and gradients, so tasks never race.
 *
 * Forward keeps one logsumexp per (query head, position); backward recomputes the probabilities from it (as
 * flash attention does), so nothing of size [queries x keys] outlives a query.
 *
 * Layouts (fp32, contiguous): q, dq [R, KVH * G, L, D]; k, v, dk, dv [R, KVH, L, D]; out, dout [R, L, KVH * G, D]
 * (transformers' layout after attention); lse [R, KVH * G, L]. prompt_len [R]; span [S, 3] = (row, start, len).
 * Query head hq reads KV head hq / G, as transformers' repeat_kv.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_G 64  /* query heads per KV head (stack arrays in backward) */
#define MAX_D 1024 /* head size (stack arrays in backward) */

static inline float dot(const float *a, const float *b, int64_t D) {
    float acc = 0.f;
    for (int64_t d = 0; d < D; ++d) acc += a[d] * b[d];
    return acc;
}

static inline void axpy(float a, const float *x, float *y, int64_t D) {
    for (int64_t d = 0; d < D; ++d) y[d] += a * x[d];
}

/* The keys query i sees: [0, n0) then [b0, b1) (b1 = b0 for a prompt query). */
typedef struct {
    int64_t n0, b0, b1;
} Keys;

/* One query vector: out_i = softmax(q k^T * scale) v over its keys; returns the logsumexp. s: scratch [L]. */
static float attend_one(const float *qi, const float *k, const float *v, Keys ks, int64_t D, float scale,
                        float *s, float *oi) {
    float m = -INFINITY, sum = 0.f;
    int64_t c = 0;
    for (int64_t j = 0; j < ks.n0; ++j, ++c) { s[c] = dot(qi, k + j * D, D) * scale; m = s[c] > m ? s[c] : m; }
    for (int64_t j = ks.b0; j < ks.b1; ++j, ++c) { s[c] = dot(qi, k + j * D, D) * scale; m = s[c] > m ? s[c] : m; }
    for (int64_t j = 0; j < c; ++j) { s[j] = expf(s[j] - m); sum += s[j]; }
    const float inv = 1.f / sum;
    memset(oi, 0, D * sizeof(float));
    c = 0;
    for (int64_t j = 0; j < ks.n0; ++j, ++c) axpy(s[c] * inv, v + j * D, oi, D);
    for (int64_t j = ks.b0; j < ks.b1; ++j, ++c) axpy(s[c] * inv, v + j * D, oi, D);
    return m + logf(sum);
}

/* Gradients of the G query heads at one position (they share keys and values): dq of each, and their summed
 * share of dk and dv, so each key's gradient rows are read and written once per position, not G times. The
 * probabilities and their gradients are computed for all keys first (p, ds: scratch [G, L]), so that the exps run
 * vectorised rather than one libm call per key. */
static void grad_position(const float *const *qi, const float *k, const float *v, const float *const *doi,
                          const float *delta, const float *lse, Keys ks, int64_t G, int64_t L, int64_t D,
                          float scale, float *const *dqi, float *dk, float *dv, float *p, float *ds) {
    const int64_t c = ks.n0 + ks.b1 - ks.b0;
    for (int64_t g = 0; g < G; ++g) {
        float *pg = p + g * L, *dsg = ds + g * L;
        for (int64_t j = 0; j < c; ++j) {
            const int64_t key = j < ks.n0 ? j : ks.b0 + j - ks.n0;
            pg[j] = dot(qi[g], k + key * D, D);
            dsg[j] = dot(doi[g], v + key * D, D);
        }
        const float lg = lse[g], dg = delta[g];
        for (int64_t j = 0; j < c; ++j) {
            pg[j] = expf(pg[j] * scale - lg);
            dsg[j] = pg[j] * (dsg[j] - dg) * scale;
        }
    }
    float dk_acc[MAX_D], dv_acc[MAX_D];
    for (int64_t j = 0; j < c; ++j) {
        const int64_t key = j < ks.n0 ? j : ks.b0 + j - ks.n0;
        const float *kj = k + key * D;
        memset(dk_acc, 0, D * sizeof(float));
        memset(dv_acc, 0, D * sizeof(float));
        for (int64_t g = 0; g < G; ++g) {
            axpy(ds[g * L + j], kj, dqi[g], D);
            axpy(ds[g * L + j], qi[g], dk_acc, D);
            axpy(p[g * L + j], doi[g], dv_acc, D);
        }
        axpy(1.f, dk_acc, dk + key * D, D);
        axpy(1.f, dv_acc, dv + key * D, D);
    }
}

/* Runs the body with i and ks (its keys) for every query position of row r that belongs to a segment. */
#define FOR_EACH_QUERY(r, ...)                                                                                \
    do {                                                                                                      \
        const int64_t P = prompt_len[r];                                                                      \
        for (int64_t i = 0; i < P; ++i) { Keys ks = {i + 1, 0, 0}; __VA_ARGS__ }                                 \
        for (int64_t sp = 0; sp < S; ++sp) {                                                                  \
            if (span[3 * sp] != r) continue;                                                                  \
            const int64_t start = span[3 * sp + 1], n = span[3 * sp + 2];                                     \
            for (int64_t i = start; i < start + n; ++i) { Keys ks = {P, start, i + 1}; __VA_ARGS__ }                 \
        }                                                                                                     \
    } while (0)

int relayrl_segment_attention_fwd(int64_t R, int64_t L, int64_t KVH, int64_t G, int64_t D, const float *q,
                                  const float *k, const float *v, const int64_t *prompt_len, int64_t S,
                                  const int64_t *span, float scale, float *out, float *lse, int threads) {
    const int64_t H = KVH * G;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t t = 0; t < R * KVH; ++t) {
        const int64_t r = t / KVH, h = t % KVH;
        const float *kr = k + (r * KVH + h) * L * D, *vr = v + (r * KVH + h) * L * D;
        float *s = malloc(L * sizeof(float));
        if (!s) { failed = 1; continue; }
        for (int64_t g = 0; g < G; ++g) {
            const int64_t hq = h * G + g;
            const float *qh = q + (r * H + hq) * L * D;
            FOR_EACH_QUERY(r, {
                lse[(r * H + hq) * L + i] = attend_one(qh + i * D, kr, vr, ks, D, scale, s,
                                                       out + ((r * L + i) * H + hq) * D);
            });
        }
        free(s);
    }
    return failed;
}

int relayrl_segment_attention_bwd(int64_t R, int64_t L, int64_t KVH, int64_t G, int64_t D, const float *q,
                                  const float *k, const float *v, const int64_t *prompt_len, int64_t S,
                                  const int64_t *span, float scale, const float *out, const float *lse,
                                  const float *dout, float *dq, float *dk, float *dv, int threads) {
    const int64_t H = KVH * G;
    int failed = 0;
    if (G > MAX_G || D > MAX_D) return 2;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t t = 0; t < R * KVH; ++t) {
        const int64_t r = t / KVH, h = t % KVH;
        const int64_t kv = (r * KVH + h) * L * D;
        float *p = malloc(2 * G * L * sizeof(float)), *ds = p ? p + G * L : NULL;
        if (!p) { failed = 1; continue; }
        FOR_EACH_QUERY(r, {
            const float *qi[MAX_G], *doi[MAX_G];
            float *dqi[MAX_G], li[MAX_G], delta[MAX_G];
            for (int64_t g = 0; g < G; ++g) {
                const int64_t hq = h * G + g, o = ((r * L + i) * H + hq) * D;
                qi[g] = q + ((r * H + hq) * L + i) * D;
                dqi[g] = dq + ((r * H + hq) * L + i) * D;
                doi[g] = dout + o;
                delta[g] = dot(dout + o, out + o, D);
                li[g] = lse[(r * H + hq) * L + i];
            }
            grad_position(qi, k + kv, v + kv, doi, delta, li, ks, G, L, D, scale, dqi, dk + kv, dv + kv, p, ds);
        });
        free(p);
    }
    return failed;
}
