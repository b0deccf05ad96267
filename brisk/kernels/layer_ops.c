/*
 * The per-layer work between the matmuls, fused, for CPUs.
 *
 * In a decode step of a small model each of these is a few thousand multiply-adds, so the cost
 * of running them as separate torch ops is the dispatch, not the math: residual add + RMSNorm
 * was three ops with two temporaries, SiLU-and-multiply two ops and a split. One call each, in
 * place where the caller allows, leaves no temporaries. Work is split across threads only when
 * a batch is big enough to repay waking them. Computed in float32 whatever the storage type;
 * sums of squares in double, as torch's rms_norm accumulates in float32 but over few terms.
 *
 * Layouts (row-major): x, residual, out [rows, dim]; gate_up [rows, 2 * inter] (gate, then up).
 */
#include <math.h>
#include <stdint.h>

#include "dtypes.h"

#define PARALLEL_MIN_ELEMENTS (1 << 15)

#define DEFINE_NORM_OPS(SUFFIX, T, LOAD, STORE)                                                           \
    static void normalize_##SUFFIX(const T *x, const T *restrict weight, T *out, int64_t dim,           \
                                   float eps) {                                                          \
        double squares = 0.0;                                                                             \
        _Pragma("omp simd reduction(+:squares)")                                                          \
        for (int64_t i = 0; i < dim; i++) squares += (double)LOAD(x[i]) * LOAD(x[i]);                     \
        const float scale = 1.0f / sqrtf((float)(squares / dim) + eps);                                   \
        _Pragma("omp simd")                                                                               \
        for (int64_t i = 0; i < dim; i++) out[i] = STORE(LOAD(x[i]) * scale * LOAD(weight[i]));          \
    }                                                                                                     \
                                                                                                          \
    /* out = rms_norm(x) * weight; out may be x. */                                                     \
    void rms_norm_##SUFFIX(const T *x, const T *restrict weight, T *out, int64_t rows, int64_t dim,     \
                           float eps) {                                                                  \
        _Pragma("omp parallel for if(rows * dim >= PARALLEL_MIN_ELEMENTS)")                               \
        for (int64_t r = 0; r < rows; r++) normalize_##SUFFIX(x + r * dim, weight, out + r * dim, dim, eps); \
    }                                                                                                     \
                                                                                                          \
    /* residual += x, then x = rms_norm(residual) * weight: the layer's two outputs, in place. */         \
    void add_rms_norm_##SUFFIX(T *restrict x, T *restrict residual, const T *restrict weight, int64_t rows, \
                               int64_t dim, float eps) {                                                 \
        _Pragma("omp parallel for if(rows * dim >= PARALLEL_MIN_ELEMENTS)")                               \
        for (int64_t r = 0; r < rows; r++) {                                                              \
            T *xr = x + r * dim, *rr = residual + r * dim;                                                \
            _Pragma("omp simd")                                                                           \
            for (int64_t i = 0; i < dim; i++) rr[i] = STORE(LOAD(rr[i]) + LOAD(xr[i]));                   \
            normalize_##SUFFIX(rr, weight, xr, dim, eps);                                                 \
        }                                                                                                 \
    }                                                                                                     \
                                                                                                          \
    /* out[r, i] = silu(gate[r, i]) * up[r, i] */                                                        \
    void silu_mul_##SUFFIX(const T *restrict gate_up, T *restrict out, int64_t rows, int64_t inter) {   \
        _Pragma("omp parallel for if(rows * inter >= PARALLEL_MIN_ELEMENTS)")                             \
        for (int64_t r = 0; r < rows; r++) {                                                              \
            const T *g = gate_up + r * 2 * inter, *u = g + inter;                                         \
            _Pragma("omp simd")                                                                           \
            for (int64_t i = 0; i < inter; i++) {                                                         \
                const float a = LOAD(g[i]);                                                               \
                out[r * inter + i] = STORE(a / (1.0f + expf(-a)) * LOAD(u[i]));                           \
            }                                                                                             \
        }                                                                                                 \
    }

DEFINE_NORM_OPS(f32, float, load_f32, store_f32)
DEFINE_NORM_OPS(bf16, uint16_t, load_bf16, store_bf16)
