"""HF-format model folders: config.json, one or sharded *.safetensors, optional tokenizer files."""
from __future__ import annotations

import glob
import json
import os

from safetensors import safe_open

from picovllm.artifact_cache import file_identity
from picovllm.config import ModelConfig
from picovllm.loader.source import ModelSource, WeightIterator

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def open_folder(path: str) -> ModelSource:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise ValueError(f"model folder {path!r} has no config.json")
    with open(cfg_path) as f:
        raw = json.load(f)
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.exists(gen_path):
        with open(gen_path) as f:
            gen_eos = json.load(f).get("eos_token_id")
        if gen_eos is not None:
            raw = dict(raw, eos_token_id=gen_eos)
    config = ModelConfig.from_hf_dict(raw)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"model folder {path!r} has no *.safetensors files")

    def weights() -> WeightIterator:
        for file in files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

    has_tok = any(os.path.exists(os.path.join(path, n)) for n in TOKENIZER_FILES)

    def load_tokenizer():
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(path)

    identity = ("hf", raw, [(os.path.basename(f), file_identity(f, head_bytes=1 << 20)) for f in files])
    return ModelSource(path, config, weights, load_tokenizer if has_tok else None, identity)
