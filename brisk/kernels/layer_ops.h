/*
 * The per-layer work between the matmuls: RMSNorm, residual add + RMSNorm, the gated MLP's
 * activation-and-multiply (SiLU, or GELU's tanh approximation).
 *
 * In a decode step of a small model each of these is a few thousand multiply-adds, so run as
 * separate torch ops their cost is the dispatch, not the math: residual add + RMSNorm was three
 * ops with two temporaries, SiLU-and-multiply two ops and a split. Computed in float32 whatever
 * the storage type; sums of squares in double.
 *
 * Layouts (row-major): x, residual, out [rows, dim]; gate_up [rows, 2 * inter] (gate, then up).
 * Activations are numbered as kernels/backend.py's ACTIVATIONS lists them (enum activation).
 * Each body is an orphaned `omp for` over rows (see matvec.h). Activations are XT, the norm's
 * weight WT.
 */
#ifndef BRISK_LAYER_OPS_H
#define BRISK_LAYER_OPS_H

#include <math.h>
#include <stdint.h>

#include "dtypes.h"

enum activation { ACT_SILU, ACT_GELU_TANH };

/* silu(a) = a * sigmoid(a); gelu_tanh(a) = a * (1 + tanh(u)) / 2 = a * sigmoid(2u) with
 * u = sqrt(2 / pi) * (a + 0.044715 a^3): one expf either way, which vectorizes where tanhf may
 * not. The exponent is clamped so no infinity appears (the kernels build with finite math). */
#define GELU_TANH_K 1.5957691216057308f /* 2 * sqrt(2 / pi) */
static inline float gated_silu(float a) { return a / (1.0f + expf(fminf(-a, 80.0f))); }
static inline float gated_gelu_tanh(float a) {
    return a / (1.0f + expf(fminf(-GELU_TANH_K * (a + 0.044715f * a * a * a), 80.0f)));
}

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
    /* out[r, i] = act(gate[r, i]) * up[r, i] */                                                          \
    static inline void act_mul_rows_##SUFFIX(const XT *restrict gate_up, XT *restrict out, int64_t rows,  \
                                             int64_t inter, int64_t activation) {                         \
        _Pragma("omp for")                                                                                \
        for (int64_t r = 0; r < rows; r++) {                                                              \
            const XT *g = gate_up + r * 2 * inter, *u = g + inter;                                        \
            if (activation == ACT_GELU_TANH) {                                                            \
                _Pragma("omp simd")                                                                       \
                for (int64_t i = 0; i < inter; i++)                                                       \
                    out[r * inter + i] = STORE_X(gated_gelu_tanh(LOAD_X(g[i])) * LOAD_X(u[i]));           \
            } else {                                                                                      \
                _Pragma("omp simd")                                                                       \
                for (int64_t i = 0; i < inter; i++)                                                       \
                    out[r * inter + i] = STORE_X(gated_silu(LOAD_X(g[i])) * LOAD_X(u[i]));                \
            }                                                                                             \
        }                                                                                                 \
    }

#endif
