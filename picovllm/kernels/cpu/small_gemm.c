/* Small-M float32 GEMM for the CPU (AVX2 + FMA): y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]).
 *
 * At decode, M (the running sequences) is small and the time goes into streaming the weights from
 * memory once per step, so the weights are read exactly once, front to back: the caller packs W once
 * into panels of NR = 16 output columns, packed[N_pad / 16][K][16] (zeros past N). For one panel,
 * each block of MR = 6 rows of x keeps its 6 x 16 results in 12 ymm registers while k runs over
 * K (a broadcast of x[r][k] and two FMAs per row and k); the panel (K * 64 bytes) stays in L1/L2
 * for the row blocks after the first. Meanwhile the next panel is prefetched, its cache lines
 * spread over all row blocks (one line every `blocks` k): prefetching it all in the first block was
 * 10% slower at M = 8..32, the memory requests bunching up.
 * Panels may hold bfloat16 instead (quantization="bf16"): half the bytes to stream, widened to float32 in
 * registers (a bfloat16 is a float32's upper half), so the products and sums stay float32.
 * Threads (OpenMP) split the panels; built with -fopenmp and loaded into a process whose torch
 * already runs libgomp, this shares torch's OpenMP threads rather than adding a second pool.
 * Compiled at run time by picovllm/kernels/cpu/small_gemm.py.
 */
#include <immintrin.h>
#include <stdint.h>
#include <omp.h>

#if !defined(__AVX2__) || !defined(__FMA__)
#error "small_gemm.c needs AVX2 and FMA"
#endif

#include "gemm_parts.h"   /* NR, panels */

#define MR 6

static inline __m256 widen_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* rows (1..MR) rows of x against one panel; cols (1..NR) of the panel are real columns of y. bf16: the panel's
 * elements are bfloat16 (a constant per call site, so each form compiles to its own loop). */
static inline __attribute__((always_inline)) void tile(const int rows, const int bf16, const float *x, int64_t k,
                                                       const void *panel, const char *prefetch, int64_t stride,
                                                       const float *bias, float *y, int64_t n, int64_t cols) {
    __m256 acc[MR][2];
    int64_t countdown = 1;
    const int64_t line = stride * NR * (bf16 ? 2 : 4);   /* bytes of panel per `stride` k */
#pragma GCC unroll 6
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i++) {
        if (--countdown == 0) {   /* a cache line every `stride` k (fp32: one k's 16 floats; bf16: half of it) */
            __builtin_prefetch(prefetch, 0, 2);   /* to L2: 5-10% faster at M = 4..32 than to L1 */
            prefetch += line;
            countdown = stride;
        }
        __m256 w0, w1;
        if (bf16) {
            w0 = widen_bf16((const uint16_t *)panel + i * NR);
            w1 = widen_bf16((const uint16_t *)panel + i * NR + 8);
        } else {
            w0 = _mm256_loadu_ps((const float *)panel + i * NR);
            w1 = _mm256_loadu_ps((const float *)panel + i * NR + 8);
        }
#pragma GCC unroll 6
        for (int r = 0; r < rows; r++) {
            const __m256 xr = _mm256_broadcast_ss(x + r * k + i);
            acc[r][0] = _mm256_fmadd_ps(xr, w0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(xr, w1, acc[r][1]);
        }
    }
    if (cols == NR) {
        const __m256 b0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
        const __m256 b1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
#pragma GCC unroll 6
        for (int r = 0; r < rows; r++) {
            _mm256_storeu_ps(y + r * n, _mm256_add_ps(acc[r][0], b0));
            _mm256_storeu_ps(y + r * n + 8, _mm256_add_ps(acc[r][1], b1));
        }
        return;
    }
    float out[NR];   /* the last panel of an N that is not a multiple of 16 */
#pragma GCC unroll 6
    for (int r = 0; r < rows; r++) {
        _mm256_storeu_ps(out, acc[r][0]);
        _mm256_storeu_ps(out + 8, acc[r][1]);
        for (int64_t j = 0; j < cols; j++) y[r * n + j] = out[j] + (bias ? bias[j] : 0.0f);
    }
}

/* One block of `rows` rows against a panel, the row count made a constant per case so the loops unroll. */
static inline __attribute__((always_inline)) void row_block(int64_t rows, const int bf16, const float *x, int64_t k,
                                                            const void *panel, const char *next, int64_t stride,
                                                            const float *bias, float *y, int64_t n, int64_t cols) {
    switch (rows) {
        case 1: tile(1, bf16, x, k, panel, next, stride, bias, y, n, cols); break;
        case 2: tile(2, bf16, x, k, panel, next, stride, bias, y, n, cols); break;
        case 3: tile(3, bf16, x, k, panel, next, stride, bias, y, n, cols); break;
        case 4: tile(4, bf16, x, k, panel, next, stride, bias, y, n, cols); break;
        case 5: tile(5, bf16, x, k, panel, next, stride, bias, y, n, cols); break;
        default: tile(6, bf16, x, k, panel, next, stride, bias, y, n, cols); break;
    }
}

/* Panels [panel_begin, panel_end). x [m, k] and y [m, n] contiguous; packed [ceil(n / 16), k, 16] float32, or
 * bfloat16 where bf16; bias [n] or NULL. */
void panels(const float *x, int64_t m, int64_t k, const void *packed, int bf16, const float *bias, float *y,
            int64_t n, int64_t panel_begin, int64_t panel_end) {
    const int64_t esize = bf16 ? 2 : 4;
    for (int64_t p = panel_begin; p < panel_end; p++) {
        const char *panel = (const char *)packed + p * k * NR * esize;
        const float *b = bias ? bias + p * NR : 0;
        const int64_t cols = n - p * NR < NR ? n - p * NR : NR;
        /* Row blocks of about equal size (8 rows: 4 + 4, not 6 + 2, whose 2-row tile is load-bound). */
        const int64_t blocks = (m + MR - 1) / MR;
        for (int64_t i = 0, r0 = 0; i < blocks; i++) {
            const int64_t r1 = m * (i + 1) / blocks;
            /* Row block i prefetches lines i, i + blocks, ... of the next panel: spread over all blocks. */
            const float *xr = x + r0 * k;
            const char *next = panel + (k + i) * NR * esize;
            float *yr = y + r0 * n + p * NR;
            if (bf16)
                row_block(r1 - r0, 1, xr, k, panel, next, blocks, b, yr, n, cols);
            else
                row_block(r1 - r0, 0, xr, k, panel, next, blocks, b, yr, n, cols);
            r0 = r1;
        }
    }
}

/* y = x @ W^T (+ bias), each of `threads` threads a contiguous run of panels; bf16: bfloat16 panels. */
void small_gemm(const float *x, int64_t m, int64_t k, const void *packed, int64_t bf16, const float *bias, float *y,
                int64_t n, int64_t threads) {
    const int64_t count = (n + NR - 1) / NR;
#pragma omp parallel num_threads(threads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        panels(x, m, k, packed, (int)bf16, bias, y, n, count * t / nt, count * (t + 1) / nt);
    }
}
