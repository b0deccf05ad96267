/*
 * The weight-streaming product of a decode step: y = x @ w^T (+ bias) for a handful of rows x.
 *
 * With few rows a linear layer is a stream over its weight matrix: each weight is used for only
 * `m` multiply-adds, so the time is the time to read w once. BLAS matrix-vector paths reached
 * ~13 GB/s on our 2-core AMD machines; splitting w's rows across threads and reading each row
 * once, with the m dot products done while it is in L1, reaches ~26 GB/s. Above ~10 rows BLAS's
 * blocked GEMM wins again; the Python side picks.
 *
 * Layouts (row-major): x [m, k], w [n, k], bias [n] or NULL, y [m, n].
 *
 * The body is an orphaned `omp for`: called inside a parallel region its rows are shared by the
 * region's threads (decode_layers.c runs a whole step in one region); called outside, it runs on
 * the caller's thread. Activations (XT) and weights (WT) may differ in type: the fused step keeps
 * activations in float32 whatever the weights are stored in.
 */
#ifndef BRISK_MATVEC_H
#define BRISK_MATVEC_H

#include <stdint.h>

#include "dtypes.h"

/* Dot products of ROWS activation rows with one weight row, loaded once for all of them. Sums are
 * float32 vector lanes: their error relative to sum |x * w| is ~5e-8 for rows of 576 to 14k terms,
 * as BLAS's sgemv, and the loop stays memory-bound up to 8 rows (double sums were compute-bound
 * from 2). */
#define DEFINE_MATVEC_BLOCK(NAME, XT, LOAD_X, WT, LOAD_W, ROWS)                                           \
    static inline void NAME(const XT *restrict x, const WT *restrict row, int64_t k,                      \
                            float *restrict sums) {                                                       \
        float acc[ROWS] = {0};                                                                            \
        _Pragma("omp simd reduction(+:acc)")                                                              \
        for (int64_t t = 0; t < k; t++) {                                                                 \
            const float wt = LOAD_W(row[t]);                                                              \
            for (int64_t i = 0; i < ROWS; i++) acc[i] += LOAD_X(x[i * k + t]) * wt;                       \
        }                                                                                                 \
        for (int64_t i = 0; i < ROWS; i++) sums[i] = acc[i];                                              \
    }

#define DEFINE_MATVEC(NAME, XT, LOAD_X, STORE_X, WT, LOAD_W)                                              \
    DEFINE_MATVEC_BLOCK(NAME##_8, XT, LOAD_X, WT, LOAD_W, 8)                                               \
    DEFINE_MATVEC_BLOCK(NAME##_7, XT, LOAD_X, WT, LOAD_W, 7)                                               \
    DEFINE_MATVEC_BLOCK(NAME##_6, XT, LOAD_X, WT, LOAD_W, 6)                                               \
    DEFINE_MATVEC_BLOCK(NAME##_5, XT, LOAD_X, WT, LOAD_W, 5)                                               \
    DEFINE_MATVEC_BLOCK(NAME##_4, XT, LOAD_X, WT, LOAD_W, 4)                                               \
    DEFINE_MATVEC_BLOCK(NAME##_3, XT, LOAD_X, WT, LOAD_W, 3)                                               \
    DEFINE_MATVEC_BLOCK(NAME##_2, XT, LOAD_X, WT, LOAD_W, 2)                                               \
    DEFINE_MATVEC_BLOCK(NAME##_1, XT, LOAD_X, WT, LOAD_W, 1)                                               \
    static inline void NAME(const XT *restrict x, const WT *restrict w, const WT *restrict bias,          \
                            XT *restrict y, int64_t m, int64_t n, int64_t k) {                            \
        _Pragma("omp for schedule(static)")                                                               \
        for (int64_t j = 0; j < n; j++) {                                                                 \
            const WT *row = w + j * k;                                                                    \
            const float b = bias ? LOAD_W(bias[j]) : 0.0f;                                                \
            float sums[8];                                                                                \
            for (int64_t i0 = 0; i0 < m;) {                                                               \
                const int64_t rows = m - i0 >= 8 ? 8 : m - i0;                                            \
                const XT *xi = x + i0 * k;                                                                \
                switch (rows) {                                                                           \
                    case 8: NAME##_8(xi, row, k, sums); break;                                            \
                    case 7: NAME##_7(xi, row, k, sums); break;                                            \
                    case 6: NAME##_6(xi, row, k, sums); break;                                            \
                    case 5: NAME##_5(xi, row, k, sums); break;                                            \
                    case 4: NAME##_4(xi, row, k, sums); break;                                            \
                    case 3: NAME##_3(xi, row, k, sums); break;                                            \
                    case 2: NAME##_2(xi, row, k, sums); break;                                            \
                    default: NAME##_1(xi, row, k, sums);                                                  \
                }                                                                                         \
                for (int64_t i = 0; i < rows; i++) y[(i0 + i) * n + j] = STORE_X(sums[i] + b);            \
                i0 += rows;                                                                               \
            }                                                                                             \
        }                                                                                                 \
    }

#endif
