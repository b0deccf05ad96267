/*
 * The batched half of the formats with an integer product (int8, q8_0, int4 and int5, which hold
 * GGUF's Q4_0/Q4_1 and Q5_0/Q5_1 bit for bit, and the K-quants: quant.h; int4x16, int5x16,
 * q8_0x16, q4_kx16, q5_kx16 and q6_kx16, stored as these panels already, need none of this file's
 * packing): y = x @ w^T for many activation rows (prefill chunks, decode batches past the fused
 * step) with x rounded to int8 per block of 32, as
 * llama.cpp rounds activations to Q8_0/Q8_1. quant.h's `qmatvec_a8` is the decode half: the
 * same rounding (quantize_activations) and the same integer block dots, one weight row at a time.
 *
 * Why a second loop: a decode product reads each weight block once and multiplies it into up to
 * 8 activation rows, then reduces each block's 32 products across a vector's lanes to one sum and
 * scales it, which costs as many instructions as the products. With many rows, the reduction can
 * go: a thread takes a tile of QG_NR weight rows and lays it out in an L1 panel where one vector
 * holds 4 consecutive codes of every row of the tile (lane l: row j0 + l), so one `vpdpbusd`
 * (VNNI) or `maddubs` (AVX2) against 4 bytes of an activation row, broadcast, leaves in each lane
 * that row's partial dot with one weight row. Eight of them cover a block; its sums are in the
 * lanes already, one per weight row, and the block's scales are applied by two FMAs across
 * all QG_NR rows at once. The tile's panel is built once and multiplied into every
 * activation row, QG_MR rows at a time in registers, so each weight block is read from the model
 * once per tile of rows, and no float copy of a weight is ever made.
 *
 * Per block b of an activation row i (x_q int8 codes, dx scale, sx = dx * sum(x_q)) and a weight
 * row l (codes c, scale d, offset o):
 *
 *     y[i][l] += d[l] * dx * sum_t c[l][t] x_q[t]  +  o[l] * sx
 *
 * int4 (c = 0..15, w = d c + min): o = min; int5 and the Q4_K/Q5_K blocks alike (Q4_K/Q5_K:
 * d = d_sb sc, o = -dmin m). Signed codes (int8, q8_0) go through the unsigned operand of
 * `vpdpbusd` as c + 128 (one xor at packing); the 128 sum(x_q) that adds is taken back by
 * o = -128 d. AVX2's `maddubs` saturates int16 at 2 x 255 x 127, so there signed codes stay
 * signed and multiply as |c| by x_q with c's sign (o = 0); unsigned codes add up in int16 a few
 * words at a time before widening: eight of 0..15 (8 x 2 x 15 x 127 < 32767), four of 0..31.
 *
 * Q6_K has a scale per 16 columns, so a lane keeps two sums, words 0-3 and 4-7, scaled by their
 * halves' d (the panel's d and o vectors hold the two). Its codes c = q - 32 are signed, and it
 * is the activation that takes the unsigned operand, as x_q + 128 (one xor of the broadcast word):
 * each sum then starts from -128 sum(c) over its half, which packing takes from the codes
 * (qg_corrections), so the sums stay exact integers.
 *
 * Columns past the last full block (int8 rows of any width, int4 padded to a block) are multiplied
 * in float, as the decode half does (qdot_tail).
 *
 * A format joins by saying where a block keeps its 32 codes (or assembling them: int5 and the
 * K-quants, through quant.h's block readers), what its d and o are, and which kind of product its
 * codes take (qg_codes_<format>, qg_scale_<format> or a row at a time, QG_SOURCE_<format>,
 * QG_KIND_<format>), and by one DEFINE_QMATMUL_A8 line; packing and products are shared. Packing a
 * tile costs about what one decode pass over its rows does, paid once for all activation rows.
 */
#ifndef BRISK_QUANT_GEMM_H
#define BRISK_QUANT_GEMM_H

#include <omp.h>

#include "quant.h"
#include "status.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define QG_NR 16       /* weight rows per tile: the int32 lanes of a zmm */
#define QG_MR 8        /* activation rows in registers: 8 int32 + 8 float accumulators of 32 zmm */
#define QG_UNSIGNED 1  /* signed codes are stored + 128 (see above) */
/* Past this many activation rows the panel product beats the decode product (qmatvec_a8): with
 * VNNI from 2 rows (a 960 x 576 Q4_1 weight, 2 rows: 22 against 43 us on an AMD EPYC Zen 4, 2
 * threads); the AVX2 build on the same host: even up to 4 rows, ahead past them. */
#define QG_MIN_ROWS 1
#elif defined(__AVX2__)
#define QG_NR 8
#define QG_MR 4        /* of 16 ymm: 4 + 4 accumulators, the codes, their magnitudes, constants */
#define QG_UNSIGNED 0
#define QG_MIN_ROWS 4
#else
#define QG_NR 8
#define QG_MR 4
#define QG_UNSIGNED 1
#define QG_MIN_ROWS 4
#endif
/* A signed format's offset per unit of scale: -128 takes back the + 128 of codes stored unsigned. */
#define QG_SIGNED_OFFSET (QG_UNSIGNED ? -128.0f : 0.0f)

/* The kinds of product, by the codes a format packs (see above): the AVX2 words of unsigned
 * products summed in int16 (SPAN), signed codes (SIGNED), a scale per half block (HALVES). */
#define QG_SPAN_unsigned4 8
#define QG_SPAN_unsigned5 4
#define QG_SPAN_signed8 1
#define QG_SPAN_halves6 2 /* 2 x 2 x 255 x 32 < 32767: x_q + 128 times |c| <= 32 */
#define QG_SIGNED_unsigned4 0
#define QG_SIGNED_unsigned5 0
#define QG_SIGNED_signed8 1
#define QG_SIGNED_halves6 0
#define QG_HALVES_unsigned4 0
#define QG_HALVES_unsigned5 0
#define QG_HALVES_signed8 0
#define QG_HALVES_halves6 1

#define QG_KIND_int4 unsigned4
#define QG_KIND_q4_k unsigned4
#define QG_KIND_int5 unsigned5
#define QG_KIND_q5_k unsigned5
#define QG_KIND_int8 signed8
#define QG_KIND_q8_0 signed8
#define QG_KIND_q6_k halves6

#define QG_PASTE(a, b) QG_PASTE_(a, b)
#define QG_PASTE_(a, b) a##b
#define QG_OF(WHAT, FMT) QG_PASTE(WHAT, QG_KIND_##FMT) /* QG_OF(QG_HALVES_, q6_k): 1 */

/* A panel block: codes [8 words][QG_NR lanes][4 bytes], then scales d [QG_NR], offsets o [QG_NR]
 * (floats; Q6_K: its halves' scales). Word t of lane l holds elements 4t .. 4t + 3 of row j0 + l's
 * block. A multiple of 64 bytes, so every vector of a panel starting on a cache line is aligned.
 * After the blocks, for Q6_K, each block's corrections: int32 [2][QG_NR], a sum's start per half. */
#define QG_BLOCK_BYTES (QBLOCK * QG_NR + 2 * QG_NR * 4)
#define QG_CORRECTION_BYTES (2 * QG_NR * 4)

static inline float *qg_scales(uint8_t *panel, int64_t b) { return (float *)(panel + b * QG_BLOCK_BYTES + QBLOCK * QG_NR); }
static inline float *qg_offsets(uint8_t *panel, int64_t b) { return qg_scales(panel, b) + QG_NR; }

/* ---- each format's source: where block b of row j keeps its codes (16 bytes of nibbles for
 * int4, 32 signed bytes for int8 and q8_0; int5 and the K-quants assemble theirs into `own`, 32
 * bytes), and its scale d and offset o ---- */

static inline const uint8_t *qg_codes_int4(const struct weight *w, int64_t j, int64_t b, uint8_t *own) {
    (void)own;
    return (const uint8_t *)w->data + (j * blocks_per_row(w) + b) * (QBLOCK / 2);
}

static inline void qg_scale_int4(const struct weight *w, int64_t j, int64_t b, float *d, float *o) {
    const int64_t g = j * groups_per_row(w) + group_of_block(w, b);
    *d = group_scale(w, g);
    *o = group_min(w, g);
}

static inline const uint8_t *qg_codes_q8_0(const struct weight *w, int64_t j, int64_t b, uint8_t *own) {
    (void)own;
    return (const uint8_t *)w->data + (j * blocks_per_row(w) + b) * 34 + 2;
}

static inline void qg_scale_q8_0(const struct weight *w, int64_t j, int64_t b, float *d, float *o) {
    uint16_t h;
    memcpy(&h, qg_codes_q8_0(w, j, b, NULL) - 2, 2);
    *d = load_f16_scalar(h);
    *o = QG_SIGNED_OFFSET * *d;
}

static inline const uint8_t *qg_codes_int8(const struct weight *w, int64_t j, int64_t b, uint8_t *own) {
    (void)own;
    return (const uint8_t *)w->data + j * w->cols + b * QBLOCK;
}

static inline void qg_scale_int8(const struct weight *w, int64_t j, int64_t b, float *d, float *o) {
    (void)b;
    *d = row_scale(w, j);
    *o = QG_SIGNED_OFFSET * *d;
}

#define DEFINE_QG_OWN_CODES(FMT, CODES)                                                                   \
    static inline const uint8_t *qg_codes_##FMT(const struct weight *w, int64_t j, int64_t b, uint8_t *own) { \
        store_codes(own, CODES);                                                                          \
        return own;                                                                                       \
    }
DEFINE_QG_OWN_CODES(q4_k, block_codes_q4_k(w, j, b))
DEFINE_QG_OWN_CODES(q5_k, block_codes_q5_k(w, j, b))
DEFINE_QG_OWN_CODES(q6_k, codes_minus(block_codes_q6_k(w, j, b), 32))

/* How a block's codes reach qg_pack_codes: 32 bytes, int4's 16 bytes of nibbles, or an int5
 * block as stored (VNNI: its nibbles transposed as int4's, the fifth bits added to the words). */
enum qg_source { QG_BYTES, QG_NIBBLES, QG_INT5 };
#define QG_SOURCE_int4 QG_NIBBLES
#define QG_SOURCE_q8_0 QG_BYTES
#define QG_SOURCE_int8 QG_BYTES
#define QG_SOURCE_q4_k QG_BYTES
#define QG_SOURCE_q5_k QG_BYTES
#define QG_SOURCE_q6_k QG_BYTES
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define QG_SOURCE_int5 QG_INT5
static inline const uint8_t *qg_codes_int5(const struct weight *w, int64_t j, int64_t b, uint8_t *own) {
    (void)own;
    return int5_block(w, j, b);
}
#else
#define QG_SOURCE_int5 QG_BYTES
DEFINE_QG_OWN_CODES(int5, block_codes_int5(w, j, b))
#endif

static const uint8_t QG_ZEROS[QBLOCK]; /* the codes of the lanes past a short last tile */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* 16 bytes of each of 16 rows -> out[t] (t = 0..3): word t of every row, lane l from row l. A
 * 4 x 4 word transpose inside each 128-bit lane, then a 4 x 4 transpose of the lanes. */
static inline void qg_transpose16(const uint8_t *const rows[16], int64_t at, __m512i out[4]) {
    const __m512i words = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    __m512i p[4];
    for (int z = 0; z < 4; z++) {
        __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(rows[4 * z] + at)));
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(rows[4 * z + 1] + at)), 1);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(rows[4 * z + 2] + at)), 2);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(rows[4 * z + 3] + at)), 3);
        p[z] = _mm512_permutexvar_epi32(words, v); /* lane t: word t of rows 4z .. 4z + 3 */
    }
    const __m512i low01 = _mm512_shuffle_i32x4(p[0], p[1], 0x44), low23 = _mm512_shuffle_i32x4(p[2], p[3], 0x44);
    const __m512i high01 = _mm512_shuffle_i32x4(p[0], p[1], 0xEE), high23 = _mm512_shuffle_i32x4(p[2], p[3], 0xEE);
    out[0] = _mm512_shuffle_i32x4(low01, low23, 0x88);
    out[1] = _mm512_shuffle_i32x4(low01, low23, 0xDD);
    out[2] = _mm512_shuffle_i32x4(high01, high23, 0x88);
    out[3] = _mm512_shuffle_i32x4(high01, high23, 0xDD);
}

/* int5: + 16 where the fifth bit is set. Word t of lane l is elements 4t .. 4t + 3 of row l,
 * whose bits are bits 4 (t % 2) .. + 3 of byte t / 2 of the row's u32: one byte shuffle spreads
 * that byte over the lane's 4, one test against each byte's own bit makes the mask. */
static inline __m512i qg_fifth_bits(__m512i word, __m512i high, int t) {
    const __m512i dword = _mm512_set4_epi32(0x0C0C0C0C, 0x08080808, 0x04040404, 0); /* its first byte in the 128 bits */
    const __m512i spread = _mm512_shuffle_epi8(high, _mm512_add_epi8(dword, _mm512_set1_epi8((char)(t / 2))));
    const __mmask64 set = _mm512_test_epi8_mask(spread, _mm512_set1_epi32(t % 2 ? (int)0x80402010 : 0x08040201));
    return _mm512_mask_add_epi8(word, set, word, _mm512_set1_epi8(16));
}

/* flip: signed codes + 128 (the unsigned operand); the others' bytes as they are */
static inline void qg_pack_codes(const uint8_t *const rows[QG_NR], enum qg_source source, int flip, uint8_t *codes) {
    __m512i v[4];
    qg_transpose16(rows, source == QG_INT5 ? 4 : 0, v);
    if (source != QG_BYTES) { /* byte t: element t low, t + 16 high (quant.h) */
        const __m512i low = _mm512_set1_epi8(0x0F);
        __m512i high = _mm512_setzero_si512();
        if (source == QG_INT5) {
            uint32_t bits[QG_NR];
            for (int l = 0; l < QG_NR; l++) memcpy(bits + l, rows[l], 4);
            high = _mm512_loadu_si512(bits);
        }
        for (int t = 0; t < 4; t++) {
            __m512i first = _mm512_and_si512(v[t], low), second = _mm512_and_si512(_mm512_srli_epi32(v[t], 4), low);
            if (source == QG_INT5) first = qg_fifth_bits(first, high, t), second = qg_fifth_bits(second, high, t + 4);
            _mm512_store_si512((void *)(codes + t * 64), first);
            _mm512_store_si512((void *)(codes + (t + 4) * 64), second);
        }
        return;
    }
    const __m512i by = _mm512_set1_epi8(flip ? -128 : 0);
    for (int t = 0; t < 4; t++) _mm512_store_si512((void *)(codes + t * 64), _mm512_xor_si512(v[t], by));
    qg_transpose16(rows, 16, v);
    for (int t = 0; t < 4; t++) _mm512_store_si512((void *)(codes + (t + 4) * 64), _mm512_xor_si512(v[t], by));
}

/* Q6_K: corrections[h * QG_NR + l] = -128 x (lane l's codes in words 4h .. 4h + 3, summed) */
static inline void qg_corrections(const uint8_t *restrict codes, int32_t *restrict corrections) {
    for (int h = 0; h < 2; h++) {
        __m512i sum = _mm512_setzero_si512();
        for (int t = 4 * h; t < 4 * h + 4; t++)
            sum = _mm512_dpbusd_epi32(sum, _mm512_set1_epi8(1), _mm512_load_si512((const void *)(codes + t * 64)));
        _mm512_store_si512((void *)(corrections + h * QG_NR), _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sum, 7)));
    }
}
#else
static inline void qg_pack_codes(const uint8_t *const rows[QG_NR], enum qg_source source, int flip, uint8_t *codes) {
    uint32_t *out = (uint32_t *)codes;
    for (int l = 0; l < QG_NR; l++) {
        uint32_t words[8];
        if (source == QG_NIBBLES) {
            memcpy(words, rows[l], QBLOCK / 2);
            for (int t = 0; t < 4; t++) words[t + 4] = (words[t] >> 4) & 0x0F0F0F0Fu, words[t] &= 0x0F0F0F0Fu;
        } else {
            memcpy(words, rows[l], QBLOCK);
            if (flip)
                for (int t = 0; t < 8; t++) words[t] ^= 0x80808080u;
        }
        for (int t = 0; t < 8; t++) out[t * QG_NR + l] = words[t];
    }
}

static inline void qg_corrections(const uint8_t *restrict codes, int32_t *restrict corrections) {
#ifdef __AVX2__
    for (int h = 0; h < 2; h++) {
        __m256i sum = _mm256_setzero_si256();
        for (int t = 4 * h; t < 4 * h + 4; t++) {
            const __m256i pairs = _mm256_maddubs_epi16(_mm256_set1_epi8(1), _mm256_load_si256((const __m256i *)(codes + t * 32)));
            sum = _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
        }
        _mm256_store_si256((__m256i *)(corrections + h * QG_NR), _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(sum, 7)));
    }
#else
    for (int h = 0; h < 2; h++)
        for (int l = 0; l < QG_NR; l++) {
            int32_t sum = 0;
            for (int t = 4 * h; t < 4 * h + 4; t++)
                for (int e = 0; e < 4; e++) sum += (int8_t)codes[(t * QG_NR + l) * 4 + e];
            corrections[h * QG_NR + l] = -128 * sum;
        }
#endif
}
#endif

/* The scales and offsets of a tile, block by block: lane l's from the format's source. */
#define DEFINE_QG_SCALES(FMT)                                                                             \
    static inline void qg_scales_by_lane_##FMT(const struct weight *w, int64_t j0, int64_t nr, int64_t full, \
                                               uint8_t *restrict panel) {                                 \
        for (int64_t b = 0; b < full; b++) {                                                              \
            float *d = qg_scales(panel, b), *o = qg_offsets(panel, b);                                    \
            for (int64_t l = 0; l < QG_NR; l++) {                                                         \
                if (l < nr) qg_scale_##FMT(w, j0 + l, b, d + l, o + l);                                   \
                else d[l] = o[l] = 0.0f;                                                                  \
            }                                                                                             \
        }                                                                                                 \
    }

DEFINE_QG_SCALES(int4)
DEFINE_QG_SCALES(q8_0)
DEFINE_QG_SCALES(int8)

/* The K-quants' scales, unpacked a row at a time (quant.h's block_scales: two floats a block, d
 * and o, or Q6_K's halves' scales) and spread into their lanes. */
#define DEFINE_QG_SCALES_BY_ROW(FMT)                                                                      \
    static inline void qg_pack_scales_##FMT(const struct weight *w, int64_t j0, int64_t nr, int64_t full, \
                                            uint8_t *restrict panel) {                                    \
        float first[full], second[full];                                                                  \
        for (int64_t l = 0; l < QG_NR; l++) {                                                             \
            if (l < nr) block_scales_##FMT(w, j0 + l, first, second);                                     \
            for (int64_t b = 0; b < full; b++) {                                                          \
                qg_scales(panel, b)[l] = l < nr ? first[b] : 0.0f;                                        \
                qg_offsets(panel, b)[l] = l < nr ? second[b] : 0.0f;                                      \
            }                                                                                             \
        }                                                                                                 \
    }

DEFINE_QG_SCALES_BY_ROW(q4_k)
DEFINE_QG_SCALES_BY_ROW(q5_k)
DEFINE_QG_SCALES_BY_ROW(q6_k)

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* r[l] (16 floats of row l) -> r[c] (column c of the 16 rows): pairs, then quads within each
 * 128-bit lane, then the lanes. */
static inline void qg_transpose16_ps(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* r[4i + c], 128-bit lane k: rows 4i .. 4i + 3 of column 4k + c */
        const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
        const __m512d c = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
    }
    __m512 out[16];
    for (int c = 0; c < 4; c++) {
        const __m512 low = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x44), low2 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x44);
        const __m512 high = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xEE), high2 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xEE);
        out[c] = _mm512_shuffle_f32x4(low, low2, 0x88);
        out[4 + c] = _mm512_shuffle_f32x4(low, low2, 0xDD);
        out[8 + c] = _mm512_shuffle_f32x4(high, high2, 0x88);
        out[12 + c] = _mm512_shuffle_f32x4(high, high2, 0xDD);
    }
    for (int c = 0; c < 16; c++) r[c] = out[c];
}

/* int4 with a scale per block (GGUF's Q4 blocks): each row's f16 scales and minimums are
 * contiguous, so 16 blocks of 16 rows convert as 16 vectors and transpose into place. */
static inline void qg_pack_scales_int4(const struct weight *w, int64_t j0, int64_t nr, int64_t full, uint8_t *restrict panel) {
    if (w->group_shift != 0) {
        qg_scales_by_lane_int4(w, j0, nr, full, panel);
        return;
    }
    const uint16_t *scales = (const uint16_t *)w->scales, *mins = (const uint16_t *)w->mins;
    for (int64_t b0 = 0; b0 < full; b0 += 16) {
        const int64_t count = full - b0 < 16 ? full - b0 : 16;
        const __mmask16 some = (__mmask16)((1u << count) - 1);
        __m512 d[16], o[16];
        for (int64_t l = 0; l < 16; l++) {
            const int64_t at = (j0 + l) * w->groups + b0;
            d[l] = l >= nr ? _mm512_setzero_ps()
                 : count == 16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + at)))
                               : _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(some, scales + at));
            o[l] = l >= nr ? _mm512_setzero_ps()
                 : count == 16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mins + at)))
                               : _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(some, mins + at));
        }
        qg_transpose16_ps(d);
        qg_transpose16_ps(o);
        for (int64_t t = 0; t < count; t++) {
            _mm512_store_ps(qg_scales(panel, b0 + t), d[t]);
            _mm512_store_ps(qg_offsets(panel, b0 + t), o[t]);
        }
    }
}

/* Q8_0 keeps its scale inside each 34-byte block: the 16 rows' scales of a block in one gather. */
static inline void qg_pack_scales_q8_0(const struct weight *w, int64_t j0, int64_t nr, int64_t full, uint8_t *restrict panel) {
    const int64_t row_bytes = blocks_per_row(w) * 34;
    if (nr < 16 || 15 * row_bytes > INT32_MAX) {
        qg_scales_by_lane_q8_0(w, j0, nr, full, panel);
        return;
    }
    const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32((int32_t)row_bytes));
    const uint8_t *first = (const uint8_t *)w->data + j0 * row_bytes;
    for (int64_t b = 0; b < full; b++) { /* 4 bytes from each block's start: its f16 scale, then a code pair */
        const __m512i words = _mm512_i32gather_epi32(rows, (const void *)(first + b * 34), 1);
        const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(words));
        _mm512_store_ps(qg_scales(panel, b), d);
        _mm512_store_ps(qg_offsets(panel, b), _mm512_mul_ps(d, _mm512_set1_ps(QG_SIGNED_OFFSET)));
    }
}
#else
#define qg_pack_scales_int4 qg_scales_by_lane_int4
#define qg_pack_scales_q8_0 qg_scales_by_lane_q8_0
#endif
#define qg_pack_scales_int8 qg_scales_by_lane_int8
#define qg_pack_scales_int5 qg_pack_scales_int4 /* int5 keeps int4's f16 scales and minimums */

/* Weight rows j0 .. j0 + nr - 1 (nr <= QG_NR) into a panel, every block; lanes past nr zero. */
#define DEFINE_QG_PACK(FMT)                                                                               \
    static inline void qg_pack_##FMT(const struct weight *w, int64_t j0, int64_t nr, int64_t full,        \
                                     uint8_t *restrict panel) {                                           \
        uint8_t own[QG_NR][QBLOCK];                                                                       \
        int32_t *corrections = (int32_t *)(panel + full * QG_BLOCK_BYTES);                                \
        qg_pack_scales_##FMT(w, j0, nr, full, panel);                                                     \
        for (int64_t b = 0; b < full; b++) {                                                              \
            const uint8_t *rows[QG_NR];                                                                   \
            for (int64_t l = 0; l < QG_NR; l++) rows[l] = l < nr ? qg_codes_##FMT(w, j0 + l, b, own[l]) : QG_ZEROS; \
            qg_pack_codes(rows, QG_SOURCE_##FMT, QG_UNSIGNED && QG_OF(QG_SIGNED_, FMT), panel + b * QG_BLOCK_BYTES); \
            if (QG_OF(QG_HALVES_, FMT)) qg_corrections(panel + b * QG_BLOCK_BYTES, corrections + b * 2 * QG_NR); \
        }                                                                                                 \
    }

DEFINE_QG_PACK(int4)
DEFINE_QG_PACK(q8_0)
DEFINE_QG_PACK(int8)
DEFINE_QG_PACK(int5)
DEFINE_QG_PACK(q4_k)
DEFINE_QG_PACK(q5_k)
DEFINE_QG_PACK(q6_k)

static inline int32_t qg_word_unsigned(const int8_t *p) { /* the same + 128, as unsigned bytes (Q6_K) */
    return (int32_t)((uint32_t)qg_word(p) ^ 0x80808080u);
}

/* ---- the product of a panel with ROWS activation rows: out[i][l] = sum over blocks ----
 * xq, xd, xs: the rows' codes [ROWS][full * 32], scales and scaled sums [ROWS][full]. A tile of
 * KIND (QG_KIND_<format>) keeps HALVES + 1 integer sums per lane and block: a HALVES kind's sums
 * start from the panel's corrections and take its d and o vectors as its halves' scales. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define DEFINE_QG_TILE(KIND, ROWS)                                                                        \
    static inline void qg_tile_##KIND##_##ROWS(const uint8_t *restrict panel, int64_t full,               \
                                               const int8_t *restrict xq, const float *restrict xd,       \
                                               const float *restrict xs, float out[][QG_NR]) {            \
        enum { HALVES = QG_HALVES_##KIND };                                                               \
        const int32_t *corrections = (const int32_t *)(panel + full * QG_BLOCK_BYTES);                    \
        __m512 acc[ROWS];                                                                                 \
        for (int i = 0; i < ROWS; i++) acc[i] = _mm512_setzero_ps();                                      \
        for (int64_t b = 0; b < full; b++) {                                                              \
            const uint8_t *c = panel + b * QG_BLOCK_BYTES;                                                \
            __m512i dots[HALVES + 1][ROWS];                                                               \
            for (int h = 0; h <= HALVES; h++) {                                                           \
                const __m512i start = HALVES ? _mm512_load_si512((const void *)(corrections + (2 * b + h) * QG_NR)) \
                                             : _mm512_setzero_si512();                                    \
                for (int i = 0; i < ROWS; i++) dots[h][i] = start;                                        \
            }                                                                                             \
            for (int t = 0; t < 8; t++) {                                                                 \
                const __m512i wv = _mm512_load_si512((const void *)(c + t * 64));                         \
                const int h = HALVES && t >= 4;                                                           \
                for (int i = 0; i < ROWS; i++) {                                                          \
                    const int8_t *x = xq + (i * full + b) * QBLOCK + 4 * t;                               \
                    dots[h][i] = HALVES ? _mm512_dpbusd_epi32(dots[h][i], _mm512_set1_epi32(qg_word_unsigned(x)), wv) \
                                        : _mm512_dpbusd_epi32(dots[h][i], wv, _mm512_set1_epi32(qg_word(x))); \
                }                                                                                         \
            }                                                                                             \
            const __m512 d = _mm512_load_ps((const float *)(c + QBLOCK * QG_NR));                         \
            const __m512 o = _mm512_load_ps((const float *)(c + QBLOCK * QG_NR + 4 * QG_NR));             \
            for (int i = 0; i < ROWS; i++) {                                                              \
                const __m512 dx = _mm512_set1_ps(xd[i * full + b]);                                       \
                acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(dots[0][i]), acc[i]);   \
                acc[i] = HALVES ? _mm512_fmadd_ps(_mm512_mul_ps(o, dx), _mm512_cvtepi32_ps(dots[HALVES][i]), acc[i]) \
                                : _mm512_fmadd_ps(o, _mm512_set1_ps(xs[i * full + b]), acc[i]);           \
            }                                                                                             \
        }                                                                                                 \
        for (int i = 0; i < ROWS; i++) _mm512_storeu_ps(out[i], acc[i]);                                  \
    }
#elif defined(__AVX2__)
/* Unsigned codes: SPAN maddubs add up in int16, widened once per SPAN words. Signed codes: |c|
 * times x_q with c's sign, widened per word (a pair of products alone nearly fills int16). */
#define DEFINE_QG_TILE(KIND, ROWS)                                                                        \
    static inline void qg_tile_##KIND##_##ROWS(const uint8_t *restrict panel, int64_t full,               \
                                               const int8_t *restrict xq, const float *restrict xd,       \
                                               const float *restrict xs, float out[][QG_NR]) {            \
        enum { HALVES = QG_HALVES_##KIND, SPAN = QG_SPAN_##KIND };                                        \
        const __m256i ones = _mm256_set1_epi16(1);                                                        \
        const int32_t *corrections = (const int32_t *)(panel + full * QG_BLOCK_BYTES);                    \
        __m256 acc[ROWS];                                                                                 \
        for (int i = 0; i < ROWS; i++) acc[i] = _mm256_setzero_ps();                                      \
        for (int64_t b = 0; b < full; b++) {                                                              \
            const uint8_t *c = panel + b * QG_BLOCK_BYTES;                                                \
            __m256i dots[HALVES + 1][ROWS];                                                               \
            for (int h = 0; h <= HALVES; h++) {                                                           \
                const __m256i start = HALVES ? _mm256_load_si256((const __m256i *)(corrections + (2 * b + h) * QG_NR)) \
                                             : _mm256_setzero_si256();                                    \
                for (int i = 0; i < ROWS; i++) dots[h][i] = start;                                        \
            }                                                                                             \
            if (QG_SIGNED_##KIND) {                                                                       \
                for (int t = 0; t < 8; t++) {                                                             \
                    const __m256i wv = _mm256_load_si256((const __m256i *)(c + t * 32));                  \
                    const __m256i magnitude = _mm256_abs_epi8(wv);                                        \
                    for (int i = 0; i < ROWS; i++) {                                                      \
                        const __m256i xv = _mm256_set1_epi32(qg_word(xq + (i * full + b) * QBLOCK + 4 * t)); \
                        const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(xv, wv));  \
                        dots[0][i] = _mm256_add_epi32(dots[0][i], _mm256_madd_epi16(pairs, ones));        \
                    }                                                                                     \
                }                                                                                         \
            } else {                                                                                      \
                for (int t0 = 0; t0 < 8; t0 += SPAN) {                                                    \
                    const int h = HALVES && t0 >= 4;                                                      \
                    __m256i pairs[ROWS];                                                                  \
                    for (int i = 0; i < ROWS; i++) pairs[i] = _mm256_setzero_si256();                     \
                    for (int t = t0; t < t0 + SPAN; t++) {                                                \
                        const __m256i wv = _mm256_load_si256((const __m256i *)(c + t * 32));              \
                        for (int i = 0; i < ROWS; i++) {                                                  \
                            const int8_t *x = xq + (i * full + b) * QBLOCK + 4 * t;                       \
                            pairs[i] = _mm256_add_epi16(pairs[i], HALVES ? _mm256_maddubs_epi16(_mm256_set1_epi32(qg_word_unsigned(x)), wv) \
                                                                         : _mm256_maddubs_epi16(wv, _mm256_set1_epi32(qg_word(x)))); \
                        }                                                                                 \
                    }                                                                                     \
                    for (int i = 0; i < ROWS; i++) dots[h][i] = _mm256_add_epi32(dots[h][i], _mm256_madd_epi16(pairs[i], ones)); \
                }                                                                                         \
            }                                                                                             \
            const __m256 d = _mm256_load_ps((const float *)(c + QBLOCK * QG_NR));                         \
            const __m256 o = _mm256_load_ps((const float *)(c + QBLOCK * QG_NR + 4 * QG_NR));             \
            for (int i = 0; i < ROWS; i++) {                                                              \
                const __m256 dx = _mm256_set1_ps(xd[i * full + b]);                                       \
                acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(dots[0][i]), acc[i]);   \
                acc[i] = HALVES ? _mm256_fmadd_ps(_mm256_mul_ps(o, dx), _mm256_cvtepi32_ps(dots[HALVES][i]), acc[i]) \
                                : _mm256_fmadd_ps(o, _mm256_set1_ps(xs[i * full + b]), acc[i]);           \
            }                                                                                             \
        }                                                                                                 \
        for (int i = 0; i < ROWS; i++) _mm256_storeu_ps(out[i], acc[i]);                                  \
    }
#else
#define DEFINE_QG_TILE(KIND, ROWS)                                                                        \
    static inline void qg_tile_##KIND##_##ROWS(const uint8_t *restrict panel, int64_t full,               \
                                               const int8_t *restrict xq, const float *restrict xd,       \
                                               const float *restrict xs, float out[][QG_NR]) {            \
        enum { HALVES = QG_HALVES_##KIND }; /* signed codes are + 128 at packing */                       \
        const int32_t *corrections = (const int32_t *)(panel + full * QG_BLOCK_BYTES);                    \
        for (int i = 0; i < ROWS; i++)                                                                    \
            for (int l = 0; l < QG_NR; l++) out[i][l] = 0.0f;                                             \
        for (int64_t b = 0; b < full; b++) {                                                              \
            const uint8_t *c = panel + b * QG_BLOCK_BYTES;                                                \
            const float *d = (const float *)(c + QBLOCK * QG_NR), *o = d + QG_NR;                         \
            for (int i = 0; i < ROWS; i++) {                                                              \
                const int8_t *x = xq + (i * full + b) * QBLOCK;                                           \
                for (int l = 0; l < QG_NR; l++) {                                                         \
                    int32_t dot[2] = {HALVES ? corrections[2 * b * QG_NR + l] : 0,                        \
                                      HALVES ? corrections[(2 * b + 1) * QG_NR + l] : 0};                 \
                    for (int t = 0; t < 8; t++)                                                           \
                        for (int e = 0; e < 4; e++) {                                                     \
                            const uint8_t code = c[(t * QG_NR + l) * 4 + e];                              \
                            dot[HALVES && t >= 4] += HALVES ? (int8_t)code * (x[4 * t + e] + 128)         \
                                                            : (int32_t)code * x[4 * t + e];               \
                        }                                                                                 \
                    const float dx = xd[i * full + b];                                                    \
                    out[i][l] += d[l] * dx * (float)dot[0]                                                \
                                 + (HALVES ? o[l] * dx * (float)dot[1] : o[l] * xs[i * full + b]);        \
                }                                                                                         \
            }                                                                                             \
        }                                                                                                 \
    }
#endif

/* out [rows][QG_NR] for rows <= QG_MR activation rows: the widest register tile that fits. */
#define DEFINE_QG_PRODUCT(KIND)                                                                           \
    DEFINE_QG_TILE(KIND, 8)                                                                               \
    DEFINE_QG_TILE(KIND, 4)                                                                               \
    DEFINE_QG_TILE(KIND, 2)                                                                               \
    DEFINE_QG_TILE(KIND, 1)                                                                               \
    static inline int64_t qg_product_##KIND(const uint8_t *panel, int64_t full, int64_t rows, const int8_t *xq, \
                                            const float *xd, const float *xs, float out[][QG_NR]) {       \
        const int64_t take = rows >= QG_MR ? QG_MR : rows >= 4 ? 4 : rows >= 2 ? 2 : 1;                   \
        if (take == 8) qg_tile_##KIND##_8(panel, full, xq, xd, xs, out);                                  \
        else if (take == 4) qg_tile_##KIND##_4(panel, full, xq, xd, xs, out);                             \
        else if (take == 2) qg_tile_##KIND##_2(panel, full, xq, xd, xs, out);                             \
        else qg_tile_##KIND##_1(panel, full, xq, xd, xs, out);                                            \
        return take;                                                                                      \
    }

DEFINE_QG_PRODUCT(unsigned4)
DEFINE_QG_PRODUCT(unsigned5)
DEFINE_QG_PRODUCT(signed8)
DEFINE_QG_PRODUCT(halves6)

/* y [m, ldy] columns [0, w->rows) = x @ w^T (+ bias) with x already rounded (xq, xd, xs:
 * quantize_activations of every row), in the calling parallel region; panel: this thread's
 * full * (QG_BLOCK_BYTES + QG_CORRECTION_BYTES) bytes, on a cache line. */
#define DEFINE_QMATMUL_A8(FMT)                                                                            \
    static inline void qmatmul_a8_##FMT(const struct weight *w, const float *restrict x, float *restrict y, \
                                        int64_t ldy, int64_t m, const int8_t *restrict xq,                \
                                        const float *restrict xd, const float *restrict xs,               \
                                        uint8_t *restrict panel) {                                        \
        const int64_t n = w->rows, k = w->cols, full = k / QBLOCK, tail = k - full * QBLOCK;              \
        const float *bias = (const float *)w->bias;                                                       \
        _Pragma("omp for schedule(static)")                                                               \
        for (int64_t j0 = 0; j0 < n; j0 += QG_NR) {                                                       \
            const int64_t nr = n - j0 < QG_NR ? n - j0 : QG_NR;                                           \
            qg_pack_##FMT(w, j0, nr, full, panel);                                                        \
            for (int64_t i0 = 0; i0 < m;) {                                                               \
                float out[QG_MR][QG_NR];                                                                  \
                const int64_t rows = QG_OF(qg_product_, FMT)(panel, full, m - i0, xq + i0 * full * QBLOCK, \
                                                             xd + i0 * full, xs + i0 * full, out);        \
                for (int64_t i = 0; i < rows; i++)                                                        \
                    for (int64_t l = 0; l < nr; l++)                                                      \
                        y[(i0 + i) * ldy + j0 + l] = out[i][l] + (bias ? bias[j0 + l] : 0.0f)             \
                                                     + (tail ? qdot_tail_##FMT(w, j0 + l, x + (i0 + i) * k) : 0.0f); \
                i0 += rows;                                                                               \
            }                                                                                             \
        }                                                                                                 \
    }

DEFINE_QMATMUL_A8(int8)
DEFINE_QMATMUL_A8(q8_0)
DEFINE_QMATMUL_A8(int4)
DEFINE_QMATMUL_A8(int5)
DEFINE_QMATMUL_A8(q4_k)
DEFINE_QMATMUL_A8(q5_k)
DEFINE_QMATMUL_A8(q6_k)

/* The formats in tiles of 16 rows (quant.h) are stored as their panels: the decode half's product
 * reads them as they are. */
#define DEFINE_QMATMUL_A8_X16(FMT)                                                                        \
    static inline void qmatmul_a8_##FMT(const struct weight *w, const float *restrict x, float *restrict y, \
                                        int64_t ldy, int64_t m, const int8_t *restrict xq,                \
                                        const float *restrict xd, const float *restrict xs,               \
                                        uint8_t *restrict panel) {                                        \
        (void)x, (void)panel;                                                                             \
        x16_product_##FMT(w, xq, xd, xs, y, ldy, m);                                                      \
    }

DEFINE_QMATMUL_A8_X16(int4x16)
DEFINE_QMATMUL_A8_X16(int5x16)
DEFINE_QMATMUL_A8_X16(q4_kx16)
DEFINE_QMATMUL_A8_X16(q6_kx16)
DEFINE_QMATMUL_A8_X16(q5_kx16)
DEFINE_QMATMUL_A8_X16(q8_0x16)

/* What the batched product needs besides its operands, taken before the parallel region: the
 * rounded activations (shared by the threads) and a panel per thread. */
struct qg_scratch {
    int8_t *xq;
    float *xd, *xs;
    uint8_t *panels;
    int64_t panel_bytes; /* per thread */
};

static inline void qg_scratch_free(struct qg_scratch *s) {
    free(s->xq), free(s->xd), free(s->xs), free(s->panels);
    s->xq = NULL, s->xd = s->xs = NULL, s->panels = NULL;
}

/* For up to m rows of up to max_cols columns and `threads` threads, whatever the weights'
 * formats; KERNEL_OK or KERNEL_OUT_OF_MEMORY (then nothing is held). Released by qg_scratch_free. */
static inline int qg_scratch_alloc(struct qg_scratch *s, int64_t m, int64_t max_cols, int64_t threads) {
    const int64_t full = max_cols / QBLOCK;
    s->panel_bytes = 4 * cache_lines_of_floats(full * (QG_BLOCK_BYTES + QG_CORRECTION_BYTES) / 4);
    s->xq = (int8_t *)scratch_floats(m * full * QBLOCK / 4);
    s->xd = scratch_floats(m * full);
    s->xs = scratch_floats(m * full);
    s->panels = (uint8_t *)scratch_floats(threads * s->panel_bytes / 4);
    if (s->xq && s->xd && s->xs && s->panels) return KERNEL_OK;
    qg_scratch_free(s);
    return KERNEL_OUT_OF_MEMORY;
}

/* y [m, rows] = x @ w^T (+ bias) for a weight with quantize_activations set, in the calling
 * parallel region: every row of x rounded once (one barrier), then the panel product of each of
 * its parts (quant.h's format_parts), all rounding x alike. */
static inline void qmatmul_a8(const struct weight *w, const float *restrict x, float *restrict y, int64_t m,
                              const struct qg_scratch *s) {
#define QMATMUL_A8_CALL(FMT) qmatmul_a8_##FMT(part, x, y + first, w->rows, m, s->xq, s->xd, s->xs, panel)
    const int64_t k = w->cols, full = k / QBLOCK;
    _Pragma("omp for schedule(static)")
    for (int64_t i = 0; i < m; i++)
        quantize_activations(x + i * k, 1, k, s->xq + i * full * QBLOCK, s->xd + i * full, s->xs + i * full);
    uint8_t *panel = s->panels + omp_get_thread_num() * s->panel_bytes;
    const struct weight *parts;
    const int64_t count = format_parts(w, &parts);
    for (int64_t p = 0, first = 0; p < count; first += parts[p].rows, p++) {
        const struct weight *part = parts + p;
        QUANT_A8_DISPATCH(part, QMATMUL_A8_CALL)
    }
#undef QMATMUL_A8_CALL
}

#endif
