"""Runs the model for one scheduled step: builds the flat batch, runs the forward, samples.

prepare() turns a SchedulerOutput into a StepInput of plain lists (the message a tensor-parallel
worker receives); execute() turns a StepInput into device tensors, runs the model and samples.
"""
from __future__ import annotations

import contextlib
import mmap
from dataclasses import dataclass, field

import numpy as np
import torch

from picovllm.config import EngineConfig, ModelConfig
from picovllm.distributed import SINGLE, TPGroup
from picovllm.engine.cuda_graph import fill_block_tables
from picovllm.engine.scheduler import SchedulerOutput
from picovllm.layers.attention import AttentionMetadata
from picovllm.layers.logits_processors import adjust_logits
from picovllm.layers.sampler import SamplingTensors, sample, seeded_stream
from picovllm.layers.structured_output import apply_token_bitmasks
from picovllm.loader.source import ModelSource
from picovllm.loader.engine_weights import load_model_weights
from picovllm.models import MODEL_REGISTRY
from picovllm.outputs import Logprob


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
    token_bitmask: torch.Tensor | None = None   # structured outputs: allowed tokens, packed (host, int32)

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


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


@dataclass
class StepResult:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob] | None]


@dataclass
class LaunchedStep:
    """A step whose device work is queued: the sampled tokens stay on the device (the next step's
    inputs read them there) and are copied to host memory that resolve() reads once `done` is reached."""
    tokens: torch.Tensor | None            # [num sampled rows] on the device; None if nothing samples
    host: list[torch.Tensor]               # tokens, then the logprob tensors, as host copies
    rows: list[SamplingRow]
    done: torch.cuda.Event | None          # recorded after the copies (CUDA); None on CPU


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros, but on the CPU in an anonymous memory map, whose pages the OS zero-fills on first touch: a
    1 GiB KV cache then costs nothing at start-up (torch.zeros writes every page, ~1 s on 2 cores)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=torch.uint8)[:nbytes].view(dtype).view(shape)


def bind_device(device: torch.device | str) -> None:
    """Make a CUDA device the calling thread's current one. Triton launches on the current device and
    rejects pointers of another, so a thread that runs the model on cuda:1 must call this first."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


class ModelRunner:
    def __init__(self, config: EngineConfig, source: ModelSource, tp: TPGroup = SINGLE,
                 device: torch.device | str | None = None) -> None:
        self.config = config
        self.model_config: ModelConfig = source.config
        self.tp = tp
        self.device = torch.device(device or config.device)
        bind_device(self.device)
        self.dtype = config.torch_dtype
        cls = MODEL_REGISTRY[source.config.architecture]
        with _default_dtype(self.dtype), torch.device(self.device):
            self.model = cls(source.config, tp)
        load_model_weights(self.model, source, config.disk_cache, (tp.rank, tp.size))   # packs on the CPU
        self.model.eval()
        self.block_size = config.block_size
        self.kv_cache: torch.Tensor | None = None
        self.attn_backend = self._make_backend()
        for attn in self.model.attention_layers():
            attn.backend = self.attn_backend
        self.cuda_graphs = None   # a CUDAGraphRunner once the KV cache exists (CUDA, not enforce_eager)
        self.cpu_decode = None    # its CPU counterpart: a DecodeStack (float32, C compiler, not enforce_eager)

    def _make_backend(self):
        from picovllm.layers.attention import TorchAttentionBackend
        name = self.config.attention_backend
        if name == "auto":
            name = "triton" if self.device.type == "cuda" else "cpu" if self._cpu_kernel_fits() else "torch"
        if name == "triton":
            from picovllm.kernels.backend import TritonAttentionBackend
            return TritonAttentionBackend()
        if name == "cpu":
            if not self._cpu_kernel_fits():
                raise ValueError("EngineConfig.attention_backend 'cpu' needs float32 on the CPU and a C compiler")
            from picovllm.kernels.cpu.decode_attention import CpuAttentionBackend
            return CpuAttentionBackend()
        return TorchAttentionBackend()

    def _cpu_kernel_fits(self) -> bool:
        if self.device.type != "cpu" or self.dtype != torch.float32:
            return False
        from picovllm.kernels.cpu import decode_attention as cpu_kernel
        attn = self.model.attention_layers()[0]
        return cpu_kernel.available(attn.num_heads, attn.num_kv_heads, attn.head_dim, self.block_size)

    # -- KV cache ------------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        attn = self.model.attention_layers()[0]
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * len(self.model.attention_layers()) * self.block_size * attn.num_kv_heads * attn.head_dim * elem

    def profile_num_blocks(self) -> int:
        """How many KV blocks fit the memory budget."""
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        per_block = self.kv_bytes_per_block()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self._profile_forward()
            free, total = torch.cuda.mem_get_info()
            peak_extra = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
            budget = total * cfg.gpu_memory_utilization - (total - free) - peak_extra
            return max(1, int(budget // per_block))
        return max(1, int(cfg.cpu_kv_cache_gib * 2**30 // per_block))

    def _profile_forward(self) -> None:
        n = self.config.max_num_batched_tokens
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        saved = [(a.k_cache, a.v_cache) for a in self.model.attention_layers()]
        attn = self.model.attention_layers()[0]
        scratch = torch.zeros(-(-n // self.block_size), self.block_size, attn.num_kv_heads, attn.head_dim,
                              dtype=self.dtype, device=self.device)
        for a in self.model.attention_layers():
            a.k_cache = a.v_cache = scratch
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n, device=self.device),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([n], dtype=torch.int32, device=self.device),
            block_tables=torch.arange(scratch.shape[0], dtype=torch.int32, device=self.device)[None],
            num_decodes=0, max_query_len=n, max_seq_len=n, query_lens_cpu=[n], seq_lens_cpu=[n])
        with torch.inference_mode():
            h = self.model(ids, torch.arange(n, device=self.device), meta)
            self.model.compute_logits(h[-min(n, self.config.max_num_seqs):])
        for a, (k, v) in zip(self.model.attention_layers(), saved):
            a.k_cache, a.v_cache = k, v
        del scratch, h
        torch.cuda.synchronize()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        attn = self.model.attention_layers()[0]
        self.kv_cache = lazy_zeros((len(self.model.attention_layers()), 2, num_blocks, self.block_size,
                                    attn.num_kv_heads, attn.head_dim), self.dtype, self.device)
        for i, a in enumerate(self.model.attention_layers()):
            a.k_cache, a.v_cache = self.kv_cache[i, 0], self.kv_cache[i, 1]
        if self.device.type == "cuda" and not self.config.enforce_eager and self.tp.size == 1 \
                and getattr(self.attn_backend, "supports_cuda_graphs", False):   # TP steps run eager
            from picovllm.engine.cuda_graph import CUDAGraphRunner
            mc = self.model_config
            max_len = min(self.config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
            self.cuda_graphs = CUDAGraphRunner(self.model, self.config.max_num_seqs, -(-max_len // self.block_size),
                                               self.block_size, self.device).capture()
        if self.device.type == "cpu" and not self.config.enforce_eager and self.tp.size == 1:
            from picovllm.kernels.cpu.decode_stack import DecodeStack
            self.cpu_decode = DecodeStack.build(self.model, self.attn_backend)

    # -- one step ------------------------------------------------------------------------------
    def prepare(self, sched: SchedulerOutput, eos_token_ids: list[int]) -> StepInput:
        bs = self.block_size
        ids, pos, slots, qsl, lens, tables, samp_idx, rows = [], [], [], [0], [], [], [], []
        prev_dst, prev_src = [], []
        for chunk in sched.chunks:
            req, start, n = chunk.request, chunk.start, chunk.num_new_tokens
            table = req.block_table
            if n == 1:   # decodes: the common case at large batch, kept cheap
                if start < req.num_known_tokens:
                    ids.append(req.token_id(start))
                else:    # sampled by the step in flight: read on the device
                    prev_dst.append(len(ids))
                    prev_src.append(req.pending_row)
                    ids.append(0)
                pos.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:        # a pending token is only ever a decode's input
                assert start + n <= req.num_known_tokens, req
                ids.extend(req.all_token_ids[start:start + n])
                pos.extend(range(start, start + n))
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            qsl.append(qsl[-1] + n)
            lens.append(start + n)
            tables.append(table)
            if chunk.samples:
                samp_idx.append(qsl[-1] - 1)
                rows.append(self._sampling_row(req, eos_token_ids))
        return StepInput(ids, pos, slots, qsl, lens, tables, sched.num_decodes, samp_idx, rows, prev_dst, prev_src)

    @staticmethod
    def _sampling_row(req, eos_token_ids: list[int]) -> SamplingRow:
        p = req.params
        n_out = req.num_output_tokens
        banned = []
        if n_out < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
        seed = None if p.seed is None else seeded_stream(p.seed, n_out)
        row = SamplingRow(p.temperature, p.top_k, p.top_p, p.min_p, seed, banned, p.logprobs)
        if p.logit_bias:
            row.bias_token_ids, row.bias_values = list(p.logit_bias), [float(v) for v in p.logit_bias.values()]
        if p.has_penalties:
            row.presence_penalty, row.frequency_penalty = p.presence_penalty, p.frequency_penalty
            row.repetition_penalty = p.repetition_penalty
            row.output_token_ids = list(req.output_token_ids)
            row.prompt_token_ids = req.prompt_token_ids if p.repetition_penalty != 1 else []  # never mutated
            row.pending_src = req.pending_row if req.num_pending_tokens else -1
        if req.grammar is not None:
            row.token_bitmask = req.grammar.next_bitmask()
        return row

    def execute(self, step: StepInput) -> StepResult:
        return self.resolve(self.launch(step))

    @torch.inference_mode()
    def launch(self, step: StepInput, prev: LaunchedStep | None = None) -> LaunchedStep:
        """Queue the step's forward and sampling on the device without waiting for them.
        prev: the step still in flight whose sampled tokens feed this one (step.prev_dst)."""
        prev_tokens = None
        if step.prev_dst:
            prev_tokens = (_to(step.prev_dst, torch.long, self.device),
                           prev.tokens[_to(step.prev_src, torch.long, self.device)])
        return self.launch_sampling(self.compute_logits(step, prev_tokens), step.sampling,
                                    prev.tokens if prev is not None else None)

    def launch_sampling(self, logits: torch.Tensor | None, rows: list[SamplingRow],
                        prev_tokens: torch.Tensor | None = None) -> LaunchedStep:
        """prev_tokens: the in-flight step's sampled tokens (penalties count a pending output from there)."""
        if logits is None:
            return LaunchedStep(None, [], [], None)
        tokens, logprob_tensors = self._sample(logits, rows, prev_tokens)
        host = [_to_host(t) for t in (tokens, *logprob_tensors)]
        done = None
        if tokens.is_cuda:
            done = torch.cuda.Event()
            done.record()
        return LaunchedStep(tokens, host, rows, done)

    @staticmethod
    def resolve(launched: LaunchedStep) -> StepResult:
        """Wait for a launched step and read its sampled tokens (the step loop's one host sync)."""
        if launched.tokens is None:
            return StepResult([], [])
        if launched.done is not None:
            launched.done.synchronize()
        tokens = launched.host[0].tolist()
        return StepResult(tokens, _logprob_dicts(tokens, launched.host[1:], launched.rows))

    @torch.inference_mode()
    def compute_logits(self, step: StepInput, prev_tokens: tuple[torch.Tensor, torch.Tensor] | None = None
                       ) -> torch.Tensor | None:
        """The forward, then the logits of the rows that sample (None if none does), in the model's
        dtype (_sample upcasts where it needs to). A decode-only step replays a CUDA graph.
        prev_tokens: (flat indices, token ids) to write into the input ids on the device.

        Tensor-parallel workers stop here: they take part in the collectives; rank 0 samples."""
        if self.cuda_graphs is not None and self.cuda_graphs.fits(step):
            return self.cuda_graphs.run(step, prev_tokens)
        dev = self.device
        meta = self._metadata(step)
        ids = _to(step.input_ids, torch.long, dev)
        if prev_tokens is not None:
            ids.index_copy_(0, *prev_tokens)
        positions = _to(step.positions, torch.long, dev)
        if self.cpu_decode is not None and self.cpu_decode.fits(step):
            return self.cpu_decode.run(ids, positions, meta)
        hidden = self.model(ids, positions, meta)
        if not step.sample_indices:
            return None
        return self.model.compute_logits(hidden[_to(step.sample_indices, torch.long, dev)])

    def shutdown(self) -> None:
        """Release what lives outside this process (tensor-parallel workers); idempotent."""

    def _metadata(self, step: StepInput) -> AttentionMetadata:
        dev = self.device
        width = max(len(t) for t in step.block_tables)
        tables = np.zeros((len(step.block_tables), width), dtype=np.int32)
        fill_block_tables(tables, step.block_tables)
        qlens = [b - a for a, b in zip(step.query_start_loc, step.query_start_loc[1:])]
        return AttentionMetadata(
            slot_mapping=_to(step.slot_mapping, torch.long, dev),
            query_start_loc=_to(step.query_start_loc, torch.int32, dev),
            seq_lens=_to(step.seq_lens, torch.int32, dev),
            block_tables=_upload(tables, dev),
            num_decodes=step.num_decodes,
            max_query_len=max(qlens), max_seq_len=max(step.seq_lens),
            query_lens_cpu=qlens, seq_lens_cpu=step.seq_lens)

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow], prev_tokens: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, tuple]:
        """Sampled token ids [B] on the device, and the logprob tensors the rows ask for (or ()).
        logits in the model's dtype: the fused GPU sampler reads them as they are, the torch
        sampler and logprobs upcast to float32 themselves."""
        dev = logits.device
        raw = logits
        logits = adjust_logits(logits, rows, prev_tokens)   # bias, banned tokens, penalties
        logits = apply_token_bitmasks(logits, rows)         # structured outputs
        temps = [r.temperature for r in rows]
        if all(x == 0 for x in temps):   # greedy batch: no sampling tensors to upload
            tokens = logits.argmax(-1)
            return tokens, _logprob_tensors(raw, tokens, rows)
        t = SamplingTensors(
            temperature=_to(temps, torch.float32, dev),
            top_k=_to([r.top_k for r in rows], torch.long, dev),
            top_p=_to([r.top_p for r in rows], torch.float32, dev),
            min_p=_to([r.min_p for r in rows], torch.float32, dev),
            seeds=[r.seed if r.temperature > 0 else None for r in rows],
            all_greedy=all(x == 0 for x in temps),
            any_top_k=any(r.top_k > 0 for r in rows),
            any_top_p=any(r.top_p < 1 for r in rows),
            any_min_p=any(r.min_p > 0 for r in rows),
            filtered=[r.top_k > 0 or r.top_p < 1 or r.min_p > 0 for r in rows])
        tokens = sample(logits, t)
        return tokens, _logprob_tensors(raw, tokens, rows)


def _logprob_tensors(raw: torch.Tensor, tokens: torch.Tensor, rows: list[SamplingRow]) -> tuple:
    """(chosen token's logprob, its rank, top-k values, top-k ids) on the device, or () if no row asks."""
    want = [r.logprobs for r in rows]
    if all(w is None for w in want):
        return ()
    logp = raw.float().log_softmax(-1)
    k = max(w or 0 for w in want)
    chosen = logp.gather(-1, tokens[:, None])[:, 0]
    ranks = (logp > chosen[:, None]).sum(-1) + 1
    top_v, top_i = logp.topk(k, dim=-1) if k else (logp[:, :0], ranks[:, None][:, :0])
    return chosen, ranks, top_v, top_i


def _logprob_dicts(tokens: list[int], host: list[torch.Tensor], rows: list[SamplingRow]) -> list:
    if not host:
        return [None] * len(rows)
    chosen_l, ranks_l, top_v_l, top_i_l = (t.tolist() for t in host)
    out = []
    for i, r in enumerate(rows):
        if r.logprobs is None:
            out.append(None)
            continue
        d = {tokens[i]: Logprob(chosen_l[i], ranks_l[i])}
        for j in range(r.logprobs):
            d.setdefault(top_i_l[i][j], Logprob(top_v_l[i][j], j + 1))
        out.append(d)
    return out


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of a device tensor, made without blocking (the caller waits on an event)."""
    if not t.is_cuda:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def _upload(array: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(array)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def _to(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(data, dtype=dtype)
