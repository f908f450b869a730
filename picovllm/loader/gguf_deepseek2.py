"""llama.cpp's `deepseek2` GGUF architecture (DeepSeek-V2, -V2-Lite, -V2.5, -V3, -R1, Kimi-K2, Moonlight) as
DeepseekV2ForCausalLM (softmax routing) or DeepseekV3ForCausalLM (sigmoid routing with a correction bias): the
metadata -> ModelConfig, the tensor names -> HF's (models/deepseek.py reads them as it reads an HF folder).

What llama.cpp's converter (DeepseekV2Model) wrote, read back:
- MLA's shapes. Newer files describe the absorbed form llama.cpp runs (head_count_kv 1, key_length kv_lora_rank +
  rope, value_length kv_lora_rank) and the heads' own in attention.key_length_mla / value_length_mla; older ones
  have only key_length (qk_nope + qk_rope) and value_length (v_head_dim). rope.dimension_count is qk_rope_head_dim;
  q goes through attn_q_a -> attn_q_a_norm -> attn_q_b when attention.q_lora_rank is there, else attn_q (V2-Lite).
- kv_b_proj: older files keep it (attn_kv_b); newer ones split each head's rows into attn_k_b (its k rows,
  transposed: [H, kv_lora_rank, nope]) and attn_v_b ([H, v, kv_lora_rank]): put back together here.
- The rope rows are not permuted by the converter (llama.cpp's deepseek2 rope is the interleaved kind, as the
  checkpoint's): each head's rope rows of q and those of kv_a_proj_with_mqa are put in rotate-half order here (so
  the config says rotary_interleaved false: the weights the model gets are rotate-half, quantized ones included).
- The routing: expert_gating_func 1 softmax (and no key at all: llama.cpp's reading of the V2 files older than it),
  2 sigmoid choosing by score + exp_probs_b (e_score_correction_bias); expert_weights_norm renormalises the top-k,
  expert_weights_scale scales them (0 or none: 1, llama.cpp's "unset"); expert_group_count / _used_count limit the
  choice to the best groups (none in the file: no limit, as llama.cpp runs it). Groups rank by their two best
  biased scores under sigmoid (V3's rule, llama.cpp's); under softmax by their best score, DeepSeek-V2's own
  group_limited_greedy (llama.cpp ranks those by their two best too: a different choice now and then).
  The first leading_dense_block_count layers are dense, the rest routed; expert_shared_count shared experts are
  one MLP of that many times expert_feed_forward_length, added ungated.
- YaRN: rope.scaling.yarn_log_multiplier is 0.1 * mscale_all_dim (the converter's); mscale is taken equal to it, as
  llama.cpp does (every released config has them equal), so cos and sin are unscaled and the scores' scale is
  qk_head_dim ** -0.5 times (0.1 * mscale_all_dim * ln(factor) + 1) squared, as HF's.
What llama.cpp reads differently from the HF model is refused or said above; the latent norms' epsilon is HF's 1e-6
(models/deepseek.py), llama.cpp's is the file's rms epsilon (1e-6 in every released config).
"""
from __future__ import annotations

import math

import numpy as np

from picovllm.config import ModelConfig
from picovllm.hf_config import scaled_context
from picovllm.layers.rotary import head_rows
from picovllm.loader.gguf_archs import Part, Slot, end_of_generation, expert_groups, required, yarn_scaling

P = "deepseek2."
GATING = {1: "softmax", 2: "sigmoid"}      # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_*

# blk.N.<GGUF name> -> model.layers.N.<HF name>: MLA's tensors and the router's correction bias (the others are
# the shared names of gguf_archs._LAYER)
_MLA_LAYER = {
    "attn_q_a.weight": "self_attn.q_a_proj.weight", "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight", "attn_q.weight": "self_attn.q_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight", "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
}


def layer_parts(name: str, prefix: str, key: str, shape: tuple[int, ...], cfg: ModelConfig) -> list[Part] | None:
    """The HF tensors of layer tensor `name` (key: its name past blk.N.) if it is one of MLA's; None for the
    names every architecture shares (norms, attn_output, the experts, the dense MLP)."""
    if key in ("attn_k_b.weight", "attn_v_b.weight"):
        return [_kv_b_share(name, prefix, key, shape, cfg)]
    hf = _MLA_LAYER.get(key)
    if hf is None:
        return None
    take: slice | np.ndarray = slice(None)
    if key in ("attn_q.weight", "attn_q_b.weight"):
        take = _rotate_half_rows(shape[0], cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.qk_rope_head_dim)
    elif key == "attn_kv_a_mqa.weight":
        take = _rotate_half_rows(shape[0], cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.qk_rope_head_dim)
    return [Part(prefix + hf, shape, take, linear=len(shape) == 2)]        # the matrices (not norms, the bias)


def _rotate_half_rows(rows: int, per_head: int, rope: int) -> np.ndarray | slice:
    """The file's rows with each head's last `rope` rows (interleaved pairs 2i, 2i + 1) in rotate-half order
    (i, i + rope / 2); the rows as they are where they are not whole heads (the model refuses the shape)."""
    if rows % per_head:
        return slice(None)
    order = [*range(per_head - rope), *(per_head - rope + j for j in (*range(0, rope, 2), *range(1, rope, 2)))]
    return head_rows(rows, per_head, order).numpy()


def _kv_b_share(name: str, prefix: str, key: str, shape: tuple[int, ...], cfg: ModelConfig) -> Part:
    """attn_k_b ([H, kv_lora_rank, nope], the k rows transposed) or attn_v_b ([H, v, kv_lora_rank]) as its rows of
    kv_b_proj ([H * (nope + v), kv_lora_rank]: each head's nope k rows, then its v rows)."""
    h, rank, nope, v = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim
    k = key == "attn_k_b.weight"
    want = (h, rank, nope) if k else (h, v, rank)
    if tuple(shape) != want:
        raise ValueError(f"GGUF tensor {name!r}: shape {tuple(shape)}, the metadata's MLA shapes need {want}")
    slot = Slot((h * (nope + v), rank), (h, nope + v, rank), (slice(None), slice(0, nope) if k else slice(nope, None)),
                0 if k else 1, 2)
    return Part(prefix + "self_attn.kv_b_proj.weight", (h, nope, rank) if k else want, slice(None), transposed=k,
                slot=slot)


# -- the metadata -----------------------------------------------------------------------------------
def model_config(meta: dict, tensors: dict, path: str) -> ModelConfig:
    """The ModelConfig of a deepseek2 file (tensors: {name: object with .shape, GGUF order})."""
    heads = int(required(meta, P + "attention.head_count", path))
    layers = int(required(meta, P + "block_count", path))
    kv_rank = int(required(meta, P + "attention.kv_lora_rank", path))
    rope = int(required(meta, P + "rope.dimension_count", path))
    mla = P + "attention.key_length_mla" in meta          # newer files: the absorbed form's lengths beside these
    qk = int(required(meta, P + ("attention.key_length_mla" if mla else "attention.key_length"), path))
    v = int(required(meta, P + ("attention.value_length_mla" if mla else "attention.value_length"), path))
    if rope % 2 or not 0 < rope < qk:
        raise ValueError(f"GGUF {path!r}: {P}rope.dimension_count={rope}: qk_rope_head_dim must be even and below "
                         f"the key length {qk}")
    q_rank = meta.get(P + "attention.q_lora_rank")
    if (q_rank is None) != ("blk.0.attn_q_a.weight" not in tensors):
        raise ValueError(f"GGUF {path!r}: {P}attention.q_lora_rank={q_rank!r} does not match the tensors (attn_q_a "
                         "with a q_lora_rank, attn_q without)")
    routing = _routing(meta, tensors, layers, path)
    scaling = _rope_scaling(meta, path)
    scale = qk ** -0.5
    if scaling is not None and scaling["factor"] > 1:
        scale *= (0.1 * scaling["mscale_all_dim"] * math.log(scaling["factor"]) + 1.0) ** 2
    inter = meta.get(P + "feed_forward_length") or routing["moe_intermediate_size"]    # the dense layers'
    if not inter:
        required(meta, P + "feed_forward_length", path)
    return ModelConfig(
        architecture="DeepseekV3ForCausalLM" if routing.get("scoring_func") == "sigmoid" else "DeepseekV2ForCausalLM",
        vocab_size=int(tensors["token_embd.weight"].shape[1]),
        hidden_size=int(required(meta, P + "embedding_length", path)),
        intermediate_size=int(inter),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,          # MLA's K and V are per head once made from the latent
        head_dim=max(qk, v),                # the cache's: the narrower of K and V padded with zeros
        rms_norm_eps=float(meta.get(P + "attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(meta.get(P + "rope.freq_base", 10000.0)),
        max_position_embeddings=scaled_context(int(meta.get(P + "context_length", 4096)), scaling),
        rope_scaling=scaling,
        tie_word_embeddings="output.weight" not in tensors,
        eos_token_ids=end_of_generation(meta),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        q_lora_rank=None if q_rank is None else int(q_rank),
        kv_lora_rank=kv_rank,
        qk_nope_head_dim=qk - rope,
        qk_rope_head_dim=rope,
        v_head_dim=v,
        attention_multiplier=scale,
        rotary_interleaved=False,           # the rope rows are put in rotate-half order at load (layer_parts)
        **routing,
    )


def _routing(meta: dict, tensors: dict, layers: int, path: str) -> dict:
    """The MoE fields of ModelConfig (zeros for a model without experts)."""
    n = int(meta.get(P + "expert_count") or 0)
    if not n:
        return dict(num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0)
    dense = int(meta.get(P + "leading_dense_block_count") or 0)
    biased = [f"blk.{i}.exp_probs_b.bias" in tensors for i in range(dense, layers)]
    gating = meta.get(P + "expert_gating_func")
    if gating is None and any(biased):
        raise ValueError(f"GGUF {path!r}: metadata key '{P}expert_gating_func' is missing, and the file has "
                         "exp_probs_b tensors (softmax or sigmoid routing?)")
    scoring = GATING.get(1 if gating is None else int(gating))
    if scoring is None:
        raise ValueError(f"GGUF {path!r}: {P}expert_gating_func={gating!r}: supported 1 (softmax), 2 (sigmoid)")
    if scoring == "softmax" and any(biased):
        raise ValueError(f"GGUF {path!r}: exp_probs_b with {P}expert_gating_func=1: a correction bias on softmax "
                         "routing is unsupported (DeepSeek-V3's is sigmoid's, expert_gating_func 2)")
    if scoring == "sigmoid" and not all(biased):
        raise ValueError(f"GGUF {path!r}: tensor 'blk.{dense + biased.index(False)}.exp_probs_b.bias' is missing "
                         "(sigmoid routing chooses by its correction bias)")
    k = int(required(meta, P + "expert_used_count", path))
    inter = int(required(meta, P + "expert_feed_forward_length", path))
    groups, keep = expert_groups(meta, P, n, k, 2 if scoring == "sigmoid" else 1, path)
    return dict(num_experts=n, num_experts_per_tok=k, moe_intermediate_size=inter,
                norm_topk_prob=bool(meta.get(P + "expert_weights_norm", False)),
                moe_layers=[i >= dense for i in range(layers)],
                shared_expert_intermediate_size=int(meta.get(P + "expert_shared_count") or 0) * inter,
                shared_expert_gated=False, scoring_func=scoring, n_group=groups, topk_group=keep,
                routed_scaling_factor=float(meta.get(P + "expert_weights_scale") or 1.0))


def _rope_scaling(meta: dict, path: str) -> dict | None:
    kind = meta.get(P + "rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind != "yarn":
        raise ValueError(f"GGUF {path!r}: {P}rope.scaling.type={kind!r}: only 'yarn' is supported for deepseek2")
    out = yarn_scaling(meta, P, path, read_elsewhere=("yarn_log_multiplier",))
    log_mul = meta.get(P + "rope.scaling.yarn_log_multiplier")
    if not log_mul:
        raise ValueError(f"GGUF {path!r}: metadata key '{P}rope.scaling.yarn_log_multiplier' is missing or 0: "
                         "DeepSeek's YaRN needs its mscale_all_dim (llama.cpp's converter writes 0.1 times it)")
    m = round(float(log_mul) / 0.1, 6)        # the converter's 0.1 undone (rounded: the file holds a float32)
    return dict(out, mscale=m, mscale_all_dim=m)
