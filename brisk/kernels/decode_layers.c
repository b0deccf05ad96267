/*
 * Every transformer layer of a decode step in one call, for small batches on CPUs.
 *
 * At batch 1 a decode step of a small model is ~30 layers x 9 operations, each a few microseconds
 * of work; run as separate calls from Python, the calls cost more than the work (~160 us of
 * Python per layer, measured). Here one parallel region runs the whole step: the threads stay
 * up from the first layer to the last and meet at a barrier (the end of each `omp for`) between
 * operations, which costs about a microsecond. Per layer:
 *
 *     residual += x; x = rms_norm(residual)       (the first layer starts from residual = 0)
 *     qkv = x @ Wqkv^T (+ bias)                   weight stream
 *     q = rope(q); cache <- rope(k), v            attention.h
 *     a = attention(q, cache)                     attention.h (within the layer's window, if any)
 *     x = a @ Wo^T                                weight stream
 *     (x = rms_norm(x))                           Gemma's sandwich norm
 *     residual += x; x = rms_norm(residual)
 *     gu = x @ Wgate_up^T                         weight stream
 *     h = act(gate) * up                          SiLU or GELU (tanh)
 *     x = h @ Wdown^T                             weight stream
 *     (x = rms_norm(x))                           Gemma's sandwich norm
 *
 * and last the final norm. With LoRA adapters in the step (decode_batch.lora), each projection's
 * product is followed by the adapters' updates of their own rows (lora.h): its shrink reads the
 * projection's input and its expand adds to the output, each after the barrier that ends the
 * `omp for` before it (no loop here has `nowait`). The operations are
 * the same bodies the standalone kernels run, so the fused step and the layer-by-layer path
 * compute the same thing. Activations are float32
 * scratch; dense weights and norms are in the model's dtype (T), the KV cache in any of dtypes.h's
 * kinds (decode_layers_<model dtype>_<cache kind>). Each projection goes through
 * `project`, which dispatches on the weight's format: dense in the model's dtype (matvec.h) or
 * one of the low-bit formats (quant.h).
 *
 * With `timings` non-NULL, the master thread adds the wall time of each phase (barrier waits
 * included) to timings[PHASE_*] in nanoseconds: how `brisk bench step` splits the step.
 */
#define _POSIX_C_SOURCE 199309L
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#include "attention.h"
#include "layer_ops.h"
#include "lora.h"
#include "matvec.h"
#include "quant.h"
#include "quant_gemm.h"
#include "status.h"

enum phase { PHASE_MATMUL, PHASE_ATTENTION, PHASE_OTHER };

struct decode_layer {
    const void *input_norm, *post_attention_norm;
    const void *q_norm, *k_norm; /* per-head norms (Qwen3, Gemma 3), or NULL */
    const void *attention_output_norm, *mlp_output_norm; /* Gemma's sandwich norms, or NULL */
    struct weight qkv, o, gate_up, down;
    const float *cos_table, *sin_table; /* [max_len, HEAD_DIM], see attention.h: the layer's RoPE */
    int64_t window;                     /* sliding-window attention's positions, 0 for all */
    int64_t group;                      /* whose slots and tables it reads (struct decode_batch) */
    void *k_cache, *v_cache;   /* layouts in attention.h */
    float *k_scales, *v_scales; /* a scaled cache kind's per token-head scales, else NULL */
};

struct decode_model {
    int64_t num_layers, hidden, num_heads, num_kv_heads, intermediate;
    float eps, scale;
    int64_t activation; /* enum activation, layer_ops.h */
    const void *final_norm;
    const struct decode_layer *layers;
};

/* A group of layers' block ids (engine/kv_cache.py: layers with sliding windows keep their K/V
 * in groups, each with its own block tables; most models have one group). */
struct decode_tables {
    const int64_t *slot_blocks;  /* [num_seqs]: the block receiving each sequence's new K/V */
    const int64_t *block_tables; /* [num_seqs, max_blocks] */
};

struct decode_batch {
    int64_t num_seqs, max_blocks;
    const int64_t *positions, *slot_offsets; /* [num_seqs] */
    const int64_t *context_lens;             /* [num_seqs], this step's token included */
    const int64_t *ancestor_masks;           /* [num_seqs] or NULL, see attention.h */
    const struct decode_tables *groups;      /* indexed by decode_layer.group */
    const struct lora_batch *lora;           /* the rows' adapters, or NULL */
};

static inline int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

#define LAP(phase)                                                                                        \
    do {                                                                                                  \
        if (timings && omp_get_thread_num() == 0) {                                                       \
            const int64_t t = now_ns();                                                                   \
            timings[phase] += t - mark;                                                                   \
            mark = t;                                                                                     \
        }                                                                                                 \
    } while (0)

/* Whether any projection rounds its activations to int8: only then does a step past QG_MIN_ROWS
 * sequences take the batched product's scratch. */
static int rounds_activations(const struct decode_model *model) {
    for (int64_t l = 0; l < model->num_layers; l++) {
        const struct decode_layer *layer = model->layers + l;
        if (layer->qkv.quantize_activations || layer->o.quantize_activations || layer->gate_up.quantize_activations
            || layer->down.quantize_activations)
            return 1;
    }
    return 0;
}

/* What depends on the model's dtype only: the dense product and the norms. */
#define DEFINE_MODEL_OPS(WS, T, LOAD)                                                                     \
    DEFINE_MATVEC(matvec_##WS, float, load_f32, store_f32, T, LOAD)                                       \
    DEFINE_LAYER_OPS(WS, float, load_f32, store_f32, T, LOAD)                                             \
                                                                                                          \
    /* y [m, w->rows] = x [m, w->cols] @ w^T (+ bias), plus the adapters' updates of projection         \
     * `index` where the step has adapters; a8: the batched product's scratch, t: the adapters' */         \
    static void project_##WS(const struct weight *w, const float *x, float *y, int64_t m,                 \
                             const struct qg_scratch *a8, const struct lora_batch *lora, int64_t index,   \
                             float *t) {                                                                  \
        if (w->format == WEIGHT_DENSE)                                                                    \
            matvec_##WS(x, (const T *)w->data, (const T *)w->bias, y, m, w->rows, w->cols);               \
        else if (w->quantize_activations && m > QG_MIN_ROWS)                                              \
            qmatmul_a8(w, x, y, m, a8);                                                                   \
        else                                                                                              \
            qmatvec(w, x, y, m);                                                                          \
        if (lora) {                                                                                       \
            lora_add_rows(lora, index, x, y, w->cols, w->rows, t);                                        \
            _Pragma("omp barrier") /* the next op reads every row of y */                                 \
        }                                                                                                 \
    }

#define DEFINE_DECODE_LAYERS(WS, T, LOAD, CS, CT, LOAD_C, STORE_HEAD, SCALED)                             \
    DEFINE_DECODE_ATTENTION(WS##_##CS, float, load_f32, store_f32, CS, CT, SCALED)                        \
    DEFINE_ROPE_WRITE_KV(WS##_##CS, float, load_f32, store_f32, T, LOAD, CT, STORE_HEAD, SCALED)          \
                                                                                                          \
    /* x [num_seqs, hidden]: this step's embeddings in, the final norm's output out. Returns a          \
     * kernel_status (status.h): out of memory, it runs nothing. */                                       \
    int decode_layers_##WS##_##CS(const struct decode_model *model, const struct decode_batch *batch,     \
                                  float *x, int64_t *timings) {                                           \
        const int64_t m = batch->num_seqs, hidden = model->hidden, inter = model->intermediate;           \
        const int64_t q_size = model->num_heads * HEAD_DIM;                                               \
        const int64_t qkv_size = q_size + 2 * model->num_kv_heads * HEAD_DIM;                             \
        const float eps = model->eps;                                                                     \
        const int64_t threads = omp_get_max_threads();                                                    \
        const int64_t parts = decode_attention_parts(batch->max_blocks); \
        float *residual = calloc(m * hidden, sizeof(float));                                              \
        float *qkv = malloc(sizeof(float) * m * qkv_size), *q = malloc(sizeof(float) * m * q_size);       \
        float *attended = malloc(sizeof(float) * m * q_size);                                             \
        float *gate_up = malloc(sizeof(float) * m * 2 * inter), *act = malloc(sizeof(float) * m * inter); \
        float *scratch = scratch_floats(decode_attention_scratch(m, model->num_heads, model->num_kv_heads, \
                                                                 batch->max_blocks, parts, threads));     \
        struct qg_scratch a8 = {0};                                                                       \
        const struct lora_batch *lora = batch->lora;                                                      \
        float *lora_t = lora ? scratch_floats(m * lora->max_rank) : NULL;                                 \
        const int64_t widest = hidden > inter ? (hidden > q_size ? hidden : q_size) : (inter > q_size ? inter : q_size); \
        const int status = residual && qkv && q && attended && gate_up && act && scratch && (!lora || lora_t) \
                               && (m <= QG_MIN_ROWS || !rounds_activations(model)                 \
                                   || qg_scratch_alloc(&a8, m, widest, threads) == KERNEL_OK)             \
                               ? KERNEL_OK : KERNEL_OUT_OF_MEMORY;                                        \
        if (status == KERNEL_OK)                                                                          \
        _Pragma("omp parallel")                                                                           \
        {                                                                                                 \
            int64_t mark = timings ? now_ns() : 0;                                                        \
            for (int64_t l = 0; l < model->num_layers; l++) {                                             \
                const struct decode_layer *layer = model->layers + l;                                     \
                add_rms_norm_rows_##WS(x, residual, layer->input_norm, m, hidden, eps);               \
                LAP(PHASE_OTHER);                                                                         \
                project_##WS(&layer->qkv, x, qkv, m, &a8,                                                     \
                             lora, l * LORA_PROJECTIONS + LORA_QKV, lora_t);                                  \
                LAP(PHASE_MATMUL);                                                                        \
                const struct decode_tables *tables = batch->groups + layer->group;                        \
                rope_tokens_##WS##_##CS(qkv, batch->positions, layer->cos_table, layer->sin_table, q,        \
                                     layer->k_cache, layer->v_cache, layer->k_scales, layer->v_scales,    \
                                     tables->slot_blocks,                                                 \
                                     batch->slot_offsets,                                                 \
                                     layer->q_norm, layer->k_norm, eps, m, model->num_heads,              \
                                     model->num_kv_heads);                                                \
                LAP(PHASE_OTHER);                                                                         \
                decode_attention_##WS##_##CS(q, layer->k_cache, layer->v_cache, layer->k_scales,   \
                                          layer->v_scales, tables->block_tables,                          \
                                          batch->context_lens, batch->ancestor_masks, batch->positions,  \
                                          attended, m, model->num_heads, model->num_kv_heads,             \
                                          batch->max_blocks, layer->window, model->scale, parts, scratch); \
                LAP(PHASE_ATTENTION);                                                                     \
                project_##WS(&layer->o, attended, x, m, &a8,                                                  \
                             lora, l * LORA_PROJECTIONS + LORA_O, lora_t);                                    \
                LAP(PHASE_MATMUL);                                                                        \
                if (layer->attention_output_norm)                                                         \
                    rms_norm_rows_##WS(x, layer->attention_output_norm, x, m, hidden, eps);              \
                add_rms_norm_rows_##WS(x, residual, layer->post_attention_norm, m, hidden, eps);      \
                LAP(PHASE_OTHER);                                                                         \
                project_##WS(&layer->gate_up, x, gate_up, m, &a8,                                             \
                             lora, l * LORA_PROJECTIONS + LORA_GATE_UP, lora_t);                              \
                LAP(PHASE_MATMUL);                                                                        \
                act_mul_rows_##WS(gate_up, act, m, inter, model->activation);                          \
                LAP(PHASE_OTHER);                                                                         \
                project_##WS(&layer->down, act, x, m, &a8,                                                    \
                             lora, l * LORA_PROJECTIONS + LORA_DOWN, lora_t);                                 \
                LAP(PHASE_MATMUL);                                                                        \
                if (layer->mlp_output_norm) {                                                             \
                    rms_norm_rows_##WS(x, layer->mlp_output_norm, x, m, hidden, eps);                    \
                    LAP(PHASE_OTHER);                                                                     \
                }                                                                                         \
            }                                                                                             \
            add_rms_norm_rows_##WS(x, residual, model->final_norm, m, hidden, eps);                   \
            LAP(PHASE_OTHER);                                                                             \
        }                                                                                                 \
        free(residual);                                                                                   \
        free(qkv);                                                                                        \
        free(q);                                                                                          \
        free(attended);                                                                                   \
        free(gate_up);                                                                                    \
        free(act);                                                                                        \
        free(scratch);                                                                                    \
        free(lora_t);                                                                                     \
        qg_scratch_free(&a8);                                                                             \
        return status;                                                                                    \
    }

DEFINE_MODEL_OPS(f32, float, load_f32)
DEFINE_MODEL_OPS(bf16, uint16_t, load_bf16)
FOR_EACH_KV_KIND(DEFINE_DECODE_LAYERS, f32, float, load_f32)
FOR_EACH_KV_KIND(DEFINE_DECODE_LAYERS, bf16, uint16_t, load_bf16)
