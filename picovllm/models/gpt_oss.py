"""GPT-OSS (OpenAI's gpt-oss-20b and -120b): the shared decoder (models/llama.py) with three changes.

- Attention sinks: each head's softmax also takes a learned logit (`self_attn.sinks`) of a key whose value is 0,
  so a head can attend to nothing (AttentionBackend.forward's `sinks`, in every attention path); biases on q, k, v
  and o; sliding (128) and full layers alternate (layer_types); YaRN rope.
- Every MLP is routed experts (GptOssMoE): a router with a bias, the top-k of its logits softmaxed (what the shared
  route() gives with renormalisation), experts with biases and a clamped SwiGLU (layers.activation.ClampedSwiGLU).
- The checkpoint stacks the experts, transposed, with gate and up interleaved ([E, H, 2I]: gate at even columns);
  the loader reorders them into the stacked [E, 2I, H] (gate rows, then up rows) the grouped GEMMs read.
"""
from __future__ import annotations

import torch
from torch import nn

from picovllm.config import ModelConfig
from picovllm.distributed import TPGroup
from picovllm.layers.activation import ClampedSwiGLU
from picovllm.layers.linear import RowParallelLinear, _check
from picovllm.layers.moe import FusedMoE
from picovllm.layers.rotary import RotaryEmbedding
from picovllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class GptOssAttention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding, tp: TPGroup,
                 norm_offset: float = 0.0) -> None:
        super().__init__(cfg, layer, rotary, tp, norm_offset)
        p = self.qkv_proj
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=True, tp=tp,
                                        in_shard=p.q_shard)
        # this rank's heads' sinks (the checkpoint's self_attn.sinks: checkpoint_name below), float32 whatever the
        # model's dtype: the kernels read them so (no conversion a step)
        self.attn.sinks = nn.Parameter(torch.zeros(p.num_heads, dtype=torch.float32), requires_grad=False)
        self.attn.sinks.weight_loader = self._load_sinks
        self._heads = (p.q_head_start, p.num_heads, cfg.num_attention_heads)

    def _load_sinks(self, param: nn.Parameter, w: torch.Tensor, shard: object = None, name: str = "") -> None:
        start, n, total = self._heads
        if tuple(w.shape) != (total,):
            raise ValueError(f"weight {name}: shape mismatch, model expects ({total},), checkpoint has "
                             f"{tuple(w.shape)}")
        param.data.copy_(w.narrow(0, start, n))


class GptOssMoE(FusedMoE):
    """The router (`gate`, with a bias) and the stacked experts with their biases: experts.gate_up_proj [E, 2 I/tp,
    H] and gate_up_proj_bias [E, 2 I/tp] (gate, then up), down_proj [E, H, I/tp] and down_proj_bias [E, H] (rank 0's
    only under TP: the ranks' partial sums are added up, so the bias must enter once)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        e, h = cfg.num_experts, cfg.hidden_size
        super().__init__(e, cfg.num_experts_per_tok, h, cfg.moe_intermediate_size, cfg.norm_topk_prob, tp=tp)
        self.gate = nn.Linear(h, e, bias=True)
        self.gate.requires_grad_(False)
        self.act = ClampedSwiGLU(cfg.swiglu_alpha, cfg.swiglu_limit)
        self.experts.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * self.inter), requires_grad=False)
        self.experts.down_proj_bias = nn.Parameter(torch.empty(e, h), requires_grad=False)
        for p in self.experts.parameters():        # whole stacked tensors, not one per expert
            p.__dict__.pop("shard_ids", None)
            p.weight_loader = self.load_stacked

    def expert_biases(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.experts.gate_up_proj_bias, self.experts.down_proj_bias

    def load_stacked(self, param: nn.Parameter, w: torch.Tensor, shard: object = None, name: str = "") -> None:
        e, n, r = self.num_experts, self.inter, self.tp.rank
        full, x = n * self.tp.size, self.experts
        if param is x.gate_up_proj or param is x.gate_up_proj_bias:
            want = (e, x.gate_up_proj.shape[2], 2 * full) if param is x.gate_up_proj else (e, 2 * full)
            _check(name, want, w.shape)
            w = w.transpose(1, 2) if param is x.gate_up_proj else w        # [E, 2I, H] or [E, 2I]
            gate, up = w[:, 0::2], w[:, 1::2]                              # interleaved in the checkpoint
            param.data.copy_(torch.cat([gate.narrow(1, r * n, n), up.narrow(1, r * n, n)], dim=1))
        elif param is x.down_proj:
            _check(name, (e, full, x.down_proj.shape[1]), w.shape)
            param.data.copy_(w.transpose(1, 2).narrow(2, r * n, n))        # [E, H, I]: this rank's columns
        else:
            _check(name, tuple(x.down_proj_bias.shape), w.shape)
            param.data.copy_(w if r == 0 else torch.zeros_like(w))


class GptOssDecoderLayer(LlamaDecoderLayer):
    attention_class = GptOssAttention

    @staticmethod
    def make_mlp(cfg: ModelConfig, layer: int, tp: TPGroup) -> nn.Module:
        return GptOssMoE(cfg, tp)


class GptOssForCausalLM(LlamaForCausalLM):
    layer_class = GptOssDecoderLayer

    @staticmethod
    def checkpoint_name(name: str) -> str:
        name = LlamaForCausalLM.checkpoint_name(name)
        return name.replace(".mlp.router.", ".mlp.gate.").replace(".self_attn.sinks", ".self_attn.attn.sinks")
