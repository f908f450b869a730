/* What decode_stack.c calls in the two GEMM kernels, which it links as objects built once (build.py's parts)
 * rather than compiling them again for every attention shape: the quantized weights' and activations' forms
 * (quant_gemm.c) and each kernel's share of one GEMM for thread t of nt. */
#ifndef PICOVLLM_GEMM_PARTS_H
#define PICOVLLM_GEMM_PARTS_H
#include <stdint.h>

#define NR 16        /* small_gemm.c: output columns per float32 (or bfloat16) panel */
#define QBLOCK 32    /* quant_gemm.c: elements per quantized block */

/* One run of output rows in one form: a linear layer is one or more (q, k, v of different ggml types). */
typedef struct {
    int64_t kind, scale_f32, n;      /* QKIND_*, scales are float32 (else float16), output rows */
    const uint8_t *codes;            /* [ceil(n / 16)][k / 32][256 (q4) | 512 (q8)] */
    const void *scales;              /* [ceil(n / 16)][k / 32][2][16] */
} QSeg;

/* Quantized activations: xq [m][k] int8, xd [m][k / 32] scales, xs [m][k / 32][2] sums of xq over each 16. */
typedef struct {
    int8_t *q;
    float *d;
    int32_t *s;
} QAct;

/* small_gemm.c: panels [panel_begin, panel_end) of y [m][n] = x [m][k] @ W^T (+ bias). */
void panels(const float *x, int64_t m, int64_t k, const void *packed, int bf16, const float *bias, float *y,
            int64_t n, int64_t panel_begin, int64_t panel_end);
/* quant_gemm.c: rows [lo, hi) of x [.][k] into a; thread t of nt's share of every segment of a layer. */
void quantize_rows(const float *x, int64_t k, QAct a, int64_t lo, int64_t hi);
void qgemm_part(const QSeg *segs, int64_t n_segs, QAct a, int64_t m, int64_t k, const float *bias, float *y,
                int64_t ldy, int64_t t, int64_t nt);
#endif
