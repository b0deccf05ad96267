/* The host's own limits, measured as the kernels meet them: how fast the threads read memory,
 * and how many int8 multiply-adds per second the build's instruction set issues. Benchmarks
 * state each figure as a fraction of these (brisk bench scale), so a row says how far it is
 * from the machine, not only from a peer. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

/* Sums n 64-bit words `passes` times, the words split evenly over the threads; the sum goes to
 * *sink so nothing is optimised away. Returns the seconds taken. */
double read_words(const int64_t *restrict words, int64_t n, int64_t passes, int64_t *restrict sink) {
    int64_t total = 0;
    double start = omp_get_wtime();
    for (int64_t p = 0; p < passes; p++) {
#pragma omp parallel for reduction(+ : total) schedule(static)
        for (int64_t i = 0; i < n; i++) total += words[i];
    }
    *sink = total;
    return omp_get_wtime() - start;
}

/* Independent chains: each chain's next step waits on its last, so CHAINS of them hide the
 * instruction's latency and the loop runs at its issue rate. */
#define CHAINS 10

/* `iterations` rounds of CHAINS int8 dot-product steps on every thread, in the sequence the
 * products use on this build: VNNI's vpdpbusd (u8 x s8 summed in fours into int32), else
 * AVX2's vpmaddubsw + vpmaddwd + vpaddd (pairs into int16, pairs of those into int32, added),
 * which is what a product without VNNI really issues (vpmaddubsw alone would count half the
 * work). An empty asm marks an operand as changed each round, so the compiler cannot hoist the
 * products out of the loop. Returns the seconds; *macs gets the multiply-adds done (0 where the
 * build has neither sequence). */
double int8_dot_peak(int64_t iterations, int64_t *restrict macs, int32_t *restrict sink) {
    int64_t lanes = 0, threads = 1;
    double start = omp_get_wtime();
#pragma omp parallel
    {
#pragma omp single
        threads = omp_get_num_threads();
        int32_t out = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
        __m512i acc[CHAINS], a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
        for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_setzero_si512();
        for (int64_t i = 0; i < iterations; i++) {
            __asm__ volatile("" : "+v"(b));
            for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_dpbusd_epi32(acc[c], a, b);
        }
        for (int c = 0; c < CHAINS; c++) out += _mm512_reduce_add_epi32(acc[c]);
#pragma omp single
        lanes = 64;
#elif defined(__AVX2__)
        __m256i acc[CHAINS], a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(-2), ones = _mm256_set1_epi16(1);
        for (int c = 0; c < CHAINS; c++) acc[c] = _mm256_setzero_si256();
        for (int64_t i = 0; i < iterations; i++) {
            __asm__ volatile("" : "+x"(b));
#if defined(__AVXVNNI__)
            for (int c = 0; c < CHAINS; c++) acc[c] = _mm256_dpbusd_avx_epi32(acc[c], a, b);
#else
            for (int c = 0; c < CHAINS; c++)
                acc[c] = _mm256_add_epi32(acc[c], _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), ones));
#endif
        }
        for (int c = 0; c < CHAINS; c++) {
            int32_t lane[8];
            _mm256_storeu_si256((__m256i *)lane, acc[c]);
            for (int j = 0; j < 8; j++) out += lane[j];
        }
#pragma omp single
        lanes = 32;
#endif
        sink[omp_get_thread_num()] = out;
    }
    *macs = iterations * CHAINS * lanes * threads;
    return omp_get_wtime() - start;
}
