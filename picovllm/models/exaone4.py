"""EXAONE 4.0 (LG AI Research): OLMo 2's layer (models/olmo2.py: norms after attention and the MLP, none before)
with per-head q/k norms, as the shared decoder's (ModelConfig.qk_norm). Hybrid attention is configuration
(hf_config.py): sliding layers per layer_types (or sliding_window_pattern), and with a sliding_window the global layers
are NoPE (rope_layers: a rotation by angle 0); without one every layer is global and rotates.
"""
from __future__ import annotations

from picovllm.models.llama import LlamaAttention, LlamaForCausalLM
from picovllm.models.olmo2 import Olmo2DecoderLayer


class Exaone4DecoderLayer(Olmo2DecoderLayer):
    attention_class = LlamaAttention       # q_norm and k_norm over each head's dims


class Exaone4ForCausalLM(LlamaForCausalLM):
    layer_class = Exaone4DecoderLayer
