"""Per-request pooling parameters (an embedding's), named and validated as in vLLM."""
from __future__ import annotations

from dataclasses import dataclass

from picovllm.sampling_params import MAX_CACHE_SALT_CHARS


@dataclass
class PoolingParams:
    """vLLM's PoolingParams, for a pooling engine (EngineConfig.runner "pooling"): LLM.embed, /v1/embeddings.
    truncate_prompt_tokens: only the prompt's last k tokens are embedded (-1: max_model_len of them). dimensions: the embedding cut to its first
    `dimensions` values, then normalized (Matryoshka; only for a model whose config says it was trained so).
    normalize: L2-normalize the embedding (None: the engine's pooler config, normalized by default)."""
    truncate_prompt_tokens: int | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    cache_salt: str | None = None     # as SamplingParams.cache_salt: prefix-cache hits only within one salt

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        k = self.truncate_prompt_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not (k >= 1 or k == -1)):
            raise ValueError(f"PoolingParams.truncate_prompt_tokens must be an int >= 1, -1 (max_model_len) or None, "
                             f"got {k!r}")
        value = self.dimensions
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"PoolingParams.dimensions must be an int >= 1 or None, got {value!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"PoolingParams.normalize must be a bool or None, got {self.normalize!r}")
        salt = self.cache_salt
        if salt is not None and not (isinstance(salt, str) and 0 < len(salt) <= MAX_CACHE_SALT_CHARS):
            shown = f"a string of {len(salt)} characters" if isinstance(salt, str) and len(salt) > 40 else repr(salt)
            raise ValueError(f"PoolingParams.cache_salt must be None or a non-empty string of at most "
                             f"{MAX_CACHE_SALT_CHARS} characters, got {shown}")
