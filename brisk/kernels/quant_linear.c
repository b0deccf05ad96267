/* Low-bit linear layers outside the fused decode step (prefill chunks, big batches, the LM head).
 * See quant.h for the formats. */
#include <stdint.h>
#include <stdlib.h>

#include "quant.h"

#define MATVEC_MAX_ROWS 8 /* up to here each weight block is multiplied into every row in registers */

/* y [m, w->rows] = x [m, w->cols] @ w^T (+ bias), float32 activations. */
void quant_linear(const struct weight *w, const float *x, float *y, int64_t m) {
    if (m <= MATVEC_MAX_ROWS) {
        _Pragma("omp parallel")
        qmatvec(w, x, y, m);
        return;
    }
    _Pragma("omp parallel")
    {
        float *panel = malloc(sizeof(float) * QPANEL * w->cols);
        if (panel == NULL) abort();
        qmatmul(w, x, y, m, panel);
        free(panel);
    }
}
