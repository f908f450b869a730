"""Runs the model for one scheduled step on this process: composes the model, its attention backend,
the KV cache, input building and sampling, and picks the forward path (CUDA graph, the CPU decode
stack, or eager).

prepare() turns a SchedulerOutput into a StepInput of plain lists (the message a tensor-parallel
worker receives); launch() turns a StepInput into device tensors, runs the model and queues sampling;
resolve() reads the sampled tokens. The jobs live in their own modules: engine/kv_cache.py,
engine/step_input.py, engine/sampling.py, engine/attention_backends.py.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch

from picovllm.config import EngineConfig, ModelConfig, model_len
from picovllm.distributed import SINGLE, TPGroup
from picovllm.engine import kv_cache, kv_scales, pooling, sampling
from picovllm.engine.attention_backends import make_attention_backend
from picovllm.engine.cuda_graph import StagedTables
from picovllm.engine.kv_cache import lazy_zeros  # noqa: F401  (re-exported: ARCHITECTURE.md names it here)
from picovllm.engine.sampling import LaunchedStep, StepResult
from picovllm.engine.scheduler import SchedulerOutput
from picovllm.engine.step_input import (SamplingRow, StepInput, build_step_input, step_metadata,  # noqa: F401
                                        step_tensors, to_device, token_tensors)
from picovllm.kernels.cpu import prebuild_cpu_kernels, quant_gemm, small_gemm
from picovllm.layers import fp8_weights
from picovllm.layers.attention import AttentionMetadata
from picovllm.layers.logits_processors import PenaltyCounts
from picovllm.layers.packed_linear import pack_linear_weights
from picovllm.loader.engine_weights import load_model_weights
from picovllm.loader.fp8 import float8_parameters
from picovllm.loader.quantize_at_load import with_q8_0
from picovllm.loader.source import ModelSource
from picovllm.models import MODEL_REGISTRY

__all__ = ["LaunchedStep", "ModelRunner", "SamplingRow", "StepInput", "StepResult", "bind_device", "lazy_zeros"]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


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
        if config.quantization == "q8_0":
            source = with_q8_0(source, self.device, self.dtype, tp.size)
        if config.quantization == "fp8":
            fp8_weights.check_fp8_weights(source, self.device)
        if config.quantization == "bf16" and (self.device.type != "cpu" or self.dtype != torch.float32
                                              or not small_gemm.available()):
            raise ValueError("EngineConfig.quantization 'bf16' gives the CPU's float32 decode kernels bfloat16 weights: "
                             f"it needs device cpu, dtype float32 and a C compiler with AVX2, got {self.device.type}, "
                             f"{self.dtype}" + ("" if small_gemm.available() else ", no small_gemm kernel"))
        cls = MODEL_REGISTRY[source.config.architecture]
        with _default_dtype(self.dtype), torch.device(self.device):
            self.model = cls(source.config, tp)
        # a pooling engine pools the final hidden states (engine/pooling.py): it has no LM head (none is loaded, a bare
        # checkpoint has none) and runs every step eagerly (the graphs and the CPU decode stack end in the LM head)
        self.is_pooling = config.runner == "pooling"
        if self.is_pooling:
            self.model.lm_head = None
        # penalized requests' counts, kept between steps
        self.penalty_counts = PenaltyCounts(self.device, config.max_num_seqs)
        if self.device.type == "cpu" and self.dtype == torch.float32:   # a first start compiles them all at once
            attn = self.model.attention_layers()[0]
            quantized = config.quantization != "none" and source.stored_weights is not None and tp.size == 1
            prebuild_cpu_kernels((attn.num_heads, attn.num_kv_heads, attn.head_dim, config.block_size),
                                 attention=config.attention_backend in ("auto", "cpu"),
                                 stack=not config.enforce_eager and tp.size == 1 and not self.is_pooling,
                                 quantized_isa=quant_gemm.preferred_isa() if quantized else None)
        load_model_weights(self.model, source, config.disk_cache, (tp.rank, tp.size),   # packs on the CPU
                           config.quantization)
        self.model.eval()
        self.block_size = config.block_size
        self.kv_dtype = config.torch_kv_cache_dtype
        # fp8 KV: (k, v) scales of every KV head [layers, total KV heads], the same on every rank (what P and D
        # compare); each layer holds its own heads' slice (engine/kv_scales.py)
        self.kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None
        self._quantize_fp8(source)      # first: the fp8 KV cache's calibration sees the weights that run
        if config.kv_cache_dtype == "fp8":
            self.kv_scales = kv_scales.bind_calibrated(self.model, source, tp, self.device)
        self.kv_cache: torch.Tensor | None = None
        self.attn_backend = make_attention_backend(config, self.model)
        for attn in self.model.attention_layers():
            attn.backend = self.attn_backend
        self.cuda_graphs = None   # a CUDAGraphRunner once the KV cache exists (CUDA, not enforce_eager)
        self.prefill_graphs = None   # a PrefillGraphRunner beside it (EngineConfig.prefill_cuda_graphs)
        self.mixed_graphs = None   # and a MixedGraphRunner for the other prefill steps (one GPU)
        self.piecewise_graphs = None   # and a PiecewiseGraphRunner for those it does not take
        self.cpu_decode = None    # its CPU counterpart: a DecodeStack (float32, C compiler, not enforce_eager)
        self.warmup_seconds: float | None = None   # what the start-up warm-up took (EngineConfig.warmup)
        mc = self.model_config
        self.max_model_len = model_len(config.max_model_len, mc.max_position_embeddings)
        # the eager steps' block tables (step_tensors), kept from step to step; np.zeros' pages are touched only as
        # rows are written
        self.staged_tables = StagedTables(config.max_num_seqs, -(-self.max_model_len // self.block_size))

    def _quantize_fp8(self, source: ModelSource) -> None:
        """fp8 weights (layers/fp8_weights.py): quantization "fp8", every linear layer and expert, or of an FP8
        checkpoint the layers it holds in float8 (those it kept unquantized stay so, as vLLM keeps them); "auto" on a
        GPU with float8 (compute capability 8.9+) and an FP8 checkpoint of block or channel scales, the same, with
        its own codes (elsewhere its weights run dequantized, as "none")."""
        ckpt, cuda = source.fp8, self.device.type == "cuda"
        auto = (self.config.quantization == "auto" and ckpt is not None and ckpt.comes_back and cuda
                and fp8_weights.has_float8(self.device))
        if self.config.quantization != "fp8" and not auto:
            return
        fp8_weights.quantize_model_weights(
            self.model, keep_fp8=cuda, block=ckpt.block if ckpt else None, pow2_scales=bool(ckpt and ckpt.pow2_scales),
            only=float8_parameters(self.model, ckpt) if ckpt is not None else None)
        if not cuda and self.dtype == torch.float32:
            pack_linear_weights(self.model)     # the CPU's packed copies of the rounded weights

    # -- KV cache ------------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        return kv_cache.kv_bytes_per_block(self.model, self.block_size, self.kv_dtype)

    def profile_num_blocks(self) -> int:
        """How many KV blocks fit the memory budget. Rank 0, the one that samples, profiles its sampler too (and its
        penalty count table takes its full size then)."""
        counts = self.penalty_counts if self.tp.rank == 0 else None
        return kv_cache.profile_num_blocks(self.model, self.config, self.device, self.max_model_len, counts)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate the cache, then what depends on it: the warm-up steps (every kernel compiled), the decode
        step's CUDA graphs or CPU stack."""
        self.kv_cache = kv_cache.allocate_kv_cache(self.model, num_blocks, self.block_size, self.kv_dtype,
                                                   self.device)
        if self.is_pooling:
            return
        triton = getattr(self.attn_backend, "supports_cuda_graphs", False)
        if self.config.warmup or (self.config.warmup is None and triton and self.device.type == "cuda"):
            self.warm_up()
        if self.device.type == "cuda" and not self.config.enforce_eager \
                and getattr(self.attn_backend, "supports_cuda_graphs", False):
            # Under tensor parallelism every rank captures the same sizes in the same order, so the
            # collectives inside the graphs (NCCL all-reduce, all-gather) pair up at replay.
            from picovllm.engine.cuda_graph import CUDAGraphRunner
            max_blocks = -(-self.max_model_len // self.block_size)
            self.cuda_graphs = CUDAGraphRunner(self.model, self.config.max_decode_rows, max_blocks,
                                               self.block_size, self.device).capture()
            prefill_graphs = self.config.prefill_cuda_graphs
            if prefill_graphs or (prefill_graphs is None and self.tp.size == 1):   # not yet measured under TP
                from picovllm.engine.prefill_graph import PrefillGraphRunner
                self.prefill_graphs = PrefillGraphRunner(self.model, self.config.max_num_batched_tokens, max_blocks,
                                                         self.block_size, self.device).capture()
                if self.tp.size == 1 and getattr(self.attn_backend, "supports_work_lists", False):
                    from picovllm.engine.mixed_graph import MixedGraphRunner   # the other steps with a prefill
                    self.mixed_graphs = MixedGraphRunner(self.model, self.config.max_num_batched_tokens,
                                                         self.config.max_decode_rows, max_blocks, self.block_size,
                                                         self.device).capture()
                if self.tp.size == 1:      # the few it does not take: pieces around eager attention
                    from picovllm.engine.piecewise_graph import PiecewiseGraphRunner
                    self.piecewise_graphs = PiecewiseGraphRunner(self.model, self.config.max_num_batched_tokens,
                                                                 self.block_size, self.device).capture()
        if self.device.type == "cpu" and not self.config.enforce_eager and self.tp.size == 1:
            from picovllm.kernels.cpu.decode_stack import DecodeStack
            self.cpu_decode = DecodeStack.build(self.model, self.attn_backend)

    def warm_up(self) -> float:
        """Run the start-up warm-up steps (engine/warmup.py) before any graph is captured; the seconds taken.
        Under tensor parallelism every rank runs the same steps, so their collectives pair up."""
        if not getattr(self.attn_backend, "supports_cuda_graphs", False):
            # its KV store must skip slot -1 (the Triton one does, for CUDA-graph padding)
            raise ValueError(f"EngineConfig.warmup needs the triton attention backend, got "
                             f"{type(self.attn_backend).__name__}; set warmup=False")
        from picovllm.engine.warmup import plan_warmup, warm_up
        from picovllm.kernels.decode_attention import num_splits_for
        hkv = self.model.attention_layers()[0].num_kv_heads
        plan = plan_warmup(self.config.max_num_batched_tokens, self.config.max_decode_rows, self.max_model_len,
                           lambda b: num_splits_for(b, hkv) == 1)
        self.warmup_seconds = warm_up(self, plan)
        return self.warmup_seconds

    # -- one step ------------------------------------------------------------------------------
    def prepare(self, sched: SchedulerOutput, eos_token_ids: list[int]) -> StepInput:
        return build_step_input(sched, self.block_size, eos_token_ids)

    def execute(self, step: StepInput) -> StepResult:
        return self.resolve(self.launch(step))

    @torch.inference_mode()
    def launch(self, step: StepInput, prev: LaunchedStep | None = None,
               before_sampling: Callable[[], None] | None = None) -> LaunchedStep:
        """Queue the step's forward and sampling on the device without waiting for them.
        prev: the step still in flight whose sampled tokens feed this one (step.prev_dst).
        before_sampling: called between the two (see Executor.launch)."""
        prev_tokens = self.prev_tokens(step, prev.tokens if prev is not None else None)
        logits = self.compute_logits(step, prev_tokens)
        if before_sampling is not None:
            before_sampling()
        return self.launch_sampling(logits, step, prev.tokens if prev is not None else None)

    def prev_tokens(self, step: StepInput, in_flight: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(flat indices, token ids) of the input ids this step reads from the step in flight, whose
        sampled tokens are `in_flight` (on the device); None when it reads none."""
        if not step.prev_dst:
            return None
        if in_flight is None:
            raise ValueError("the step reads tokens of a step in flight (StepInput.prev_dst), but none was given")
        return (to_device(step.prev_dst, torch.long, self.device),
                in_flight[to_device(step.prev_src, torch.long, self.device)])

    def launch_sampling(self, logits: torch.Tensor | None, step: StepInput,
                        prev_tokens: torch.Tensor | None = None) -> LaunchedStep:
        """logits: compute_logits' rows, the sampled ones first, then the prompt-logprob ones (a pooling step's:
        its pooled rows, copied to the host, nothing sampled).
        prev_tokens: the in-flight step's sampled tokens (penalties count a pending output from there)."""
        if step.pooled_rows:
            return pooling.launch_pooled(logits)
        return sampling.launch_sampling(logits, step, prev_tokens, self.penalty_counts)

    @staticmethod
    def resolve(launched: LaunchedStep) -> StepResult:
        """Wait for a launched step and read its sampled tokens (the step loop's one host sync)."""
        return sampling.resolve(launched)

    @torch.inference_mode()
    def compute_logits(self, step: StepInput, prev_tokens: tuple[torch.Tensor, torch.Tensor] | None = None
                       ) -> torch.Tensor | None:
        """The forward, then the logits of the rows that sample and then of the prompt-logprob rows
        (None if there are none), in the model's dtype (sampling upcasts where it needs to). A
        decode-only step replays a CUDA graph, a one-chunk prefill step another, the other steps of at most a
        bucket's tokens a whole-step graph (engine/mixed_graph.py), or, for the few it leaves, pieces around eager
        attention (engine/piecewise_graph.py).
        prev_tokens: (flat indices, token ids) to write into the input ids on the device.
        A pooling engine's step with StepInput.pooled_rows gets those rows' sums of the final hidden states instead
        (engine/pooling.py; the forward is eager, and the hidden states are the same on every rank).

        Tensor-parallel workers stop here: they take part in the collectives; rank 0 samples."""
        if step.pooled_rows:
            ids, positions, meta, _ = step_tensors(step, self.device, staged=self.staged_tables)
            return pooling.pool_rows(self.model(ids, positions, meta), step.pooled_rows)
        plain = not step.prompt_indices     # the captured paths compute the sampled rows' logits only
        if plain and self.cuda_graphs is not None and self.cuda_graphs.fits(step):
            return self.cuda_graphs.run(step, prev_tokens)
        if plain and self.prefill_graphs is not None and self.prefill_graphs.fits(step):
            return self.prefill_graphs.run(step)
        if self.mixed_graphs is not None and self.mixed_graphs.fits(step):     # prompt logprobs too
            return self.mixed_graphs.run(step, prev_tokens)
        if plain and self.piecewise_graphs is not None and self.piecewise_graphs.fits(step):
            return self.piecewise_graphs.run(step, prev_tokens, self.staged_tables)
        ids, positions, meta, rows = step_tensors(step, self.device, prev_tokens, self.staged_tables)
        if plain and self.cpu_decode is not None and self.cpu_decode.fits(step):
            return self.cpu_decode.run(ids, positions, meta)
        hidden = self.model(ids, positions, meta)
        if not step.num_logit_rows:
            return None
        return self.model.compute_logits(hidden[rows])

    def shutdown(self) -> None:
        """Drop the CUDA graphs and, on a GPU, the KV cache: the runner steps no more. Under tensor parallelism
        the graphs hold the TP group's NCCL communicator: destroying the group while they live hangs, so every
        rank calls this before it does. The cache goes so that an engine made next in this process (a second
        LLM, a P beside a D) sizes its own from free memory, not from what this one still held."""
        if self.device.type != "cuda" or (self.cuda_graphs is None and self.kv_cache is None):
            return
        torch.cuda.synchronize(self.device)
        self.cuda_graphs = self.prefill_graphs = self.mixed_graphs = self.piecewise_graphs = None
        if self.kv_cache is not None:
            for attn in self.model.attention_layers():
                attn.k_cache = attn.v_cache = None
            self.kv_cache = None
            torch.cuda.empty_cache()

    def _metadata(self, step: StepInput) -> AttentionMetadata:
        return step_metadata(step, self.device)
