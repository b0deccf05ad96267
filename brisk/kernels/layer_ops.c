/* The norms and activation of layer_ops.h as standalone kernels. Work is split across threads
 * only when a batch is big enough to repay waking them. */
#include <stdint.h>

#include "layer_ops.h"

#define PARALLEL_MIN_ELEMENTS (1 << 15)

#define DEFINE_LAYER_OP_KERNELS(SUFFIX, T, LOAD, STORE)                                                   \
    DEFINE_LAYER_OPS(SUFFIX, T, LOAD, STORE, T, LOAD)                                                     \
    void rms_norm_##SUFFIX(const T *x, const T *weight, T *out, int64_t rows, int64_t dim, float eps) {   \
        _Pragma("omp parallel if(rows * dim >= PARALLEL_MIN_ELEMENTS)")                                   \
        rms_norm_rows_##SUFFIX(x, weight, out, rows, dim, eps);                                           \
    }                                                                                                     \
    void add_rms_norm_##SUFFIX(T *x, T *residual, const T *weight, int64_t rows, int64_t dim, float eps) { \
        _Pragma("omp parallel if(rows * dim >= PARALLEL_MIN_ELEMENTS)")                                   \
        add_rms_norm_rows_##SUFFIX(x, residual, weight, rows, dim, eps);                                  \
    }                                                                                                     \
    void act_mul_##SUFFIX(const T *gate_up, T *out, int64_t rows, int64_t inter, int64_t activation) {    \
        _Pragma("omp parallel if(rows * inter >= PARALLEL_MIN_ELEMENTS)")                                 \
        act_mul_rows_##SUFFIX(gate_up, out, rows, inter, activation);                                     \
    }

DEFINE_LAYER_OP_KERNELS(f32, float, load_f32, store_f32)
DEFINE_LAYER_OP_KERNELS(bf16, uint16_t, load_bf16, store_bf16)
