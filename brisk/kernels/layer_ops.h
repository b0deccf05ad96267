/*
 * The per-layer work between the matmuls: RMSNorm, residual add + RMSNorm, SiLU-and-multiply.
 *
 * In a decode step of a small model each of these is a few thousand multiply-adds, so run as
 * separate torch ops their cost is the dispatch, not the math: residual add + RMSNorm was three
 * ops with two temporaries, SiLU-and-multiply two ops and a split. Computed in float32 whatever
 * the storage type; sums of squares in double.
 *
 * Layouts (row-major): x, residual, out [rows, dim]; gate_up [rows, 2 * inter] (gate, then up).
 * Each body is an orphaned `omp for` over rows (see matvec.h). Activations are XT, the norm's
 * weight WT.
 */
#ifndef BRISK_LAYER_OPS_H
#define BRISK_LAYER_OPS_H

#include <math.h>
#include <stdint.h>

#include "dtypes.h"

#define DEFINE_LAYER_OPS(SUFFIX, XT, LOAD_X, STORE_X, WT, LOAD_W)                                         \
    static inline void normalize_##SUFFIX(const XT *x, const WT *restrict weight, XT *out, int64_t dim,   \
                                          float eps) {                                                    \
        double squares = 0.0;                                                                             \
        _Pragma("omp simd reduction(+:squares)")                                                          \
        for (int64_t i = 0; i < dim; i++) squares += (double)LOAD_X(x[i]) * LOAD_X(x[i]);                 \
        const float scale = 1.0f / sqrtf((float)(squares / dim) + eps);                                   \
        _Pragma("omp simd")                                                                               \
        for (int64_t i = 0; i < dim; i++) out[i] = STORE_X(LOAD_X(x[i]) * scale * LOAD_W(weight[i]));     \
    }                                                                                                     \
                                                                                                          \
    /* out = rms_norm(x) * weight; out may be x. */                                                       \
    static inline void rms_norm_rows_##SUFFIX(const XT *x, const WT *restrict weight, XT *out, int64_t rows, \
                                              int64_t dim, float eps) {                                   \
        _Pragma("omp for")                                                                                \
        for (int64_t r = 0; r < rows; r++) normalize_##SUFFIX(x + r * dim, weight, out + r * dim, dim, eps); \
    }                                                                                                     \
                                                                                                          \
    /* residual += x, then x = rms_norm(residual) * weight: the layer's two outputs, in place. */         \
    static inline void add_rms_norm_rows_##SUFFIX(XT *restrict x, XT *restrict residual,                  \
                                                  const WT *restrict weight,                              \
                                                  int64_t rows, int64_t dim, float eps) {                 \
        _Pragma("omp for")                                                                                \
        for (int64_t r = 0; r < rows; r++) {                                                              \
            XT *xr = x + r * dim, *rr = residual + r * dim;                                               \
            _Pragma("omp simd")                                                                           \
            for (int64_t i = 0; i < dim; i++) rr[i] = STORE_X(LOAD_X(rr[i]) + LOAD_X(xr[i]));             \
            normalize_##SUFFIX(rr, weight, xr, dim, eps);                                                 \
        }                                                                                                 \
    }                                                                                                     \
                                                                                                          \
    /* out[r, i] = silu(gate[r, i]) * up[r, i] */                                                         \
    static inline void silu_mul_rows_##SUFFIX(const XT *restrict gate_up, XT *restrict out, int64_t rows, \
                                              int64_t inter) {                                            \
        _Pragma("omp for")                                                                                \
        for (int64_t r = 0; r < rows; r++) {                                                              \
            const XT *g = gate_up + r * 2 * inter, *u = g + inter;                                        \
            _Pragma("omp simd")                                                                           \
            for (int64_t i = 0; i < inter; i++) {                                                         \
                const float a = LOAD_X(g[i]);                                                             \
                out[r * inter + i] = STORE_X(a / (1.0f + expf(-a)) * LOAD_X(u[i]));                       \
            }                                                                                             \
        }                                                                                                 \
    }

#endif
