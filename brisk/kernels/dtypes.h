/* Element loads and stores shared by the kernels: every kernel computes in float32; bfloat16
 * tensors are read and written as uint16 bit patterns. */
#ifndef BRISK_DTYPES_H
#define BRISK_DTYPES_H

#include <stdint.h>
#include <string.h>

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

#endif
