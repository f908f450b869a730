"""Which tokenizer an engine uses: the model source's, or vLLM's --tokenizer (EngineConfig.tokenizer) from elsewhere."""
from __future__ import annotations

import os

from picovllm.config import EngineConfig
from picovllm.loader.source import ModelSource, open_model_source, resolve_model


def tokenizer_of(source: ModelSource, config: EngineConfig):
    """The tokenizer an engine of this config uses: config.tokenizer's, else the model source's, or None (none there,
    skip_tokenizer_init)."""
    if config.skip_tokenizer_init:
        return None
    if config.tokenizer is not None:
        return open_tokenizer(config.tokenizer, config.disk_cache)
    return None if source.load_tokenizer is None else source.load_tokenizer()


def open_tokenizer(name: str, disk_cache: bool = True):
    """vLLM's --tokenizer: an HF folder's or Hub repository's tokenizer files (no config.json needed), or a .gguf
    file's; ValueError naming EngineConfig.tokenizer when there is none to load."""
    from picovllm.loader.hf_folder import TOKENIZER_FILES
    try:
        path = resolve_model(name, weights_needed=False)
        if os.path.isdir(path):
            if not any(os.path.exists(os.path.join(path, n)) for n in TOKENIZER_FILES):
                raise ValueError(f"the folder has none of the tokenizer files {', '.join(TOKENIZER_FILES)}")
            from transformers import AutoTokenizer
            return AutoTokenizer.from_pretrained(path)
        load = open_model_source(path, disk_cache, weights_needed=False).load_tokenizer
        if load is None:
            raise ValueError("it holds no tokenizer")
        return load()
    except (ValueError, OSError) as e:
        raise ValueError(f"EngineConfig.tokenizer {name!r}: {e}") from None
