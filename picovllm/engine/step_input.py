"""Input building: a SchedulerOutput becomes a StepInput of plain lists (prepare), and a StepInput
becomes the device tensors of one forward (token ids, positions, AttentionMetadata).

A StepInput is also what rank 0 of a tensor-parallel engine sends its workers (engine/messages.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from picovllm.engine.cuda_graph import StagedTables, fill_block_tables
from picovllm.engine.scheduler import SchedulerOutput, prompt_logprob_positions
from picovllm.layers.attention import AttentionMetadata
from picovllm.layers.logits_processors import bad_word_bans
from picovllm.layers.sampler import seeded_stream
from picovllm.layers.structured_output import TokenBitmasks


@dataclass
class SamplingRow:
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int | None          # stream seed for this very token (seed, output index), or None
    banned: list[int]         # token ids masked out (EOS and stop ids before min_tokens)
    logprobs: int | None
    # Logit bias and penalties (picovllm.layers.logits_processors). The token ids only travel when a
    # penalty needs them: the outputs known on the host, the prompt only for the repetition penalty.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    bias_token_ids: list[int] = field(default_factory=list)
    bias_values: list[float] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    pending_src: int = -1     # overlapped: the in-flight step's row sampling this request's last output, or -1
    allowed: list[int] = field(default_factory=list)   # SamplingParams.allowed_token_ids: the only tokens (or [])
    # SamplingParams.bad_words that hang on the pending token (pending_src): bad_ban[j] is banned if it is
    # bad_after[j]. The bans the host can decide alone are in `banned`.
    bad_after: list[int] = field(default_factory=list)
    bad_ban: list[int] = field(default_factory=list)
    # Penalties kept on the device from step to step (logits_processors.PenaltyCounts): the request's id, the outputs
    # counted are output_token_ids[:num_outputs] (the request's own list, only appended to: not copied; -1: all of
    # it), then the drafted tokens `ahead` (speculative rows). Without a key the counts are built anew each step.
    penalty_key: str | None = None
    num_outputs: int = -1
    ahead: list[int] = field(default_factory=list)

    def counted_outputs(self) -> list[int]:
        """The outputs the penalties count, besides the pending one: the known ones, then the drafts."""
        known = self.output_token_ids if self.num_outputs < 0 else self.output_token_ids[:self.num_outputs]
        return known + self.ahead if self.ahead else known

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def filtered(self) -> bool:
        """Uses top-k, top-p or min-p (the torch sampler's filters)."""
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0


@dataclass
class StepInput:
    """Everything a step needs, as plain data: what rank 0 sends to tensor-parallel workers."""
    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    query_start_loc: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    num_decodes: int
    sample_indices: list[int]     # rows of the flat batch whose logits are sampled
    sampling: list[SamplingRow]
    # Overlapped scheduling: input_ids[prev_dst[i]] is the token the previous step sampled in its
    # row prev_src[i], still on the device when this step was prepared (the id here is a placeholder).
    prev_dst: list[int] = field(default_factory=list)
    prev_src: list[int] = field(default_factory=list)
    # SamplingParams.prompt_logprobs: rows of the flat batch whose logits score the next prompt token
    # (prompt_targets), and each row's top-k. Their logits come after the sampled rows'.
    prompt_indices: list[int] = field(default_factory=list)
    prompt_targets: list[int] = field(default_factory=list)
    prompt_topk: list[int] = field(default_factory=list)
    # Structured outputs: the grammar masks of the sampling rows, filled by the engine on the host (rank 0
    # only: not part of the wire form, workers do not sample)
    token_bitmasks: TokenBitmasks | None = None
    # A pooling engine's step (engine/pooling.py): rows [a, b) of the flat batch whose hidden states are summed into
    # one pooled row each, in place of logits (rank 0 only: not part of the wire form, workers run the forward alone)
    pooled_rows: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_logit_rows(self) -> int:
        return len(self.sample_indices) + len(self.prompt_indices)


# -- SchedulerOutput -> StepInput ------------------------------------------------------------------
def build_step_input(sched: SchedulerOutput, block_size: int, eos_token_ids: list[int]) -> StepInput:
    """One flat varlen batch of the scheduled chunks, decodes first (the scheduler's order)."""
    bs = block_size
    ids, pos, slots, qsl, lens, tables, samp_idx, rows = [], [], [], [0], [], [], [], []
    prev_dst, prev_src = [], []
    p_idx, p_tgt, p_k = [], [], []
    pooled = []
    for chunk in sched.chunks:
        req, start, n = chunk.request, chunk.start, chunk.num_new_tokens
        if req.prompt_logprobs is not None:     # as many as the scheduler allowed for (its max_prompt_rows)
            prompt = req.prompt_token_ids
            for p in prompt_logprob_positions(req, start, n):
                p_idx.append(len(ids) + p - start)
                p_tgt.append(prompt[p + 1])
                p_k.append(req.params.prompt_logprobs)
        table = req.block_table
        if chunk.drafts:     # decode rows, one a token: each samples, each a sequence of its own
            if req.num_pending_tokens:      # its first row reads the token in flight on the device
                prev_dst.append(len(ids))
                prev_src.append(req.pending_row)
            r_ids, r_pos, r_slots, r_rows = speculative_rows(chunk, bs, eos_token_ids)
            samp_idx.extend(range(len(ids), len(ids) + len(r_ids)))
            ids += r_ids
            pos += r_pos
            slots += r_slots
            rows += r_rows
            for p in range(start + 1, start + 1 + len(r_ids)):
                qsl.append(qsl[-1] + 1)
                lens.append(p)
                tables.append(table)
            continue
        if n == 1:   # decodes: the common case at large batch, kept cheap
            if start < req.num_known_tokens:
                ids.append(req.token_id(start))
            else:    # sampled by the step in flight: read on the device
                prev_dst.append(len(ids))
                prev_src.append(req.pending_row)
                ids.append(0)
            pos.append(start + req.position_offset)
            slots.append(table[start // bs] * bs + start % bs)
        else:        # a pending token is only ever a decode's input
            assert start + n <= req.num_known_tokens, req
            ids.extend(req.token_ids(start, start + n))
            pos.extend(range(start + req.position_offset, start + n + req.position_offset))
            for b in range(start // bs, (start + n - 1) // bs + 1):    # a run of slots per block, not per token
                base = table[b] * bs
                slots.extend(range(base + max(start - b * bs, 0), base + min(start + n - b * bs, bs)))
        qsl.append(qsl[-1] + n)
        lens.append(start + n)
        tables.append(table)
        if chunk.samples:
            samp_idx.append(qsl[-1] - 1)
            rows.append(sampling_row(req, eos_token_ids))
        if chunk.pools:      # every row of the chunk under mean pooling, else the prompt's last
            pooled.append((qsl[-2] if req.pooling.mean else qsl[-1] - 1, qsl[-1]))
    return StepInput(ids, pos, slots, qsl, lens, tables, sched.num_decodes, samp_idx, rows, prev_dst, prev_src,
                     p_idx, p_tgt, p_k, pooled_rows=pooled)


def speculative_rows(chunk, bs: int, eos_token_ids: list[int]) -> tuple[list, list, list, list[SamplingRow]]:
    """A speculative chunk (engine/spec_decode.py) as decode rows: its last token, then each draft, every one a
    decode of its own prefix (the same block table, its own sequence length) that samples the token after it: (ids,
    positions, slots, sampling rows). A layer stores every row's K/V before any row attends, so a row sees the rows
    before it: the decode-only paths (CUDA graphs, the CPU's one-call decode stack) run speculative steps as any other."""
    req, start, drafts = chunk.request, chunk.start, chunk.drafts
    assert start == req.num_tokens - 1, req
    table, off, n = req.block_table, req.position_offset, 1 + len(drafts)
    slots = [table[p // bs] * bs + p % bs for p in range(start, start + n)]
    rows = [sampling_row(req, eos_token_ids, drafts[:i]) for i in range(n)]
    first = req.token_id(start) if start < req.num_known_tokens else 0     # 0: a placeholder for the token in flight
    return [first] + drafts, list(range(start + off, start + n + off)), slots, rows


def sampling_row(req, eos_token_ids: list[int], ahead: list[int] = ()) -> SamplingRow:
    """How a request samples its next token: its SamplingParams resolved for this output index.
    ahead: drafted tokens taken as its next outputs (speculative decoding: the row samples the token after them).
    A row that no later output index changes (no seed, bad words or penalties; past min_tokens) is built once, kept as
    req.fixed_sampling_row and shared by every later step: rows are never mutated once built."""
    if req.fixed_sampling_row is not None:
        return req.fixed_sampling_row
    p = req.params
    n_out = req.num_output_tokens + len(ahead)
    # the outputs so far, drafts included, read by bad words only (a copy a row: made only for them)
    outputs = req.output_token_ids + list(ahead) if ahead and req.bad_words_ids else req.output_token_ids
    banned = []
    if n_out < p.min_tokens:
        banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
    seed = None if p.seed is None else seeded_stream(p.seed, n_out)
    pending = req.pending_row if req.num_pending_tokens else -1
    if req.bad_words_ids:
        now, after, ban = bad_word_bans(req.bad_words_ids, outputs, pending >= 0)
        banned = banned + now
    row = SamplingRow(p.temperature, p.top_k, p.top_p, p.min_p, seed, banned, p.logprobs)
    if req.bad_words_ids and after:
        row.bad_after, row.bad_ban, row.pending_src = after, ban, pending
    if p.allowed_token_ids:
        row.allowed = p.allowed_token_ids          # never mutated
    if p.logit_bias:
        row.bias_token_ids, row.bias_values = list(p.logit_bias), [float(v) for v in p.logit_bias.values()]
    if p.has_penalties:
        row.presence_penalty, row.frequency_penalty = p.presence_penalty, p.frequency_penalty
        row.repetition_penalty = p.repetition_penalty
        row.penalty_key, row.output_token_ids = req.request_id, req.output_token_ids     # only appended to
        row.num_outputs, row.ahead = len(req.output_token_ids), list(ahead)
        row.prompt_token_ids = req.prompt_token_ids if p.repetition_penalty != 1 else []  # never mutated
        row.pending_src = pending
    elif not (ahead or req.bad_words_ids or p.seed is not None) and n_out >= p.min_tokens:
        req.fixed_sampling_row = row      # (n_out never falls: a later row's min_tokens ban is empty too)
    return row


# -- StepInput -> device tensors -------------------------------------------------------------------
def step_tensors(step: StepInput, device: torch.device,
                 prev_tokens: tuple[torch.Tensor, torch.Tensor] | None = None, staged: StagedTables | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    """(input ids, positions, AttentionMetadata, logit rows: the sampled then the prompt-logprob rows) on the
    device, in one host-to-device copy. prev_tokens = (flat indices, token ids) overwrite the placeholders of
    tokens the step in flight sampled. staged: a runner's kept block tables, which write only the entries each row
    gained since the last step (else every entry is converted anew)."""
    width = max(len(t) for t in step.block_tables)
    if staged is not None and staged.fits(step.block_tables, width):
        tables = staged.stage(step.block_tables, width)
    else:
        tables = np.zeros((len(step.block_tables), width), dtype=np.int32)
        fill_block_tables(tables, step.block_tables)
    ids, pos, slots, rows, qsl, lens, tables = pack_upload(
        [(step.input_ids, np.int64), (step.positions, np.int64), (step.slot_mapping, np.int64),
         (step.sample_indices + step.prompt_indices, np.int64), (step.query_start_loc, np.int32),
         (step.seq_lens, np.int32), (tables, np.int32)], device)
    if prev_tokens is not None:
        ids.index_copy_(0, *prev_tokens)
    qsl_cpu = step.query_start_loc
    qlens = [b - a for a, b in zip(qsl_cpu, qsl_cpu[1:])]
    meta = AttentionMetadata(slot_mapping=slots, query_start_loc=qsl, seq_lens=lens, block_tables=tables,
                             num_decodes=step.num_decodes, max_query_len=max(qlens), max_seq_len=max(step.seq_lens),
                             query_lens_cpu=qlens, seq_lens_cpu=step.seq_lens)
    return ids, pos, meta, rows


ALIGN = 64   # bytes: every packed tensor starts 16-byte aligned, as Triton's specialization expects of a fresh one


def pack_upload(parts: list[tuple[object, type]], device: torch.device) -> list[torch.Tensor]:
    """Each (list or array, numpy dtype) as a tensor on the device. All of them travel in one copy of one host
    buffer (pinned on CUDA, so the copy does not block), each at an ALIGN-byte offset; on the CPU they are
    views of that buffer. One copy instead of one per tensor: a step's inputs cost one transfer's overhead."""
    arrays = [np.ascontiguousarray(data, dtype=dtype) for data, dtype in parts]   # a staged view is strided
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.nbytes // ALIGN) * ALIGN
    host = torch.empty(max(total, ALIGN), dtype=torch.uint8, pin_memory=device.type == "cuda")
    flat = host.numpy()
    for a, off in zip(arrays, offsets):
        flat[off:off + a.nbytes] = a.reshape(-1).view(np.uint8)
    buf = host.to(device, non_blocking=True) if device.type == "cuda" else host
    return [buf[off:off + a.nbytes].view(_TORCH_DTYPES[a.dtype.type]).view(a.shape) for a, off in zip(arrays, offsets)]


_TORCH_DTYPES = {np.int64: torch.int64, np.int32: torch.int32}


def token_tensors(step: StepInput, device: torch.device,
                  prev_tokens: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, positions) on the device; prev_tokens = (flat indices, token ids) overwrite
    the placeholders of tokens the step in flight sampled."""
    ids = to_device(step.input_ids, torch.long, device)
    if prev_tokens is not None:
        ids.index_copy_(0, *prev_tokens)
    return ids, to_device(step.positions, torch.long, device)


def step_metadata(step: StepInput, device: torch.device) -> AttentionMetadata:
    """The AttentionMetadata alone (step_tensors builds it with the rest of a step's inputs)."""
    return step_tensors(step, device)[2]


def upload(array: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(array)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def to_device(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor; on CUDA through pinned memory, so the copy does not block."""
    if device.type == "cuda":
        return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(data, dtype=dtype)
