/* tile_rows: a weight's rows interleaved in tiles of 16, the layouts quant.h's integer products
 * read ("tiles of 16 rows" there), in one pass over the weight with the tiles shared by the threads.
 *
 * kernels/packed.py's tile_rows says the same in torch and is the reference this is tested
 * against byte for byte; it made a dozen whole-matrix temporaries per weight, 3.8 of the 8.9 s a
 * 1.7B Q4_K_M file took to load on two Zen 4 cores.
 *
 * Inputs, by the source format (quant.h's enum weight_format):
 *   WEIGHT_INT4   codes [rows, blocks * 16] (nibbles as int4 keeps them), scales and mins [rows, blocks] f16
 *   WEIGHT_INT5   codes [rows, blocks * 20] ({u32 fifth bits, 16 nibble bytes}), scales and mins f16
 *   WEIGHT_Q8_0   the file's blocks [rows, blocks * 34] ({f16 d, int8 q[32]})
 *   WEIGHT_Q4_K, WEIGHT_Q5_K, WEIGHT_Q6_K   the file's super-blocks [rows, supers * 144 | 176 | 210]
 * `out` receives tiles * (blocks * TILE_BLOCK_BYTES) bytes; lanes past the last row are zeros.
 *
 * A tile's record for a block is its code words then its fields: word w of lane l at
 * 64 w + 4 l, and a field of `width` bytes at its offset + width * l. The K-quants group 8 such
 * records per super-block, followed by the 16 rows' f16 d (and dmin). */
#include <stdint.h>
#include <string.h>

#include "quant.h"

#define LANES 16
#define QBLOCK 32

struct tile_layout {
    int64_t words;        /* code words of 4 bytes per lane and block */
    int64_t record;       /* bytes per block record of a tile */
    int64_t fields;       /* one-byte (K-quants) or two-byte fields after the words */
    int64_t field_width;
    int64_t heads;        /* K-quants: f16 values per super-block after its 8 records (d, dmin) */
};

static inline __attribute__((always_inline)) struct tile_layout layout_of(int64_t format) {
    switch (format) {
        case WEIGHT_INT4: return (struct tile_layout){4, LANES * (16 + 4), 2, 2, 0};
        case WEIGHT_INT5: return (struct tile_layout){5, LANES * (20 + 4), 2, 2, 0};
        case WEIGHT_Q8_0: return (struct tile_layout){8, LANES * (32 + 2), 1, 2, 0};
        case WEIGHT_Q4_K: return (struct tile_layout){4, LANES * (16 + 2), 2, 1, 2};
        case WEIGHT_Q5_K: return (struct tile_layout){5, LANES * (20 + 2), 2, 1, 2};
        default: return (struct tile_layout){6, LANES * (24 + 2), 2, 1, 1}; /* WEIGHT_Q6_K */
    }
}

/* Bytes of a K-quant's super-block of 256 columns (quant.h's sizes). */
static inline int64_t k_bytes(int64_t format) {
    return format == WEIGHT_Q4_K ? Q4_K_BYTES : format == WEIGHT_Q5_K ? Q5_K_BYTES : Q6_K_BYTES;
}

/* Q4_K/Q5_K's 12 bytes of 6-bit fields -> block k's scale and minimum (quant.h). */
static inline void k_scale(const uint8_t *p, int k, uint8_t *sc, uint8_t *m) {
    if (k < 4) {
        *sc = p[k] & 63;
        *m = p[k + 4] & 63;
    } else {
        *sc = (uint8_t)((p[k + 4] & 15) | ((p[k - 4] >> 2) & 48));
        *m = (uint8_t)((p[k + 4] >> 4) | ((p[k] >> 2) & 48));
    }
}

/* One row's block b: its code bytes (words * 4) and its fields (fields * field_width bytes). */
static inline __attribute__((always_inline)) void row_block(int64_t format, const uint8_t *codes,
                                                            const uint8_t *scales, const uint8_t *mins, int64_t row,
                                                            int64_t blocks, int64_t b, uint8_t *code, uint8_t *field) {
    switch (format) {
        case WEIGHT_INT4:
        case WEIGHT_INT5: {
            const int64_t bytes = format == WEIGHT_INT4 ? 16 : 20;
            const uint8_t *block = codes + (row * blocks + b) * bytes;
            if (format == WEIGHT_INT4) {
                memcpy(code, block, 16);
            } else { /* {u32 fifth bits, nibbles} -> {nibbles, fifth bits by word} */
                memcpy(code, block + 4, 16);
                uint32_t high; /* bit j: element j's fifth bit */
                memcpy(&high, block, 4);
                for (int e = 0; e < 4; e++) {
                    uint8_t byte = 0;
                    for (int t = 0; t < 8; t++) byte |= (uint8_t)(((high >> (4 * t + e)) & 1) << t);
                    code[16 + e] = byte;
                }
            }
            memcpy(field, scales + (row * blocks + b) * 2, 2);
            memcpy(field + 2, mins + (row * blocks + b) * 2, 2);
            return;
        }
        case WEIGHT_Q8_0: {
            const uint8_t *block = codes + (row * blocks + b) * 34;
            for (int j = 0; j < 32; j++) code[j] = block[2 + j] ^ 0x80;
            memcpy(field, block, 2);
            return;
        }
        case WEIGHT_Q4_K:
        case WEIGHT_Q5_K: {
            const int64_t bytes = k_bytes(format);
            const int k = (int)(b % 8);
            const uint8_t *super = codes + (row * (blocks / 8) + b / 8) * bytes;
            const uint8_t *qs = super + bytes - 128 + 32 * (k / 2);
            const int shift = 4 * (k % 2);
            for (int j = 0; j < 16; j++)
                code[j] = (uint8_t)(((qs[j] >> shift) & 15) | (((qs[16 + j] >> shift) & 15) << 4));
            if (format == WEIGHT_Q5_K) {
                for (int e = 0; e < 4; e++) { /* element l's fifth bit is bit k of qh[l] */
                    uint8_t byte = 0;
                    for (int t = 0; t < 8; t++) byte |= (uint8_t)(((super[16 + 4 * t + e] >> k) & 1) << t);
                    code[16 + e] = byte;
                }
            }
            k_scale(super + 4, k, &field[0], &field[1]);
            return;
        }
        default: { /* WEIGHT_Q6_K */
            const int k = (int)(b % 8);
            const uint8_t *super = codes + (row * (blocks / 8) + b / 8) * Q6_K_BYTES;
            const uint8_t *ql = super + 64 * (k / 4) + 32 * (k % 2), *qh = super + 128 + 32 * (k / 4);
            const int low_shift = 4 * (k / 2 % 2), high_shift = 2 * (k % 4);
            uint8_t value[QBLOCK];
            for (int t = 0; t < QBLOCK; t++)
                value[t] = (uint8_t)(((ql[t] >> low_shift) & 15) | ((qh[t] >> high_shift) & 3) << 4);
            for (int j = 0; j < 16; j++) code[j] = (uint8_t)((value[j] & 15) | (value[16 + j] & 15) << 4);
            for (int a = 0; a < 2; a++) /* byte e of half a: element 16 a + 4 t + e's high bits at 2 t */
                for (int e = 0; e < 4; e++) {
                    uint8_t byte = 0;
                    for (int t = 0; t < 4; t++) byte |= (uint8_t)((value[16 * a + 4 * t + e] >> 4) << (2 * t));
                    code[16 + 4 * a + e] = byte;
                }
            field[0] = super[192 + 2 * k];
            field[1] = super[192 + 2 * k + 1];
            return;
        }
    }
}

/* The loop, inlined once per format (tile_rows' switch) so that every size and branch in it is a
 * constant: called per block through a switch it ran at 0.45 GB/s. */
static inline __attribute__((always_inline)) void tile_all(int64_t format, const uint8_t *codes, const uint8_t *scales,
                                                           const uint8_t *mins, int64_t rows, int64_t cols,
                                                           uint8_t *out) {
    const struct tile_layout t = layout_of(format);
    const int64_t blocks = cols / QBLOCK, tiles = (rows + LANES - 1) / LANES;
    const int k_quant = t.heads > 0;
    const int64_t super_bytes = 8 * t.record + t.heads * 2 * LANES; /* K-quants: 8 records, then d (and dmin) */
    const int64_t tile_bytes = k_quant ? blocks / 8 * super_bytes : blocks * t.record;
    _Pragma("omp parallel for schedule(static)")
    for (int64_t tile = 0; tile < tiles; tile++) {
        uint8_t *dst = out + tile * tile_bytes;
        if ((tile + 1) * LANES > rows) memset(dst, 0, (size_t)tile_bytes); /* the last tile's missing rows */
        for (int64_t lane = 0; lane < LANES && tile * LANES + lane < rows; lane++) {
            const int64_t row = tile * LANES + lane;
            for (int64_t b = 0; b < blocks; b++) {
                uint8_t code[32], field[4];
                row_block(format, codes, scales, mins, row, blocks, b, code, field);
                uint8_t *record = dst + (k_quant ? b / 8 * super_bytes + b % 8 * t.record : b * t.record);
                for (int64_t w = 0; w < t.words; w++) memcpy(record + w * 4 * LANES + 4 * lane, code + 4 * w, 4);
                uint8_t *fields = record + t.words * 4 * LANES;
                for (int64_t f = 0; f < t.fields; f++)
                    memcpy(fields + f * t.field_width * LANES + t.field_width * lane, field + f * t.field_width,
                           (size_t)t.field_width);
                if (k_quant && b % 8 == 7) { /* the super-block's f16 d (and dmin), after its 8 records */
                    const uint8_t *super = codes + (row * (blocks / 8) + b / 8) * k_bytes(format);
                    uint8_t *heads = dst + b / 8 * super_bytes + 8 * t.record;
                    if (format == WEIGHT_Q6_K) {
                        memcpy(heads + 2 * lane, super + 208, 2);
                    } else {
                        memcpy(heads + 2 * lane, super, 2);
                        memcpy(heads + 2 * LANES + 2 * lane, super + 2, 2);
                    }
                }
            }
        }
    }
}

void tile_rows(int64_t format, const uint8_t *codes, const uint8_t *scales, const uint8_t *mins, int64_t rows,
               int64_t cols, uint8_t *out) {
    switch (format) {
        case WEIGHT_INT4: tile_all(WEIGHT_INT4, codes, scales, mins, rows, cols, out); return;
        case WEIGHT_INT5: tile_all(WEIGHT_INT5, codes, scales, mins, rows, cols, out); return;
        case WEIGHT_Q8_0: tile_all(WEIGHT_Q8_0, codes, scales, mins, rows, cols, out); return;
        case WEIGHT_Q4_K: tile_all(WEIGHT_Q4_K, codes, scales, mins, rows, cols, out); return;
        case WEIGHT_Q5_K: tile_all(WEIGHT_Q5_K, codes, scales, mins, rows, cols, out); return;
        default: tile_all(WEIGHT_Q6_K, codes, scales, mins, rows, cols, out);
    }
}
