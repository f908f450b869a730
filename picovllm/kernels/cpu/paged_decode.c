/* Paged decode attention for the CPU, float32: one query token per sequence, GQA.
 *
 * Task b (one sequence) attends all its query heads to its first seq_lens[b] cached tokens,
 * block by block with an online softmax. Each K and V block ([block_size, Hkv, D], contiguous)
 * is read once, front to back, straight from the paged cache (no gathered copy), while the next
 * block of the sequence is prefetched: blocks sit at random places, which no hardware prefetcher
 * can guess. The caller splits the sequences between threads: [task_begin, task_end).
 * Compiled at run time by picovllm/kernels/cpu/decode_attention.py, once per model shape: HQ, HKV,
 * DIM and BLOCK are compile-time constants (-D...), so the inner loops are fully unrolled.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>

/* The shape it was built for, as the caller checks it: query heads, kv heads, head dim, block size. */
void paged_decode_shape(int64_t *shape) {
    shape[0] = HQ;
    shape[1] = HKV;
    shape[2] = DIM;
    shape[3] = BLOCK;
}

static void prefetch(const float *p, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) __builtin_prefetch(p + i, 0, 3);   /* 16 floats = one cache line */
}

void paged_decode_attention(const float *q, const float *k_cache, const float *v_cache,
                            const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                            float *out, float scale, int64_t task_begin, int64_t task_end) {
    const int64_t hq = HQ, dim = DIM, block_size = BLOCK, group = HQ / HKV;
    const int64_t row = HKV * DIM;                     /* one token's K (or V) in a block */
    const int64_t block_floats = BLOCK * row;
    float acc[HQ][DIM], s[HQ][BLOCK], m[HQ], l[HQ];
    for (int64_t b = task_begin; b < task_end; b++) {
        const int64_t len = seq_lens[b];
        const int32_t *table = block_tables + b * bt_stride;
        const float *qb = q + b * hq * dim;
        for (int64_t i = 0; i < hq; i++) {
            m[i] = -FLT_MAX;     /* built with -ffast-math (finite math only): no infinities */
            l[i] = 0.0f;
            for (int64_t d = 0; d < dim; d++) acc[i][d] = 0.0f;
        }
        for (int64_t start = 0; start < len; start += block_size) {
            const int64_t n = len - start < block_size ? len - start : block_size;
            const int64_t base = (int64_t)table[start / block_size] * block_floats;
            const float *kb = k_cache + base, *vb = v_cache + base;
            if (start + block_size < len) {
                const int64_t next = (int64_t)table[start / block_size + 1] * block_floats;
                prefetch(k_cache + next, block_floats);
                prefetch(v_cache + next, block_floats);
            }
            for (int64_t j = 0; j < n; j++)                       /* scores: K read front to back */
                for (int64_t i = 0; i < hq; i++) {
                    const float *kr = kb + j * row + (i / group) * dim, *qi = qb + i * dim;
                    float dot = 0.0f;
                    for (int64_t d = 0; d < dim; d++) dot += qi[d] * kr[d];
                    s[i][j] = dot * scale;
                }
            for (int64_t i = 0; i < hq; i++) {                     /* online softmax over this block */
                float mx = m[i];
                for (int64_t j = 0; j < n; j++) mx = s[i][j] > mx ? s[i][j] : mx;
                const float alpha = expf(m[i] - mx);               /* 0 on the first block */
                float sum = 0.0f;
                for (int64_t j = 0; j < n; j++) {
                    s[i][j] = expf(s[i][j] - mx);
                    sum += s[i][j];
                }
                l[i] = l[i] * alpha + sum;
                m[i] = mx;
                for (int64_t d = 0; d < dim; d++) acc[i][d] *= alpha;
            }
            for (int64_t j = 0; j < n; j++)                       /* values: V read front to back */
                for (int64_t i = 0; i < hq; i++) {
                    const float *vr = vb + j * row + (i / group) * dim;
                    const float p = s[i][j];
                    for (int64_t d = 0; d < dim; d++) acc[i][d] += p * vr[d];
                }
        }
        float *ob = out + b * hq * dim;
        for (int64_t i = 0; i < hq; i++) {
            const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;   /* empty context: zeros */
            for (int64_t d = 0; d < dim; d++) ob[i * dim + d] = acc[i][d] * inv;
        }
    }
}
