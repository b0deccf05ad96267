/* Element loads and stores shared by the kernels: every kernel computes in float32; bfloat16
 * and float16 tensors are read and written as uint16 bit patterns. */
#ifndef BRISK_DTYPES_H
#define BRISK_DTYPES_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef __F16C__
#include <immintrin.h>
#endif

static inline float load_f32(float x) { return x; }
static inline float store_f32(float x) { return x; }

static inline float load_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t store_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFF + ((u >> 16) & 1); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

/* Exact for every finite half, and written so loops over arrays vectorize (F16C's scalar
 * conversion does not): a normal half's exponent and mantissa move into a float's with the
 * exponent rebiased by integer addition; a subnormal one is mantissa x 2^-24. Infinities and
 * NaNs, which no cache or GGUF scale holds, come out finite. */
static inline float load_f16(uint16_t h) {
    const uint32_t magnitude = h & 0x7FFF, sign = (uint32_t)(h & 0x8000) << 16;
    const uint32_t normal = (magnitude << 13) + (112u << 23);
    float f;
    memcpy(&f, &normal, sizeof f);
    if (magnitude < 0x400) f = (float)magnitude * 0x1p-24f;
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits |= sign;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* One half on its own (a GGUF block's scale): F16C's scalar conversion where there is one, which
 * is one instruction where load_f16's bit arithmetic is a dozen (load_f16 is for loops, where it
 * vectorizes). Both are exact. */
static inline float load_f16_scalar(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    return load_f16(h);
#endif
}

static inline uint16_t store_f16(float f) { /* round to nearest even, as torch's .half() */
#ifdef __F16C__
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint16_t sign = (x >> 16) & 0x8000;
    const uint32_t ax = x & 0x7FFFFFFF;
    if (ax > 0x7F800000) return sign | 0x7E00;                            /* NaN */
    if (ax >= 0x477FF000) return sign | 0x7C00;                           /* rounds past 65504: inf */
    if (ax < 0x38800000) return sign | (uint16_t)lrintf(fabsf(f) * 0x1p24f); /* half subnormal: steps of 2^-24 */
    const uint32_t r = ax - (112u << 23);                                 /* rebias the exponent */
    return sign | (uint16_t)((r + 0xFFF + ((r >> 13) & 1)) >> 13);
#endif
}

static inline float load_i8(int8_t c) { return (float)c; }

/*
 * KV cache kinds. A cache entry is one token's head: HEAD_DIM values written at once (RoPE +
 * cache write, attention.h) from floats y, element d at dst[d * stride] (keys are stored
 * transposed, values not). Float kinds round each value; i8 stores codes round(y * (1 / s)) with
 * one float scale s = max|y| * (1 / 127) per token and head, written to *scale: K and V in a quarter of
 * fp32's bytes, and the attention loops fold s into the score (keys) or the probability
 * (values), so a code is never turned back into a float in memory.
 */
#define DEFINE_STORE_HEAD(SUFFIX, CT, STORE)                                                              \
    static inline void store_head_##SUFFIX(CT *restrict dst, int64_t stride, const float *restrict y,     \
                                           int64_t n, float *restrict scale) {                            \
        (void)scale;                                                                                      \
        for (int64_t d = 0; d < n; d++) dst[d * stride] = STORE(y[d]);                                    \
    }
DEFINE_STORE_HEAD(f32, float, store_f32)
DEFINE_STORE_HEAD(bf16, uint16_t, store_bf16)
DEFINE_STORE_HEAD(f16, uint16_t, store_f16)

static inline void store_head_i8(int8_t *restrict dst, int64_t stride, const float *restrict y, int64_t n,
                                 float *restrict scale) {
    float top = 0.0f;
    for (int64_t d = 0; d < n; d++) top = fabsf(y[d]) > top ? fabsf(y[d]) : top;
    const float s = top * (1.0f / 127.0f), inv = s > 0.0f ? 1.0f / s : 0.0f; /* products: as -ffast-math would */
    *scale = s;
    for (int64_t d = 0; d < n; d++) dst[d * stride] = (int8_t)nearbyintf(y[d] * inv);
}

/* M(..., suffix, element type, load, store_head, scaled) for every cache kind: scaled kinds keep a
 * float scale per token and head beside the codes. */
#define FOR_EACH_KV_KIND(M, ...)                                                                          \
    M(__VA_ARGS__, f32, float, load_f32, store_head_f32, 0)                                               \
    M(__VA_ARGS__, bf16, uint16_t, load_bf16, store_head_bf16, 0)                                         \
    M(__VA_ARGS__, f16, uint16_t, load_f16, store_head_f16, 0)                                            \
    M(__VA_ARGS__, i8, int8_t, load_i8, store_head_i8, 1)

#endif
