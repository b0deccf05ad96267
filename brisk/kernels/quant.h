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
 *   WEIGHT_INT5   data [rows, blocks * 20]: {u32 h; 16 bytes of nibbles} a block
 *                                                         scales, mins f16 [rows, blocks]
 *                                                                      w = s * (q + 16 h_t) + min
 *   WEIGHT_Q4_K   GGUF super-blocks of 256 columns (8 blocks): {f16 d, dmin; u8 sc[12]; u8 q[128]}
 *                                             block k: w = d * sc_k * q - dmin * m_k (6-bit sc, m)
 *   WEIGHT_Q5_K   {f16 d, dmin; u8 sc[12]; u8 qh[32]; u8 q[128]}: Q4_K's and a fifth bit
 *   WEIGHT_Q6_K   {u8 ql[128]; u8 qh[64]; int8 sc[16]; f16 d}        w = d * sc_s * (q - 32), a
 *                                                                      scale per 16 columns
 *   WEIGHT_MIXED  parts: row ranges of the matrix, each a weight in its own format
 *   WEIGHT_INT4X16, WEIGHT_INT5X16, WEIGHT_Q8_0X16, WEIGHT_Q4_KX16, WEIGHT_Q5_KX16, WEIGHT_Q6_KX16  int4 with a
 *                 scale per block, int5, Q8_0, Q4_K, Q5_K and Q6_K, rows interleaved in tiles of 16 (see
 *                 "tiles of 16 rows")
 *
 * Nibbles follow GGUF's order inside each 32-block: byte t holds element t in its low half and
 * element t + 16 in its high half. A group (int4, nf4) is 32, 64 or 128 columns. A GGUF file's
 * Q4_0 and Q4_1 blocks arrive here as INT4 with groups of 32, its Q5_0 and Q5_1 blocks as INT5
 * (quant/formats.py repacks them at load, bit for bit: the same codes and f16 scales; bit t of
 * h is element t's fifth bit, as in the file), so one 4-bit reader serves the int4 and gguf
 * modes, and INT5 is that reader plus a bit. The K-quants stay as the file has them; block k
 * (of 8) of a super-block has element t's code at
 *
 *   Q4_K  q[32 (k / 2) + t] >> 4 (k % 2) & 15           (32 bytes: block k low, k + 1 high)
 *   Q5_K  that, | (qh[t] >> k & 1) << 4
 *   Q6_K  ql[64 (k / 4) + 32 (k % 2) + t] >> 4 (k / 2 % 2) & 15 | (qh[32 (k / 4) + t] >> 2 (k % 4) & 3) << 4
 *
 * and Q4_K/Q5_K pack sc_k and m_k in 12 bytes: for k < 4 the low 6 bits of bytes k and k + 4,
 * for k >= 4 a nibble of byte k + 4 each, their top 2 bits those of bytes k - 4 and k.
 *
 * A fused projection whose shards a GGUF file stores in different formats (Gemma 3's q and k in
 * Q5_0, v in Q8_0) is a WEIGHT_MIXED of its parts: each part's product writes its own columns of
 * y, which is why every product below takes y's row stride `ldy` (the whole weight's rows).
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
    WEIGHT_INT5 = 6,
    WEIGHT_Q4_K = 7,
    WEIGHT_Q5_K = 8,
    WEIGHT_Q6_K = 9,
    WEIGHT_MIXED = 10,
    WEIGHT_INT4X16 = 11,
    WEIGHT_Q8_0X16 = 12,
    WEIGHT_INT5X16 = 13,
    WEIGHT_Q4_KX16 = 14,
    WEIGHT_Q6_KX16 = 15,
    WEIGHT_Q5_KX16 = 16,
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
     * 64-bit division per row or block cost as much as a row's products on the narrow layers.
     * A K-quant's every block has its own scale: groups = blocks. */
    int64_t blocks, groups, group_shift;
    const struct weight *parts; /* WEIGHT_MIXED: num_parts weights of these cols, their rows stacked */
    int64_t num_parts;
};

#define QBLOCK 32
#define QK_BLOCKS 8 /* blocks of 32 in a K-quant super-block */
#define Q4_K_BYTES 144
#define Q5_K_BYTES 176
#define Q6_K_BYTES 210
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
        case WEIGHT_INT5: return blocks_per_row(w) * 20;
        case WEIGHT_Q4_K: return blocks_per_row(w) / QK_BLOCKS * Q4_K_BYTES;
        case WEIGHT_Q5_K: return blocks_per_row(w) / QK_BLOCKS * Q5_K_BYTES;
        case WEIGHT_Q6_K: return blocks_per_row(w) / QK_BLOCKS * Q6_K_BYTES;
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

/* ---- a block's 32 codes as bytes in element order (`codes32`: a register with AVX2) --------
 * The formats whose codes are not whole bytes as stored (INT5, the K-quants) assemble them here
 * once, for every product: shifts and masks of 32 bytes at a time. */
#ifdef __AVX2__
typedef __m256i codes32;
static inline codes32 load_codes(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline codes32 unpack_codes(const uint8_t *q) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)q);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
}
/* (c >> shift) & mask in every byte: the shift is of 16-bit lanes, so `mask` must drop the bits
 * it brings down from the next byte (every use keeps at most 8 - shift bits). */
static inline codes32 codes_shift_mask(codes32 c, int shift, int mask) {
    return _mm256_and_si256(_mm256_srl_epi16(c, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8((char)mask));
}
static inline codes32 codes_or(codes32 a, codes32 b) { return _mm256_or_si256(a, b); }
static inline codes32 codes_times16(codes32 c) { return _mm256_slli_epi16(c, 4); } /* bytes < 16 */
static inline codes32 codes_minus(codes32 c, int k) { return _mm256_sub_epi8(c, _mm256_set1_epi8((char)k)); }
/* byte t: 16 where bit t of `bits` is set, else 0 (byte t / 8 of the word to byte t, then its bit) */
static inline codes32 codes_bits16(uint32_t bits) {
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
                                               _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202,
                                                                  0x0303030303030303));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}
static inline void store_codes(void *out, codes32 c) { _mm256_storeu_si256((__m256i *)out, c); }
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
static inline codes32 codes_shift_mask(codes32 c, int shift, int mask) {
    for (int t = 0; t < QBLOCK; t++) c.v[t] = (int8_t)(((uint8_t)c.v[t] >> shift) & mask);
    return c;
}
static inline codes32 codes_or(codes32 a, codes32 b) {
    for (int t = 0; t < QBLOCK; t++) a.v[t] |= b.v[t];
    return a;
}
static inline codes32 codes_times16(codes32 c) {
    for (int t = 0; t < QBLOCK; t++) c.v[t] = (int8_t)(c.v[t] * 16);
    return c;
}
static inline codes32 codes_minus(codes32 c, int k) {
    for (int t = 0; t < QBLOCK; t++) c.v[t] = (int8_t)(c.v[t] - k);
    return c;
}
static inline codes32 codes_bits16(uint32_t bits) {
    codes32 c;
    for (int t = 0; t < QBLOCK; t++) c.v[t] = (int8_t)((bits >> t & 1) * 16);
    return c;
}
static inline void store_codes(void *out, codes32 c) { memcpy(out, c.v, QBLOCK); }
#endif

static inline const uint8_t *int5_block(const struct weight *w, int64_t j, int64_t b) {
    return (const uint8_t *)w->data + (j * blocks_per_row(w) + b) * 20;
}

static inline codes32 block_codes_int5(const struct weight *w, int64_t j, int64_t b) {
    const uint8_t *block = int5_block(w, j, b);
    uint32_t high;
    memcpy(&high, block, 4);
    return codes_or(unpack_codes(block + 4), codes_bits16(high));
}

/* The K-quant super-block (of `bytes`) that holds block b of row j. */
static inline const uint8_t *kq_super(const struct weight *w, int64_t j, int64_t b, int64_t bytes) {
    return (const uint8_t *)w->data + (j * (blocks_per_row(w) / QK_BLOCKS) + b / QK_BLOCKS) * bytes;
}

static inline codes32 block_codes_q4_k(const struct weight *w, int64_t j, int64_t b) {
    const int k = (int)(b % QK_BLOCKS);
    return codes_shift_mask(load_codes(kq_super(w, j, b, Q4_K_BYTES) + 16 + 32 * (k / 2)), 4 * (k % 2), 0x0F);
}

static inline codes32 block_codes_q5_k(const struct weight *w, int64_t j, int64_t b) {
    const uint8_t *s = kq_super(w, j, b, Q5_K_BYTES);
    const int k = (int)(b % QK_BLOCKS);
    return codes_or(codes_shift_mask(load_codes(s + 48 + 32 * (k / 2)), 4 * (k % 2), 0x0F),
                    codes_times16(codes_shift_mask(load_codes(s + 16), k, 0x01)));
}

/* q in 0..63: the weight is d * sc * (q - 32) */
static inline codes32 block_codes_q6_k(const struct weight *w, int64_t j, int64_t b) {
    const uint8_t *s = kq_super(w, j, b, Q6_K_BYTES);
    const int k = (int)(b % QK_BLOCKS);
    return codes_or(codes_shift_mask(load_codes(s + 64 * (k / 4) + 32 * (k % 2)), 4 * (k / 2 % 2), 0x0F),
                    codes_times16(codes_shift_mask(load_codes(s + 128 + 32 * (k / 4)), 2 * (k % 4), 0x03)));
}

/* Block k's 6-bit scale and minimum from a Q4_K/Q5_K super-block's 12 bytes (ggml's get_scale_min_k4). */
static inline void kq_scale_min(const uint8_t *q, int k, int *sc, int *m) {
    if (k < 4) {
        *sc = q[k] & 63, *m = q[k + 4] & 63;
    } else {
        *sc = (q[k + 4] & 0x0F) | (q[k - 4] >> 6) << 4;
        *m = (q[k + 4] >> 4) | (q[k] >> 6) << 4;
    }
}

/* Block b's scale d * sc and offset -dmin * m: w = scale * q + offset. */
static inline void kq_block_scale(const uint8_t *super, int64_t b, float *scale, float *offset) {
    uint16_t h[2];
    memcpy(h, super, 4);
    int sc, m;
    kq_scale_min(super + 4, (int)(b % QK_BLOCKS), &sc, &m);
    *scale = load_f16_scalar(h[0]) * (float)sc;
    *offset = -load_f16_scalar(h[1]) * (float)m;
}

/* Every block's scale and offset of row j, [blocks] each: a super-block's 8 pairs unpacked at
 * once, 4 at a time in 32-bit words (bytes 0-3: sc_0..3, 4-7: sc_4..7, 8-11: m_0..3, 12-15: m_4..7). */
static inline void kq_row_scales(const struct weight *w, int64_t j, int64_t bytes, float *restrict scales,
                                 float *restrict offsets) {
    const int64_t supers = blocks_per_row(w) / QK_BLOCKS;
    const uint8_t *s = (const uint8_t *)w->data + j * supers * bytes;
    for (int64_t sb = 0; sb < supers; sb++, s += bytes) {
        uint32_t u[4];
        uint16_t h[2];
        memcpy(u, s + 4, 12);
        memcpy(h, s, 4);
        u[3] = ((u[2] >> 4) & 0x0F0F0F0Fu) | ((u[1] >> 6) & 0x03030303u) << 4;
        const uint32_t low_mins = u[1] & 0x3F3F3F3Fu;
        u[1] = (u[2] & 0x0F0F0F0Fu) | ((u[0] >> 6) & 0x03030303u) << 4;
        u[2] = low_mins;
        u[0] &= 0x3F3F3F3Fu;
        uint8_t v[16];
        memcpy(v, u, 16);
        const float d = load_f16_scalar(h[0]), dmin = load_f16_scalar(h[1]);
        for (int k = 0; k < QK_BLOCKS; k++) {
            scales[sb * QK_BLOCKS + k] = d * (float)v[k];
            offsets[sb * QK_BLOCKS + k] = -dmin * (float)v[k + 8];
        }
    }
}

static inline float q6k_d(const uint8_t *super) {
    uint16_t h;
    memcpy(&h, super + 208, 2);
    return load_f16_scalar(h);
}

/* Q6_K row j's scales of each block's two halves: first[b] (columns 0-15), second[b] (16-31). */
static inline void q6k_row_scales(const struct weight *w, int64_t j, float *restrict first, float *restrict second) {
    const int64_t supers = blocks_per_row(w) / QK_BLOCKS;
    const uint8_t *s = (const uint8_t *)w->data + j * supers * Q6_K_BYTES;
    for (int64_t sb = 0; sb < supers; sb++, s += Q6_K_BYTES) {
        const float d = q6k_d(s);
        const int8_t *sc = (const int8_t *)(s + 192);
        for (int k = 0; k < QK_BLOCKS; k++) {
            first[sb * QK_BLOCKS + k] = d * (float)sc[2 * k];
            second[sb * QK_BLOCKS + k] = d * (float)sc[2 * k + 1];
        }
    }
}

/* Two floats per block of row j, for the K-quants, whose scales are unpacked a row at a time:
 * Q4_K/Q5_K a block's scale and offset, Q6_K its halves' scales. */
static inline void block_scales_q4_k(const struct weight *w, int64_t j, float *first, float *second) {
    kq_row_scales(w, j, Q4_K_BYTES, first, second);
}
static inline void block_scales_q5_k(const struct weight *w, int64_t j, float *first, float *second) {
    kq_row_scales(w, j, Q5_K_BYTES, first, second);
}
#define block_scales_q6_k q6k_row_scales

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

/* A block from its codes: element t is (t < 16 ? first : second) * code + offset. */
static inline void dequant_codes(codes32 c, float first, float second, float offset, float *restrict out) {
    int8_t q[QBLOCK];
    store_codes(q, c);
    for (int t = 0; t < QBLOCK; t++) out[t] = (t < 16 ? first : second) * (float)q[t] + offset;
}

static inline void dequant_int5(const struct weight *w, int64_t j, int64_t b, float *restrict out) {
    const int64_t g = j * groups_per_row(w) + group_of_block(w, b);
    const float s = group_scale(w, g);
    dequant_codes(block_codes_int5(w, j, b), s, s, group_min(w, g), out);
}

static inline void dequant_q4_k(const struct weight *w, int64_t j, int64_t b, float *restrict out) {
    float d, m;
    kq_block_scale(kq_super(w, j, b, Q4_K_BYTES), b, &d, &m);
    dequant_codes(block_codes_q4_k(w, j, b), d, d, m, out);
}

static inline void dequant_q5_k(const struct weight *w, int64_t j, int64_t b, float *restrict out) {
    float d, m;
    kq_block_scale(kq_super(w, j, b, Q5_K_BYTES), b, &d, &m);
    dequant_codes(block_codes_q5_k(w, j, b), d, d, m, out);
}

static inline void dequant_q6_k(const struct weight *w, int64_t j, int64_t b, float *restrict out) {
    const uint8_t *s = kq_super(w, j, b, Q6_K_BYTES);
    const int8_t *sc = (const int8_t *)(s + 192) + 2 * (b % QK_BLOCKS);
    const float d = q6k_d(s);
    dequant_codes(codes_minus(block_codes_q6_k(w, j, b), 32), d * (float)sc[0], d * (float)sc[1], 0.0f, out);
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
 * minimums' part added per group at the end (row_offsets). Two weight rows at a time share
 * each load of x and give the core two independent chains of adds. */
#define DEFINE_QDOT(NAME, FMT, HAS_MIN, ROWS, WROWS)                                                      \
    static inline void NAME(const struct weight *w, int64_t j, const float *restrict x,                   \
                            const float *restrict gsum, float *restrict sums) {                           \
        const int64_t k = w->cols, full = k / QBLOCK;                                                     \
        vfloat acc[WROWS][ROWS];                                                                          \
        for (int r = 0; r < WROWS; r++)                                                                   \
            for (int i = 0; i < ROWS; i++) acc[r][i] = vf_zero();                                         \
        float rs[WROWS][GROUPED_##FMT ? w->groups + VLANES : 1];                                         \
        float rm[WROWS][GROUPED_##FMT && HAS_MIN ? w->groups + VLANES : 1];                               \
        for (int r = 0; GROUPED_##FMT && r < WROWS; r++) row_scales_##FMT(w, j + r, rs[r], rm[r]);        \
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
                if (HAS_MIN) acc[r][i] = row_offsets_##FMT(w, j + r, rm[r], gsum + i * w->groups, acc[r][i]); \
                sums[r * ROWS + i] = vf_sum(acc[r][i]) + qdot_tail_##FMT(w, j + r, x + i * k);            \
            }                                                                                             \
    }

/* Whether a format has a scale per group that DEFINE_QDOT reads from a row's floats, made once
 * per row (row_scales): the f16 scales of int4, nf4 and int5 (GROUPED_FORMATS in
 * quant/formats.py), VLANES at a time, and the K-quants' 6-bit ones with their minimums. Converting
 * one per block (a load, a conversion and a broadcast) made the product slower than f32 scales,
 * whose broadcast folds into the FMA's memory operand. Q6_K has one f16 scale per super-block: its
 * codes come out of codes_q6_k times their half's integer scale. */
#define GROUPED_int4 1
#define GROUPED_nf4 1
#define GROUPED_int5 1
#define GROUPED_q4_k 1
#define GROUPED_q5_k 1
#define GROUPED_int8 0
#define GROUPED_fp8 0
#define GROUPED_q8_0 0
#define GROUPED_q6_k 0

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

/* Each format's row scales (rs per group; rm, the minimums as floats, where row_offsets reads
 * them) and its minimums' part of a product (rm, or the f16 minimums, with the activation's sums
 * per group). The formats without them never call theirs. */
static inline void row_scales_halves(const struct weight *w, int64_t j, float *restrict rs, float *restrict rm) {
    (void)rm;
    halves_to_floats_n((const uint16_t *)w->scales + j * w->groups, w->groups, rs);
}
static inline void row_scales_none(const struct weight *w, int64_t j, float *restrict rs, float *restrict rm) {
    (void)w, (void)j, (void)rs, (void)rm;
}
#define row_scales_int4 row_scales_halves
#define row_scales_nf4 row_scales_halves
#define row_scales_int5 row_scales_halves
#define row_scales_q4_k block_scales_q4_k
#define row_scales_q5_k block_scales_q5_k
#define row_scales_int8 row_scales_none
#define row_scales_fp8 row_scales_none
#define row_scales_q8_0 row_scales_none
#define row_scales_q6_k row_scales_none

static inline vfloat row_offsets_halves(const struct weight *w, int64_t j, const float *restrict rm,
                                        const float *restrict gsum, vfloat acc) {
    (void)rm;
    return group_offsets(w, j, gsum, acc);
}
static inline vfloat row_offsets_floats(const struct weight *w, int64_t j, const float *restrict rm,
                                        const float *restrict gsum, vfloat acc) {
    (void)j;
    int64_t g = 0;
    for (; g + VLANES <= w->groups; g += VLANES) acc = vf_fmadd(vf_load(rm + g), vf_load(gsum + g), acc);
    if (g < w->groups) acc = vf_fmadd(vf_load_first(rm + g, w->groups - g), vf_load_first(gsum + g, w->groups - g), acc);
    return acc;
}
static inline vfloat row_offsets_none(const struct weight *w, int64_t j, const float *restrict rm,
                                      const float *restrict gsum, vfloat acc) {
    (void)w, (void)j, (void)rm, (void)gsum;
    return acc;
}
#define row_offsets_int4 row_offsets_halves
#define row_offsets_int5 row_offsets_halves
#define row_offsets_q4_k row_offsets_floats
#define row_offsets_q5_k row_offsets_floats
#define row_offsets_int8 row_offsets_none
#define row_offsets_fp8 row_offsets_none
#define row_offsets_nf4 row_offsets_none
#define row_offsets_q8_0 row_offsets_none
#define row_offsets_q6_k row_offsets_none

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

/* A block's codes (signed bytes) as QVECS float vectors, in element order. */
static inline void codes_to_floats(codes32 c, vfloat q[QVECS]) {
    const __m128i low = _mm256_castsi256_si128(c), high = _mm256_extracti128_si256(c, 1);
#if defined(__AVX512F__) && defined(__AVX512BW__)
    q[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(low));
    q[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(high));
#else
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(low));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(low, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(high));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(high, 8)));
#endif
}

static inline void codes_int5(const struct weight *w, int64_t j, int64_t b, vfloat q[QVECS], float *d, float *m) {
    const int64_t g = j * groups_per_row(w) + group_of_block(w, b);
    codes_to_floats(block_codes_int5(w, j, b), q);
    *d = group_scale(w, g);
    *m = group_min(w, g);
}

static inline void codes_q4_k(const struct weight *w, int64_t j, int64_t b, vfloat q[QVECS], float *d, float *m) {
    codes_to_floats(block_codes_q4_k(w, j, b), q);
    kq_block_scale(kq_super(w, j, b, Q4_K_BYTES), b, d, m);
}

static inline void codes_q5_k(const struct weight *w, int64_t j, int64_t b, vfloat q[QVECS], float *d, float *m) {
    codes_to_floats(block_codes_q5_k(w, j, b), q);
    kq_block_scale(kq_super(w, j, b, Q5_K_BYTES), b, d, m);
}

/* Q6_K: q - 32 times its half's integer scale (exact in float: 14 bits), d the super-block's. */
static inline void codes_q6_k(const struct weight *w, int64_t j, int64_t b, vfloat q[QVECS], float *d, float *m) {
    const uint8_t *s = kq_super(w, j, b, Q6_K_BYTES);
    const int8_t *sc = (const int8_t *)(s + 192) + 2 * (b % QK_BLOCKS);
    codes_to_floats(codes_minus(block_codes_q6_k(w, j, b), 32), q);
    for (int i = 0; i < QVECS; i++) q[i] = vf_mul(q[i], vf_set1((float)sc[i < QVECS / 2 ? 0 : 1]));
    *d = q6k_d(s);
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

/* 4 activation codes as one 32-bit lane value, to broadcast against a word of 4 codes per lane */
static inline int32_t qg_word(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* ---- int8 activations ----------------------------------------------------------------------
 *
 * With `quantize_activations` set on a weight, each 32-block of each activation row is rounded
 * to int8 with its own scale (llama.cpp's Q8_0 for activations) and a block's product is an
 * integer dot product: 32 multiply-adds in three instructions on AVX2 (`maddubs`, `madd`), 64 in
 * one with AVX512-VNNI (`vpdpbusd`, DEFINE_QDOT_VNNI), where the float path converts every weight
 * to float first. Faster, and no longer equal to the float
 * product: the activation's rounding adds ~0.3% relative error per block. int8, q8_0, int4, int5
 * and the K-quants have this path; fp8 and nf4 values are not integers.
 *
 * The K-quants round activations per 32 too, where llama.cpp rounds them per 256 (Q8_K, with
 * sums per 16): a K-quant block of 32 has a scale of its own (Q6_K one per 16, applied per lane),
 * so a scale per 32 of x costs one multiply per block that the weight's scale costs anyway; the
 * rounding is finer (each step follows 32 values' largest, not 256's); and every format rounds x
 * alike, so a fused weight whose parts differ in format (WEIGHT_MIXED) rounds it once for all of
 * them, into the one scratch layout of the batched product (quant_gemm.h).
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

/* A block's integer dot product weighs its two halves' sums of products (`mult16`): by 1, or by
 * Q6_K's integer scales of its halves, so Q6_K's block sum stays one exact integer. */
#ifdef __AVX2__
typedef __m256i mult16; /* int16 weights of the 16 pairs of products: the first 8 pairs are columns 0-15 */
static inline mult16 mult_ones(void) { return _mm256_set1_epi16(1); }
static inline mult16 mult_halves(int first, int second) {
    return _mm256_set_m128i(_mm_set1_epi16((short)second), _mm_set1_epi16((short)first));
}
/* sum over 32 int8 pairs, as 8 float lanes. maddubs multiplies unsigned by signed bytes, so a
 * signed left operand lends its sign to the right one (|a| * sign(a) x); pairs of products fit
 * int16 as |a|, |x| <= 127. */
static inline __m256 idot32(codes32 a, mult16 mult, const int8_t *x) {
    const __m256i xv = _mm256_loadu_si256((const __m256i *)x);
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(a), _mm256_sign_epi8(xv, a));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, mult));
}
#define IDOT_ACC __m256
#define IDOT_ZERO _mm256_setzero_ps()
#define IDOT_FMA(acc, a, mult, x, scale) acc = _mm256_fmadd_ps(idot32(a, mult, x), _mm256_set1_ps(scale), acc)
#define IDOT_SUM(acc) hsum(acc)
#else
typedef struct { int16_t half[2]; } mult16;
static inline mult16 mult_ones(void) { return (mult16){{1, 1}}; }
static inline mult16 mult_halves(int first, int second) { return (mult16){{(int16_t)first, (int16_t)second}}; }
static inline float idot32(codes32 a, mult16 mult, const int8_t *x) {
    int32_t s[2] = {0, 0};
    for (int t = 0; t < QBLOCK; t++) s[t / 16] += (int32_t)a.v[t] * x[t];
    return (float)(s[0] * mult.half[0] + s[1] * mult.half[1]);
}
#define IDOT_ACC float
#define IDOT_ZERO 0.0f
#define IDOT_FMA(acc, a, mult, x, scale) acc += idot32(a, mult, x) * (scale)
#define IDOT_SUM(acc) (acc)
#endif

/* One block's 32 codes as int8 in element order, with its scale d, offset m (w = d * code + m)
 * and its halves' weights. */
static inline codes32 icodes_int8(const struct weight *w, int64_t j, int64_t b, float *d, float *m, mult16 *mult) {
    *d = row_scale(w, j);
    *m = 0.0f;
    *mult = mult_ones();
    return load_codes((const int8_t *)w->data + j * w->cols + b * QBLOCK);
}

static inline codes32 icodes_q8_0(const struct weight *w, int64_t j, int64_t b, float *d, float *m, mult16 *mult) {
    const uint8_t *block = (const uint8_t *)w->data + (j * blocks_per_row(w) + b) * 34;
    uint16_t h;
    memcpy(&h, block, 2);
    *d = load_f16_scalar(h);
    *m = 0.0f;
    *mult = mult_ones();
    return load_codes(block + 2);
}

static inline codes32 icodes_int4(const struct weight *w, int64_t j, int64_t b, float *d, float *m, mult16 *mult) {
    const int64_t g = j * groups_per_row(w) + group_of_block(w, b);
    *d = group_scale(w, g);
    *m = group_min(w, g);
    *mult = mult_ones();
    return unpack_codes((const uint8_t *)w->data + (j * blocks_per_row(w) + b) * (QBLOCK / 2));
}

static inline codes32 icodes_int5(const struct weight *w, int64_t j, int64_t b, float *d, float *m, mult16 *mult) {
    const int64_t g = j * groups_per_row(w) + group_of_block(w, b);
    *d = group_scale(w, g);
    *m = group_min(w, g);
    *mult = mult_ones();
    return block_codes_int5(w, j, b);
}

static inline codes32 icodes_q4_k(const struct weight *w, int64_t j, int64_t b, float *d, float *m, mult16 *mult) {
    kq_block_scale(kq_super(w, j, b, Q4_K_BYTES), b, d, m);
    *mult = mult_ones();
    return block_codes_q4_k(w, j, b);
}

static inline codes32 icodes_q5_k(const struct weight *w, int64_t j, int64_t b, float *d, float *m, mult16 *mult) {
    kq_block_scale(kq_super(w, j, b, Q5_K_BYTES), b, d, m);
    *mult = mult_ones();
    return block_codes_q5_k(w, j, b);
}

/* Q6_K: codes q - 32 (|c| <= 32), weighed by the halves' int8 scales; d the super-block's */
static inline codes32 icodes_q6_k(const struct weight *w, int64_t j, int64_t b, float *d, float *m, mult16 *mult) {
    const uint8_t *s = kq_super(w, j, b, Q6_K_BYTES);
    const int8_t *sc = (const int8_t *)(s + 192) + 2 * (b % QK_BLOCKS);
    *d = q6k_d(s);
    *m = 0.0f;
    *mult = mult_halves(sc[0], sc[1]);
    return codes_minus(block_codes_q6_k(w, j, b), 32);
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
            mult16 mult;                                                                                  \
            const codes32 c = icodes_##FMT(w, j, b, &d, &offset, &mult);                                  \
            for (int i = 0; i < ROWS; i++) {                                                              \
                IDOT_FMA(acc[i], c, mult, xq + (i * full + b) * QBLOCK, d * xd[i * full + b]);            \
                offsets[i] += offset * xs[i * full + b];                                                  \
            }                                                                                             \
        }                                                                                                 \
        for (int i = 0; i < ROWS; i++) sums[i] = IDOT_SUM(acc[i]) + offsets[i] + qdot_tail_##FMT(w, j, x + i * k); \
    }

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* With AVX512-VNNI one `vpdpbusd` multiplies 64 unsigned by 64 signed bytes and adds them in fours
 * into 16 int32 lanes: two blocks' products in one instruction, where AVX2 takes three per block.
 * Its left operand is unsigned, which int4, int5 and K-quant codes (0..15, 0..31, Q6_K's 0..63)
 * are. int8 and Q8_0 codes q are read as q + 128 (one xor); that and Q6_K's - 32 are each format's
 * code offset (VNNI_OFFSET: w = scale * (code + offset)), taken back in the same FMA (`xsv`).
 *
 * A pair of blocks b, b + 1 becomes 64 codes in element order, so x's int8 blocks are read as
 * stored; lanes 0-7 of the product belong to block b and 8-15 to b + 1, each lane the sum of 4
 * consecutive products (lanes 0-3: block b's first 16 columns, where Q6_K's first scale applies).
 * Per pair and activation row, what depends only on x is laid out once per call in those lanes:
 * xdv = d_x / xsv = offset * d_x * (the lane's 4 codes of x summed), exact whatever scale a lane
 * has. A weight row then costs, per pair, its codes and its scales' vector (`wsv`, a scale per
 * lane), and per activation row a product, a conversion and two FMAs. An odd last block is a
 * pair whose second half is zero (codes, and x's lanes). */
#define VNNI_PAIR_LANES _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1)

#define VNNI_QUAD_LANES _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)

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

/* int5: int4's nibbles, and the fifth bits straight from the blocks' words as a byte mask */
static inline __m512i vnni_codes_int5(const struct weight *w, int64_t j, int64_t b, __mmask64 half) {
    const uint8_t *block = int5_block(w, j, b);
    const int two = (uint32_t)(half >> 32) != 0;
    uint32_t high[2] = {0, 0};
    memcpy(high, block, 4);
    if (two) memcpy(high + 1, block + 20, 4);
    const __m128i first = _mm_loadu_si128((const __m128i *)(block + 4));
    const __m256i raw = two ? _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(block + 24)), first)
                            : _mm256_castsi128_si256(first);
    const __m512i twice = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3), _mm512_castsi256_si512(raw));
    const __m512i low = _mm512_and_si512(_mm512_srlv_epi64(twice, _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4)),
                                         _mm512_set1_epi8(0x0F));
    return _mm512_mask_add_epi8(low, (__mmask64)high[0] | (__mmask64)high[1] << 32, low, _mm512_set1_epi8(16));
}

/* A K-quant pair is blocks k, k + 1 (k even) of one super-block, and a row holds whole
 * super-blocks: `half` is always both. Their codes come from the same 32 or 64 bytes. */
static inline __m512i vnni_twice(const uint8_t *p) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_inserti64x4(_mm512_castsi256_si512(v), v, 1);
}

/* (v >> first) & mask in the pair's first 32 bytes, (v >> second) & mask in the others */
static inline __m512i vnni_shift_mask(__m512i v, int64_t first, int64_t second, int mask) {
    const __m512i by = _mm512_inserti64x4(_mm512_set1_epi64(first), _mm256_set1_epi64x(second), 1);
    return _mm512_and_si512(_mm512_srlv_epi64(v, by), _mm512_set1_epi8((char)mask));
}

static inline __m512i vnni_codes_q4_k(const struct weight *w, int64_t j, int64_t b, __mmask64 half) {
    (void)half;
    return vnni_shift_mask(vnni_twice(kq_super(w, j, b, Q4_K_BYTES) + 16 + 16 * (b % QK_BLOCKS)), 0, 4, 0x0F);
}

static inline __m512i vnni_codes_q5_k(const struct weight *w, int64_t j, int64_t b, __mmask64 half) {
    (void)half;
    const uint8_t *s = kq_super(w, j, b, Q5_K_BYTES);
    const int64_t k = b % QK_BLOCKS;
    const __m512i low = vnni_shift_mask(vnni_twice(s + 48 + 16 * k), 0, 4, 0x0F);
    return _mm512_or_si512(low, _mm512_slli_epi64(vnni_shift_mask(vnni_twice(s + 16), k, k + 1, 0x01), 4));
}

/* q in 0..63: the pair's low nibbles are 64 bytes in a row (one shift), its high bits one 32 bytes twice */
static inline __m512i vnni_codes_q6_k(const struct weight *w, int64_t j, int64_t b, __mmask64 half) {
    (void)half;
    const uint8_t *s = kq_super(w, j, b, Q6_K_BYTES);
    const int64_t k = b % QK_BLOCKS, shift = 4 * (k / 2 % 2);
    const __m512i low = vnni_shift_mask(_mm512_loadu_si512(s + 64 * (k / 4)), shift, shift, 0x0F);
    const __m512i high = vnni_shift_mask(vnni_twice(s + 128 + 32 * (k / 4)), 2 * (k % 4), 2 * (k % 4) + 2, 0x03);
    return _mm512_or_si512(low, _mm512_slli_epi64(high, 4));
}

/* Row j's scales per block, ws [blocks + 1 + VLANES] (the one past the last 0), and per block
 * what else its pairs' scales need, wm (the K-quants' offsets for row_offsets, Q6_K's second
 * half's scales): read once per row. int4, int5: the group scales. */
static inline void vnni_row_scales_int4(const struct weight *w, int64_t j, int64_t full, float *ws, float *wm) {
    (void)wm;
    const uint16_t *scales = (const uint16_t *)w->scales + j * w->groups;
    if (w->group_shift == 0) {
        halves_to_floats_n(scales, full, ws);
    } else {
        for (int64_t b = 0; b < full; b++) ws[b] = load_f16_scalar(scales[group_of_block(w, b)]); /* scalar: vectorized, gathers */
    }
    ws[full] = 0.0f;
}

static inline void vnni_row_scales_none(const struct weight *w, int64_t j, int64_t full, float *ws, float *wm) {
    (void)w, (void)j, (void)full, (void)ws, (void)wm; /* int8: one scale per row; Q8_0: read with the codes */
}

/* The K-quants' rows have whole super-blocks: an even number of blocks, no pad to zero. */
static inline void vnni_row_scales_q4_k(const struct weight *w, int64_t j, int64_t full, float *ws, float *wm) {
    (void)full;
    block_scales_q4_k(w, j, ws, wm);
}
static inline void vnni_row_scales_q5_k(const struct weight *w, int64_t j, int64_t full, float *ws, float *wm) {
    (void)full;
    block_scales_q5_k(w, j, ws, wm);
}
static inline void vnni_row_scales_q6_k(const struct weight *w, int64_t j, int64_t full, float *ws, float *wm) {
    (void)full;
    block_scales_q6_k(w, j, ws, wm);
}
#define vnni_row_scales_int5 vnni_row_scales_int4
#define vnni_row_scales_int8 vnni_row_scales_none
#define vnni_row_scales_q8_0 vnni_row_scales_none

/* The weight scales of blocks b, b + 1 in the pair's lanes, from what vnni_row_scales prepared. */
static inline __m512 vnni_scales_int8(const struct weight *w, int64_t j, int64_t b, const float *ws, const float *wm) {
    (void)b, (void)ws, (void)wm;
    return _mm512_set1_ps(row_scale(w, j));
}

static inline __m512 vnni_scales_int4(const struct weight *w, int64_t j, int64_t b, const float *ws, const float *wm) {
    (void)w, (void)j, (void)wm;
    return _mm512_permutexvar_ps(VNNI_PAIR_LANES, _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd((const double *)(ws + b)))));
}
#define vnni_scales_int5 vnni_scales_int4
#define vnni_scales_q4_k vnni_scales_int4
#define vnni_scales_q5_k vnni_scales_int4

/* Q6_K: a scale per half block, 4 lanes each: b's first and second, then b + 1's. */
static inline __m512 vnni_scales_q6_k(const struct weight *w, int64_t j, int64_t b, const float *ws, const float *wm) {
    (void)w, (void)j;
    const __m128 first = _mm_castpd_ps(_mm_load_sd((const double *)(ws + b)));
    const __m128 second = _mm_castpd_ps(_mm_load_sd((const double *)(wm + b)));
    return _mm512_permutexvar_ps(VNNI_QUAD_LANES, _mm512_castps128_ps512(_mm_unpacklo_ps(first, second)));
}

/* Two f16 scales 34 bytes apart, joined into one register for one conversion. A row's scales
 * gathered into an array first was slower (the compiler made the strided loop gathers). */
static inline __m512 vnni_scales_q8_0(const struct weight *w, int64_t j, int64_t b, const float *ws, const float *wm) {
    (void)ws, (void)wm;
    const uint8_t *block = (const uint8_t *)w->data + (j * blocks_per_row(w) + b) * 34;
    uint16_t first, second = 0;
    memcpy(&first, block, 2);
    if (b + 1 < blocks_per_row(w)) memcpy(&second, block + 34, 2);
    const __m128 both = _mm_cvtph_ps(_mm_cvtsi32_si128((int)(first | (uint32_t)second << 16)));
    return _mm512_permutexvar_ps(VNNI_PAIR_LANES, _mm512_castps128_ps512(both));
}

/* offset * d_x * (each lane's 4 codes of x summed), in a pair's lanes */
static inline __m512 vnni_lane_offsets(const int8_t *xq, int64_t two, __m512 xdv, float offset) {
    const __m512i xv = vnni_load_pair(xq, two ? ~(__mmask64)0 : (__mmask64)0xFFFFFFFF);
    const __m512i fours = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), xv);
    return _mm512_mul_ps(_mm512_mul_ps(xdv, _mm512_set1_ps(offset)), _mm512_cvtepi32_ps(fours));
}

#define VNNI_OFFSET_int8 (-128)
#define VNNI_OFFSET_q8_0 (-128)
#define VNNI_OFFSET_q6_k (-32)
#define VNNI_OFFSET_int4 0
#define VNNI_OFFSET_int5 0
#define VNNI_OFFSET_q4_k 0
#define VNNI_OFFSET_q5_k 0

/* Products of weight row j with ROWS activation rows (x rounded per block: xq; xdv and xsv laid
 * out per pair as above; gxs, for the formats with minimums, the activation's d * sum(q) per group). */
#define DEFINE_QDOT_VNNI(NAME, FMT, HAS_MIN, ROWS)                                                        \
    static inline void NAME(const struct weight *w, int64_t j, const int8_t *restrict xq,                 \
                            const __m512 *restrict xdv, const __m512 *restrict xsv,                       \
                            const float *restrict gxs, const float *restrict x, float *restrict sums) {   \
        const int64_t k = w->cols, full = k / QBLOCK, pairs = (full + 1) / 2;                             \
        float ws[full + 1 + VLANES], wm[full + 1 + VLANES];                                               \
        vnni_row_scales_##FMT(w, j, full, ws, wm);                                                        \
        __m512 acc[ROWS];                                                                                 \
        for (int i = 0; i < ROWS; i++) acc[i] = _mm512_setzero_ps();                                      \
        for (int64_t p = 0; p < pairs; p++) {                                                             \
            const int64_t b = 2 * p;                                                                      \
            const __mmask64 half = b + 1 < full ? ~(__mmask64)0 : (__mmask64)0xFFFFFFFF;                 \
            const __m512i codes = vnni_codes_##FMT(w, j, b, half);                                        \
            const __m512 wsv = vnni_scales_##FMT(w, j, b, ws, wm);                                        \
            for (int i = 0; i < ROWS; i++) {                                                              \
                const __m512i xv = vnni_load_pair(xq + (i * full + b) * QBLOCK, half);                    \
                const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, xv)); \
                const __m512 t = VNNI_OFFSET_##FMT ? _mm512_fmadd_ps(xdv[i * pairs + p], dot, xsv[i * pairs + p]) \
                                                   : _mm512_mul_ps(xdv[i * pairs + p], dot);              \
                acc[i] = _mm512_fmadd_ps(wsv, t, acc[i]);                                                 \
            }                                                                                             \
        }                                                                                                 \
        for (int i = 0; i < ROWS; i++) {                                                                  \
            if (HAS_MIN) acc[i] = row_offsets_##FMT(w, j, wm, gxs + i * w->groups, acc[i]);               \
            sums[i] = _mm512_reduce_add_ps(acc[i]) + qdot_tail_##FMT(w, j, x + i * k);                    \
        }                                                                                                 \
    }

#define DEFINE_QMATVEC_A8(FMT, HAS_MIN)                                                                   \
    DEFINE_QDOT_VNNI(qdot_a8_##FMT##_4, FMT, HAS_MIN, 4)                                                  \
    DEFINE_QDOT_VNNI(qdot_a8_##FMT##_1, FMT, HAS_MIN, 1)                                                  \
    static inline void qmatvec_a8_##FMT(const struct weight *w, const float *restrict x, float *restrict y, \
                                        int64_t ldy, int64_t m) {                                         \
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
                if (VNNI_OFFSET_##FMT)                                                                    \
                    xsv[i * pairs + p] = vnni_lane_offsets(xq + b * QBLOCK, two, xdv[i * pairs + p], VNNI_OFFSET_##FMT); \
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
                for (int64_t i = 0; i < rows; i++) y[(i0 + i) * ldy + j] = sums[i] + (bias ? bias[j] : 0.0f); \
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
                                        int64_t ldy, int64_t m) {                                         \
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
                for (int64_t i = 0; i < rows; i++) y[(i0 + i) * ldy + j] = sums[i] + (bias ? bias[j] : 0.0f); \
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
                                     int64_t ldy, int64_t m) {                                            \
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
                        y[(i0 + i) * ldy + j + r] = sums[r * rows + i] + (bias ? bias[j + r] : 0.0f);     \
                i0 += rows;                                                                               \
            }                                                                                             \
        }                                                                                                 \
    }                                                                                                     \
                                                                                                          \
    /* The same for many rows: panels of QPANEL weight rows dequantized into `panel` (this thread's  \
     * scratch, QPANEL * cols floats), then multiplied into every activation row. */                      \
    static inline void qmatmul_##FMT(const struct weight *w, const float *restrict x, float *restrict y,  \
                                     int64_t ldy, int64_t m, float *restrict panel) {                     \
        const int64_t n = w->rows, k = w->cols;                                                           \
        _Pragma("omp for schedule(static)")                                                               \
        for (int64_t j0 = 0; j0 < n; j0 += QPANEL) {                                                      \
            const int64_t p = n - j0 < QPANEL ? n - j0 : QPANEL;                                          \
            for (int64_t r = 0; r < p; r++) qrow_##FMT(w, j0 + r, panel + r * k);                         \
            panel_product(panel, p, x, m, k, (const float *)w->bias, j0, y, ldy);                         \
        }                                                                                                 \
    }

/* y[:, j0 : j0 + p] = x [m, k] @ panel [p, k]^T (+ bias), y's rows ldy apart, in tiles of QTILE
 * activation rows x the panel's rows: 12 accumulators of 8 lanes held in registers, each x and
 * panel vector loaded once per tile. A short tile or panel repeats its first row rather than
 * branch in the loop. */
static inline void panel_product(const float *restrict panel, int64_t p, const float *restrict x, int64_t m,
                                 int64_t k, const float *restrict bias, int64_t j0, float *restrict y, int64_t ldy) {
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
                y[(i0 + i) * ldy + j0 + r] = s + (bias ? bias[j0 + r] : 0.0f);
            }
        }
    }
}

DEFINE_QFORMAT(int8, 0)
DEFINE_QFORMAT(fp8, 0)
DEFINE_QFORMAT(int4, 1)
DEFINE_QFORMAT(nf4, 0)
DEFINE_QFORMAT(q8_0, 0)
DEFINE_QFORMAT(int5, 1)
DEFINE_QFORMAT(q4_k, 1)
DEFINE_QFORMAT(q5_k, 1)
DEFINE_QFORMAT(q6_k, 0)
DEFINE_QMATVEC_A8(int8, 0)
DEFINE_QMATVEC_A8(q8_0, 0)
DEFINE_QMATVEC_A8(int4, 1)
DEFINE_QMATVEC_A8(int5, 1)
DEFINE_QMATVEC_A8(q4_k, 1)
DEFINE_QMATVEC_A8(q5_k, 1)
DEFINE_QMATVEC_A8(q6_k, 0)

/* ---- tiles of 16 rows: the integer products' own layouts -------------------------------------
 *
 * WEIGHT_INT4X16, WEIGHT_INT5X16, WEIGHT_Q8_0X16, WEIGHT_Q4_KX16, WEIGHT_Q5_KX16 and WEIGHT_Q6_KX16
 * are int4 with a scale per block (GGUF's Q4_0 and Q4_1, int4 at group 32), int5 (Q5_0 and Q5_1),
 * and GGUF's Q8_0, Q4_K, Q5_K and Q6_K with their rows interleaved the way the integer products
 * read them;
 * quant/modules.py lays a weight out so once it takes int8 activations on a CPU (the file's
 * bytes, reordered). Tile T holds rows 16 T .. 16 T + 15, and per block b:
 *
 *   int4x16, 320 bytes   codes [4 words][16 lanes][4 bytes]: word t of lane l is bytes 4t .. 4t + 3
 *                        of row 16 T + l's block (elements 4t .. 4t + 3 low, 4t + 16 .. high), then
 *                        d [16], min [16] in f16: w = d * code + min
 *   int5x16, 384 bytes   int4x16's nibble words, then the fifth bits as a fifth word: byte e of lane
 *                        l holds in bit t the fifth bit of element 4t + e (so word t's fifth bits
 *                        are one bit of every byte, one shift away from bit 4), then d, min
 *   q4_kx16              per super-block of 8 blocks: 8 records of 288 bytes (int4x16's nibble
 *                        words, the blocks' 6-bit scales sc [16] and minimums m [16] as bytes),
 *                        then the rows' d [16] and dmin [16] in f16: w = d sc code - dmin m. 296
 *                        bytes a block; the file's scales unpacked (its 12 bytes of 6-bit fields)
 *   q5_kx16              q4_kx16 with int5x16's fifth-bit word after the nibble words: records of
 *                        352 bytes (codes 320, sc 16, m 16), then d and dmin: 360 bytes a block
 *   q6_kx16              per super-block: 8 records of 416 bytes (int4x16's words of each code's
 *                        low 4 bits, then two words of their high 2 bits: byte e of lane l holds in
 *                        bits 2t, 2t + 1 those of element 4t + e, the second word of 16 + 4t + e;
 *                        then the signed scales of the block's halves, sc_lo [16] and sc_hi [16]),
 *                        then d [16] in f16: w = d sc_half (code - 32). 420 bytes a block, the
 *                        file's 210 per 256 columns of a row
 *   q8_0x16, 544 bytes   codes [8 words][16 lanes][4 bytes]: word t of lane l is elements 4t .. 4t + 3
 *                        of row 16 T + l's block, each + 128 (unsigned), then d [16] in f16: w = d * q
 *
 * One vector load is a word of all 16 rows (int4: a mask gives 4 codes of each row, a shift and a
 * mask 4 more), and one `vpdpbusd` against 4 bytes of an activation row broadcast leaves every
 * row's partial dot product in its own lane: the batched product's panel (quant_gemm.h), stored
 * so rather than packed on every call, at the file's size. A tile is one stream and no sum
 * crosses lanes, where the row-major decode product reduced 16 lanes per row. The + 128 of q8_0's
 * codes is taken back as an offset, -128 d per unit of x's sum (xs), as the panels do; AVX2's
 * `maddubs` would overflow on it, so there the codes are turned back to signed and multiplied as
 * |c| by x with c's sign. Q6_K's scale per 16 columns splits each block's sum into its halves
 * (words 0..3 and 4..7), and its codes' - 32 comes off each half as 32 x the half's sum of x
 * (vpdpbusd of ones against the same broadcast words). Measured on an AMD EPYC (Zen 4, AVX-512 VNNI, 2 threads), SmolLM2's 120
 * layer products alone: 1.6 ms a token instead of 2.9; its decode steps in the engine: one
 * sequence 5.65 -> 4.25 ms, 32 sequences 52 -> 47 ms (against the panel product with its
 * packing). So one product serves every number of rows: the decode half (qmatvec_a8_<fmt>x16)
 * and the batched half (quant_gemm.h's qmatmul_a8_<fmt>x16) differ only in who rounds x. Rows
 * past the last whole tile are zero (codes of zeros, d 0); rows are whole blocks (only such
 * weights are laid out so).
 */
#define X16_ROWS 16
#define X16_BYTES_int4x16 320 /* a tile's bytes per block of its rows */
#define X16_BYTES_int5x16 384
#define X16_BYTES_q8_0x16 544
#define X16_BYTES_q4_kx16 296
#define X16_BYTES_q6_kx16 420
#define X16_BYTES_q5_kx16 360
#define X16_SCALES_int4x16 256 /* where d starts in a block; int4's and int5's minimums follow */
#define X16_SCALES_int5x16 320
#define X16_SCALES_q8_0x16 512
#define X16_FIFTH 256 /* where int5x16's fifth bits start in a block */
#define X16_Q4K_RECORD 288 /* a q4_kx16 block's codes, sc and m; a super-block's 8, then d and dmin */
#define X16_Q4K_SUPER (QK_BLOCKS * X16_Q4K_RECORD + 4 * X16_ROWS)
#define X16_Q5K_RECORD 352 /* a q5_kx16 block's codes (with their fifth bits), sc and m */
#define X16_Q5K_SUPER (QK_BLOCKS * X16_Q5K_RECORD + 4 * X16_ROWS)
#define X16_Q6K_RECORD 416 /* a q6_kx16 block's codes, high bits and scales; a super-block's 8, then d */
#define X16_Q6K_SUPER (QK_BLOCKS * X16_Q6K_RECORD + 2 * X16_ROWS)
#define X16_Q6K_HIGH 256 /* where a q6_kx16 record's high bits start, its two scales at 384 and 400 */
/* Where block b starts in its tile */
#define X16_AT_int4x16(b) ((b) * X16_BYTES_int4x16)
#define X16_AT_int5x16(b) ((b) * X16_BYTES_int5x16)
#define X16_AT_q8_0x16(b) ((b) * X16_BYTES_q8_0x16)
#define X16_AT_q4_kx16(b) ((b) / QK_BLOCKS * X16_Q4K_SUPER + (b) % QK_BLOCKS * X16_Q4K_RECORD)
#define X16_AT_q6_kx16(b) ((b) / QK_BLOCKS * X16_Q6K_SUPER + (b) % QK_BLOCKS * X16_Q6K_RECORD)
#define X16_AT_q5_kx16(b) ((b) / QK_BLOCKS * X16_Q5K_SUPER + (b) % QK_BLOCKS * X16_Q5K_RECORD)
/* A K-quant block's super-block scales, after its super-block's records */
#define X16_SUPER_q4_kx16(tile, b) ((tile) + (b) / QK_BLOCKS * X16_Q4K_SUPER + QK_BLOCKS * X16_Q4K_RECORD)
#define X16_SUPER_q6_kx16(tile, b) ((tile) + (b) / QK_BLOCKS * X16_Q6K_SUPER + QK_BLOCKS * X16_Q6K_RECORD)
#define X16_SUPER_q5_kx16(tile, b) ((tile) + (b) / QK_BLOCKS * X16_Q5K_SUPER + QK_BLOCKS * X16_Q5K_RECORD)
#define x16_codes_q4_kx16 x16_codes_int4x16
#define x16_codes_q5_kx16 x16_codes_int5x16
/* X16_SIGNED: codes stored + 128, signed again on AVX2. X16_HALVES: a scale per half block (each
 * half's sum apart), codes - 32. */
#define X16_SIGNED_int4x16 0
#define X16_SIGNED_int5x16 0
#define X16_SIGNED_q8_0x16 1
#define X16_SIGNED_q4_kx16 0
#define X16_SIGNED_q6_kx16 0
#define X16_SIGNED_q5_kx16 0
#define X16_HALVES_int4x16 0
#define X16_HALVES_int5x16 0
#define X16_HALVES_q8_0x16 0
#define X16_HALVES_q4_kx16 0
#define X16_HALVES_q6_kx16 1
#define X16_HALVES_q5_kx16 0

/* out[i][l] = row l of a tile times activation row i, for ROWS rows (x rounded per block: xq
 * codes, xd scales and xs = xd * sum of codes, `full` blocks per row). */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* A block's 8 words of unsigned codes, and the offsets' vector (per unit of xs) */
static inline void x16_codes_int4x16(const uint8_t *p, __m512i c[8]) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int t = 0; t < 4; t++) {
        const __m512i v = _mm512_loadu_si512((const void *)(p + 64 * t));
        c[t] = _mm512_and_si512(v, low);
        c[t + 4] = _mm512_and_si512(_mm512_srli_epi32(v, 4), low);
    }
}
/* int5: int4's codes with bit t of the fifth word's bytes moved to bit 4 (16-bit shifts: the
 * bit that lands on bit 4 comes from its own byte) and or-ed in (vpternlogd: a | b & c) */
static inline void x16_codes_int5x16(const uint8_t *p, __m512i c[8]) {
    const __m512i fifth = _mm512_loadu_si512((const void *)(p + X16_FIFTH)), bit4 = _mm512_set1_epi8(0x10);
    x16_codes_int4x16(p, c);
    for (int t = 0; t < 4; t++) {
        c[t] = _mm512_ternarylogic_epi32(c[t], _mm512_slli_epi16(fifth, 4 - t), bit4, 0xF8);
        c[t + 4] = _mm512_ternarylogic_epi32(c[t + 4], _mm512_srli_epi16(fifth, t), bit4, 0xF8);
    }
}
static inline void x16_codes_q8_0x16(const uint8_t *p, __m512i c[8]) {
    for (int t = 0; t < 8; t++) c[t] = _mm512_loadu_si512((const void *)(p + 64 * t));
}
/* Q6_K: int4's codes with bits 2t, 2t + 1 of a high-bits word's bytes moved to bits 4, 5 */
static inline void x16_codes_q6_kx16(const uint8_t *p, __m512i c[8]) {
    const __m512i bits = _mm512_set1_epi8(0x30);
    x16_codes_int4x16(p, c);
    for (int h = 0; h < 2; h++) {
        const __m512i high = _mm512_loadu_si512((const void *)(p + X16_Q6K_HIGH + 64 * h));
        for (int t = 0; t < 4; t++) {
            const __m512i moved = t < 3 ? _mm512_slli_epi16(high, 4 - 2 * t) : _mm512_srli_epi16(high, 2);
            c[4 * h + t] = _mm512_ternarylogic_epi32(c[4 * h + t], moved, bits, 0xF8);
        }
    }
}
/* Block b's 16 scales d (X16_HALVES: the first half's, and hi the second's) and offsets o (per unit
 * of x's sum, xs), its record at p in `tile` */
static inline __m512 x16_halves(const uint8_t *at) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)at)); }
static inline void x16_scales_int4x16(const uint8_t *tile, int64_t b, const uint8_t *p, __m512 *d, __m512 *hi,
                                     __m512 *o) {
    (void)tile, (void)b, (void)hi;
    *d = x16_halves(p + X16_SCALES_int4x16);
    *o = x16_halves(p + X16_SCALES_int4x16 + 2 * X16_ROWS);
}
static inline void x16_scales_int5x16(const uint8_t *tile, int64_t b, const uint8_t *p, __m512 *d, __m512 *hi,
                                     __m512 *o) {
    (void)tile, (void)b, (void)hi;
    *d = x16_halves(p + X16_SCALES_int5x16);
    *o = x16_halves(p + X16_SCALES_int5x16 + 2 * X16_ROWS);
}
static inline void x16_scales_q8_0x16(const uint8_t *tile, int64_t b, const uint8_t *p, __m512 *d, __m512 *hi,
                                     __m512 *o) {
    (void)tile, (void)b, (void)hi;
    *d = x16_halves(p + X16_SCALES_q8_0x16);
    *o = _mm512_mul_ps(*d, _mm512_set1_ps(-128.0f));
}
static inline __m512 x16_bytes(const uint8_t *at) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)at)));
}
/* Q4_K, Q5_K: d sc and -dmin m per row, sc and m as bytes at `at` in the record */
static inline void x16_k_scales(const uint8_t *super, const uint8_t *at, __m512 *d, __m512 *o) {
    *d = _mm512_mul_ps(x16_halves(super), x16_bytes(at));
    *o = _mm512_mul_ps(x16_halves(super + 2 * X16_ROWS), _mm512_sub_ps(_mm512_setzero_ps(), x16_bytes(at + X16_ROWS)));
}
static inline void x16_scales_q4_kx16(const uint8_t *tile, int64_t b, const uint8_t *p, __m512 *d, __m512 *hi,
                                      __m512 *o) {
    (void)hi;
    x16_k_scales(X16_SUPER_q4_kx16(tile, b), p + 256, d, o);
}
static inline void x16_scales_q5_kx16(const uint8_t *tile, int64_t b, const uint8_t *p, __m512 *d, __m512 *hi,
                                      __m512 *o) {
    (void)hi;
    x16_k_scales(X16_SUPER_q5_kx16(tile, b), p + 320, d, o);
}
static inline __m512 x16_signed_bytes(const uint8_t *at) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)at)));
}
static inline void x16_scales_q6_kx16(const uint8_t *tile, int64_t b, const uint8_t *p, __m512 *d, __m512 *hi,
                                      __m512 *o) {
    const __m512 super = x16_halves(X16_SUPER_q6_kx16(tile, b));
    *d = _mm512_mul_ps(super, x16_signed_bytes(p + X16_Q6K_HIGH + 128));
    *hi = _mm512_mul_ps(super, x16_signed_bytes(p + X16_Q6K_HIGH + 144));
    *o = _mm512_setzero_ps();
}

#define DEFINE_X16_TILE(FMT, ROWS)                                                                        \
    static inline void x16_tile_##FMT##_##ROWS(const uint8_t *restrict tile, int64_t full, const int8_t *restrict xq, \
                                               const float *restrict xd, const float *restrict xs,       \
                                               float out[][X16_ROWS]) {                                   \
        __m512 acc[ROWS];                                                                                 \
        for (int i = 0; i < ROWS; i++) acc[i] = _mm512_setzero_ps();                                      \
        for (int64_t b = 0; b < full; b++) {                                                              \
            const uint8_t *p = tile + X16_AT_##FMT(b);                                                    \
            __m512i c[8];                                                                                 \
            __m512 d, hi, o;                                                                              \
            x16_codes_##FMT(p, c);                                                                        \
            x16_scales_##FMT(tile, b, p, &d, &hi, &o);                                                    \
            for (int i = 0; i < ROWS; i++) {                                                              \
                const int8_t *x = xq + (i * full + b) * QBLOCK;                                           \
                /* the halves sum in two chains, so a row's 8 products do not wait on each other */       \
                __m512i dot[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};                       \
                __m512i sum[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};                       \
                for (int t = 0; t < 8; t++) {                                                             \
                    const __m512i xv = _mm512_set1_epi32(qg_word(x + 4 * t));                             \
                    dot[t / 4] = _mm512_dpbusd_epi32(dot[t / 4], c[t], xv);                               \
                    if (X16_HALVES_##FMT) sum[t / 4] = _mm512_dpbusd_epi32(sum[t / 4], _mm512_set1_epi8(1), xv); \
                }                                                                                         \
                const __m512 xdv = _mm512_set1_ps(xd[i * full + b]);                                      \
                if (X16_HALVES_##FMT) {                                                                   \
                    for (int h = 0; h < 2; h++) /* codes - 32 */                                          \
                        dot[h] = _mm512_sub_epi32(dot[h], _mm512_slli_epi32(sum[h], 5));                  \
                    acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(d, xdv), _mm512_cvtepi32_ps(dot[0]), acc[i]);  \
                    acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(hi, xdv), _mm512_cvtepi32_ps(dot[1]), acc[i]); \
                } else {                                                                                  \
                    const __m512 both = _mm512_cvtepi32_ps(_mm512_add_epi32(dot[0], dot[1]));             \
                    acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(d, xdv), both, acc[i]);                        \
                    acc[i] = _mm512_fmadd_ps(o, _mm512_set1_ps(xs[i * full + b]), acc[i]);                \
                }                                                                                         \
            }                                                                                             \
        }                                                                                                 \
        for (int i = 0; i < ROWS; i++) _mm512_storeu_ps(out[i], acc[i]);                                  \
    }
#elif defined(__AVX2__)
/* A tile as two halves of 8 lanes (bytes 32 h .. 32 h + 31 of each word vector). Unsigned codes
 * add up in int16 for X16_WIDEN words, then widen: int4's 8 (8 x 2 x 15 x 127 < 32767), int5's 4
 * (4 x 2 x 31 x 127). q8_0's codes, signed again: |c| times x with c's sign, widened per word (a
 * pair alone nearly fills int16). */
#define X16_WIDEN_int4x16 8
#define X16_WIDEN_int5x16 4
#define X16_WIDEN_q8_0x16 1
#define X16_WIDEN_q4_kx16 8
#define X16_WIDEN_q6_kx16 2 /* 2 x 2 x 63 x 127 */
#define X16_WIDEN_q5_kx16 4
static inline void x16_codes_int4x16(const uint8_t *p, int h, __m256i c[8]) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int t = 0; t < 4; t++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(p + 64 * t + 32 * h));
        c[t] = _mm256_and_si256(v, low);
        c[t + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    }
}
static inline void x16_codes_int5x16(const uint8_t *p, int h, __m256i c[8]) {
    const __m256i fifth = _mm256_loadu_si256((const __m256i *)(p + X16_FIFTH + 32 * h)), bit4 = _mm256_set1_epi8(0x10);
    x16_codes_int4x16(p, h, c);
    for (int t = 0; t < 4; t++) {
        c[t] = _mm256_or_si256(c[t], _mm256_and_si256(_mm256_slli_epi16(fifth, 4 - t), bit4));
        c[t + 4] = _mm256_or_si256(c[t + 4], _mm256_and_si256(_mm256_srli_epi16(fifth, t), bit4));
    }
}
static inline void x16_codes_q6_kx16(const uint8_t *p, int h, __m256i c[8]) {
    const __m256i bits = _mm256_set1_epi8(0x30);
    x16_codes_int4x16(p, h, c);
    for (int w = 0; w < 2; w++) {
        const __m256i high = _mm256_loadu_si256((const __m256i *)(p + X16_Q6K_HIGH + 64 * w + 32 * h));
        for (int t = 0; t < 4; t++) {
            const __m256i moved = t < 3 ? _mm256_slli_epi16(high, 4 - 2 * t) : _mm256_srli_epi16(high, 2);
            c[4 * w + t] = _mm256_or_si256(c[4 * w + t], _mm256_and_si256(moved, bits));
        }
    }
}
static inline void x16_codes_q8_0x16(const uint8_t *p, int h, __m256i c[8]) {
    for (int t = 0; t < 8; t++)
        c[t] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(p + 64 * t + 32 * h)), _mm256_set1_epi8(-128));
}
/* Half h's 8 scales d (and hi), offsets o (q8_0's codes are signed again here: none) */
static inline __m256 x16_halves(const uint8_t *at) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)at)); }
static inline void x16_scales_int4x16(const uint8_t *tile, int64_t b, const uint8_t *p, int h, __m256 *d,
                                     __m256 *hi, __m256 *o) {
    (void)tile, (void)b, (void)hi;
    *d = x16_halves(p + X16_SCALES_int4x16 + 16 * h);
    *o = x16_halves(p + X16_SCALES_int4x16 + 2 * X16_ROWS + 16 * h);
}
static inline void x16_scales_int5x16(const uint8_t *tile, int64_t b, const uint8_t *p, int h, __m256 *d,
                                     __m256 *hi, __m256 *o) {
    (void)tile, (void)b, (void)hi;
    *d = x16_halves(p + X16_SCALES_int5x16 + 16 * h);
    *o = x16_halves(p + X16_SCALES_int5x16 + 2 * X16_ROWS + 16 * h);
}
static inline void x16_scales_q8_0x16(const uint8_t *tile, int64_t b, const uint8_t *p, int h, __m256 *d,
                                     __m256 *hi, __m256 *o) {
    (void)tile, (void)b, (void)hi;
    *d = x16_halves(p + X16_SCALES_q8_0x16 + 16 * h);
    *o = _mm256_setzero_ps();
}
static inline __m256 x16_bytes(const uint8_t *at) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)at)));
}
static inline void x16_k_scales(const uint8_t *super, const uint8_t *at, int h, __m256 *d, __m256 *o) {
    *d = _mm256_mul_ps(x16_halves(super + 16 * h), x16_bytes(at + 8 * h));
    *o = _mm256_mul_ps(x16_halves(super + 2 * X16_ROWS + 16 * h),
                       _mm256_sub_ps(_mm256_setzero_ps(), x16_bytes(at + X16_ROWS + 8 * h)));
}
static inline void x16_scales_q4_kx16(const uint8_t *tile, int64_t b, const uint8_t *p, int h, __m256 *d,
                                      __m256 *hi, __m256 *o) {
    (void)hi;
    x16_k_scales(X16_SUPER_q4_kx16(tile, b), p + 256, h, d, o);
}
static inline void x16_scales_q5_kx16(const uint8_t *tile, int64_t b, const uint8_t *p, int h, __m256 *d,
                                      __m256 *hi, __m256 *o) {
    (void)hi;
    x16_k_scales(X16_SUPER_q5_kx16(tile, b), p + 320, h, d, o);
}
static inline __m256 x16_signed_bytes(const uint8_t *at) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)at)));
}
static inline void x16_scales_q6_kx16(const uint8_t *tile, int64_t b, const uint8_t *p, int h, __m256 *d,
                                      __m256 *hi, __m256 *o) {
    const __m256 super = x16_halves(X16_SUPER_q6_kx16(tile, b) + 16 * h);
    *d = _mm256_mul_ps(super, x16_signed_bytes(p + X16_Q6K_HIGH + 128 + 8 * h));
    *hi = _mm256_mul_ps(super, x16_signed_bytes(p + X16_Q6K_HIGH + 144 + 8 * h));
    *o = _mm256_setzero_ps();
}

#define DEFINE_X16_TILE(FMT, ROWS)                                                                        \
    static inline void x16_tile_##FMT##_##ROWS(const uint8_t *restrict tile, int64_t full, const int8_t *restrict xq, \
                                               const float *restrict xd, const float *restrict xs,       \
                                               float out[][X16_ROWS]) {                                   \
        const __m256i ones = _mm256_set1_epi16(1);                                                        \
        for (int h = 0; h < 2; h++) {                                                                     \
            __m256 acc[ROWS];                                                                             \
            for (int i = 0; i < ROWS; i++) acc[i] = _mm256_setzero_ps();                                  \
            for (int64_t b = 0; b < full; b++) {                                                          \
                const uint8_t *p = tile + X16_AT_##FMT(b);                                                \
                __m256i c[8], magnitude[8];                                                               \
                __m256 d, hi, o;                                                                          \
                x16_codes_##FMT(p, h, c);                                                                 \
                if (X16_SIGNED_##FMT)                                                                     \
                    for (int t = 0; t < 8; t++) magnitude[t] = _mm256_abs_epi8(c[t]);                     \
                x16_scales_##FMT(tile, b, p, h, &d, &hi, &o);                                             \
                for (int i = 0; i < ROWS; i++) {                                                          \
                    const int8_t *x = xq + (i * full + b) * QBLOCK;                                       \
                    __m256i dot[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};                    \
                    __m256i pairs = _mm256_setzero_si256(), sums = _mm256_setzero_si256();                \
                    for (int t = 0; t < 8; t++) {                                                         \
                        const __m256i xv = _mm256_set1_epi32(qg_word(x + 4 * t));                         \
                        if (X16_SIGNED_##FMT)                                                             \
                            dot[t / 4] = _mm256_add_epi32(dot[t / 4], _mm256_madd_epi16(                  \
                                _mm256_maddubs_epi16(magnitude[t], _mm256_sign_epi8(xv, c[t])), ones));   \
                        else                                                                              \
                            pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(c[t], xv));              \
                        if (!X16_SIGNED_##FMT && (t + 1) % X16_WIDEN_##FMT == 0) {                        \
                            dot[t / 4] = _mm256_add_epi32(dot[t / 4], _mm256_madd_epi16(pairs, ones));    \
                            pairs = _mm256_setzero_si256();                                               \
                        }                                                                                 \
                        if (X16_HALVES_##FMT) { /* the half's sum of x, in int16 (4 x 2 x 127) */         \
                            sums = _mm256_add_epi16(sums, _mm256_maddubs_epi16(_mm256_set1_epi8(1), xv)); \
                            if (t % 4 == 3) {                                                             \
                                dot[t / 4] = _mm256_sub_epi32(dot[t / 4],                                 \
                                    _mm256_slli_epi32(_mm256_madd_epi16(sums, ones), 5)); /* codes - 32 */ \
                                sums = _mm256_setzero_si256();                                            \
                            }                                                                             \
                        }                                                                                 \
                    }                                                                                     \
                    const __m256 xdv = _mm256_set1_ps(xd[i * full + b]);                                  \
                    if (X16_HALVES_##FMT) {                                                               \
                        acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(d, xdv), _mm256_cvtepi32_ps(dot[0]), acc[i]); \
                        acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(hi, xdv), _mm256_cvtepi32_ps(dot[1]), acc[i]); \
                    } else {                                                                              \
                        const __m256 both = _mm256_cvtepi32_ps(_mm256_add_epi32(dot[0], dot[1]));         \
                        acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(d, xdv), both, acc[i]);                    \
                        acc[i] = _mm256_fmadd_ps(o, _mm256_set1_ps(xs[i * full + b]), acc[i]);            \
                    }                                                                                     \
                }                                                                                         \
            }                                                                                             \
            for (int i = 0; i < ROWS; i++) _mm256_storeu_ps(out[i] + 8 * h, acc[i]);                      \
        }                                                                                                 \
    }
#else
/* Code e of word t of lane l, and lane l's offset (per unit of xs) */
static inline int32_t x16_code_int4x16(const uint8_t *p, int t, int l, int e) {
    const uint8_t byte = p[64 * (t % 4) + 4 * l + e];
    return t < 4 ? byte & 15 : byte >> 4;
}
static inline int32_t x16_code_int5x16(const uint8_t *p, int t, int l, int e) {
    return x16_code_int4x16(p, t, l, e) | (p[X16_FIFTH + 4 * l + e] >> t & 1) << 4;
}
#define x16_code_q4_kx16 x16_code_int4x16
#define x16_code_q5_kx16 x16_code_int5x16
static inline int32_t x16_code_q6_kx16(const uint8_t *p, int t, int l, int e) { /* code - 32 */
    const uint8_t high = p[X16_Q6K_HIGH + 64 * (t / 4) + 4 * l + e] >> (2 * (t % 4)) & 3;
    return (x16_code_int4x16(p, t, l, e) | high << 4) - 32;
}
static inline int32_t x16_code_q8_0x16(const uint8_t *p, int t, int l, int e) {
    return (int8_t)(p[64 * t + 4 * l + e] ^ 0x80);
}
/* Lane l's scale d (X16_HALVES: the first half's, hi the second's) and offset o (per unit of xs)
 * for block b, its record at p in `tile` */
static inline float x16_half(const uint8_t *at) {
    uint16_t h;
    memcpy(&h, at, 2);
    return load_f16_scalar(h);
}
static inline void x16_scale_int4x16(const uint8_t *tile, int64_t b, const uint8_t *p, int l, float *d, float *hi,
                                    float *o) {
    (void)tile, (void)b, (void)hi;
    *d = x16_half(p + X16_SCALES_int4x16 + 2 * l);
    *o = x16_half(p + X16_SCALES_int4x16 + 2 * X16_ROWS + 2 * l);
}
static inline void x16_scale_int5x16(const uint8_t *tile, int64_t b, const uint8_t *p, int l, float *d, float *hi,
                                    float *o) {
    (void)tile, (void)b, (void)hi;
    *d = x16_half(p + X16_SCALES_int5x16 + 2 * l);
    *o = x16_half(p + X16_SCALES_int5x16 + 2 * X16_ROWS + 2 * l);
}
static inline void x16_scale_q8_0x16(const uint8_t *tile, int64_t b, const uint8_t *p, int l, float *d, float *hi,
                                    float *o) {
    (void)tile, (void)b, (void)hi;
    *d = x16_half(p + X16_SCALES_q8_0x16 + 2 * l);
    *o = 0.0f;
}
static inline void x16_k_scale(const uint8_t *super, const uint8_t *at, int l, float *d, float *o) {
    *d = x16_half(super + 2 * l) * (float)at[l];
    *o = -x16_half(super + 2 * X16_ROWS + 2 * l) * (float)at[X16_ROWS + l];
}
static inline void x16_scale_q4_kx16(const uint8_t *tile, int64_t b, const uint8_t *p, int l, float *d, float *hi,
                                     float *o) {
    (void)hi;
    x16_k_scale(X16_SUPER_q4_kx16(tile, b), p + 256, l, d, o);
}
static inline void x16_scale_q5_kx16(const uint8_t *tile, int64_t b, const uint8_t *p, int l, float *d, float *hi,
                                     float *o) {
    (void)hi;
    x16_k_scale(X16_SUPER_q5_kx16(tile, b), p + 320, l, d, o);
}
static inline void x16_scale_q6_kx16(const uint8_t *tile, int64_t b, const uint8_t *p, int l, float *d, float *hi,
                                     float *o) {
    const float super = x16_half(X16_SUPER_q6_kx16(tile, b) + 2 * l);
    *d = super * (float)(int8_t)p[X16_Q6K_HIGH + 128 + l];
    *hi = super * (float)(int8_t)p[X16_Q6K_HIGH + 144 + l];
    *o = 0.0f;
}

#define DEFINE_X16_TILE(FMT, ROWS)                                                                        \
    static inline void x16_tile_##FMT##_##ROWS(const uint8_t *restrict tile, int64_t full, const int8_t *restrict xq, \
                                               const float *restrict xd, const float *restrict xs,       \
                                               float out[][X16_ROWS]) {                                   \
        for (int i = 0; i < ROWS; i++)                                                                    \
            for (int l = 0; l < X16_ROWS; l++) out[i][l] = 0.0f;                                          \
        for (int64_t b = 0; b < full; b++) {                                                              \
            const uint8_t *p = tile + X16_AT_##FMT(b);                                                    \
            for (int i = 0; i < ROWS; i++) {                                                              \
                const int8_t *x = xq + (i * full + b) * QBLOCK;                                           \
                for (int l = 0; l < X16_ROWS; l++) {                                                      \
                    int32_t dot[2] = {0, 0};                                                              \
                    for (int t = 0; t < 8; t++)                                                           \
                        for (int e = 0; e < 4; e++) dot[t / 4] += x16_code_##FMT(p, t, l, e) * x[4 * t + e]; \
                    float d, hi, o;                                                                       \
                    x16_scale_##FMT(tile, b, p, l, &d, &hi, &o);                                          \
                    out[i][l] += X16_HALVES_##FMT ? (d * (float)dot[0] + hi * (float)dot[1]) * xd[i * full + b] \
                                                  : d * xd[i * full + b] * (float)(dot[0] + dot[1])       \
                                                    + o * xs[i * full + b];                               \
                }                                                                                         \
            }                                                                                             \
        }                                                                                                 \
    }
#endif

/* y [m, ldy] columns [0, w->rows) = x @ w^T (+ bias) with x rounded already (xq, xd, xs as
 * quantize_activations leaves them), in the calling parallel region: a tile per iteration,
 * multiplied into the activation rows 8 at a time while it sits in L1. The decode half rounds x
 * by every thread into its own stack, as qmatvec_a8 does. */
#define DEFINE_X16(FMT)                                                                                   \
    DEFINE_X16_TILE(FMT, 8)                                                                               \
    DEFINE_X16_TILE(FMT, 4)                                                                               \
    DEFINE_X16_TILE(FMT, 2)                                                                               \
    DEFINE_X16_TILE(FMT, 1)                                                                               \
    static inline void x16_product_##FMT(const struct weight *w, const int8_t *restrict xq,                \
                                         const float *restrict xd, const float *restrict xs,              \
                                         float *restrict y, int64_t ldy, int64_t m) {                     \
        const int64_t n = w->rows, full = w->blocks, tiles = (n + X16_ROWS - 1) / X16_ROWS;               \
        const float *bias = (const float *)w->bias;                                                       \
        _Pragma("omp for schedule(static)")                                                               \
        for (int64_t tile = 0; tile < tiles; tile++) {                                                    \
            const uint8_t *codes = (const uint8_t *)w->data + tile * full * X16_BYTES_##FMT;              \
            const int64_t j0 = tile * X16_ROWS, nr = n - j0 < X16_ROWS ? n - j0 : X16_ROWS;               \
            for (int64_t i0 = 0; i0 < m;) {                                                               \
                float out[8][X16_ROWS];                                                                   \
                const int64_t left = m - i0, rows = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;    \
                const int8_t *xqi = xq + i0 * full * QBLOCK;                                              \
                const float *xdi = xd + i0 * full, *xsi = xs + i0 * full;                                 \
                if (rows == 8) x16_tile_##FMT##_8(codes, full, xqi, xdi, xsi, out);                       \
                else if (rows == 4) x16_tile_##FMT##_4(codes, full, xqi, xdi, xsi, out);                  \
                else if (rows == 2) x16_tile_##FMT##_2(codes, full, xqi, xdi, xsi, out);                  \
                else x16_tile_##FMT##_1(codes, full, xqi, xdi, xsi, out);                                 \
                for (int64_t i = 0; i < rows; i++)                                                        \
                    for (int64_t l = 0; l < nr; l++)                                                      \
                        y[(i0 + i) * ldy + j0 + l] = out[i][l] + (bias ? bias[j0 + l] : 0.0f);            \
                i0 += rows;                                                                               \
            }                                                                                             \
        }                                                                                                 \
    }                                                                                                     \
                                                                                                          \
    static inline void qmatvec_a8_##FMT(const struct weight *w, const float *restrict x, float *restrict y, \
                                        int64_t ldy, int64_t m) {                                         \
        const int64_t full = w->blocks;                                                                   \
        int8_t xq[m * full * QBLOCK + 1];                                                                 \
        float xd[m * full + 1], xs[m * full + 1];                                                         \
        quantize_activations(x, m, w->cols, xq, xd, xs);                                                  \
        x16_product_##FMT(w, xq, xd, xs, y, ldy, m);                                                      \
    }

DEFINE_X16(int4x16)
DEFINE_X16(int5x16)
DEFINE_X16(q4_kx16)
DEFINE_X16(q6_kx16)
DEFINE_X16(q5_kx16)
DEFINE_X16(q8_0x16)

#define QUANT_DISPATCH(W, CALL)                                                                           \
    switch ((W)->format) {                                                                                  \
    case WEIGHT_INT8: CALL(int8); break;                                                                  \
    case WEIGHT_FP8: CALL(fp8); break;                                                                    \
    case WEIGHT_INT4: CALL(int4); break;                                                                  \
    case WEIGHT_NF4: CALL(nf4); break;                                                                    \
    case WEIGHT_Q8_0: CALL(q8_0); break;                                                                  \
    case WEIGHT_INT5: CALL(int5); break;                                                                  \
    case WEIGHT_Q4_K: CALL(q4_k); break;                                                                  \
    case WEIGHT_Q5_K: CALL(q5_k); break;                                                                  \
    case WEIGHT_Q6_K: CALL(q6_k); break;                                                                  \
    default: abort(); /* the Python side builds only the formats listed in enum weight_format */         \
    }

/* The formats with an integer product (cpu.py's INT8_ACTIVATION_FORMATS). */
#define QUANT_A8_DISPATCH(W, CALL)                                                                        \
    switch ((W)->format) {                                                                                  \
    case WEIGHT_INT8: CALL(int8); break;                                                                  \
    case WEIGHT_Q8_0: CALL(q8_0); break;                                                                  \
    case WEIGHT_INT4: CALL(int4); break;                                                                  \
    case WEIGHT_INT5: CALL(int5); break;                                                                  \
    case WEIGHT_Q4_K: CALL(q4_k); break;                                                                  \
    case WEIGHT_Q5_K: CALL(q5_k); break;                                                                  \
    case WEIGHT_Q6_K: CALL(q6_k); break;                                                                  \
    case WEIGHT_INT4X16: CALL(int4x16); break;                                                            \
    case WEIGHT_INT5X16: CALL(int5x16); break;                                                            \
    case WEIGHT_Q4_KX16: CALL(q4_kx16); break;                                                            \
    case WEIGHT_Q6_KX16: CALL(q6_kx16); break;                                                            \
    case WEIGHT_Q5_KX16: CALL(q5_kx16); break;                                                            \
    case WEIGHT_Q8_0X16: CALL(q8_0x16); break;                                                            \
    default: abort(); /* the Python side sets quantize_activations only for these */                     \
    }

/* A weight's single-format pieces: a WEIGHT_MIXED's parts, else the weight itself. Part p's rows
 * are columns [sum of the rows before it, + its rows) of y. */
static inline int64_t format_parts(const struct weight *w, const struct weight **parts) {
    if (w->format == WEIGHT_MIXED) {
        *parts = w->parts;
        return w->num_parts;
    }
    *parts = w;
    return 1;
}

/* y [m, rows] = x [m, cols] @ w^T (+ bias) for a low-bit w, in the calling parallel region. */
static inline void qmatvec(const struct weight *w, const float *restrict x, float *restrict y, int64_t m) {
#define QMATVEC_CALL(FMT) qmatvec_##FMT(part, x, y + first, w->rows, m)
#define QMATVEC_A8_CALL(FMT) qmatvec_a8_##FMT(part, x, y + first, w->rows, m)
    const struct weight *parts;
    const int64_t count = format_parts(w, &parts);
    for (int64_t p = 0, first = 0; p < count; first += parts[p].rows, p++) {
        const struct weight *part = parts + p;
        if (part->quantize_activations) {
            QUANT_A8_DISPATCH(part, QMATVEC_A8_CALL)
        } else {
            QUANT_DISPATCH(part, QMATVEC_CALL)
        }
    }
#undef QMATVEC_A8_CALL
#undef QMATVEC_CALL
}

static inline void qmatmul(const struct weight *w, const float *restrict x, float *restrict y, int64_t m,
                           float *restrict panel) {
#define QMATMUL_CALL(FMT) qmatmul_##FMT(part, x, y + first, w->rows, m, panel)
    const struct weight *parts;
    const int64_t count = format_parts(w, &parts);
    for (int64_t p = 0, first = 0; p < count; first += parts[p].rows, p++) {
        const struct weight *part = parts + p;
        QUANT_DISPATCH(part, QMATMUL_CALL)
    }
#undef QMATMUL_CALL
}

#endif
