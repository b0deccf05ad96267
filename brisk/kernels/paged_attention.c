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
 * Built for float32 and bfloat16 (stored as uint16, computed in float32).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "dtypes.h"

#define DEFINE_DECODE_ATTENTION(NAME, T, LOAD, STORE)                                                    \
    void NAME(const T *restrict q, const T *restrict k_cache, const T *restrict v_cache,                  \
              const int64_t *restrict block_tables, const int64_t *restrict context_lens, T *restrict out,  \
              int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t max_blocks, float scale) { \
        const int64_t group = num_heads / num_kv_heads;                                                   \
        const int64_t block_elems = BLOCK_SIZE * HEAD_DIM;                                                \
        _Pragma("omp parallel for collapse(2) schedule(dynamic)")                                          \
        for (int64_t s = 0; s < num_seqs; s++) {                                                          \
            for (int64_t h = 0; h < num_kv_heads; h++) {                                                  \
                const int64_t len = context_lens[s];                                                      \
                const int64_t num_blocks = (len + BLOCK_SIZE - 1) / BLOCK_SIZE;                           \
                const int64_t padded = num_blocks * BLOCK_SIZE;                                           \
                const int64_t *table = block_tables + s * max_blocks;                                     \
                float *scores = malloc(sizeof(float) * group * padded);                                   \
                float *query = malloc(sizeof(float) * group * HEAD_DIM);                                  \
                for (int64_t g = 0; g < group; g++)                                                       \
                    for (int64_t d = 0; d < HEAD_DIM; d++)                                                \
                        query[g * HEAD_DIM + d] = LOAD(q[(s * num_heads + h * group + g) * HEAD_DIM + d]) * scale; \
                for (int64_t b = 0; b < num_blocks; b++) {                                                \
                    const T *keys = k_cache + (table[b] * num_kv_heads + h) * block_elems;                \
                    for (int64_t g = 0; g < group; g++) {                                                 \
                        float row[BLOCK_SIZE] = {0};                                                      \
                        const float *qg = query + g * HEAD_DIM;                                           \
                        for (int64_t d = 0; d < HEAD_DIM; d++) {                                          \
                            _Pragma("omp simd")                                                           \
                            for (int64_t t = 0; t < BLOCK_SIZE; t++) row[t] += qg[d] * LOAD(keys[d * BLOCK_SIZE + t]); \
                        }                                                                                 \
                        for (int64_t t = 0; t < BLOCK_SIZE; t++) scores[g * padded + b * BLOCK_SIZE + t] = row[t]; \
                    }                                                                                     \
                }                                                                                         \
                for (int64_t g = 0; g < group; g++) {                                                     \
                    float *p = scores + g * padded, top = -FLT_MAX, sum = 0.0f;                           \
                    for (int64_t t = 0; t < len; t++) top = p[t] > top ? p[t] : top;                      \
                    _Pragma("omp simd reduction(+:sum)")                                                  \
                    for (int64_t t = 0; t < padded; t++) {                                                \
                        p[t] = t < len ? expf(p[t] - top) : 0.0f;                                         \
                        sum += p[t];                                                                      \
                    }                                                                                     \
                    const float inv = 1.0f / sum;                                                         \
                    for (int64_t t = 0; t < padded; t++) p[t] *= inv;                                     \
                }                                                                                         \
                for (int64_t g = 0; g < group; g++) {                                                     \
                    float acc[HEAD_DIM] = {0};                                                            \
                    const float *p = scores + g * padded;                                                 \
                    for (int64_t b = 0; b < num_blocks; b++) {                                            \
                        const T *values = v_cache + (table[b] * num_kv_heads + h) * block_elems;          \
                        const int64_t n = len - b * BLOCK_SIZE < BLOCK_SIZE ? len - b * BLOCK_SIZE : BLOCK_SIZE; \
                        for (int64_t t = 0; t < n; t++) {                                                 \
                            const float pt = p[b * BLOCK_SIZE + t];                                       \
                            _Pragma("omp simd")                                                           \
                            for (int64_t d = 0; d < HEAD_DIM; d++) acc[d] += pt * LOAD(values[t * HEAD_DIM + d]); \
                        }                                                                                 \
                    }                                                                                     \
                    for (int64_t d = 0; d < HEAD_DIM; d++)                                                \
                        out[(s * num_heads + h * group + g) * HEAD_DIM + d] = STORE(acc[d]);               \
                }                                                                                         \
                free(scores);                                                                             \
                free(query);                                                                              \
            }                                                                                             \
        }                                                                                                 \
    }

DEFINE_DECODE_ATTENTION(paged_decode_attention_f32, float, load_f32, store_f32)
DEFINE_DECODE_ATTENTION(paged_decode_attention_bf16, uint16_t, load_bf16, store_bf16)

/*
 * Prefill attention for one sequence's chunk of new tokens, over its paged context.
 *
 * Query i of the chunk sits at absolute position start + i and attends keys 0..start + i, so
 * one kernel serves a fresh prompt (start = 0) and a chunk continuing a cached prefix. Each task
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

#define DEFINE_PREFILL_ATTENTION(NAME, T, LOAD, STORE)                                                   \
    void NAME(const T *restrict q, const T *restrict k_cache, const T *restrict v_cache,                  \
              const int64_t *restrict block_table, T *restrict out, int64_t num_queries, int64_t start,    \
              int64_t num_heads, int64_t num_kv_heads, float scale) {                                     \
        const int64_t group = num_heads / num_kv_heads;                                                   \
        const int64_t block_elems = BLOCK_SIZE * HEAD_DIM;                                                \
        const int64_t num_tiles = (num_queries + QT - 1) / QT;                                            \
        _Pragma("omp parallel for collapse(2) schedule(dynamic)")                                          \
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
                        query[r][d] = LOAD(q[((first + r) * num_heads + head) * HEAD_DIM + d]) * scale;    \
                const int64_t last_key = start + first + rows - 1; /* the tile's last row sees this far */ \
                for (int64_t b = 0; b <= last_key / BLOCK_SIZE; b++) {                                    \
                    const T *keys = k_cache + (block_table[b] * num_kv_heads + kv_head) * block_elems;    \
                    const T *values = v_cache + (block_table[b] * num_kv_heads + kv_head) * block_elems;  \
                    for (int64_t r0 = 0; r0 < rows; r0 += ROWS) {                                         \
                        float sb[ROWS][BLOCK_SIZE] = {{0}};                                               \
                        for (int64_t d = 0; d < HEAD_DIM; d++) {                                          \
                            const T *kd = keys + d * BLOCK_SIZE;                                          \
                            for (int64_t rr = 0; rr < ROWS; rr++) {                                       \
                                const float qd = query[r0 + rr][d];                                       \
                                _Pragma("omp simd")                                                       \
                                for (int64_t t = 0; t < BLOCK_SIZE; t++) sb[rr][t] += qd * LOAD(kd[t]);   \
                            }                                                                             \
                        }                                                                                 \
                        for (int64_t rr = 0; rr < ROWS; rr++)                                             \
                            for (int64_t t = 0; t < BLOCK_SIZE; t++) s[r0 + rr][t] = sb[rr][t];           \
                    }                                                                                     \
                    for (int64_t r = 0; r < rows; r++) {                                                  \
                        const int64_t visible = start + first + r - b * BLOCK_SIZE + 1;                  \
                        const int64_t n = visible < BLOCK_SIZE ? visible : BLOCK_SIZE;                    \
                        if (n <= 0) continue;                                                             \
                        float top = m[r], sum = 0.0f;                                                     \
                        for (int64_t t = 0; t < n; t++) top = s[r][t] > top ? s[r][t] : top;              \
                        const float correction = expf(m[r] - top);                                        \
                        float p[BLOCK_SIZE];                                                              \
                        _Pragma("omp simd reduction(+:sum)")                                              \
                        for (int64_t t = 0; t < BLOCK_SIZE; t++) {                                        \
                            p[t] = t < n ? expf(s[r][t] - top) : 0.0f;                                    \
                            sum += p[t];                                                                  \
                        }                                                                                 \
                        m[r] = top;                                                                       \
                        l[r] = l[r] * correction + sum;                                                   \
                        float a[HEAD_DIM];                                                                \
                        _Pragma("omp simd")                                                               \
                        for (int64_t d = 0; d < HEAD_DIM; d++) a[d] = acc[r][d] * correction;             \
                        for (int64_t t = 0; t < n; t++) {                                                 \
                            const T *vt = values + t * HEAD_DIM;                                          \
                            _Pragma("omp simd")                                                           \
                            for (int64_t d = 0; d < HEAD_DIM; d++) a[d] += p[t] * LOAD(vt[d]);            \
                        }                                                                                 \
                        for (int64_t d = 0; d < HEAD_DIM; d++) acc[r][d] = a[d];                          \
                    }                                                                                     \
                }                                                                                         \
                for (int64_t r = 0; r < rows; r++) {                                                      \
                    const float inv = 1.0f / l[r];                                                        \
                    for (int64_t d = 0; d < HEAD_DIM; d++)                                                \
                        out[((first + r) * num_heads + head) * HEAD_DIM + d] = STORE(acc[r][d] * inv);     \
                }                                                                                         \
            }                                                                                             \
        }                                                                                                 \
    }

DEFINE_PREFILL_ATTENTION(paged_prefill_attention_f32, float, load_f32, store_f32)
DEFINE_PREFILL_ATTENTION(paged_prefill_attention_bf16, uint16_t, load_bf16, store_bf16)

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
 * q_norm / k_norm (Qwen3's per-head RMSNorm before the rotation) are applied when not NULL.
 */
#define DEFINE_ROPE_WRITE_KV(NAME, T, LOAD, STORE)                                                        \
    void NAME(const T *restrict qkv, const int64_t *restrict positions, const float *restrict cos_table,  \
              const float *restrict sin_table, T *restrict q_out, T *restrict k_cache, T *restrict v_cache, \
              const int64_t *restrict slot_blocks, const int64_t *restrict slot_offsets,                 \
              const T *restrict q_norm, const T *restrict k_norm, float eps, int64_t num_tokens,        \
              int64_t num_heads, int64_t num_kv_heads) {                                                  \
        const int64_t stride = (num_heads + 2 * num_kv_heads) * HEAD_DIM, half = HEAD_DIM / 2;            \
        _Pragma("omp parallel for if(num_tokens >= 16)")                                                  \
        for (int64_t t = 0; t < num_tokens; t++) {                                                        \
            const float *c = cos_table + positions[t] * HEAD_DIM, *s = sin_table + positions[t] * HEAD_DIM; \
            const T *row = qkv + t * stride;                                                              \
            for (int64_t h = 0; h < num_heads + num_kv_heads; h++) {                                      \
                const int is_q = h < num_heads;                                                           \
                const T *norm = is_q ? q_norm : k_norm;                                                   \
                float x[HEAD_DIM], y[HEAD_DIM];                                                           \
                for (int64_t d = 0; d < HEAD_DIM; d++) x[d] = LOAD(row[h * HEAD_DIM + d]);                \
                if (norm) {                                                                               \
                    double squares = 0.0;                                                                 \
                    for (int64_t d = 0; d < HEAD_DIM; d++) squares += (double)x[d] * x[d];                \
                    const float scale = 1.0f / sqrtf((float)(squares / HEAD_DIM) + eps);                  \
                    for (int64_t d = 0; d < HEAD_DIM; d++) x[d] = x[d] * scale * LOAD(norm[d]);           \
                }                                                                                         \
                _Pragma("omp simd")                                                                       \
                for (int64_t d = 0; d < HEAD_DIM; d++) y[d] = x[d] * c[d] + x[(d + half) % HEAD_DIM] * s[d]; \
                if (is_q) {                                                                               \
                    for (int64_t d = 0; d < HEAD_DIM; d++) q_out[(t * num_heads + h) * HEAD_DIM + d] = STORE(y[d]); \
                } else {                                                                                  \
                    T *keys = k_cache + (slot_blocks[t] * num_kv_heads + h - num_heads) * BLOCK_SIZE * HEAD_DIM; \
                    for (int64_t d = 0; d < HEAD_DIM; d++) keys[d * BLOCK_SIZE + slot_offsets[t]] = STORE(y[d]); \
                }                                                                                         \
            }                                                                                             \
            const T *v = row + (num_heads + num_kv_heads) * HEAD_DIM;                                     \
            for (int64_t h = 0; h < num_kv_heads; h++) {                                                  \
                T *values = v_cache + ((slot_blocks[t] * num_kv_heads + h) * BLOCK_SIZE + slot_offsets[t]) * HEAD_DIM; \
                for (int64_t d = 0; d < HEAD_DIM; d++) values[d] = v[h * HEAD_DIM + d];                   \
            }                                                                                             \
        }                                                                                                 \
    }

DEFINE_ROPE_WRITE_KV(rope_write_kv_f32, float, load_f32, store_f32)
DEFINE_ROPE_WRITE_KV(rope_write_kv_bf16, uint16_t, load_bf16, store_bf16)
