/*
 * Decode attention over paged KV blocks, for CPUs.
 *
 * One query token per sequence. Each (sequence, kv head) pair is one task, or a few when there are
 * too few pairs to keep every thread busy (decode_attention_parts): its query heads are scored
 * against the keys block by block, straight from the cache (no gathered copy), then the
 * softmax-weighted values are summed. K and V are read exactly once, which is the floor for
 * decode attention; torch's formulation gathered them into a copy and ran thousands of tiny
 * matmuls, and was ~5x slower at batch 64.
 *
 * Layouts (row-major):  q, out [seqs, heads, dim]
 *                       k_cache [blocks, kv_heads, dim, block_size]   (keys transposed per block)
 *                       v_cache [blocks, kv_heads, block_size, dim]
 * With keys transposed, a query is scored against a whole block as 16 lanes of FMAs per
 * dimension, with no horizontal sums; values are accumulated along dim. Both vectorize.
 *                       block_tables [seqs, max_blocks], context_lens [seqs]
 *                       ancestor_masks [seqs] or NULL (a speculative tree's rows, see below)
 * Queries and outputs are XT, the cache one of dtypes.h's kinds, CT (computed in float32). A
 * scaled kind (SCALED = 1: int8) has k_scales and v_scales [blocks, kv_heads, block_size], one per
 * token and head: a key's scale multiplies its score, a value's its softmax weight.
 * A row of a speculative candidate tree sees its context and its ancestors, not its siblings'
 * branches, which sit in the slots between: bit j of ancestor_masks[s] says whether row s sees
 * the key j positions before its own (bit 0, itself, always set; keys further back than 63 are
 * always seen). -1 (every bit) is a plain row. A sliding-window layer (window > 0) sees only keys
 * at positions[s] - window + 1 and after: the blocks before are not read (a row's position is
 * its slot's, but a tree row's sits below: its ancestors' depth). Both bodies here are orphaned `omp for` loops (see
 * matvec.h): paged_attention.c wraps
 * each in its own parallel region, decode_layers.c runs them inside the step's one region.
 * BLOCK_SIZE and HEAD_DIM are compile-time constants: the files that include this are built per
 * model shape.
 */
#ifndef BRISK_ATTENTION_H
#define BRISK_ATTENTION_H

#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "dtypes.h"
#include "status.h"

/* A K or V block (BLOCK_SIZE * HEAD_DIM values of the cache) as floats: the cache itself when it
 * holds floats, else converted once into `scratch` (L1-sized), so every query head of the group
 * reads floats and no element is converted once per head. */
#define AS_FLOATS(CT, LOAD_C, src, scratch)                                                               \
    (sizeof(CT) == sizeof(float) ? (const float *)(src) : to_floats_##LOAD_C((src), (scratch)))

#define DEFINE_TO_FLOATS(CT, LOAD_C)                                                                      \
    static inline const float *to_floats_##LOAD_C(const CT *restrict src, float *restrict dst) {          \
        _Pragma("omp simd")                                                                               \
        for (int64_t i = 0; i < BLOCK_SIZE * HEAD_DIM; i++) dst[i] = LOAD_C(src[i]);                      \
        return dst;                                                                                       \
    }
DEFINE_TO_FLOATS(float, load_f32)
DEFINE_TO_FLOATS(uint16_t, load_bf16)
DEFINE_TO_FLOATS(uint16_t, load_f16)
DEFINE_TO_FLOATS(int8_t, load_i8)

/* Asks for a block's cache lines ahead of use. Blocks sit anywhere in the cache, and the hardware
 * prefetchers stop at each 4 KiB page, so without this every block starts with a wait on memory:
 * in a decode step the weights have just pushed the cache's K and V out of every level. */
static inline void prefetch_block(const void *p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)p + i);
}

/* A task is one (sequence, kv head) pair's keys, or a part of them: with fewer pairs than a few
 * per thread (one sequence has as many pairs as kv heads: 3 for SmolLM2, on 2 threads), each
 * pair's blocks are split into `parts` and the parts' softmaxes merged after, so every thread has
 * work (flash-decoding's split). A part is at least one block of the longest context. */
static inline int64_t decode_attention_parts(int64_t num_seqs, int64_t num_kv_heads, int64_t max_blocks,
                                             int64_t threads) {
    const int64_t tasks = num_seqs * num_kv_heads, wanted = 4 * threads;
    if (threads == 1 || tasks >= wanted || max_blocks <= 1) return 1;
    int64_t parts = (wanted + tasks - 1) / tasks;
    while ((tasks * parts) % threads) parts++; /* whole rounds of tasks: no thread waits on a last one */
    return parts < max_blocks ? parts : max_blocks;
}

/* The scratch decode attention needs, allocated by its caller before the parallel region:
 *
 *   partials  [seqs, kv_heads, parts, group, HEAD_DIM + 2]   per part and query head: the part's
 *             largest score, its sum of exponentials and its unnormalized output
 *   scores    [threads] rows of decode_attention_scores()    a thread's task at a time: its
 *             group's scaled queries and their scores against the part's keys
 *
 * A part spans at most ceil(max_blocks / parts) blocks (a context never outgrows its table). */
static inline int64_t decode_attention_partials(int64_t num_seqs, int64_t num_heads, int64_t parts) {
    return cache_lines_of_floats(num_seqs * num_heads * parts * (HEAD_DIM + 2));
}

static inline int64_t decode_attention_scores(int64_t num_heads, int64_t num_kv_heads, int64_t max_blocks,
                                              int64_t parts) {
    const int64_t group = num_heads / num_kv_heads, part_blocks = (max_blocks + parts - 1) / parts;
    return cache_lines_of_floats(group * (part_blocks * BLOCK_SIZE + HEAD_DIM));
}

/* Floats of the whole scratch, for `threads` = omp_get_max_threads() (a team's size at most). */
static inline int64_t decode_attention_scratch(int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                               int64_t max_blocks, int64_t parts, int64_t threads) {
    return decode_attention_partials(num_seqs, num_heads, parts)
           + threads * decode_attention_scores(num_heads, num_kv_heads, max_blocks, parts);
}

#define DEFINE_DECODE_ATTENTION(SUFFIX, XT, LOAD_X, STORE_X, CT, LOAD_C, SCALED)                          \
    static inline void decode_attention_##SUFFIX(const XT *restrict q, const CT *restrict k_cache,        \
                                                 const CT *restrict v_cache,                              \
                                                 const float *restrict k_scales,                          \
                                                 const float *restrict v_scales,                          \
                                                 const int64_t *restrict block_tables,                    \
                                                 const int64_t *restrict context_lens,                    \
                                                 const int64_t *restrict ancestor_masks,                  \
                                                 const int64_t *restrict positions, XT *restrict out,     \
                                                 int64_t num_seqs, int64_t num_heads,                     \
                                                 int64_t num_kv_heads, int64_t max_blocks, int64_t window, \
                                                 float scale, int64_t parts, float *restrict scratch) {   \
        const int64_t group = num_heads / num_kv_heads;                                                   \
        const int64_t block_elems = BLOCK_SIZE * HEAD_DIM, slot = HEAD_DIM + 2;                           \
        float *restrict partials = scratch;                                                               \
        float *scores_of_thread = scratch + decode_attention_partials(num_seqs, num_heads, parts);        \
        const int64_t scores_stride = decode_attention_scores(num_heads, num_kv_heads, max_blocks, parts); \
        _Pragma("omp for collapse(3) schedule(dynamic)")                                                  \
        for (int64_t s = 0; s < num_seqs; s++) {                                                          \
            for (int64_t h = 0; h < num_kv_heads; h++) {                                                  \
                for (int64_t part = 0; part < parts; part++) {                                            \
                    const int64_t len = context_lens[s];                                                  \
                    /* the first key the row sees: its window's, or the context's */                      \
                    const int64_t seen = window > 0 && positions[s] >= window ? positions[s] - window + 1 : 0; \
                    const int64_t num_blocks = (len + BLOCK_SIZE - 1) / BLOCK_SIZE - seen / BLOCK_SIZE;   \
                    const int64_t first = seen / BLOCK_SIZE + part * num_blocks / parts;                  \
                    const int64_t last = seen / BLOCK_SIZE + (part + 1) * num_blocks / parts;             \
                    const int64_t start = first * BLOCK_SIZE, end = last * BLOCK_SIZE < len ? last * BLOCK_SIZE : len; \
                    const int64_t padded = (last - first) * BLOCK_SIZE;                                   \
                    const int64_t *table = block_tables + s * max_blocks;                                 \
                    float *results = partials + ((s * num_kv_heads + h) * parts + part) * group * slot;   \
                    float *scores = scores_of_thread + omp_get_thread_num() * scores_stride;              \
                    float *restrict query = scores + group * padded;                                      \
                    float block[BLOCK_SIZE * HEAD_DIM]; /* a K or V block as floats, when CT is not float */ \
                    for (int64_t g = 0; g < group; g++)                                                   \
                        for (int64_t d = 0; d < HEAD_DIM; d++)                                            \
                            query[g * HEAD_DIM + d] = LOAD_X(q[(s * num_heads + h * group + g) * HEAD_DIM + d]) * scale; \
                    for (int64_t b = first; b < last; b++) {                                              \
                        if (b + 1 < last)                                                                 \
                            prefetch_block(k_cache + (table[b + 1] * num_kv_heads + h) * block_elems, sizeof(CT) * block_elems); \
                        const float *keys = AS_FLOATS(CT, LOAD_C, k_cache + (table[b] * num_kv_heads + h) * block_elems, \
                                                      block);                                             \
                        const float *ks = SCALED ? k_scales + (table[b] * num_kv_heads + h) * BLOCK_SIZE : NULL; \
                        for (int64_t g = 0; g < group; g++) {                                             \
                            /* four partial sums over d: enough FMA chains in flight to hide their latency */ \
                            float sums[4][BLOCK_SIZE] = {{0}};                                            \
                            const float *qg = query + g * HEAD_DIM;                                       \
                            for (int64_t d = 0; d < HEAD_DIM; d += 4)                                     \
                                for (int u = 0; u < 4; u++) {                                             \
                                    _Pragma("omp simd")                                                   \
                                    for (int64_t t = 0; t < BLOCK_SIZE; t++)                              \
                                        sums[u][t] += qg[d + u] * keys[(d + u) * BLOCK_SIZE + t];         \
                                }                                                                         \
                            float *row = scores + g * padded + (b - first) * BLOCK_SIZE;                  \
                            for (int64_t t = 0; t < BLOCK_SIZE; t++) {                                    \
                                const float sum = (sums[0][t] + sums[1][t]) + (sums[2][t] + sums[3][t]);  \
                                row[t] = SCALED ? sum * ks[t] : sum;                                      \
                            }                                                                             \
                        }                                                                                 \
                    }                                                                                     \
                    const uint64_t ancestors = ancestor_masks ? (uint64_t)ancestor_masks[s] : ~(uint64_t)0; \
                    for (int64_t g = 0; g < group; g++) {                                                 \
                        float *p = scores + g * padded, top = -FLT_MAX, sum = 0.0f;                       \
                        if (~ancestors) /* a tree row: hide the keys of other branches */                 \
                            for (int64_t j = 1; j < 64 && j < len; j++)                                   \
                                if (!((ancestors >> j) & 1) && len - 1 - j >= start && len - 1 - j < end) \
                                    p[len - 1 - j - start] = -FLT_MAX;                                    \
                        for (int64_t t = start; t < seen && t < end; t++) p[t - start] = -FLT_MAX;       \
                        for (int64_t t = 0; t < end - start; t++) top = p[t] > top ? p[t] : top;          \
                        _Pragma("omp simd reduction(+:sum)")                                              \
                        for (int64_t t = 0; t < padded; t++) {                                            \
                            p[t] = t < end - start ? expf(p[t] - top) : 0.0f;                             \
                            sum += p[t];                                                                  \
                        }                                                                                 \
                        /* top stays -FLT_MAX in an empty part, or one whose every key is hidden: its     \
                         * weight in the merge, exp(-FLT_MAX - the row's top), is 0 */                    \
                        results[g * slot] = top;                                                          \
                        results[g * slot + 1] = sum;                                                      \
                        for (int64_t d = 0; d < HEAD_DIM; d++) results[g * slot + 2 + d] = 0.0f;         \
                    }                                                                                     \
                    for (int64_t b = first; b < last; b++) { /* each value block read once for the group */ \
                        if (b + 1 < last)                                                                 \
                            prefetch_block(v_cache + (table[b + 1] * num_kv_heads + h) * block_elems, sizeof(CT) * block_elems); \
                        const float *values = AS_FLOATS(CT, LOAD_C,                                       \
                                                        v_cache + (table[b] * num_kv_heads + h) * block_elems, block); \
                        const int64_t n = end - b * BLOCK_SIZE < BLOCK_SIZE ? end - b * BLOCK_SIZE : BLOCK_SIZE; \
                        const float *vs = SCALED ? v_scales + (table[b] * num_kv_heads + h) * BLOCK_SIZE : NULL; \
                        for (int64_t g = 0; g < group; g++) {                                             \
                            const float *p = scores + g * padded + (b - first) * BLOCK_SIZE;              \
                            float *acc = results + g * slot + 2, a[HEAD_DIM];                             \
                            for (int64_t d = 0; d < HEAD_DIM; d++) a[d] = acc[d];                         \
                            for (int64_t t = 0; t < n; t++) {                                             \
                                const float pt = SCALED ? p[t] * vs[t] : p[t];                            \
                                _Pragma("omp simd")                                                       \
                                for (int64_t d = 0; d < HEAD_DIM; d++) a[d] += pt * values[t * HEAD_DIM + d]; \
                            }                                                                             \
                            for (int64_t d = 0; d < HEAD_DIM; d++) acc[d] = a[d];                         \
                        }                                                                                 \
                    }                                                                                     \
                }                                                                                         \
            }                                                                                             \
        }                                                                                                 \
        /* merge the parts: each part's sums rescaled to the largest score of all */                      \
        _Pragma("omp for collapse(2) schedule(static)")                                                   \
        for (int64_t s = 0; s < num_seqs; s++) {                                                          \
            for (int64_t head = 0; head < num_heads; head++) {                                            \
                const int64_t h = head / group, g = head % group;                                         \
                const float *first = partials + (s * num_kv_heads + h) * parts * group * slot + g * slot; \
                float top = -FLT_MAX, total = 0.0f, o[HEAD_DIM] = {0};                                    \
                for (int64_t part = 0; part < parts; part++)                                              \
                    top = first[part * group * slot] > top ? first[part * group * slot] : top;            \
                for (int64_t part = 0; part < parts; part++) {                                            \
                    const float *r = first + part * group * slot;                                         \
                    const float w = expf(r[0] - top);                                                     \
                    total += w * r[1];                                                                    \
                    for (int64_t d = 0; d < HEAD_DIM; d++) o[d] += w * r[2 + d];                          \
                }                                                                                         \
                const float inv = 1.0f / total;                                                           \
                for (int64_t d = 0; d < HEAD_DIM; d++) out[(s * num_heads + head) * HEAD_DIM + d] = STORE_X(o[d] * inv); \
            }                                                                                             \
        }                                                                                                 \
    }

/*
 * The step's new tokens into the cache, with their rotary embedding: what runs between the QKV
 * projection and attention, in one pass (it was a dozen torch ops and two scatter writes).
 *
 * qkv [tokens, (num_heads + 2 * num_kv_heads) * HEAD_DIM] holds each token's q, k and v heads.
 * q heads are rotated into q_out [tokens, num_heads, HEAD_DIM]; k heads are rotated into the
 * cache at (slot_blocks[t], slot_offsets[t]) in its transposed layout; v heads are copied there.
 * Rotation is rotate-half ("neox") style with per-position tables cos and signed_sin
 * [max_len, HEAD_DIM] (float32; signed_sin carries rotate_half's sign, see model/llama.py):
 *     out[d] = x[d] * cos[d] + x[(d + HEAD_DIM / 2) % HEAD_DIM] * signed_sin[d]
 * q_norm / k_norm (Qwen3's per-head RMSNorm before the rotation, NT: the model's dtype) are
 * applied when not NULL. Cache entries are written by STORE_HEAD (dtypes.h), with their scales
 * for a scaled kind.
 */
#define DEFINE_ROPE_WRITE_KV(SUFFIX, XT, LOAD_X, STORE_X, NT, LOAD_N, CT, STORE_HEAD, SCALED)             \
    static inline void rope_tokens_##SUFFIX(const XT *restrict qkv, const int64_t *restrict positions,    \
                                            const float *restrict cos_table,                              \
                                            const float *restrict sin_table, XT *restrict q_out,          \
                                            CT *restrict k_cache, CT *restrict v_cache,                   \
                                            float *restrict k_scales, float *restrict v_scales,           \
                                            const int64_t *restrict slot_blocks,                          \
                                            const int64_t *restrict slot_offsets,                         \
                                            const NT *restrict q_norm, const NT *restrict k_norm,         \
                                            float eps, int64_t num_tokens, int64_t num_heads,             \
                                            int64_t num_kv_heads) {                                       \
        const int64_t stride = (num_heads + 2 * num_kv_heads) * HEAD_DIM, half = HEAD_DIM / 2;            \
        _Pragma("omp for")                                                                                \
        for (int64_t t = 0; t < num_tokens; t++) {                                                        \
            const float *c = cos_table + positions[t] * HEAD_DIM, *s = sin_table + positions[t] * HEAD_DIM; \
            const XT *row = qkv + t * stride;                                                             \
            for (int64_t h = 0; h < num_heads + num_kv_heads; h++) {                                      \
                const int is_q = h < num_heads;                                                           \
                const NT *norm = is_q ? q_norm : k_norm;                                                  \
                float x[HEAD_DIM], y[HEAD_DIM];                                                           \
                for (int64_t d = 0; d < HEAD_DIM; d++) x[d] = LOAD_X(row[h * HEAD_DIM + d]);              \
                if (norm) {                                                                               \
                    double squares = 0.0;                                                                 \
                    for (int64_t d = 0; d < HEAD_DIM; d++) squares += (double)x[d] * x[d];                \
                    const float scale = 1.0f / sqrtf((float)(squares / HEAD_DIM) + eps);                  \
                    for (int64_t d = 0; d < HEAD_DIM; d++) x[d] = x[d] * scale * LOAD_N(norm[d]);         \
                }                                                                                         \
                _Pragma("omp simd")                                                                       \
                for (int64_t d = 0; d < HEAD_DIM; d++) y[d] = x[d] * c[d] + x[(d + half) % HEAD_DIM] * s[d]; \
                if (is_q) {                                                                               \
                    for (int64_t d = 0; d < HEAD_DIM; d++) q_out[(t * num_heads + h) * HEAD_DIM + d] = STORE_X(y[d]); \
                } else {                                                                                  \
                    const int64_t head_block = slot_blocks[t] * num_kv_heads + h - num_heads;             \
                    const int64_t offset = slot_offsets[t];                                               \
                    STORE_HEAD(k_cache + head_block * BLOCK_SIZE * HEAD_DIM + offset, BLOCK_SIZE, y, HEAD_DIM, \
                               SCALED ? k_scales + head_block * BLOCK_SIZE + offset : NULL);              \
                }                                                                                         \
            }                                                                                             \
            const XT *v = row + (num_heads + num_kv_heads) * HEAD_DIM;                                    \
            for (int64_t h = 0; h < num_kv_heads; h++) {                                                  \
                const int64_t entry = (slot_blocks[t] * num_kv_heads + h) * BLOCK_SIZE + slot_offsets[t]; \
                float y[HEAD_DIM];                                                                        \
                for (int64_t d = 0; d < HEAD_DIM; d++) y[d] = LOAD_X(v[h * HEAD_DIM + d]);                \
                STORE_HEAD(v_cache + entry * HEAD_DIM, 1, y, HEAD_DIM, SCALED ? v_scales + entry : NULL); \
            }                                                                                             \
        }                                                                                                 \
    }

#endif
