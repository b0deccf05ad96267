/* Low-bit linear layers outside the fused decode step (prefill chunks, big batches, the LM head).
 * See quant.h for the formats. */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "lora.h"
#include "quant.h"
#include "quant_gemm.h"
#include "status.h"

#define MATVEC_MAX_ROWS 8 /* up to here each weight block is multiplied into every row in registers */

/* y [m, w->rows] = x [m, w->cols] @ w^T (+ bias), plus, with `lora`, the step's adapters' updates
 * of projection `index` on their rows (lora.h), in the same parallel region: one call and one
 * region a projection instead of two. Returns a kernel_status (status.h). With activations rounded
 * to int8, past QG_MIN_ROWS rows: the panel product (quant_gemm.h). Else past MATVEC_MAX_ROWS
 * each thread dequantizes into a float panel of its own. Each product ends on its worksharing
 * loop's barrier, so the adapters add to a finished y. */
int quant_linear(const struct weight *w, const float *x, float *y, int64_t m, const struct lora_batch *lora,
                 int64_t index) {
    float *t = lora ? scratch_floats(m * lora->max_rank) : NULL;
    if (lora && !t) return KERNEL_OUT_OF_MEMORY;
    int status = KERNEL_OK;
    if (w->quantize_activations && m > QG_MIN_ROWS) {
        struct qg_scratch scratch;
        status = qg_scratch_alloc(&scratch, m, w->cols, omp_get_max_threads());
        if (status == KERNEL_OK) {
            _Pragma("omp parallel")
            {
                qmatmul_a8(w, x, y, m, &scratch);
                if (lora) lora_add_rows(lora, index, x, y, w->cols, w->rows, t);
            }
            qg_scratch_free(&scratch);
        }
    } else if (m <= MATVEC_MAX_ROWS) {
        _Pragma("omp parallel")
        {
            qmatvec(w, x, y, m);
            if (lora) lora_add_rows(lora, index, x, y, w->cols, w->rows, t);
        }
    } else {
        const int64_t panel_floats = cache_lines_of_floats(QPANEL * w->cols);
        float *panels = scratch_floats(omp_get_max_threads() * panel_floats);
        if (panels == NULL) {
            status = KERNEL_OUT_OF_MEMORY;
        } else {
            _Pragma("omp parallel")
            {
                qmatmul(w, x, y, m, panels + omp_get_thread_num() * panel_floats);
                if (lora) lora_add_rows(lora, index, x, y, w->cols, w->rows, t);
            }
            free(panels);
        }
    }
    free(t);
    return status;
}

/* The int8 GEMM path of w8a8 (quant/modules.py: the torch code there is the reference), around
 * oneDNN's int8 x int8 -> int32 product. In torch each of these was a dozen passes over the
 * tensors, which together took longer than the product itself.
 *
 * quantize_rows_int8: columns of x [m, k] holding any |value| > threshold are outliers, marked in
 * outlier [k] (their codes are 0: they are multiplied in float); each row is rounded to int8 with
 * inverse scale 127 / its largest remaining magnitude (scale 1 for a row with none). */
void quantize_rows_int8(const float *x, int64_t m, int64_t k, float threshold, int8_t *codes, float *scales,
                           uint8_t *outlier) {
    for (int64_t j = 0; j < k; j++) outlier[j] = 0;
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < k; j++) outlier[j] |= fabsf(x[i * k + j]) > threshold;
    _Pragma("omp parallel for schedule(static)")
    for (int64_t i = 0; i < m; i++) {
        const float *row = x + i * k;
        float amax = 0.0f;
        for (int64_t j = 0; j < k; j++) amax = fmaxf(amax, outlier[j] ? 0.0f : fabsf(row[j]));
        float inverse = amax > 0.0f ? 127.0f / amax : 1.0f;
        scales[i] = amax > 0.0f ? amax / 127.0f : 1.0f;
        for (int64_t j = 0; j < k; j++) codes[i * k + j] = outlier[j] ? 0 : (int8_t)nearbyintf(row[j] * inverse);
    }
}

/* y [m, n] = acc [m, n] * row_scales[i] * col_scales[j] (+ bias[j]), in one pass. */
void scale_int32(const int32_t *acc, int64_t m, int64_t n, const float *row_scales, const float *col_scales,
                 const float *bias, float *y) {
    _Pragma("omp parallel for schedule(static)")
    for (int64_t i = 0; i < m; i++) {
        const float r = row_scales[i];
        for (int64_t j = 0; j < n; j++)
            y[i * n + j] = (float)acc[i * n + j] * r * col_scales[j] + (bias != NULL ? bias[j] : 0.0f);
    }
}
