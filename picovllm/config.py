"""Engine and model configuration: built once, validated in one place, passed down."""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# dtype names -> torch attribute; torch is imported when a config is built, not when this module is (the CLI's
# parser is made from EngineConfig's fields and must not wait for torch)
DTYPES = {"float32": "float32", "fp32": "float32", "float": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16", "half": "float16"}

def dtype_from_name(name: str) -> "torch.dtype":
    """'bf16', 'float32', ... -> the torch dtype; ValueError for other names."""
    import torch

    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} must be one of {sorted(DTYPES)}")
    return getattr(torch, DTYPES[name])


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


@dataclass
class ModelConfig:
    """The shape of a decoder-only transformer, independent of where its weights came from."""
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int                  # of the KV cache's heads (MLA: K's and V's, the narrower padded with zeros)
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: dict | None = None
    attention_bias: bool = False   # Qwen2: bias on q/k/v
    o_proj_bias: bool = False      # attention_bias where HF's o_proj takes it too (Llama, Qwen3, Gemma, OLMo, ...);
                                   # Seed-OSS: attention_out_bias
    mlp_bias: bool = False         # Llama, SmolLM3 (mlp_bias): biases on the gate, up and down projections
    qk_norm: bool = False          # Qwen3, Gemma 3: RMSNorm on q and k per head
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    hidden_act: str = "silu"                       # of the gated MLP: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU)
    sliding_window: int | None = None              # attend to the last this many positions, on the sliding layers
    sliding_layers: list[bool] | None = None       # which layers slide (None: all of them, if sliding_window)
    rope_local_theta: float | None = None          # Gemma 3: the sliding layers' rope base (no scaling)
    query_pre_attn_scalar: float | None = None     # Gemma: scores scaled by its -1/2 power, not head_dim's
    attn_logit_softcapping: float | None = None    # Gemma 2: scores -> cap * tanh(scores / cap) (not Gemma 3's)
    final_logit_softcapping: float | None = None   # Gemma 2: logits -> cap * tanh(logits / cap)
    num_experts: int = 0                           # MoE (Qwen3-MoE, Mixtral): routed experts per MoE layer
    num_experts_per_tok: int = 0                   # top-k
    moe_intermediate_size: int = 0                 # each expert's
    norm_topk_prob: bool = True                    # renormalise the top-k routing weights to sum to 1
    moe_layers: list[bool] | None = None           # which layers route to experts (the others: a dense MLP)
    shared_expert_intermediate_size: int = 0       # Qwen2-MoE, GLM-4.5: a dense expert every token takes
    shared_expert_gated: bool = True               # its output scaled by sigmoid(shared_expert_gate(x)) (Qwen2-MoE)
                                                   # or added as it is (GLM-4.5)
    scoring_func: str = "softmax"                  # routing (layers/moe.Routing): softmax, or sigmoid (GLM-4.5:
    n_group: int = 1                               # DeepSeek-V3's, an e_score_correction_bias for the choice only);
    topk_group: int = 1                            # experts picked from the best topk_group of n_group groups (and
    routed_scaling_factor: float = 1.0             # DeepSeek-V2's softmax), the routed weights times this factor
    rope_layers: list[bool] | None = None          # SmolLM3: which layers rotate q and k (None: all; the rest NoPE)
    rotary_interleaved: bool = False               # Cohere, GLM-4, DeepSeek: rotated pairs (2i, 2i + 1), not
                                                   # (i, i + D / 2)
    rotary_dim: int | None = None                  # partial rotary (Phi-4-mini): each head's first rotary_dim dims
                                                   # rotate, the rest pass (None: all); layers/rotary.rotary_order
    # DeepSeek's multi-head latent attention (MLA; kv_lora_rank > 0): K and V from a latent of kv_lora_rank dims,
    # per head k_nope (qk_nope_head_dim) and v (v_head_dim), beside one k_pe (qk_rope_head_dim) all heads share;
    # q direct (q_lora_rank None) or through a latent of q_lora_rank dims (models/deepseek.py)
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    attention_multiplier: float | None = None      # Granite, DeepSeek: the scores' scale (not head_dim ** -0.5)
    embedding_multiplier: float = 1.0              # Granite: embeddings scaled by it
    residual_multiplier: float = 1.0               # Granite: each attention and MLP output scaled before the add
    logits_scaling: float = 1.0                    # Granite: logits divided by it (Cohere: 1 / logit_scale)
    swiglu_alpha: float = 1.702                    # GPT-OSS: its experts' clamped SwiGLU (layers.activation)
    swiglu_limit: float = 7.0
    has_lm_head: bool = True                       # False: a bare model's checkpoint (BARE_MODELS): pooling only
    # Matryoshka-trained embeddings (config.json's is_matryoshka / matryoshka_dimensions, as vLLM reads them): a
    # request may cut its embedding to its first `dimensions` (any, or only those listed)
    is_matryoshka: bool = False
    matryoshka_dimensions: list[int] | None = None

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of decoder layer `layer` (None: it attends to the whole context)."""
        if self.sliding_window is None or (self.sliding_layers is not None and not self.sliding_layers[layer]):
            return None
        return self.sliding_window

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and (self.moe_layers is None or self.moe_layers[layer])

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
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
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", cfg.get("layer_norm_eps", 1e-5) if arch in COHERE
                                 else 1e-5 if arch == "Olmo2ForCausalLM" else 1e-6),           # HF's defaults
            rope_theta=rope.get("rope_theta", _DEFAULT_THETA.get(arch, 10000.0)),
            max_position_embeddings=scaled_context(cfg.get("max_position_embeddings", 4096), scaling),
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
    if "full_attention" in params:     # per layer type (Gemma 3)
        return dict(params["full_attention"]), dict(params.get("sliding_attention") or {})
    rope = dict(cfg.get("rope_scaling") or {}, **params)
    if "rope_theta" in cfg:
        rope["rope_theta"] = cfg["rope_theta"]
    arch = (cfg.get("architectures") or [None])[0]
    if arch == "Olmo3ForCausalLM":     # its sliding layers: the same base, never scaled (HF's rope_scaling is the
        return rope, {"rope_theta": rope.get("rope_theta", _DEFAULT_THETA[arch])}   # full layers' only)
    local = {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)} if arch == "Gemma3ForCausalLM" else None
    return rope, local


# the families whose sliding window is switched on by use_sliding_window (transformers' default: off)
_USE_SLIDING_WINDOW = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
                       "SmolLM3ForCausalLM")


def _sliding_window(cfg: dict[str, Any], arch: str, layers: int) -> tuple[int | None, list[bool] | None]:
    """(window, which layers slide): HF's rules per family. Mistral, Mixtral, Phi-3: every layer; Qwen2, Qwen3: with
    use_sliding_window (off unless set, as in transformers' configs), the layers from max_window_layers (default 28)
    on; Qwen3-MoE: with it, every layer; Gemma 2: every other layer, from the first; Gemma 3, Cohere 2, EXAONE 4: all
    but every sliding_window_pattern-th; OLMo 3: all but every 4th. A config's layer_types overrides the rule (but
    Qwen3-MoE's, which HF's model does not read)."""
    window, use = cfg.get("sliding_window"), cfg.get("use_sliding_window")
    if window is None or use is False or (arch in _USE_SLIDING_WINDOW and not use):
        return None, None
    if arch == "Qwen3MoeForCausalLM":
        return int(window), [True] * layers
    types = cfg.get("layer_types")
    if types is None and arch in ("Qwen2MoeForCausalLM", "SmolLM3ForCausalLM"):
        raise ValueError(f"config.json use_sliding_window without layer_types: which layers of {arch} slide is not "
                         "read from this config (give layer_types)")
    if types is not None:
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
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
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


def parse_hf_overrides(value: dict | str | None, what: str = "hf_overrides") -> dict | None:
    """--hf-overrides' value: a dict or its JSON text (an object of config.json fields); None for none. ValueError
    naming `what` otherwise."""
    return parse_json_object(value, what, "config.json fields")


def parse_json_object(value: dict | str | None, what: str, of: str) -> dict | None:
    """A flag's or field's value that is a dict or its JSON text (an object of `of`); None for none. ValueError
    naming `what` otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{what} is not valid JSON ({e}), got {value!r}") from None
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"{what} must be a JSON object of {of}, got {value!r}")
    return value


def parse_config_object(cls, value, what: str, of: str, only: str | None = None):
    """A config dataclass field's value (EngineConfig.pooler_config, .speculative_config): an instance of cls, a dict
    of its fields, or that dict as JSON text (parse_json_object's `of` says what the object holds); None for none.
    A key that is not one of cls's fields is refused naming it (`only`: the fields the message lists, else `of`)."""
    if value is None or isinstance(value, cls):
        return value
    value = parse_json_object(value, what, of)
    unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise ValueError(f"{what}.{unknown[0]} is not supported (only {only or of})")
    return cls(**value)


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
    the factor (as vLLM derives it; Qwen's configs keep the unscaled length there)."""
    if scaling is not None and scaling["rope_type"] == "yarn":
        return max(max_position, int(scaling["original_max_position_embeddings"] * scaling["factor"]))
    return max_position


def _rope_scaling(rs: dict[str, Any], cfg: dict[str, Any] | None = None) -> dict | None:
    """A config's rope parameters as the scaling the rotary table applies (None: the default rope); another
    rope_type is refused naming the field. The original context of llama3, yarn and longrope is HF's: the top-level
    original_max_position_embeddings (Phi-3's place) over the rope parameters'; where neither has one, llama3's is
    max_position_embeddings (HF's fallback), and yarn and longrope are refused (vLLM requires it too)."""
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
    if kind == "yarn":                   # Qwen's long-context setting: factor x the original context
        if not orig:
            raise ValueError("config.json rope_scaling (yarn) needs original_max_position_embeddings")
        out.update(original_max_position_embeddings=int(orig),
                   factor=float(rs.get("factor") or cfg.get("max_position_embeddings", orig) / orig))
    if kind == "longrope":               # Phi-3: per-frequency factors, short below the original context
        if not orig or "short_factor" not in rs or "long_factor" not in rs:
            raise ValueError("config.json rope_scaling (longrope) needs short_factor, long_factor and "
                             "original_max_position_embeddings")
        out.update(original_max_position_embeddings=int(orig),
                   factor=rs.get("factor") or cfg.get("max_position_embeddings", orig) / orig)
    return out


POOLING_TYPES = ("LAST", "MEAN")


@dataclass
class PoolerConfig:
    """How a pooling engine (EngineConfig.runner "pooling") makes a prompt's embedding from its final hidden states,
    as vLLM's PoolerConfig: pooling_type "LAST" (the last prompt token's: decoder embedders such as Qwen3-Embedding
    and e5-mistral) or "MEAN" (over every prompt token); normalize: L2-normalize it. None: the model folder's
    sentence-transformers config (modules.json), else LAST and normalized (engine/pooling.py)."""
    pooling_type: str | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            if not isinstance(self.pooling_type, str) or self.pooling_type.upper() not in POOLING_TYPES:
                raise ValueError(f"EngineConfig.pooler_config.pooling_type must be one of {', '.join(POOLING_TYPES)}"
                                 f" or None, got {self.pooling_type!r}")
            self.pooling_type = self.pooling_type.upper()
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"EngineConfig.pooler_config.normalize must be a bool or None, got {self.normalize!r}")

    @classmethod
    def parse(cls, value: "PoolerConfig | dict | str | None") -> "PoolerConfig | None":
        """EngineConfig.pooler_config's value: a PoolerConfig, a dict of its fields, or that as JSON (--pooler-config
        '{"pooling_type": "MEAN"}'); ValueError naming the field otherwise."""
        return parse_config_object(cls, value, "EngineConfig.pooler_config", "pooling_type and normalize")


SPECULATIVE_METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 32


@dataclass
class SpeculativeConfig:
    """Speculative decoding (vLLM's speculative_config): each step a decoding request also feeds up to
    num_speculative_tokens drafted tokens, and the step keeps the longest run of them the model itself samples, plus
    one token of its own (engine/spec_decode.py). method "ngram" (prompt lookup): the drafts are what followed the
    latest earlier occurrence of the sequence's last n tokens, n from prompt_lookup_max down to prompt_lookup_min
    (vLLM's defaults: either one missing is the other; both missing, 5). disable_by_batch_size (vLLM's): no request
    speculates in a step while more than this many are running (a large batch is compute-bound enough that rejected
    drafts cost more than kept ones save)."""
    method: str = "ngram"
    num_speculative_tokens: int | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    disable_by_batch_size: int | None = None   # no drafts in a step while more requests than this are running

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"EngineConfig.speculative_config.{name} {why}, got {getattr(self, name)!r}")

        if self.method not in SPECULATIVE_METHODS:
            raise bad("method", "must be 'ngram' (draft models, EAGLE, MTP and suffix decoding are not supported)")
        k = self.num_speculative_tokens
        if k is None:
            raise bad("num_speculative_tokens", "is required")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise bad("num_speculative_tokens", f"must be an int in [1, {MAX_SPECULATIVE_TOKENS}]")
        for name, least in (("prompt_lookup_min", 1), ("prompt_lookup_max", 1), ("disable_by_batch_size", 2)):
            v = getattr(self, name)      # what was given, before a missing one is filled in
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < least):
                raise bad(name, f"must be None or an int >= {least}")
        if self.prompt_lookup_max is None and self.prompt_lookup_min is None:
            self.prompt_lookup_max = self.prompt_lookup_min = 5
        elif self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        elif self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise bad("prompt_lookup_min", f"must be at most prompt_lookup_max ({self.prompt_lookup_max})")

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        """EngineConfig.speculative_config's value: a SpeculativeConfig, a dict of its fields, or that as JSON
        (--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'); ValueError naming the field
        otherwise."""
        return parse_config_object(cls, value, "EngineConfig.speculative_config",
                                   "method, num_speculative_tokens, prompt_lookup_max, prompt_lookup_min and "
                                   "disable_by_batch_size", ", ".join(sorted(f.name for f in dataclasses.fields(cls))))


# "auto": a GGUF's own 4/8-bit form on the CPU; "none": float; "q8_0": an HF folder's matrices quantized at
# load to 8 bits (a scale per 16 weights), run by the same CPU kernels (loader/quantize_at_load.py); "bf16":
# the CPU's decode GEMMs read bfloat16 copies of the float32 weights (kernels/cpu/small_gemm.c)
QUANTIZATIONS = ("auto", "none", "q8_0", "bf16", "fp8")
# the KV cache's element type: "auto" = the model's dtype; "fp8" (alias "fp8_e4m3") = float8 e4m3fn with a float32
# scale per layer and KV head for K and for V (engine/kv_scales.py)
KV_CACHE_DTYPES = {"auto": "auto", "fp8": "fp8", "fp8_e4m3": "fp8"}


@dataclass
class EngineConfig:
    model: str | None = None              # HF folder, .gguf file, or None for the default model
    tokenizer: str | None = None          # load the tokenizer from this HF folder, .gguf file or Hub repository,
                                          # not the model's (vLLM's --tokenizer; loader/tokenizer.tokenizer_of)
    dtype: str | torch.dtype = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    scheduling_policy: str = "fcfs"       # "fcfs" | "priority" (each request's priority, lower first; vLLM's)
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gib: float = 1.0
    num_kv_blocks: int | None = None      # override the memory-budget computation (tests, PD)
    enable_prefix_caching: bool = True
    enforce_eager: bool = False           # no CUDA graphs (GPU), no one-call decode stack (CPU)
    async_scheduling: bool | None = None  # overlap host work with the device (None: on for GPUs, but with
                                          # speculative_config)
    prefill_cuda_graphs: bool | None = None   # CUDA graphs for one-chunk prefill steps of <= 512 tokens (GPU);
                                              # None: on where the decode steps have graphs, one rank (no TP)
    warmup: bool | None = None            # start-up steps that compile every Triton kernel variant a run can
                                          # meet (engine/warmup.py); None: on for CUDA with the Triton backend
    attention_backend: str = "auto"       # "torch" | "triton" | "cpu" (C paged kernel) | "auto"
    skip_tokenizer_init: bool = False
    trust_remote_code: bool = False       # vLLM's flag, accepted so its command lines run: picovllm never runs a
                                          # checkpoint's own code (an architecture it lacks is refused either way)
    revision: str | None = None           # a Hub repository's branch, tag or commit (vLLM's --revision); None: main
    download_dir: str | None = None       # where a Hub repository is fetched to and looked for (vLLM's
                                          # --download-dir); None: the Hub's cache (HF_HUB_CACHE)
    hf_overrides: dict | str | None = None    # JSON: config.json's top-level fields set or replaced before the model
                                              # is read (vLLM's --hf-overrides; HF folders only), e.g. a rope_scaling
    tensor_parallel_size: int = 1
    seed: int = 0                         # seeds torch and random at start-up, as vLLM's: unseeded sampling
                                          # repeats run to run
    role: str = "pd"                      # "pd" (colocated), "p" (prefill only), "d" (decode only)
    disk_cache: bool = True               # keep a GGUF's tokenizer and weights in the artifact cache
    quantization: str = "auto"            # "auto": a GGUF's own 4/8-bit form on the CPU, an FP8 checkpoint's
                                          # float8 layers in fp8 on a GPU | "none" (float, dequantized)
                                          # | "q8_0" (an HF folder quantized at load) | "bf16" (CPU decode)
                                          # | "fp8" (linear and expert weights in float8 e4m3, a scale per
                                          # output feature, quantized at load: layers/fp8_weights.py)
    kv_cache_dtype: str = "auto"          # "auto" (the model's dtype) | "fp8" / "fp8_e4m3" (float8 e4m3fn, scaled)
    stream_interval: int = 1              # a streamed request's outputs: its first token, then every this many
                                          # tokens, and its last (vLLM's and SGLang's --stream-interval)
    generation_config: str = "auto"       # sampling defaults for requests that leave them unset: "auto" (the
                                          # model folder's generation_config.json), "vllm" (none), or a folder
    override_generation_config: dict | str | None = None   # JSON: set or replace those defaults
                                                           # (picovllm/generation_config.py, vLLM's flags)
    reasoning_parser: str | None = None   # "qwen3" | "deepseek_r1" | "glm45": structured outputs' grammar governs
                                          # the answer after a thinking model's <think> block; "openai_gptoss":
                                          # after GPT-OSS's final header (vLLM's --reasoning-parser)
    runner: str = "generate"              # "generate" | "pooling" (prompts in, embeddings out: LLM.embed,
                                          # /v1/embeddings; engine/pooling.py) | "auto" ("generate"); vLLM's --runner
    pooler_config: PoolerConfig | dict | str | None = None   # a pooling engine's pooling_type and normalize
                                                             # (vLLM's --pooler-config JSON)
    speculative_config: SpeculativeConfig | dict | str | None = None   # vLLM's --speculative-config JSON:
                                          # {"method": "ngram", "num_speculative_tokens": k, ...} (engine/spec_decode.py)

    def __post_init__(self) -> None:
        import torch

        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"EngineConfig.{name} {why}, got {getattr(self, name)!r}")

        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not -2**63 <= self.seed < 2**64:
            raise bad("seed", "must be an int in [-2**63, 2**64) (torch's generator seeds)")
        if isinstance(self.model, os.PathLike):     # a pathlib.Path, as HF's from_pretrained takes
            self.model = os.fspath(self.model)
        if isinstance(self.tokenizer, os.PathLike):
            self.tokenizer = os.fspath(self.tokenizer)
        if self.tokenizer is not None and (not isinstance(self.tokenizer, str) or not self.tokenizer):
            raise bad("tokenizer", "must be None or a path or Hub repository id")
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self._check_device(bad)
        if self.dtype == "auto":
            self.dtype = torch.bfloat16 if str(self.device).startswith("cuda") else torch.float32
        elif isinstance(self.dtype, str):
            if self.dtype not in DTYPES:
                raise bad("dtype", f"must be one of {sorted(set(DTYPES))}")
            self.dtype = dtype_from_name(self.dtype)
        elif self.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise bad("dtype", "must be float32, bfloat16 or float16")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise bad("block_size", "must be an int >= 1")
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise bad("max_num_seqs", "must be an int >= 1")
        if not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < 1:
            raise bad("max_num_batched_tokens", "must be an int >= 1")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise bad("scheduling_policy", "must be 'fcfs' or 'priority'")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 1):
            raise bad("max_model_len", "must be an int >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise bad("gpu_memory_utilization", "must be in (0, 1]")
        if self.cpu_kv_cache_gib <= 0:
            raise bad("cpu_kv_cache_gib", "must be > 0")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise bad("num_kv_blocks", "must be >= 1")
        if not isinstance(self.stream_interval, int) or isinstance(self.stream_interval, bool) \
                or self.stream_interval < 1:
            raise bad("stream_interval", "must be an int >= 1")
        from picovllm.generation_config import parse_override
        self.override_generation_config = parse_override(self.override_generation_config)
        self.hf_overrides = parse_hf_overrides(self.hf_overrides, "EngineConfig.hf_overrides")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise bad("generation_config", "must be 'auto', 'vllm' or a folder path")
        from picovllm.reasoning import REASONING_PARSERS
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise bad("reasoning_parser", f"must be None or one of {', '.join(map(repr, REASONING_PARSERS))}")
        if self.attention_backend not in ("auto", "torch", "triton", "cpu"):
            raise bad("attention_backend", "must be 'auto', 'torch', 'triton' or 'cpu'")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise bad("tensor_parallel_size", "must be an int >= 1")
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.async_scheduling is None:     # speculation gains more waiting for each step (BENCHMARKS.md)
            self.async_scheduling = str(self.device).startswith("cuda") and self.speculative_config is None
        if not isinstance(self.async_scheduling, bool):
            raise bad("async_scheduling", "must be a bool or None")
        if self.prefill_cuda_graphs is not None and not isinstance(self.prefill_cuda_graphs, bool):
            raise bad("prefill_cuda_graphs", "must be a bool or None")
        if self.warmup is not None and not isinstance(self.warmup, bool):
            raise bad("warmup", "must be a bool or None")
        if self.quantization not in QUANTIZATIONS:
            raise bad("quantization", f"must be one of {', '.join(map(repr, QUANTIZATIONS))}")
        if self.role not in ("pd", "p", "d"):
            raise bad("role", "must be 'pd', 'p' or 'd'")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise bad("kv_cache_dtype", f"must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}")
        self.kv_cache_dtype = KV_CACHE_DTYPES[self.kv_cache_dtype]
        self._check_runner()
        self._check_speculative()
        if self.kv_cache_dtype == "fp8" and self.attention_backend == "cpu":
            raise ValueError("EngineConfig.kv_cache_dtype 'fp8': the CPU's C attention kernels read float32 KV "
                             "only; use attention_backend 'torch' or 'auto' (which takes torch for fp8 KV)")

    def _check_device(self, bad) -> None:
        """device names a torch device this machine has: the CPU, or a CUDA device (an index below its count)."""
        import torch
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError):
            raise bad("device", "must be 'auto', 'cpu', 'cuda' or 'cuda:N'") from None
        if device.type not in ("cpu", "cuda"):
            raise bad("device", "must be 'auto', 'cpu', 'cuda' or 'cuda:N'")
        if device.type == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if count == 0:
                raise bad("device", "names a CUDA device, and this machine has none (torch sees no CUDA)")
            if device.index is not None and device.index >= count:
                raise bad("device", f"names CUDA device {device.index}; this machine has {count}")

    def _check_runner(self) -> None:
        """runner and pooler_config; what a pooling engine (prefill only, no LM head, steps run eagerly) refuses."""
        if self.runner == "auto":       # vLLM's default: every architecture here generates (a bare model's pools)
            self.runner = "generate"
        if self.runner not in ("generate", "pooling"):
            raise ValueError(f"EngineConfig.runner must be 'generate', 'pooling' or 'auto', got {self.runner!r}")
        self.pooler_config = PoolerConfig.parse(self.pooler_config)
        if self.runner != "pooling":
            if self.pooler_config is not None:
                raise ValueError("EngineConfig.pooler_config applies to a pooling engine (runner 'pooling') only")
            return
        refused = {"role": (self.role != "pd", "roles p and d hand a prompt's KV over for decoding, and a pooling "
                                               "request never decodes"),
                   "warmup": (self.warmup is True, "a pooling engine runs its steps eagerly: nothing to warm up"),
                   "prefill_cuda_graphs": (self.prefill_cuda_graphs is True, "the graphs end in the LM head, which "
                                                                              "a pooling engine has not"),
                   "reasoning_parser": (self.reasoning_parser is not None, "a pooling engine samples nothing")}
        self._refuse(refused, "runner 'pooling'")

    def _check_speculative(self) -> None:
        if self.speculative_config is None:
            return
        self._refuse({"role": (self.role == "p", "a prefill engine never decodes"),
                      "runner": (self.runner == "pooling", "a pooling engine never decodes")}, "speculative_config")

    def _refuse(self, refused: dict[str, tuple[bool, str]], beside: str) -> None:
        """ValueError naming the first field given (name -> (given, why)) that cannot go with `beside`."""
        for name, (given, why) in refused.items():
            if given:
                raise ValueError(f"EngineConfig.{name} {getattr(self, name)!r} with {beside}: {why}")

    @property
    def max_decode_rows(self) -> int:
        """The most decode rows a step has: a row per running request (max_num_seqs), and with speculative decoding a
        row per draft too, up to max(max_num_seqs, 256) rows in all (engine/spec_decode.py). The decode CUDA graphs,
        the warm-up and the memory profile cover this many."""
        if self.speculative_config is None:
            return self.max_num_seqs
        with_drafts = self.max_num_seqs * (1 + self.speculative_config.num_speculative_tokens)
        return max(self.max_num_seqs, min(self.max_num_batched_tokens, with_drafts, 256))

    @property
    def torch_dtype(self) -> torch.dtype:
        return self.dtype  # normalised in __post_init__

    @property
    def torch_kv_cache_dtype(self) -> torch.dtype:
        """The KV cache's element type: the model's dtype, or float8_e4m3fn for kv_cache_dtype 'fp8'."""
        import torch

        return torch.float8_e4m3fn if self.kv_cache_dtype == "fp8" else self.dtype
