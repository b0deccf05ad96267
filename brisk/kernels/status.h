/* What a kernel that allocates scratch returns (as an int): KERNEL_OK, or KERNEL_OUT_OF_MEMORY
 * when an allocation failed. Such a kernel allocates everything before it reads or writes any
 * tensor, so on failure it has changed nothing; cpu.py raises MemoryError naming the kernel.
 * No kernel allocates inside a parallel region: the scratch of every thread is taken at once,
 * before it, and checked once. */
#ifndef BRISK_STATUS_H
#define BRISK_STATUS_H

#include <stdint.h>
#include <stdlib.h>

enum kernel_status { KERNEL_OK = 0, KERNEL_OUT_OF_MEMORY = 1 };

/* n floats rounded up to whole 64-byte cache lines: the stride of per-thread slices of one
 * scratch_floats() allocation, so no two threads ever write the same line. */
static inline int64_t cache_lines_of_floats(int64_t n) { return (n + 15) / 16 * 16; }

/* Scratch of n floats starting on a cache line (one line at least, so NULL always means out of
 * memory), or NULL; released by free(). */
static inline float *scratch_floats(int64_t n) {
    return aligned_alloc(64, sizeof(float) * (size_t)cache_lines_of_floats(n > 0 ? n : 1));
}

#endif
