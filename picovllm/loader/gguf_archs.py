"""llama.cpp's GGUF architectures as picovllm models: a file's metadata -> ModelConfig, and each of its tensors -> the
HF tensors it holds (names, rows, experts).

What llama.cpp's converter changed, undone here:
- llama (Llama, Mistral, Mixtral): each q/k head's two rotary halves interleaved (llama.cpp's rope is the
  interleaved kind); a Mixtral layer's experts stacked into one [E, rows, cols] tensor per projection.
- gemma2, gemma3: every norm stored as 1 + w (Gemma's norms scale by 1 + w; the model adds the 1 back at load).
- phi3: q/k/v kept fused (attn_qkv) and gate/up fused in ffn_up, as Phi-3's checkpoints; LongRoPE's factors as
  tensors (rope_factors_short/long), read into the config, not the weights.
- qwen3moe, qwen2moe: experts stacked as Mixtral's; a layer without a router (ffn_gate_inp) is a dense MLP;
  qwen2moe's shared expert gate ([1, H] in HF) is stored as a vector.
- granite, smollm3: q/k rows interleaved as llama's; Granite's four scalings as metadata.
- olmo2: its norms after attention and the MLP (post_attention_norm, post_ffw_norm), q/k norms over the projection.
- gpt-oss: each projection's experts stacked [E, out, in] (MXFP4 blocks or floats), gate and up apart, biases
  [E, out]: put back into the checkpoint's [E, in, out] with gate and up interleaved (gate_up_proj, its bias), which
  the model reads as it reads an HF folder (models/gpt_oss.py); the router (ffn_gate_inp) and sinks as HF's.
- deepseek2 (DeepSeek-V2/V3, Kimi-K2, Moonlight): its own module, loader/gguf_deepseek2.py (MLA's shapes, kv_b_proj
  split per head in newer files, the rope rows, the routing).
- glm4, glm4moe (GLM-4-0414, GLM-Z1; GLM-4.5, -Air, 4.6): loader/gguf_glm4.py (GLM-4's post-norms and fused gate/up,
  GLM-4.5's routing, the MTP layers past the model's).
- command-r, cohere2 (Command R, Aya; Command R7B, Command A): loader/gguf_cohere.py (the LayerNorm's epsilon, the
  logit scale, Cohere 2's window and NoPE layers).
An architecture with a module of its own (Arch.module) reads its metadata there (model_config(meta, tensors, path))
and may claim its layer tensors first (layer_parts(name, prefix, key, shape, cfg): None for the shared names).
What the metadata does not say, llama.cpp's own rule decides (Gemma's query scale, Gemma 3's sliding pattern,
Qwen3-MoE's renormalised top-k, SmolLM3's NoPE on every 4th layer, GPT-OSS's SwiGLU constants and stop tokens).
Llama 3's rope scaling comes as a tensor (rope_freqs: a divisor per rotary frequency, computed by the converter from
the checkpoint's llama3 parameters), read into the config as such.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np
import torch

from picovllm.config import ModelConfig
from picovllm.hf_config import scaled_context


@dataclass(frozen=True)
class Arch:
    hf: str                         # the HF architecture (llama: Mistral with a window, Mixtral with experts)
    interleaved_qk: bool = False    # q/k rows with each head's rotary halves interleaved (llama.cpp's non-NeoX rope)
    gemma: bool = False             # norms stored as 1 + w, GeGLU, soft-caps, query scale by llama.cpp's rule
    module: str | None = None       # the loader module that reads it (gguf_deepseek2, gguf_glm4, gguf_cohere)


ARCHITECTURES = {
    "llama": Arch("LlamaForCausalLM", interleaved_qk=True),
    "qwen2": Arch("Qwen2ForCausalLM"),
    "qwen3": Arch("Qwen3ForCausalLM"),
    "qwen3moe": Arch("Qwen3MoeForCausalLM"),
    "qwen2moe": Arch("Qwen2MoeForCausalLM"),
    "olmo2": Arch("Olmo2ForCausalLM"),
    "gemma2": Arch("Gemma2ForCausalLM", gemma=True),
    "gemma3": Arch("Gemma3ForCausalLM", gemma=True),
    "phi3": Arch("Phi3ForCausalLM"),
    "granite": Arch("GraniteForCausalLM", interleaved_qk=True),
    "smollm3": Arch("SmolLM3ForCausalLM", interleaved_qk=True),
    "gpt-oss": Arch("GptOssForCausalLM"),
    "deepseek2": Arch("DeepseekV3ForCausalLM", module="gguf_deepseek2"),   # V2 (softmax routing) or V3: its gating
    "glm4": Arch("Glm4ForCausalLM", module="gguf_glm4"),
    "glm4moe": Arch("Glm4MoeForCausalLM", module="gguf_glm4"),
    "command-r": Arch("CohereForCausalLM", module="gguf_cohere"),
    "cohere2": Arch("Cohere2ForCausalLM", module="gguf_cohere"),
}


def family_module(arch: Arch):
    """The loader module of an architecture with one of its own (Arch.module), else None."""
    import importlib
    return None if arch.module is None else importlib.import_module(f"picovllm.loader.{arch.module}")

# blk.N.<GGUF name> -> model.layers.N.<HF name>
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",            # Gemma: pre_feedforward_layernorm
    "post_attention_norm.weight": "post_attention_layernorm.weight",  # Gemma
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",      # Gemma
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",     # qwen2
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",                                           # the router
    "ffn_gate_exps.weight": "mlp.experts.{}.gate_proj.weight", "ffn_up_exps.weight": "mlp.experts.{}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{}.down_proj.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",                     # Qwen2-MoE's shared expert
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",                       # [H] in the file, HF [1, H]
}
_GEMMA_LAYER = {"ffn_norm.weight": "pre_feedforward_layernorm.weight"}
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
# gpt-oss: blk.N.<GGUF name> -> (model.layers.N.<HF name>, the file's [.., out, in] transposed, interleaved (i, n))
_GPT_OSS_LAYER = {
    "attn_sinks.weight": ("self_attn.sinks", False, None),
    "attn_output.bias": ("self_attn.o_proj.bias", False, None),
    "ffn_gate_inp.weight": ("mlp.router.weight", False, None), "ffn_gate_inp.bias": ("mlp.router.bias", False, None),
    "ffn_gate_exps.weight": ("mlp.experts.gate_up_proj", True, (0, 2)),
    "ffn_up_exps.weight": ("mlp.experts.gate_up_proj", True, (1, 2)),
    "ffn_down_exps.weight": ("mlp.experts.down_proj", True, None),
    "ffn_gate_exps.bias": ("mlp.experts.gate_up_proj_bias", False, (0, 2)),
    "ffn_up_exps.bias": ("mlp.experts.gate_up_proj_bias", False, (1, 2)),
    "ffn_down_exps.bias": ("mlp.experts.down_proj_bias", False, None),
}
_IN_CONFIG = ("rope_factors_short.weight", "rope_factors_long.weight",   # Phi-3's LongRoPE factors
              "rope_freqs.weight")                                        # Llama 3's frequency divisors


@dataclass(frozen=True)
class Slot:
    """Where a part goes in an HF tensor made of `n` file tensors (this part is number `i`): whole.view(view)[index],
    `whole` of shape `shape`. GPT-OSS's gate and up: columns i, i + 2, ... of gate_up_proj; DeepSeek's attn_k_b and
    attn_v_b: each head's first qk_nope_head_dim rows of kv_b_proj, and the rest."""
    shape: tuple[int, ...]
    view: tuple[int, ...]
    index: tuple
    i: int
    n: int


@dataclass(frozen=True)
class Part:
    """One HF tensor of a file tensor (torch dimension order): `take` is rows of a 2-D one (slice or index array,
    in HF order) or an expert's index in a stacked 3-D one. With a `slot`, it is not a whole HF tensor but the
    slot's share of one (`shape` is the part's): hf_tensors assembles the slot's n parts."""
    name: str
    shape: tuple[int, ...]
    take: slice | np.ndarray | int
    minus_one: bool = False      # Gemma's norms: the file holds 1 + w
    linear: bool = False         # a dense linear layer, the embedding or the LM head: may stay quantized
    transposed: bool = False     # the last two dims swapped: GPT-OSS's experts ([E, out, in] -> the checkpoint's
                                 # [E, in, out]), DeepSeek's attn_k_b ([H, rank, nope] -> kv_b_proj's rows)
    slot: Slot | None = None     # a share of an HF tensor made of several file tensors

    def of(self, w: torch.Tensor) -> torch.Tensor:
        """This part of the file tensor `w`, dequantized to float, in the HF tensor's shape."""
        t = w[self.take] if not isinstance(self.take, np.ndarray) else w[torch.from_numpy(self.take)]
        t = t.transpose(-1, -2) if self.transposed else t
        return (t - 1 if self.minus_one else t).reshape(self.shape).contiguous()


def hf_tensors(pieces: Iterable[tuple[Part, object]]) -> Iterator[tuple[str, object]]:
    """(HF name, tensor) from (part, what part.of gave, or a quantized form) in file order: a whole part as it
    comes, a slotted one's HF tensor once its last part is in. ValueError if the parts of one never all come
    (hf_specs, on meta tensors, finds that before any weight is read)."""
    pending: dict[str, tuple[torch.Tensor, set[int]]] = {}
    for part, t in pieces:
        slot = part.slot
        if slot is None:
            yield part.name, t
            continue
        if part.name not in pending:
            pending[part.name] = (t.new_empty(slot.shape), set())
        whole, seen = pending[part.name]
        whole.view(slot.view)[slot.index] = t
        seen.add(slot.i)
        if len(seen) == slot.n:
            del pending[part.name]
            yield part.name, whole
    if pending:
        name, (_, seen) = next(iter(pending.items()))
        raise ValueError(f"the HF tensor {name!r} is made of {len(seen)} file tensor(s) only; it needs all its "
                         "parts (GPT-OSS's gate_up_proj: ffn_gate_exps and ffn_up_exps, weight and bias; DeepSeek's "
                         "kv_b_proj: attn_k_b and attn_v_b)")


def hf_specs(parts: Iterable[Part]) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of each HF tensor, in the order hf_tensors yields them from `parts` (file order)."""
    return [(name, tuple(t.shape)) for name, t in hf_tensors((p, torch.empty(p.shape, device="meta")) for p in parts)]


def tensor_parts(name: str, shape: tuple[int, ...], cfg: ModelConfig, arch: Arch) -> list[Part]:
    """The HF tensors the file tensor `name` (torch shape `shape`) holds; ValueError for a name no model reads."""
    from picovllm.layers.rotary import head_order
    parts, order = _file_parts(name, shape, cfg, arch), head_order(cfg)
    return parts if order is None else [_in_rotary_order(part, cfg, order) for part in parts]


def _in_rotary_order(part: Part, cfg: ModelConfig, head_order: list[int]) -> Part:
    """Partial rotary: q's and k's rows (and biases, per-head norms) with each head's dims in
    layers/rotary.head_order, as the HF folders' loader puts them."""
    from picovllm.layers.rotary import head_rows
    if not part.name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "q_norm.weight",
                               "k_norm.weight")):
        return part
    rows = part.shape[0]
    order = head_rows(rows, cfg.head_dim, head_order).numpy()
    start = part.take.start or 0 if isinstance(part.take, slice) else 0
    base = np.arange(start, start + rows) if isinstance(part.take, slice) else np.asarray(part.take)
    return dataclasses.replace(part, take=base[order])


def _file_parts(name: str, shape: tuple[int, ...], cfg: ModelConfig, arch: Arch) -> list[Part]:
    if name in _IN_CONFIG:
        return []
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) > 2:
        key = ".".join(parts[2:])
        family = family_module(arch)
        if family is not None and hasattr(family, "layer_parts"):
            own = family.layer_parts(name, f"model.layers.{parts[1]}.", key, shape, cfg)
            if own is not None:
                return own
        if arch.hf == "GptOssForCausalLM" and key in _GPT_OSS_LAYER:
            return [_gpt_oss_part(f"model.layers.{parts[1]}.", key, shape)]
        if arch.hf == "GptOssForCausalLM" and key.startswith("ffn_gate_up_exps."):
            raise ValueError(f"GGUF tensor {name!r}: gate and up experts fused in one tensor are unsupported "
                             "(llama.cpp's gpt-oss reads ffn_gate_exps and ffn_up_exps)")
        hf = (_GEMMA_LAYER if arch.gemma else {}).get(key, _LAYER.get(key))
        if key == "attn_qkv.weight":
            return split_rows(name, shape, f"model.layers.{parts[1]}.self_attn.{{}}_proj.weight", ("q", "k", "v"),
                              [cfg.num_attention_heads * cfg.head_dim] + [cfg.num_key_value_heads * cfg.head_dim] * 2)
        if key == "ffn_up.weight" and cfg.architecture == "Phi3ForCausalLM":      # [gate; up]
            return split_rows(name, shape, f"model.layers.{parts[1]}.mlp.{{}}_proj.weight", ("gate", "up"),
                              [cfg.intermediate_size] * 2)
        if hf is not None:
            full = f"model.layers.{parts[1]}.{hf}"
            if "{}" in full:         # experts stacked [E, rows, cols]
                return [Part(full.format(e), shape[1:], e) for e in range(shape[0])]
            if key == "ffn_gate_inp_shexp.weight" and len(shape) == 1:
                shape = (1, shape[0])
            return [Part(full, shape, _rows(full, shape[0], cfg, arch), arch.gemma and key.endswith("norm.weight"),
                         full.endswith("_proj.weight"))]
    elif name in _TOP:
        return [Part(_TOP[name], shape, slice(None), arch.gemma and name == "output_norm.weight",
                     name != "output_norm.weight")]
    raise ValueError(f"GGUF tensor {name!r}: unknown tensor name (supported architectures: "
                     f"{', '.join(ARCHITECTURES)})")


def _gpt_oss_part(prefix: str, key: str, shape: tuple[int, ...]) -> Part:
    hf, transposed, interleaved = _GPT_OSS_LAYER[key]
    if transposed:
        shape = shape[:-2] + (shape[-1], shape[-2])
    slot = None
    if interleaved is not None:      # columns i, i + n, ... of the last dim
        i, n = interleaved
        whole = shape[:-1] + (shape[-1] * n,)
        slot = Slot(whole, whole, (..., slice(i, None, n)), i, n)
    return Part(prefix + hf, shape, slice(None), transposed=transposed, slot=slot)


def split_rows(name: str, shape: tuple[int, ...], pattern: str, labels: tuple[str, ...],
               sizes: list[int]) -> list[Part]:
    """A file tensor holding several HF matrices one above the other (Phi-3's attn_qkv, its and GLM-4's ffn_up):
    each one's rows, named by `pattern` with its label."""
    if sum(sizes) != shape[0]:
        raise ValueError(f"GGUF tensor {name!r}: {shape[0]} rows, the config's shape needs {sum(sizes)}")
    bounds = np.cumsum([0] + sizes)
    return [Part(pattern.format(label), (n,) + shape[1:], slice(int(a), int(a) + n), linear=True)
            for label, n, a in zip(labels, sizes, bounds)]


def _rows(name: str, rows: int, cfg: ModelConfig, arch: Arch) -> np.ndarray | slice:
    """The file's rows in HF order: undo the interleaving of q/k rows (and biases) where llama.cpp did it."""
    if not arch.interleaved_qk or not name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
        return slice(None)
    heads = cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(0, 2, 1).reshape(-1)


# -- the metadata -----------------------------------------------------------------------------------
def required(meta: dict, key: str, path: str):
    if key not in meta:
        raise ValueError(f"GGUF {path!r}: metadata key {key!r} is missing")
    return meta[key]


# keys llama.cpp reads as one value or an array of one per layer (get_key_or_arr)
_PER_LAYER = ("attention.head_count", "attention.head_count_kv", "feed_forward_length")


def _one_value_for_all_layers(meta: dict, p: str, path: str) -> dict:
    """meta with each _PER_LAYER key given as an array (one value per layer) replaced by its one value; ValueError
    naming the key where the values differ between layers (every model here has one shape for all its layers) or
    there is not one per layer."""
    layers = meta.get(p + "block_count")
    out = dict(meta)
    for key in _PER_LAYER:
        values = meta.get(p + key)
        if not isinstance(values, (list, np.ndarray)):
            continue
        if len(set(int(v) for v in values)) != 1 or (layers is not None and len(values) != int(layers)):
            raise ValueError(f"GGUF {path!r}: {p}{key}={list(map(int, values))}: one value per layer is read only "
                             f"where there is one for each of the {p}block_count layers and all are the same")
        out[p + key] = int(values[0])
    return out


def expert_groups(meta: dict, p: str, experts: int, k: int, smallest: int, path: str) -> tuple[int, int]:
    """(n_group, topk_group) of a group-limited router (p's expert_group_count and _used_count), checked: groups of
    at least `smallest` experts (sigmoid's rule ranks a group by its two best), the kept groups holding the top-k."""
    groups = int(meta.get(p + "expert_group_count") or 1)
    if groups == 1:
        return 1, 1
    if experts % groups or experts // groups < smallest:
        raise ValueError(f"GGUF {path!r}: {p}expert_group_count={groups} must divide expert_count ({experts}) into "
                         f"groups of at least {smallest} experts")
    keep = int(required(meta, p + "expert_group_used_count", path))
    if not 1 <= keep <= groups or k > keep * (experts // groups):
        raise ValueError(f"GGUF {path!r}: {p}expert_group_used_count={keep} must be 1 .. {groups}, its groups "
                         f"holding at least expert_used_count ({k}) experts")
    return groups, keep


def model_config(meta: dict, tensors: dict, path: str) -> tuple[ModelConfig, Arch]:
    """The ModelConfig a GGUF's metadata and tensor names describe, and its architecture's conventions.
    tensors: {name: object with .shape (GGUF order, fastest dimension first) and .data}."""
    name = meta.get("general.architecture")
    if name not in ARCHITECTURES:
        raise ValueError(f"GGUF {path!r}: general.architecture={name!r} is unsupported "
                         f"(supported: {', '.join(map(repr, ARCHITECTURES))})")
    arch, p = ARCHITECTURES[name], name + "."
    splits = int(meta.get("split.count", 1))
    if splits > 1:      # this file holds only some of the tensors: a missing output.weight would read as tied
        raise ValueError(f"GGUF {path!r}: split.count={splits}: a model split over several files (gguf-split's "
                         "-0000N-of-0000M.gguf) is unsupported; merge its parts into one file first "
                         "(llama-gguf-split --merge)")
    if "token_embd.weight" not in tensors:
        raise ValueError(f"GGUF {path!r}: tensor 'token_embd.weight' is missing")
    meta = _one_value_for_all_layers(meta, p, path)
    family_reader = family_module(arch)
    if family_reader is not None:
        return family_reader.model_config(meta, tensors, path), arch
    shared = shared_fields(meta, tensors, p, path, arch.interleaved_qk, 1e6 if name == "gemma3" else 10000.0)
    heads, hidden, layers = shared["num_attention_heads"], shared["hidden_size"], shared["num_hidden_layers"]
    head_dim, scaling = shared["head_dim"], shared["rope_scaling"]
    experts = _experts(meta, tensors, p, layers, path)
    window, sliding = sliding_pattern(meta, p, name, layers, path)
    if name == "olmo2" and window:          # OLMo 3 as llama.cpp writes it: not this model's layer shape
        raise ValueError(f"GGUF {path!r}: {p}attention.sliding_window: sliding-window OLMo (OLMo 3) is unsupported")
    hf = arch.hf
    if name == "llama":
        hf = "MixtralForCausalLM" if experts["num_experts"] else "MistralForCausalLM" if window else hf
    inter = meta.get(p + "feed_forward_length") or experts["moe_intermediate_size"]   # MoE: its dense layers'
    if not inter:
        required(meta, p + "feed_forward_length", path)
    family = _gemma(meta, p, name, hidden, heads, head_dim, layers) if arch.gemma else {}   # one family's fields
    if name == "granite":
        family = {field: float(meta.get(p + key, 1.0)) for field, key in _GRANITE.items()}
        if not meta.get(p + "attention.scale"):        # llama.cpp's rule: missing or 0 is head_dim ** -0.5
            family["attention_multiplier"] = None
    elif name == "smollm3":             # llama.cpp's rule (the file does not say): every 4th layer NoPE
        family = {"rope_layers": [(i + 1) % 4 != 0 for i in range(layers)] if layers >= 4 else None}
    if name == "gpt-oss":
        family = _gpt_oss(meta, tensors, p, path)
        experts["norm_topk_prob"] = True        # llama.cpp softmaxes the top-k logits, whatever the file says
        if scaling is not None and scaling["rope_type"] == "yarn":
            # GPT-OSS's YaRN does not round its ramp's ends (OpenAI's reference, HF's config: truncate false);
            # ggml's rope does (floor/ceil), a small difference in the ramp's two end pairs: ours is the model's
            scaling["truncate"] = False
    config = ModelConfig(architecture=hf, intermediate_size=int(inter), sliding_window=window, sliding_layers=sliding,
                         **shared, **family, **experts)
    return config, arch


def shared_fields(meta: dict, tensors: dict, p: str, path: str, interleaved_qk: bool = False,
                  default_theta: float = 10000.0) -> dict:
    """The ModelConfig fields every architecture's metadata gives alike (the shape, rope, context, special tokens;
    biases and q/k norms by their tensors), under prefix `p`: those of the architectures without a module of their
    own, and a base for those with one (gguf_glm4, gguf_cohere), which replace what they read otherwise."""
    heads = int(required(meta, p + "attention.head_count", path))
    hidden = int(required(meta, p + "embedding_length", path))
    head_dim = int(meta.get(p + "attention.key_length", hidden // heads))
    rot = int(meta.get(p + "rope.dimension_count", head_dim))
    if rot != head_dim and (interleaved_qk or rot % 2 or not 0 < rot < head_dim):
        raise ValueError(f"GGUF {path!r}: {p}rope.dimension_count={rot} with head_dim {head_dim}: only full rotary "
                         "embeddings are supported here (partial ones: an even count, rotate-half architectures)")
    scaling = _rope_scaling(meta, tensors, p, path, rot)
    return dict(
        vocab_size=int(tensors["token_embd.weight"].shape[1]),
        hidden_size=hidden,
        num_hidden_layers=int(required(meta, p + "block_count", path)),
        num_attention_heads=heads,
        num_key_value_heads=int(meta.get(p + "attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(meta.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta.get(p + "rope.freq_base", default_theta)),
        max_position_embeddings=scaled_context(int(meta.get(p + "context_length", 4096)), scaling),
        rope_scaling=scaling,
        tie_word_embeddings="output.weight" not in tensors,
        eos_token_ids=end_of_generation(meta),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        rotary_dim=None if rot == head_dim else rot,
    )


# Granite's ModelConfig fields <- its metadata keys (llama.cpp's names)
_GRANITE = {"embedding_multiplier": "embedding_scale", "residual_multiplier": "residual_scale",
            "attention_multiplier": "attention.scale", "logits_scaling": "logit_scale"}


def _experts(meta: dict, tensors: dict, p: str, layers: int, path: str) -> dict:
    """Mixtral (llama with experts), Qwen3-MoE and Qwen2-MoE: the MoE fields of ModelConfig (zeros for a dense
    model)."""
    n = int(meta.get(p + "expert_count", 0))
    if not n:
        return dict(num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0)
    qwen2 = p == "qwen2moe."               # one shared expert a layer, sigmoid-gated (Qwen2-MoE)
    if int(meta.get(p + "expert_shared_count", 0)) > (1 if qwen2 else 0):
        raise ValueError(f"GGUF {path!r}: shared experts ({p}expert_shared_count) are unsupported")
    gating = int(meta.get(p + "expert_gating_func", 1))
    if gating != 1 and p != "gpt-oss.":     # gpt-oss: llama.cpp reads no gating function (softmax of the top-k)
        raise ValueError(f"GGUF {path!r}: {p}expert_gating_func={gating}: only softmax routing (1) is supported")
    routed = [f"blk.{i}.ffn_gate_inp.weight" in tensors for i in range(layers)]
    inter = meta.get(p + "expert_feed_forward_length") or required(meta, p + "feed_forward_length", path)
    return dict(num_experts=n, num_experts_per_tok=int(required(meta, p + "expert_used_count", path)),
                moe_intermediate_size=int(inter),
                # llama.cpp renormalises Mixtral's and Qwen3-MoE's top-k weights unless the file says otherwise
                # (Qwen2-MoE's it does not)
                norm_topk_prob=bool(meta.get(p + "expert_weights_norm", not qwen2)),
                moe_layers=None if all(routed) else routed,
                shared_expert_intermediate_size=int(required(meta, p + "expert_shared_feed_forward_length", path))
                if qwen2 else 0)


def sliding_pattern(meta: dict, p: str, arch: str, layers: int, path: str) -> tuple[int | None, list[bool] | None]:
    """(window, which layers slide). attention.sliding_window_pattern: a bool per layer (True: sliding), or a period
    n (every n-th layer global); without it, llama.cpp's rules: Gemma 2 and GPT-OSS every other layer from the
    first, Gemma 3 a period of 6, Cohere 2 of 4, the others every layer. As llama.cpp's set_swa_pattern, a period
    of 0 makes every layer slide and one of 1 none."""
    window = meta.get(p + "attention.sliding_window")
    if not window:
        return None, None
    default = {"gemma2": 2, "gemma3": 6, "gpt-oss": 2, "cohere2": 4}.get(arch)
    pattern = meta.get(p + "attention.sliding_window_pattern", default)
    if pattern is None:
        return int(window), None
    if isinstance(pattern, (int, np.integer)):
        sliding = [int(pattern) == 0 or (i + 1) % int(pattern) != 0 for i in range(layers)]   # 1: none slides
    else:
        sliding = [bool(s) for s in pattern]
        if len(sliding) != layers:
            raise ValueError(f"GGUF {path!r}: {p}attention.sliding_window_pattern has {len(sliding)} values, one per "
                             f"layer of {layers}")
    return (int(window), sliding) if any(sliding) else (None, None)


def _gpt_oss(meta: dict, tensors: dict, p: str, path: str) -> dict:
    """GPT-OSS's fields. Its clamped SwiGLU's constants are llama.cpp's (build_moe_ffn's LLM_FFN_SWIGLU_OAI_MOE:
    alpha 1.702, limit 7, every released model's; the file has none). What llama.cpp's gpt-oss would read and this
    model cannot do is refused: attention without sinks or biases, another rope base on the sliding layers, scaled
    routing weights."""
    required(meta, p + "expert_count", path)
    for key in ("blk.0.attn_sinks.weight", "blk.0.attn_q.bias", "blk.0.attn_output.bias"):
        if key not in tensors:
            raise ValueError(f"GGUF {path!r}: tensor {key!r} is missing (GPT-OSS's attention has sinks and biases)")
    base = meta.get(p + "rope.freq_base_swa")
    if base is not None and float(base) != float(meta.get(p + "rope.freq_base", 10000.0)):
        raise ValueError(f"GGUF {path!r}: {p}rope.freq_base_swa={base!r}: another rope base on the sliding layers "
                         "is unsupported for gpt-oss")
    scale = meta.get(p + "expert_weights_scale")
    if scale is not None and float(scale) not in (0.0, 1.0):       # 0: llama.cpp's "unset"
        raise ValueError(f"GGUF {path!r}: {p}expert_weights_scale={scale!r}: scaled routing weights are unsupported")
    return dict(swiglu_alpha=1.702, swiglu_limit=7.0)


_GPT_OSS_STOPS = ("<|return|>", "<|call|>", "<|endoftext|>")
# control tokens that end a reply by their text, as llama.cpp reads a GGUF's vocabulary (llama-vocab.cpp: a file's
# eos is often the base model's <|endoftext|> where the chat template ends turns with another token)
_END_TEXTS = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
              "<EOT>", "_<EOT>", "<end_of_utterance>")
_CONTROL = 3      # tokenizer.ggml.token_type's control-token type


def end_of_generation(meta: dict) -> list[int]:
    """The tokens that end generation, as llama.cpp takes them: the file's eos, its eot and eom tokens, and the
    control tokens whose text ends a turn (_END_TEXTS; gpt-oss's <|end|> ends a message, not a reply: left out); for
    gpt-oss also _GPT_OSS_STOPS, whatever their token type."""
    ids = [int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                  "tokenizer.ggml.eom_token_id") if meta.get(k) is not None]
    tokens = meta.get("tokenizer.ggml.tokens")
    types = meta.get("tokenizer.ggml.token_type")
    gpt_oss = meta.get("general.architecture") == "gpt-oss"
    texts = {t for t in _END_TEXTS if not (t == "<|end|>" and gpt_oss)}
    if tokens is not None and types is not None:
        ids += [i for i, t in enumerate(tokens) if t in texts and i < len(types) and int(types[i]) == _CONTROL]
    if gpt_oss and tokens is not None:
        index = {t: i for i, t in enumerate(tokens) if t in _GPT_OSS_STOPS}
        ids += [index[t] for t in _GPT_OSS_STOPS if t in index]
    return list(dict.fromkeys(ids))


def _gemma(meta: dict, p: str, arch: str, hidden: int, heads: int, head_dim: int, layers: int) -> dict:
    """Gemma's ModelConfig fields. The query scale: attention.scale if the file has it, else llama.cpp's rule
    (the 27B models, 46 or 62 layers, scale by hidden / heads, the others by head_dim)."""
    scale = meta.get(p + "attention.scale")
    if scale:
        scalar = float(scale) ** -2
    else:
        scalar = hidden / heads if layers == {"gemma2": 46, "gemma3": 62}[arch] else head_dim
    caps = {k: float(meta[p + k]) if meta.get(p + k) else None
            for k in ("attn_logit_softcapping", "final_logit_softcapping")}
    if arch == "gemma3":      # Gemma 3 caps no attention scores (its q/k norms instead): llama.cpp's and HF's models
        caps["attn_logit_softcapping"] = None
    local = float(meta.get(p + "rope.freq_base_swa", 10000.0)) if arch == "gemma3" else None
    return dict(hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=scalar, rope_local_theta=local, **caps)


def _rope_scaling(meta: dict, tensors: dict, p: str, path: str, rotary_dim: int) -> dict | None:
    """Linear scaling (Gemma 3's global layers), YaRN (Qwen's long-context setting), Phi-3's LongRoPE or Llama 3's
    frequency divisors (both factors are tensors of the file). Without rope.scaling.type, llama.cpp's rule: linear,
    by rope.scaling.factor or older files' rope.scale_linear (none where neither is there, or it is 0)."""
    factor = meta.get(p + "rope.scaling.factor", meta.get(p + "rope.scale_linear"))
    kind = meta.get(p + "rope.scaling.type", "linear" if factor else "none")
    if "rope_freqs.weight" in tensors:
        factors = _vector(tensors["rope_freqs.weight"])
        if len(factors) != rotary_dim // 2:
            raise ValueError(f"GGUF {path!r}: tensor 'rope_freqs.weight' has {len(factors)} values, the rotary "
                             f"embedding has {rotary_dim // 2} frequencies")
        if kind != "none" or "rope_factors_long.weight" in tensors:
            raise ValueError(f"GGUF {path!r}: tensor 'rope_freqs.weight' with another rope scaling "
                             f"({p}rope.scaling.type={kind!r}) is unsupported")
        return {"rope_type": "freq_factors", "factors": factors}
    if "rope_factors_long.weight" in tensors:
        factors = {k: _vector(tensors[f"rope_factors_{k}.weight"]) for k in ("short", "long")}
        orig = int(required(meta, p + "rope.scaling.original_context_length", path))
        ctx = int(meta.get(p + "context_length", orig))
        out = {"rope_type": "longrope", "short_factor": factors["short"], "long_factor": factors["long"],
               "original_max_position_embeddings": orig, "factor": ctx / orig}
        if meta.get(p + "rope.scaling.attn_factor"):
            out["attention_factor"] = float(meta[p + "rope.scaling.attn_factor"])
        return out
    if kind == "none":
        return None
    if kind == "yarn":
        return yarn_scaling(meta, p, path)
    if kind != "linear":
        raise ValueError(f"GGUF {path!r}: {p}rope.scaling.type={kind!r}: only 'linear', 'yarn' (and Phi-3's "
                         "LongRoPE factors) are supported")
    if factor is None:
        required(meta, p + "rope.scaling.factor", path)
    return {"rope_type": "linear", "factor": float(factor)} if factor else None       # llama.cpp: 0 is unscaled


# YaRN's keys past the factor and original context that change llama.cpp's rotation, with their neutral values
# (yarn_ext_factor: -1 is llama.cpp's "the default", 1); another value is refused rather than ignored
_YARN_NEUTRAL = {"yarn_ext_factor": (-1.0, 1.0), "yarn_attn_factor": (1.0,), "attn_factor": (1.0,),
                 "yarn_log_multiplier": (0.0,)}


def yarn_scaling(meta: dict, p: str, path: str, read_elsewhere: tuple[str, ...] = ()) -> dict:
    """The HF form of a file's YaRN (llama.cpp's converter writes Qwen's as type, factor and original context).
    read_elsewhere: keys of _YARN_NEUTRAL the caller reads itself (deepseek2's yarn_log_multiplier)."""
    out = {"rope_type": "yarn", "factor": float(required(meta, p + "rope.scaling.factor", path)),
           "original_max_position_embeddings": int(required(meta, p + "rope.scaling.original_context_length", path))}
    for key, field in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        if meta.get(p + "rope.scaling." + key) is not None:
            out[field] = float(meta[p + "rope.scaling." + key])
    for key, neutral in _YARN_NEUTRAL.items():
        value = meta.get(p + "rope.scaling." + key)
        if key not in read_elsewhere and value is not None and float(value) not in neutral:
            raise ValueError(f"GGUF {path!r}: {p}rope.scaling.{key}={value!r} is unsupported (YaRN with its default "
                             "attention factor only)")
    return out


def _vector(t) -> list[float]:
    import gguf
    return np.asarray(gguf.quants.dequantize(t.data, gguf.GGMLQuantizationType(t.ggml_type)),
                      dtype=np.float64).reshape(-1).tolist()
