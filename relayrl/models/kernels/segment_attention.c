/* Training attention over shared-prompt rows (relayrl/models/segments.py), forward and backward, for CPUs.
 *
 * A row is [prompt, response 1, ..., response G] (relayrl/trainer/packer.py): a prompt query at position i sees
 * keys 0..i; a query at position i of a response starting at `start` sees the row's prompt keys 0..P-1 and its
 * own keys start..i; positions in no segment (padding) produce zeros. The same computation with PyTorch ops
 * gathers every response's keys into padded buckets and runs ~20 small ops per bucket and layer, which made
 * attention a third of a training step at the README job's shapes although its arithmetic is a few percent
 * (docs/benchmarks.md). Here tasks read the row's keys and values in place, work in fp32 and write only their own
 * outputs and gradients, so they never race: forward, one task per (row, query head); backward, two per (row, KV
 * head), each with half of the row's responses (the second adds its share of the prompt keys' gradients into its
 * own buffer, summed at the end), so that a one-row micro-batch keeps two threads busy.
 *
 * Forward keeps one logsumexp per (query head, position); backward recomputes the probabilities from it (as
 * flash attention does), so nothing of size [queries x keys] outlives a query block. Backward takes blocks of 8
 * positions of one segment (x G query heads) at a time and walks their keys in blocks of 16, so keys, values and
 * their gradients come from L2 once per block instead of once per query (backward 2.4-2.9x the first version's speed
 * at the GRPO bench's shapes as AVX2, forward 1.5-1.7x: bench/kernels.py segment_attention, docs/benchmarks.md, "The
 * shared-prompt attention's backward in blocks").
 *
 * Layouts (fp32, contiguous): q, dq [R, KVH * G, L, D]; k, v, dk, dv [R, KVH, L, D]; out, dout [R, L, KVH * G, D]
 * (transformers' layout after attention); lse [R, KVH * G, L]. prompt_len [R]; span [S, 3] = (row, start, len).
 * Query head hq reads KV head hq / G, as transformers' repeat_kv.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
/* glibc's libmvec has vector expf (1 ulp from the true value in each ISA's variant); declared `simd` so the loops
 * calling it vectorise without -ffast-math (relayrl/common/cbuild.py says why that flag is gone). */
#if defined(__x86_64__) && defined(__GLIBC__)
float expf(float) __attribute__((simd("notinbranch")));
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define MAX_G 64  /* query heads per KV head (stack arrays in backward) */
#define MAX_D 1024 /* largest head size taken (relayrl/models/segments.py's _MAX_D checks the same) */
#define QB 8       /* query positions per backward block */
#define KB 16      /* keys per block of the backward's passes: 8 KB of k and v at D = 64, in L1 with the block's queries */

#define INLINE static inline __attribute__((always_inline))

/* The helpers below take the head size D as an argument and are always inlined into a task body that is instantiated
 * for D = 64 and D = 128 (and once for any D): with D a constant the compiler unrolls their loops, keeps a head's
 * accumulators in vector registers and splits dot products into independent chains. The first version, one generic
 * loop per dot product and per key, ran the GRPO bench's backward at about a seventh of the machine's FMA rate. */

INLINE float dot(const float *a, const float *b, int64_t D) {
    float acc = 0.f;
    for (int64_t d = 0; d < D; ++d) acc += a[d] * b[d];
    return acc;
}

/* s[0..3] = a . b_j for the 4 key rows starting at b (row stride D): 4 independent sums, one load of a for 4 FMAs */
INLINE void dot4(const float *a, const float *b, int64_t D, float *s) {
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
    for (int64_t d = 0; d < D; ++d) {
        const float x = a[d];
        s0 += x * b[d];
        s1 += x * b[D + d];
        s2 += x * b[2 * D + d];
        s3 += x * b[3 * D + d];
    }
    s[0] = s0, s[1] = s1, s[2] = s2, s[3] = s3;
}

/* s[c..] = a . b_j for key rows j in [from, to) (row stride D); returns c + to - from */
INLINE int64_t dots(const float *a, const float *b, int64_t from, int64_t to, int64_t D, float *s, int64_t c) {
    int64_t j = from;
    for (; j + 4 <= to; j += 4, c += 4) dot4(a, b + j * D, D, s + c);
    for (; j < to; ++j, ++c) s[c] = dot(a, b + j * D, D);
    return c;
}

/* dst += sum over the n rows b_j of b (row stride D) of w[j] * b_j: dst's D values stay in registers over the rows
 * (explicitly at D = 64 with AVX2; a compiler keeps a local array in memory, one store per row and value). */
INLINE void acc_rows(float *dst, const float *w, const float *b, int64_t n, int64_t D) {
#if defined(__AVX2__) && defined(__FMA__)
    if (D == 64) {
        __m256 a[8];
        for (int i = 0; i < 8; ++i) a[i] = _mm256_loadu_ps(dst + 8 * i);
        for (int64_t j = 0; j < n; ++j) {
            const __m256 c = _mm256_set1_ps(w[j]);
            for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(c, _mm256_loadu_ps(b + j * 64 + 8 * i), a[i]);
        }
        for (int i = 0; i < 8; ++i) _mm256_storeu_ps(dst + 8 * i, a[i]);
        return;
    }
#endif
    for (int64_t j = 0; j < n; ++j)
        for (int64_t d = 0; d < D; ++d) dst[d] += w[j] * b[j * D + d];
}

/* dst += sum over u < V of c[u * cs] * x[u]: one key's dk or dv from every query vector of a block */
INLINE void acc_vectors(float *dst, const float *c, int64_t cs, const float *const *x, int64_t V, int64_t D) {
#if defined(__AVX2__) && defined(__FMA__)
    if (D == 64) {
        __m256 a[8];
        for (int i = 0; i < 8; ++i) a[i] = _mm256_loadu_ps(dst + 8 * i);
        for (int64_t u = 0; u < V; ++u) {
            const __m256 cu = _mm256_set1_ps(c[u * cs]);
            for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(cu, _mm256_loadu_ps(x[u] + 8 * i), a[i]);
        }
        for (int i = 0; i < 8; ++i) _mm256_storeu_ps(dst + 8 * i, a[i]);
        return;
    }
#endif
    for (int64_t u = 0; u < V; ++u)
        for (int64_t d = 0; d < D; ++d) dst[d] += c[u * cs] * x[u][d];
}

/* The keys query i sees: [0, n0) then [b0, b1) (b1 = b0 for a prompt query). */
typedef struct {
    int64_t n0, b0, b1;
} Keys;

/* One query vector: out_i = softmax(q k^T * scale) v over its keys; returns the logsumexp. s: scratch [L]. */
INLINE float attend_one(const float *qi, const float *k, const float *v, Keys ks, int64_t D, float scale, float *s,
                        float *oi) {
    const int64_t c = dots(qi, k, ks.b0, ks.b1, D, s, dots(qi, k, 0, ks.n0, D, s, 0));
    float m = -INFINITY, sum = 0.f;
    for (int64_t j = 0; j < c; ++j) { s[j] *= scale; m = s[j] > m ? s[j] : m; }
    for (int64_t j = 0; j < c; ++j) { s[j] = expf(s[j] - m); sum += s[j]; }
    const float inv = 1.f / sum;
    for (int64_t j = 0; j < c; ++j) s[j] *= inv;
    for (int64_t d = 0; d < D; ++d) oi[d] = 0.f;
    acc_rows(oi, s, v, ks.n0, D);
    acc_rows(oi, s + ks.n0, v + ks.b0 * D, ks.b1 - ks.b0, D);
    return m + logf(sum);
}

/* A query vector of a backward block: one query head at one position, with the keys it sees among the block's
 * (the union [0, n0max) then [b0, b1max)): [0, n0) and [b0, b1). */
typedef struct {
    const float *q, *dout;
    float *dq;
    float lse, delta;
    int64_t n0, b1;
} Vec;

/* s[j] = a . (key of union position j) for j in [j0, j1): union positions below n0max are keys 0.., the rest b0.. */
INLINE void union_dots(const float *a, const float *k, int64_t j0, int64_t j1, int64_t n0max, int64_t b0, int64_t D,
                       float *s) {
    const int64_t m = j1 < n0max ? j1 : n0max, f = j0 > n0max ? j0 : n0max;
    if (j0 < m) dots(a, k, j0, m, D, s, j0);
    if (f < j1) dots(a, k, b0 + f - n0max, b0 + j1 - n0max, D, s, f);
}

/* acc += sum over union positions j in [j0, j1) of w[j] * (key row of j) */
INLINE void union_gather(const float *w, const float *k, int64_t j0, int64_t j1, int64_t n0max, int64_t b0, int64_t D,
                         float *acc) {
    const int64_t m = j1 < n0max ? j1 : n0max, f = j0 > n0max ? j0 : n0max;
    if (j0 < m) acc_rows(acc, w + j0, k + j0 * D, m - j0, D);
    if (f < j1) acc_rows(acc, w + f, k + (b0 + f - n0max) * D, j1 - f, D);
}

/* Gradients of V query vectors (QB positions x G heads) that share most of their keys: dq of each, and their summed
 * share of dk and dv. Keys go in blocks of KB through every vector (a block of k and v stays in L1 while all V pass),
 * and each key's dk and dv rows are read and written once per block of vectors. Position by position (the first
 * version) every query swept all its keys' k, v, dk and dv from L2 about ten times: that bound the backward.
 * p, ds: scratch [V, stride], stride >= the union's size. Positions a vector does not see get p = ds = 0.
 * dk_low, dv_low: where the gradients of keys [0, n0max) go (the prompt's keys: dk, dv or a task's own copy). */
INLINE void grad_block(int64_t V, const Vec *vec, int64_t n0max, int64_t b0, int64_t b1max, const float *k,
                       const float *v, int64_t D, float scale, float *dk_low, float *dv_low, float *dk, float *dv,
                       float *p, float *ds, int64_t stride) {
    const int64_t c = n0max + b1max - b0;
    for (int64_t j0 = 0; j0 < c; j0 += KB) {
        const int64_t j1 = j0 + KB < c ? j0 + KB : c;
        for (int64_t u = 0; u < V; ++u) {
            union_dots(vec[u].q, k, j0, j1, n0max, b0, D, p + u * stride);
            union_dots(vec[u].dout, v, j0, j1, n0max, b0, D, ds + u * stride);
        }
    }
    for (int64_t u = 0; u < V; ++u) {
        float *pu = p + u * stride, *du = ds + u * stride;
        const float lu = vec[u].lse, dl = vec[u].delta;
        const int64_t own = n0max + vec[u].b1 - b0; /* visible: [0, n0) and [n0max, own) */
        for (int64_t j = 0; j < c; ++j) pu[j] = expf(pu[j] * scale - lu); /* one vectorised pass, then the mask */
        for (int64_t j = vec[u].n0; j < n0max; ++j) pu[j] = 0.f;
        for (int64_t j = own; j < c; ++j) pu[j] = 0.f;
        for (int64_t j = 0; j < c; ++j) du[j] = pu[j] * (du[j] - dl) * scale;
    }
    for (int64_t j0 = 0; j0 < c; j0 += KB) {
        const int64_t j1 = j0 + KB < c ? j0 + KB : c;
        for (int64_t u = 0; u < V; ++u) union_gather(ds + u * stride, k, j0, j1, n0max, b0, D, vec[u].dq);
    }
    const float *qs[QB * MAX_G], *douts[QB * MAX_G];
    for (int64_t u = 0; u < V; ++u) qs[u] = vec[u].q, douts[u] = vec[u].dout;
    for (int64_t j = 0; j < c; ++j) { /* keys below n0max go to dk_low / dv_low (another task may own dk's) */
        float *dkj = j < n0max ? dk_low + j * D : dk + (b0 + j - n0max) * D;
        float *dvj = j < n0max ? dv_low + j * D : dv + (b0 + j - n0max) * D;
        acc_vectors(dkj, ds + j, stride, qs, V, D);
        acc_vectors(dvj, p + j, stride, douts, V, D);
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

/* One forward task: query head hq = h * G + g of row r, every query position. s: scratch [L]. */
INLINE void fwd_task(int64_t r, int64_t h, int64_t g, int64_t L, int64_t KVH, int64_t G, const int64_t D,
                     const float *q, const float *k, const float *v, const int64_t *prompt_len, int64_t S,
                     const int64_t *span, float scale, float *out, float *lse, float *s) {
    const int64_t H = KVH * G, hq = h * G + g;
    const float *kr = k + (r * KVH + h) * L * D, *vr = v + (r * KVH + h) * L * D;
    const float *qh = q + (r * H + hq) * L * D;
    FOR_EACH_QUERY(r, {
        lse[(r * H + hq) * L + i] = attend_one(qh + i * D, kr, vr, ks, D, scale, s, out + ((r * L + i) * H + hq) * D);
    });
}

int relayrl_segment_attention_fwd(int64_t R, int64_t L, int64_t KVH, int64_t G, int64_t D, const float *q,
                                  const float *k, const float *v, const int64_t *prompt_len, int64_t S,
                                  const int64_t *span, float scale, float *out, float *lse, int threads) {
    int failed = 0;
    if (D > MAX_D) return 2;
    /* one task per (row, query head): 9 tasks for a one-row micro-batch of SmolLM2 where (row, KV head) gave 3 */
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t t = 0; t < R * KVH * G; ++t) {
        const int64_t r = t / (KVH * G), h = t / G % KVH, g = t % G;
        float *s = malloc(L * sizeof(float));
        if (!s) { failed = 1; continue; }
        if (D == 64) fwd_task(r, h, g, L, KVH, G, 64, q, k, v, prompt_len, S, span, scale, out, lse, s);
        else if (D == 128) fwd_task(r, h, g, L, KVH, G, 128, q, k, v, prompt_len, S, span, scale, out, lse, s);
        else fwd_task(r, h, g, L, KVH, G, D, q, k, v, prompt_len, S, span, scale, out, lse, s);
        free(s);
    }
    return failed;
}

/* Which part (0 or 1) of row r a response belongs to: the prompt and the responses whose work midpoint falls in the
 * first half of the row's work go to part 0 (work of a segment: its queries x the keys each sees). */
static int part_of(int64_t r, int64_t seg, int64_t P, int64_t S, const int64_t *span) {
    double total = 0.5 * (double)P * (double)P, before = total, mine = 0.;
    for (int64_t sp = 0; sp < S; ++sp) {
        if (span[3 * sp] != r) continue;
        const double n = (double)span[3 * sp + 2], w = n * ((double)P + 0.5 * n);
        if (sp < seg) before += w;
        if (sp == seg) mine = w;
        total += w;
    }
    return before + 0.5 * mine >= 0.5 * total;
}

/* One backward task: part `part` of row r (relayrl's two per row, so that a one-row micro-batch still keeps two
 * threads busy) for KV head h and its G query heads, QB positions at a time. Part 1 adds the prompt keys' gradients
 * into its own dk_low / dv_low ([P, D] each, zeroed), summed into dk and dv after the parallel loop; every other key
 * belongs to one part. vec: scratch [QB G]; p: scratch [2 QB G L]. */
INLINE void bwd_task(int64_t r, int64_t h, int part, int64_t L, int64_t KVH, int64_t G, const int64_t D,
                     const float *q, const float *k, const float *v, const int64_t *prompt_len, int64_t S,
                     const int64_t *span, float scale, const float *out, const float *lse, const float *dout,
                     float *dq, float *dk, float *dv, float *dk_low, float *dv_low, Vec *vec, float *p) {
    const int64_t H = KVH * G, kv = (r * KVH + h) * L * D, P = prompt_len[r], stride = L;
    float *ds = p + QB * G * L;
    if (part == 0) dk_low = dk + kv, dv_low = dv + kv;
    for (int64_t seg = -1; seg < S; ++seg) { /* the prompt (seg = -1), then each response of row r */
        if (seg < 0 ? part != 0 : span[3 * seg] != r || part_of(r, seg, P, S, span) != part) continue;
        const int64_t start = seg < 0 ? 0 : span[3 * seg + 1], end = seg < 0 ? P : start + span[3 * seg + 2];
        for (int64_t i0 = start; i0 < end; i0 += QB) {
            const int64_t i1 = i0 + QB < end ? i0 + QB : end;
            int64_t V = 0;
            for (int64_t i = i0; i < i1; ++i)
                for (int64_t g = 0; g < G; ++g, ++V) {
                    const int64_t hq = h * G + g, o = ((r * L + i) * H + hq) * D, row = (r * H + hq) * L + i;
                    /* a prompt query sees keys [0, i]; a response query the prompt and its own keys up to i */
                    vec[V] = (Vec){q + row * D, dout + o, dq + row * D, lse[row], dot(dout + o, out + o, D),
                                   seg < 0 ? i + 1 : P, seg < 0 ? 0 : i + 1};
                }
            if (seg < 0)
                grad_block(V, vec, i1, 0, 0, k + kv, v + kv, D, scale, dk_low, dv_low, dk + kv, dv + kv, p, ds,
                           stride);
            else
                grad_block(V, vec, P, start, i1, k + kv, v + kv, D, scale, dk_low, dv_low, dk + kv, dv + kv, p, ds,
                           stride);
        }
    }
}

int relayrl_segment_attention_bwd(int64_t R, int64_t L, int64_t KVH, int64_t G, int64_t D, const float *q,
                                  const float *k, const float *v, const int64_t *prompt_len, int64_t S,
                                  const int64_t *span, float scale, const float *out, const float *lse,
                                  const float *dout, float *dq, float *dk, float *dv, int threads) {
    int failed = 0;
    if (G > MAX_G || D > MAX_D) return 2;
    int64_t pmax = 1;
    for (int64_t r = 0; r < R; ++r) pmax = prompt_len[r] > pmax ? prompt_len[r] : pmax;
    float *low = calloc((size_t)(R * KVH * 2 * pmax * D), sizeof(float)); /* part 1's prompt-key dk, dv per task */
    if (!low) return 1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t t = 0; t < R * KVH * 2; ++t) {
        const int64_t r = t / (2 * KVH), h = t / 2 % KVH;
        const int part = (int)(t % 2);
        float *p = malloc(2 * QB * G * L * sizeof(float)), *dkl = low + (r * KVH + h) * 2 * pmax * D;
        float *dvl = dkl + pmax * D;
        Vec *vec = malloc(QB * G * sizeof(Vec));
        if (!p || !vec) { free(p); free(vec); failed = 1; continue; }
#define BWD(DIM) bwd_task(r, h, part, L, KVH, G, DIM, q, k, v, prompt_len, S, span, scale, out, lse, dout, dq, dk, dv, \
                          dkl, dvl, vec, p)
        if (D == 64) BWD(64);
        else if (D == 128) BWD(128);
        else BWD(D);
#undef BWD
        free(p);
        free(vec);
    }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < R * KVH; ++t) { /* part 1's prompt-key gradients into dk and dv */
        const int64_t r = t / KVH, n = prompt_len[r] * D;
        float *dkl = low + t * 2 * pmax * D, *dvl = dkl + pmax * D, *dkt = dk + t * L * D, *dvt = dv + t * L * D;
        for (int64_t x = 0; x < n; ++x) dkt[x] += dkl[x], dvt[x] += dvl[x];
    }
    free(low);
    return failed;
}
