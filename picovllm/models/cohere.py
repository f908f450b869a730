"""Cohere (Command R, Aya) and Cohere 2 (Command R7B, Command A): the shared decoder (models/llama.py) as a parallel
block.

Each layer norms its input once (LayerNorm, no bias) and adds attention and the MLP of that one input to the
residual stream; the logits are scaled by logit_scale (ModelConfig.logits_scaling, its inverse). Rotary pairs are
interleaved in the checkpoint, reordered at load (layers/rotary.head_order). Cohere 2 slides three layers of four
and rotates only on those: its global layers are NoPE (ModelConfig.rope_layers).
"""
from __future__ import annotations

from picovllm.config import ModelConfig
from picovllm.distributed import SINGLE, TPGroup
from picovllm.layers.layernorm import LayerNorm
from picovllm.layers.rotary import RotaryEmbedding
from picovllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class CohereDecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding, tp: TPGroup,
                 norm_offset: float = 0.0) -> None:
        super().__init__(cfg, layer, rotary, tp, norm_offset)
        self.input_layernorm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)
        del self.post_attention_layernorm                # one norm: attention and the MLP read the same input
        # under tensor parallelism the two outputs' partial sums are added first, then reduced once
        self.tp = tp
        self.self_attn.o_proj.reduce = self.mlp.down_proj.reduce = False

    def forward(self, positions, x, residual, meta):
        h = x if residual is None else x + residual
        normed = self.input_layernorm(h)
        return self.tp.all_reduce(self.self_attn(positions, normed, meta) + self.mlp(normed)), h


class CohereForCausalLM(LlamaForCausalLM):
    layer_class = CohereDecoderLayer

    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__(cfg, tp)
        self.norm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)
