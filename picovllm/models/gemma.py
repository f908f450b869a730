"""Gemma 2 and Gemma 3 (text): the shared decoder (models/llama.py) with Gemma's differences.

Each layer norms the attention and MLP outputs too (pre- and post-norms), the MLP is GeGLU, norms scale by
1 + weight (added once at load), embeddings are scaled by sqrt(hidden), and scores by query_pre_attn_scalar.
Gemma 2 soft-caps attention scores and final logits and alternates sliding and global layers; Gemma 3 adds q/k
norms and gives sliding layers their own rope base (ModelConfig: rope_local_theta, sliding_layers).
"""
from __future__ import annotations

import torch

from picovllm.config import ModelConfig
from picovllm.distributed import TPGroup
from picovllm.layers.layernorm import RMSNorm
from picovllm.layers.rotary import RotaryEmbedding
from picovllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class GemmaDecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding, tp: TPGroup,
                 norm_offset: float = 0.0) -> None:
        super().__init__(cfg, layer, rotary, tp, norm_offset)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, norm_offset)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, norm_offset)

    def forward(self, positions, x, residual, meta):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(positions, x, meta))   # normed before the residual add
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class GemmaForCausalLM(LlamaForCausalLM):
    layer_class = GemmaDecoderLayer
    norm_offset = 1.0

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * torch.tensor(self.cfg.hidden_size ** 0.5, dtype=x.dtype)   # rounded to the dtype, as HF's

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else cap * torch.tanh(logits / cap)
