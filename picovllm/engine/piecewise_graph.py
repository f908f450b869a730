"""CUDA graphs in pieces, cut at attention, for the steps no whole-step graph serves: a prompt's chunk beside decodes
(a mixed step), several chunks, chunks longer than the prefill graphs' buckets (EngineConfig.prefill_cuda_graphs).

Such a step ran the model eagerly: ~25 kernels a layer, each launched from Python. On an H200 a mixed step of the
Qwen3-0.6B shape took 15-18 ms of host time for 1.7 ms of kernels (684 launches), and under online traffic most
steps are mixed; in pieces it takes 8.4-10.6 ms (BENCHMARKS.md), most of it the eager attention's launches.
Everything in the forward but attention depends on the step's token count alone; attention's launches depend on its
layout (how many decodes, which chunks, their contexts). So the forward is captured once per token-count bucket as
L+1 graphs cut at each layer's attention call: piece 0 runs from the token ids to layer 0's q (the rope kernel
inside it stores K/V), piece i from attention i - 1's output to layer i's q, the last piece to the final norm. Each
piece ends by copying q (and k, v where the backend stores them itself) into static buffers; a step replays piece 0,
runs attention 0 eagerly on those buffers, copies its output into the static buffer piece 1 reads, replays piece 1,
and so on; the LM head runs eagerly on the sampled rows. The buffers serve every layer and bucket (a layer's q is
dead once its attention ran), so the pieces hold no layer's activations beyond its own.

The graphs read their inputs from static buffers: token ids, positions and slots, padded to the bucket with slot -1
(the KV store skips those rows; they flow through the row-wise layers and are never read). The pieces share one
memory pool and replay in the order they were captured.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from picovllm.engine.cuda_graph import StagedTables
from picovllm.engine.step_input import StepInput, step_tensors
from picovllm.layers.attention import AttentionMetadata

BUCKETS = (64, 128, 256, 512, 1024, 2048)


def piecewise_buckets(max_num_batched_tokens: int) -> list[int]:
    """The token counts captured: the buckets a step can reach under its budget (at least the smallest)."""
    fit = [b for b in BUCKETS if b < max_num_batched_tokens]
    return fit + [b for b in BUCKETS if b >= max_num_batched_tokens][:1]


@dataclass
class _AttentionCall:
    """One layer's attention as the capture met it: what the eager call at replay takes (all but the step's
    metadata: q, k, v are views of the static buffers, k and v None where the rope kernel stored them), and the
    static buffer its output goes to."""
    q: torch.Tensor
    k: torch.Tensor | None
    v: torch.Tensor | None
    k_cache: torch.Tensor | None
    v_cache: torch.Tensor | None
    scale: float
    window: int | None
    softcap: float | None
    kv_scales: object
    kv_stored: bool
    sinks: torch.Tensor | None
    out: torch.Tensor


class _Bucket:
    def __init__(self) -> None:
        self.pieces: list[torch.cuda.CUDAGraph] = []
        self.calls: list[_AttentionCall] = []
        self.hidden: torch.Tensor | None = None     # the forward's output (the last piece's)


class _CutAtAttention:
    """Every layer's attention backend while a bucket is captured: the call ends the piece being captured, is
    recorded, and starts the next piece; it hands back the static buffer the eager attention will fill at replay.
    What layers ask of a backend before the call (accepts_stored_kv) is the real backend's."""

    def __init__(self, runner: "PiecewiseGraphRunner", backend, bucket: _Bucket) -> None:
        self._runner, self._backend, self._bucket = runner, backend, bucket

    def __getattr__(self, name: str):
        return getattr(self._backend, name)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, window=None, softcap=None,
                kv_scales=None, kv_stored: bool = False, sinks=None) -> torch.Tensor:
        static = self._runner.static
        q_in = static("q", q).copy_(q)               # the piece's last kernels: its q (k, v) where attention reads
        k_in = None if kv_stored else static("k", k).copy_(k)
        v_in = None if kv_stored else static("v", v).copy_(v)
        out = static("out", q)
        self._runner._end_piece(self._bucket)
        self._bucket.calls.append(_AttentionCall(q_in, k_in, v_in, k_cache, v_cache, scale, window, softcap,
                                                 kv_scales, kv_stored, sinks, out))
        self._runner._begin_piece()
        return out


class PiecewiseGraphRunner:
    def __init__(self, model: nn.Module, max_num_batched_tokens: int, block_size: int, device: torch.device) -> None:
        self.model = model
        self.sizes = piecewise_buckets(max_num_batched_tokens)
        self.max_tokens = min(self.sizes[-1], max_num_batched_tokens)
        self.block_size = block_size
        self.device = torch.device(device)
        self.tokens = torch.zeros(3, self.sizes[-1], dtype=torch.long, device=device)   # ids, positions, slots
        self.tokens[2].fill_(-1)
        self.buckets: dict[int, _Bucket] = {}
        self.backends = [attn.backend for attn in model.attention_layers()]   # what runs attention at replay
        self._static: dict[tuple, torch.Tensor] = {}
        self._pool = None
        self._open: torch.cuda.CUDAGraph | None = None

    def _meta(self, size: int) -> AttentionMetadata:
        """A one-chunk step of `size` tokens that writes nothing (slots -1): the warm-up forward's, and what the
        capture passes (the pieces read only its slots)."""
        blocks = -(-size // self.block_size)
        dev = self.device
        return AttentionMetadata(
            slot_mapping=self.tokens[2, :size], query_start_loc=torch.tensor([0, size], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([size], dtype=torch.int32, device=dev),
            block_tables=torch.zeros(1, max(blocks, 1), dtype=torch.int32, device=dev), num_decodes=0,
            max_query_len=size, max_seq_len=size, query_lens_cpu=[size], seq_lens_cpu=[size])

    def static(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """A static buffer for `like`'s rows (contiguous, the largest bucket's rows: the first capture's), shared
        by every layer and bucket; the view of its first like.shape[0] rows."""
        key = (name, tuple(like.shape[1:]), like.dtype)
        if key not in self._static:
            self._static[key] = torch.empty((self.sizes[-1], *like.shape[1:]), dtype=like.dtype, device=like.device)
        return self._static[key][:like.shape[0]]

    def _begin_piece(self) -> None:
        self._open = torch.cuda.CUDAGraph()
        self._open.capture_begin(pool=self._pool)

    def _end_piece(self, bucket: _Bucket) -> None:
        self._open.capture_end()
        bucket.pieces.append(self._open)
        self._open = None

    @torch.inference_mode()
    def capture(self) -> "PiecewiseGraphRunner":
        """Capture every bucket, largest first (the smaller ones reuse its memory), on a side stream."""
        self._pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        self.tokens[2].fill_(-1)
        for size in reversed(self.sizes):
            self.model(self.tokens[0, :size], self.tokens[1, :size], self._meta(size))   # lazy inits, compiles
            torch.cuda.synchronize(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self.buckets[size] = self.record(size)
            torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        return self

    def record(self, size: int) -> _Bucket:
        """Run the forward of `size` tokens once with every layer's attention cut out (_CutAtAttention); the
        stretches between the cuts are recorded by _begin_piece and _end_piece (CUDA graph captures)."""
        bucket = _Bucket()
        layers = self.model.attention_layers()
        meta = self._meta(size)       # before the capture: it uploads
        try:
            for attn, backend in zip(layers, self.backends):
                attn.backend = _CutAtAttention(self, backend, bucket)
            self._begin_piece()
            bucket.hidden = self.model(self.tokens[0, :size], self.tokens[1, :size], meta)
            self._end_piece(bucket)
        finally:
            if self._open is not None:       # a failed capture: end it, so the stream is usable again
                try:
                    self._open.capture_end()
                except RuntimeError:
                    pass
                self._open = None
            for attn, backend in zip(layers, self.backends):
                attn.backend = backend
        return bucket

    def fits(self, step: StepInput) -> bool:
        """Steps of at most the largest bucket's tokens without prompt logprobs (the LM head's rows are the sampled
        ones only); any layout of decodes and chunks, any context: the pieces read no block table."""
        return not step.prompt_indices and 0 < len(step.input_ids) <= self.max_tokens

    def run(self, step: StepInput, prev_tokens=None, staged: StagedTables | None = None) -> torch.Tensor | None:
        """The step's forward through the bucket's pieces and eager attention; the sampled rows' logits, or None
        when no row samples. prev_tokens: as ModelRunner.compute_logits'; staged: as step_tensors'."""
        ids, positions, meta, rows = step_tensors(step, self.device, prev_tokens, staged)
        n = ids.shape[0]
        size = next(s for s in self.sizes if s >= n)
        bucket = self.buckets[size]
        self.tokens[0, :n].copy_(ids)
        self.tokens[1, :n].copy_(positions)
        self.tokens[2, :n].copy_(meta.slot_mapping)
        if size > n:
            self.tokens[2, n:size].fill_(-1)
        for piece, call, backend in zip(bucket.pieces, bucket.calls, self.backends):
            piece.replay()
            # the keywords only when set, as Attention.forward passes them
            extra = {"kv_stored": True} if call.kv_stored else {}
            if call.sinks is not None:
                extra["sinks"] = call.sinks
            k, v = (None, None) if call.kv_stored else (call.k[:n], call.v[:n])
            out = backend.forward(call.q[:n], k, v, call.k_cache, call.v_cache, meta, call.scale, call.window,
                                  call.softcap, call.kv_scales, **extra)
            call.out[:n].copy_(out)
        bucket.pieces[-1].replay()
        if not step.num_logit_rows:
            return None
        return self.model.compute_logits(bucket.hidden[rows])
