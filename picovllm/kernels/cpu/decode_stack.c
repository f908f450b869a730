/* A decode step of a Llama-family model on the CPU, float32, in one call: every decoder layer, the final
 * norm and the LM head, for m sequences of one new token each.
 *
 * Through torch, a decode step is ~400 operators, each a Python call, five of them per layer OpenMP
 * regions (the GEMMs and attention). Between two regions torch's second thread waits, and how it waits
 * decides the speed: spinning (OMP_WAIT_POLICY=ACTIVE) is ~30% faster on an idle 2-core machine than
 * sleeping (PASSIVE, which the CLI sets), but costs 1.4x-3.5x as soon as another process wants a core,
 * because a thread spinning for its partner holds the core the partner needs. Here the whole step is one
 * OpenMP region whose threads meet at barriers of their own: a short spin (the gaps are the few
 * microseconds of imbalance, no Python in between), then sleep on a futex. So the region starts once a
 * step, whatever the wait policy.
 *
 * It composes the kernels of this folder, included whole (one translation unit, nothing written twice):
 * rms_norm / silu_mul / rope (elementwise.c), panels (small_gemm.c) and paged_decode_attention
 * (paged_decode.c, built for HQ, HKV, DIM, BLOCK given with -D). Between barriers the threads split
 * rows (the row-wise ops), 16-column weight panels (the GEMMs) or runs of sequences (attention).
 * Compiled at run time by picovllm/kernels/cpu/decode_stack.py; the torch modules stay the reference.
 */
#include <limits.h>
#include <linux/futex.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "elementwise.c"
#include "paged_decode.c"
#include "small_gemm.c"

/* One decoder layer: norm weights, weights packed as small_gemm.c reads them (qkv_bias, q_norm and
 * k_norm may be NULL), and the layer's KV cache [num_blocks, BLOCK, HKV, DIM]. */
typedef struct {
    const float *input_norm, *qkv, *qkv_bias, *q_norm, *k_norm, *o, *post_norm, *gate_up, *down;
    float *k_cache, *v_cache;
} Layer;

/* ---- barrier: spin a little, then sleep on a futex ---------------------------------------------- */
#define SPIN 4000   /* ~100 us of pause loops: longer than the imbalance between threads at a barrier */

typedef struct {
    atomic_int arrived, generation, sleepers;
} Barrier;

static long futex(atomic_int *addr, int op, int value) {
    return syscall(SYS_futex, (int *)addr, op, value, NULL, NULL, 0);
}

static void barrier_wait(Barrier *b, int threads) {
    const int gen = atomic_load(&b->generation);
    if (atomic_fetch_add(&b->arrived, 1) == threads - 1) {   /* the last one in lets the others go */
        atomic_store(&b->arrived, 0);
        atomic_fetch_add(&b->generation, 1);
        if (atomic_load(&b->sleepers) > 0) futex(&b->generation, FUTEX_WAKE_PRIVATE, INT_MAX);
        return;
    }
    for (int i = 0; i < SPIN; i++) {
        if (atomic_load_explicit(&b->generation, memory_order_acquire) != gen) return;
        _mm_pause();
    }
    atomic_fetch_add(&b->sleepers, 1);   /* seq_cst, as the last one's generation bump and sleepers read */
    while (atomic_load(&b->generation) == gen) futex(&b->generation, FUTEX_WAIT_PRIVATE, gen);
    atomic_fetch_sub(&b->sleepers, 1);
}

/* ---- the step ------------------------------------------------------------------------------------ */
static inline int64_t part(int64_t n, int64_t t, int64_t nt) { return n * t / nt; }

/* Rows [lo, hi): q/k norm (when the model has it) in place, rotary into q and k, and k, v into the cache. */
static void qkv_rows(const Layer *L, float *qkv, int64_t nqkv, float *q, float *k, const int64_t *pos,
                     const int64_t *slots, const float *cos_sin, float eps, int64_t lo, int64_t hi) {
    const int64_t kv_row = HKV * DIM;
    if (L->q_norm)
        for (int64_t r = lo; r < hi; r++) {
            float *qr = qkv + r * nqkv, *kr = qr + HQ * DIM;
            rms_norm(qr, NULL, NULL, L->q_norm, qr, DIM, eps, 0, HQ);
            rms_norm(kr, NULL, NULL, L->k_norm, kr, DIM, eps, 0, HKV);
        }
    rope(qkv, nqkv, HQ, DIM, pos, cos_sin, q, lo, hi);
    rope(qkv + HQ * DIM, nqkv, HKV, DIM, pos, cos_sin, k, lo, hi);
    for (int64_t r = lo; r < hi; r++) {
        memcpy(L->k_cache + slots[r] * kv_row, k + r * kv_row, kv_row * sizeof(float));
        memcpy(L->v_cache + slots[r] * kv_row, qkv + r * nqkv + (HQ + HKV) * DIM, kv_row * sizeof(float));
    }
}

/* x [m, hidden]: the tokens' embeddings in, overwritten. pos, slots [m]; cos_sin as rope() reads it;
 * tables [m, table_stride] and lens [m] of the sequences (length after this token); runs[0..n_runs]:
 * attention's runs of sequences, about equal work each. scratch: m * (2 * hidden + 3 * HQ * DIM + 3 * HKV * DIM
 * + 3 * inter) floats. logits [m, vocab] out. */
void decode_stack(const Layer *layers, int64_t n_layers, int64_t hidden, int64_t inter, float eps, float scale,
                  const float *final_norm, const float *lm_head, int64_t vocab, float *x, int64_t m,
                  const int64_t *pos, const int64_t *slots, const float *cos_sin, const int32_t *tables,
                  int64_t table_stride, const int32_t *lens, const int64_t *runs, int64_t n_runs, float *scratch,
                  float *logits, int64_t threads) {
    const int64_t nqkv = (HQ + 2 * HKV) * DIM, nq = HQ * DIM;
    float *res = scratch, *xn = res + m * hidden, *qkv = xn + m * hidden, *q = qkv + m * nqkv;
    float *k = q + m * nq, *attn = k + m * HKV * DIM, *gu = attn + m * nq, *act = gu + m * 2 * inter;
    Barrier barrier = {0};
#pragma omp parallel num_threads(threads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t lo = part(m, t, nt), hi = part(m, t + 1, nt);
#define GEMM(in, k_dim, w, bias, out, n) panels(in, m, k_dim, w, bias, out, n, part((n + NR - 1) / NR, t, nt), \
                                                part((n + NR - 1) / NR, t + 1, nt))
#define SYNC() barrier_wait(&barrier, (int)nt)
        memset(res + lo * hidden, 0, (hi - lo) * hidden * sizeof(float));   /* the residual starts at 0 + x */
        for (int64_t l = 0; l < n_layers; l++) {
            const Layer *L = layers + l;
            rms_norm(x, res, res, L->input_norm, xn, hidden, eps, lo, hi);
            SYNC();
            GEMM(xn, hidden, L->qkv, L->qkv_bias, qkv, nqkv);
            SYNC();
            qkv_rows(L, qkv, nqkv, q, k, pos, slots, cos_sin, eps, lo, hi);
            SYNC();
            for (int64_t r = t; r < n_runs; r += nt)
                paged_decode_attention(q, L->k_cache, L->v_cache, tables, table_stride, lens, attn, scale, runs[r],
                                       runs[r + 1]);
            SYNC();
            GEMM(attn, nq, L->o, NULL, x, hidden);
            SYNC();
            rms_norm(x, res, res, L->post_norm, xn, hidden, eps, lo, hi);
            SYNC();
            GEMM(xn, hidden, L->gate_up, NULL, gu, 2 * inter);
            SYNC();
            silu_mul(gu, act, inter, lo, hi);
            SYNC();
            GEMM(act, inter, L->down, NULL, x, hidden);
            SYNC();
        }
        rms_norm(x, res, res, final_norm, xn, hidden, eps, lo, hi);
        SYNC();
        GEMM(xn, hidden, lm_head, NULL, logits, vocab);
#undef GEMM
#undef SYNC
    }
}
