"""GLM-4 (GLM-4-9B-0414, GLM-Z1) and GLM-4.5 (GLM-4.5, -Air, GLM-4.6): the shared decoder (models/llama.py) under
their checkpoint names; what differs is configuration (hf_config.py: _glm_as_shared_fields, _glm).

GLM-4: each layer norms its attention and MLP outputs before the residual add, as Gemma's layer does (the same
layer, models/gemma.py, under Gemma's names: GLM's post_self_attn_layernorm is Gemma's post_attention_layernorm,
its post_attention_layernorm Gemma's pre_feedforward_layernorm, its post_mlp_layernorm Gemma's
post_feedforward_layernorm); norms scale by w, not 1 + w. q/k/v biases; half of each head rotates, its pairs
interleaved (2i, 2i + 1), reordered at load (layers/rotary.head_order); gate/up fused in the checkpoint (split at
load, loader/weights.py).

GLM-4.5: the pre-norm decoder with experts from layer first_k_dense_replace on, routed by DeepSeek-V3's rule
(layers/moe.Routing "sigmoid"), a shared expert beside them (`shared_experts` in the checkpoint), optional q/k norms,
half of each head rotating (rotate-half pairs). Its multi-token-prediction layers (num_nextn_predict_layers, at layer
indices from num_hidden_layers on) are not read (loader/hf_folder.py), as vLLM without speculative decoding.
"""
from __future__ import annotations

from picovllm.models.gemma import GemmaDecoderLayer
from picovllm.models.llama import LlamaForCausalLM

# GLM-4's layer norms -> Gemma's (applied in this order: post_attention_layernorm is renamed before it is made)
_GLM4_NORMS = ((".post_attention_layernorm.", ".pre_feedforward_layernorm."),
               (".post_self_attn_layernorm.", ".post_attention_layernorm."),
               (".post_mlp_layernorm.", ".post_feedforward_layernorm."))


class Glm4ForCausalLM(LlamaForCausalLM):
    layer_class = GemmaDecoderLayer       # with norm_offset 0 (LlamaForCausalLM's)

    @staticmethod
    def checkpoint_name(name: str) -> str:
        name = LlamaForCausalLM.checkpoint_name(name)
        for old, new in _GLM4_NORMS:
            name = name.replace(old, new)
        return name


class Glm4MoeForCausalLM(LlamaForCausalLM):
    @staticmethod
    def checkpoint_name(name: str) -> str:
        """GLM-4.5's shared experts (one MLP in the checkpoint) as the shared decoder's shared_expert."""
        return LlamaForCausalLM.checkpoint_name(name).replace(".mlp.shared_experts.", ".mlp.shared_expert.")
