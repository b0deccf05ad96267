/*
 * The paged attention kernels, each in its own parallel region: decode attention and the
 * RoPE + cache write from attention.h, and prefill attention below.
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "attention.h"

/*
 * Prefill attention for one sequence's chunk of new tokens, over its paged context.
 *
 * Query i of the chunk sits at absolute position start + i and attends keys 0..start + i, so
 * one kernel serves a fresh prompt (start = 0) and a chunk continuing a cached prefix; in a
 * sliding-window layer (window > 0) only its last `window` of them, start + i - window + 1 on.
 * Each row is computed exactly as decode attention computes a decode row at that position
 * (attention.h: the same parts, the same functions, in the same order), so a prompt gives the
 * same K/V and the same next token whether its tail ran as a prefill chunk, as decode rows after
 * a prefix-cache hit, or after a preemption. What differs is the sharing: a task is a tile of up
 * to PREFILL_TILE_ROWS consecutive rows and one kv head, which walks the parts of the context in
 * order, each part's blocks read from memory once for the whole tile (and from L1 by each row),
 * and keeps each row's merged state as it goes. Decode rows, one task per (row, kv head, part),
 * read the context once per row.
 */
#define PREFILL_TILE_ROWS 16

/* Floats of one thread's scratch: a tile's scores, scaled queries, a part's results and the
 * merged states. */
static inline int64_t prefill_attention_scratch(int64_t num_heads, int64_t num_kv_heads) {
    return cache_lines_of_floats(PREFILL_TILE_ROWS * num_heads / num_kv_heads
                                 * (PART_KEYS + HEAD_DIM + 2 * (HEAD_DIM + 2)));
}

#define DEFINE_PREFILL_ATTENTION(SUFFIX, XT, LOAD_X, STORE_X, CS, CT, SCALED)                             \
    int paged_prefill_attention_##SUFFIX(const XT *restrict q, const CT *restrict k_cache,                \
                                         const CT *restrict v_cache, const float *restrict k_scales,      \
                                         const float *restrict v_scales,                                  \
                                         const int64_t *restrict block_table, XT *restrict out,           \
                                         int64_t num_queries, int64_t start, int64_t num_heads,           \
                                         int64_t num_kv_heads, int64_t window, float scale) {             \
        const int64_t group = num_heads / num_kv_heads, slot = HEAD_DIM + 2;                              \
        const int64_t threads = omp_get_max_threads(), stride = prefill_attention_scratch(num_heads, num_kv_heads); \
        /* tiles small enough to give every thread two tasks or more */                                 \
        const int64_t wanted = (2 * threads + num_kv_heads - 1) / num_kv_heads;                           \
        const int64_t even = (num_queries + wanted - 1) / wanted;                                         \
        const int64_t tile_rows = even < PREFILL_TILE_ROWS ? (even > 0 ? even : 1) : PREFILL_TILE_ROWS;   \
        const int64_t tiles = (num_queries + tile_rows - 1) / tile_rows;                                  \
        float *scratch = scratch_floats(threads * stride);                                                \
        if (scratch == NULL) return KERNEL_OUT_OF_MEMORY;                                                 \
        _Pragma("omp parallel for collapse(2) schedule(dynamic)")                                         \
        for (int64_t tile = 0; tile < tiles; tile++) {                                                    \
            for (int64_t h = 0; h < num_kv_heads; h++) {                                                  \
                const int64_t first = tile * tile_rows;                                                   \
                const int64_t rows = num_queries - first < tile_rows ? num_queries - first : tile_rows;   \
                float *scores = scratch + omp_get_thread_num() * stride;                                  \
                float *query = scores + PREFILL_TILE_ROWS * group * PART_KEYS;                            \
                float *results = query + PREFILL_TILE_ROWS * group * HEAD_DIM;                            \
                float *states = results + PREFILL_TILE_ROWS * group * slot;                               \
                int64_t lens[PREFILL_TILE_ROWS], seens[PREFILL_TILE_ROWS];                                \
                for (int64_t r = 0; r < rows; r++) {                                                      \
                    lens[r] = start + first + r + 1;                                                      \
                    seens[r] = window_first_key(window, start + first + r);                               \
                    for (int64_t g = 0; g < group; g++) {                                                 \
                        for (int64_t d = 0; d < HEAD_DIM; d++)                                            \
                            query[(r * group + g) * HEAD_DIM + d] =                                       \
                                LOAD_X(q[((first + r) * num_heads + h * group + g) * HEAD_DIM + d]) * scale; \
                        merge_start(states + (r * group + g) * slot);                                     \
                    }                                                                                     \
                }                                                                                         \
                const int64_t last_part = row_first_part(seens[rows - 1]) + row_parts(lens[rows - 1], seens[rows - 1]); \
                for (int64_t part = row_first_part(seens[0]); part < last_part; part++) {                \
                    attend_part_##CS(query, rows, group, lens, seens, NULL, part, block_table, k_cache,   \
                                     v_cache, k_scales, v_scales, num_kv_heads, h, scores, results);      \
                    for (int64_t r = 0; r < rows; r++) {                                                  \
                        int64_t lo, hi;                                                                   \
                        if (part_blocks(part, lens[r], seens[r], &lo, &hi))                               \
                            for (int64_t g = 0; g < group; g++)                                           \
                                merge_part(states + (r * group + g) * slot, results + (r * group + g) * slot); \
                    }                                                                                     \
                }                                                                                         \
                for (int64_t r = 0; r < rows; r++)                                                        \
                    for (int64_t g = 0; g < group; g++)                                                   \
                        FINISH_ROW(states + (r * group + g) * slot,                                       \
                                   out + ((first + r) * num_heads + h * group + g) * HEAD_DIM, STORE_X);  \
            }                                                                                             \
        }                                                                                                 \
        free(scratch);                                                                                    \
        return KERNEL_OK;                                                                                 \
    }

/* Queries in the model's dtype (XS), the cache in any kind (CS): paged_*_attention_XS_CS. */
#define DEFINE_ATTENTION_KERNELS(XS, XT, LOAD_X, STORE_X, CS, CT, LOAD_C, STORE_HEAD, SCALED)               \
    DEFINE_PREFILL_ATTENTION(XS##_##CS, XT, LOAD_X, STORE_X, CS, CT, SCALED)                          \
    DEFINE_DECODE_ATTENTION(XS##_##CS, XT, LOAD_X, STORE_X, CS, CT, SCALED)                               \
    DEFINE_ROPE_WRITE_KV(XS##_##CS, XT, LOAD_X, STORE_X, XT, LOAD_X, CT, STORE_HEAD, SCALED)               \
    int paged_decode_attention_##XS##_##CS(const XT *q, const CT *k_cache, const CT *v_cache,             \
                                           const float *k_scales, const float *v_scales,                  \
                                           const int64_t *block_tables, const int64_t *context_lens,      \
                                           const int64_t *ancestor_masks, const int64_t *positions,       \
                                           XT *out, int64_t num_seqs, int64_t num_heads,                  \
                                           int64_t num_kv_heads, int64_t max_blocks, int64_t window,      \
                                           float scale) {                                                 \
        const int64_t threads = omp_get_max_threads();                                                    \
        const int64_t parts = decode_attention_parts(max_blocks);        \
        float *scratch = scratch_floats(decode_attention_scratch(num_seqs, num_heads, num_kv_heads, max_blocks, \
                                                                 parts, threads));                        \
        if (scratch == NULL) return KERNEL_OUT_OF_MEMORY;                                                 \
        _Pragma("omp parallel")                                                                           \
        decode_attention_##XS##_##CS(q, k_cache, v_cache, k_scales, v_scales, block_tables, context_lens, \
                                     ancestor_masks, positions, out, num_seqs, num_heads, num_kv_heads,   \
                                     max_blocks, window, scale, parts, scratch);                          \
        free(scratch);                                                                                    \
        return KERNEL_OK;                                                                                 \
    }                                                                                                     \
    void rope_write_kv_##XS##_##CS(const XT *qkv, const int64_t *positions, const float *cos_table,       \
                                   const float *sin_table, XT *q_out, CT *k_cache, CT *v_cache,           \
                                   float *k_scales, float *v_scales, const int64_t *slot_blocks,          \
                                   const int64_t *slot_offsets, const XT *q_norm, const XT *k_norm,       \
                                   float eps, int64_t num_tokens, int64_t num_heads,                      \
                                   int64_t num_kv_heads) {                                                \
        _Pragma("omp parallel if(num_tokens >= 16)")                                                      \
        rope_tokens_##XS##_##CS(qkv, positions, cos_table, sin_table, q_out, k_cache, v_cache, k_scales,  \
                                v_scales, slot_blocks, slot_offsets, q_norm, k_norm, eps, num_tokens,     \
                                num_heads, num_kv_heads);                                                 \
    }

FOR_EACH_KV_KIND(DEFINE_ATTENTION_KERNELS, f32, float, load_f32, store_f32)
FOR_EACH_KV_KIND(DEFINE_ATTENTION_KERNELS, bf16, uint16_t, load_bf16, store_bf16)
