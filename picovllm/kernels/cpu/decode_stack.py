"""A decode-only step of a model of the shared decoder on the CPU (float32) in one C call: decode_stack.c.
Llama, Mistral, Phi-3, Qwen2/3, Gemma 2/3 (post-norms, GeGLU, soft-capped scores and logits, a rope base per
layer), Qwen3-MoE and Mixtral (the router and each expert as float32 small_gemm panels, packed here: a second copy
of the experts beside the modules' stacked tensors, which stay the reference and run every other step).

The CPU's counterpart of the CUDA graph runner: the model runner asks fits(step), and run() then returns the
step's logits without going through the torch modules, which stay the reference (and run every other step:
prefills, mixed batches, more than SMALL_M rows). One call per step instead of ~400 torch operators, and one
OpenMP region whose threads meet at barriers of their own (see decode_stack.c for why that matters).
Built once per shape; without a C compiler, AVX2 and FMA, or with a second OpenMP runtime, build() gives None.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from picovllm.kernels.cpu.build import ISA_FLAGS, compile_openmp_library, shape_defines
from picovllm.kernels.cpu.decode_attention import CpuAttentionBackend, token_batch
from picovllm.kernels.cpu.quant_gemm import QSeg, QuantizedWeight, refine_top_logits, scratch_bytes
from picovllm.kernels.cpu.small_gemm import pack_panels
from picovllm.layers.attention import AttentionMetadata
from picovllm.layers.moe import FusedMoE
from picovllm.layers.packed_linear import SMALL_M

_ptr, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
MAX_SEGS = 3   # as in decode_stack.c


class Weight(ctypes.Structure):   # as in decode_stack.c
    _fields_ = [("panels", _ptr), ("bf16", _i64), ("n_segs", _i64), ("segs", QSeg * MAX_SEGS)]


class Layer(ctypes.Structure):   # as in decode_stack.c
    _fields_ = [*[(name, _ptr) for name in ("input_norm", "qkv_bias", "q_norm", "k_norm", "post_norm")],
                *[(name, Weight) for name in ("qkv", "o", "gate_up", "down")],
                ("k_cache", _ptr), ("v_cache", _ptr), ("window", _i64),
                *[(name, _ptr) for name in ("cos_sin", "attn_out_norm", "mlp_out_norm")], ("softcap", _f32),
                ("out_scale", _f32),
                *[(name, _i64) for name in ("n_experts", "top_k", "moe_inter", "renormalize")],
                *[(name, _ptr) for name in ("router", "expert_gate_up", "expert_down")]]


class MoeScratch(ctypes.Structure):   # as in decode_stack.c
    _fields_ = [(name, _ptr) for name in ("logits", "weight", "in_", "out", "expert")]


@functools.lru_cache(maxsize=8)
def _library(shape: tuple[int, int, int, int], isa: str | None) -> ctypes.CDLL | None:
    """isa: the quantized kernels' build (its ISA_FLAGS), None for a float32-only model (-march=native)."""
    lib = compile_openmp_library("decode_stack.c", shape_defines(shape), ISA_FLAGS[isa] if isa else ())
    if lib is None:
        return None
    lib.decode_stack.argtypes = [_ptr, _i64, _i64, _i64, _f32, _f32, _ptr, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64,
                                 _ptr, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64]
    lib.decode_stack.restype = None
    return lib


def _weight(linear) -> Weight | None:
    """The linear layer's weight as decode_stack.c reads it; None if it has neither panels nor a QuantizedWeight
    of at most MAX_SEGS segments."""
    packed = getattr(linear, "packed", None)
    if isinstance(packed, QuantizedWeight):
        if len(packed.segments) > MAX_SEGS:
            return None
        w = Weight(None, 0, len(packed.segments))
        for i, seg in enumerate(packed.table):
            w.segs[i] = seg
        return w
    panels = getattr(packed, "panels", None)
    return None if panels is None else Weight(panels.data_ptr(), panels.dtype == torch.bfloat16, 0)


def _isa(model) -> str | None:
    """The quantized kernels' ISA if any linear layer of `model` is quantized."""
    return next((m.packed.isa for m in model.modules() if isinstance(getattr(m, "packed", None), QuantizedWeight)),
                None)


class DecodeStack:
    """Runs decode-only steps of `model` (the shared decoder or Gemma's, whose linear layers carry small_gemm panels
    and whose attention layers have their KV cache bound) through decode_stack.c."""

    def __init__(self, model, lib: ctypes.CDLL) -> None:
        cfg = model.cfg
        self.model, self.lib = model, lib
        self.hidden, self.inter, self.eps = cfg.hidden_size, cfg.intermediate_size, cfg.rms_norm_eps
        attn = model.layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.scale = attn.attn.scale
        self.vocab, self.gelu, self.final_cap = cfg.vocab_size, cfg.hidden_act != "silu", cfg.final_logit_softcapping
        self.logits_scaling = cfg.logits_scaling                                  # Granite's
        self.cos_sin = [layer.self_attn.rotary.cos_sin.contiguous() for layer in model.layers]   # kept alive
        self.quantized = _isa(model) is not None
        self.kmax = max(self.hidden, self.inter, self.num_heads * self.head_dim)   # the widest GEMM input
        self.lm_head = _weight(model.lm_head)
        self.layers = (Layer * len(model.layers))()
        self._panels: list[torch.Tensor] = []
        for entry, layer, cos_sin in zip(self.layers, model.layers, self.cos_sin):
            a, mlp = layer.self_attn, layer.mlp
            gemma = getattr(layer, "pre_feedforward_layernorm", None) is not None   # Gemma: outputs normed too
            pre_mlp = layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm
            tensors = {"input_norm": layer.input_layernorm.weight, "qkv_bias": a.qkv_proj.bias,
                       "q_norm": a.q_norm.weight if a.q_norm is not None else None,
                       "k_norm": a.k_norm.weight if a.k_norm is not None else None,
                       "post_norm": pre_mlp.weight,
                       "k_cache": a.attn.k_cache, "v_cache": a.attn.v_cache, "cos_sin": cos_sin,
                       "attn_out_norm": layer.post_attention_layernorm.weight if gemma else None,
                       "mlp_out_norm": layer.post_feedforward_layernorm.weight if gemma else None}
            for name, t in tensors.items():
                setattr(entry, name, None if t is None else t.data_ptr())
            entry.window = a.attn.sliding_window or 0
            entry.softcap = a.attn.softcap or 0.0
            entry.out_scale = cfg.residual_multiplier
            entry.qkv, entry.o = _weight(a.qkv_proj), _weight(a.o_proj)
            if isinstance(mlp, FusedMoE):
                self._moe(entry, mlp)
            else:
                entry.gate_up, entry.down = _weight(mlp.gate_up_proj), _weight(mlp.down_proj)
        moe = [layer.mlp for layer in model.layers if isinstance(layer.mlp, FusedMoE)]
        # MoE scratch per row: router logits, top-k weights and experts, one expert's input and output rows
        self.moe_dims = (max(m.num_experts for m in moe), max(m.top_k for m in moe),
                         max(self.hidden, 2 * max(m.inter for m in moe))) if moe else None

    def _moe(self, entry: Layer, mlp: FusedMoE) -> None:
        """A MoE layer's router and experts as panels (kept alive here)."""
        panels = [pack_panels(mlp.gate.weight),
                  torch.stack([pack_panels(w) for w in mlp.experts.gate_up_proj]).contiguous(),
                  torch.stack([pack_panels(w) for w in mlp.experts.down_proj]).contiguous()]
        self._panels += panels
        entry.n_experts, entry.top_k, entry.moe_inter = mlp.num_experts, mlp.top_k, mlp.inter
        entry.renormalize = mlp.renormalize
        entry.router, entry.expert_gate_up, entry.expert_down = (p.data_ptr() for p in panels)

    @classmethod
    def build(cls, model, backend) -> DecodeStack | None:
        """A DecodeStack for this model, or None where it does not apply (another architecture, tensor
        parallel, not float32 on the CPU, another attention backend, weights not packed, no compiler)."""
        layers = getattr(model, "layers", None)
        if not isinstance(backend, CpuAttentionBackend) or not layers or not getattr(model, "in_decode_stack", False):
            return None
        a = layers[0].self_attn
        if a.qkv_proj.tp.size != 1 or a.attn.k_cache is None or a.attn.k_cache.dtype != torch.float32 \
                or a.rotary.cos_sin.dtype != torch.float32:
            return None
        needed = [_weight(model.lm_head)]
        for layer in layers:
            a, m = layer.self_attn, layer.mlp
            mlp = [] if isinstance(m, FusedMoE) else [m.gate_up_proj, m.down_proj]
            needed += [_weight(lin) for lin in [a.qkv_proj, a.o_proj, *mlp]]
            if any(lin.bias is not None for lin in [a.o_proj, *mlp]) or a.attn.sinks is not None \
                    or (isinstance(m, FusedMoE) and m.expert_biases() != (None, None)):
                return None     # o/MLP biases, attention sinks, expert biases (GPT-OSS): not in the C stack
        if any(p is None for p in needed):
            return None
        a = layers[0].self_attn
        lib = _library((a.num_heads, a.num_kv_heads, a.head_dim, a.attn.k_cache.shape[1]), _isa(model))
        return None if lib is None else cls(model, lib)

    @staticmethod
    def fits(step) -> bool:
        """Is this step decode-only (one new token per sequence, every one sampled) and small enough?"""
        n = len(step.input_ids)
        return n == step.num_decodes == len(step.seq_lens) == len(step.sample_indices) and n <= SMALL_M

    @torch.inference_mode()
    def run(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """ids, positions [m] int64 of a decode-only step; meta its attention metadata -> logits [m, vocab]."""
        m = ids.shape[0]
        x = self.model.embed(ids).contiguous()       # Gemma's scaled
        batch = token_batch(meta)     # the tasks attention splits between threads, as CpuAttentionBackend's
        h, i, d = self.hidden, self.inter, self.head_dim
        nq, nkv = self.num_heads * d, self.num_kv_heads * d
        scratch = torch.empty(m * (2 * h + 3 * nq + 3 * nkv + 3 * i), dtype=torch.float32)   # decode_stack.c's split
        qscratch = torch.empty(scratch_bytes(m, self.kmax), dtype=torch.uint8) if self.quantized else None
        moe = None
        if self.moe_dims:
            e, k, width = self.moe_dims
            floats = torch.empty(m * (e + k + 2 * width), dtype=torch.float32)
            expert = torch.empty(m * k, dtype=torch.int32)
            moe = MoeScratch(floats.data_ptr(), floats[m * e:].data_ptr(), floats[m * (e + k):].data_ptr(),
                             floats[m * (e + k + width):].data_ptr(), expert.data_ptr())
        logits = torch.empty(m, self.vocab, dtype=torch.float32)
        slots = meta.slot_mapping.contiguous()
        positions = positions.contiguous()
        model = self.model
        self.lib.decode_stack(
            self.layers, len(self.layers), h, i, self.eps, self.scale, model.norm.weight.data_ptr(),
            ctypes.byref(self.lm_head), self.vocab, x.data_ptr(), m, positions.data_ptr(), slots.data_ptr(),
            self.gelu, batch.tables.data_ptr(), batch.tables.stride(0), batch.lens.data_ptr(),
            batch.bounds_array.data_ptr(), len(batch.bounds) - 1, scratch.data_ptr(),
            qscratch.data_ptr() if qscratch is not None else None, ctypes.byref(moe) if moe else None,
            logits.data_ptr(), torch.get_num_threads())
        if isinstance(model.lm_head.packed, QuantizedWeight):   # as ParallelLMHead.compute_logits does
            refine_top_logits(logits, scratch[m * h:2 * m * h].view(m, h), model.lm_head.packed)   # the final norm's
        if self.logits_scaling != 1.0:                          # Granite, as LlamaForCausalLM.compute_logits
            logits.div_(self.logits_scaling)
        if self.final_cap:                                      # Gemma 2, as GemmaForCausalLM.compute_logits
            logits.div_(self.final_cap).tanh_().mul_(self.final_cap)
        return logits
