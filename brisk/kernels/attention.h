/*
 * Decode attention over paged KV blocks, for CPUs.
 *
 * One query token per sequence. Each (sequence, kv head) pair is one task: its query heads are
 * scored against the keys block by block, straight from the cache (no gathered copy), then the
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
 * always seen). -1 (every bit) is a plain row. Both bodies here are orphaned `omp for` loops (see matvec.h): paged_attention.c wraps
 * each in its own parallel region, decode_layers.c runs them inside the step's one region.
 * BLOCK_SIZE and HEAD_DIM are compile-time constants: the files that include this are built per
 * model shape.
 */
#ifndef BRISK_ATTENTION_H
#define BRISK_ATTENTION_H

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "dtypes.h"

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

#define DEFINE_DECODE_ATTENTION(SUFFIX, XT, LOAD_X, STORE_X, CT, LOAD_C, SCALED)                          \
    static inline void decode_attention_##SUFFIX(const XT *restrict q, const CT *restrict k_cache,        \
                                                 const CT *restrict v_cache,                              \
                                                 const float *restrict k_scales,                          \
                                                 const float *restrict v_scales,                          \
                                                 const int64_t *restrict block_tables,                    \
                                                 const int64_t *restrict context_lens,                    \
                                                 const int64_t *restrict ancestor_masks, XT *restrict out,\
                                                 int64_t num_seqs, int64_t num_heads,                     \
                                                 int64_t num_kv_heads, int64_t max_blocks,                \
                                                 float scale) {                                           \
        const int64_t group = num_heads / num_kv_heads;                                                   \
        const int64_t block_elems = BLOCK_SIZE * HEAD_DIM;                                                \
        _Pragma("omp for collapse(2) schedule(dynamic)")                                                  \
        for (int64_t s = 0; s < num_seqs; s++) {                                                          \
            for (int64_t h = 0; h < num_kv_heads; h++) {                                                  \
                const int64_t len = context_lens[s];                                                      \
                const int64_t num_blocks = (len + BLOCK_SIZE - 1) / BLOCK_SIZE;                           \
                const int64_t padded = num_blocks * BLOCK_SIZE;                                           \
                const int64_t *table = block_tables + s * max_blocks;                                     \
                float *scores = malloc(sizeof(float) * group * (padded + 2 * HEAD_DIM));                  \
                float *restrict query = scores + group * padded, *restrict acc = query + group * HEAD_DIM; \
                float block[BLOCK_SIZE * HEAD_DIM]; /* a K or V block as floats, when CT is not float */  \
                for (int64_t g = 0; g < group; g++)                                                       \
                    for (int64_t d = 0; d < HEAD_DIM; d++) {                                              \
                        query[g * HEAD_DIM + d] = LOAD_X(q[(s * num_heads + h * group + g) * HEAD_DIM + d]) * scale; \
                        acc[g * HEAD_DIM + d] = 0.0f;                                                     \
                    }                                                                                     \
                for (int64_t b = 0; b < num_blocks; b++) {                                                \
                    if (b + 1 < num_blocks)                                                               \
                        prefetch_block(k_cache + (table[b + 1] * num_kv_heads + h) * block_elems, sizeof(CT) * block_elems); \
                    const float *keys = AS_FLOATS(CT, LOAD_C, k_cache + (table[b] * num_kv_heads + h) * block_elems, \
                                                  block);                                                 \
                    const float *ks = SCALED ? k_scales + (table[b] * num_kv_heads + h) * BLOCK_SIZE : NULL; \
                    for (int64_t g = 0; g < group; g++) {                                                 \
                        /* four partial sums over d: enough FMA chains in flight to hide their latency */ \
                        float part[4][BLOCK_SIZE] = {{0}};                                                \
                        const float *qg = query + g * HEAD_DIM;                                           \
                        for (int64_t d = 0; d < HEAD_DIM; d += 4)                                         \
                            for (int u = 0; u < 4; u++) {                                                 \
                                _Pragma("omp simd")                                                       \
                                for (int64_t t = 0; t < BLOCK_SIZE; t++)                                  \
                                    part[u][t] += qg[d + u] * keys[(d + u) * BLOCK_SIZE + t];             \
                            }                                                                             \
                        float *row = scores + g * padded + b * BLOCK_SIZE;                                \
                        for (int64_t t = 0; t < BLOCK_SIZE; t++) {                                        \
                            const float sum = (part[0][t] + part[1][t]) + (part[2][t] + part[3][t]);      \
                            row[t] = SCALED ? sum * ks[t] : sum;                                          \
                        }                                                                                 \
                    }                                                                                     \
                }                                                                                         \
                const uint64_t ancestors = ancestor_masks ? (uint64_t)ancestor_masks[s] : ~(uint64_t)0;  \
                for (int64_t g = 0; g < group; g++) {                                                     \
                    float *p = scores + g * padded, top = -FLT_MAX, sum = 0.0f;                           \
                    if (~ancestors) /* a tree row: hide the keys of other branches */                     \
                        for (int64_t j = 1; j < 64 && j < len; j++)                                       \
                            if (!((ancestors >> j) & 1)) p[len - 1 - j] = -FLT_MAX;                       \
                    for (int64_t t = 0; t < len; t++) top = p[t] > top ? p[t] : top;                      \
                    _Pragma("omp simd reduction(+:sum)")                                                  \
                    for (int64_t t = 0; t < padded; t++) {                                                \
                        p[t] = t < len ? expf(p[t] - top) : 0.0f;                                         \
                        sum += p[t];                                                                      \
                    }                                                                                     \
                    const float inv = 1.0f / sum;                                                         \
                    for (int64_t t = 0; t < padded; t++) p[t] *= inv;                                     \
                }                                                                                         \
                for (int64_t b = 0; b < num_blocks; b++) { /* each value block read once for the group */ \
                    if (b + 1 < num_blocks)                                                               \
                        prefetch_block(v_cache + (table[b + 1] * num_kv_heads + h) * block_elems, sizeof(CT) * block_elems); \
                    const float *values = AS_FLOATS(CT, LOAD_C,                                           \
                                                    v_cache + (table[b] * num_kv_heads + h) * block_elems, block); \
                    const int64_t n = len - b * BLOCK_SIZE < BLOCK_SIZE ? len - b * BLOCK_SIZE : BLOCK_SIZE; \
                    const float *vs = SCALED ? v_scales + (table[b] * num_kv_heads + h) * BLOCK_SIZE : NULL; \
                    for (int64_t g = 0; g < group; g++) {                                                 \
                        const float *p = scores + g * padded + b * BLOCK_SIZE;                            \
                        float a[HEAD_DIM];                                                                \
                        for (int64_t d = 0; d < HEAD_DIM; d++) a[d] = acc[g * HEAD_DIM + d];              \
                        for (int64_t t = 0; t < n; t++) {                                                 \
                            const float pt = SCALED ? p[t] * vs[t] : p[t];                                \
                            _Pragma("omp simd")                                                           \
                            for (int64_t d = 0; d < HEAD_DIM; d++) a[d] += pt * values[t * HEAD_DIM + d]; \
                        }                                                                                 \
                        for (int64_t d = 0; d < HEAD_DIM; d++) acc[g * HEAD_DIM + d] = a[d];              \
                    }                                                                                     \
                }                                                                                         \
                for (int64_t g = 0; g < group; g++)                                                       \
                    for (int64_t d = 0; d < HEAD_DIM; d++)                                                \
                        out[(s * num_heads + h * group + g) * HEAD_DIM + d] = STORE_X(acc[g * HEAD_DIM + d]); \
                free(scores);                                                                             \
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
