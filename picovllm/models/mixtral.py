"""Mixtral: the shared decoder with routed experts (ModelConfig.num_experts), under Mixtral's checkpoint names."""
from __future__ import annotations

from picovllm.models.llama import LlamaForCausalLM

# Mixtral's names -> the shared decoder's (Qwen3-MoE's): block_sparse_moe.experts.N.w1 -> mlp.experts.N.gate_proj
_RENAMES = ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj."))


class MixtralForCausalLM(LlamaForCausalLM):
    @staticmethod
    def checkpoint_name(name: str) -> str:
        name = LlamaForCausalLM.checkpoint_name(name)
        for old, new in _RENAMES:
            name = name.replace(old, new)
        return name
