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
 * sliding-window layer (window > 0) only its last `window` of them, start + i - window + 1 on. Each task
 * is (query head, tile of QT queries); it walks the key blocks with an online softmax
 * (flash-attention style), so no [queries x keys] matrix or mask is ever built:
 *
 *     S[r][t] = q_r . K_block[:, t]        BLOCK_SIZE key lanes per FMA (keys stored transposed),
 *                                          ROWS query rows share every key load
 *     m, l    = running max and sum per row; O = O * exp(m_old - m_new) + P @ V_block
 *
 * BLOCK_SIZE and HEAD_DIM are compile-time constants (the library is built per model shape),
 * which lets the compiler keep score rows and output rows in vector registers.
 */
#define QT 16
#define ROWS 4

#define DEFINE_PREFILL_ATTENTION(SUFFIX, XT, LOAD_X, STORE_X, CT, LOAD_C, SCALED)                         \
    void paged_prefill_attention_##SUFFIX(const XT *restrict q, const CT *restrict k_cache,               \
                                          const CT *restrict v_cache, const float *restrict k_scales,     \
                                          const float *restrict v_scales,                                 \
                                          const int64_t *restrict block_table, XT *restrict out,          \
                                          int64_t num_queries, int64_t start, int64_t num_heads,          \
                                          int64_t num_kv_heads, int64_t window, float scale) {            \
        const int64_t group = num_heads / num_kv_heads;                                                   \
        const int64_t block_elems = BLOCK_SIZE * HEAD_DIM;                                                \
        const int64_t num_tiles = (num_queries + QT - 1) / QT;                                            \
        _Pragma("omp parallel for collapse(2) schedule(dynamic)")                                         \
        for (int64_t head = 0; head < num_heads; head++) {                                                \
            for (int64_t tile = 0; tile < num_tiles; tile++) {                                            \
                const int64_t kv_head = head / group;                                                     \
                const int64_t first = tile * QT;                                                          \
                const int64_t rows = num_queries - first < QT ? num_queries - first : QT;                 \
                float query[QT][HEAD_DIM] = {{0}}, acc[QT][HEAD_DIM] = {{0}}, s[QT][BLOCK_SIZE];          \
                float m[QT], l[QT];                                                                       \
                for (int64_t r = 0; r < QT; r++) {                                                        \
                    m[r] = -FLT_MAX;                                                                      \
                    l[r] = 0.0f;                                                                          \
                }                                                                                         \
                for (int64_t r = 0; r < rows; r++)                                                        \
                    for (int64_t d = 0; d < HEAD_DIM; d++)                                                \
                        query[r][d] = LOAD_X(q[((first + r) * num_heads + head) * HEAD_DIM + d]) * scale;    \
                const int64_t last_key = start + first + rows - 1; /* the tile's last row sees this far */ \
                /* and its first row back to here (its window's first key, or the context's) */          \
                const int64_t first_key = window_first_key(window, start + first);                      \
                for (int64_t b = first_key / BLOCK_SIZE; b <= last_key / BLOCK_SIZE; b++) {               \
                    const int64_t head_block = block_table[b] * num_kv_heads + kv_head;                   \
                    const CT *keys = k_cache + head_block * block_elems;                                  \
                    const CT *values = v_cache + head_block * block_elems;                                \
                    const float *ks = SCALED ? k_scales + head_block * BLOCK_SIZE : NULL;                 \
                    const float *vs = SCALED ? v_scales + head_block * BLOCK_SIZE : NULL;                 \
                    for (int64_t r0 = 0; r0 < rows; r0 += ROWS) {                                         \
                        float sb[ROWS][BLOCK_SIZE] = {{0}};                                               \
                        for (int64_t d = 0; d < HEAD_DIM; d++) {                                          \
                            const CT *kd = keys + d * BLOCK_SIZE;                                         \
                            for (int64_t rr = 0; rr < ROWS; rr++) {                                       \
                                const float qd = query[r0 + rr][d];                                       \
                                _Pragma("omp simd")                                                       \
                                for (int64_t t = 0; t < BLOCK_SIZE; t++) sb[rr][t] += qd * LOAD_C(kd[t]); \
                            }                                                                             \
                        }                                                                                 \
                        for (int64_t rr = 0; rr < ROWS; rr++)                                             \
                            for (int64_t t = 0; t < BLOCK_SIZE; t++)                                      \
                                s[r0 + rr][t] = SCALED ? sb[rr][t] * ks[t] : sb[rr][t];                   \
                    }                                                                                     \
                    for (int64_t r = 0; r < rows; r++) {                                                  \
                        const int64_t visible = start + first + r - b * BLOCK_SIZE + 1;                   \
                        const int64_t n = visible < BLOCK_SIZE ? visible : BLOCK_SIZE;                    \
                        /* keys [from, n) of the block are the row's: after its window's start */       \
                        const int64_t from = window > 0 && visible > window ? visible - window : 0;       \
                        if (n <= from) continue;                                                          \
                        float top = m[r], sum = 0.0f;                                                     \
                        for (int64_t t = from; t < n; t++) top = s[r][t] > top ? s[r][t] : top;           \
                        const float correction = expf(m[r] - top);                                        \
                        float p[BLOCK_SIZE];                                                              \
                        _Pragma("omp simd reduction(+:sum)")                                              \
                        for (int64_t t = 0; t < BLOCK_SIZE; t++) {                                        \
                            p[t] = t >= from && t < n ? expf(s[r][t] - top) : 0.0f;                       \
                            sum += p[t];                                                                  \
                        }                                                                                 \
                        m[r] = top;                                                                       \
                        l[r] = l[r] * correction + sum;                                                   \
                        float a[HEAD_DIM];                                                                \
                        _Pragma("omp simd")                                                               \
                        for (int64_t d = 0; d < HEAD_DIM; d++) a[d] = acc[r][d] * correction;             \
                        for (int64_t t = from; t < n; t++) {                                              \
                            const CT *vt = values + t * HEAD_DIM;                                         \
                            const float pt = SCALED ? p[t] * vs[t] : p[t];                                \
                            _Pragma("omp simd")                                                           \
                            for (int64_t d = 0; d < HEAD_DIM; d++) a[d] += pt * LOAD_C(vt[d]);            \
                        }                                                                                 \
                        for (int64_t d = 0; d < HEAD_DIM; d++) acc[r][d] = a[d];                          \
                    }                                                                                     \
                }                                                                                         \
                for (int64_t r = 0; r < rows; r++) {                                                      \
                    const float inv = 1.0f / l[r];                                                        \
                    for (int64_t d = 0; d < HEAD_DIM; d++)                                                \
                        out[((first + r) * num_heads + head) * HEAD_DIM + d] = STORE_X(acc[r][d] * inv);  \
                }                                                                                         \
            }                                                                                             \
        }                                                                                                 \
    }

/* Queries in the model's dtype (XS), the cache in any kind (CS): paged_*_attention_XS_CS. */
#define DEFINE_ATTENTION_KERNELS(XS, XT, LOAD_X, STORE_X, CS, CT, LOAD_C, STORE_HEAD, SCALED)               \
    DEFINE_PREFILL_ATTENTION(XS##_##CS, XT, LOAD_X, STORE_X, CT, LOAD_C, SCALED)                          \
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
