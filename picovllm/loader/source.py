from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

from picovllm.config import ModelConfig

if TYPE_CHECKING:
    import torch

WeightIterator = Iterator[tuple[str, "torch.Tensor"]]


@dataclass
class ModelSource:
    path: str
    config: ModelConfig
    weights: Callable[[], WeightIterator]                # HF-named tensors, full (unsharded)
    load_tokenizer: Callable[[], object] | None          # None: no tokenizer files (token-id prompts only)
    identity: tuple | None = None                        # what the weights' content rests on (cache keys)
    # GGUF: its tensors as the file stores them, HF-named: quantized ones as gguf_quants.DecodedBlocks, the
    # others as float32 tensors (None: no quantized form, e.g. an HF folder)
    stored_weights: Callable[[], Iterator[tuple[str, object]]] | None = None


def open_model_source(model: str | None, disk_cache: bool = True) -> ModelSource:
    """model: an HF folder, a .gguf file, "random:<preset>" (random weights of a benchmark preset's shape, made as
    they are loaded: picovllm/bench/random_checkpoint.py), or None for the default model. disk_cache: keep what is
    derived from a GGUF (tokenizer, dequantized weights) in the artifact cache (picovllm/artifact_cache.py)."""
    from picovllm.artifact_cache import ArtifactCache
    from picovllm.loader.default_model import default_model_path

    if model is not None and model.startswith("random:"):
        from picovllm.bench.random_checkpoint import random_source
        return random_source(model[len("random:"):])

    path = model if model is not None else default_model_path()
    if not os.path.exists(path):
        raise ValueError(f"model path {path!r} does not exist (give an HF model folder or a .gguf file)")
    if os.path.isdir(path):
        from picovllm.loader import hf_folder
        return hf_folder.open_folder(path)
    if path.endswith(".gguf"):
        from picovllm.loader import gguf_file   # needs the gguf package, which an HF-only setup may lack
        return gguf_file.open_gguf(path, ArtifactCache.from_env() if disk_cache else None)
    raise ValueError(f"model path {path!r} is neither a folder nor a .gguf file")
