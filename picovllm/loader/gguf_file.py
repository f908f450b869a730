"""GGUF files of the llama, qwen2 and qwen3 architectures (llama.cpp's names), dequantized to float at load time
(or mapped from the artifact cache), or kept quantized (stored_weights)."""
from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
from typing import Iterator

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType

from picovllm.artifact_cache import ArtifactCache, file_identity, make_key
from picovllm.config import ModelConfig
from picovllm.loader import gguf_quants, gguf_tokenizer, tensor_file
from picovllm.loader.gguf_format import GGUFFile
from picovllm.loader.source import ModelSource, WeightIterator

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")

# general.architecture -> (the HF architecture, whether llama.cpp's converter interleaved the q/k rows' rotary
# halves: it does for llama, whose llama.cpp rope is the interleaved kind, not for the NeoX-rope qwen2 and qwen3)
ARCHITECTURES = {"llama": ("LlamaForCausalLM", True), "qwen2": ("Qwen2ForCausalLM", False),
                 "qwen3": ("Qwen3ForCausalLM", False)}

# GGUF tensor name -> HF tensor name ({} is the layer index)
_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{}.attn_norm.weight": "model.layers.{}.input_layernorm.weight",
    "blk.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "blk.{}.attn_q.weight": "model.layers.{}.self_attn.q_proj.weight",
    "blk.{}.attn_k.weight": "model.layers.{}.self_attn.k_proj.weight",
    "blk.{}.attn_v.weight": "model.layers.{}.self_attn.v_proj.weight",
    "blk.{}.attn_output.weight": "model.layers.{}.self_attn.o_proj.weight",
    "blk.{}.ffn_gate.weight": "model.layers.{}.mlp.gate_proj.weight",
    "blk.{}.ffn_up.weight": "model.layers.{}.mlp.up_proj.weight",
    "blk.{}.ffn_down.weight": "model.layers.{}.mlp.down_proj.weight",
    "blk.{}.attn_q.bias": "model.layers.{}.self_attn.q_proj.bias",            # qwen2
    "blk.{}.attn_k.bias": "model.layers.{}.self_attn.k_proj.bias",
    "blk.{}.attn_v.bias": "model.layers.{}.self_attn.v_proj.bias",
    "blk.{}.attn_q_norm.weight": "model.layers.{}.self_attn.q_norm.weight",  # qwen3
    "blk.{}.attn_k_norm.weight": "model.layers.{}.self_attn.k_norm.weight",
}


def _hf_name(name: str) -> str:
    parts = name.split(".")
    if parts[0] == "blk":
        key = ".".join(["blk", "{}"] + parts[2:])
        if key in _NAMES:
            return _NAMES[key].format(parts[1])
    elif name in _NAMES:
        return _NAMES[name]
    raise ValueError(f"GGUF tensor {name!r}: unknown tensor name (llama, qwen2 and qwen3 tensors are read)")


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    # llama.cpp stores q/k rows with each head's two rotary halves interleaved; undo that.
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _required(meta: dict, key: str, path: str):
    if key not in meta:
        raise ValueError(f"GGUF {path!r}: metadata key {key!r} is missing")
    return meta[key]


def _model_config(gf: GGUFFile) -> ModelConfig:
    meta, path = gf.metadata, gf.path
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF {path!r}: general.architecture={arch!r} is unsupported "
                         f"(supported: {', '.join(map(repr, ARCHITECTURES))})")
    p = arch + "."
    if "token_embd.weight" not in gf.tensors:
        raise ValueError(f"GGUF {path!r}: tensor 'token_embd.weight' is missing")
    heads = int(_required(meta, p + "attention.head_count", path))
    hidden = int(_required(meta, p + "embedding_length", path))
    eos = meta.get("tokenizer.ggml.eos_token_id")
    head_dim = meta.get(p + "attention.key_length", meta.get(p + "rope.dimension_count", hidden // heads))
    return ModelConfig(
        architecture=ARCHITECTURES[arch][0],
        vocab_size=int(gf.tensors["token_embd.weight"].shape[1]),
        hidden_size=hidden,
        intermediate_size=int(_required(meta, p + "feed_forward_length", path)),
        num_hidden_layers=int(_required(meta, p + "block_count", path)),
        num_attention_heads=heads,
        num_key_value_heads=int(meta.get(p + "attention.head_count_kv", heads)),
        head_dim=int(head_dim),
        rms_norm_eps=float(meta.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta.get(p + "rope.freq_base", 10000.0)),
        max_position_embeddings=int(meta.get(p + "context_length", 4096)),
        tie_word_embeddings="output.weight" not in gf.tensors,
        eos_token_ids=[int(eos)] if eos is not None else [],
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        attention_bias="blk.0.attn_q.bias" in gf.tensors,
        qk_norm="blk.0.attn_q_norm.weight" in gf.tensors,
    )


def _weight_specs(gf: GGUFFile) -> list[tuple[str, str, tuple[int, ...]]]:
    """(GGUF name, HF name, torch shape) of every tensor, in file order; unsupported types refused."""
    specs = []
    for t in gf.tensors.values():
        kind = GGMLQuantizationType(t.ggml_type).name
        if kind not in SUPPORTED_TYPES:
            raise ValueError(f"GGUF tensor {t.name!r}: quantization {kind} is unsupported "
                             f"(supported: {', '.join(SUPPORTED_TYPES)})")
        specs.append((t.name, _hf_name(t.name), tuple(reversed(t.shape))))
    return specs


def _dequantized(gf: GGUFFile, config: ModelConfig) -> WeightIterator:
    for gguf_name, name, shape in _weight_specs(gf):
        t = gf.tensors[gguf_name]
        kind = GGMLQuantizationType(t.ggml_type)
        rows = t.data.reshape(-1, t.data.size // max(1, int(np.prod(shape[:-1], dtype=np.int64))))
        w = torch.from_numpy(np.array(gguf.quants.dequantize(rows, kind), dtype=np.float32)).reshape(shape)
        yield name, w[_row_order(name, shape[0], config)]


def _row_order(name: str, rows: int, config: ModelConfig) -> torch.Tensor | slice:
    """The file's rows in HF order: for llama, llama.cpp stores q/k rows (and biases) with each head's two rotary
    halves interleaved."""
    if config.architecture != "LlamaForCausalLM":
        return slice(None)
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return _unpermute(torch.arange(rows), config.num_attention_heads)
    if name.endswith(("k_proj.weight", "k_proj.bias")):
        return _unpermute(torch.arange(rows), config.num_key_value_heads)
    return slice(None)


def _stored(gf: GGUFFile, config: ModelConfig) -> Iterator[tuple[str, object]]:
    """ModelSource.stored_weights: quantized 2-d tensors as DecodedBlocks (rows in HF order), the rest as float."""
    for gguf_name, name, shape in _weight_specs(gf):
        t = gf.tensors[gguf_name]
        kind = GGMLQuantizationType(t.ggml_type).name
        if kind not in gguf_quants.QUANTIZED_TYPES or len(shape) != 2:
            rows = t.data.reshape(-1, t.data.size // max(1, int(np.prod(shape[:-1], dtype=np.int64))))
            w = torch.from_numpy(np.array(gguf.quants.dequantize(rows, GGMLQuantizationType(t.ggml_type)),
                                          dtype=np.float32)).reshape(shape)
            yield name, w[_row_order(name, shape[0], config)]
            continue
        blocks = gguf_quants.decode_blocks(kind, t.data, *shape)
        order = _row_order(name, shape[0], config)
        yield name, blocks.take_rows(order.numpy() if isinstance(order, torch.Tensor) else order)


def open_gguf(path: str, cache: ArtifactCache | None = None) -> ModelSource:
    """A GGUF file as a ModelSource. With a cache, the first start stores the config, the converted
    tokenizer and the dequantized weights, and later starts map those instead of reading the file again."""
    identity = ("gguf", file_identity(path))
    if cache is not None:
        config_fields = [f.name for f in dataclasses.fields(ModelConfig)]     # config.json's schema
        key = make_key(identity, _transformers_version(), config_fields)
        folder = cache.get_or_build("gguf", key, lambda entry: _write_entry(GGUFFile(path), entry),
                                    os.path.abspath(path))
        if folder is not None:
            return _source_from_entry(path, folder, identity)
    return _source_from_file(GGUFFile(path), identity)


def _source_from_file(gf: GGUFFile, identity: tuple) -> ModelSource:
    config = _model_config(gf)
    _weight_specs(gf)                    # refuse unsupported tensors now, not halfway through loading
    has_tok = "tokenizer.ggml.tokens" in gf.metadata
    return ModelSource(gf.path, config, lambda: _dequantized(gf, config),
                       (lambda: gguf_tokenizer.from_metadata(gf.metadata, gf.path)) if has_tok else None, identity,
                       lambda: _stored(gf, config))


# -- the cache entry: config.json, tokenizer/ (save_pretrained), weights.safetensors ---------------
def _write_entry(gf: GGUFFile, folder: str) -> None:
    src = _source_from_file(gf, ())
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"model": dataclasses.asdict(src.config), "has_tokenizer": src.load_tokenizer is not None}, f)
    if src.load_tokenizer is not None:
        src.load_tokenizer().save_pretrained(os.path.join(folder, "tokenizer"))
    specs = [(name, shape) for _, name, shape in _weight_specs(gf)]
    tensor_file.write(os.path.join(folder, "weights.safetensors"), specs, src.weights())


def _source_from_entry(path: str, folder: str, identity: tuple) -> ModelSource:
    with open(os.path.join(folder, "config.json")) as f:
        entry = json.load(f)
    config = ModelConfig(**entry["model"])
    tok_dir = os.path.join(folder, "tokenizer")
    weights = os.path.join(folder, "weights.safetensors")
    return ModelSource(path, config, lambda: tensor_file.read(weights),
                       (lambda: gguf_tokenizer.load_saved(tok_dir)) if entry["has_tokenizer"] else None, identity,
                       lambda: _stored(GGUFFile(path), config))


def _transformers_version() -> str:
    """The tokenizer conversion is transformers': a new version may convert differently."""
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return "none"
