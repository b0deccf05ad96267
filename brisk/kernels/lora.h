/*
 * LoRA adapters' updates over a batch of rows of several adapters (kernels/lora.py):
 *
 *     t[i] = A x[i]             shrink: each row of A read once per adapter, dotted with its rows
 *     y[i] += B t[i]            expand: each column of B read once per adapter, for its rows
 *
 * for every row i of each adapter's segment (rows[starts[a] .. starts[a + 1]]), t times the
 * segment's scale (1 but where a request scales its adapter, as llama.cpp's server lets it); rows
 * of the base model are in no segment and left alone. A fused projection's update has one A (its
 * modules' stacked, R rows) and one B per module (a piece: the rows of y it adds to, its columns of
 * t). Adapters are float32 or bfloat16 (the batch says which), activations float32.
 *
 * B is kept transposed and in tiles (lora_piece.bt): each row of the segment adds t[i, r] times a
 * run of B^T's row r along the outputs, and a tile, the part of B^T an expand pass reads, is one
 * run of memory. A tile holds LORA_COLUMNS outputs (the piece's last tile fewer, w); in it the
 * ranks come in groups of g (2 for bfloat16, 1 for float32; a last odd rank is paired with zeros),
 * group after group, each output-major: element (r, o) of tile b is at
 *
 *     b * LORA_COLUMNS * G + (r / g) * w * g + (o - b * LORA_COLUMNS) * g + r % g    (G: the rank rounded up to g)
 *
 * B^T's rows read side by side were eight short streams a pass, which the memory system fed at
 * half the rate it feeds one; a bfloat16 pair of ranks is one 32-bit word per output, widened to
 * two floats by a shift and a mask where single ranks needed a zero-extending shuffle.
 *
 * Where the CPU has AVX-512 BF16 (LORA_BF16_PRODUCTS), the shrink of bfloat16 adapters multiplies
 * bfloat16 operands (vdpbf16ps: two products a lane, summed in float32): x is rounded to bfloat16
 * as PEFT's bf16 layers take it (exactly so in a bf16 model, whose activations are bf16 already);
 * t stays float32. Elsewhere, and for float32 adapters, the arithmetic is float32.
 *
 * Both halves run over a parallel region's threads (orphaned worksharing): the region of
 * decode_layers.c's fused step (which puts a barrier after them before it reads y) or of
 * quant_linear.c's product (the update in the product's own call), or lora.c's lora_add's own.
 * How the work is cut: lora_add_rows_of. Scratch t: [rows of the step, max_rank] floats.
 */
#ifndef BRISK_LORA_H
#define BRISK_LORA_H

#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "dtypes.h"

enum lora_target { LORA_QKV, LORA_O, LORA_GATE_UP, LORA_DOWN, LORA_PROJECTIONS };

struct lora_piece {
    int64_t first_row, rows;   /* the columns of y it adds to */
    int64_t first_rank, rank;  /* its columns of t */
    const void *bt;            /* B^T in tiles, the scaling folded in */
};

struct lora_projection {      /* an adapter's update of one projection: rank 0 where there is none */
    const void *a;             /* [rank, cols] */
    int64_t rank, num_pieces;
    const struct lora_piece *pieces;
};

struct lora_batch {
    int64_t num_adapters, max_rank;
    int64_t bf16;              /* the adapters' element type: bfloat16, else float32 */
    const int64_t *rows;       /* the step's rows of adapters, grouped by adapter */
    const int64_t *starts;     /* [num_adapters + 1] */
    const float *scales;       /* [num_adapters]: a request's own scale of its adapter's update */
    const struct lora_projection **adapters; /* each: [num_layers * LORA_PROJECTIONS] */
};

/* Outputs a tile of B^T holds (kernels/lora.py packs them). Rows of A a shrink task covers: with
 * a single sequence (a decode step of one) the shrink still splits across the threads. Ranks the
 * expand holds in registers at once: a larger rank takes several passes over its rows' y. Bytes a
 * thread prefetches ahead of what it reads of an adapter (the hardware's prefetchers start late on
 * streams of 10-70 KB, which an adapter's update of one projection is). */
#define LORA_COLUMNS 128
#define LORA_RANKS 16
#define LORA_EXPAND_RANKS 64
#define LORA_PREFETCH 16384

/* Register blocks. A vector is one AVX-512 register where the host has them, else one AVX2 one
 * (GCC's vector extensions lower it to whatever the target has). The shrink holds up to four rows
 * of the segment against LORA_SHRINK_RANKS rows of A in accumulators (16 of AVX-512's 32
 * registers; 8 of AVX2's 16): each element of A loaded once for the rows, each of x once for the
 * ranks. The expand holds LORA_EXPAND_ACCUMULATORS vectors of y (four rows' outputs) while B^T's
 * ranks pass: y read and written once per tile, each element of B^T loaded once for the rows. An
 * FMA takes four cycles and two issue a cycle: fewer than eight chains leave the units idle. */
#ifdef __AVX512F__
#define LORA_VECTOR_BYTES 64
#define LORA_SHRINK_RANKS 4
#define LORA_EXPAND_ACCUMULATORS 16
#define LORA_EXPAND_VECTORS 8
#else
#define LORA_VECTOR_BYTES 32
#define LORA_SHRINK_RANKS 2
#define LORA_EXPAND_ACCUMULATORS 8
#define LORA_EXPAND_VECTORS 4
#endif
#define LORA_LANES (LORA_VECTOR_BYTES / 4)
#define LORA_BLOCK_ROWS 4

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define LORA_BF16_PRODUCTS 1
#include <immintrin.h>
#else
#define LORA_BF16_PRODUCTS 0
#endif

typedef float lora_floats __attribute__((vector_size(LORA_VECTOR_BYTES)));
typedef uint32_t lora_words __attribute__((vector_size(LORA_VECTOR_BYTES)));
typedef uint16_t lora_halves __attribute__((vector_size(LORA_VECTOR_BYTES / 2)));

/* Every block function is inlined where its row, rank and type counts are constants, so each
 * case compiles to its own unrolled loop with its accumulators in registers. */
#define LORA_INLINE static inline __attribute__((always_inline))

LORA_INLINE lora_floats lora_as_floats(lora_words w) {
    lora_floats f;
    memcpy(&f, &w, sizeof f);
    return f;
}

/* LORA_LANES elements from p + i (any alignment) as floats: an adapter's A is bf16 or float32 */
LORA_INLINE lora_floats lora_load(const void *p, int64_t i, const int bf16) {
    lora_floats f;
    if (bf16) {
        lora_halves h;
        memcpy(&h, (const uint16_t *)p + i, sizeof h);
        return lora_as_floats(__builtin_convertvector(h, lora_words) << 16);
    }
    memcpy(&f, (const float *)p + i, sizeof f);
    return f;
}

LORA_INLINE float lora_element(const void *p, int64_t i, const int bf16) {
    return bf16 ? load_bf16(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* What the products read of an activation: itself, or where they multiply bfloat16 operands its
 * bfloat16 rounding */
LORA_INLINE float lora_operand(float v, const int bf16) {
    return bf16 && LORA_BF16_PRODUCTS ? load_bf16(store_bf16(v)) : v;
}

LORA_INLINE float lora_sum(lora_floats v) {
    float s = 0.0f;
    for (int l = 0; l < LORA_LANES; l++) s += v[l];
    return s;
}

/* Prefetches LORA_PREFETCH bytes ahead of a block of A or B^T that is read a column at a time
 * across its rows (`width` bytes a column, in all): at column `done`, the share of the next `step`
 * columns that far on. Over the block it sweeps the LORA_PREFETCH bytes after it at the pace the
 * block is read, so the stream runs ahead across block, projection and adapter boundaries. */
LORA_INLINE void lora_prefetch(const void *block, int64_t width, int64_t done, int64_t step) {
    const char *at = (const char *)block + LORA_PREFETCH + width * done;
    for (int64_t line = 0; line < width * step; line += 64) __builtin_prefetch(at + line);
}

/* One vector of columns from c on into the accumulators acc[q][j] (lora_shrink_block) */
#define LORA_SHRINK_STEP(acc, c)                                                                         \
    do {                                                                                                 \
        lora_floats xs[LORA_BLOCK_ROWS];                                                                 \
        lora_prefetch(a, nj * (bf16 ? 2 : 4), c, LORA_LANES);                                            \
        for (int q = 0; q < nr; q++) memcpy(&xs[q], x[q] + (c), sizeof xs[q]);                           \
        for (int j = 0; j < nj; j++) {                                                                   \
            const lora_floats w = lora_load(a, j * k + (c), bf16);                                       \
            for (int q = 0; q < nr; q++) acc[q][j] += w * xs[q];                                         \
        }                                                                                                \
    } while (0)
/* The same for 32 columns with AVX-512 BF16: x rounded to bf16 pairs, one vdpbf16ps per (row, rank) */
#define LORA_SHRINK_PAIRS(acc, c)                                                                        \
    do {                                                                                                 \
        __m512bh xs[LORA_BLOCK_ROWS];                                                                    \
        lora_prefetch(a, nj * 2, c, 32);                                                                 \
        for (int q = 0; q < nr; q++)                                                                     \
            xs[q] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x[q] + (c) + 16), _mm512_loadu_ps(x[q] + (c)));  \
        for (int j = 0; j < nj; j++) {                                                                   \
            const __m512bh w = (__m512bh)_mm512_loadu_si512((const uint16_t *)a + j * k + (c));          \
            for (int q = 0; q < nr; q++) acc[q][j] = _mm512_dpbf16_ps(acc[q][j], w, xs[q]);              \
        }                                                                                                \
    } while (0)

/* sums[q * LORA_SHRINK_RANKS + j] = A[j] . x[q] for the block's nr rows x and nj rows of A, with
 * two sets of accumulators taking alternate vectors of the columns where one set is under eight */
LORA_INLINE void lora_shrink_block(const void *a, int64_t k, const float *const *x, const int nr, const int nj,
                                   const int bf16, float *sums) {
    const int two = nr * nj < 8;
    int64_t c = 0;
#if LORA_BF16_PRODUCTS
    if (bf16) {
        __m512 even[LORA_BLOCK_ROWS][LORA_SHRINK_RANKS], odd[LORA_BLOCK_ROWS][LORA_SHRINK_RANKS];
        for (int q = 0; q < nr; q++)
            for (int j = 0; j < nj; j++) even[q][j] = odd[q][j] = _mm512_setzero_ps();
        if (two)
            for (; c + 64 <= k; c += 64) {
                LORA_SHRINK_PAIRS(even, c);
                LORA_SHRINK_PAIRS(odd, c + 32);
            }
        for (; c + 32 <= k; c += 32) LORA_SHRINK_PAIRS(even, c);
        for (int q = 0; q < nr; q++)
            for (int j = 0; j < nj; j++)
                sums[q * LORA_SHRINK_RANKS + j] = _mm512_reduce_add_ps(_mm512_add_ps(even[q][j], odd[q][j]));
    } else
#endif
    {
        lora_floats even[LORA_BLOCK_ROWS][LORA_SHRINK_RANKS] = {{{0}}};
        lora_floats odd[LORA_BLOCK_ROWS][LORA_SHRINK_RANKS] = {{{0}}};
        if (two)
            for (; c + 2 * LORA_LANES <= k; c += 2 * LORA_LANES) {
                LORA_SHRINK_STEP(even, c);
                LORA_SHRINK_STEP(odd, c + LORA_LANES);
            }
        for (; c + LORA_LANES <= k; c += LORA_LANES) LORA_SHRINK_STEP(even, c);
        for (int q = 0; q < nr; q++)
            for (int j = 0; j < nj; j++) sums[q * LORA_SHRINK_RANKS + j] = lora_sum(even[q][j] + odd[q][j]);
    }
    for (int q = 0; q < nr; q++)
        for (int j = 0; j < nj; j++)
            for (int64_t e = c; e < k; e++)
                sums[q * LORA_SHRINK_RANKS + j] += lora_element(a, j * k + e, bf16) * lora_operand(x[q][e], bf16);
}

/* y[q][o, o + nv vectors) += t[q][0, rank) . B^T[0, rank)[o, ...) from one tile (w outputs wide,
 * ranks from the tile's `group`-th group on) for the block's nr rows: nr x nv accumulators.
 * t: [LORA_BLOCK_ROWS][LORA_EXPAND_RANKS], zero past rank. */
LORA_INLINE void lora_expand_vectors(const void *tile, int64_t w, int64_t group, int64_t rank,
                                     const float (*t)[LORA_EXPAND_RANKS], float *const *y, int64_t o, const int nr,
                                     const int nv, const int bf16) {
    lora_floats acc[LORA_BLOCK_ROWS][LORA_EXPAND_VECTORS];
    for (int q = 0; q < nr; q++)
        for (int v = 0; v < nv; v++) memcpy(&acc[q][v], y[q] + o + v * LORA_LANES, sizeof acc[q][v]);
    if (bf16) { /* a word per output: rank r in its low half, r + 1 in its high half */
        for (int64_t r = 0; r < rank; r += 2) {
            const uint32_t *pairs = (const uint32_t *)tile + (group + r / 2) * w + o;
            lora_floats low[LORA_EXPAND_VECTORS], high[LORA_EXPAND_VECTORS];
            for (int v = 0; v < nv; v++) {
                lora_words words;
                memcpy(&words, pairs + v * LORA_LANES, sizeof words);
                low[v] = lora_as_floats(words << 16);
                high[v] = lora_as_floats(words & 0xFFFF0000u);
            }
            for (int q = 0; q < nr; q++)
                for (int v = 0; v < nv; v++) acc[q][v] += t[q][r] * low[v] + t[q][r + 1] * high[v];
        }
    } else {
        for (int64_t r = 0; r < rank; r++) {
            lora_floats b[LORA_EXPAND_VECTORS];
            const float *row = (const float *)tile + (group + r) * w + o;
            for (int v = 0; v < nv; v++) memcpy(&b[v], row + v * LORA_LANES, sizeof b[v]);
            for (int q = 0; q < nr; q++)
                for (int v = 0; v < nv; v++) acc[q][v] += t[q][r] * b[v];
        }
    }
    for (int q = 0; q < nr; q++)
        for (int v = 0; v < nv; v++) memcpy(y[q] + o + v * LORA_LANES, &acc[q][v], sizeof acc[q][v]);
}

/* y[q][first * LORA_COLUMNS, last * LORA_COLUMNS) += t[q] . B^T over tiles [first, last) of a
 * piece, for the block's nr rows (t[q], y[q]: their own columns of t and y for the piece) */
LORA_INLINE void lora_expand_tiles(const struct lora_piece *piece, int64_t first, int64_t last, const float *const *t,
                                   float *const *y, const int nr, const int bf16) {
    const int g = bf16 ? 2 : 1, size = bf16 ? 2 : 4;
    const int nv = LORA_EXPAND_ACCUMULATORS / nr < LORA_EXPAND_VECTORS ? LORA_EXPAND_ACCUMULATORS / nr
                                                                        : LORA_EXPAND_VECTORS;
    const int64_t groups = (piece->rank + g - 1) / g;
    for (int64_t r0 = 0; r0 < piece->rank; r0 += LORA_EXPAND_RANKS) {
        const int64_t ranks = piece->rank - r0 < LORA_EXPAND_RANKS ? piece->rank - r0 : LORA_EXPAND_RANKS;
        const int64_t group = r0 / g, held = (ranks + g - 1) / g * g;
        float ts[LORA_BLOCK_ROWS][LORA_EXPAND_RANKS]; /* this pass's t, an odd rank's partner zero */
        for (int q = 0; q < nr; q++)
            for (int64_t r = 0; r < held; r++) ts[q][r] = r < ranks ? t[q][r0 + r] : 0.0f;
        for (int64_t b = first; b < last; b++) {
            const int64_t lo = b * LORA_COLUMNS;
            const int64_t w = piece->rows - lo < LORA_COLUMNS ? piece->rows - lo : LORA_COLUMNS;
            const void *tile = (const char *)piece->bt + lo * groups * g * size;
            float *ys[LORA_BLOCK_ROWS];
            for (int q = 0; q < nr; q++) ys[q] = y[q] + lo;
            int64_t o = 0;
            for (; o + nv * LORA_LANES <= w; o += nv * LORA_LANES)
                lora_expand_vectors(tile, w, group, ranks, ts, ys, o, nr, nv, bf16);
            for (; o + LORA_LANES <= w; o += LORA_LANES)
                lora_expand_vectors(tile, w, group, ranks, ts, ys, o, nr, 1, bf16);
            for (; o < w; o++)
                for (int q = 0; q < nr; q++) {
                    float s = ys[q][o];
                    for (int64_t r = 0; r < ranks; r++)
                        s += ts[q][r] * lora_element(tile, ((group + r / g) * w + o) * g + r % g, bf16);
                    ys[q][o] = s;
                }
        }
    }
}

#define LORA_ROWS_CASES(nr, CALL) \
    switch (nr) {                 \
    case 4: CALL(4); break;       \
    case 3: CALL(3); break;       \
    case 2: CALL(2); break;       \
    default: CALL(1); break;      \
    }

/* t[i, j] for the (up to four) rows of adapter a's segment from its `first`-th row on, and rows
 * [j0, j1) of its A */
LORA_INLINE void lora_shrink_rows(const struct lora_batch *batch, int64_t a, const struct lora_projection *p,
                                  int64_t first, int64_t j0, int64_t j1, const float *x, int64_t k, float *t,
                                  const int bf16) {
    const int64_t R = batch->max_rank, last = batch->starts[a + 1];
    const int nr = (int)(last - first < LORA_BLOCK_ROWS ? last - first : LORA_BLOCK_ROWS);
    const float *xs[LORA_BLOCK_ROWS], scale = batch->scales[a];
    for (int q = 0; q < nr; q++) xs[q] = x + batch->rows[first + q] * k;
    for (int64_t j = j0; j < j1; j += LORA_SHRINK_RANKS) {
        float sums[LORA_BLOCK_ROWS * LORA_SHRINK_RANKS];
        const void *aj = (const char *)p->a + j * k * (bf16 ? 2 : 4);
        const int nj = (int)(j1 - j < LORA_SHRINK_RANKS ? j1 - j : LORA_SHRINK_RANKS);
        if (nj == LORA_SHRINK_RANKS) {
#define LORA_SHRINK(NR) lora_shrink_block(aj, k, xs, NR, LORA_SHRINK_RANKS, bf16, sums)
            LORA_ROWS_CASES(nr, LORA_SHRINK)
#undef LORA_SHRINK
        } else { /* a rank that is not a multiple of the block */
            for (int jj = 0; jj < nj; jj++) {
                float one[LORA_BLOCK_ROWS * LORA_SHRINK_RANKS];
                const void *row = (const char *)aj + jj * k * (bf16 ? 2 : 4);
#define LORA_SHRINK(NR) lora_shrink_block(row, k, xs, NR, 1, bf16, one)
                LORA_ROWS_CASES(nr, LORA_SHRINK)
#undef LORA_SHRINK
                for (int q = 0; q < nr; q++) sums[q * LORA_SHRINK_RANKS + jj] = one[q * LORA_SHRINK_RANKS];
            }
        }
        for (int q = 0; q < nr; q++)
            for (int jj = 0; jj < nj; jj++)
                t[batch->rows[first + q] * R + j + jj] = sums[q * LORA_SHRINK_RANKS + jj] * scale;
    }
}

/* y += B t over tiles [from, to) of one piece of adapter a's update, for every row of its segment */
LORA_INLINE void lora_expand_rows(const struct lora_batch *batch, int64_t a, const struct lora_piece *piece,
                                  int64_t from, int64_t to, const float *t, float *y, int64_t n, const int bf16) {
    for (int64_t s = batch->starts[a]; s < batch->starts[a + 1]; s += LORA_BLOCK_ROWS) {
        const int64_t left = batch->starts[a + 1] - s;
        const int nr = (int)(left < LORA_BLOCK_ROWS ? left : LORA_BLOCK_ROWS);
        const float *ts[LORA_BLOCK_ROWS];
        float *ys[LORA_BLOCK_ROWS];
        for (int i = 0; i < nr; i++) {
            ts[i] = t + batch->rows[s + i] * batch->max_rank + piece->first_rank;
            ys[i] = y + batch->rows[s + i] * n + piece->first_row;
        }
#define LORA_EXPAND(NR) lora_expand_tiles(piece, from, to, ts, ys, NR, bf16)
        LORA_ROWS_CASES(nr, LORA_EXPAND)
#undef LORA_EXPAND
    }
}

LORA_INLINE int64_t lora_tiles(const struct lora_piece *piece) {
    return (piece->rows + LORA_COLUMNS - 1) / LORA_COLUMNS;
}

/* The segments' updates of the step's rows, with t scratch [rows of the step, R]: the shrink's
 * tasks (four rows of one adapter against LORA_RANKS rows of its A, in L1 or L2 after the first
 * task reads them) in an `omp for`, then the adapters' tiles in order, a run per thread (tiles
 * write disjoint parts of y: a row belongs to one segment, a tile to one piece). Giving each
 * thread whole adapters instead (their shrink and expand, no barrier between) measured the same;
 * splitting the expand by y's columns, as the base product splits them, took 60% longer (each
 * thread then reads half of every adapter's tiles: twice the streams, half as long). */
LORA_INLINE void lora_add_rows_of(const struct lora_batch *batch, int64_t index, const float *x, float *y,
                                  int64_t k, int64_t n, float *t, const int bf16) {
    const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num(), adapters = batch->num_adapters;
    const int64_t chunks = (batch->max_rank + LORA_RANKS - 1) / LORA_RANKS;
    int64_t tasks = 0;
    for (int64_t a = 0; a < adapters; a++)
        tasks += (batch->starts[a + 1] - batch->starts[a] + LORA_BLOCK_ROWS - 1) / LORA_BLOCK_ROWS * chunks;
#pragma omp for schedule(static)
    for (int64_t task = 0; task < tasks; task++) {
        int64_t a = 0, s = task / chunks;
        const int64_t chunk = task % chunks;
        while (s >= (batch->starts[a + 1] - batch->starts[a] + LORA_BLOCK_ROWS - 1) / LORA_BLOCK_ROWS)
            s -= (batch->starts[a + 1] - batch->starts[a] + LORA_BLOCK_ROWS - 1) / LORA_BLOCK_ROWS, a++;
        const struct lora_projection *p = batch->adapters[a] + index;
        const int64_t j_end = (chunk + 1) * LORA_RANKS < p->rank ? (chunk + 1) * LORA_RANKS : p->rank;
        lora_shrink_rows(batch, a, p, batch->starts[a] + LORA_BLOCK_ROWS * s, chunk * LORA_RANKS, j_end, x, k, t, bf16);
    }
    int64_t total = 0;
    for (int64_t a = 0; a < adapters; a++) {
        const struct lora_projection *p = batch->adapters[a] + index;
        for (int64_t q = 0; q < p->num_pieces; q++) total += lora_tiles(p->pieces + q);
    }
    const int64_t begin = total * me / threads, end = total * (me + 1) / threads;
    int64_t seen = 0; /* tiles before the current piece's first */
    for (int64_t a = 0; a < adapters && seen < end; a++) {
        const struct lora_projection *p = batch->adapters[a] + index;
        for (int64_t q = 0; q < p->num_pieces && seen < end; q++) {
            const int64_t tiles = lora_tiles(p->pieces + q);
            const int64_t from = begin > seen ? begin - seen : 0, to = end - seen < tiles ? end - seen : tiles;
            if (from < to) lora_expand_rows(batch, a, p->pieces + q, from, to, t, y, n, bf16);
            seen += tiles;
        }
    }
}

static void lora_add_rows(const struct lora_batch *batch, int64_t index, const float *x, float *y, int64_t k,
                          int64_t n, float *t) {
    if (batch->bf16)
        lora_add_rows_of(batch, index, x, y, k, n, t, 1);
    else
        lora_add_rows_of(batch, index, x, y, k, n, t, 0);
}

#endif
