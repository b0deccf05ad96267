/*
 * Attention over paged KV blocks, for CPUs: decode attention, and the row arithmetic prefill
 * attention (paged_attention.c) shares with it.
 *
 * One query token per decode row. A task is one (row, kv head) pair's part of the keys (parts of
 * DECODE_PART_TOKENS, below): its query heads are scored against the keys block by block,
 * straight from the cache (no gathered copy), then the softmax-weighted values are summed, and
 * the parts are merged after. K and V are read exactly once, which is the floor for decode
 * attention; torch's formulation gathered them into a copy and ran thousands of tiny matmuls,
 * and was ~5x slower at batch 64.
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

/* Asks for a block's cache lines ahead of use. Blocks sit anywhere in the cache, and the hardware
 * prefetchers stop at each 4 KiB page, so without this every block starts with a wait on memory:
 * in a decode step the weights have just pushed the cache's K and V out of every level. The key
 * pass asks for the K and the V block KV_AHEAD blocks on, so the value pass finds its blocks in
 * cache as well (a bf16 cache at batch 32, Zen 4, 2 threads: 9.6 GB/s with K alone one block
 * ahead, 14 GB/s so; 4 and 8 blocks ahead were no faster). */
#define KV_AHEAD 2
static inline void prefetch_block(const void *p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)p + i);
}

/* The first key a row at `position` sees: its window's, or the context's (window 0) */
static inline int64_t window_first_key(int64_t window, int64_t position) {
    return window > 0 && position >= window ? position - window + 1 : 0;
}

/* The same for decode row s; positions is read only for a window layer (callers pass NULL
 * otherwise). */
static inline int64_t decode_first_key(int64_t window, const int64_t *positions, int64_t s) {
    return window > 0 ? window_first_key(window, positions[s]) : 0;
}

/*
 * A group's query heads are scored and summed in tiles of up to QHEADS heads, each key and value
 * converted to float once for the whole tile (in registers, never into a scratch copy), and each
 * tile's sums held in registers: G x BLOCK_SIZE scores (two sets, even and odd dims, so twice as
 * many FMA chains hide their latency), G x VCHUNK output sums. G is a constant in every copy of
 * the tile loops (DECODE_TILE picks the copy), which is what lets the compiler keep those arrays
 * in registers: with the group a loop bound, the value sums lived on the stack, a store and a
 * reload per key, and the pass ran at the latency of that chain.
 *
 * Each copy is a function of its own, never inlined nor cloned for one caller's constants, and so
 * is every other step of a row's
 * arithmetic (part_weights, merge_part): decode rows and prefill rows, in whichever kernel or
 * library, run the same machine code on the same numbers in the same order. The kernels build
 * with -ffast-math, under which two inlined copies of one loop may be vectorized or reassociated
 * differently; a row's last bits would then depend on which kernel ran it, and int8 activation
 * rounding turns last bits into other tokens (a prompt's tail after a prefix-cache hit runs as
 * decode rows, the same prompt cold as a prefill chunk: with two kernels, greedy answers left
 * the cold run's after 0 to 56 tokens).
 */
#define QHEADS 4
#ifdef __AVX512F__
#define VCHUNK_MAX 64 /* QHEADS x 64 sums: 16 of the 32 vector registers */
#else
#define VCHUNK_MAX 32 /* 16 of AVX2's 16 would spill: QHEADS x 32 is 16 of them, with 4 values */
#endif
#define VCHUNK (HEAD_DIM % VCHUNK_MAX == 0 ? VCHUNK_MAX : HEAD_DIM % 16 == 0 ? 16 : HEAD_DIM % 8 == 0 ? 8 : HEAD_DIM)

/* Calls FN_G(...), the copy of FN for G = the tile's heads: 1 .. QHEADS. */
#define DECODE_TILE(heads, FN, ...)                                                                       \
    switch ((heads) < QHEADS ? (heads) : QHEADS) {                                                        \
        case 1: FN##_1(__VA_ARGS__); break;                                                               \
        case 2: FN##_2(__VA_ARGS__); break;                                                               \
        case 3: FN##_3(__VA_ARGS__); break;                                                               \
        default: FN##_4(__VA_ARGS__); break;                                                              \
    }

/* FN_1 .. FN_4: BODY's copies for G = 1 .. QHEADS, each its own function (see above). */
#define DEFINE_TILE_COPIES(FN, BODY, PARAMS, ARGS)                                                        \
    static __attribute__((noinline, noclone, unused)) void FN##_1 PARAMS { BODY(ARGS, 1); }               \
    static __attribute__((noinline, noclone, unused)) void FN##_2 PARAMS { BODY(ARGS, 2); }               \
    static __attribute__((noinline, noclone, unused)) void FN##_3 PARAMS { BODY(ARGS, 3); }               \
    static __attribute__((noinline, noclone, unused)) void FN##_4 PARAMS { BODY(ARGS, QHEADS); }

#define SCORE_PARAMS(CT)                                                                                  \
    (const float *restrict query, const CT *restrict keys, const float *restrict ks,                     \
     float *restrict scores, int64_t stride, const CT *ahead_keys, const CT *ahead_values)
#define SCORE_ARGS query, keys, ks, scores, stride, ahead_keys, ahead_values
#define SUM_PARAMS(CT)                                                                                    \
    (const float *restrict weights, int64_t wstride, const CT *restrict values, const float *restrict vs, \
     int64_t n, float *restrict out, int64_t stride)
#define SUM_ARGS weights, wstride, values, vs, n, out, stride

/* scores[g][t] = query[g] . key t of the block (times the key's scale), for G query heads; rows of
 * scores `stride` apart. Keys are stored transposed: dim d of the block's keys is one row. With
 * ahead_keys non-NULL, a later block's K and V are asked for on the way. */
#define DEFINE_DECODE_TILES(SUFFIX, CT, LOAD_C, SCALED)                                                   \
    static inline __attribute__((always_inline)) void score_tile_body_##SUFFIX(                           \
        const float *restrict query, const CT *restrict keys, const float *restrict ks,                  \
        float *restrict scores, int64_t stride, const CT *ahead_keys, const CT *ahead_values, const int G) { \
        float sums[2][QHEADS][BLOCK_SIZE] = {{{0}}};                                                      \
        for (int64_t d = 0; d < HEAD_DIM; d += 2) {                                                       \
            if (ahead_keys)                                                                               \
                for (int u = 0; u < 2; u++) { /* a later block's K and V, a row each per row read here */ \
                    __builtin_prefetch(ahead_keys + (d + u) * BLOCK_SIZE);                                \
                    __builtin_prefetch(ahead_values + (d + u) * BLOCK_SIZE);                              \
                }                                                                                         \
            for (int u = 0; u < 2; u++)                                                                   \
                for (int g = 0; g < G; g++) { /* a key row's conversion is shared by the unrolled heads */ \
                    const float qd = query[g * HEAD_DIM + d + u];                                         \
                    _Pragma("omp simd")                                                                   \
                    for (int64_t t = 0; t < BLOCK_SIZE; t++)                                              \
                        sums[u][g][t] += qd * LOAD_C(keys[(d + u) * BLOCK_SIZE + t]);                     \
                }                                                                                         \
        }                                                                                                 \
        for (int g = 0; g < G; g++)                                                                       \
            for (int64_t t = 0; t < BLOCK_SIZE; t++)                                                      \
                scores[g * stride + t] = SCALED ? (sums[0][g][t] + sums[1][g][t]) * ks[t]                  \
                                                : sums[0][g][t] + sums[1][g][t];                          \
    }                                                                                                     \
    DEFINE_TILE_COPIES(score_tile_##SUFFIX, score_tile_body_##SUFFIX, SCORE_PARAMS(CT), SCORE_ARGS)       \
    /* sums[g] (VCHUNK-strided rows `stride` apart) += weights[g][t] * values[t] over the block's first n \
     * values (each scaled by its own scale), for G query heads; weights rows `wstride` apart. A value \
     * is converted where each head uses it: a converted copy shared by the heads let the compiler     \
     * keep a float32 cache's sums on the stack (its decode attention 28% slower, prefill 2x). */     \
    static inline __attribute__((always_inline)) void sum_tile_body_##SUFFIX(                             \
        const float *restrict weights, int64_t wstride, const CT *restrict values,                       \
        const float *restrict vs, int64_t n, float *restrict out, int64_t stride, const int G) {         \
        float w[QHEADS][BLOCK_SIZE];                                                                      \
        for (int g = 0; g < G; g++)                                                                       \
            for (int64_t t = 0; t < BLOCK_SIZE; t++)                                                      \
                w[g][t] = SCALED ? weights[g * wstride + t] * vs[t] : weights[g * wstride + t];           \
        for (int64_t d0 = 0; d0 < HEAD_DIM; d0 += VCHUNK) {                                               \
            float acc[QHEADS][VCHUNK];                                                                    \
            for (int g = 0; g < G; g++)                                                                   \
                for (int64_t c = 0; c < VCHUNK; c++) acc[g][c] = out[g * stride + d0 + c];                \
            for (int64_t t = 0; t < n; t++) {                                                             \
                const CT *v = values + t * HEAD_DIM + d0;                                                 \
                for (int g = 0; g < G; g++) {                                                             \
                    const float wt = w[g][t];                                                             \
                    _Pragma("omp simd")                                                                   \
                    for (int64_t c = 0; c < VCHUNK; c++) acc[g][c] += wt * LOAD_C(v[c]);                  \
                }                                                                                         \
            }                                                                                             \
            for (int g = 0; g < G; g++)                                                                   \
                for (int64_t c = 0; c < VCHUNK; c++) out[g * stride + d0 + c] = acc[g][c];                \
        }                                                                                                 \
    }                                                                                                     \
    DEFINE_TILE_COPIES(sum_tile_##SUFFIX, sum_tile_body_##SUFFIX, SUM_PARAMS(CT), SUM_ARGS)
DEFINE_DECODE_TILES(f32, float, load_f32, 0)
DEFINE_DECODE_TILES(bf16, uint16_t, load_bf16, 0)
DEFINE_DECODE_TILES(f16, uint16_t, load_f16, 0)
DEFINE_DECODE_TILES(i8, int8_t, load_i8, 1)

/* A row's keys are taken in parts of DECODE_PART_TOKENS, its softmax computed per part and the
 * parts merged after, in their order (flash-decoding's split): one sequence (as many (sequence,
 * kv head) pairs as kv heads: 3 for SmolLM2, on 2 threads) still gives every thread work. Parts
 * are fixed runs of the cache counted from its first block (part p: blocks [p, p + 1) x
 * DECODE_PART_BLOCKS), not a number chosen by the batch, so a row's sums run in the same order
 * whatever else the step holds and whichever kernel runs it: that is what makes a speculative
 * verify pass (the row and its drafts, one step) compute the row exactly as decoding it alone
 * would, and a prompt's rows in a prefill chunk exactly as decode rows (splitting by the batch's
 * size moved the last bits of attention, and int8 activation rounding turned those into logprob
 * changes of up to 0.4 on SmolLM2, enough to change greedy output). A row of a sliding-window
 * layer starts at the part of its window's first key. */
#define DECODE_PART_TOKENS 128
#define DECODE_PART_BLOCKS (DECODE_PART_TOKENS > BLOCK_SIZE ? DECODE_PART_TOKENS / BLOCK_SIZE : 1)
#define PART_KEYS (DECODE_PART_BLOCKS * BLOCK_SIZE)
static inline int64_t decode_attention_parts(int64_t max_blocks) {
    return max_blocks > DECODE_PART_BLOCKS ? (max_blocks + DECODE_PART_BLOCKS - 1) / DECODE_PART_BLOCKS : 1;
}

/* The first part a row whose first seen key is `seen` reads, and how many it reads at context
 * length `len` (none at 0). */
static inline int64_t row_first_part(int64_t seen) { return seen / BLOCK_SIZE / DECODE_PART_BLOCKS; }
static inline int64_t row_parts(int64_t len, int64_t seen) {
    return len > 0 ? ((len + BLOCK_SIZE - 1) / BLOCK_SIZE - 1) / DECODE_PART_BLOCKS - row_first_part(seen) + 1 : 0;
}

/* The blocks [*lo, *hi) of part `part` such a row reads; 0 where it reads none. */
static inline int part_blocks(int64_t part, int64_t len, int64_t seen, int64_t *lo, int64_t *hi) {
    const int64_t first = part * DECODE_PART_BLOCKS, blocks = (len + BLOCK_SIZE - 1) / BLOCK_SIZE;
    *lo = first > seen / BLOCK_SIZE ? first : seen / BLOCK_SIZE;
    *hi = first + DECODE_PART_BLOCKS < blocks ? first + DECODE_PART_BLOCKS : blocks;
    return *lo < *hi;
}

/* p [padded]: one head's scores against a row's keys in one part, the first n its own (the rest
 * pad the part's last block). Out: p[t] = exp(p[t] - top) for t < n, 0 after; returns their sum,
 * *top_out = top, the largest of the n (-FLT_MAX where every key is hidden: its weight in the merge,
 * exp(-FLT_MAX - the row's top), is 0). The sum runs in BLOCK_SIZE lanes and then a fixed tree, an
 * order no compiler picks for itself. */
static __attribute__((noinline, noclone, unused)) float part_weights(float *restrict p, int64_t n, int64_t padded,
                                                            float *restrict top_out) {
    float top = -FLT_MAX, lanes[BLOCK_SIZE] = {0};
    for (int64_t t = 0; t < n; t++) top = p[t] > top ? p[t] : top;
    for (int64_t b = 0; b < padded; b += BLOCK_SIZE) {
        _Pragma("omp simd")
        for (int64_t t = 0; t < BLOCK_SIZE; t++) p[b + t] = expf(p[b + t] - top);
        if (b + BLOCK_SIZE > n) /* the last block: its padding weighs 0 */
            for (int64_t t = n - b; t < BLOCK_SIZE; t++) p[b + t] = 0.0f;
        _Pragma("omp simd")
        for (int64_t t = 0; t < BLOCK_SIZE; t++) lanes[t] += p[b + t];
    }
    for (int64_t width = 1; width < BLOCK_SIZE; width *= 2)
        for (int64_t t = 0; t + width < BLOCK_SIZE; t += 2 * width) lanes[t] += lanes[t + width];
    *top_out = top;
    return lanes[0];
}

/* A row's head across parts: state and part are (top, sum of exp(score - top), unnormalized
 * output [HEAD_DIM]); state takes in the next part, both rescaled to the larger top. A state
 * starts as (-FLT_MAX, 0, 0) (merge_start), so merging the first part copies it exactly. */
static inline void merge_start(float *restrict state) {
    state[0] = -FLT_MAX;
    for (int64_t d = 1; d < HEAD_DIM + 2; d++) state[d] = 0.0f;
}

static __attribute__((noinline, noclone, unused)) void merge_part(float *restrict state, const float *restrict part) {
    const float top = part[0] > state[0] ? part[0] : state[0];
    const float kept = expf(state[0] - top), added = expf(part[0] - top);
    state[0] = top;
    for (int64_t d = 1; d < HEAD_DIM + 2; d++) state[d] = state[d] * kept + part[d] * added;
}

/*
 * One part of one sequence's keys (kv head h) for `rows` query rows of it: row r at context
 * length lens[r], seeing keys from seens[r] on (and, with ancestors, among the 63 keys before its
 * own only those its mask keeps), its `group` heads' scaled queries at query + (r * group + g) *
 * HEAD_DIM. For each row with keys in the part, results + (r * group + g) * (HEAD_DIM + 2) gets
 * the part's top, sum and unnormalized output (merge_part's). Rows are taken one by one over each
 * block, which stays in L1 for all of them; scores rows are PART_KEYS floats apart, a row's
 * first at its first block.
 */
#define DEFINE_ATTEND_PART(CS, CT, SCALED)                                                                \
    static inline void attend_part_##CS(const float *restrict query, int64_t rows, int64_t group,         \
                                        const int64_t *restrict lens, const int64_t *restrict seens,      \
                                        const int64_t *restrict ancestors, int64_t part,                  \
                                        const int64_t *restrict table, const CT *restrict k_cache,        \
                                        const CT *restrict v_cache, const float *restrict k_scales,       \
                                        const float *restrict v_scales, int64_t num_kv_heads, int64_t h,  \
                                        float *restrict scores, float *restrict results) {                \
        const int64_t block_elems = BLOCK_SIZE * HEAD_DIM, slot = HEAD_DIM + 2;                           \
        int64_t lo[rows], hi[rows], end[rows], first = INT64_MAX, last = 0, blocks = 0;                   \
        for (int64_t r = 0; r < rows; r++) {                                                              \
            const int64_t own = (lens[r] + BLOCK_SIZE - 1) / BLOCK_SIZE;                                  \
            blocks = own > blocks ? own : blocks;                                                         \
            if (!part_blocks(part, lens[r], seens[r], lo + r, hi + r)) hi[r] = lo[r];                     \
            end[r] = hi[r] * BLOCK_SIZE < lens[r] ? hi[r] * BLOCK_SIZE : lens[r];                         \
            if (lo[r] < hi[r]) {                                                                          \
                first = lo[r] < first ? lo[r] : first;                                                    \
                last = hi[r] > last ? hi[r] : last;                                                       \
            }                                                                                             \
        }                                                                                                 \
        for (int64_t b = first; b < last; b++) {                                                          \
            if (b == first) /* the first blocks: at once; the rest, as the keys are read */               \
                for (int64_t a = b; a < b + KV_AHEAD && a < last; a++) {                                  \
                    prefetch_block(k_cache + (table[a] * num_kv_heads + h) * block_elems, sizeof(CT) * block_elems); \
                    prefetch_block(v_cache + (table[a] * num_kv_heads + h) * block_elems, sizeof(CT) * block_elems); \
                }                                                                                         \
            const int64_t ahead = (b + KV_AHEAD < blocks ? table[b + KV_AHEAD] : table[b]) * num_kv_heads + h; \
            const CT *keys = k_cache + (table[b] * num_kv_heads + h) * block_elems;                       \
            const float *ks = SCALED ? k_scales + (table[b] * num_kv_heads + h) * BLOCK_SIZE : NULL;       \
            int asked = 0; /* the first row to read the block asks for the later one */                  \
            for (int64_t r = 0; r < rows; r++) {                                                          \
                if (b < lo[r] || b >= hi[r]) continue;                                                    \
                for (int64_t g = 0; g < group; g += QHEADS)                                               \
                    DECODE_TILE(group - g, score_tile_##CS, query + (r * group + g) * HEAD_DIM, keys, ks,  \
                                scores + (r * group + g) * PART_KEYS + (b - lo[r]) * BLOCK_SIZE, PART_KEYS, \
                                asked ? NULL : k_cache + ahead * block_elems, v_cache + ahead * block_elems) \
                asked = 1;                                                                                \
            }                                                                                             \
        }                                                                                                 \
        for (int64_t r = 0; r < rows; r++) {                                                              \
            if (lo[r] == hi[r]) continue;                                                                 \
            const int64_t len = lens[r], start = lo[r] * BLOCK_SIZE;                                      \
            const uint64_t mask = ancestors ? (uint64_t)ancestors[r] : ~(uint64_t)0;                      \
            for (int64_t g = 0; g < group; g++) {                                                         \
                float *p = scores + (r * group + g) * PART_KEYS, *result = results + (r * group + g) * slot; \
                if (~mask) /* a tree row: hide the keys of other branches */                              \
                    for (int64_t j = 1; j < 64 && j < len; j++)                                           \
                        if (!((mask >> j) & 1) && len - 1 - j >= start && len - 1 - j < end[r])           \
                            p[len - 1 - j - start] = -FLT_MAX;                                            \
                for (int64_t t = start; t < seens[r] && t < end[r]; t++) p[t - start] = -FLT_MAX;         \
                result[1] = part_weights(p, end[r] - start, (hi[r] - lo[r]) * BLOCK_SIZE, result);        \
                for (int64_t d = 0; d < HEAD_DIM; d++) result[2 + d] = 0.0f;                              \
            }                                                                                             \
        }                                                                                                 \
        for (int64_t b = first; b < last; b++) { /* each value block read once for every row */          \
            const CT *values = v_cache + (table[b] * num_kv_heads + h) * block_elems;                     \
            const float *vs = SCALED ? v_scales + (table[b] * num_kv_heads + h) * BLOCK_SIZE : NULL;      \
            for (int64_t r = 0; r < rows; r++) {                                                          \
                if (b < lo[r] || b >= hi[r]) continue;                                                    \
                const int64_t n = end[r] - b * BLOCK_SIZE < BLOCK_SIZE ? end[r] - b * BLOCK_SIZE : BLOCK_SIZE; \
                for (int64_t g = 0; g < group; g += QHEADS)                                               \
                    DECODE_TILE(group - g, sum_tile_##CS,                                                 \
                                scores + (r * group + g) * PART_KEYS + (b - lo[r]) * BLOCK_SIZE, PART_KEYS, \
                                values, vs, n, results + (r * group + g) * slot + 2, slot)                \
            }                                                                                             \
        }                                                                                                 \
    }
DEFINE_ATTEND_PART(f32, float, 0)
DEFINE_ATTEND_PART(bf16, uint16_t, 0)
DEFINE_ATTEND_PART(f16, uint16_t, 0)
DEFINE_ATTEND_PART(i8, int8_t, 1)

/* A row's output for one head from its merged state. */
#define FINISH_ROW(state, out, STORE_X)                                                                   \
    do {                                                                                                  \
        const float inv = 1.0f / (state)[1];                                                              \
        for (int64_t d = 0; d < HEAD_DIM; d++) (out)[d] = STORE_X((state)[2 + d] * inv);                  \
    } while (0)

/* The scratch decode attention needs, allocated by its caller before the parallel region:
 *
 *   partials  [seqs, kv_heads, parts, group, HEAD_DIM + 2]   per part and query head: the part's
 *             largest score, its sum of exponentials and its unnormalized output
 *   scores    [threads] rows of decode_attention_scores()    a thread's task at a time: its
 *             group's scores against the part's keys, then its scaled queries
 */
static inline int64_t decode_attention_partials(int64_t num_seqs, int64_t num_heads, int64_t parts) {
    return cache_lines_of_floats(num_seqs * num_heads * parts * (HEAD_DIM + 2));
}

static inline int64_t decode_attention_scores(int64_t num_heads, int64_t num_kv_heads) {
    return cache_lines_of_floats(num_heads / num_kv_heads * (PART_KEYS + HEAD_DIM));
}

/* Floats of the whole scratch, for `threads` = omp_get_max_threads() (a team's size at most). */
static inline int64_t decode_attention_scratch(int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                               int64_t max_blocks, int64_t parts, int64_t threads) {
    return decode_attention_partials(num_seqs, num_heads, parts)
           + threads * decode_attention_scores(num_heads, num_kv_heads);
}

#define DEFINE_DECODE_ATTENTION(SUFFIX, XT, LOAD_X, STORE_X, CS, CT, SCALED)                              \
    static __attribute__((noinline, noclone)) void decode_attention_##SUFFIX(const XT *restrict q, const CT *restrict k_cache, \
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
        const int64_t group = num_heads / num_kv_heads, slot = HEAD_DIM + 2;                              \
        float *restrict partials = scratch;                                                               \
        float *scores_of_thread = scratch + decode_attention_partials(num_seqs, num_heads, parts);        \
        const int64_t scores_stride = decode_attention_scores(num_heads, num_kv_heads);                   \
        /* tasks handed out a few at a time: one by one, a big batch's thousands of parts per layer     \
         * spent more in the hand-out than in its shortest parts */                                      \
        const int64_t tasks = num_seqs * num_kv_heads * parts, handout = tasks / (8 * omp_get_num_threads()); \
        const int64_t chunk = handout > 1 ? handout : 1;                                                  \
        _Pragma("omp for collapse(3) schedule(dynamic, chunk)")                                           \
        for (int64_t s = 0; s < num_seqs; s++) {                                                          \
            for (int64_t h = 0; h < num_kv_heads; h++) {                                                  \
                for (int64_t part = 0; part < parts; part++) {                                            \
                    const int64_t len = context_lens[s];                                                  \
                    const int64_t seen = decode_first_key(window, positions, s);                          \
                    if (part >= row_parts(len, seen)) continue; /* past this row's keys: the merge skips it */ \
                    float *scores = scores_of_thread + omp_get_thread_num() * scores_stride;              \
                    float *restrict query = scores + group * PART_KEYS;                                   \
                    for (int64_t g = 0; g < group; g++)                                                   \
                        for (int64_t d = 0; d < HEAD_DIM; d++)                                            \
                            query[g * HEAD_DIM + d] = LOAD_X(q[(s * num_heads + h * group + g) * HEAD_DIM + d]) * scale; \
                    attend_part_##CS(query, 1, group, &len, &seen, ancestor_masks ? ancestor_masks + s : NULL, \
                                     row_first_part(seen) + part, block_tables + s * max_blocks, k_cache, v_cache, \
                                     k_scales, v_scales, num_kv_heads, h, scores,                         \
                                     partials + ((s * num_kv_heads + h) * parts + part) * group * slot);  \
                }                                                                                         \
            }                                                                                             \
        }                                                                                                 \
        /* merge the row's parts, in their order */                                                      \
        _Pragma("omp for collapse(2) schedule(static)")                                                   \
        for (int64_t s = 0; s < num_seqs; s++) {                                                          \
            for (int64_t head = 0; head < num_heads; head++) {                                            \
                const int64_t h = head / group, g = head % group;                                         \
                const int64_t own = row_parts(context_lens[s], decode_first_key(window, positions, s));   \
                const float *first = partials + (s * num_kv_heads + h) * parts * group * slot + g * slot; \
                float state[HEAD_DIM + 2];                                                                \
                merge_start(state);                                                                       \
                for (int64_t part = 0; part < own; part++) merge_part(state, first + part * group * slot); \
                FINISH_ROW(state, out + (s * num_heads + head) * HEAD_DIM, STORE_X);                      \
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
