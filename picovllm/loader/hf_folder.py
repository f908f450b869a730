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
                    t = f.get_tensor(name)
                    yield name, t if config.rotary_dim is None else _in_rotary_order(name, t, config)

    has_tok = any(os.path.exists(os.path.join(path, n)) for n in TOKENIZER_FILES)

    def load_tokenizer():
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(path)

    identity = ("hf", raw, [(os.path.basename(f), file_identity(f, head_bytes=1 << 20)) for f in files])
    return ModelSource(path, config, weights, load_tokenizer if has_tok else None, identity)


def _in_rotary_order(name: str, t, config: ModelConfig):
    """Partial rotary: q's and k's rows (Phi-3's fused q/k/v rows too), biases and per-head norms with each head's
    dims in layers/rotary.rotary_order; every other tensor as it is."""
    import torch

    from picovllm.layers.rotary import rotary_order
    d = config.head_dim
    order = torch.tensor(rotary_order(d, config.rotary_dim))
    if name.endswith((".q_norm.weight", ".k_norm.weight")):
        return t[order]

    def heads(rows):          # rows of whole heads, each in the order
        return rows.reshape(-1, d, *rows.shape[1:])[:, order].reshape(rows.shape)
    if ".q_proj." in name or ".k_proj." in name:
        return heads(t)
    if ".qkv_proj." in name:
        q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
        q_rows, k_rows, v_rows = t.split([q, kv, kv])
        return torch.cat([heads(q_rows), heads(k_rows), v_rows])
    return t

