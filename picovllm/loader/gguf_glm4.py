"""llama.cpp's `glm4` (GLM-4-9B-0414, GLM-4-32B-0414, GLM-Z1) and `glm4moe` (GLM-4.5, GLM-4.5-Air, GLM-4.6) GGUF
architectures as Glm4ForCausalLM and Glm4MoeForCausalLM: the metadata -> ModelConfig, the tensor names -> HF's
(models/glm4.py reads them as it reads an HF folder).

What llama.cpp's converter (Glm4Model, Glm4MoeModel) wrote, read back:
- q/k rows as the checkpoint has them: llama.cpp's glm4 rope is the interleaved kind (pairs 2i, 2i + 1 within the
  rotated part, GLM-4's own), glm4moe's the rotate-half kind (GLM-4.5's); rope.dimension_count is the rotated part
  (partial_rotary_factor times head_dim). The rows are put in layers/rotary.head_order at load, as an HF folder's
  (gguf_archs.tensor_parts), quantized ones included. Only GLM-4V's M-RoPE (rope.dimension_sections) had its rows
  permuted by the converter: refused.
- GLM-4's four norms: attn_norm (input_layernorm), post_attention_norm (post_self_attn_layernorm, after attention),
  ffn_norm (post_attention_layernorm, before the MLP), post_ffw_norm (post_mlp_layernorm); its gate/up fused in
  ffn_up (gate rows first), as the checkpoint's gate_up_proj.
- GLM-4.5: post_attention_norm is its norm before the MLP (post_attention_layernorm); experts stacked per
  projection (ffn_*_exps), the shared experts as ffn_*_shexp (expert_shared_count of them: one MLP of that many
  times expert_feed_forward_length), the router as ffn_gate_inp, its correction bias as exp_probs_b.bias; the first
  leading_dense_block_count layers dense. Routing: sigmoid (expert_gating_func 2, or none: llama.cpp's default for
  glm4moe), top-k chosen by score + bias, renormalised if expert_weights_norm, scaled by expert_weights_scale; groups
  from expert_group_count / expert_group_used_count (llama.cpp reads them for any architecture; none: no limit).
- block_count counts the multi-token-prediction layers (nextn_predict_layers of them, at the end): the model has
  block_count - nextn_predict_layers layers; the MTP blocks' tensors are not read, as llama.cpp's graph skips them.
- End of generation: the eos token, and the eot and eom tokens the converter sets (<|user|>, <|observation|>), as
  HF's generation_config lists them.
"""
from __future__ import annotations

from picovllm.config import ModelConfig
from picovllm.loader.gguf_archs import Part, expert_groups, required, shared_fields, split_rows

# blk.N.<GGUF name> -> model.layers.N.<HF name> where it is not gguf_archs._LAYER's
_GLM4_LAYER = {"post_attention_norm.weight": "post_self_attn_layernorm.weight",
               "post_ffw_norm.weight": "post_mlp_layernorm.weight"}
_GLM4_MOE_LAYER = {"exp_probs_b.bias": "mlp.gate.e_score_correction_bias"}
_GLM4_POST_NORMS = ("post_attention_norm.weight", "post_ffw_norm.weight")
SIGMOID = 2                 # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


def layer_parts(name: str, prefix: str, key: str, shape: tuple[int, ...], cfg: ModelConfig) -> list[Part] | None:
    """The HF tensors of layer tensor `name` (key: its name past blk.N.) where GLM's differ from the shared names;
    nothing for an MTP block's; None for the shared names."""
    if int(name.split(".")[1]) >= cfg.num_hidden_layers:       # a multi-token-prediction block: not read
        return []
    if cfg.architecture == "Glm4ForCausalLM":
        if key == "ffn_up.weight":                              # [gate; up], as the checkpoint's gate_up_proj
            return split_rows(name, shape, prefix + "mlp.{}_proj.weight", ("gate", "up"),
                              [cfg.intermediate_size] * 2)
        hf = _GLM4_LAYER.get(key)
    else:
        hf = _GLM4_MOE_LAYER.get(key)
    return None if hf is None else [Part(prefix + hf, shape, slice(None))]


def model_config(meta: dict, tensors: dict, path: str) -> ModelConfig:
    """The ModelConfig of a glm4 or glm4moe file (tensors: {name: object with .shape, GGUF order})."""
    name = meta["general.architecture"]
    p = name + "."
    fields = shared_fields(meta, tensors, p, path)
    sections = meta.get(p + "rope.dimension_sections")
    if sections is not None and any(int(s) for s in sections):
        raise ValueError(f"GGUF {path!r}: {p}rope.dimension_sections={list(map(int, sections))}: GLM-4V's "
                         "multimodal rope (M-RoPE, its q/k rows permuted by the converter) is unsupported")
    nextn = int(meta.get(p + "nextn_predict_layers") or 0)
    layers = fields["num_hidden_layers"] - nextn
    if layers < 1:
        raise ValueError(f"GGUF {path!r}: {p}nextn_predict_layers={nextn} leaves no layer of block_count "
                         f"{fields['num_hidden_layers']}")
    fields["num_hidden_layers"] = layers
    inter = int(required(meta, p + "feed_forward_length", path))      # GLM-4.5: its dense layers'
    if name == "glm4":
        _require_tensors(tensors, range(layers), _GLM4_POST_NORMS, path, "GLM-4's norms after attention and the MLP")
        return ModelConfig(architecture="Glm4ForCausalLM", intermediate_size=inter, rotary_interleaved=True,
                           **fields)
    return ModelConfig(architecture="Glm4MoeForCausalLM", intermediate_size=inter,
                       **_routing(meta, tensors, p, layers, path), **fields)


def _require_tensors(tensors: dict, layers, keys: tuple[str, ...], path: str, why: str) -> None:
    for i in layers:
        for key in keys:
            if f"blk.{i}.{key}" not in tensors:
                raise ValueError(f"GGUF {path!r}: tensor 'blk.{i}.{key}' is missing ({why})")


def _routing(meta: dict, tensors: dict, p: str, layers: int, path: str) -> dict:
    """GLM-4.5's MoE fields of ModelConfig, as llama.cpp's glm4moe reads them (the keys it requires required here)."""
    n = int(required(meta, p + "expert_count", path))
    k = int(required(meta, p + "expert_used_count", path))
    inter = int(required(meta, p + "expert_feed_forward_length", path))
    shared = int(required(meta, p + "expert_shared_count", path))
    dense = int(meta.get(p + "leading_dense_block_count") or 0)
    gating = int(meta.get(p + "expert_gating_func") or SIGMOID)       # 0 or none: llama.cpp's sigmoid
    if gating != SIGMOID:
        raise ValueError(f"GGUF {path!r}: {p}expert_gating_func={gating}: GLM-4.5's routing is sigmoid (2) only")
    if not 0 <= dense < layers or not 0 < k <= n:
        raise ValueError(f"GGUF {path!r}: {p}leading_dense_block_count={dense} / expert_used_count={k}: need "
                         f"0 <= dense < {layers} layers and 1 <= top-k <= {n} experts")
    _require_tensors(tensors, range(dense, layers), ("ffn_gate_inp.weight", "exp_probs_b.bias"), path,
                     "a routed layer's router and the correction bias sigmoid routing chooses by")
    scale = float(required(meta, p + "expert_weights_scale", path))
    if scale <= 0:
        raise ValueError(f"GGUF {path!r}: {p}expert_weights_scale={scale}: must be > 0")
    groups, keep = expert_groups(meta, p, n, k, 2, path)
    return dict(num_experts=n, num_experts_per_tok=k, moe_intermediate_size=inter,
                norm_topk_prob=bool(meta.get(p + "expert_weights_norm", False)),
                moe_layers=[i >= dense for i in range(layers)], shared_expert_intermediate_size=shared * inter,
                shared_expert_gated=False, scoring_func="sigmoid", n_group=groups, topk_group=keep,
                routed_scaling_factor=scale)
