"""Granite (IBM): the shared decoder (models/llama.py) with four scalings, from ModelConfig.

Embeddings are multiplied by embedding_multiplier; each attention and MLP output by residual_multiplier before it
joins the residual stream; the logits divided by logits_scaling and the scores scaled by attention_multiplier in
place of head_dim ** -0.5 (the shared decoder reads those two).
"""
from __future__ import annotations

import torch

from picovllm.config import ModelConfig
from picovllm.distributed import TPGroup
from picovllm.layers.rotary import RotaryEmbedding
from picovllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class GraniteDecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding, tp: TPGroup,
                 norm_offset: float = 0.0) -> None:
        super().__init__(cfg, layer, rotary, tp, norm_offset)
        self.residual_multiplier = cfg.residual_multiplier

    def forward(self, positions, x, residual, meta):
        m = self.residual_multiplier
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta) * m
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x) * m, residual


class GraniteForCausalLM(LlamaForCausalLM):
    layer_class = GraniteDecoderLayer

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.cfg.embedding_multiplier
