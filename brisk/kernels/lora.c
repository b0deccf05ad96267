/* lora_add: the adapters' updates of one projection, in a parallel region of its own around
 * lora.h's loops: after a dense projection of the layer-by-layer path (prefill chunks, batches
 * past the fused decode step; a quantized projection adds them in its own call, quant_linear.c).
 * y [m, n] += the update of projection `index` (layer * LORA_PROJECTIONS + which) for x [m, k]. */
#include <stdint.h>

#include "lora.h"
#include "status.h"

/* Whether bfloat16 adapters' operands are multiplied as bfloat16 in this build (lora.h) */
const int lora_bf16_products = LORA_BF16_PRODUCTS;

int lora_add(const struct lora_batch *batch, int64_t index, const float *x, float *y, int64_t m, int64_t k,
             int64_t n) {
    float *t = scratch_floats(m * batch->max_rank);
    if (!t) return KERNEL_OUT_OF_MEMORY;
#pragma omp parallel
    lora_add_rows(batch, index, x, y, k, n, t);
    free(t);
    return KERNEL_OK;
}
