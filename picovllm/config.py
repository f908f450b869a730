"""Engine and model configuration: built once, validated in one place, passed down."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# dtype names -> torch attribute; torch is imported when a config is built, not when this module is (the CLI's
# parser is made from EngineConfig's fields and must not wait for torch)
_DTYPES = {"float32": "float32", "fp32": "float32", "float": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16", "half": "float16"}

def dtype_from_name(name: str) -> "torch.dtype":
    """'bf16', 'float32', ... -> the torch dtype; ValueError for other names."""
    import torch

    if name not in _DTYPES:
        raise ValueError(f"dtype {name!r} must be one of {sorted(_DTYPES)}")
    return getattr(torch, _DTYPES[name])


SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM")


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
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: dict | None = None
    attention_bias: bool = False   # Qwen2: bias on q/k/v
    qk_norm: bool = False          # Qwen3: RMSNorm on q and k per head
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"config.json architectures={archs!r}: unsupported architecture; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        heads = cfg["num_attention_heads"]
        if cfg.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"config.json partial_rotary_factor={cfg['partial_rotary_factor']!r}: only full "
                             "rotary embeddings (1.0) are supported")
        eos = cfg.get("eos_token_id")
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            max_position_embeddings=_context_length(cfg),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            rope_scaling=_rope_scaling(cfg),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            eos_token_ids=eos,
            bos_token_id=cfg.get("bos_token_id"),
        )


def _context_length(cfg: dict[str, Any]) -> int:
    """max_position_embeddings, capped at a sliding window (Mistral, Phi-3): no attention path here slides
    its window yet, and up to the window full attention is the same thing; longer requests are refused."""
    length = cfg.get("max_position_embeddings", 4096)
    window = cfg.get("sliding_window")
    if window is not None and cfg.get("use_sliding_window", True) is not False:
        length = min(length, int(window))
    return length


def _rope_scaling(cfg: dict[str, Any]) -> dict | None:
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ValueError(f"config.json rope_scaling.rope_type={kind!r}: only 'llama3' is supported")
    return dict(rs)


# "auto": a GGUF's own 4/8-bit form on the CPU; "none": float; "q8_0": an HF folder's matrices quantized at
# load to 8 bits (a scale per 16 weights), run by the same CPU kernels (loader/quantize_at_load.py); "bf16":
# the CPU's decode GEMMs read bfloat16 copies of the float32 weights (kernels/cpu/small_gemm.c)
QUANTIZATIONS = ("auto", "none", "q8_0", "bf16")


@dataclass
class EngineConfig:
    model: str | None = None              # HF folder, .gguf file, or None for the default model
    dtype: str | torch.dtype = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gib: float = 1.0
    num_kv_blocks: int | None = None      # override the memory-budget computation (tests, PD)
    enable_prefix_caching: bool = True
    enforce_eager: bool = False           # no CUDA graphs (GPU), no one-call decode stack (CPU)
    async_scheduling: bool | None = None  # overlap host work with the device (None: on for GPUs)
    attention_backend: str = "auto"       # "torch" | "triton" | "cpu" (C paged kernel) | "auto"
    skip_tokenizer_init: bool = False
    tensor_parallel_size: int = 1
    seed: int = 0
    role: str = "pd"                      # "pd" (colocated), "p" (prefill only), "d" (decode only)
    disk_cache: bool = True               # keep a GGUF's tokenizer and weights in the artifact cache
    quantization: str = "auto"            # weights on the CPU: "auto" (a GGUF's own 4/8-bit form) | "none" (fp32)
                                          # | "q8_0" (an HF folder quantized at load) | "bf16" (CPU decode)

    def __post_init__(self) -> None:
        import torch

        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"EngineConfig.{name} {why}, got {getattr(self, name)!r}")

        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.dtype == "auto":
            self.dtype = torch.bfloat16 if str(self.device).startswith("cuda") else torch.float32
        elif isinstance(self.dtype, str):
            if self.dtype not in _DTYPES:
                raise bad("dtype", f"must be one of {sorted(set(_DTYPES))}")
            self.dtype = dtype_from_name(self.dtype)
        elif self.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise bad("dtype", "must be float32, bfloat16 or float16")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise bad("block_size", "must be an int >= 1")
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise bad("max_num_seqs", "must be an int >= 1")
        if not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < 1:
            raise bad("max_num_batched_tokens", "must be an int >= 1")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 1):
            raise bad("max_model_len", "must be an int >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise bad("gpu_memory_utilization", "must be in (0, 1]")
        if self.cpu_kv_cache_gib <= 0:
            raise bad("cpu_kv_cache_gib", "must be > 0")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise bad("num_kv_blocks", "must be >= 1")
        if self.attention_backend not in ("auto", "torch", "triton", "cpu"):
            raise bad("attention_backend", "must be 'auto', 'torch', 'triton' or 'cpu'")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise bad("tensor_parallel_size", "must be an int >= 1")
        if self.async_scheduling is None:
            self.async_scheduling = str(self.device).startswith("cuda")
        if not isinstance(self.async_scheduling, bool):
            raise bad("async_scheduling", "must be a bool or None")
        if self.quantization not in QUANTIZATIONS:
            raise bad("quantization", f"must be one of {', '.join(map(repr, QUANTIZATIONS))}")
        if self.role not in ("pd", "p", "d"):
            raise bad("role", "must be 'pd', 'p' or 'd'")

    @property
    def torch_dtype(self) -> torch.dtype:
        return self.dtype  # normalised in __post_init__
