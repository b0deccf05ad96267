/*
 * The batched half of the formats with an integer product (int8, q8_0 and int4, which holds
 * GGUF's Q4_0 and Q4_1 bit for bit: quant.h): y = x @ w^T for many activation rows (prefill
 * chunks, decode batches past the fused step) with x rounded to int8 per block of 32, as
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
 * int4 (c = 0..15, w = d c + min): o = min. Signed codes (int8, q8_0) go through the unsigned
 * operand of `vpdpbusd` as c + 128 (one xor at packing); the 128 sum(x_q) that adds is taken back
 * by o = -128 d. AVX2's `maddubs` saturates int16 at 2 x 255 x 127, so there signed codes stay
 * signed and multiply as |c| by x_q with c's sign (o = 0); int4's 0..15 fit unsigned, and eight
 * pairs of them add up in int16 before widening (8 x 2 x 15 x 127 < 32767).
 *
 * Columns past the last full block (int8 rows of any width, int4 padded to a block) are multiplied
 * in float, as the decode half does (qdot_tail).
 *
 * A format joins by saying where a block keeps its 32 codes and what its d and o are
 * (qg_codes_<format>, qg_scale_<format>, QG_NIBBLES_<format>) and by one DEFINE_QMATMUL_A8 line;
 * packing and products are shared. Packing a tile costs about what one decode pass over its rows
 * does, paid once for all activation rows.
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

/* A panel block: codes [8 words][QG_NR lanes][4 bytes], then scales d [QG_NR], offsets o [QG_NR]
 * (floats). Word t of lane l holds elements 4t .. 4t + 3 of row j0 + l's block. A multiple of 64
 * bytes, so every vector of a panel starting on a cache line is aligned. */
#define QG_BLOCK_BYTES (QBLOCK * QG_NR + 2 * QG_NR * 4)

static inline float *qg_scales(uint8_t *panel, int64_t b) { return (float *)(panel + b * QG_BLOCK_BYTES + QBLOCK * QG_NR); }
static inline float *qg_offsets(uint8_t *panel, int64_t b) { return qg_scales(panel, b) + QG_NR; }

/* ---- each format's source: where block b of row j keeps its codes (16 bytes of nibbles for
 * int4, 32 signed bytes for int8 and q8_0), and its scale d and offset o ---- */

static inline const uint8_t *qg_codes_int4(const struct weight *w, int64_t j, int64_t b) {
    return (const uint8_t *)w->data + (j * blocks_per_row(w) + b) * (QBLOCK / 2);
}

static inline void qg_scale_int4(const struct weight *w, int64_t j, int64_t b, float *d, float *o) {
    const int64_t g = j * groups_per_row(w) + group_of_block(w, b);
    *d = group_scale(w, g);
    *o = group_min(w, g);
}

static inline const uint8_t *qg_codes_q8_0(const struct weight *w, int64_t j, int64_t b) {
    return (const uint8_t *)w->data + (j * blocks_per_row(w) + b) * 34 + 2;
}

static inline void qg_scale_q8_0(const struct weight *w, int64_t j, int64_t b, float *d, float *o) {
    uint16_t h;
    memcpy(&h, qg_codes_q8_0(w, j, b) - 2, 2);
    *d = load_f16_scalar(h);
    *o = QG_SIGNED_OFFSET * *d;
}

static inline const uint8_t *qg_codes_int8(const struct weight *w, int64_t j, int64_t b) {
    return (const uint8_t *)w->data + j * w->cols + b * QBLOCK;
}

static inline void qg_scale_int8(const struct weight *w, int64_t j, int64_t b, float *d, float *o) {
    (void)b;
    *d = row_scale(w, j);
    *o = QG_SIGNED_OFFSET * *d;
}

#define QG_NIBBLES_int4 1
#define QG_NIBBLES_q8_0 0
#define QG_NIBBLES_int8 0

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

static inline void qg_pack_codes(const uint8_t *const rows[QG_NR], int nibbles, uint8_t *codes) {
    __m512i v[4];
    qg_transpose16(rows, 0, v);
    if (nibbles) { /* byte t: element t low, t + 16 high (quant.h) */
        const __m512i low = _mm512_set1_epi8(0x0F);
        for (int t = 0; t < 4; t++) {
            _mm512_store_si512((void *)(codes + t * 64), _mm512_and_si512(v[t], low));
            _mm512_store_si512((void *)(codes + (t + 4) * 64), _mm512_and_si512(_mm512_srli_epi32(v[t], 4), low));
        }
        return;
    }
    const __m512i flip = _mm512_set1_epi8(-128); /* + 128: the unsigned operand */
    for (int t = 0; t < 4; t++) _mm512_store_si512((void *)(codes + t * 64), _mm512_xor_si512(v[t], flip));
    qg_transpose16(rows, 16, v);
    for (int t = 0; t < 4; t++) _mm512_store_si512((void *)(codes + (t + 4) * 64), _mm512_xor_si512(v[t], flip));
}
#else
static inline void qg_pack_codes(const uint8_t *const rows[QG_NR], int nibbles, uint8_t *codes) {
    uint32_t *out = (uint32_t *)codes;
    for (int l = 0; l < QG_NR; l++) {
        uint32_t words[8];
        if (nibbles) {
            memcpy(words, rows[l], QBLOCK / 2);
            for (int t = 0; t < 4; t++) words[t + 4] = (words[t] >> 4) & 0x0F0F0F0Fu, words[t] &= 0x0F0F0F0Fu;
        } else {
            memcpy(words, rows[l], QBLOCK);
            if (QG_UNSIGNED)
                for (int t = 0; t < 8; t++) words[t] ^= 0x80808080u;
        }
        for (int t = 0; t < 8; t++) out[t * QG_NR + l] = words[t];
    }
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

/* Weight rows j0 .. j0 + nr - 1 (nr <= QG_NR) into a panel, every block; lanes past nr zero. */
#define DEFINE_QG_PACK(FMT)                                                                               \
    static inline void qg_pack_##FMT(const struct weight *w, int64_t j0, int64_t nr, int64_t full,        \
                                     uint8_t *restrict panel) {                                           \
        qg_pack_scales_##FMT(w, j0, nr, full, panel);                                                     \
        for (int64_t b = 0; b < full; b++) {                                                              \
            const uint8_t *rows[QG_NR];                                                                   \
            for (int64_t l = 0; l < QG_NR; l++) rows[l] = l < nr ? qg_codes_##FMT(w, j0 + l, b) : QG_ZEROS; \
            qg_pack_codes(rows, QG_NIBBLES_##FMT, panel + b * QG_BLOCK_BYTES);                            \
        }                                                                                                 \
    }

DEFINE_QG_PACK(int4)
DEFINE_QG_PACK(q8_0)
DEFINE_QG_PACK(int8)

static inline int32_t qg_word(const int8_t *p) { /* 4 activation codes as one 32-bit lane value */
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* ---- the product of a panel with ROWS activation rows: out[i][l] = sum over blocks ----
 * xq, xd, xs: the rows' codes [ROWS][full * 32], scales and scaled sums [ROWS][full]. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define DEFINE_QG_TILE(ROWS)                                                                              \
    static inline void qg_tile_##ROWS(const uint8_t *restrict panel, int64_t full, int signed_codes,      \
                                      const int8_t *restrict xq, const float *restrict xd,                \
                                      const float *restrict xs, float out[][QG_NR]) {                     \
        (void)signed_codes; /* + 128 at packing */                                                        \
        __m512 acc[ROWS];                                                                                 \
        for (int i = 0; i < ROWS; i++) acc[i] = _mm512_setzero_ps();                                      \
        for (int64_t b = 0; b < full; b++) {                                                              \
            const uint8_t *c = panel + b * QG_BLOCK_BYTES;                                                \
            __m512i dots[ROWS];                                                                           \
            for (int i = 0; i < ROWS; i++) dots[i] = _mm512_setzero_si512();                              \
            for (int t = 0; t < 8; t++) {                                                                 \
                const __m512i wv = _mm512_load_si512((const void *)(c + t * 64));                         \
                for (int i = 0; i < ROWS; i++)                                                            \
                    dots[i] = _mm512_dpbusd_epi32(dots[i], wv,                                            \
                                                  _mm512_set1_epi32(qg_word(xq + (i * full + b) * QBLOCK + 4 * t))); \
            }                                                                                             \
            const __m512 d = _mm512_load_ps((const float *)(c + QBLOCK * QG_NR));                         \
            const __m512 o = _mm512_load_ps((const float *)(c + QBLOCK * QG_NR + 4 * QG_NR));             \
            for (int i = 0; i < ROWS; i++) {                                                              \
                acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(xd[i * full + b])),              \
                                         _mm512_cvtepi32_ps(dots[i]), acc[i]);                            \
                acc[i] = _mm512_fmadd_ps(o, _mm512_set1_ps(xs[i * full + b]), acc[i]);                    \
            }                                                                                             \
        }                                                                                                 \
        for (int i = 0; i < ROWS; i++) _mm512_storeu_ps(out[i], acc[i]);                                  \
    }
#elif defined(__AVX2__)
/* Unsigned codes (int4): eight maddubs add up in int16, widened once per block. Signed codes:
 * |c| times x_q with c's sign, widened per word (a pair of products alone nearly fills int16). */
#define DEFINE_QG_TILE(ROWS)                                                                              \
    static inline void qg_tile_##ROWS(const uint8_t *restrict panel, int64_t full, int signed_codes,      \
                                      const int8_t *restrict xq, const float *restrict xd,                \
                                      const float *restrict xs, float out[][QG_NR]) {                     \
        const __m256i ones = _mm256_set1_epi16(1);                                                        \
        __m256 acc[ROWS];                                                                                 \
        for (int i = 0; i < ROWS; i++) acc[i] = _mm256_setzero_ps();                                      \
        for (int64_t b = 0; b < full; b++) {                                                              \
            const uint8_t *c = panel + b * QG_BLOCK_BYTES;                                                \
            __m256i dots[ROWS];                                                                           \
            for (int i = 0; i < ROWS; i++) dots[i] = _mm256_setzero_si256();                              \
            if (signed_codes) {                                                                           \
                for (int t = 0; t < 8; t++) {                                                             \
                    const __m256i wv = _mm256_load_si256((const __m256i *)(c + t * 32));                  \
                    const __m256i magnitude = _mm256_abs_epi8(wv);                                        \
                    for (int i = 0; i < ROWS; i++) {                                                      \
                        const __m256i xv = _mm256_set1_epi32(qg_word(xq + (i * full + b) * QBLOCK + 4 * t)); \
                        const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(xv, wv));  \
                        dots[i] = _mm256_add_epi32(dots[i], _mm256_madd_epi16(pairs, ones));              \
                    }                                                                                     \
                }                                                                                         \
            } else {                                                                                      \
                for (int t = 0; t < 8; t++) {                                                             \
                    const __m256i wv = _mm256_load_si256((const __m256i *)(c + t * 32));                  \
                    for (int i = 0; i < ROWS; i++) {                                                      \
                        const __m256i xv = _mm256_set1_epi32(qg_word(xq + (i * full + b) * QBLOCK + 4 * t)); \
                        dots[i] = _mm256_add_epi16(dots[i], _mm256_maddubs_epi16(wv, xv));                \
                    }                                                                                     \
                }                                                                                         \
                for (int i = 0; i < ROWS; i++) dots[i] = _mm256_madd_epi16(dots[i], ones);                \
            }                                                                                             \
            const __m256 d = _mm256_load_ps((const float *)(c + QBLOCK * QG_NR));                         \
            const __m256 o = _mm256_load_ps((const float *)(c + QBLOCK * QG_NR + 4 * QG_NR));             \
            for (int i = 0; i < ROWS; i++) {                                                              \
                acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(xd[i * full + b])),              \
                                         _mm256_cvtepi32_ps(dots[i]), acc[i]);                            \
                acc[i] = _mm256_fmadd_ps(o, _mm256_set1_ps(xs[i * full + b]), acc[i]);                    \
            }                                                                                             \
        }                                                                                                 \
        for (int i = 0; i < ROWS; i++) _mm256_storeu_ps(out[i], acc[i]);                                  \
    }
#else
#define DEFINE_QG_TILE(ROWS)                                                                              \
    static inline void qg_tile_##ROWS(const uint8_t *restrict panel, int64_t full, int signed_codes,      \
                                      const int8_t *restrict xq, const float *restrict xd,                \
                                      const float *restrict xs, float out[][QG_NR]) {                     \
        (void)signed_codes; /* + 128 at packing */                                                        \
        for (int i = 0; i < ROWS; i++)                                                                    \
            for (int l = 0; l < QG_NR; l++) out[i][l] = 0.0f;                                             \
        for (int64_t b = 0; b < full; b++) {                                                              \
            const uint8_t *c = panel + b * QG_BLOCK_BYTES;                                                \
            const float *d = (const float *)(c + QBLOCK * QG_NR), *o = d + QG_NR;                         \
            for (int i = 0; i < ROWS; i++) {                                                              \
                const int8_t *x = xq + (i * full + b) * QBLOCK;                                           \
                for (int l = 0; l < QG_NR; l++) {                                                         \
                    int32_t dot = 0;                                                                      \
                    for (int t = 0; t < 8; t++)                                                           \
                        for (int e = 0; e < 4; e++) dot += (int32_t)c[(t * QG_NR + l) * 4 + e] * x[4 * t + e]; \
                    out[i][l] += d[l] * xd[i * full + b] * (float)dot + o[l] * xs[i * full + b];          \
                }                                                                                         \
            }                                                                                             \
        }                                                                                                 \
    }
#endif

DEFINE_QG_TILE(8)
DEFINE_QG_TILE(4)
DEFINE_QG_TILE(2)
DEFINE_QG_TILE(1)

/* out [rows][QG_NR] for rows <= QG_MR activation rows: the widest register tile that fits. */
static inline int64_t qg_product(const uint8_t *panel, int64_t full, int64_t rows, int signed_codes,
                                 const int8_t *xq, const float *xd, const float *xs, float out[][QG_NR]) {
    const int64_t take = rows >= QG_MR ? QG_MR : rows >= 4 ? 4 : rows >= 2 ? 2 : 1;
    if (take == 8) qg_tile_8(panel, full, signed_codes, xq, xd, xs, out);
    else if (take == 4) qg_tile_4(panel, full, signed_codes, xq, xd, xs, out);
    else if (take == 2) qg_tile_2(panel, full, signed_codes, xq, xd, xs, out);
    else qg_tile_1(panel, full, signed_codes, xq, xd, xs, out);
    return take;
}

/* y [m, rows] = x @ w^T (+ bias) with x already rounded (xq, xd, xs: quantize_activations of
 * every row), in the calling parallel region; panel: this thread's full * QG_BLOCK_BYTES bytes,
 * on a cache line. */
#define DEFINE_QMATMUL_A8(FMT, SIGNED)                                                                    \
    static inline void qmatmul_a8_##FMT(const struct weight *w, const float *restrict x, float *restrict y, \
                                        int64_t m, const int8_t *restrict xq, const float *restrict xd,   \
                                        const float *restrict xs, uint8_t *restrict panel) {              \
        const int64_t n = w->rows, k = w->cols, full = k / QBLOCK, tail = k - full * QBLOCK;              \
        const float *bias = (const float *)w->bias;                                                       \
        _Pragma("omp for schedule(static)")                                                               \
        for (int64_t j0 = 0; j0 < n; j0 += QG_NR) {                                                       \
            const int64_t nr = n - j0 < QG_NR ? n - j0 : QG_NR;                                           \
            qg_pack_##FMT(w, j0, nr, full, panel);                                                        \
            for (int64_t i0 = 0; i0 < m;) {                                                               \
                float out[QG_MR][QG_NR];                                                                  \
                const int64_t rows = qg_product(panel, full, m - i0, SIGNED && !QG_UNSIGNED,              \
                                                xq + i0 * full * QBLOCK, xd + i0 * full, xs + i0 * full, out); \
                for (int64_t i = 0; i < rows; i++)                                                        \
                    for (int64_t l = 0; l < nr; l++)                                                      \
                        y[(i0 + i) * n + j0 + l] = out[i][l] + (bias ? bias[j0 + l] : 0.0f)               \
                                                   + (tail ? qdot_tail_##FMT(w, j0 + l, x + (i0 + i) * k) : 0.0f); \
                i0 += rows;                                                                               \
            }                                                                                             \
        }                                                                                                 \
    }

DEFINE_QMATMUL_A8(int8, 1)
DEFINE_QMATMUL_A8(q8_0, 1)
DEFINE_QMATMUL_A8(int4, 0)

static inline void qmatmul_a8_format(const struct weight *w, const float *restrict x, float *restrict y, int64_t m,
                                     const int8_t *restrict xq, const float *restrict xd, const float *restrict xs,
                                     uint8_t *restrict panel) {
    switch (w->format) {
    case WEIGHT_INT8: qmatmul_a8_int8(w, x, y, m, xq, xd, xs, panel); return;
    case WEIGHT_Q8_0: qmatmul_a8_q8_0(w, x, y, m, xq, xd, xs, panel); return;
    case WEIGHT_INT4: qmatmul_a8_int4(w, x, y, m, xq, xd, xs, panel); return;
    default: abort(); /* the Python side sets quantize_activations only for these */
    }
}

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

/* For up to m rows of up to max_cols columns and `threads` threads; KERNEL_OK or
 * KERNEL_OUT_OF_MEMORY (then nothing is held). Released by qg_scratch_free. */
static inline int qg_scratch_alloc(struct qg_scratch *s, int64_t m, int64_t max_cols, int64_t threads) {
    const int64_t full = max_cols / QBLOCK;
    s->panel_bytes = 4 * cache_lines_of_floats(full * QG_BLOCK_BYTES / 4);
    s->xq = (int8_t *)scratch_floats(m * full * QBLOCK / 4);
    s->xd = scratch_floats(m * full);
    s->xs = scratch_floats(m * full);
    s->panels = (uint8_t *)scratch_floats(threads * s->panel_bytes / 4);
    if (s->xq && s->xd && s->xs && s->panels) return KERNEL_OK;
    qg_scratch_free(s);
    return KERNEL_OUT_OF_MEMORY;
}

/* y [m, rows] = x @ w^T (+ bias) for a weight with quantize_activations set, in the calling
 * parallel region: every row of x rounded once (one barrier), then the panel product. */
static inline void qmatmul_a8(const struct weight *w, const float *restrict x, float *restrict y, int64_t m,
                              const struct qg_scratch *s) {
    const int64_t k = w->cols, full = k / QBLOCK;
    _Pragma("omp for schedule(static)")
    for (int64_t i = 0; i < m; i++)
        quantize_activations(x + i * k, 1, k, s->xq + i * full * QBLOCK, s->xd + i * full, s->xs + i * full);
    qmatmul_a8_format(w, x, y, m, s->xq, s->xd, s->xs, s->panels + omp_get_thread_num() * s->panel_bytes);
}

#endif
