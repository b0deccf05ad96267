/*
 * Low-bit weights read as they are stored: y = x @ w^T (+ bias) with float32 activations.
 *
 * A decode step streams every weight once, so its time is the bytes read: 4-bit blocks read a
 * sixth of fp32's. Each weight format here is a function that turns one block of 32 weights of
 * one row into 32 floats in registers (`dequant_<format>`); the products consume those floats
 * at once and never write a dequantized matrix. The activations stay float32, so a format's
 * products equal those of its dequantized matrix up to float32 rounding (the sums are taken in
 * another order, nothing else).
 *
 * Layouts, for a weight of `rows` x `cols` (row-major; `cols` padded up to a multiple of 32 in
 * the packed codes, the pad codes zero and never multiplied):
 *
 *   WEIGHT_INT8   data int8 [rows, cols]                  scales f32 [rows]      w = s * q
 *   WEIGHT_FP8    data e4m3 bytes [rows, cols]            scales f32 [rows]      w = s * fp8(q)
 *   WEIGHT_INT4   data [rows, cols32 / 2] nibbles         scales, mins f16 [rows, groups]
 *                                                                               w = s * q + min
 *   WEIGHT_NF4    data as INT4                            scales f16 [rows, groups]  w = s * NF4[q]
 *   WEIGHT_Q8_0   GGUF blocks {f16 d; int8 q[32]}                                w = d * q
 *
 * Nibbles follow GGUF's order inside each 32-block: byte t holds element t in its low half and
 * element t + 16 in its high half. A group (int4, nf4) is 32, 64 or 128 columns. A GGUF file's
 * Q4_0 and Q4_1 blocks arrive here as INT4 with groups of 32 (quant/formats.py repacks them at
 * load, bit for bit: the same codes and f16 scales), so one 4-bit reader serves
 * the int4 and gguf modes.
 *
 * Two loops use the blocks. `qmatvec` is the decode path: one weight row at a time, each block
 * dequantized once and multiplied into up to 8 activation rows while in registers. `qmatmul` is
 * for more rows (prefill, big batches): a thread dequantizes a panel of QPANEL weight rows into
 * an L1-sized scratch, then runs a register-blocked product over all activation rows, so the
 * dequantization is paid once per row of w, not once per row of x.
 *
 * Both are orphaned `omp for` loops, like matvec.h's.
 */
#ifndef BRISK_QUANT_H
#define BRISK_QUANT_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtypes.h"

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

enum weight_format {
    WEIGHT_DENSE = 0, /* a row-major [rows, cols] matrix in the model's dtype (matvec.h) */
    WEIGHT_INT8 = 1,
    WEIGHT_FP8 = 2,
    WEIGHT_INT4 = 3,
    WEIGHT_NF4 = 4,
    WEIGHT_Q8_0 = 5,
};

struct weight {
    const void *data;
    const void *bias;                   /* [rows]: the model's dtype when dense, float32 otherwise; or NULL */
    const void *scales, *mins;          /* f32 or f16, see the table above; NULL where a format has none */
    int64_t rows, cols, format;
    int64_t quantize_activations;       /* products round activations to int8 (see below) */
    /* The shape of the codes, derived by the caller so no loop divides: blocks of 32 per row
     * (codes padded to them), groups per row (a group, for int4 and nf4, is 32, 64 or 128
     * columns: one scale), and log2(group / 32), which takes a block's index to its group's. A
     * 64-bit division per row or block cost as much as a row's products on the narrow layers. */
    int64_t blocks, groups, group_shift;
};

#define QBLOCK 32
#define QPANEL 4 /* weight rows per dequantized panel in qmatmul */
#define QTILE 3  /* activation rows per tile of the panel product: QTILE x QPANEL accumulators */

/* 16 fp16 bit patterns -> floats. */
static inline void halves_to_floats(const uint16_t *restrict h, float *restrict out) {
#ifdef __F16C__
    _mm256_storeu_ps(out, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h)));
    _mm256_storeu_ps(out + 8, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + 8))));
#else
    for (int t = 0; t < 16; t++) out[t] = load_f16(h[t]);
#endif
}

/* bitsandbytes' NF4 codebook: the 16 quantiles of a standard normal, scaled to [-1, 1]. */
static const float NF4_VALUES[16] = {
    -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
    -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
    0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f,
    0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f,
};

/* ---- one block of 32 weights of row j, block b, as floats ---------------------------------- */

static inline int64_t groups_per_row(const struct weight *w) { return w->groups; }
static inline int64_t blocks_per_row(const struct weight *w) { return w->blocks; }
static inline int64_t group_of_block(const struct weight *w, int64_t b) { return b >> w->group_shift; }
static inline float row_scale(const struct weight *w, int64_t j) { return ((const float *)w->scales)[j]; }
static inline float group_scale(const struct weight *w, int64_t g) {
    return load_f16_scalar(((const uint16_t *)w->scales)[g]);
}
static inline float group_min(const struct weight *w, int64_t g) { return load_f16_scalar(((const uint16_t *)w->mins)[g]); }

/* Bytes of codes per weight row (the layouts above). */
static inline int64_t row_bytes(const struct weight *w) {
    switch (w->format) {
        case WEIGHT_INT8:
        case WEIGHT_FP8: return w->cols;
        case WEIGHT_Q8_0: return blocks_per_row(w) * 34;
        default: return blocks_per_row(w) * (QBLOCK / 2);
    }
}

/* The decode products stream each weight row once, a few hundred bytes a row. On AMD's Zen 5 the
 * hardware prefetchers do not run far enough ahead of that stream: the int8 LM head's product
 * ran at a third of the dense fp32 kernel's bytes per second. So each row loop asks for the codes
 * QPREFETCH_BYTES past the rows it starts (bytes [from, from + bytes) of data): 2.7x faster on
 * that head there. Hints past the codes' end are harmless: a prefetch never faults. */
#ifndef QPREFETCH_BYTES
#define QPREFETCH_BYTES 16384
#endif
static inline void prefetch_codes(const void *data, int64_t from, int64_t bytes) {
    const char *p = (const char *)data + from + QPREFETCH_BYTES;
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o);
}

static inline void dequant_int8(const struct weight *w, int64_t j, int64_t b, float *restrict out) {
    const int8_t *q = (const int8_t *)w->data + j * w->cols + b * QBLOCK;
    const float s = row_scale(w, j);
    const int64_t n = w->cols - b * QBLOCK < QBLOCK ? w->cols - b * QBLOCK : QBLOCK;
    if (n == QBLOCK) {
        _Pragma("omp simd")
        for (int t = 0; t < QBLOCK; t++) out[t] = s * (float)q[t];
    } else {
        for (int t = 0; t < QBLOCK; t++) out[t] = t < n ? s * (float)q[t] : 0.0f;
    }
}

/* e4m3 -> the fp16 with the same sign, exponent and mantissa bits, which is the value times
 * 2^-8 (normal and subnormal alike; 0x7F/0xFF, NaN, are never stored). The 2^8 is in the scale. */
static inline void dequant_fp8(const struct weight *w, int64_t j, int64_t b, float *restrict out) {
    const uint8_t *q = (const uint8_t *)w->data + j * w->cols + b * QBLOCK;
    const float s = row_scale(w, j);
    const int64_t n = w->cols - b * QBLOCK < QBLOCK ? w->cols - b * QBLOCK : QBLOCK;
    uint16_t h[QBLOCK];
    _Pragma("omp simd")
    for (int t = 0; t < QBLOCK; t++) {
        const uint16_t v = t < n ? q[t] : 0;
        h[t] = (uint16_t)(((v & 0x80) << 8) | ((v & 0x7F) << 7));
    }
    halves_to_floats(h, out);
    halves_to_floats(h + 16, out + 16);
    _Pragma("omp simd")
    for (int t = 0; t < QBLOCK; t++) out[t] *= s;
}

/* Nibble codes -> floats as scale * code + offset (GGUF order, see above). */
static inline void unpack_nibbles(const uint8_t *restrict q, float scale, float offset, float *restrict out) {
    _Pragma("omp simd")
    for (int t = 0; t < 16; t++) {
        out[t] = scale * (float)(q[t] & 0x0F) + offset;
        out[t + 16] = scale * (float)(q[t] >> 4) + offset;
    }
}

static inline void dequant_int4(const struct weight *w, int64_t j, int64_t b, float *restrict out) {
    const uint8_t *q = (const uint8_t *)w->data + (j * blocks_per_row(w) + b) * (QBLOCK / 2);
    const int64_t g = j * groups_per_row(w) + group_of_block(w, b);
    unpack_nibbles(q, group_scale(w, g), group_min(w, g), out);
}

static inline void dequant_nf4(const struct weight *w, int64_t j, int64_t b, float *restrict out) {
    const uint8_t *q = (const uint8_t *)w->data + (j * blocks_per_row(w) + b) * (QBLOCK / 2);
    const float s = group_scale(w, j * groups_per_row(w) + group_of_block(w, b));
    for (int t = 0; t < 16; t++) {
        out[t] = s * NF4_VALUES[q[t] & 0x0F];
        out[t + 16] = s * NF4_VALUES[q[t] >> 4];
    }
}

static inline void dequant_q8_0(const struct weight *w, int64_t j, int64_t b, float *restrict out) {
    const uint8_t *block = (const uint8_t *)w->data + (j * blocks_per_row(w) + b) * 34;
    uint16_t d;
    memcpy(&d, block, 2);
    const float s = load_f16_scalar(d);
    const int8_t *q = (const int8_t *)(block + 2);
    _Pragma("omp simd")
    for (int t = 0; t < QBLOCK; t++) out[t] = s * (float)q[t];
}

/* ---- products ------------------------------------------------------------------------------ */

/* The products of WROWS weight rows j, j + 1, ... with ROWS activation rows: sums [WROWS][ROWS].
 * Each block is dequantized once and multiplied into every activation row. The portable path
 * dequantizes fully (`gsum`, the per-group sums of x, is unused); LANES independent accumulators
 * per row keep the chains of adds short enough to hide their latency. */
#define DEFINE_QDOT_PORTABLE(NAME, FMT, HAS_MIN, ROWS, WROWS)                                             \
    static inline void NAME(const struct weight *w, int64_t j, const float *restrict x,                   \
                            const float *restrict gsum, float *restrict sums) {                           \
        (void)gsum;                                                                                       \
        enum { LANES = 8 };                                                                               \
        const int64_t k = w->cols, full = k / QBLOCK;                                                     \
        for (int r = 0; r < WROWS; r++) {                                                                 \
            float acc[ROWS][LANES] = {{0}};                                                               \
            float wb[QBLOCK];                                                                             \
            for (int64_t b = 0; b < full; b++) {                                                          \
                dequant_##FMT(w, j + r, b, wb);                                                           \
                for (int i = 0; i < ROWS; i++) {                                                          \
                    const float *xi = x + i * k + b * QBLOCK;                                             \
                    for (int c = 0; c < QBLOCK; c += LANES) {                                             \
                        _Pragma("omp simd")                                                               \
                        for (int l = 0; l < LANES; l++) acc[i][l] += wb[c + l] * xi[c + l];               \
                    }                                                                                     \
                }                                                                                         \
            }                                                                                             \
            for (int i = 0; i < ROWS; i++) {                                                              \
                float s = 0.0f;                                                                           \
                for (int l = 0; l < LANES; l++) s += acc[i][l];                                           \
                sums[r * ROWS + i] = s + qdot_tail_##FMT(w, j + r, x + i * k);                            \
            }                                                                                             \
        }                                                                                                 \
    }

/* Sums of x over each group's full blocks, gsum [m, groups]: a format with minimums adds
 * sum_g min_g * gsum_g to a row's product once, instead of a product per block. */
static inline void group_sums(const struct weight *w, const float *restrict x, int64_t m, float *restrict gsum) {
    const int64_t k = w->cols, full = k / QBLOCK;
    for (int64_t i = 0; i < m; i++) {
        float *gi = gsum + i * w->groups;
        for (int64_t g = 0; g < w->groups; g++) gi[g] = 0.0f;
        for (int64_t b = 0; b < full; b++) {
            float s = 0.0f;
            _Pragma("omp simd reduction(+:s)")
            for (int t = 0; t < QBLOCK; t++) s += x[i * k + b * QBLOCK + t];
            gi[group_of_block(w, b)] += s;
        }
    }
}

#if defined(__AVX2__)
/* The float products below hold a block of 32 codes in QVECS vectors of VLANES floats: two zmm
 * registers with AVX-512, four ymm with AVX2. The wide path halves the instructions per block,
 * and a 4-bit block's products are bound by instructions, not bytes (its 16 bytes are cheap to
 * read; turning them into floats is not). */
#if defined(__AVX512F__) && defined(__AVX512BW__)
typedef __m512 vfloat;
#define VLANES 16
#define QPAIR_MAX_ROWS 8 /* 2 x 8 accumulators + a pair's codes fit 32 zmm registers */
#define vf_zero _mm512_setzero_ps
#define vf_set1 _mm512_set1_ps
#define vf_load _mm512_loadu_ps
#define vf_store _mm512_storeu_ps
#define vf_mul _mm512_mul_ps
#define vf_fmadd _mm512_fmadd_ps
#define vf_sum _mm512_reduce_add_ps
static inline __m512 vf_load_halves(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline __m512 vf_load_halves_first(const uint16_t *p, int64_t n) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1), p));
}
static inline __m512 vf_load_first(const float *p, int64_t n) { /* p[0, n), n < 16; zeros after */
    return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p);
}
#else
typedef __m256 vfloat;
#define VLANES 8
#define QPAIR_MAX_ROWS 2 /* a pair's 8 code vectors leave room for only 2 x 2 of 16 ymm */
#define vf_zero _mm256_setzero_ps
#define vf_set1 _mm256_set1_ps
#define vf_load _mm256_loadu_ps
#define vf_store _mm256_storeu_ps
#define vf_mul _mm256_mul_ps
#define vf_fmadd _mm256_fmadd_ps
#define vf_sum hsum
static inline __m256 vf_load_halves(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline __m256 vf_load_halves_first(const uint16_t *p, int64_t n) {
    uint16_t rest[8] = {0};
    for (int64_t i = 0; i < n; i++) rest[i] = p[i];
    return vf_load_halves(rest);
}
static inline __m256 vf_load_first(const float *p, int64_t n) { /* p[0, n), n < 8; zeros after */
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), lanes));
}
#endif
#define QVECS (QBLOCK / VLANES)

/* The same with each block kept in registers as its codes (unscaled), and the block's scale
 * applied once per block per row: sum_t (d q_t + m) x_t = d (sum_t q_t x_t) + m sum_t x_t, the
 * minimums' part added per group at the end (group_offsets). Two weight rows at a time share
 * each load of x and give the core two independent chains of adds. */
#define DEFINE_QDOT(NAME, FMT, HAS_MIN, ROWS, WROWS)                                                      \
    static inline void NAME(const struct weight *w, int64_t j, const float *restrict x,                   \
                            const float *restrict gsum, float *restrict sums) {                           \
        const int64_t k = w->cols, full = k / QBLOCK;                                                     \
        vfloat acc[WROWS][ROWS];                                                                          \
        for (int r = 0; r < WROWS; r++)                                                                   \
            for (int i = 0; i < ROWS; i++) acc[r][i] = vf_zero();                                         \
        float rs[WROWS][GROUPED_##FMT ? w->groups + VLANES : 1];                                         \
        for (int r = 0; GROUPED_##FMT && r < WROWS; r++)                                                  \
            halves_to_floats_n((const uint16_t *)w->scales + (j + r) * w->groups, w->groups, rs[r]);       \
        for (int64_t b = 0; b < full; b++) {                                                              \
            vfloat q[WROWS][QVECS], scale[WROWS];                                                         \
            for (int r = 0; r < WROWS; r++) {                                                             \
                float d, unused;                                                                          \
                codes_##FMT(w, j + r, b, q[r], &d, &unused);                                              \
                scale[r] = vf_set1(GROUPED_##FMT ? rs[r][group_of_block(w, b)] : d);                      \
            }                                                                                             \
            for (int i = 0; i < ROWS; i++) {                                                              \
                const float *xi = x + i * k + b * QBLOCK;                                                 \
                vfloat xv[QVECS];                                                                         \
                for (int v = 0; v < QVECS; v++) xv[v] = vf_load(xi + v * VLANES);                         \
                for (int r = 0; r < WROWS; r++) {                                                         \
                    vfloat p = vf_mul(q[r][0], xv[0]);                                                    \
                    for (int v = 1; v < QVECS; v++) p = vf_fmadd(q[r][v], xv[v], p);                      \
                    acc[r][i] = vf_fmadd(p, scale[r], acc[r][i]);                                         \
                }                                                                                         \
            }                                                                                             \
        }                                                                                                 \
        for (int r = 0; r < WROWS; r++)                                                                   \
            for (int i = 0; i < ROWS; i++) {                                                              \
                if (HAS_MIN) acc[r][i] = group_offsets(w, j + r, gsum + i * w->groups, acc[r][i]);        \
                sums[r * ROWS + i] = vf_sum(acc[r][i]) + qdot_tail_##FMT(w, j + r, x + i * k);            \
            }                                                                                             \
    }

/* Whether a format keeps f16 scales per group (GROUPED_FORMATS in quant/formats.py). DEFINE_QDOT
 * converts such a row's scales to floats once, VLANES at a time, before its blocks: converting one
 * per block (a load, a conversion and a broadcast) made the product slower than f32 scales, whose
 * broadcast folds into the FMA's memory operand. */
#define GROUPED_int4 1
#define GROUPED_nf4 1
#define GROUPED_int8 0
#define GROUPED_fp8 0
#define GROUPED_q8_0 0

/* n halves -> floats, VLANES at a time (dst has room for n rounded up to VLANES) */
static inline void halves_to_floats_n(const uint16_t *restrict src, int64_t n, float *restrict dst) {
    int64_t i = 0;
    for (; i + VLANES <= n; i += VLANES) vf_store(dst + i, vf_load_halves(src + i));
    if (i < n) vf_store(dst + i, vf_load_halves_first(src + i, n - i));
}

/* acc + the minimums' part of row j's product, sum_g min_g * gsum_g, in vector lanes. */
static inline vfloat group_offsets(const struct weight *w, int64_t j, const float *restrict gsum, vfloat acc) {
    const uint16_t *mins = (const uint16_t *)w->mins + j * w->groups;
    int64_t g = 0;
    for (; g + VLANES <= w->groups; g += VLANES) acc = vf_fmadd(vf_load_halves(mins + g), vf_load(gsum + g), acc);
    if (g < w->groups) acc = vf_fmadd(vf_load_halves_first(mins + g, w->groups - g), vf_load_first(gsum + g, w->groups - g), acc);
    return acc;
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* e4m3 bytes -> the fp16 bit patterns of dequant_fp8, 16 at a time. */
static inline __m256i fp8_halves(const uint8_t *codes) {
    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)codes));
    return _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x80)), 8),
                           _mm256_slli_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x7F)), 7));
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* One widening per block: the 16 bytes become 16 int32 lanes, each holding elements t (low
 * nibble) and t + 16 (high nibble), so a mask and a shift give the block's two halves. */
static inline void nibble_codes(const uint8_t *codes, __m512i out[2]) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)codes));
    out[0] = _mm512_and_si512(v, _mm512_set1_epi32(0x0F));
    out[1] = _mm512_srli_epi32(v, 4);
}

static inline void codes_int4(const struct weight *w, int64_t j, int64_t b, vfloat q[QVECS], float *d, float *m) {
    const int64_t g = j * groups_per_row(w) + group_of_block(w, b);
    __m512i c[2];
    nibble_codes((const uint8_t *)w->data + (j * blocks_per_row(w) + b) * (QBLOCK / 2), c);
    q[0] = _mm512_cvtepi32_ps(c[0]);
    q[1] = _mm512_cvtepi32_ps(c[1]);
    *d = group_scale(w, g);
    *m = group_min(w, g);
}

/* NF4 codes -> codebook values: the 16-entry table is one register, so one permute per half. */
static inline void codes_nf4(const struct weight *w, int64_t j, int64_t b, vfloat q[QVECS], float *d, float *m) {
    const __m512 table = _mm512_loadu_ps(NF4_VALUES);
    __m512i c[2];
    nibble_codes((const uint8_t *)w->data + (j * blocks_per_row(w) + b) * (QBLOCK / 2), c);
    q[0] = _mm512_permutexvar_ps(c[0], table);
    q[1] = _mm512_permutexvar_ps(c[1], table);
    *d = group_scale(w, j * groups_per_row(w) + group_of_block(w, b));
    *m = 0.0f;
}

static inline __m512 sbytes_to_ps(const int8_t *q) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
}

static inline void codes_fp8(const struct weight *w, int64_t j, int64_t b, vfloat q[QVECS], float *d, float *m) {
    const uint8_t *codes = (const uint8_t *)w->data + j * w->cols + b * QBLOCK;
    q[0] = _mm512_cvtph_ps(fp8_halves(codes));
    q[1] = _mm512_cvtph_ps(fp8_halves(codes + 16));
    *d = row_scale(w, j);
    *m = 0.0f;
}
#else
/* 16 bytes of nibbles -> their 32 codes (GGUF order) as 4 x 8 int32 lanes. The bytes go to both
 * 128-bit lanes and in-lane byte shuffles spread them: lane-crossing widenings (vpmovzxbd from a
 * register) ran the loop at half this speed on Zen 3. */
static inline void nibble_codes(const uint8_t *codes, __m256i out[4]) {
    const __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)codes));
    const __m256i mask = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_and_si256(raw, mask), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
    const __m256i first = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1,
                                           4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1);
    const __m256i second = _mm256_add_epi32(first, _mm256_set1_epi32(8));
    out[0] = _mm256_shuffle_epi8(lo, first);
    out[1] = _mm256_shuffle_epi8(lo, second);
    out[2] = _mm256_shuffle_epi8(hi, first);
    out[3] = _mm256_shuffle_epi8(hi, second);
}

static inline void codes_int4(const struct weight *w, int64_t j, int64_t b, vfloat q[QVECS], float *d, float *m) {
    const int64_t g = j * groups_per_row(w) + group_of_block(w, b);
    __m256i c[4];
    nibble_codes((const uint8_t *)w->data + (j * blocks_per_row(w) + b) * (QBLOCK / 2), c);
    for (int i = 0; i < 4; i++) q[i] = _mm256_cvtepi32_ps(c[i]);
    *d = group_scale(w, g);
    *m = group_min(w, g);
}

/* NF4 codes -> codebook values: a 16-entry lookup as two 8-lane permutes and a blend on bit 3. */
static inline void codes_nf4(const struct weight *w, int64_t j, int64_t b, vfloat q[QVECS], float *d, float *m) {
    const __m256 lo = _mm256_loadu_ps(NF4_VALUES), hi = _mm256_loadu_ps(NF4_VALUES + 8);
    __m256i c[4];
    nibble_codes((const uint8_t *)w->data + (j * blocks_per_row(w) + b) * (QBLOCK / 2), c);
    for (int i = 0; i < 4; i++)
        q[i] = _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, c[i]), _mm256_permutevar8x32_ps(hi, c[i]),
                                _mm256_castsi256_ps(_mm256_slli_epi32(c[i], 28)));
    *d = group_scale(w, j * groups_per_row(w) + group_of_block(w, b));
    *m = 0.0f;
}

static inline __m256 sbytes_to_ps(const int8_t *q) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
}

static inline void codes_fp8(const struct weight *w, int64_t j, int64_t b, vfloat q[QVECS], float *d, float *m) {
    const uint8_t *codes = (const uint8_t *)w->data + j * w->cols + b * QBLOCK;
    for (int i = 0; i < 2; i++) {
        const __m256i h = fp8_halves(codes + 16 * i);
        q[2 * i] = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
        q[2 * i + 1] = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
    }
    *d = row_scale(w, j);
    *m = 0.0f;
}
#endif

static inline void codes_int8(const struct weight *w, int64_t j, int64_t b, vfloat q[QVECS], float *d, float *m) {
    const int8_t *codes = (const int8_t *)w->data + j * w->cols + b * QBLOCK;
    for (int i = 0; i < QVECS; i++) q[i] = sbytes_to_ps(codes + VLANES * i);
    *d = row_scale(w, j);
    *m = 0.0f;
}

static inline void codes_q8_0(const struct weight *w, int64_t j, int64_t b, vfloat q[QVECS], float *d, float *m) {
    const uint8_t *block = (const uint8_t *)w->data + (j * blocks_per_row(w) + b) * 34;
    uint16_t h;
    memcpy(&h, block, 2);
    for (int i = 0; i < QVECS; i++) q[i] = sbytes_to_ps((const int8_t *)block + 2 + VLANES * i);
    *d = load_f16_scalar(h);
    *m = 0.0f;
}
#else
#define DEFINE_QDOT DEFINE_QDOT_PORTABLE
#define QPAIR_MAX_ROWS 8
#endif

/* Row j of the weight dequantized into out [cols] (the pad of the last block dropped). */
#ifdef __AVX2__
/* A full block through the register reader the products use (codes, then d * code + m). */
#define QROW_BLOCK(FMT, w, j, b, out)                                                                     \
    do {                                                                                                  \
        vfloat q_[QVECS];                                                                                 \
        float d_, m_;                                                                                     \
        codes_##FMT(w, j, b, q_, &d_, &m_);                                                               \
        for (int i_ = 0; i_ < QVECS; i_++)                                                                \
            vf_store((out) + VLANES * i_, vf_fmadd(q_[i_], vf_set1(d_), vf_set1(m_)));                    \
    } while (0)
#else
#define QROW_BLOCK(FMT, w, j, b, out) dequant_##FMT(w, j, b, out)
#endif

#define DEFINE_QROW(NAME, FMT)                                                                            \
    static inline void NAME(const struct weight *w, int64_t j, float *restrict out) {                     \
        const int64_t k = w->cols, full = k / QBLOCK, tail = k - full * QBLOCK;                           \
        for (int64_t b = 0; b < full; b++) QROW_BLOCK(FMT, w, j, b, out + b * QBLOCK);                    \
        if (tail) {                                                                                       \
            float wb[QBLOCK];                                                                             \
            dequant_##FMT(w, j, full, wb);                                                                \
            memcpy(out + full * QBLOCK, wb, sizeof(float) * tail);                                        \
        }                                                                                                 \
    }

/* ---- int8 activations ----------------------------------------------------------------------
 *
 * With `quantize_activations` set on a weight, each 32-block of each activation row is rounded
 * to int8 with its own scale (llama.cpp's Q8_0 for activations) and a block's product is an
 * integer dot product: 32 multiply-adds in three instructions on AVX2 (`maddubs`, `madd`), 64 in
 * one with AVX512-VNNI (`vpdpbusd`, DEFINE_QDOT_VNNI), where the float path converts every weight
 * to float first. Faster, and no longer equal to the float
 * product: the activation's rounding adds ~0.3% relative error per block. int8, q8_0 and int4
 * weights have this path; fp8 and nf4 values are not integers.
 *
 * Activations: q [m, full * 32] int8, d [m, full] scales, s [m, full] = d * sum(q) per block.
 */
static inline void quantize_activations(const float *restrict x, int64_t m, int64_t k, int8_t *restrict q,
                                        float *restrict d, float *restrict s) {
    const int64_t full = k / QBLOCK;
    for (int64_t i = 0; i < m; i++) {
        for (int64_t b = 0; b < full; b++) {
            const float *xb = x + i * k + b * QBLOCK;
            int8_t *qb = q + (i * full + b) * QBLOCK;
            float amax = 0.0f;
            _Pragma("omp simd reduction(max:amax)")
            for (int t = 0; t < QBLOCK; t++) amax = fmaxf(amax, fabsf(xb[t]));
            const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            int sum = 0;
            _Pragma("omp simd reduction(+:sum)")
            for (int t = 0; t < QBLOCK; t++) {
                const int v = (int)nearbyintf(xb[t] * inv);
                qb[t] = (int8_t)v;
                sum += v;
            }
            d[i * full + b] = amax / 127.0f;
            s[i * full + b] = amax / 127.0f * (float)sum;
        }
    }
}

/* One block's 32 codes as int8 in element order (`codes32`: a register on AVX2), with its scale
 * d and offset m: w = d * code + m. */
#ifdef __AVX2__
typedef __m256i codes32;
static inline codes32 load_codes(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline codes32 unpack_codes(const uint8_t *q) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)q);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
}

/* sum over 32 int8 pairs, as 8 float lanes. maddubs multiplies unsigned by signed bytes, so a
 * signed left operand lends its sign to the right one (|a| * sign(a) x); pairs of products fit
 * int16 as |a|, |x| <= 127. */
static inline __m256 idot32(codes32 a, const int8_t *x) {
    const __m256i xv = _mm256_loadu_si256((const __m256i *)x);
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(a), _mm256_sign_epi8(xv, a));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
#define IDOT_ACC __m256
#define IDOT_ZERO _mm256_setzero_ps()
#define IDOT_FMA(acc, a, x, scale) acc = _mm256_fmadd_ps(idot32(a, x), _mm256_set1_ps(scale), acc)
#define IDOT_SUM(acc) hsum(acc)
#else
typedef struct { int8_t v[QBLOCK]; } codes32;
static inline codes32 load_codes(const void *p) {
    codes32 c;
    memcpy(c.v, p, QBLOCK);
    return c;
}
static inline codes32 unpack_codes(const uint8_t *q) {
    codes32 c;
    for (int t = 0; t < 16; t++) c.v[t] = (int8_t)(q[t] & 0x0F), c.v[t + 16] = (int8_t)(q[t] >> 4);
    return c;
}
static inline float idot32(codes32 a, const int8_t *x) {
    int32_t s = 0;
    for (int t = 0; t < QBLOCK; t++) s += (int32_t)a.v[t] * x[t];
    return (float)s;
}
#define IDOT_ACC float
#define IDOT_ZERO 0.0f
#define IDOT_FMA(acc, a, x, scale) acc += idot32(a, x) * (scale)
#define IDOT_SUM(acc) (acc)
#endif

static inline codes32 icodes_int8(const struct weight *w, int64_t j, int64_t b, float *d, float *m) {
    *d = row_scale(w, j);
    *m = 0.0f;
    return load_codes((const int8_t *)w->data + j * w->cols + b * QBLOCK);
}

static inline codes32 icodes_q8_0(const struct weight *w, int64_t j, int64_t b, float *d, float *m) {
    const uint8_t *block = (const uint8_t *)w->data + (j * blocks_per_row(w) + b) * 34;
    uint16_t h;
    memcpy(&h, block, 2);
    *d = load_f16_scalar(h);
    *m = 0.0f;
    return load_codes(block + 2);
}

static inline codes32 icodes_int4(const struct weight *w, int64_t j, int64_t b, float *d, float *m) {
    const int64_t g = j * groups_per_row(w) + group_of_block(w, b);
    *d = group_scale(w, g);
    *m = group_min(w, g);
    return unpack_codes((const uint8_t *)w->data + (j * blocks_per_row(w) + b) * (QBLOCK / 2));
}

#define DEFINE_QDOT_A8(NAME, FMT, ROWS)                                                                   \
    static inline void NAME(const struct weight *w, int64_t j, const int8_t *restrict xq,                 \
                            const float *restrict xd, const float *restrict xs, const float *restrict x,  \
                            float *restrict sums) {                                                       \
        const int64_t k = w->cols, full = k / QBLOCK;                                                     \
        IDOT_ACC acc[ROWS];                                                                               \
        float offsets[ROWS];                                                                              \
        for (int i = 0; i < ROWS; i++) acc[i] = IDOT_ZERO, offsets[i] = 0.0f;                             \
        for (int64_t b = 0; b < full; b++) {                                                              \
            float d, offset;                                                                              \
            const codes32 c = icodes_##FMT(w, j, b, &d, &offset);                                         \
            for (int i = 0; i < ROWS; i++) {                                                              \
                IDOT_FMA(acc[i], c, xq + (i * full + b) * QBLOCK, d * xd[i * full + b]);                  \
                offsets[i] += offset * xs[i * full + b];                                                  \
            }                                                                                             \
        }                                                                                                 \
        for (int i = 0; i < ROWS; i++) sums[i] = IDOT_SUM(acc[i]) + offsets[i] + qdot_tail_##FMT(w, j, x + i * k); \
    }

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* With AVX512-VNNI one `vpdpbusd` multiplies 64 unsigned by 64 signed bytes and adds them in fours
 * into 16 int32 lanes: two blocks' products in one instruction, where AVX2 takes three per block.
 * Its left operand is unsigned, which int4 codes (0..15) are. int8 and Q8_0 codes q are read as
 * q + 128 (one xor); the 128 sum(x_q) that adds is taken back in the same FMA (`xsv`).
 *
 * A pair of blocks b, b + 1 becomes 64 codes in element order, so x's int8 blocks are read as
 * stored; lanes 0-7 of the product belong to block b and 8-15 to b + 1. Per pair and activation
 * row, what depends only on x is laid out once per call in those lanes: xdv = d_x / xsv =
 * -16 d_x sum(x_q) (eight lanes of -16 add up to -128). A weight row then costs, per pair, its
 * codes and its scales' vector (`wsv`), and per activation row a product, a conversion and two
 * FMAs. An odd last block is a pair whose second half is zero (codes, and x's lanes). */
#define VNNI_PAIR_LANES _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1)

static inline __m512 vnni_pair_of(float first, float second) {
    return _mm512_permutexvar_ps(VNNI_PAIR_LANES, _mm512_castps128_ps512(_mm_setr_ps(first, second, 0.0f, 0.0f)));
}

/* A pair's 64 bytes; only a lone last block (half: its 32 bytes) takes a masked load. AMD's Zen 5
 * streams masked loads from memory several times slower than plain ones. */
static inline __m512i vnni_load_pair(const void *p, __mmask64 half) {
    return half == ~(__mmask64)0 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8(half, p);
}

/* q + 128 as unsigned bytes (a missing second block becomes 128s, against x's zeros) */
static inline __m512i vnni_unsigned(__m512i codes) { return _mm512_xor_si512(codes, _mm512_set1_epi8(-128)); }

static inline __m512i vnni_codes_int8(const struct weight *w, int64_t j, int64_t b, __mmask64 half) {
    return vnni_unsigned(vnni_load_pair((const int8_t *)w->data + j * w->cols + b * QBLOCK, half));
}

static inline __m512i vnni_codes_q8_0(const struct weight *w, int64_t j, int64_t b, __mmask64 half) {
    const uint8_t *block = (const uint8_t *)w->data + (j * blocks_per_row(w) + b) * 34 + 2;
    const __m256i second = (uint32_t)(half >> 32) ? _mm256_loadu_si256((const __m256i *)(block + 34)) : _mm256_setzero_si256();
    return vnni_unsigned(_mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)block)), second, 1));
}

static inline __m512i vnni_codes_int4(const struct weight *w, int64_t j, int64_t b, __mmask64 half) {
    const uint8_t *q = (const uint8_t *)w->data + (j * blocks_per_row(w) + b) * (QBLOCK / 2);
    const __m256i raw = (uint32_t)(half >> 32) ? _mm256_loadu_si256((const __m256i *)q) /* 16 bytes a block */
                                               : _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)q));
    /* [b, b, b + 1, b + 1] in 16-byte lanes, the second of each shifted down a nibble */
    const __m512i twice = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3), _mm512_castsi256_si512(raw));
    return _mm512_and_si512(_mm512_srlv_epi64(twice, _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4)), _mm512_set1_epi8(0x0F));
}

/* int4: row j's group scales per block, ws [blocks + 1 + VLANES] (the one past the last 0). */
static inline void vnni_row_scales_int4(const struct weight *w, int64_t j, int64_t full, float *ws) {
    const uint16_t *scales = (const uint16_t *)w->scales + j * w->groups;
    if (w->group_shift == 0) {
        halves_to_floats_n(scales, full, ws);
    } else {
        for (int64_t b = 0; b < full; b++) ws[b] = load_f16_scalar(scales[group_of_block(w, b)]); /* scalar: vectorized, gathers */
    }
    ws[full] = 0.0f;
}

static inline void vnni_row_scales_none(const struct weight *w, int64_t j, int64_t full, float *ws) {
    (void)w, (void)j, (void)full, (void)ws; /* int8: one scale per row; Q8_0: read with the codes */
}
#define vnni_row_scales_int8 vnni_row_scales_none
#define vnni_row_scales_q8_0 vnni_row_scales_none

/* The weight scales of blocks b, b + 1 in the pair's lanes, from what vnni_row_scales prepared. */
static inline __m512 vnni_scales_int8(const struct weight *w, int64_t j, int64_t b, const float *ws) {
    (void)b, (void)ws;
    return _mm512_set1_ps(row_scale(w, j));
}

static inline __m512 vnni_scales_int4(const struct weight *w, int64_t j, int64_t b, const float *ws) {
    (void)w, (void)j;
    return _mm512_permutexvar_ps(VNNI_PAIR_LANES, _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd((const double *)(ws + b)))));
}

/* Two f16 scales 34 bytes apart, joined into one register for one conversion. A row's scales
 * gathered into an array first was slower (the compiler made the strided loop gathers). */
static inline __m512 vnni_scales_q8_0(const struct weight *w, int64_t j, int64_t b, const float *ws) {
    (void)ws;
    const uint8_t *block = (const uint8_t *)w->data + (j * blocks_per_row(w) + b) * 34;
    uint16_t first, second = 0;
    memcpy(&first, block, 2);
    if (b + 1 < blocks_per_row(w)) memcpy(&second, block + 34, 2);
    const __m128 both = _mm_cvtph_ps(_mm_cvtsi32_si128((int)(first | (uint32_t)second << 16)));
    return _mm512_permutexvar_ps(VNNI_PAIR_LANES, _mm512_castps128_ps512(both));
}

#define VNNI_SIGNED_int8 1
#define VNNI_SIGNED_q8_0 1
#define VNNI_SIGNED_int4 0

/* Products of weight row j with ROWS activation rows (x rounded per block: xq; xdv and xsv laid
 * out per pair as above; gxs, for int4, the activation's d * sum(q) per group for the minimums). */
#define DEFINE_QDOT_VNNI(NAME, FMT, HAS_MIN, ROWS)                                                        \
    static inline void NAME(const struct weight *w, int64_t j, const int8_t *restrict xq,                 \
                            const __m512 *restrict xdv, const __m512 *restrict xsv,                       \
                            const float *restrict gxs, const float *restrict x, float *restrict sums) {   \
        const int64_t k = w->cols, full = k / QBLOCK, pairs = (full + 1) / 2;                             \
        float ws[full + 1 + VLANES];                                                                      \
        vnni_row_scales_##FMT(w, j, full, ws);                                                            \
        __m512 acc[ROWS];                                                                                 \
        for (int i = 0; i < ROWS; i++) acc[i] = _mm512_setzero_ps();                                      \
        for (int64_t p = 0; p < pairs; p++) {                                                             \
            const int64_t b = 2 * p;                                                                      \
            const __mmask64 half = b + 1 < full ? ~(__mmask64)0 : (__mmask64)0xFFFFFFFF;                 \
            const __m512i codes = vnni_codes_##FMT(w, j, b, half);                                        \
            const __m512 wsv = vnni_scales_##FMT(w, j, b, ws);                                            \
            for (int i = 0; i < ROWS; i++) {                                                              \
                const __m512i xv = vnni_load_pair(xq + (i * full + b) * QBLOCK, half);                    \
                const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, xv)); \
                const __m512 t = VNNI_SIGNED_##FMT ? _mm512_fmadd_ps(xdv[i * pairs + p], dot, xsv[i * pairs + p]) \
                                                   : _mm512_mul_ps(xdv[i * pairs + p], dot);              \
                acc[i] = _mm512_fmadd_ps(wsv, t, acc[i]);                                                 \
            }                                                                                             \
        }                                                                                                 \
        for (int i = 0; i < ROWS; i++) {                                                                  \
            if (HAS_MIN) acc[i] = group_offsets(w, j, gxs + i * w->groups, acc[i]);                       \
            sums[i] = _mm512_reduce_add_ps(acc[i]) + qdot_tail_##FMT(w, j, x + i * k);                    \
        }                                                                                                 \
    }

#define DEFINE_QMATVEC_A8(FMT, HAS_MIN)                                                                   \
    DEFINE_QDOT_VNNI(qdot_a8_##FMT##_4, FMT, HAS_MIN, 4)                                                  \
    DEFINE_QDOT_VNNI(qdot_a8_##FMT##_1, FMT, HAS_MIN, 1)                                                  \
    static inline void qmatvec_a8_##FMT(const struct weight *w, const float *restrict x, float *restrict y, \
                                        int64_t m) {                                                      \
        const int64_t n = w->rows, k = w->cols, full = k / QBLOCK, pairs = (full + 1) / 2;                \
        const float *bias = (const float *)w->bias;                                                       \
        int8_t xq[m * full * QBLOCK + 1];                                                                 \
        float xd[m * full + 1], xs[m * full + 1], gxs[m * w->groups + 1];                                 \
        __m512 xdv[m * pairs + 1], xsv[m * pairs + 1];                                                    \
        quantize_activations(x, m, k, xq, xd, xs);                                                        \
        for (int64_t i = 0; i < m; i++) {                                                                 \
            for (int64_t g = 0; g < w->groups; g++) gxs[i * w->groups + g] = 0.0f;                        \
            for (int64_t b = 0; b < full; b++) gxs[i * w->groups + group_of_block(w, b)] += xs[i * full + b]; \
            for (int64_t p = 0; p < pairs; p++) {                                                         \
                const int64_t b = i * full + 2 * p, two = 2 * p + 1 < full;                               \
                xdv[i * pairs + p] = vnni_pair_of(xd[b], two ? xd[b + 1] : 0.0f);                         \
                xsv[i * pairs + p] = vnni_pair_of(-16.0f * xs[b], two ? -16.0f * xs[b + 1] : 0.0f);       \
            }                                                                                             \
        }                                                                                                 \
        const int64_t bytes = row_bytes(w);                                                               \
        _Pragma("omp for schedule(static)")                                                               \
        for (int64_t j = 0; j < n; j++) {                                                                 \
            float sums[4];                                                                                \
            prefetch_codes(w->data, j * bytes, bytes);                                                    \
            for (int64_t i0 = 0; i0 < m;) {                                                               \
                const int64_t rows = m - i0 >= 4 ? 4 : 1;                                                 \
                const int8_t *xqi = xq + i0 * full * QBLOCK;                                              \
                if (rows == 4) qdot_a8_##FMT##_4(w, j, xqi, xdv + i0 * pairs, xsv + i0 * pairs, gxs + i0 * w->groups, x + i0 * k, sums); \
                else qdot_a8_##FMT##_1(w, j, xqi, xdv + i0 * pairs, xsv + i0 * pairs, gxs + i0 * w->groups, x + i0 * k, sums); \
                for (int64_t i = 0; i < rows; i++) y[(i0 + i) * n + j] = sums[i] + (bias ? bias[j] : 0.0f); \
                i0 += rows;                                                                               \
            }                                                                                             \
        }                                                                                                 \
    }
#else

/* y [m, rows] = x @ w^T with x rounded to int8 per block; the activations are quantized by every
 * thread into its own stack (m * cols bytes: cheaper than a barrier). */
#define DEFINE_QMATVEC_A8(FMT, HAS_MIN)                                                                   \
    DEFINE_QDOT_A8(qdot_a8_##FMT##_4, FMT, 4)                                                             \
    DEFINE_QDOT_A8(qdot_a8_##FMT##_1, FMT, 1)                                                             \
    static inline void qmatvec_a8_##FMT(const struct weight *w, const float *restrict x, float *restrict y, \
                                        int64_t m) {                                                      \
        const int64_t n = w->rows, k = w->cols, full = k / QBLOCK;                                        \
        const float *bias = (const float *)w->bias;                                                       \
        int8_t xq[m * full * QBLOCK + 1];                                                                 \
        float xd[m * full + 1], xs[m * full + 1];                                                         \
        quantize_activations(x, m, k, xq, xd, xs);                                                        \
        const int64_t bytes = row_bytes(w);                                                               \
        _Pragma("omp for schedule(static)")                                                               \
        for (int64_t j = 0; j < n; j++) {                                                                 \
            float sums[4];                                                                                \
            prefetch_codes(w->data, j * bytes, bytes);                                                    \
            for (int64_t i0 = 0; i0 < m;) {                                                               \
                const int64_t rows = m - i0 >= 4 ? 4 : 1, at = i0 * full;                                 \
                if (rows == 4) qdot_a8_##FMT##_4(w, j, xq + at * QBLOCK, xd + at, xs + at, x + i0 * k, sums); \
                else qdot_a8_##FMT##_1(w, j, xq + at * QBLOCK, xd + at, xs + at, x + i0 * k, sums);       \
                for (int64_t i = 0; i < rows; i++) y[(i0 + i) * n + j] = sums[i] + (bias ? bias[j] : 0.0f); \
                i0 += rows;                                                                               \
            }                                                                                             \
        }                                                                                                 \
    }
#endif

/* The columns past the last full block (int8 and fp8 rows of any width), one at a time. */
#define DEFINE_QDOT_TAIL(FMT)                                                                             \
    static inline float qdot_tail_##FMT(const struct weight *w, int64_t j, const float *restrict x) {    \
        const int64_t full = w->cols / QBLOCK, tail = w->cols - full * QBLOCK;                            \
        if (tail == 0) return 0.0f;                                                                       \
        float wb[QBLOCK], s = 0.0f;                                                                       \
        dequant_##FMT(w, j, full, wb);                                                                    \
        for (int64_t t = 0; t < tail; t++) s += wb[t] * x[full * QBLOCK + t];                             \
        return s;                                                                                         \
    }

/* A tile of ROWS activation rows against weight rows j (and j + 1 when `pair`): a pair shares one
 * product while its accumulators fit the registers (QPAIR_MAX_ROWS), else the rows go one by one. */
#define QDOT_TILE(FMT, ROWS, w, j, pair, x, gsum, sums)                                                   \
    do {                                                                                                  \
        if ((pair) && ROWS <= QPAIR_MAX_ROWS) {                                                           \
            qdot2_##FMT##_##ROWS(w, j, x, gsum, sums);                                                    \
        } else {                                                                                          \
            qdot_##FMT##_##ROWS(w, j, x, gsum, sums);                                                     \
            if (pair) qdot_##FMT##_##ROWS(w, (j) + 1, x, gsum, (sums) + ROWS);                            \
        }                                                                                                 \
    } while (0)

#define DEFINE_QFORMAT(FMT, HAS_MIN)                                                                      \
    DEFINE_QDOT_TAIL(FMT)                                                                                 \
    DEFINE_QDOT(qdot_##FMT##_8, FMT, HAS_MIN, 8, 1)                                                       \
    DEFINE_QDOT(qdot_##FMT##_4, FMT, HAS_MIN, 4, 1)                                                       \
    DEFINE_QDOT(qdot_##FMT##_2, FMT, HAS_MIN, 2, 1)                                                       \
    DEFINE_QDOT(qdot_##FMT##_1, FMT, HAS_MIN, 1, 1)                                                       \
    DEFINE_QDOT(qdot2_##FMT##_8, FMT, HAS_MIN, 8, 2)                                                      \
    DEFINE_QDOT(qdot2_##FMT##_4, FMT, HAS_MIN, 4, 2)                                                      \
    DEFINE_QDOT(qdot2_##FMT##_2, FMT, HAS_MIN, 2, 2)                                                      \
    DEFINE_QDOT(qdot2_##FMT##_1, FMT, HAS_MIN, 1, 2)                                                      \
    DEFINE_QROW(qrow_##FMT, FMT)                                                                          \
                                                                                                          \
    /* y [m, rows] = x [m, cols] @ w^T for m <= 8 or so: the weight streamed once, two rows at a time */ \
    static inline void qmatvec_##FMT(const struct weight *w, const float *restrict x, float *restrict y,  \
                                     int64_t m) {                                                         \
        const int64_t n = w->rows, k = w->cols, groups = w->groups;                                       \
        const float *bias = (const float *)w->bias;                                                       \
        float gsum[HAS_MIN ? m * groups : 1];                                                             \
        if (HAS_MIN) group_sums(w, x, m, gsum);                                                           \
        const int64_t bytes = row_bytes(w);                                                               \
        _Pragma("omp for schedule(static)")                                                               \
        for (int64_t jp = 0; jp < (n + 1) / 2; jp++) {                                                    \
            const int64_t j = 2 * jp, pair = j + 1 < n;                                                   \
            prefetch_codes(w->data, j * bytes, 2 * bytes);                                                \
            float sums[2 * 8];                                                                            \
            for (int64_t i0 = 0; i0 < m;) {                                                               \
                const int64_t left = m - i0, rows = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;    \
                const float *xi = x + i0 * k, *gi = gsum + (HAS_MIN ? i0 * groups : 0);                   \
                if (rows == 8) QDOT_TILE(FMT, 8, w, j, pair, xi, gi, sums);                               \
                else if (rows == 4) QDOT_TILE(FMT, 4, w, j, pair, xi, gi, sums);                          \
                else if (rows == 2) QDOT_TILE(FMT, 2, w, j, pair, xi, gi, sums);                          \
                else QDOT_TILE(FMT, 1, w, j, pair, xi, gi, sums);                                         \
                for (int64_t r = 0; r <= pair; r++)                                                       \
                    for (int64_t i = 0; i < rows; i++)                                                    \
                        y[(i0 + i) * n + j + r] = sums[r * rows + i] + (bias ? bias[j + r] : 0.0f);       \
                i0 += rows;                                                                               \
            }                                                                                             \
        }                                                                                                 \
    }                                                                                                     \
                                                                                                          \
    /* The same for many rows: panels of QPANEL weight rows dequantized into `panel` (this thread's  \
     * scratch, QPANEL * cols floats), then multiplied into every activation row. */                      \
    static inline void qmatmul_##FMT(const struct weight *w, const float *restrict x, float *restrict y,  \
                                     int64_t m, float *restrict panel) {                                  \
        const int64_t n = w->rows, k = w->cols;                                                           \
        _Pragma("omp for schedule(static)")                                                               \
        for (int64_t j0 = 0; j0 < n; j0 += QPANEL) {                                                      \
            const int64_t p = n - j0 < QPANEL ? n - j0 : QPANEL;                                          \
            for (int64_t r = 0; r < p; r++) qrow_##FMT(w, j0 + r, panel + r * k);                         \
            panel_product(panel, p, x, m, k, (const float *)w->bias, j0, y, n);                           \
        }                                                                                                 \
    }

/* y[:, j0 : j0 + p] = x [m, k] @ panel [p, k]^T (+ bias), in tiles of QTILE activation rows x
 * the panel's rows: 12 accumulators of 8 lanes held in registers, each x and panel vector loaded
 * once per tile. A short tile or panel repeats its first row rather than branch in the loop. */
static inline void panel_product(const float *restrict panel, int64_t p, const float *restrict x, int64_t m,
                                 int64_t k, const float *restrict bias, int64_t j0, float *restrict y, int64_t n) {
    const int64_t k8 = k / 8 * 8;
    for (int64_t i0 = 0; i0 < m; i0 += QTILE) {
        const int64_t mr = m - i0 < QTILE ? m - i0 : QTILE;
        const float *xr[QTILE], *wr[QPANEL];
        for (int64_t i = 0; i < QTILE; i++) xr[i] = x + (i0 + (i < mr ? i : 0)) * k;
        for (int64_t r = 0; r < QPANEL; r++) wr[r] = panel + (r < p ? r : 0) * k;
        float sums[QTILE][QPANEL];
#ifdef __AVX2__
        __m256 acc[QTILE][QPANEL];
        for (int i = 0; i < QTILE; i++)
            for (int r = 0; r < QPANEL; r++) acc[i][r] = _mm256_setzero_ps();
        for (int64_t t = 0; t < k8; t += 8) {
            __m256 xv[QTILE];
            for (int i = 0; i < QTILE; i++) xv[i] = _mm256_loadu_ps(xr[i] + t);
            for (int r = 0; r < QPANEL; r++) {
                const __m256 wv = _mm256_loadu_ps(wr[r] + t);
                for (int i = 0; i < QTILE; i++) acc[i][r] = _mm256_fmadd_ps(xv[i], wv, acc[i][r]);
            }
        }
        for (int i = 0; i < QTILE; i++)
            for (int r = 0; r < QPANEL; r++) sums[i][r] = hsum(acc[i][r]);
#else
        float acc[QTILE][QPANEL][8] = {{{0}}};
        for (int64_t t = 0; t < k8; t += 8)
            for (int i = 0; i < QTILE; i++)
                for (int r = 0; r < QPANEL; r++) {
                    _Pragma("omp simd")
                    for (int l = 0; l < 8; l++) acc[i][r][l] += xr[i][t + l] * wr[r][t + l];
                }
        for (int i = 0; i < QTILE; i++)
            for (int r = 0; r < QPANEL; r++) {
                float s = 0.0f;
                for (int l = 0; l < 8; l++) s += acc[i][r][l];
                sums[i][r] = s;
            }
#endif
        for (int64_t i = 0; i < mr; i++) {
            for (int64_t r = 0; r < p; r++) {
                float s = sums[i][r];
                for (int64_t t = k8; t < k; t++) s += xr[i][t] * wr[r][t];
                y[(i0 + i) * n + j0 + r] = s + (bias ? bias[j0 + r] : 0.0f);
            }
        }
    }
}

DEFINE_QFORMAT(int8, 0)
DEFINE_QFORMAT(fp8, 0)
DEFINE_QFORMAT(int4, 1)
DEFINE_QFORMAT(nf4, 0)
DEFINE_QFORMAT(q8_0, 0)
DEFINE_QMATVEC_A8(int8, 0)
DEFINE_QMATVEC_A8(q8_0, 0)
DEFINE_QMATVEC_A8(int4, 1)

#define QUANT_DISPATCH(CALL)                                                                              \
    switch (w->format) {                                                                                  \
    case WEIGHT_INT8: CALL(int8); break;                                                                  \
    case WEIGHT_FP8: CALL(fp8); break;                                                                    \
    case WEIGHT_INT4: CALL(int4); break;                                                                  \
    case WEIGHT_NF4: CALL(nf4); break;                                                                    \
    case WEIGHT_Q8_0: CALL(q8_0); break;                                                                  \
    default: abort(); /* the Python side builds only the formats listed in enum weight_format */         \
    }

/* y [m, rows] = x [m, cols] @ w^T (+ bias) for a low-bit w, in the calling parallel region. */
static inline void qmatvec(const struct weight *w, const float *restrict x, float *restrict y, int64_t m) {
#define QMATVEC_CALL(FMT) qmatvec_##FMT(w, x, y, m)
#define QMATVEC_A8_CALL(FMT) qmatvec_a8_##FMT(w, x, y, m)
    if (w->quantize_activations) {
        switch (w->format) {
        case WEIGHT_INT8: QMATVEC_A8_CALL(int8); return;
        case WEIGHT_Q8_0: QMATVEC_A8_CALL(q8_0); return;
        case WEIGHT_INT4: QMATVEC_A8_CALL(int4); return;
        default: abort(); /* the Python side sets quantize_activations only for these */
        }
    }
    QUANT_DISPATCH(QMATVEC_CALL)
#undef QMATVEC_A8_CALL
#undef QMATVEC_CALL
}

static inline void qmatmul(const struct weight *w, const float *restrict x, float *restrict y, int64_t m,
                           float *restrict panel) {
#define QMATMUL_CALL(FMT) qmatmul_##FMT(w, x, y, m, panel)
    QUANT_DISPATCH(QMATMUL_CALL)
#undef QMATMUL_CALL
}

#endif
