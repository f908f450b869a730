"""The shared decoder over a flat varlen token batch: Llama 2/3, SmolLM 1-3, Mistral, Phi-3, Qwen2, Qwen3, Seed-OSS,
ERNIE 4.5 and, with routed experts in place of the MLP, Qwen3-MoE, Mixtral, Qwen2-MoE (a shared expert beside them)
and GLM-4.5 (sigmoid, group-limited routing and a shared expert; its checkpoint names in models/glm4.py). What differs
between families is configuration (ModelConfig: q/k/v and o biases, q/k norm, sliding windows, experts and their
routing, NoPE layers, logits scaling, ...); other layer shapes are in models/gemma.py, granite.py, olmo2.py (OLMo 2
and 3, OLMoE), exaone4.py, cohere.py, glm4.py and deepseek.py (DeepSeek-V2/V3's latent attention in place of this
one's)."""
from __future__ import annotations

import functools

import torch
from torch import nn

from picovllm import kernels
from picovllm.config import ModelConfig
from picovllm.distributed import SINGLE, TPGroup
from picovllm.layers.activation import gated_activation
from picovllm.layers.attention import Attention, AttentionMetadata
from picovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from picovllm.layers.layernorm import RMSNorm
from picovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from picovllm.layers.moe import FusedMoE, Routing, SharedExpertMoE
from picovllm.layers.rotary import RotaryEmbedding


@functools.cache
def _triton_rotary():
    """kernels.rotary, imported at the first CUDA call (cached: see layers.layernorm)."""
    from picovllm.kernels import rotary
    return rotary


class LlamaAttention(nn.Module):
    per_head_qk_norm = True     # q_norm and k_norm, if any, over each head's dims (OLMo 2's: models/olmo2.py)

    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding, tp: TPGroup,
                 norm_offset: float = 0.0) -> None:
        super().__init__()
        d = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_attention_heads, cfg.num_key_value_heads,
                                          bias=cfg.attention_bias, tp=tp)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size, bias=cfg.o_proj_bias, tp=tp,
                                        in_shard=self.qkv_proj.q_shard)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, norm_offset) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, norm_offset) if cfg.qk_norm else None
        self.rotary = rotary
        scale = cfg.attention_multiplier if cfg.attention_multiplier is not None else \
            cfg.query_pre_attn_scalar ** -0.5 if cfg.query_pre_attn_scalar else None
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, scale, cfg.layer_window(layer),
                              cfg.attn_logit_softcapping)
        self.head_dim = d

    def prepare_qkv(self, qkv: torch.Tensor) -> torch.Tensor:
        """The QKV projection's output before the heads' norms and rotation (a family may change it first)."""
        return qkv

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.prepare_qkv(self.qkv_proj(x))
        if kernels.use_triton(qkv):   # q/k norm and rotary in one Triton pass over qkv (same math as the branch below)
            norm = self.q_norm is not None and self.per_head_qk_norm
            kv_write = self.attn.kv_write(meta)   # where the backend allows: the KV store in the same pass
            q, k, v = _triton_rotary().rope_qkv(positions, qkv, self.num_heads, self.num_kv_heads, self.rotary.cos_sin,
                                                self.q_norm.weight if norm else None,
                                                self.k_norm.weight if norm else None,
                                                self.q_norm.eps if norm else 0.0, kv_write)
            o = self.attn(q, k, v, meta, kv_stored=kv_write is not None)   # v: a strided view; a KV store takes it
            return self.o_proj(o.flatten(1))
        d = self.head_dim
        q, k, v = qkv.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        q, k, v = q.view(-1, self.num_heads, d), k.view(-1, self.num_kv_heads, d), v.view(-1, self.num_kv_heads, d)
        if self.q_norm is not None and self.per_head_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        o = self.attn(q, k, v, meta)   # v is a strided view of qkv; the KV store takes it as is
        return self.o_proj(o.flatten(1))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        if cfg.intermediate_size % tp.size:    # (a bare assert in the linear layers otherwise, after the spawn)
            raise ValueError(f"intermediate_size {cfg.intermediate_size} is not divisible by tensor_parallel_size "
                             f"{tp.size}")
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2,
                                                       bias=cfg.mlp_bias, tp=tp)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias, tp=tp)
        self.act = gated_activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    attention_class = LlamaAttention

    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding, tp: TPGroup,
                 norm_offset: float = 0.0) -> None:
        super().__init__()
        self.self_attn = self.attention_class(cfg, layer, rotary, tp, norm_offset)
        self.mlp = self.make_mlp(cfg, layer, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, norm_offset)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, norm_offset)

    @staticmethod
    def make_mlp(cfg: ModelConfig, layer: int, tp: TPGroup) -> nn.Module:
        """The layer's MLP: routed experts (with Qwen2-MoE's or GLM-4.5's shared one) or a dense gated MLP."""
        routing = Routing(cfg.scoring_func, cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor)
        if cfg.is_moe_layer(layer) and cfg.shared_expert_intermediate_size:     # Qwen2-MoE, GLM-4.5
            return SharedExpertMoE(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size,
                                   cfg.moe_intermediate_size, cfg.norm_topk_prob,
                                   cfg.shared_expert_intermediate_size, cfg.hidden_act, tp, routing,
                                   cfg.shared_expert_gated)
        if cfg.is_moe_layer(layer):
            return FusedMoE(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size,
                            cfg.norm_topk_prob, cfg.hidden_act, tp, routing)
        return LlamaMLP(cfg, tp)

    def forward(self, positions, x, residual, meta):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (our parameter name fragment, shard id for fused weights)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    layer_class = LlamaDecoderLayer
    norm_offset = 0.0     # Gemma: its norms scale by 1 + weight

    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.cfg = cfg
        d = self.rotary_head_dim(cfg)
        rotary = RotaryEmbedding(d, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling, cfg.rotary_dim)
        local = rotary if cfg.rope_local_theta is None else RotaryEmbedding(     # Gemma 3's sliding layers
            d, cfg.max_position_embeddings, cfg.rope_local_theta, rotary_dim=cfg.rotary_dim)
        # SmolLM3's NoPE layers: a rotation by angle 0 (every rotary path then leaves q and k as they are)
        nope = RotaryEmbedding.identity(d, len(rotary.cos_sin)) if cfg.rope_layers else None   # as long

        def layer_rotary(i: int) -> RotaryEmbedding:
            if cfg.rope_layers and not cfg.rope_layers[i]:
                return nope
            return rotary if cfg.layer_window(i) is None else local
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(self.layer_class(cfg, i, layer_rotary(i), tp, self.norm_offset)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, self.norm_offset)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @staticmethod
    def rotary_head_dim(cfg: ModelConfig) -> int:
        """The dims of a head the rotary table spans (DeepSeek's MLA: its rope part only)."""
        return cfg.head_dim

    @property
    def in_decode_stack(self) -> bool:
        """Layers the CPU's one-call decode step (kernels/cpu/decode_stack.c) runs: the shared decoder (experts
        and NoPE layers included), Gemma's (sliding windows, soft-caps, GeGLU, a rope base per layer; GLM-4's, the
        same layer) and Granite's (its scalings)."""
        from picovllm.models.gemma import GemmaForCausalLM
        from picovllm.models.glm4 import Glm4ForCausalLM
        from picovllm.models.granite import GraniteForCausalLM
        from picovllm.models.mixtral import MixtralForCausalLM
        return type(self) in (LlamaForCausalLM, GemmaForCausalLM, MixtralForCausalLM, GraniteForCausalLM,
                              Glm4ForCausalLM) \
            and not self.cfg.shared_expert_intermediate_size \
            and self.cfg.scoring_func == "softmax"     # shared experts, sigmoid routing (GLM-4.5): not in C

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x, residual = self.embed(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden)
        scaling = self.cfg.logits_scaling          # Granite's, Cohere's (1 / logit_scale)
        return logits if scaling == 1.0 else logits / scaling

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """HF checkpoint name -> our parameter name (the 'model.' prefix is dropped)."""
        return name[len("model."):] if name.startswith("model.") else name

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers]
