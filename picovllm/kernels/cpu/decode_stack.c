/* A decode step of a model of the shared decoder (Llama, Mistral, Phi-3, Qwen2/3; Gemma 2/3: post-norms, GeGLU,
 * soft-capped scores, a rope base per layer; Qwen3-MoE and Mixtral: routed experts) on the CPU, float32, in one
 * call: every decoder layer, the final norm and the LM head, for m sequences of one new token each.
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
 * It composes the kernels of this folder, nothing written twice: rms_norm / silu_mul / rope (elementwise.c) and
 * paged_decode_attention (paged_decode.c, built for HQ, HKV, DIM, BLOCK given with -D), included whole; panels
 * (small_gemm.c), quantize_rows and qgemm_part (quant_gemm.c, for weights kept in 4 or 8 bits), linked as objects
 * built once (gemm_parts.h; build.py's PARTS): they do not depend on the shape, and compiling them took ~80% of
 * this file's build, once per shape. Between barriers the threads split rows (the row-wise ops), 16-column weight
 * panels (the GEMMs) or runs of sequences (attention). With quantized weights, whoever writes a GEMM's input rows also
 * quantizes them, before the barrier the GEMM waits at anyway.
 * Compiled at run time by picovllm/kernels/cpu/decode_stack.py; the torch modules stay the reference.
 */
#include <limits.h>
#include <linux/futex.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <immintrin.h>
#include <omp.h>

#include "elementwise.c"
#include "gemm_parts.h"
#include "paged_decode.c"

/* A weight: panels as small_gemm.c reads them (n_segs 0; bfloat16 ones where bf16), or n_segs quantized segments. */
#define MAX_SEGS 3
typedef struct {
    const void *panels;
    int64_t bf16;
    int64_t n_segs;
    QSeg segs[MAX_SEGS];
} Weight;

/* One decoder layer: norm weights, its weights (qkv_bias, q_norm and k_norm may be NULL), the layer's KV
 * cache [num_blocks, BLOCK, HKV, DIM], its sliding window (0: none), its rotary table (cos_sin as rope() reads
 * it), Gemma's norms of the attention and MLP outputs (NULL: none; post_norm is then Gemma's pre-MLP norm), its
 * attention scores' soft-cap (0: none) and what the attention and MLP outputs are multiplied by before they join
 * the residual (Granite's residual multiplier; 1: none). */
typedef struct {
    const float *input_norm, *qkv_bias, *q_norm, *k_norm, *post_norm;
    Weight qkv, o, gate_up, down;
    float *k_cache, *v_cache;
    int64_t window;
    const float *cos_sin, *attn_out_norm, *mlp_out_norm;
    float softcap, out_scale;
    /* a MoE layer (n_experts > 0; gate_up and down unused): the router's panels, and each expert's gate_up
     * [2 * moe_inter, hidden] and down [hidden, moe_inter] panels, one expert after another */
    int64_t n_experts, top_k, moe_inter, renormalize;
    const float *router, *expert_gate_up, *expert_down;
} Layer;

/* rows lo..hi of x [rows, n] times s */
static void scale_rows(float *x, float s, int64_t n, int64_t lo, int64_t hi) {
    for (int64_t i = lo * n; i < hi * n; i++) x[i] *= s;
}

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

/* Thread t of nt's share of out [m][n] = in [m][k] @ W^T (+ bias); qa: `in` quantized, for quantized weights. */
static void gemm_part(const Weight *w, const float *in, QAct qa, int64_t m, int64_t k, const float *bias, float *out,
                      int64_t n, int64_t t, int64_t nt) {
    if (w->n_segs) {
        qgemm_part(w->segs, w->n_segs, qa, m, k, bias, out, n, t, nt);
        return;
    }
    const int64_t count = (n + NR - 1) / NR;
    panels(in, m, k, w->panels, (int)w->bf16, bias, out, n, part(count, t, nt), part(count, t + 1, nt));
}

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

/* Scratch of the MoE layers: router logits [m, E], each row's top-k experts [m, K] and weights [m, K], and one
 * expert's input and output rows [m, max(hidden, 2 * moe_inter)] each. */
typedef struct {
    float *logits, *weight, *in, *out;
    int32_t *expert;
} MoeScratch;

/* Rows [lo, hi): softmax over the experts (float32, as layers/moe.py's route), the top_k largest in order,
 * renormalised to sum to 1 if asked. */
static void route_rows(const Layer *L, MoeScratch *ms, int64_t lo, int64_t hi) {
    const int64_t E = L->n_experts, K = L->top_k;
    for (int64_t r = lo; r < hi; r++) {
        float *p = ms->logits + r * E, mx = p[0], sum = 0.0f, kept = 0.0f;
        for (int64_t e = 1; e < E; e++) mx = fmaxf(mx, p[e]);
        for (int64_t e = 0; e < E; e++) sum += (p[e] = expf(p[e] - mx));
        for (int64_t j = 0; j < K; j++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++)
                if (p[e] >= 0.0f && (best < 0 || p[e] > p[best])) best = e;
            ms->expert[r * K + j] = (int32_t)best;
            ms->weight[r * K + j] = p[best] / sum;
            kept += p[best] / sum;
            p[best] = -1.0f;                       /* taken */
        }
        if (L->renormalize)
            for (int64_t j = 0; j < K; j++) ms->weight[r * K + j] /= kept;
    }
}

/* A MoE layer's MLP: xn [m, hidden] in, the weighted sum of each row's experts into x. Experts one after another,
 * in ascending order (as the torch reference adds them); every thread finds the same rows for an expert, so all
 * skip an expert no row picked alike and meet at the same barriers. */
static void moe_part(const Layer *L, MoeScratch *ms, const float *xn, float *x, int64_t m, int64_t hidden,
                     int gelu, Barrier *barrier, int64_t t, int64_t nt, int64_t lo, int64_t hi) {
    const int64_t E = L->n_experts, K = L->top_k, mi = L->moe_inter;
    const int64_t gu_panels = (2 * mi + NR - 1) / NR, down_panels = (hidden + NR - 1) / NR;
    const QAct none = {0, 0, 0};
    Weight router = {L->router, 0, 0}, gate_up = {0, 0, 0}, down = {0, 0, 0};
    gemm_part(&router, xn, none, m, hidden, NULL, ms->logits, E, t, nt);
    barrier_wait(barrier, (int)nt);
    route_rows(L, ms, lo, hi);
    memset(x + lo * hidden, 0, (hi - lo) * hidden * sizeof(float));
    barrier_wait(barrier, (int)nt);
    int32_t sel[m * K];        /* the expert's rows and their weights: each thread its own copy (a thread may */
    float sel_weight[m * K];   /* list the next expert's while another still adds up this one's) */
    for (int64_t e = 0; e < E; e++) {
        int64_t n = 0;
        for (int64_t i = 0; i < m * K; i++)
            if (ms->expert[i] == e) { sel[n] = (int32_t)(i / K); sel_weight[n++] = ms->weight[i]; }
        if (!n) continue;
        const int64_t a = part(n, t, nt), b = part(n, t + 1, nt);
        for (int64_t i = a; i < b; i++) memcpy(ms->in + i * hidden, xn + sel[i] * hidden, hidden * sizeof(float));
        gate_up.panels = L->expert_gate_up + e * gu_panels * hidden * NR;
        down.panels = L->expert_down + e * down_panels * mi * NR;
        barrier_wait(barrier, (int)nt);
        gemm_part(&gate_up, ms->in, none, n, hidden, NULL, ms->out, 2 * mi, t, nt);
        barrier_wait(barrier, (int)nt);
        if (gelu) gelu_tanh_mul(ms->out, ms->in, mi, a, b);     /* in: the activations now */
        else silu_mul(ms->out, ms->in, mi, a, b);
        barrier_wait(barrier, (int)nt);
        gemm_part(&down, ms->in, none, n, mi, NULL, ms->out, hidden, t, nt);
        barrier_wait(barrier, (int)nt);
        for (int64_t i = a; i < b; i++) {          /* an expert holds a row once: no two threads add to one row */
            float *xr = x + sel[i] * hidden;
            const float *y = ms->out + i * hidden, w = sel_weight[i];
            for (int64_t c = 0; c < hidden; c++) xr[c] += w * y[c];
        }
    }
}

/* x [m, hidden]: the tokens' embeddings in, overwritten. pos, slots [m]; gelu: GeGLU, else SwiGLU;
 * tables [m, table_stride] and lens [m] of the sequences (length after this token); runs[0..n_runs]:
 * attention's runs of sequences, about equal work each. scratch: m * (2 * hidden + 3 * HQ * DIM + 3 * HKV * DIM
 * + 3 * inter) floats. qscratch: NULL without quantized weights, else quant_gemm's scratch for m rows of
 * the widest GEMM input (quant_gemm.py's scratch_bytes). moe: NULL without MoE layers, else its scratch.
 * logits [m, vocab] out. */
void decode_stack(const Layer *layers, int64_t n_layers, int64_t hidden, int64_t inter, float eps, float scale,
                  const float *final_norm, const Weight *lm_head, int64_t vocab, float *x, int64_t m,
                  const int64_t *pos, const int64_t *slots, int64_t gelu, const int32_t *tables,
                  int64_t table_stride, const int32_t *lens, const int64_t *runs, int64_t n_runs, float *scratch,
                  void *qscratch, MoeScratch *moe, float *logits, int64_t threads) {
    const int64_t nqkv = (HQ + 2 * HKV) * DIM, nq = HQ * DIM;
    float *res = scratch, *xn = res + m * hidden, *qkv = xn + m * hidden, *q = qkv + m * nqkv;
    float *k = q + m * nq, *attn = k + m * HKV * DIM, *gu = attn + m * nq, *act = gu + m * 2 * inter;
    const int64_t kmax = hidden > inter ? (hidden > nq ? hidden : nq) : (inter > nq ? inter : nq);
    QAct qa = {(int8_t *)qscratch, 0, 0};
    if (qscratch) {
        qa.d = (float *)((char *)qscratch + ((m * kmax + 63) & ~(int64_t)63));
        qa.s = (int32_t *)(qa.d + m * (kmax / QBLOCK));
    }
    Barrier barrier = {0};
#pragma omp parallel num_threads(threads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t lo = part(m, t, nt), hi = part(m, t + 1, nt);
#define GEMM(in, k_dim, w, bias, out, n) gemm_part(w, in, qa, m, k_dim, bias, out, n, t, nt)
#define QUANTIZE(in, k_dim, r0, r1) if (qscratch) quantize_rows(in, k_dim, qa, r0, r1)
#define SYNC() barrier_wait(&barrier, (int)nt)
        memset(res + lo * hidden, 0, (hi - lo) * hidden * sizeof(float));   /* the residual starts at 0 + x */
        for (int64_t l = 0; l < n_layers; l++) {
            const Layer *L = layers + l;
            rms_norm(x, res, res, L->input_norm, xn, hidden, eps, lo, hi);
            QUANTIZE(xn, hidden, lo, hi);
            SYNC();
            GEMM(xn, hidden, &L->qkv, L->qkv_bias, qkv, nqkv);
            SYNC();
            qkv_rows(L, qkv, nqkv, q, k, pos, slots, L->cos_sin, eps, lo, hi);
            SYNC();
            for (int64_t r = t; r < n_runs; r += nt) {   /* a decode-only step: sequence i is row i */
                paged_attention(q, L->k_cache, L->v_cache, tables, table_stride, lens, attn, scale, L->window, L->softcap,
                                0, runs[r], runs[r + 1]);   /* no sinks: a model with them is not in the stack */
                QUANTIZE(attn, nq, runs[r], runs[r + 1]);
            }
            SYNC();
            GEMM(attn, nq, &L->o, NULL, x, hidden);
            SYNC();
            if (L->out_scale != 1.0f) scale_rows(x, L->out_scale, hidden, lo, hi);
            if (L->attn_out_norm) rms_norm(x, NULL, NULL, L->attn_out_norm, x, hidden, eps, lo, hi);
            rms_norm(x, res, res, L->post_norm, xn, hidden, eps, lo, hi);
            if (L->n_experts) {        /* the experts are float32 panels: no quantized input needed */
                SYNC();
                moe_part(L, moe, xn, x, m, hidden, (int)gelu, &barrier, t, nt, lo, hi);
                SYNC();
                if (L->out_scale != 1.0f) scale_rows(x, L->out_scale, hidden, lo, hi);
                if (L->mlp_out_norm) rms_norm(x, NULL, NULL, L->mlp_out_norm, x, hidden, eps, lo, hi);
                continue;
            }
            QUANTIZE(xn, hidden, lo, hi);
            SYNC();
            GEMM(xn, hidden, &L->gate_up, NULL, gu, 2 * inter);
            SYNC();
            if (gelu) gelu_tanh_mul(gu, act, inter, lo, hi);
            else silu_mul(gu, act, inter, lo, hi);
            QUANTIZE(act, inter, lo, hi);
            SYNC();
            GEMM(act, inter, &L->down, NULL, x, hidden);
            SYNC();
            if (L->out_scale != 1.0f) scale_rows(x, L->out_scale, hidden, lo, hi);
            if (L->mlp_out_norm) rms_norm(x, NULL, NULL, L->mlp_out_norm, x, hidden, eps, lo, hi);   /* own rows */
        }
        rms_norm(x, res, res, final_norm, xn, hidden, eps, lo, hi);
        QUANTIZE(xn, hidden, lo, hi);
        SYNC();
        GEMM(xn, hidden, lm_head, NULL, logits, vocab);
#undef QUANTIZE
#undef GEMM
#undef SYNC
    }
}
