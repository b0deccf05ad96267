/*
 * LoRA adapters' updates over a batch of rows of several adapters (kernels/lora.py):
 *
 *     t[i] = A x[i]             shrink: each row of A read once per adapter, dotted with its rows
 *     y[i] += B t[i]            expand: each row of B read once per adapter, for its rows
 *
 * for every row i of each adapter's segment (rows[starts[a] .. starts[a + 1]]); rows of the base
 * model are in no segment and left alone. A fused projection's update has one A (its modules'
 * stacked, R rows) and one B per module (a piece: the rows of y it adds to, its columns of t).
 * Adapters are float32 or bfloat16 (the batch says which), activations float32.
 *
 * Both halves are orphaned `omp for` loops over the adapters' ranks and the projection's output
 * rows: inside decode_layers.c's parallel region the region's threads share them, and lora.c's
 * lora_add opens a region of its own. Scratch t: [rows of the step, max_rank] floats.
 */
#ifndef BRISK_LORA_H
#define BRISK_LORA_H

#include <stdint.h>

#include "dtypes.h"

enum lora_target { LORA_QKV, LORA_O, LORA_GATE_UP, LORA_DOWN, LORA_PROJECTIONS };

struct lora_piece {
    int64_t first_row, rows;   /* the rows of y it adds to */
    int64_t first_rank, rank;  /* its columns of t */
    const void *b;             /* [rows, rank] */
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
    const struct lora_projection **adapters; /* each: [num_layers * LORA_PROJECTIONS] */
};

#define DEFINE_LORA_ADD(SUFFIX, T, LOAD)                                                                  \
    /* y [m, n] += the update of projection `index` (layer * LORA_PROJECTIONS + which) for x [m, k] */ \
    static void lora_add_rows_##SUFFIX(const struct lora_batch *batch, int64_t index, const float *x,     \
                                       float *y, int64_t k, int64_t n, float *t) {                        \
        const int64_t R = batch->max_rank;                                                                \
        _Pragma("omp for schedule(static)")                                                               \
        for (int64_t aj = 0; aj < batch->num_adapters * R; aj++) {                                        \
            const int64_t a = aj / R, j = aj % R;                                                         \
            const struct lora_projection *p = batch->adapters[a] + index;                                 \
            if (j >= p->rank) continue;                                                                   \
            const T *restrict row = (const T *)p->a + j * k;                                              \
            for (int64_t s = batch->starts[a]; s < batch->starts[a + 1]; s++) {                           \
                const int64_t i = batch->rows[s];                                                         \
                const float *restrict xi = x + i * k;                                                     \
                float acc = 0.0f;                                                                         \
                _Pragma("omp simd reduction(+:acc)")                                                      \
                for (int64_t c = 0; c < k; c++) acc += LOAD(row[c]) * xi[c];                              \
                t[i * R + j] = acc;                                                                       \
            }                                                                                             \
        }                                                                                                 \
        _Pragma("omp for schedule(static)")                                                               \
        for (int64_t o = 0; o < n; o++) {                                                                 \
            for (int64_t a = 0; a < batch->num_adapters; a++) {                                           \
                const struct lora_projection *p = batch->adapters[a] + index;                             \
                for (int64_t q = 0; q < p->num_pieces; q++) {                                             \
                    const struct lora_piece *piece = p->pieces + q;                                       \
                    if (o < piece->first_row || o >= piece->first_row + piece->rows) continue;            \
                    const T *restrict b = (const T *)piece->b + (o - piece->first_row) * piece->rank;     \
                    for (int64_t s = batch->starts[a]; s < batch->starts[a + 1]; s++) {                   \
                        const int64_t i = batch->rows[s];                                                 \
                        const float *restrict ti = t + i * R + piece->first_rank;                         \
                        float acc = 0.0f;                                                                 \
                        for (int64_t r = 0; r < piece->rank; r++) acc += LOAD(b[r]) * ti[r];              \
                        y[i * n + o] += acc;                                                              \
                    }                                                                                     \
                }                                                                                         \
            }                                                                                             \
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
