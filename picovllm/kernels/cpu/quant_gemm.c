/* Quantized-weight GEMM for the CPU: y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]), W kept in 4 or 8 bits.
 *
 * As llama.cpp does, the activations are quantized too, per block of 32 (int8, scale amax / 127), so the inner
 * products are integer ones: u8 x s8 multiply-adds, 4 products summed per 32-bit lane (AVX-512 VNNI's vpdpbusd;
 * AVX2's vpmaddubsw + vpmaddwd). Two weight forms (picovllm/loader/gguf_quants.py):
 *   q4: codes u in 0..15, per 32 a scale d and an offset m:  w = d * u + m
 *       sum_i w_i x_i = d * dx * sum_i u_i xq_i + m * dx * sum_i xq_i
 *   q8: codes q in -128..127, per 16 a scale d:               w = d * q
 *       VNNI multiplies unsigned by signed, so it reads q + 128 (q ^ 0x80) and takes 128 * sum xq back off;
 *       AVX2 multiplies |q| by xq carrying q's sign (|q| <= 128 and |xq| <= 127: no int16 overflow).
 * Layout: 16 output rows form a panel; a panel's 32-element blocks follow each other, and within a block the
 * rows are interleaved by 4-element groups, so that one 64-byte vector holds group g of all 16 rows (lane r =
 * row r's 4 codes) and the lanes accumulate 16 rows' dot products side by side; per block the 16 rows' scales
 * (and offsets) are two vectors of 16. q4 block: 256 bytes, 4 chunks of 64: chunk c's low nibbles are group c,
 * its high nibbles group c + 4. q8 block: 512 bytes, group g at byte 64 g. Scales [2][16] per block, float16 or
 * float32: q4 d then m; q8 the d of elements 0-15, then of 16-31. Rows past N are zero.
 * Built twice (build.py): with AVX-512 (F, BW, VL, VNNI) where the CPU has it, and with -mno-avx512f (AVX2,
 * FMA, F16C); picovllm/kernels/cpu/quant_gemm.py picks one at run time. decode_stack.c links its object.
 */
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "gemm_parts.h"   /* QSeg, QAct */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define QG_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QG_AVX512 0
#else
#error "quant_gemm.c needs AVX2, FMA and F16C (or AVX-512 with VNNI)"
#endif

#define QROWS 16     /* output rows per panel */
#define QMR 4        /* rows of x per tile */
#define QKIND_Q4 1
#define QKIND_Q8 2

static inline int32_t load4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* A block whose scale d is subnormal (its largest |x| below ~1.5e-36): 1 / d overflows float32 there, and every
 * code came out -128. Here the codes are x / d in double, where it does not. */
static void quantize_tiny_block(const float *v, float d, int8_t *q, int32_t *s) {
    s[0] = s[1] = 0;
    for (int i = 0; i < QBLOCK; i++) {
        const double c = fmin(fmax(nearbyint((double)v[i] / (double)d), -127.0), 127.0);
        q[i] = (int8_t)c;
        s[i / 16] += (int32_t)c;
    }
}

/* Rows [lo, hi) of x [.][k] into a. A block holding a NaN or an infinity gets a NaN scale and zero codes, so that
 * every output of its row is NaN, as the float product's would be non-finite (a NaN had come out as an ordinary
 * number: max drops it, and its conversion gives a -128 code). */
void quantize_rows(const float *x, int64_t k, QAct a, int64_t lo, int64_t hi) {
    const int64_t nb = k / QBLOCK;
    const __m256 sign = _mm256_set1_ps(-0.0f), inf = _mm256_set1_ps(INFINITY);
    for (int64_t r = lo; r < hi; r++)
        for (int64_t b = 0; b < nb; b++) {
            const float *v = x + r * k + b * QBLOCK;
            __m256 x4[4], amax = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) {
                x4[i] = _mm256_loadu_ps(v + 8 * i);
                const __m256 ax = _mm256_andnot_ps(sign, x4[i]);
                amax = _mm256_max_ps(amax, ax);
                bad = _mm256_or_ps(bad, _mm256_cmp_ps(ax, inf, _CMP_NLT_UQ));   /* |x| >= inf, or NaN */
            }
            if (!_mm256_testz_ps(bad, bad)) {
                a.d[r * nb + b] = NAN;
                memset(a.q + r * k + b * QBLOCK, 0, QBLOCK);
                a.s[(r * nb + b) * 2] = a.s[(r * nb + b) * 2 + 1] = 0;
                continue;
            }
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            const float d = _mm_cvtss_f32(m4) / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
            a.d[r * nb + b] = d;
            if (d > 0.0f && d < FLT_MIN) {
                quantize_tiny_block(v, d, a.q + r * k + b * QBLOCK, a.s + (r * nb + b) * 2);
                continue;
            }
            __m256i q[4];
            for (int i = 0; i < 4; i++)   /* round to nearest (MXCSR's default) */
                q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(x4[i], _mm256_set1_ps(id)));
            /* packs interleaves 128-bit lanes: 0 1 2 3 -> (0 lo, 1 lo, 0 hi, 1 hi) ..., undone by the permute */
            const __m256i p16a = _mm256_packs_epi32(q[0], q[1]), p16b = _mm256_packs_epi32(q[2], q[3]);
            const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b),
                                                           _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)(a.q + r * k + b * QBLOCK), p8);
            const __m256i s0 = _mm256_add_epi32(q[0], q[1]), s1 = _mm256_add_epi32(q[2], q[3]);
            const __m256i h = _mm256_hadd_epi32(s0, s1);          /* s0 pairs, s1 pairs, per 128-bit lane */
            const __m256i h2 = _mm256_hadd_epi32(h, h);
            a.s[(r * nb + b) * 2] = _mm256_extract_epi32(h2, 0) + _mm256_extract_epi32(h2, 4);
            a.s[(r * nb + b) * 2 + 1] = _mm256_extract_epi32(h2, 1) + _mm256_extract_epi32(h2, 5);
        }
}

#if QG_AVX512
static inline __m512 qscales(const QSeg *w, int64_t at) {
    if (w->scale_f32) return _mm512_loadu_ps((const float *)w->scales + at);
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w->scales + at)));
}

static inline void qstore(float *y, int64_t ldy, int r, __m512 acc, const float *bias, int64_t cols) {
    const __mmask16 mask = cols >= QROWS ? (__mmask16)0xFFFF : (__mmask16)((1u << cols) - 1);
    if (bias) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(mask, bias));
    _mm512_mask_storeu_ps(y + r * ldy, mask, acc);
}

/* R (1..QMR) rows of activations against panel p: y[r][0..cols) of the panel's rows. */
static inline __attribute__((always_inline)) void qtile(const int R, const QSeg *w, int64_t p, int64_t k,
                                                        QAct a, float *y, int64_t ldy, const float *bias,
                                                        int64_t cols) {
    const int64_t nb = k / QBLOCK;
    __m512 acc[QMR];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    if (w->kind == QKIND_Q4) {
        const uint8_t *c = w->codes + p * nb * 256;
        const __m512i low = _mm512_set1_epi8(0x0F);
        for (int64_t b = 0; b < nb; b++, c += 256) {
            __m512i g[8];
            for (int i = 0; i < 4; i++) {
                const __m512i v = _mm512_loadu_si512(c + 64 * i);
                g[i] = _mm512_and_si512(v, low);
                g[i + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
            const __m512 d = qscales(w, (p * nb + b) * 32), m = qscales(w, (p * nb + b) * 32 + 16);
            for (int r = 0; r < R; r++) {
                const int8_t *xr = a.q + r * k + b * QBLOCK;
                __m512i s = _mm512_setzero_si512();
                for (int i = 0; i < 8; i++) s = _mm512_dpbusd_epi32(s, g[i], _mm512_set1_epi32(load4(xr + 4 * i)));
                const float dx = a.d[r * nb + b];
                const int32_t *xs = a.s + (r * nb + b) * 2;
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, _mm512_set1_ps(dx)), acc[r]);
                acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(dx * (float)(xs[0] + xs[1])), acc[r]);
            }
        }
    } else {
        const uint8_t *c = w->codes + p * nb * 512;
        const __m512i flip = _mm512_set1_epi8((char)0x80);
        for (int64_t b = 0; b < nb; b++, c += 512) {
            __m512i g[8];
            for (int i = 0; i < 8; i++) g[i] = _mm512_xor_si512(_mm512_loadu_si512(c + 64 * i), flip);
            const __m512 d0 = qscales(w, (p * nb + b) * 32), d1 = qscales(w, (p * nb + b) * 32 + 16);
            for (int r = 0; r < R; r++) {
                const int8_t *xr = a.q + r * k + b * QBLOCK;
                const int32_t *xs = a.s + (r * nb + b) * 2;
                __m512i s0 = _mm512_set1_epi32(-128 * xs[0]), s1 = _mm512_set1_epi32(-128 * xs[1]);
                for (int i = 0; i < 4; i++) {
                    s0 = _mm512_dpbusd_epi32(s0, g[i], _mm512_set1_epi32(load4(xr + 4 * i)));
                    s1 = _mm512_dpbusd_epi32(s1, g[i + 4], _mm512_set1_epi32(load4(xr + 16 + 4 * i)));
                }
                const __m512 dx = _mm512_set1_ps(a.d[r * nb + b]);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_mul_ps(d0, dx), acc[r]);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_mul_ps(d1, dx), acc[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) qstore(y, ldy, r, acc[r], bias, cols);
}
#else
static inline __m256 qscales(const QSeg *w, int64_t at) {
    if (w->scale_f32) return _mm256_loadu_ps((const float *)w->scales + at);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)w->scales + at)));
}

static inline void qstore(float *y, int64_t ldy, int r, __m256 acc, const float *bias, int64_t cols) {
    float out[8];
    _mm256_storeu_ps(out, acc);
    for (int64_t j = 0; j < cols && j < 8; j++) y[r * ldy + j] = out[j] + (bias ? bias[j] : 0.0f);
}

/* As the AVX-512 tile, one half panel (8 rows, h = 0 or 1) at a time: 32-byte vectors, lane r = row 8 h + r. */
static inline __attribute__((always_inline)) void qtile(const int R, const QSeg *w, int64_t p, int64_t k,
                                                        QAct a, float *y, int64_t ldy, const float *bias,
                                                        int64_t cols) {
    const int64_t nb = k / QBLOCK;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int h = 0; h < 2 && 8 * h < cols; h++) {
        __m256 acc[QMR];
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
        if (w->kind == QKIND_Q4) {
            const uint8_t *c = w->codes + p * nb * 256 + 32 * h;
            const __m256i low = _mm256_set1_epi8(0x0F);
            for (int64_t b = 0; b < nb; b++, c += 256) {
                __m256i g[8];
                for (int i = 0; i < 4; i++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(c + 64 * i));
                    g[i] = _mm256_and_si256(v, low);
                    g[i + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                }
                const int64_t at = (p * nb + b) * 32 + 8 * h;
                const __m256 d = qscales(w, at), m = qscales(w, at + 16);
                for (int r = 0; r < R; r++) {
                    const int8_t *xr = a.q + r * k + b * QBLOCK;
                    /* 8 groups of u * xq pairs: |sum| <= 8 * 2 * 15 * 127 < 32768, so int16 holds it */
                    __m256i s16 = _mm256_maddubs_epi16(g[0], _mm256_set1_epi32(load4(xr)));
                    for (int i = 1; i < 8; i++)
                        s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(g[i], _mm256_set1_epi32(load4(xr + 4 * i))));
                    const __m256i s = _mm256_madd_epi16(s16, ones);
                    const float dx = a.d[r * nb + b];
                    const int32_t *xs = a.s + (r * nb + b) * 2;
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_set1_ps(dx)), acc[r]);
                    acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(dx * (float)(xs[0] + xs[1])), acc[r]);
                }
            }
        } else {
            const uint8_t *c = w->codes + p * nb * 512 + 32 * h;
            for (int64_t b = 0; b < nb; b++, c += 512) {
                __m256i g[8];
                for (int i = 0; i < 8; i++) g[i] = _mm256_loadu_si256((const __m256i *)(c + 64 * i));
                const int64_t at = (p * nb + b) * 32 + 8 * h;
                const __m256 d0 = qscales(w, at), d1 = qscales(w, at + 16);
                for (int r = 0; r < R; r++) {
                    const int8_t *xr = a.q + r * k + b * QBLOCK;
                    __m256i s[2];
                    for (int half = 0; half < 2; half++) {
                        __m256i acc32 = _mm256_setzero_si256();
                        for (int i = 4 * half; i < 4 * half + 4; i++) {
                            const __m256i x = _mm256_set1_epi32(load4(xr + 4 * i));
                            const __m256i prod = _mm256_maddubs_epi16(_mm256_abs_epi8(g[i]), _mm256_sign_epi8(x, g[i]));
                            acc32 = _mm256_add_epi32(acc32, _mm256_madd_epi16(prod, ones));
                        }
                        s[half] = acc32;
                    }
                    const __m256 dx = _mm256_set1_ps(a.d[r * nb + b]);
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[0]), _mm256_mul_ps(d0, dx), acc[r]);
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[1]), _mm256_mul_ps(d1, dx), acc[r]);
                }
            }
        }
        for (int r = 0; r < R; r++) qstore(y + 8 * h, ldy, r, acc[r], bias ? bias + 8 * h : 0, cols - 8 * h);
    }
}
#endif

/* Panels [p0, p1) of segment w against all m rows of a; y: the segment's first column, row stride ldy. */
static void qseg_panels(const QSeg *w, QAct a, int64_t m, int64_t k, const float *bias, float *y, int64_t ldy,
                        int64_t p0, int64_t p1) {
    const int64_t nb = k / QBLOCK;
    for (int64_t p = p0; p < p1; p++) {
        const int64_t cols = w->n - p * QROWS < QROWS ? w->n - p * QROWS : QROWS;
        const float *bp = bias ? bias + p * QROWS : 0;
        for (int64_t r0 = 0; r0 < m; r0 += QMR) {
            const QAct ar = {a.q + r0 * k, a.d + r0 * nb, a.s + r0 * nb * 2};
            float *yr = y + r0 * ldy + p * QROWS;
            switch (m - r0 < QMR ? m - r0 : QMR) {   /* a constant row count per case: the loops unroll */
                case 1: qtile(1, w, p, k, ar, yr, ldy, bp, cols); break;
                case 2: qtile(2, w, p, k, ar, yr, ldy, bp, cols); break;
                case 3: qtile(3, w, p, k, ar, yr, ldy, bp, cols); break;
                default: qtile(4, w, p, k, ar, yr, ldy, bp, cols); break;
            }
        }
    }
}

/* Thread t of nt's share of every segment of a layer: y [m][ldy] from column 0, segment after segment. */
void qgemm_part(const QSeg *segs, int64_t n_segs, QAct a, int64_t m, int64_t k, const float *bias, float *y,
                int64_t ldy, int64_t t, int64_t nt) {
    for (int64_t s = 0, col = 0; s < n_segs; col += segs[s].n, s++) {
        const int64_t panels = (segs[s].n + QROWS - 1) / QROWS;
        qseg_panels(segs + s, a, m, k, bias ? bias + col : 0, y + col, ldy, panels * t / nt,
                    panels * (t + 1) / nt);
    }
}

/* y [m][ldy] = x [m][k] @ W^T (+ bias), W the segments' rows one after another. scratch: m * k int8 then
 * m * (k / 32) * 3 int32-sized words (quant_gemm.py's scratch_bytes). */
void quant_gemm(const QSeg *segs, int64_t n_segs, const float *x, int64_t m, int64_t k, const float *bias, float *y,
                int64_t ldy, void *scratch, int64_t threads) {
    const int64_t nb = k / QBLOCK;
    QAct a = {(int8_t *)scratch, 0, 0};
    a.d = (float *)((char *)scratch + ((m * k + 63) & ~(int64_t)63));
    a.s = (int32_t *)(a.d + m * nb);
#pragma omp parallel num_threads(threads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        quantize_rows(x, k, a, m * t / nt, m * (t + 1) / nt);
#pragma omp barrier
        qgemm_part(segs, n_segs, a, m, k, bias, y, ldy, t, nt);
    }
}

/* The activations as the kernel quantizes them (for tests): xq [m][k], xd [m][k / 32], xs [m][k / 32][2]. */
void quant_activations(const float *x, int64_t m, int64_t k, int8_t *xq, float *xd, int32_t *xs) {
    const QAct a = {xq, xd, xs};
    quantize_rows(x, k, a, 0, m);
}

/* 1 for the AVX-512 build, 0 for the AVX2 one. */
int64_t quant_gemm_isa(void) { return QG_AVX512; }

/* Rows rows[0..count) of the weight whose segments are segs (rows numbered across them) into out [count][k],
 * float32: the embedding's lookup in a quantized table. */
void quant_rows(const QSeg *segs, int64_t n_segs, int64_t k, const int64_t *rows, int64_t count, float *out) {
    const int64_t nb = k / QBLOCK;
    for (int64_t i = 0; i < count; i++) {
        int64_t r = rows[i], s = 0;
        while (s < n_segs - 1 && r >= segs[s].n) r -= segs[s++].n;
        const QSeg *w = segs + s;
        const int64_t p = r / QROWS, lane = r % QROWS;
        for (int64_t b = 0; b < nb; b++) {
            const int64_t at = (p * nb + b) * 32 + lane;
            float sc[2];
            for (int h = 0; h < 2; h++)
                sc[h] = w->scale_f32 ? ((const float *)w->scales)[at + 16 * h]
                                     : _cvtsh_ss(((const uint16_t *)w->scales)[at + 16 * h]);
            float *o = out + i * k + b * QBLOCK;
            if (w->kind == QKIND_Q4) {
                const uint8_t *c = w->codes + (p * nb + b) * 256 + 4 * lane;
                for (int ch = 0; ch < 4; ch++)
                    for (int j = 0; j < 4; j++) {
                        const uint8_t v = c[64 * ch + j];
                        o[4 * ch + j] = sc[0] * (float)(v & 0x0F) + sc[1];
                        o[16 + 4 * ch + j] = sc[0] * (float)(v >> 4) + sc[1];
                    }
            } else {
                const int8_t *c = (const int8_t *)(w->codes + (p * nb + b) * 512 + 4 * lane);
                for (int g = 0; g < 8; g++)
                    for (int j = 0; j < 4; j++) o[4 * g + j] = sc[g / 4] * (float)c[64 * g + j];
            }
        }
    }
}
