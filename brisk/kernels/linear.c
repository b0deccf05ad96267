/* linear_rows: y = x @ w^T (+ bias) for a few rows, one parallel region around matvec.h's loop. */
#include <stdint.h>

#include "matvec.h"

#define DEFINE_LINEAR_ROWS(SUFFIX, T, LOAD, STORE)                                                        \
    DEFINE_MATVEC(matvec_##SUFFIX, T, LOAD, STORE, T, LOAD)                                               \
    void linear_rows_##SUFFIX(const T *x, const T *w, const T *bias, T *y, int64_t m, int64_t n,          \
                              int64_t k) {                                                                \
        _Pragma("omp parallel")                                                                           \
        matvec_##SUFFIX(x, w, bias, y, m, n, k);                                                          \
    }

DEFINE_LINEAR_ROWS(f32, float, load_f32, store_f32)
DEFINE_LINEAR_ROWS(bf16, uint16_t, load_bf16, store_bf16)
