"""An HF checkpoint's config.json read into ModelConfig's fields (ModelConfig.from_hf_dict is the entry): the
supported architectures, each family's fields and the defaults transformers' config classes fill in, the rope scaling
(and the context it allows), the quantized checkpoints read; what is unsupported is refused naming the field."""
from __future__ import annotations

import math
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM",
                           "MixtralForCausalLM", "GraniteForCausalLM", "SmolLM3ForCausalLM", "Qwen2MoeForCausalLM",
                           "Olmo2ForCausalLM", "CohereForCausalLM", "Cohere2ForCausalLM", "GptOssForCausalLM",
                           "Glm4ForCausalLM", "Glm4MoeForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
                           "Olmo3ForCausalLM", "OlmoeForCausalLM", "SeedOssForCausalLM", "Exaone4ForCausalLM",
                           "Ernie4_5ForCausalLM")
# A checkpoint saved as the bare decoder (no LM head; tensors without the "model." prefix), as sentence-transformers
# saves an embedding model (Qwen3-Embedding, e5-mistral): read as its causal LM's architecture, for pooling only
BARE_MODELS = {"LlamaModel": "LlamaForCausalLM", "MistralModel": "MistralForCausalLM",
               "Qwen2Model": "Qwen2ForCausalLM", "Qwen3Model": "Qwen3ForCausalLM"}
COHERE = ("CohereForCausalLM", "Cohere2ForCausalLM")
GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
GLM = ("Glm4ForCausalLM", "Glm4MoeForCausalLM")
DEEPSEEK = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
DEFAULT_MAX_POSITION = 4096     # a config.json's max_position_embeddings left out


def model_config_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """A config.json (parsed) as ModelConfig's keyword arguments: its architecture's fields read as HF's config
    class reads them, transformers' defaults where it leaves one out; an unsupported value refused naming the
    field."""
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    bare = arch in BARE_MODELS
    arch = BARE_MODELS.get(arch, arch)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"config.json architectures={archs!r}: unsupported architecture; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)} (and, for pooling, "
                         f"{', '.join(BARE_MODELS)})")
    _check_quantization(cfg, arch)
    cfg = _with_family_defaults(cfg, arch)
    cfg = _glm_as_shared_fields(cfg, arch)
    cfg = _deepseek_as_shared_fields(cfg, arch)
    heads, layers = cfg["num_attention_heads"], cfg["num_hidden_layers"]
    rope, local_rope = _ropes(cfg)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    if head_dim % 2:
        raise ValueError(f"config.json head_dim {head_dim}: rotary embeddings need an even head_dim")
    partial = cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor"))
    partial = 1.0 if partial is None else partial
    if partial != 1.0 and arch not in ("Phi3ForCausalLM", *GLM):   # HF's other families rotate every dim anyway
        raise ValueError(f"config.json partial_rotary_factor={partial!r}: only Phi-3's (Phi3ForCausalLM) and "
                         "GLM-4's (Glm4ForCausalLM, Glm4MoeForCausalLM) partial rotary is supported")
    rotary_dim = int(head_dim * partial)      # as HF computes it
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ValueError(f"config.json partial_rotary_factor={partial!r}: rotates {rotary_dim} of head_dim "
                         f"{head_dim}; it must rotate an even number of dimensions, at least 2")
    if local_rope is not None and _rope_scaling(local_rope) is not None:
        raise ValueError("config.json rope_parameters.sliding_attention: only the default rope is supported "
                         "on sliding layers")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("config.json use_bidirectional_attention=true: only causal attention is supported")
    act_field = "hidden_activation" if cfg.get("hidden_activation") else "hidden_act"   # Gemma's name, others'
    act = cfg.get(act_field) or "silu"
    if act not in ACTIVATIONS:
        raise ValueError(f"config.json {act_field}={act!r}: supported: {', '.join(ACTIVATIONS)}")
    eos = cfg.get("eos_token_id")
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    window, sliding = _sliding_window(cfg, arch, layers)
    gemma = arch in GEMMA
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    scaling = _rope_scaling(rope, cfg)
    return dict(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.get("layer_norm_eps", 1e-5) if arch in COHERE else      # the one field HF's Cohere reads
        cfg.get("rms_norm_eps", 1e-5 if arch == "Olmo2ForCausalLM" else 1e-6),       # HF's defaults
        rope_theta=rope.get("rope_theta", _DEFAULT_THETA.get(arch, 10000.0)),
        max_position_embeddings=scaled_context(cfg.get("max_position_embeddings", DEFAULT_MAX_POSITION),
                                               scaling),
        tie_word_embeddings=cfg.get("tie_word_embeddings", gemma or arch in COHERE),   # HF's defaults
        rope_scaling=scaling,
        attention_bias=_qkv_bias(cfg, arch),
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM", "Exaone4ForCausalLM")
        or (arch == "Glm4MoeForCausalLM" and bool(cfg.get("use_qk_norm"))),
        eos_token_ids=eos,
        bos_token_id=cfg.get("bos_token_id"),
        hidden_act=act,
        sliding_window=window,
        sliding_layers=sliding,
        rope_local_theta=None if local_rope is None else local_rope.get("rope_theta", 10000.0),
        query_pre_attn_scalar=cfg.get("query_pre_attn_scalar") if gemma else None,
        # Gemma 3's HF attention never reads its config's attn_logit_softcapping (only Gemma 2's caps scores)
        attn_logit_softcapping=cfg.get("attn_logit_softcapping") if arch == "Gemma2ForCausalLM" else None,
        final_logit_softcapping=cfg.get("final_logit_softcapping") if gemma else None,
        num_experts=experts,
        num_experts_per_tok=cfg.get("num_experts_per_tok", 0) if experts else 0,
        moe_intermediate_size=cfg.get("moe_intermediate_size") or cfg["intermediate_size"] if experts else 0,
        norm_topk_prob=arch in ("MixtralForCausalLM", "GptOssForCausalLM")
        or bool(cfg.get("norm_topk_prob", False)),
        moe_layers=_moe_layers(cfg, layers) if experts else None,
        shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size") or 0 if experts else 0,
        rope_layers=_rope_layers(cfg, arch, layers, sliding),
        rotary_dim=None if rotary_dim == head_dim else rotary_dim,
        has_lm_head=not bare,
        **_matryoshka(cfg),
        **_o_proj_bias(cfg, arch),
        **_mlp_bias(cfg, arch),
        **_granite(cfg, arch),
        **_cohere(cfg, arch),
        **_gpt_oss(cfg, arch),
        **_glm(cfg, arch),
        **_deepseek(cfg, arch, scaling),
        **_olmo(cfg, arch, heads),
        **_seed_oss(cfg, arch),
        **_ernie(cfg, arch),
    )


def _ropes(cfg: dict[str, Any]) -> tuple[dict, dict | None]:
    """(the global layers' rope parameters, Gemma 3's and OLMo 3's sliding layers' or None): rope_theta and
    rope_scaling as HF configs before 5.0 wrote them (Gemma 3: rope_local_base_freq), or rope_parameters (per layer
    type)."""
    params = cfg.get("rope_parameters") or {}
    arch = (cfg.get("architectures") or [None])[0]
    if "full_attention" in params:     # per layer type (Gemma 3, OLMo 3); a base left out is HF's
        full, sliding = dict(params["full_attention"]), dict(params.get("sliding_attention") or {})
        if "rope_theta" in cfg:
            full.setdefault("rope_theta", cfg["rope_theta"])
        sliding.setdefault("rope_theta", cfg.get("rope_local_base_freq", 10000.0) if arch == "Gemma3ForCausalLM"
                           else _DEFAULT_THETA.get(arch, 10000.0))
        return full, sliding
    # as HF's config classes read them: a rope_scaling (the old name) replaces rope_parameters whole, and the rope
    # dict's own rope_theta is taken over the top-level one
    rope = dict(cfg.get("rope_scaling") or params)
    if "rope_theta" in cfg:
        rope.setdefault("rope_theta", cfg["rope_theta"])
    if arch == "Phi3ForCausalLM" and rope.get("rope_type", rope.get("type")) == "yarn":
        rope["rope_type"] = "longrope"    # HF's Phi3Config reads Phi-3's old name "yarn" as LongRoPE
    if arch == "Olmo3ForCausalLM":     # its sliding layers: the same base, never scaled (HF's rope_scaling is the
        return rope, {"rope_theta": rope.get("rope_theta", _DEFAULT_THETA[arch])}   # full layers' only)
    local = {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)} if arch == "Gemma3ForCausalLM" else None
    return rope, local


# the families whose sliding window is switched on by use_sliding_window (transformers' default: off)
_USE_SLIDING_WINDOW = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
                       "SmolLM3ForCausalLM")


# the families whose HF attention has no sliding window: a sliding_window (or layer_types) in their config.json, as
# some Llama conversions of Mistral models carry, is not read
_NO_SLIDING_WINDOW = ("LlamaForCausalLM", "GraniteForCausalLM", "Olmo2ForCausalLM", "OlmoeForCausalLM",
                      "CohereForCausalLM", "Glm4ForCausalLM", "Glm4MoeForCausalLM", "SeedOssForCausalLM",
                      "Ernie4_5ForCausalLM", *DEEPSEEK)


def _sliding_window(cfg: dict[str, Any], arch: str, layers: int) -> tuple[int | None, list[bool] | None]:
    """(window, which layers slide): HF's rules per family. Mistral, Mixtral, Phi-3: every layer; Qwen2, Qwen3: with
    use_sliding_window (off unless set, as in transformers' configs), the layers from max_window_layers (default 28)
    on; Qwen3-MoE: with it, every layer; Gemma 2: every other layer, from the first; Gemma 3, Cohere 2, EXAONE 4: all
    but every sliding_window_pattern-th; OLMo 3: all but every 4th; _NO_SLIDING_WINDOW's: none. A config's layer_types
    overrides the rule (but Qwen3-MoE's, which HF's model does not read)."""
    types = cfg.get("layer_types")
    if types is not None and (not isinstance(types, list) or len(types) != layers):    # HF's config refuses it too
        got = f"{len(types)} entries" if isinstance(types, list) else repr(types)
        raise ValueError(f"config.json layer_types: {got} for {layers} layers (one type per layer)")
    window, use = cfg.get("sliding_window"), cfg.get("use_sliding_window")
    if window is None or use is False or (arch in _USE_SLIDING_WINDOW and not use) or arch in _NO_SLIDING_WINDOW:
        return None, None
    if arch == "Qwen3MoeForCausalLM":
        return int(window), [True] * layers
    if types is None and arch in ("Qwen2MoeForCausalLM", "SmolLM3ForCausalLM"):
        raise ValueError(f"config.json use_sliding_window without layer_types: which layers of {arch} slide is not "
                         "read from this config (give layer_types)")
    if types is not None:
        unknown = [t for t in types if t not in ("full_attention", "sliding_attention")]
        if unknown:
            raise ValueError(f"config.json layer_types: {unknown[0]!r} layers are unsupported (only full_attention "
                             "and sliding_attention)")
        sliding = [t == "sliding_attention" for t in types]
    elif arch == "Gemma2ForCausalLM":
        sliding = [i % 2 == 0 for i in range(layers)]
    elif arch in ("Gemma3ForCausalLM", "Cohere2ForCausalLM", "Exaone4ForCausalLM"):   # every pattern-th global
        default = 6 if arch == "Gemma3ForCausalLM" else 4
        pattern = cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", default))
        if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 1:   # EXAONE's "LLLG" form
            raise ValueError(f"config.json sliding_window_pattern={pattern!r} without layer_types: only an int "
                             "pattern is read (give layer_types)")
        sliding = [(i + 1) % pattern != 0 for i in range(layers)]
    elif arch == "Olmo3ForCausalLM":
        sliding = [(i + 1) % 4 != 0 for i in range(layers)]
    elif arch.startswith("Qwen"):
        sliding = [i >= cfg.get("max_window_layers", 28) for i in range(layers)]
    else:
        sliding = [True] * layers
    return (int(window), sliding) if any(sliding) else (None, None)


def _rope_layers(cfg: dict[str, Any], arch: str, layers: int, sliding: list[bool] | None) -> list[bool] | None:
    """SmolLM3: no_rope_layers holds 1 for a layer with rotary embeddings, 0 for a NoPE one (None: all rotate).
    Cohere 2: only the sliding layers rotate; EXAONE 4 too, once it has a sliding_window (without one, every layer
    rotates; with one and no sliding layer, none does, as HF's)."""
    if arch == "Cohere2ForCausalLM":
        return None if sliding is None or all(sliding) else list(sliding)
    if arch == "Exaone4ForCausalLM":
        if cfg.get("sliding_window") is None:
            return None
        flags = sliding or [False] * layers          # None here: no layer slides
        return None if all(flags) else list(flags)
    if arch != "SmolLM3ForCausalLM":
        return None
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = cfg.get("no_rope_layer_interval", 4)
        flags = [(i + 1) % interval != 0 for i in range(layers)]
    if len(flags) != layers:
        raise ValueError(f"config.json no_rope_layers has {len(flags)} entries for {layers} layers")
    flags = [bool(f) for f in flags]
    return None if all(flags) else flags


def _matryoshka(cfg: dict[str, Any]) -> dict[str, Any]:
    """is_matryoshka and matryoshka_dimensions (vLLM's reading: a list of dimensions makes a model Matryoshka)."""
    dims = cfg.get("matryoshka_dimensions")
    if dims is not None and (not isinstance(dims, list) or not all(isinstance(d, int) and d >= 1 for d in dims)):
        raise ValueError(f"config.json matryoshka_dimensions must be a list of ints >= 1, got {dims!r}")
    return dict(is_matryoshka=bool(cfg.get("is_matryoshka")) or dims is not None, matryoshka_dimensions=dims)


# Where HF's attention reads attention_bias (config.json may hold it for any family; HF's own classes decide): these
# families' q/k/v never take it (Qwen2's always have biases, Qwen2-MoE's follow qkv_bias, ERNIE's use_bias) ...
_QKV_BIAS_FIXED = ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM", "Exaone4ForCausalLM",
                   "Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "Ernie4_5ForCausalLM")
# ... and these put it on o_proj too (OLMo's and Seed-OSS's in _olmo and _seed_oss; GPT-OSS's and DeepSeek's models
# read attention_bias themselves)
_O_BIAS_FROM_ATTENTION_BIAS = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma2ForCausalLM",
                               "Gemma3ForCausalLM", "GraniteForCausalLM", "SmolLM3ForCausalLM", "CohereForCausalLM",
                               "Cohere2ForCausalLM")
# the families whose HF MLP takes mlp_bias (gate, up and down) and whose MLP biases are read; the others' HF MLPs
# have none whatever it says (Granite's and Seed-OSS's are refused in _granite and _seed_oss)
_MLP_BIAS = ("LlamaForCausalLM", "SmolLM3ForCausalLM")


def _qkv_bias(cfg: dict[str, Any], arch: str) -> bool:
    """Whether q, k and v have biases, as HF's attention of the family decides."""
    if arch == "Qwen2ForCausalLM":
        return True
    if arch == "Qwen2MoeForCausalLM":
        return bool(cfg.get("qkv_bias", True))
    return arch not in _QKV_BIAS_FIXED and bool(cfg.get("attention_bias", False))


def _o_proj_bias(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """o_proj's bias where HF's o_proj takes attention_bias (Llama, Qwen3, Gemma, Granite, SmolLM3, Cohere)."""
    return dict(o_proj_bias=bool(cfg.get("attention_bias", False))) if arch in _O_BIAS_FROM_ATTENTION_BIAS else {}


def _mlp_bias(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """mlp_bias where HF's MLP takes it; DeepSeek-V2's (its dense and shared-expert MLPs) is refused."""
    if arch == "DeepseekV2ForCausalLM" and cfg.get("mlp_bias"):
        raise ValueError("config.json mlp_bias=true: DeepSeek-V2's MLP biases are unsupported")
    return dict(mlp_bias=bool(cfg.get("mlp_bias", False))) if arch in _MLP_BIAS else {}


def _granite(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """Granite's four scalings (HF's defaults where a field is missing; the others' neutral values)."""
    if arch != "GraniteForCausalLM":
        return {}
    if cfg.get("mlp_bias"):
        raise ValueError("config.json mlp_bias=true: only MLPs without biases are supported")
    return dict(attention_multiplier=float(cfg.get("attention_multiplier", 1.0)),
                embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
                residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
                logits_scaling=float(cfg.get("logits_scaling", 1.0)))


def _cohere(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """Cohere's interleaved rotary pairs and logit scale; its q/k LayerNorms (use_qk_norm) are refused."""
    if arch not in COHERE:
        return {}
    if cfg.get("use_qk_norm"):
        raise ValueError("config.json use_qk_norm=true: Cohere's q/k norms are unsupported")
    return dict(rotary_interleaved=True, logits_scaling=1.0 / float(cfg.get("logit_scale") or 0.0625))   # HF's


def _gpt_oss(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """GPT-OSS: its SwiGLU's constants (its routing, the top-k logits softmaxed, is softmax, top-k, renormalised;
    its o_proj bias and sinks are the model's own: models/gpt_oss.py)."""
    if arch != "GptOssForCausalLM":
        return {}
    if not cfg.get("attention_bias", True):
        raise ValueError("config.json attention_bias=false: GPT-OSS's attention without biases is unsupported")
    return dict(swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)), swiglu_limit=float(cfg.get("swiglu_limit", 7.0)))


# transformers' defaults of the fields a config.json of these families may leave out (HF's save_pretrained writes only
# the fields that differ from them) where they differ from the shared ones; rope_theta's: _DEFAULT_THETA
_FAMILY_DEFAULTS = {       # transformers' config classes' defaults where they differ from the generic ones
    # Phi3Config's original_max_position_embeddings (4096) is what HF takes over the rope parameters' own
    "Phi3ForCausalLM": dict(rms_norm_eps=1e-5, original_max_position_embeddings=4096),
    "MixtralForCausalLM": dict(rms_norm_eps=1e-5),
    "Gemma2ForCausalLM": dict(hidden_activation="gelu_pytorch_tanh"),
    "Gemma3ForCausalLM": dict(hidden_activation="gelu_pytorch_tanh"),
    "SmolLM3ForCausalLM": dict(tie_word_embeddings=True),
    "Olmo3ForCausalLM": dict(rms_norm_eps=1e-5, sliding_window=4096, max_position_embeddings=2048, eos_token_id=50279),
    "OlmoeForCausalLM": dict(rms_norm_eps=1e-5, num_experts=64, num_experts_per_tok=8, max_position_embeddings=4096,
                             eos_token_id=50279),
    "SeedOssForCausalLM": dict(attention_bias=True, head_dim=128, num_key_value_heads=8, rms_norm_eps=1e-6,
                               max_position_embeddings=524288, bos_token_id=0, eos_token_id=2),
    "Exaone4ForCausalLM": dict(rms_norm_eps=1e-5, sliding_window=4096, sliding_window_pattern=4, num_key_value_heads=32,
                               max_position_embeddings=2048, bos_token_id=0, eos_token_id=2),
    "Ernie4_5ForCausalLM": dict(rms_norm_eps=1e-5, head_dim=128, num_key_value_heads=2, tie_word_embeddings=True,
                                max_position_embeddings=131072, bos_token_id=1, eos_token_id=2),
}
_DEFAULT_THETA = {"Olmo3ForCausalLM": 500000.0, "Ernie4_5ForCausalLM": 500000.0, "MixtralForCausalLM": 1e6,
                  "Gemma3ForCausalLM": 1e6, "SmolLM3ForCausalLM": 2e6, "CohereForCausalLM": 500000.0}


def _with_family_defaults(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """cfg with _FAMILY_DEFAULTS under it (OLMoE's num_local_experts, its other name, stands for num_experts)."""
    defaults = dict(_FAMILY_DEFAULTS.get(arch, {}))
    if "num_local_experts" in cfg:
        defaults.pop("num_experts", None)
    return {**defaults, **cfg}


def _olmo(cfg: dict[str, Any], arch: str, heads: int) -> dict[str, Any]:
    """OLMo 2, OLMo 3, OLMoE: attention_bias puts a bias on o_proj too (HF's). OLMoE's q/k norms span hidden_size,
    so its heads must tile it; its clip_qkv (q, k, v clamped) is refused."""
    if arch not in ("Olmo2ForCausalLM", "Olmo3ForCausalLM", "OlmoeForCausalLM"):
        return {}
    if arch == "OlmoeForCausalLM":
        if cfg.get("clip_qkv") is not None:
            raise ValueError(f"config.json clip_qkv={cfg['clip_qkv']!r}: OLMoE's clamped q/k/v are unsupported")
        if cfg.get("head_dim") not in (None, cfg["hidden_size"] // heads):
            raise ValueError(f"config.json head_dim={cfg['head_dim']!r}: OLMoE's q/k norms span hidden_size, so "
                             f"head_dim must be hidden_size / num_attention_heads ({cfg['hidden_size'] // heads})")
    return dict(o_proj_bias=bool(cfg.get("attention_bias", False)))


def _seed_oss(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """Seed-OSS: Llama with q/k/v biases (attention_bias, on by default) and an o_proj bias (attention_out_bias);
    MLP biases (mlp_bias) are refused. Its dropouts are training-only."""
    if arch != "SeedOssForCausalLM":
        return {}
    if cfg.get("mlp_bias"):
        raise ValueError("config.json mlp_bias=true: only MLPs without biases are supported")
    return dict(o_proj_bias=bool(cfg.get("attention_out_bias", False)))


def _ernie(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """ERNIE 4.5 (dense): Llama with rotary pairs interleaved (2i, 2i + 1), reordered at load; use_bias (biases on
    every projection, the MLP's included) is refused."""
    if arch != "Ernie4_5ForCausalLM":
        return {}
    if cfg.get("use_bias"):
        raise ValueError("config.json use_bias=true: ERNIE 4.5's biased projections are unsupported")
    return dict(rotary_interleaved=True)


def _glm_as_shared_fields(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """GLM-4's and GLM-4.5's config.json in the fields the other families are read by, with transformers' defaults
    (Glm4Config, Glm4MoeConfig) where it leaves them out: head_dim 128, q/k/v biases and eps 1.5625e-7 (GLM-4),
    half of each head rotating (both); GLM-4.5's n_routed_experts as num_experts, its first first_k_dense_replace
    layers as mlp_only_layers, its n_shared_experts as one shared expert of n times moe_intermediate_size. Any other
    architecture's as it is."""
    if arch not in GLM:
        return cfg
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    partial = {} if "partial_rotary_factor" in cfg or "partial_rotary_factor" in rope else \
        {"partial_rotary_factor": 0.5}
    if arch == "Glm4ForCausalLM":
        out = {"head_dim": 128, "attention_bias": True, "rms_norm_eps": 1.5625e-07, **partial, **cfg}
        return out if out.get("eos_token_id") is not None else dict(out, eos_token_id=[151329, 151336, 151338])
    experts, inter = cfg.get("n_routed_experts", 128), cfg.get("moe_intermediate_size", 1408)
    dense = cfg.get("first_k_dense_replace", 1)
    if not isinstance(dense, int) or dense < 0:
        raise ValueError(f"config.json first_k_dense_replace={dense!r}: must be an int >= 0")
    return {"rms_norm_eps": 1e-5, "norm_topk_prob": True, "num_experts_per_tok": 8, "moe_intermediate_size": inter,
            **partial, **cfg, "num_experts": experts, "mlp_only_layers": list(range(dense)),
            "shared_expert_intermediate_size": cfg.get("n_shared_experts", 1) * inter}


def _glm(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """GLM-4: rotary pairs interleaved (2i, 2i + 1) within the rotated part; GLM-4.5: DeepSeek-V3's routing (sigmoid
    scores, a correction bias for the choice, group-limited, scaled; layers/moe.route_sigmoid) and a shared expert
    added without a gate. Groups are checked as HF's router reads them (the two best experts of each group)."""
    if arch == "Glm4ForCausalLM":
        return dict(rotary_interleaved=True)
    if arch != "Glm4MoeForCausalLM":
        return {}
    groups, keep = _expert_groups(cfg, smallest=2)
    return dict(scoring_func="sigmoid", n_group=groups, topk_group=keep, shared_expert_gated=False,
                routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)))


def _expert_groups(cfg: dict[str, Any], smallest: int) -> tuple[int, int]:
    """(n_group, topk_group) of a group-limited router, checked: the groups divide the experts into groups of at
    least `smallest` (DeepSeek-V3's rule reads each group's two best), and the kept groups hold the top-k."""
    experts, k = cfg["num_experts"], cfg["num_experts_per_tok"]
    groups, keep = cfg.get("n_group") or 1, cfg.get("topk_group") or 1
    if not isinstance(groups, int) or groups < 1 or experts % groups or experts // groups < smallest:
        raise ValueError(f"config.json n_group={groups!r}: must divide n_routed_experts ({experts}) into groups of "
                         f"at least {smallest} expert{'s' if smallest > 1 else ''}")
    if not isinstance(keep, int) or not 1 <= keep <= groups or k > keep * (experts // groups):
        raise ValueError(f"config.json topk_group={keep!r}: must be 1 .. n_group ({groups}), its groups holding at "
                         f"least num_experts_per_tok ({k}) experts")
    return groups, keep


# transformers' defaults (DeepseekV2Config, DeepseekV3Config) of the fields a DeepSeek config.json may leave out
_DEEPSEEK_DEFAULTS = {
    "DeepseekV2ForCausalLM": dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                  v_head_dim=128, n_routed_experts=64, n_shared_experts=2, moe_intermediate_size=1407,
                                  first_k_dense_replace=0, routed_scaling_factor=1.0, topk_method="greedy",
                                  norm_topk_prob=False, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2),
    "DeepseekV3ForCausalLM": dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                  v_head_dim=128, n_routed_experts=256, n_shared_experts=1, moe_intermediate_size=2048,
                                  first_k_dense_replace=3, routed_scaling_factor=2.5, n_group=8, topk_group=4,
                                  num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=4096,
                                  bos_token_id=0, eos_token_id=1),
}


def _deepseek_as_shared_fields(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """DeepSeek-V2's and -V3's config.json in the shared fields, with transformers' defaults where it leaves them
    out: head_dim the cache's (the wider of K's qk_nope_head_dim + qk_rope_head_dim and v_head_dim), as many KV heads
    as query heads (MLA's K and V are per head once made from the latent), n_routed_experts as num_experts, the
    dense layers (the first first_k_dense_replace, then all but every moe_layer_freq-th, as DeepSeek's code) as
    mlp_only_layers, n_shared_experts as one shared expert of n times moe_intermediate_size. Any other
    architecture's as it is."""
    if arch not in DEEPSEEK:
        return cfg
    cfg = {**_DEEPSEEK_DEFAULTS[arch], **cfg}
    for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if not isinstance(cfg[name], int) or cfg[name] < 1:
            raise ValueError(f"config.json {name}={cfg[name]!r}: must be an int >= 1")
    if cfg["qk_rope_head_dim"] % 2:
        raise ValueError(f"config.json qk_rope_head_dim={cfg['qk_rope_head_dim']}: rotary embeddings need an even "
                         "number of dims")
    q_rank = cfg["q_lora_rank"]
    if q_rank is not None and (not isinstance(q_rank, int) or q_rank < 1):
        raise ValueError(f"config.json q_lora_rank={q_rank!r}: must be null (q_proj) or an int >= 1")
    dense, freq = cfg["first_k_dense_replace"], cfg.get("moe_layer_freq") or 1
    if not isinstance(dense, int) or dense < 0:
        raise ValueError(f"config.json first_k_dense_replace={dense!r}: must be an int >= 0")
    if not isinstance(freq, int) or freq < 1:
        raise ValueError(f"config.json moe_layer_freq={freq!r}: must be an int >= 1")
    experts, inter = cfg["n_routed_experts"] or 0, cfg["moe_intermediate_size"]
    if experts and not cfg.get("num_experts_per_tok"):
        raise ValueError(f"config.json num_experts_per_tok={cfg.get('num_experts_per_tok')!r}: must be an int >= 1")
    layers = cfg["num_hidden_layers"]
    return {**cfg, "head_dim": max(cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"], cfg["v_head_dim"]),
            "num_key_value_heads": cfg["num_attention_heads"], "num_experts": experts,
            "mlp_only_layers": [i for i in range(layers) if i < dense or i % freq],
            "shared_expert_intermediate_size": (cfg.get("n_shared_experts") or 0) * inter}


def _deepseek(cfg: dict[str, Any], arch: str, scaling: dict | None) -> dict[str, Any]:
    """DeepSeek-V2/V3: MLA's shapes; the scores' scale qk_head_dim ** -0.5 times YaRN's mscale(mscale_all_dim)
    squared, as HF's; the rope part's pairs interleaved (V2's always, V3's unless rope_interleave is false); the
    routing: V2's softmax (topk_method greedy, or group_limited_greedy: the topk_group groups with the best expert),
    V3's sigmoid with its correction bias (noaux_tc), both times routed_scaling_factor; the shared experts ungated."""
    if arch not in DEEPSEEK:
        return {}
    v2 = arch == "DeepseekV2ForCausalLM"
    scoring, method = cfg.get("scoring_func") or ("softmax" if v2 else "sigmoid"), cfg.get("topk_method")
    if scoring != ("softmax" if v2 else "sigmoid"):
        raise ValueError(f"config.json scoring_func={scoring!r}: {arch} routes by "
                         f"{'softmax' if v2 else 'sigmoid'} only")
    if method not in (("greedy", "group_limited_greedy") if v2 else (None, "noaux_tc")):
        raise ValueError(f"config.json topk_method={method!r}: {arch} supports "
                         f"{'greedy and group_limited_greedy' if v2 else 'noaux_tc'} only")
    if v2 and cfg.get("norm_topk_prob"):
        raise ValueError("config.json norm_topk_prob=true: unsupported for DeepseekV2ForCausalLM (HF's router ignores "
                         "it, DeepSeek's own renormalises instead of scaling)")
    routing = {}
    if cfg["num_experts"]:
        groups, keep = (1, 1) if method == "greedy" else _expert_groups(cfg, smallest=1 if v2 else 2)
        routing = dict(scoring_func=scoring, n_group=groups, topk_group=keep, shared_expert_gated=False,
                       routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0))
    nope, rope = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
    scale = (nope + rope) ** -0.5
    if scaling is not None and scaling.get("mscale_all_dim") and scaling.get("factor", 1.0) > 1:
        scale *= (0.1 * scaling["mscale_all_dim"] * math.log(scaling["factor"]) + 1.0) ** 2
    return dict(q_lora_rank=cfg["q_lora_rank"], kv_lora_rank=cfg["kv_lora_rank"], qk_nope_head_dim=nope,
                qk_rope_head_dim=rope, v_head_dim=cfg["v_head_dim"], attention_multiplier=scale,
                rotary_interleaved=v2 or bool(cfg.get("rope_interleave", True)), **routing)


def _moe_layers(cfg: dict[str, Any], layers: int) -> list[bool]:
    """Qwen3-MoE: layer i routes unless it is in mlp_only_layers or (i + 1) is off decoder_sparse_step."""
    dense, step = set(cfg.get("mlp_only_layers") or ()), cfg.get("decoder_sparse_step", 1) or 1
    return [i not in dense and (i + 1) % step == 0 for i in range(layers)]


def _check_quantization(cfg: dict[str, Any], arch: str) -> None:
    """The quantized HF checkpoints read, each dequantized at load: GPT-OSS's mxfp4 (loader/mxfp4.py) and any other
    architecture's FP8 (quant_method "fp8" or "compressed-tensors", loader/fp8.py, whose refusals name the field)."""
    quant = checkpoint_quantization(cfg)
    gpt_oss = arch == "GptOssForCausalLM"
    if quant is None or (quant == "mxfp4" and gpt_oss):
        return
    if quant in ("fp8", "compressed-tensors") and not gpt_oss:
        from picovllm.loader.fp8 import Fp8Scheme
        Fp8Scheme.from_quantization_config(cfg["quantization_config"])
        return
    raise ValueError(f"config.json quantization_config.quant_method={quant!r}: quantized HF checkpoints are "
                     "unsupported (but GPT-OSS's mxfp4 and other models' FP8, fp8 or compressed-tensors, dequantized "
                     "at load; GGUF files for 4-8 bits)")


def checkpoint_quantization(cfg: dict[str, Any]) -> str | None:
    """An HF config's quantization_config.quant_method (None: the weights are not quantized)."""
    qc = cfg.get("quantization_config")
    return None if not qc else str(qc.get("quant_method"))


def scaled_context(max_position: int, scaling: dict | None) -> int:
    """The positions a model takes: its max_position_embeddings, or under YaRN at least the original context times
    the factor (as vLLM derives it; Qwen's configs keep the unscaled length there; without an original context,
    max_position_embeddings times the factor, as vLLM's once transformers has filled it in)."""
    if scaling is not None and scaling["rope_type"] == "yarn":
        return max(max_position, int(scaling["original_max_position_embeddings"] * scaling["factor"]))
    return max_position


def _rope_scaling(rs: dict[str, Any], cfg: dict[str, Any] | None = None) -> dict | None:
    """A config's rope parameters as the scaling the rotary table applies (None: the default rope); another
    rope_type is refused naming the field. The original context of llama3, yarn and longrope is HF's: the top-level
    original_max_position_embeddings (Phi-3's place) over the rope parameters'; where neither has one,
    max_position_embeddings (transformers' standardize_rope_params). A yarn or longrope factor left out is
    max_position_embeddings over the original context (HF's): 1 in that fallback, which leaves yarn the default rope
    and longrope its short factors, cos and sin unscaled; a factor given is kept, and so is the attention factor HF
    derives from it (layers/rotary.attention_factor)."""
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return None
    if kind == "dynamic":
        # HF's dynamic NTK rope is the default rope at every position below max_position_embeddings (its base only
        # grows once a sequence passes that length), and the model's context stops there (scaled_context)
        return None
    if kind == "su":                     # Phi-3's first name for LongRoPE
        kind = "longrope"
    if kind not in ("llama3", "linear", "longrope", "yarn"):
        raise ValueError(f"config.json rope_scaling.rope_type={kind!r}: only 'llama3', 'linear', 'yarn', 'longrope' "
                         "and 'dynamic' are supported")
    out = dict(rs, rope_type=kind)
    if kind == "linear":
        return out
    cfg = cfg or {}
    orig = cfg.get("original_max_position_embeddings") or rs.get("original_max_position_embeddings")
    if kind == "llama3":
        out.update(original_max_position_embeddings=int(orig or cfg.get("max_position_embeddings", 8192)))
        return out
    # yarn: Qwen's long-context setting (factor x the original context); longrope: Phi-3's per-frequency factors,
    # the short ones within the original context
    if kind == "longrope" and ("short_factor" not in rs or "long_factor" not in rs):
        raise ValueError("config.json rope_scaling (longrope) needs short_factor and long_factor")
    orig = int(orig or cfg.get("max_position_embeddings", DEFAULT_MAX_POSITION))
    factor = rs.get("factor") or cfg.get("max_position_embeddings", orig) / orig
    return dict(out, original_max_position_embeddings=orig, factor=float(factor))
