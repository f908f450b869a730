"""Engine and model configuration: built once, validated in one place, passed down."""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from picovllm.hf_config import model_config_fields

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
        """An HF config.json (parsed) as a ModelConfig: picovllm/hf_config.py reads each family's fields."""
        return cls(**model_config_fields(cfg))


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

AUTO_MODEL_LEN = -1     # EngineConfig.max_model_len: fit to the KV cache


def model_len(max_model_len: int | None, context: int) -> int:
    """The longest sequence an engine takes: max_model_len within the model's context (None, -1: the context)."""
    return context if max_model_len in (None, AUTO_MODEL_LEN) else min(max_model_len, context)


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
    max_model_len: int | None = None      # None: the model's context; -1 (vLLM's -1 or auto): that, or the longest
                                          # sequence the KV cache holds where it holds less
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
    seed: int | None = 0                  # seeds torch and random at start-up, as vLLM's: unseeded sampling
                                          # repeats run to run; None: not seeded (differs run to run)
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
    max_logprobs: int = 20                # the most logprobs and prompt_logprobs a request may ask for (vLLM's;
                                          # its -1, the whole vocabulary, counts as the vocabulary's size); -1: no
                                          # limit (engine/admission.check_logprobs)
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

        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not -2**63 <= self.seed < 2**64):
            raise bad("seed", "must be an int in [-2**63, 2**64) (torch's generator seeds) or None (not seeded)")
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
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 1) \
                and self.max_model_len != AUTO_MODEL_LEN:
            raise bad("max_model_len", "must be an int >= 1, or -1 (fit to the KV cache)")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise bad("gpu_memory_utilization", "must be in (0, 1]")
        if self.cpu_kv_cache_gib <= 0:
            raise bad("cpu_kv_cache_gib", "must be > 0")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise bad("num_kv_blocks", "must be >= 1")
        if not isinstance(self.stream_interval, int) or isinstance(self.stream_interval, bool) \
                or self.stream_interval < 1:
            raise bad("stream_interval", "must be an int >= 1")
        if not isinstance(self.max_logprobs, int) or isinstance(self.max_logprobs, bool) or self.max_logprobs < -1:
            raise bad("max_logprobs", "must be an int >= 0, or -1 (no limit)")
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
