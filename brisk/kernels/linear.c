/*
 * y = x @ w^T (+ bias) for a handful of rows x (decode steps), on CPUs.
 *
 * With few rows, a linear layer is a stream over its weight matrix: each weight is used for
 * only `m` multiply-adds, so the time is the time to read w once. BLAS matrix-vector paths
 * reached ~13 GB/s on our 2-core AMD machines; splitting w's rows across threads and reading
 * each row once, with the m dot products done while it is in L1, reaches ~26 GB/s.
 * Above ~10 rows BLAS's blocked GEMM wins again; the Python side picks. Sums are kept in double:
 * free in a memory-bound loop, and it keeps results within fp32 rounding of the exact product.
 *
 * Layouts (row-major): x [m, k], w [n, k], bias [n] or NULL, y [m, n].
 */
#include <stdint.h>

#include "dtypes.h"

#define DEFINE_LINEAR_ROWS(NAME, T, LOAD, STORE)                                                        \
    void NAME(const T *restrict x, const T *restrict w, const T *restrict bias, T *restrict y,           \
              int64_t m, int64_t n, int64_t k) {                                                          \
        _Pragma("omp parallel for schedule(static)")                                                      \
        for (int64_t j = 0; j < n; j++) {                                                                 \
            const T *row = w + j * k;                                                                     \
            const double b = bias ? LOAD(bias[j]) : 0.0;                                                  \
            for (int64_t i = 0; i < m; i++) {                                                             \
                const T *xi = x + i * k;                                                                  \
                double acc = 0.0;                                                                         \
                _Pragma("omp simd reduction(+:acc)")                                                      \
                for (int64_t t = 0; t < k; t++) acc += (double)LOAD(xi[t]) * LOAD(row[t]);                \
                y[i * n + j] = STORE((float)(acc + b));                                                   \
            }                                                                                             \
        }                                                                                                 \
    }

DEFINE_LINEAR_ROWS(linear_rows_f32, float, load_f32, store_f32)
DEFINE_LINEAR_ROWS(linear_rows_bf16, uint16_t, load_bf16, store_bf16)
