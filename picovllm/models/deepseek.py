"""DeepSeek-V2 and -V3 (DeepseekV2ForCausalLM: DeepSeek-V2, -V2-Lite, -V2.5; DeepseekV3ForCausalLM: DeepSeek-V3, -R1,
Kimi-K2, Moonlight): the shared decoder (models/llama.py) with multi-head latent attention (MLA) in place of its
attention; the experts, the dense first layers and the ungated shared expert are configuration (hf_config.py's
_deepseek_as_shared_fields, _deepseek; V2's softmax and V3's sigmoid routing: layers/moe.Routing).

MLA: q = q_proj(x), or q_b_proj(norm(q_a_proj(x))); kv_a_proj_with_mqa(x) = [latent (kv_lora_rank), k_pe
(qk_rope_head_dim)]; kv_b_proj(norm(latent)) = each head's [k_nope (qk_nope_head_dim), v (v_head_dim)]. Each head
attends with K = [k_nope, k_pe] (k_pe one rotated vector all heads share) and V = v, by the model's scale. Here K and
V are made from the latent at every step and go to the engine's paged attention as ordinary heads (V padded with zeros
to K's head dim, or the other way round, and the output cut back): the cache holds the full K and V, not the
compressed latent (DeepSeek's, vLLM's MLA cache is ~ (kv_lora_rank + qk_rope_head_dim) / (2 H D) of it).

The rope part's pairs are interleaved (2i, 2i + 1) in the checkpoint (V2's always, V3's unless rope_interleave is
false): their rows of q's projection and of kv_a_proj_with_mqa are put in rotate-half order at load (the same order
for q and k leaves q.k as it is), so the rotary table and kernels are the ones every family uses.

The multi-token-prediction layers (num_nextn_predict_layers, at layer indices from num_hidden_layers on) are not read
(loader/hf_folder.py), as vLLM without speculative decoding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from picovllm.config import ModelConfig
from picovllm.distributed import TPGroup
from picovllm.layers.attention import Attention, AttentionMetadata
from picovllm.layers.layernorm import RMSNorm
from picovllm.layers.linear import ColumnParallelLinear, RowParallelLinear
from picovllm.layers.rotary import RotaryEmbedding, head_rows
from picovllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM

LATENT_NORM_EPS = 1e-6      # q_a_layernorm's and kv_a_layernorm's (HF's and DeepSeek's default, not rms_norm_eps)


def rotate_half_loader(load, rows_per_head: int, rope: int):
    """A weight_loader that puts the last `rope` rows of each `rows_per_head` rows (a head's rope part) from
    interleaved pairs (2i, 2i + 1) into rotate-half order (i, i + rope / 2), then loads as `load` does."""
    half = [*range(0, rope, 2), *range(1, rope, 2)]
    order = [*range(rows_per_head - rope), *(rows_per_head - rope + j for j in half)]

    def loader(param: nn.Parameter, w: torch.Tensor, shard: object = None, name: str = "") -> None:
        if len(w) % rows_per_head == 0:      # else `load` refuses the shape, naming the tensor
            w = w[head_rows(len(w), rows_per_head, order)]
        load(param, w, shard, name)
    return loader


class MLAAttention(nn.Module):
    """Multi-head latent attention, heads split across tensor-parallel ranks: q's projection (q_proj or q_b_proj) and
    kv_b_proj column-parallel by head, o_proj row-parallel; the latent projections (q_a_proj, kv_a_proj_with_mqa) and
    their norms replicated."""

    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding, tp: TPGroup,
                 norm_offset: float = 0.0) -> None:
        super().__init__()
        heads = cfg.num_attention_heads
        if heads % tp.size:
            raise ValueError(f"tensor_parallel_size {tp.size} does not divide num_attention_heads {heads}")
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_rank, qk = cfg.kv_lora_rank, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        self.num_heads = heads // tp.size
        # the cache's heads, as tp_kv and kv_scales read them off a QKVParallelLinear: this rank's of all heads
        self.kv_head_start, self.num_kv_heads, self.total_kv_heads = tp.rank * self.num_heads, self.num_heads, heads
        hidden, bias = cfg.hidden_size, cfg.attention_bias
        self.q_direct = cfg.q_lora_rank is None
        if self.q_direct:
            self.q_proj = ColumnParallelLinear(hidden, heads * qk, tp=tp)
            q_out = self.q_proj
        else:
            self.q_a_proj = ColumnParallelLinear(hidden, cfg.q_lora_rank, bias=bias)     # replicated
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, heads * qk, tp=tp)
            q_out = self.q_b_proj
        self.kv_a_proj_with_mqa = ColumnParallelLinear(hidden, self.kv_rank + self.rope, bias=bias)   # replicated
        self.kv_a_layernorm = RMSNorm(self.kv_rank, LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(self.kv_rank, heads * (self.nope + self.v_dim), tp=tp)
        self.o_proj = RowParallelLinear(heads * self.v_dim, hidden, bias=bias, tp=tp)
        if cfg.rotary_interleaved:
            q_out.weight.weight_loader = rotate_half_loader(q_out.load, qk, self.rope)
            kv_a = self.kv_a_proj_with_mqa
            for p in (kv_a.weight, kv_a.bias):
                if p is not None:
                    p.weight_loader = rotate_half_loader(kv_a.load, self.kv_rank + self.rope, self.rope)
        self.rotary = rotary
        self.head_dim = cfg.head_dim        # max(qk, v_dim): K, V and q padded to it with zeros
        self.attn = Attention(self.num_heads, self.num_heads, self.head_dim, cfg.attention_multiplier,
                                   cfg.layer_window(layer))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        h, nope, rope = self.num_heads, self.nope, self.rope
        q = self.q_proj(x) if self.q_direct else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(-1, h, nope + rope)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_rank, rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent.contiguous())).view(-1, h, nope + self.v_dim)
        q_pe, k_pe = self.rotary(positions, q[..., nope:], k_pe.reshape(-1, 1, rope))
        q = torch.cat([q[..., :nope], q_pe], dim=-1)
        k = torch.cat([kv[..., :nope], k_pe.expand(-1, h, rope)], dim=-1)
        v = kv[..., nope:]
        d = self.head_dim
        q, k, v = (_padded(t, d) for t in (q, k, v))
        o = self.attn(q, k, v, meta)[..., :self.v_dim]
        return self.o_proj(o.reshape(-1, h * self.v_dim))


def _padded(x: torch.Tensor, d: int) -> torch.Tensor:
    """[T, H, n] -> [T, H, d], zeros past n (zeros in q and k add nothing to a score, in v nothing to the output)."""
    return x if x.shape[-1] == d else F.pad(x, (0, d - x.shape[-1]))


class DeepseekDecoderLayer(LlamaDecoderLayer):
    attention_class = MLAAttention


class DeepseekForCausalLM(LlamaForCausalLM):
    packed_modules = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}    # q_proj is MLA's own
    layer_class = DeepseekDecoderLayer

    @staticmethod
    def rotary_head_dim(cfg: ModelConfig) -> int:
        return cfg.qk_rope_head_dim

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """DeepSeek's shared experts (one MLP in the checkpoint) as the shared decoder's shared_expert."""
        return LlamaForCausalLM.checkpoint_name(name).replace(".mlp.shared_experts.", ".mlp.shared_expert.")
