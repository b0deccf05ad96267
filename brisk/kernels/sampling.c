/*
 * Next-token sampling for a batch of logits rows, each with its own parameters, on CPUs.
 *
 * torch's formulation sorts the whole vocabulary for top-k/top-p (72 ms for 32 rows x 49,152
 * on our 2-core machines) and draws one exponential per vocabulary entry (40 ms); this kernel
 * needs one uniform per row and a few linear passes over it. It implements exactly the rule of
 * brisk/sample/sampler.py (kernels/backend.py's torch `KernelBackend.sample_rows` is its reference in
 * the tests):
 *
 *   w_i  = exp((z_i - max z) / T)                weights, the best token's is 1; -inf/NaN -> 0
 *   min_p:  w_i < min_p            -> 0
 *   top_k:  w_i < (k-th largest w) -> 0           ties with the k-th are kept
 *   top_p:  w_i < w_(c)            -> 0           c: fewest best tokens with mass >= p * sum(w)
 *   token = smallest id i with  sum_{j <= i} w_j > u * sum(w)      (inverse CDF in id order)
 *
 * Neither edge needs a sort of the vocabulary. The k-th largest weight comes from a size-k heap
 * swept over the row (after the first few hundred tokens almost nothing beats its root, so the
 * sweep is a compare per token). The nucleus edge comes from a selection that keeps only the
 * side of each pivot where the running mass crosses p, linear on average: a peaked row's
 * nucleus is a handful of tokens, but a flat one (text at T >= 0.7 that has lost its thread)
 * holds tens of thousands, which a sort would order in full for every row at every step (64
 * flat rows of 49,152 on our 2-core machines: 126-160 ms a step sorted, 19 ms selected).
 * Only tokens with weight >= 2^-10 are candidates when they hold the mass; lower floors are
 * tried when they do not. Temperature 0 rows take the argmax (the first best id).
 * Sums are in double. NaN and infinities are recognised by their bits: the kernels are built
 * with -ffast-math, under which isinf/isnan may fold to false.
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "status.h"

static inline int is_finite(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return (u & 0x7F800000u) != 0x7F800000u;
}

static int descending(const void *a, const void *b) {
    const float x = *(const float *)a, y = *(const float *)b;
    return (x < y) - (x > y);
}

static int64_t argmax(const float *z, int64_t n) {
    int64_t best = 0;
    float top = z[0];
    for (int64_t i = 1; i < n; i++)
        if (z[i] > top) {
            top = z[i];
            best = i;
        }
    return best;
}

static double sum(const float *w, int64_t n) {
    double total = 0.0;
#pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < n; i++) total += w[i];
    return total;
}

/* w = exp((z - top) / T) with min_p applied; non-finite logits weigh 0. Vectorizes (libmvec expf). */
static void weigh(const float *z, int64_t n, float top, float inv_t, float min_p, float *w) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        const float x = is_finite(z[i]) ? expf((z[i] - top) * inv_t) : 0.0f;
        w[i] = x >= min_p ? x : 0.0f;
    }
}

static void drop_below(float *w, int64_t n, float edge) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) w[i] = w[i] >= edge ? w[i] : 0.0f;
}

static void sift_down(float *heap, int64_t k) {
    int64_t i = 0;
    for (;;) {
        int64_t least = i, l = 2 * i + 1, r = l + 1;
        if (l < k && heap[l] < heap[least]) least = l;
        if (r < k && heap[r] < heap[least]) least = r;
        if (least == i) return;
        const float t = heap[i];
        heap[i] = heap[least];
        heap[least] = t;
        i = least;
    }
}

/* The k largest weights (zeros where the row has fewer) into heap[0..k), a min-heap: heap[0] is
 * the k-th largest. */
static void top_k_heap(const float *w, int64_t n, int64_t k, float *heap) {
    memset(heap, 0, sizeof(float) * k);
    for (int64_t i = 0; i < n; i++)
        if (w[i] > heap[0]) {
            heap[0] = w[i];
            sift_down(heap, k);
        }
}

static void swap(float *a, int64_t i, int64_t j) {
    const float t = a[i];
    a[i] = a[j];
    a[j] = t;
}

static float median_of_three(float x, float y, float z) {
    return fmaxf(fminf(x, y), fminf(fmaxf(x, y), z));
}

/* The nucleus edge among the weights a[0..m) (reordered in place) of total mass `total`: the
 * weight of the token that, taking tokens best first, brings the running sum to p * total
 * (rounding short of it: the least weight). Ties share an edge, so any order among them gives
 * the same answer. Each round splits the range three ways around a pivot and keeps the part
 * where the goal falls; ranges of 32 or fewer are sorted and walked. */
static float nucleus_edge(float *a, int64_t m, float top_p, double total) {
    const double goal = top_p * total;
    double before = 0.0; /* mass of the tokens above a[lo..hi) */
    int64_t lo = 0, hi = m;
    while (hi - lo > 32) {
        const float pivot = median_of_three(a[lo], a[lo + (hi - lo) / 2], a[hi - 1]);
        /* a[lo..gt) > pivot, a[gt..i) == pivot, a[lt..hi) < pivot */
        int64_t gt = lo, i = lo, lt = hi;
        double above = 0.0, at = 0.0;
        while (i < lt) {
            if (a[i] > pivot) {
                above += a[i];
                swap(a, gt++, i++);
            } else if (a[i] < pivot) {
                swap(a, i, --lt);
            } else {
                at += a[i++];
            }
        }
        if (before + above >= goal) {
            hi = gt;
        } else if (before + above + at >= goal || lt == hi) {
            return pivot; /* or nothing lies below it: the goal was rounded out of reach */
        } else {
            before += above + at;
            lo = lt;
        }
    }
    qsort(a + lo, hi - lo, sizeof *a, descending);
    for (int64_t j = lo; j < hi; j++) {
        before += a[j];
        if (before >= goal) return a[j];
    }
    return a[hi - 1];
}

/* top-p alone: select among the tokens above the highest floor that holds the nucleus. */
static float top_p_edge(const float *w, int64_t n, float top_p, double total, float *scratch) {
    static const float floors[] = {1.0f / 1024.0f, 1.0f / 1048576.0f, 0.0f};
    for (int f = 0;; f++) {
        const float floor = floors[f];
        double mass = 0.0;
#pragma omp simd reduction(+ : mass)
        for (int64_t i = 0; i < n; i++) mass += w[i] >= floor ? w[i] : 0.0f;
        if (mass >= top_p * total || floor == 0.0f) {
            int64_t m = 0;
            for (int64_t i = 0; i < n; i++)
                if (w[i] >= floor && w[i] > 0.0f) scratch[m++] = w[i];
            return nucleus_edge(scratch, m, top_p, total);
        }
    }
}

/* top-k, then top-p within what top-k kept. */
static float top_k_top_p_edge(const float *w, int64_t n, int64_t k, float top_p, float *scratch) {
    top_k_heap(w, n, k, scratch);
    const float edge = scratch[0];
    if (edge == 0.0f) /* fewer than k tokens have weight: top-k keeps them all */
        return top_p < 1.0f ? top_p_edge(w, n, top_p, sum(w, n), scratch) : 0.0f;
    if (top_p >= 1.0f) return edge;
    int64_t ties = -k; /* tokens equal to the k-th but outside the heap are kept too */
#pragma omp simd reduction(+ : ties)
    for (int64_t i = 0; i < n; i++) ties += w[i] >= edge;
    for (int64_t j = 0; j < ties; j++) scratch[k + j] = edge;
    return nucleus_edge(scratch, k + ties, top_p, sum(scratch, k + ties));
}

/* The smallest id whose running sum of weights passes target (inverse CDF in id order): a coarse
 * walk over CHUNK-sized partial sums, then a fine one inside the chunk. -1 if none has weight. */
#define CHUNK 512
static int64_t invert(const float *w, int64_t n, double target) {
    int64_t start = 0;
    double acc = 0.0;
    for (; start + CHUNK < n; start += CHUNK) {
        const double part = sum(w + start, CHUNK);
        if (acc + part > target) break;
        acc += part;
    }
    int64_t last = -1;
    for (int64_t i = start; i < n; i++) {
        if (w[i] > 0.0f) {
            acc += w[i];
            last = i;
            if (acc > target) return i;
        }
    }
    return last; /* rounding left the target at the very end: the last token with weight */
}

static int64_t sample_row(const float *z, int64_t n, float temperature, int64_t top_k, float top_p, float min_p,
                          double u, float *w, float *scratch) {
    const int64_t best = argmax(z, n);
    if (temperature == 0.0f || !is_finite(z[best])) return best;
    weigh(z, n, z[best], 1.0f / temperature, min_p, w);
    if (top_k > 0 && top_k < n)
        drop_below(w, n, top_k_top_p_edge(w, n, top_k, top_p, scratch));
    else if (top_p < 1.0f)
        drop_below(w, n, top_p_edge(w, n, top_p, sum(w, n), scratch));
    const int64_t token = invert(w, n, u * sum(w, n));
    return token >= 0 ? token : best;
}

/* logits [rows, n] float32; per row: temperature (0: greedy), top_k (0: off), top_p (1: off), min_p (0: off),
 * u in [0, 1). Writes the chosen token ids to out [rows]. Returns a kernel_status (status.h): each
 * thread weighs its rows in two rows of n floats of its own, all allocated before the region. */
int sample_rows_f32(const float *restrict logits, int64_t rows, int64_t n, const float *restrict temperature,
                    const int64_t *restrict top_k, const float *restrict top_p, const float *restrict min_p,
                    const double *restrict u, int64_t *restrict out) {
    const int64_t stride = cache_lines_of_floats(n);
    float *buffers = scratch_floats(omp_get_max_threads() * 2 * stride);
    if (buffers == NULL) return KERNEL_OUT_OF_MEMORY;
#pragma omp parallel
    {
        float *w = buffers + omp_get_thread_num() * 2 * stride, *scratch = w + stride;
#pragma omp for schedule(dynamic)
        for (int64_t r = 0; r < rows; r++)
            out[r] = sample_row(logits + r * n, n, temperature[r], top_k[r], top_p[r], min_p[r], u[r], w, scratch);
    }
    free(buffers);
    return KERNEL_OK;
}

/* The k largest logits of z [n] (k: a few, cpu.py's TOP_LOGPROBS_MAX at most), best first (an
 * equal one: the lower id first; past the finite logits the others, in id order), into values and
 * ids, and the largest finite logit, returned. One pass: each run of TOP_RUN logits is compared whole against the k-th best so far
 * (vectorized, as the plain maximum is) and looked into only where it beats it, which after the
 * first runs is almost never (torch.topk over a 262,144-token row cost more than the rest of the
 * logprobs together). */
#define TOP_RUN 64
static float top_logits(const float *restrict z, int64_t n, int64_t k, float *restrict values, int64_t *restrict ids) {
    for (int64_t j = 0; j < k; j++) {
        values[j] = -FLT_MAX;
        ids[j] = -1;
    }
    float top = -FLT_MAX;
    for (int64_t start = 0; start < n; start += TOP_RUN) {
        const int64_t end = start + TOP_RUN < n ? start + TOP_RUN : n;
        float run = -FLT_MAX;
#pragma omp simd reduction(max : run)
        for (int64_t i = start; i < end; i++) run = is_finite(z[i]) && z[i] > run ? z[i] : run;
        top = run > top ? run : top;
        if (k == 0 || run <= values[k - 1]) continue;
        for (int64_t i = start; i < end; i++) {
            if (!is_finite(z[i]) || z[i] <= values[k - 1]) continue;
            int64_t j = k - 1; /* insert, keeping values descending */
            for (; j > 0 && values[j - 1] < z[i]; j--) {
                values[j] = values[j - 1];
                ids[j] = ids[j - 1];
            }
            values[j] = z[i];
            ids[j] = i;
        }
    }
    int64_t j = 0; /* fewer than k above the start value: the rest (non-finite, or -FLT_MAX), in id order */
    while (j < k && ids[j] >= 0) j++;
    for (int64_t i = 0; i < n && j < k; i++) {
        if (is_finite(z[i]) && z[i] > -FLT_MAX) continue;
        values[j] = z[i];
        ids[j++] = i;
    }
    return top;
}

/* Per row of logits [rows, n]: the log-sum-exp, the target token's logprob and rank (1 + the
 * tokens with a strictly larger logit), and the k largest logits with their ids (top_values,
 * top_ids [rows, k]: top_logits): what logprobs need, without building a [rows, n] log-softmax.
 * One pass for the maximum and the top k, one for the sum of exponentials and the count.
 * Non-finite logits weigh 0; a non-finite target's logit is its logprob, as log-softmax would give. */
void target_logprobs_f32(const float *restrict logits, int64_t rows, int64_t n, const int64_t *restrict targets,
                         int64_t k, float *restrict lse, float *restrict logprob, int64_t *restrict rank,
                         float *restrict top_values, int64_t *restrict top_ids) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *z = logits + r * n;
        const float target = z[targets[r]];
        const float top = top_logits(z, n, k, top_values + r * k, top_ids + r * k);
        double total = 0.0;
        int64_t better = 0;
#pragma omp simd reduction(+ : total, better)
        for (int64_t i = 0; i < n; i++) {
            total += is_finite(z[i]) ? expf(z[i] - top) : 0.0f;
            better += z[i] > target;
        }
        lse[r] = top + (float)log(total);
        logprob[r] = is_finite(target) ? target - lse[r] : target;
        rank[r] = better + 1;
    }
}

/* Grammar masks (structured outputs): in logits [*, n], row rows[g] keeps token i only where bit
 * i % 32 of word i / 32 of mask row g is set (llguidance's layout, mask [num_rows, words]); the
 * others become -inf. Written as bits: -ffast-math may not keep an infinity it computes. */
void mask_rows_f32(float *restrict logits, int64_t n, const int64_t *restrict rows, int64_t num_rows,
                   const uint32_t *restrict mask, int64_t words) {
    const uint32_t minus_inf = 0xff800000u;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < num_rows; g++) {
        uint32_t *z = (uint32_t *)(logits + rows[g] * n);
        const uint32_t *m = mask + g * words;
        for (int64_t w = 0; w < words; w++) {
            const uint32_t bits = m[w];
            if (bits == 0xffffffffu) continue;
            const int64_t end = (w + 1) * 32 < n ? (w + 1) * 32 : n;
            if (bits == 0) {  /* most words of a grammar's mask */
                for (int64_t i = w * 32; i < end; i++) z[i] = minus_inf;
                continue;
            }
            for (int64_t i = w * 32; i < end; i++)
                if (!((bits >> (i & 31)) & 1u)) z[i] = minus_inf;
        }
    }
}
