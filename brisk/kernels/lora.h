/*
 * LoRA adapters' updates over a batch of rows of several adapters (kernels/lora.py):
 *
 *     t[i] = A x[i]             shrink: each row of A read once per adapter, dotted with its rows
 *     y[i] += B t[i]            expand: each column of B read once per adapter, for its rows
 *
 * for every row i of each adapter's segment (rows[starts[a] .. starts[a + 1]]), t times the
 * segment's scale (1 but where a request scales its adapter, as llama.cpp's server lets it); rows
 * of the base model are in no segment and left alone. A fused projection's update has one A (its modules'
 * stacked, R rows) and one B per module (a piece: the rows of y it adds to, its columns of t).
 * Adapters are float32 or bfloat16 (the batch says which), activations float32.
 *
 * Both halves are orphaned `omp for` loops, over the adapters' ranks (each row of A converted once
 * for four of the segment's rows at a time) and over blocks of the projection's outputs (B kept
 * transposed, so each row of the segment adds t[i, r] times a contiguous run of B^T's row r:
 * vectorized along the outputs, where B's own rows are only rank long): inside decode_layers.c's parallel region the region's threads share them, and lora.c's
 * lora_add opens a region of its own. Scratch t: [rows of the step, max_rank] floats.
 */
#ifndef BRISK_LORA_H
#define BRISK_LORA_H

#include <stdint.h>

#include "dtypes.h"

enum lora_target { LORA_QKV, LORA_O, LORA_GATE_UP, LORA_DOWN, LORA_PROJECTIONS };

struct lora_piece {
    int64_t first_row, rows;   /* the columns of y it adds to */
    int64_t first_rank, rank;  /* its columns of t */
    const void *bt;            /* B transposed, [rank, rows]: the expand runs along y's columns */
};

struct lora_projection {      /* an adapter's update of one projection: rank 0 where there is none */
    const void *a;             /* [rank, cols] */
    int64_t rank, num_pieces;
    const struct lora_piece *pieces;
};

struct lora_batch {
    int64_t num_adapters, max_rank;
    int64_t bf16;              /* the adapters' element type: bfloat16, else float32 */
    const int64_t *rows;       /* the step's rows of adapters, grouped by adapter */
    const int64_t *starts;     /* [num_adapters + 1] */
    const float *scales;       /* [num_adapters]: a request's own scale of its adapter's update */
    const struct lora_projection **adapters; /* each: [num_layers * LORA_PROJECTIONS] */
};

/* Output columns an expand task covers: its slice of B^T (rank x LORA_COLUMNS) stays in L1 while
 * every row of the segment adds its share. Rows of A a shrink task covers: with a single sequence
 * (a decode step of one) the shrink still splits across the threads. */
#define LORA_COLUMNS 128
#define LORA_RANKS 16

#define DEFINE_LORA_ADD(SUFFIX, T, LOAD)                                                                  \
    /* t[i, j] = A[j] . x[i] for four gathered rows at once: A's row is converted once for them */       \
    static inline void lora_shrink4_##SUFFIX(const T *restrict a, const float *const *x, int64_t k,       \
                                             float *sums) {                                               \
        float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;                                                 \
        const float *restrict x0 = x[0], *restrict x1 = x[1], *restrict x2 = x[2], *restrict x3 = x[3];  \
        _Pragma("omp simd reduction(+:s0, s1, s2, s3)")                                                   \
        for (int64_t c = 0; c < k; c++) {                                                                 \
            const float w = LOAD(a[c]);                                                                   \
            s0 += w * x0[c];                                                                              \
            s1 += w * x1[c];                                                                              \
            s2 += w * x2[c];                                                                              \
            s3 += w * x3[c];                                                                              \
        }                                                                                                 \
        sums[0] = s0, sums[1] = s1, sums[2] = s2, sums[3] = s3;                                           \
    }                                                                                                     \
                                                                                                          \
    /* y [m, n] += the update of projection `index` (layer * LORA_PROJECTIONS + which) for x [m, k] */ \
    static void lora_add_rows_##SUFFIX(const struct lora_batch *batch, int64_t index, const float *x,     \
                                       float *y, int64_t k, int64_t n, float *t) {                        \
        const int64_t R = batch->max_rank;                                                                \
        /* shrink: a task is four rows of one adapter against LORA_RANKS rows of its A (in L1 or L2  \
         * after the first task reads them), each row of A converted once for the four rows */        \
        const int64_t chunks = (R + LORA_RANKS - 1) / LORA_RANKS;                                         \
        int64_t tasks = 0;                                                                                \
        for (int64_t a = 0; a < batch->num_adapters; a++)                                                 \
            tasks += (batch->starts[a + 1] - batch->starts[a] + 3) / 4 * chunks;                          \
        _Pragma("omp for schedule(static)")                                                               \
        for (int64_t task = 0; task < tasks; task++) {                                                    \
            int64_t a = 0, s = task / chunks;                                                             \
            const int64_t chunk = task % chunks;                                                          \
            while (s >= (batch->starts[a + 1] - batch->starts[a] + 3) / 4)                                \
                s -= (batch->starts[a + 1] - batch->starts[a] + 3) / 4, a++;                              \
            const struct lora_projection *p = batch->adapters[a] + index;                                 \
            const int64_t first = batch->starts[a] + 4 * s, last = batch->starts[a + 1];                  \
            const int64_t count = last - first < 4 ? last - first : 4;                                    \
            const int64_t j_end = (chunk + 1) * LORA_RANKS < p->rank ? (chunk + 1) * LORA_RANKS : p->rank; \
            const float *xs[4], scale = batch->scales[a];                                                 \
            for (int64_t q = 0; q < 4; q++) xs[q] = x + batch->rows[first + (q < count ? q : 0)] * k;     \
            for (int64_t j = chunk * LORA_RANKS; j < j_end; j++) {                                        \
                float sums[4];                                                                            \
                lora_shrink4_##SUFFIX((const T *)p->a + j * k, xs, k, sums);                              \
                for (int64_t q = 0; q < count; q++) t[batch->rows[first + q] * R + j] = sums[q] * scale;  \
            }                                                                                             \
        }                                                                                                 \
        /* expand: a task is one adapter's rows over a block of outputs, four of B^T's rows at a time; \
         * adapter-major, so a thread streams one adapter's B^T at a time (its rank rows, a few      \
         * streams), and tasks write disjoint parts of y (a row belongs to one segment) */           \
        const int64_t blocks = (n + LORA_COLUMNS - 1) / LORA_COLUMNS;                                     \
        _Pragma("omp for schedule(static)")                                                               \
        for (int64_t task = 0; task < batch->num_adapters * blocks; task++) {                             \
            const int64_t a = task / blocks, block = task % blocks;                                       \
            const int64_t lo = block * LORA_COLUMNS, hi = lo + LORA_COLUMNS < n ? lo + LORA_COLUMNS : n;  \
            const struct lora_projection *p = batch->adapters[a] + index;                                     \
            for (int64_t q = 0; q < p->num_pieces; q++) {                                                     \
                const struct lora_piece *piece = p->pieces + q;                                               \
                const int64_t from = lo > piece->first_row ? lo : piece->first_row;                           \
                const int64_t end = piece->first_row + piece->rows, to = hi < end ? hi : end;                 \
                if (from >= to) continue;                                                                     \
                /* B^T's row r from this task's first output on */                                            \
                const T *bt = (const T *)piece->bt + (from - piece->first_row);                               \
                const int64_t stride = piece->rows, width = to - from;                                        \
                float *restrict yi0 = y + from;                                                               \
                for (int64_t s = batch->starts[a]; s < batch->starts[a + 1]; s++) {                           \
                    const int64_t i = batch->rows[s];                                                         \
                    const float *ti = t + i * R + piece->first_rank;                                          \
                    float *restrict yi = yi0 + i * n;                                                         \
                    int64_t r = 0;                                                                            \
                    for (; r + 4 <= piece->rank; r += 4) {                                                    \
                        const float t0 = ti[r], t1 = ti[r + 1], t2 = ti[r + 2], t3 = ti[r + 3];               \
                        const T *restrict b0 = bt + r * stride, *restrict b1 = b0 + stride;                   \
                        const T *restrict b2 = b1 + stride, *restrict b3 = b2 + stride;                       \
                        _Pragma("omp simd")                                                                   \
                        for (int64_t o = 0; o < width; o++)                                                   \
                            yi[o] += t0 * LOAD(b0[o]) + t1 * LOAD(b1[o]) + t2 * LOAD(b2[o])                   \
                                     + t3 * LOAD(b3[o]);                                                      \
                    }                                                                                         \
                    for (; r < piece->rank; r++) {                                                            \
                        const float tr = ti[r];                                                               \
                        const T *restrict column = bt + r * stride;                                           \
                        _Pragma("omp simd")                                                                   \
                        for (int64_t o = 0; o < width; o++) yi[o] += tr * LOAD(column[o]);                    \
                    }                                                                                         \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                 \
    }

DEFINE_LORA_ADD(f32, float, load_f32)
DEFINE_LORA_ADD(bf16, uint16_t, load_bf16)

static void lora_add_rows(const struct lora_batch *batch, int64_t index, const float *x, float *y, int64_t k,
                          int64_t n, float *t) {
    if (batch->bf16)
        lora_add_rows_bf16(batch, index, x, y, k, n, t);
    else
        lora_add_rows_f32(batch, index, x, y, k, n, t);
}

#endif
