"""OLMo 2, OLMo 3 and OLMoE (AllenAI): the shared decoder (models/llama.py) with OLMo's attention.

q and k are normed over the whole projection (every head's dims together, layers.layernorm.ProjectionRMSNorm),
before the heads' rotation. OLMo 2 and 3 move the layer's norms: none before attention or the MLP, each output normed
before it joins the residual stream (post_attention_layernorm, post_feedforward_layernorm); OLMo 3 is OLMo 2 with
sliding layers (layer_types; the default rope of the same base on them, hf_config.py's _ropes). OLMoE keeps the pre-norm
layer and routes each token to experts (layers/moe.py; softmax, top-k).
"""
from __future__ import annotations

import torch

from picovllm.config import ModelConfig
from picovllm.distributed import TPGroup
from picovllm.layers.layernorm import ProjectionRMSNorm, RMSNorm
from picovllm.layers.rotary import RotaryEmbedding
from picovllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Olmo2Attention(LlamaAttention):
    per_head_qk_norm = False

    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding, tp: TPGroup,
                 norm_offset: float = 0.0) -> None:
        super().__init__(cfg, layer, rotary, tp, norm_offset)
        p, d = self.qkv_proj, cfg.head_dim
        replicas = max(1, tp.size // cfg.num_key_value_heads)     # KV heads replicated when fewer than the ranks
        self.q_norm = ProjectionRMSNorm(cfg.num_attention_heads * d, p.q_head_start * d, p.num_heads * d,
                                        cfg.rms_norm_eps, tp)
        self.k_norm = ProjectionRMSNorm(cfg.num_key_value_heads * d, p.kv_head_start * d, p.num_kv_heads * d,
                                        cfg.rms_norm_eps, tp, replicas)

    def prepare_qkv(self, qkv: torch.Tensor) -> torch.Tensor:
        q, k, v = qkv.split([self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                             self.num_kv_heads * self.head_dim], dim=-1)
        return torch.cat([self.q_norm(q), self.k_norm(k), v], dim=-1)


class Olmo2DecoderLayer(LlamaDecoderLayer):
    attention_class = Olmo2Attention

    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding, tp: TPGroup,
                 norm_offset: float = 0.0) -> None:
        super().__init__(cfg, layer, rotary, tp, norm_offset)
        del self.input_layernorm                       # OLMo 2 norms outputs, not inputs
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, x, residual, meta):
        h = x if residual is None else x + residual
        h = h + self.post_attention_layernorm(self.self_attn(positions, h, meta))
        return self.post_feedforward_layernorm(self.mlp(h)), h


class Olmo2ForCausalLM(LlamaForCausalLM):
    layer_class = Olmo2DecoderLayer


class OlmoeDecoderLayer(LlamaDecoderLayer):
    attention_class = Olmo2Attention      # the pre-norm layer (experts: make_mlp) with OLMo's q/k norms


class OlmoeForCausalLM(LlamaForCausalLM):
    layer_class = OlmoeDecoderLayer
