/* Paged decode attention for the CPU, float32: one query token per sequence, GQA.
 *
 * Task b (one sequence) attends all its query heads to its first seq_lens[b] cached tokens (with a
 * sliding window > 0, to the last `window` of them; with softcap > 0, scores s become
 * softcap * tanh(s / softcap), as Gemma 2's; with sinks, each head's softmax also takes the logit sinks[h] of
 * a zero-valued key, as GPT-OSS's), block by block with an online softmax. Each K and V
 * block ([block_size, Hkv, D], contiguous) is read once, front to back, straight from the paged
 * cache (no gathered copy), while the next block of the sequence is prefetched: blocks sit at
 * random places, which no hardware prefetcher can guess. The caller splits the sequences between threads: [task_begin, task_end).
 * Compiled at run time by picovllm/kernels/cpu/decode_attention.py, once per model shape: HQ, HKV,
 * DIM and BLOCK are compile-time constants (-D...), so the inner loops are fully unrolled.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#if defined(__AVX2__) && defined(__FMA__) && DIM % 8 == 0 && BLOCK % 8 == 0
#include <immintrin.h>
#define VECTOR_PATH 1
#endif

/* The shape it was built for, as the caller checks it: query heads, kv heads, head dim, block size. */
void paged_decode_shape(int64_t *shape) {
    shape[0] = HQ;
    shape[1] = HKV;
    shape[2] = DIM;
    shape[3] = BLOCK;
}

/* A sequence's online-softmax state per query head: running max m, running sum l, weighted values acc. With
 * sinks (NULL: none), the sink's key is already in: max its logit, sum exp(0) = 1, no value. */
static void start_sequence(float acc[HQ][DIM], float *m, float *l, float m0, const float *sinks) {
    for (int64_t i = 0; i < HQ; i++) {
        m[i] = sinks ? sinks[i] : m0;
        l[i] = sinks ? 1.0f : 0.0f;
        for (int64_t d = 0; d < DIM; d++) acc[i][d] = 0.0f;
    }
}

static void write_out(float acc[HQ][DIM], const float *l, float *ob) {
    for (int64_t i = 0; i < HQ; i++) {
        const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;   /* empty context: zeros */
        for (int64_t d = 0; d < DIM; d++) ob[i * DIM + d] = acc[i][d] * inv;
    }
}

static float soft_cap(float s, float softcap) {
    return softcap > 0.0f ? softcap * tanhf(s / softcap) : s;
}

/* The first position a query at len - 1 sees. */
static int64_t window_start(int64_t len, int64_t window) {
    return window > 0 && len > window ? len - window : 0;
}

#ifndef VECTOR_PATH
static void prefetch(const float *p, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) __builtin_prefetch(p + i, 0, 1);   /* 16 floats = one cache line */
}

void paged_attention(const float *q, const float *k_cache, const float *v_cache, const int32_t *block_tables,
                     int64_t bt_stride, const int32_t *seq_lens, float *out, float scale, int64_t window,
                     float softcap, const float *sinks, int64_t task_begin, int64_t task_end) {
    const int64_t hq = HQ, dim = DIM, block_size = BLOCK, group = HQ / HKV;
    const int64_t row = HKV * DIM;                     /* one token's K (or V) in a block */
    const int64_t block_floats = BLOCK * row;
    float acc[HQ][DIM], s[HQ][BLOCK], m[HQ], l[HQ];
    for (int64_t b = task_begin; b < task_end; b++) {
        const int64_t len = seq_lens[b];
        const int32_t *table = block_tables + b * bt_stride;
        const float *qb = q + b * hq * dim;
        start_sequence(acc, m, l, -FLT_MAX, sinks);   /* built with -ffast-math (finite math only): no infinities */
        const int64_t first = window_start(len, window);
        for (int64_t start = first / block_size * block_size; start < len; start += block_size) {
            const int64_t n = len - start < block_size ? len - start : block_size;
            const int64_t skip = first > start ? first - start : 0;   /* the block's rows before the window */
            const int64_t base = (int64_t)table[start / block_size] * block_floats;
            const float *kb = k_cache + base, *vb = v_cache + base;
            if (start + block_size < len) {
                const int64_t next = (int64_t)table[start / block_size + 1] * block_floats;
                prefetch(k_cache + next, block_floats);
                prefetch(v_cache + next, block_floats);
            }
            for (int64_t j = skip; j < n; j++)                    /* scores: K read front to back */
                for (int64_t i = 0; i < hq; i++) {
                    const float *kr = kb + j * row + (i / group) * dim, *qi = qb + i * dim;
                    float dot = 0.0f;
                    for (int64_t d = 0; d < dim; d++) dot += qi[d] * kr[d];
                    s[i][j] = soft_cap(dot * scale, softcap);
                }
            for (int64_t i = 0; i < hq; i++) {                     /* online softmax over this block */
                float mx = m[i];
                for (int64_t j = skip; j < n; j++) mx = s[i][j] > mx ? s[i][j] : mx;
                const float alpha = expf(m[i] - mx);               /* 0 on the first block */
                float sum = 0.0f;
                for (int64_t j = skip; j < n; j++) {
                    s[i][j] = expf(s[i][j] - mx);
                    sum += s[i][j];
                }
                l[i] = l[i] * alpha + sum;
                m[i] = mx;
                for (int64_t d = 0; d < dim; d++) acc[i][d] *= alpha;
            }
            for (int64_t j = skip; j < n; j++)                    /* values: V read front to back */
                for (int64_t i = 0; i < hq; i++) {
                    const float *vr = vb + j * row + (i / group) * dim;
                    const float p = s[i][j];
                    for (int64_t d = 0; d < dim; d++) acc[i][d] += p * vr[d];
                }
        }
        write_out(acc, l, out + b * hq * dim);
    }
}
#endif

#ifdef VECTOR_PATH
/* The same, written for AVX2 + FMA (DIM and BLOCK multiples of 8). Scores are taken 8 tokens at a time with one
 * accumulator per token (independent FMA chains, not one chain per dot product) and reduced together; a block's
 * values are summed into a head's 64-float accumulator held in registers. A block's rows past the sequence's
 * end are read (the block is allocated whole) and get probability 0. The next block's lines are prefetched to
 * L2 a few per score step rather than all at once: bunched, the requests stalled (1.6 -> 1.05 ms a layer at
 * batch 32, context 250, one thread). */
#define NEG_BIG (-1e30f)
#define DV (DIM / 8)
#define LINES_PER_STEP ((BLOCK * HKV * DIM / 16 + (BLOCK / 8) * HQ - 1) / ((BLOCK / 8) * HQ))

static inline __m256 exp8(__m256 x) {   /* e^x, |rel err| ~1e-7; 0 below -87 (x is never above 0 here) */
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);          /* x - n ln2, in two parts */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);                               /* Cephes expf polynomial */
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline __m256 hsum8x8(__m256 a[8]) {   /* lane t of the result = sum of a[t]'s lanes */
    const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    /* s0123 = [a0 lo, a1 lo, a2 lo, a3 lo | a0 hi, a1 hi, a2 hi, a3 hi] (each a 4-lane partial sum) */
    const __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20), hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
    return _mm256_add_ps(lo, hi);
}

void paged_attention(const float *q, const float *k_cache, const float *v_cache, const int32_t *block_tables,
                     int64_t bt_stride, const int32_t *seq_lens, float *out, float scale, int64_t window,
                     float softcap, const float *sinks, int64_t task_begin, int64_t task_end) {
    const int64_t group = HQ / HKV, row = HKV * DIM, block_floats = BLOCK * row;
    float acc[HQ][DIM] __attribute__((aligned(32)));
    float s[HQ][BLOCK] __attribute__((aligned(32)));
    float m[HQ], l[HQ];
    for (int64_t b = task_begin; b < task_end; b++) {
        const int64_t len = seq_lens[b];
        const int32_t *table = block_tables + b * bt_stride;
        const float *qb = q + b * HQ * DIM;
        start_sequence(acc, m, l, NEG_BIG, sinks);
        const int64_t first = window_start(len, window);
        for (int64_t start = first / BLOCK * BLOCK; start < len; start += BLOCK) {
            const int64_t n = len - start < BLOCK ? len - start : BLOCK;
            const int64_t skip = first > start ? first - start : 0;   /* the block's rows before the window */
            const int64_t base = (int64_t)table[start / BLOCK] * block_floats;
            const float *kb = k_cache + base, *vb = v_cache + base;
            /* The next block (or the next sequence's first): its lines are prefetched a few at a time,
             * spread over this block's score loop, so the requests do not bunch up. */
            const float *pk = 0, *pv = 0;
            if (start + BLOCK < len) {
                const int64_t next = (int64_t)table[start / BLOCK + 1] * block_floats;
                pk = k_cache + next, pv = v_cache + next;
            } else if (b + 1 < task_end && seq_lens[b + 1] > 0) {
                const int64_t next = (int64_t)block_tables[(b + 1) * bt_stride] * block_floats;
                pk = k_cache + next, pv = v_cache + next;
            }
            int64_t fetched = 0;
            for (int64_t j0 = 0; j0 < n; j0 += 8)                  /* scores, 8 tokens at a time */
                for (int64_t i = 0; i < HQ; i++) {
                    if (pk) {
                        for (int64_t e = 0; e < LINES_PER_STEP && fetched < block_floats; e++, fetched += 16) {
                            __builtin_prefetch(pk + fetched, 0, 1);
                            __builtin_prefetch(pv + fetched, 0, 1);
                        }
                    }
                    const float *qi = qb + i * DIM, *kh = kb + (i / group) * DIM;
                    __m256 dot[8];
                    for (int t = 0; t < 8; t++) dot[t] = _mm256_setzero_ps();
                    for (int64_t c = 0; c < DV; c++) {
                        const __m256 qv = _mm256_loadu_ps(qi + 8 * c);
                        for (int t = 0; t < 8; t++)
                            dot[t] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kh + (j0 + t) * row + 8 * c), dot[t]);
                    }
                    _mm256_store_ps(&s[i][j0], _mm256_mul_ps(hsum8x8(dot), _mm256_set1_ps(scale)));
                }
            for (int64_t i = 0; i < HQ; i++) {
                if (softcap > 0.0f)
                    for (int64_t j = skip; j < n; j++) s[i][j] = soft_cap(s[i][j], softcap);
                for (int64_t j = 0; j < skip; j++) s[i][j] = NEG_BIG;
                for (int64_t j = n; j < BLOCK; j++) s[i][j] = NEG_BIG;
            }
            for (int64_t i = 0; i < HQ; i++) {                     /* online softmax over this block */
                float mx = m[i];
                for (int64_t j = 0; j < n; j++) mx = s[i][j] > mx ? s[i][j] : mx;
                const float alpha = expf(m[i] - mx);
                __m256 sum8 = _mm256_setzero_ps();
                for (int64_t j = 0; j < BLOCK; j += 8) {
                    const __m256 e = exp8(_mm256_sub_ps(_mm256_load_ps(&s[i][j]), _mm256_set1_ps(mx)));
                    _mm256_store_ps(&s[i][j], e);
                    sum8 = _mm256_add_ps(sum8, e);
                }
                float sum = 0.0f, lanes[8];
                _mm256_storeu_ps(lanes, sum8);
                for (int t = 0; t < 8; t++) sum += lanes[t];
                l[i] = l[i] * alpha + sum;
                m[i] = mx;
                const float *vh = vb + (i / group) * DIM;         /* values: this head's sum in registers */
                __m256 a[DV];
                const __m256 av = _mm256_set1_ps(alpha);
                for (int64_t c = 0; c < DV; c++) a[c] = _mm256_mul_ps(_mm256_load_ps(&acc[i][8 * c]), av);
                for (int64_t j = skip; j < n; j++) {
                    const __m256 p = _mm256_set1_ps(s[i][j]);
                    for (int64_t c = 0; c < DV; c++)
                        a[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vh + j * row + 8 * c), a[c]);
                }
                for (int64_t c = 0; c < DV; c++) _mm256_store_ps(&acc[i][8 * c], a[c]);
            }
        }
        write_out(acc, l, out + b * HQ * DIM);
    }
}
#endif

/* Whole contexts, no soft-cap, no sinks: the Llama family's attention (decode_stack.c calls it). */
void paged_decode_attention(const float *q, const float *k_cache, const float *v_cache,
                            const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                            float *out, float scale, int64_t task_begin, int64_t task_end) {
    paged_attention(q, k_cache, v_cache, block_tables, bt_stride, seq_lens, out, scale, 0, 0.0f, 0, task_begin,
                    task_end);
}

#ifdef _OPENMP
/* The runs [bounds[r], bounds[r + 1]) of sequences, one per thread of torch's OpenMP pool. */
void paged_attention_runs(const float *q, const float *k_cache, const float *v_cache, const int32_t *block_tables,
                          int64_t bt_stride, const int32_t *seq_lens, float *out, float scale, int64_t window,
                          float softcap, const float *sinks, const int64_t *bounds, int64_t runs) {
#pragma omp parallel for num_threads(runs) schedule(static, 1)
    for (int64_t r = 0; r < runs; r++)
        paged_attention(q, k_cache, v_cache, block_tables, bt_stride, seq_lens, out, scale, window, softcap, sinks,
                        bounds[r], bounds[r + 1]);
}
#endif
