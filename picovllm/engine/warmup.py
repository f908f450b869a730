"""Start-up warm-up: steps of every shape class a run can meet, run once after the KV cache is allocated
(before the decode CUDA graphs are captured), so that no request pays for a Triton compile.

What makes Triton compile again. A jitted kernel is compiled once per *specialization key*: the
constexpr values, each tensor argument's dtype and whether its address is a multiple of 16, and for
each int argument not listed in `do_not_specialize` its type (i32 below 2**31, i64 above), whether it
is divisible by 16, and whether it equals 1 (then it becomes a constant). Floats and bools never
specialize. So, kernel by kernel (kernels/*.py):

- rms_norm, rope (+ q/k norm, + the KV store), silu_and_mul, store_kv, the MoE grouped GEMM: every int argument
  is a stride or a size fixed by the model's shape (hidden, heads, head_dim, intermediate, the caches);
  the token count is only the grid. Constexprs: HAS_RESIDUAL (both occur in every forward: the first
  layer has no residual), HAS_NORM, the MoE's A_DIV/SCALE (both per forward). One forward covers them.
- prefill attention: first_seq and the block table's stride vary per step and are do_not_specialize;
  `window` is fixed per layer (each layer of the forward is run). One variant per model, the same with
  or without prefix-cached context and with or without decodes before the chunk.
- decode attention: num_splits and the table stride are do_not_specialize, but num_splits == 1
  switches the constexprs DIRECT and BLOCK_N (no reduce pass). That depends on the batch size through
  num_splits_for(batch, kv_heads): the plan runs the smallest decode batch of each variant that a run
  can meet (up to max_num_seqs), eagerly (mixed steps and enforce_eager run decodes outside graphs).
- sampling (Gumbel-max): chunk and num_chunks are do_not_specialize, vocab is the model's, but the
  logits' dtype is: the model's dtype as computed, float32 once a row has a bias, banned tokens (min
  tokens) or penalties (logits_processors copies to float32). Both are sampled.
- greedy argmax (kernels/argmax.py, batches of few rows): the same, so greedy batches run on both dtypes
  (the "greedy_adjusted" step: a greedy row with a bias and penalties).
- Alignment: every tensor a kernel receives is a fresh allocation, a slice starting at row 0, or (the fused
  sampler's temperatures) a slice at an even int64 index (layers/sampler.packed_rows), so always 16-byte
  aligned; nothing to vary.

What the token count does change is outside Triton: cuBLAS picks its GEMM kernel by the row count
(each loaded on first use, CUDA's lazy module loading), the caching allocator and the pinned host
allocator grow by size class. So prefills run at every power of two up to the step's token budget
(largest first: the allocator reaches its peak at once), plus a prefill over cached context, a step of
several prefill chunks with prompt logprobs, decode-only steps and mixed (decodes + chunk) steps, and
sampling with greedy, temperature-only, filtered (top-p), penalized and logprob rows.

No state is left behind: every warm-up token has slot -1, which the Triton KV stores (store_kv and
rope_qkv's) skip (as CUDA-graph padding does), so the cache is never written; block tables point at block
0, whose contents are only read; the block manager is not involved (it is built after the runner); the
random generators are forked, so a run draws the same numbers with or without the warm-up.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Hashable

import torch

from picovllm.engine.step_input import SamplingRow, StepInput

if TYPE_CHECKING:
    from picovllm.engine.model_runner import ModelRunner

logger = logging.getLogger("picovllm.engine")

CACHED_CONTEXT = 40       # tokens of "prefix-cached" context ahead of a warm-up chunk (whole blocks are read)
CACHED_SUFFIX = 2         # new tokens after it: the short-suffix request of a chat turn


@dataclass(frozen=True)
class WarmupPlan:
    """The warm-up steps, each a list of (context tokens, new tokens) per sequence, decodes first."""
    prefill_tokens: list[int]          # fresh prefill steps of these many tokens (buckets, largest first)
    max_seq_len: int                   # a bucket longer than this is cut into sequences of at most this
    decode_batches: list[int]          # decode-only steps of these batch sizes (one per decode-kernel variant)
    mixed_decodes: list[int]           # steps of this many decodes plus one prefill chunk
    cached: tuple[int, int]            # (context, new tokens) of a chunk after cached context
    multi: list[tuple[int, int]]       # several prefill chunks in one step

    def steps(self) -> list[tuple[list[tuple[int, int]], str]]:
        """(sequences, sampling kind) per step; the multi-chunk step also scores prompt logprobs."""
        c, n = self.cached
        kinds = ("greedy", "plain", "adjusted")
        out = []
        for i, t in enumerate(self.prefill_tokens):
            whole, rest = divmod(t, self.max_seq_len)
            out.append(([(0, self.max_seq_len)] * whole + [(0, rest)] * (rest > 0), kinds[i % 3]))
        out.append(([(c, n)], "plain"))
        out.append((self.multi, "adjusted"))
        out += [([(c, 1)] * b, "plain") for b in self.decode_batches]
        out += [([(c, 1)] * b + [(c, n)], "adjusted") for b in self.mixed_decodes]
        out.append(([(c, 1)], "greedy_adjusted"))
        return out


def powers_of_two_upto(n: int) -> list[int]:
    """n, then the powers of two below it, down to 1 (largest first)."""
    out, p = [n], 1 << (n.bit_length() - 1)
    while p >= 1:
        if p != n:
            out.append(p)
        p //= 2
    return out


def plan_warmup(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                decode_variant: Callable[[int], Hashable]) -> WarmupPlan:
    """decode_variant(batch size) -> what the decode kernel specializes on at that size (equal keys: the
    same compiled kernels). Every step fits the scheduler's limits: at most max_num_batched_tokens
    tokens and max_num_seqs sequences, no sequence past max_model_len."""
    budget = min(max_num_batched_tokens, max_model_len)     # one sequence's chunk
    n = min(CACHED_SUFFIX, budget)
    c = min(CACHED_CONTEXT, max_model_len - n)
    seen: dict[Hashable, int] = {}
    for b in range(1, min(max_num_seqs, max_num_batched_tokens) + 1):
        seen.setdefault(decode_variant(b), b)
    decodes = sorted(seen.values())
    mixed = [b for b in decodes if b < max_num_seqs and b + n <= budget]
    multi = [(0, min(3, budget))]
    if max_num_seqs > 1 and budget >= multi[0][1] + n:
        multi.append((c, n))
    step_tokens = min(max_num_batched_tokens, max_num_seqs * max_model_len)
    return WarmupPlan(powers_of_two_upto(step_tokens), max_model_len, decodes, mixed, (c, n), multi)


def warmup_step(seqs: list[tuple[int, int]], block_size: int, vocab_size: int,
                prompt_logprobs: bool = False) -> StepInput:
    """A StepInput for (context, new tokens) per sequence (decodes first), every slot -1, every block
    table entry block 0; each sequence samples its last token."""
    ids, pos, qsl, lens, tables, samp = [], [], [0], [], [], []
    for ctx, n in seqs:
        ids += [(7919 * (ctx + i)) % vocab_size for i in range(n)]
        pos += range(ctx, ctx + n)
        qsl.append(qsl[-1] + n)
        lens.append(ctx + n)
        tables.append([0] * -(-(ctx + n) // block_size))
        samp.append(qsl[-1] - 1)
    num_decodes = next((i for i, (_, n) in enumerate(seqs) if n != 1), len(seqs))
    step = StepInput(ids, pos, [-1] * len(ids), qsl, lens, tables, num_decodes, samp, [])
    if prompt_logprobs and seqs[0][1] > 1:    # the first sequence's prompt tokens are scored (top 2)
        step.prompt_indices = list(range(seqs[0][1] - 1))
        step.prompt_targets = ids[1:seqs[0][1]]
        step.prompt_topk = [2] * len(step.prompt_indices)
    return step


def sampling_rows(n: int, kind: str, vocab_size: int) -> list[SamplingRow]:
    """kind "greedy"; "plain": temperature only (the fused sampler on the model's dtype); "adjusted":
    banned tokens, a bias and penalties (float32 logits) with a top-p row (the torch sampler) and logprobs;
    "greedy_adjusted": greedy rows with those (the greedy argmax on float32 logits)."""
    if kind == "greedy":
        return [SamplingRow(0.0, 0, 1.0, 0.0, None, [], None) for _ in range(n)]
    if kind == "plain":
        return [SamplingRow(0.0 if i == 0 and n > 1 else 0.7, 0, 1.0, 0.0, 1000 + i, [], None) for i in range(n)]
    greedy = kind == "greedy_adjusted"
    rows = []
    for i in range(n):
        row = SamplingRow(0.0 if greedy else 0.8, 0, 0.9 if i == 0 and not greedy else 1.0, 0.0,
                          None if greedy else 2000 + i, [i % vocab_size], 2)
        row.bias_token_ids, row.bias_values = [1 % vocab_size], [0.5]
        row.presence_penalty, row.repetition_penalty = 0.1, 1.1
        row.output_token_ids, row.prompt_token_ids = [2 % vocab_size], [3 % vocab_size]
        rows.append(row)
    return rows


def warm_up(runner: "ModelRunner", plan: WarmupPlan) -> float:
    """Run the plan's steps through the runner's launch/resolve (eagerly: call before the CUDA graphs are
    captured); returns the seconds taken. Decode steps read their tokens from the step before them on the
    device (the overlapped path) where it sampled enough rows."""
    t0 = time.perf_counter()
    vocab, bs = runner.model_config.vocab_size, runner.block_size
    devices = [runner.device] if runner.device.type == "cuda" else []
    steps = plan.steps()
    prev = None
    with torch.random.fork_rng(devices=devices):
        for seqs, kind in steps:
            step = warmup_step(seqs, bs, vocab, prompt_logprobs=seqs is plan.multi)
            step.sampling = sampling_rows(len(seqs), kind, vocab)
            if prev is not None and prev.tokens is not None and step.num_decodes:
                k = min(step.num_decodes, prev.tokens.shape[0])
                step.prev_dst, step.prev_src = list(range(k)), list(range(k))
                for j, row in enumerate(step.sampling[:k]):
                    if row.has_penalties:
                        row.pending_src = j
            launched = runner.launch(step, prev if step.prev_dst else None)
            runner.resolve(launched)
            prev = launched
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    seconds = time.perf_counter() - t0
    logger.info("warm-up: %d steps in %.2f s (Triton kernels compiled at start-up)", len(steps), seconds)
    return seconds
