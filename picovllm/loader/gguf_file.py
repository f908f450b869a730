"""GGUF files of the llama architecture, dequantized to float at load time."""
from __future__ import annotations

import os

import numpy as np
import torch

from picovllm.config import ModelConfig
from picovllm.loader.source import ModelSource, WeightIterator

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")

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
}


def _hf_name(name: str) -> str:
    parts = name.split(".")
    if parts[0] == "blk":
        key = ".".join(["blk", "{}"] + parts[2:])
        if key in _NAMES:
            return _NAMES[key].format(parts[1])
    elif name in _NAMES:
        return _NAMES[name]
    raise ValueError(f"GGUF tensor {name!r}: unknown tensor name for the llama architecture")


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    # llama.cpp stores q/k rows with each head's two rotary halves interleaved; undo that.
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    v = f.contents()
    return v


def _required(reader, key: str, path: str):
    v = _field(reader, key)
    if v is None:
        raise ValueError(f"GGUF {path!r}: metadata key {key!r} is missing")
    return v


def open_gguf(path: str) -> ModelSource:
    import gguf

    reader = gguf.GGUFReader(path)
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF {path!r}: general.architecture={arch!r} is unsupported (only 'llama')")
    p = "llama."
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError(f"GGUF {path!r}: tensor 'token_embd.weight' is missing")
    emb = tensors["token_embd.weight"]
    heads = int(_required(reader, p + "attention.head_count", path))
    kv_heads = int(_field(reader, p + "attention.head_count_kv", heads))
    hidden = int(_required(reader, p + "embedding_length", path))
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    config = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=int(emb.shape[1]),
        hidden_size=hidden,
        intermediate_size=int(_required(reader, p + "feed_forward_length", path)),
        num_hidden_layers=int(_required(reader, p + "block_count", path)),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=int(_field(reader, p + "rope.dimension_count", hidden // heads)),
        rms_norm_eps=float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, p + "rope.freq_base", 10000.0)),
        max_position_embeddings=int(_field(reader, p + "context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensors,
        eos_token_ids=[int(eos)] if eos is not None else [],
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
    )

    def weights() -> WeightIterator:
        for t in reader.tensors:
            kind = t.tensor_type.name
            if kind not in SUPPORTED_TYPES:
                raise ValueError(f"GGUF tensor {t.name!r}: quantization {kind} is unsupported "
                                 f"(supported: {', '.join(SUPPORTED_TYPES)})")
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
            w = torch.from_numpy(np.array(arr, dtype=np.float32, copy=True)).reshape(
                tuple(int(s) for s in reversed(t.shape)))
            name = _hf_name(t.name)
            if name.endswith("q_proj.weight"):
                w = _unpermute(w, heads)
            elif name.endswith("k_proj.weight"):
                w = _unpermute(w, kv_heads)
            yield name, w

    folder, file = os.path.split(os.path.abspath(path))

    def load_tokenizer():
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(folder, gguf_file=file)

    has_tok = "tokenizer.ggml.tokens" in reader.fields
    return ModelSource(path, config, weights, load_tokenizer if has_tok else None)
