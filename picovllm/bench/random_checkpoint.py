"""Random-weight HF checkpoints of a real model's shape, for benchmarks that need no real weights.

The folder holds config.json and model.safetensors (no tokenizer), so prompts are token ids.
Weights are N(0, 0.02), norms are ones: numerically tame, so the speed is the speed of real weights.
"""
from __future__ import annotations

import json
import os

import torch

PRESETS: dict[str, dict] = {
    # Qwen3-0.6B's shape: the model nano-vllm's benchmark uses.
    "qwen3-0.6b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936,
                       hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, rope_theta=1_000_000.0,
                       rms_norm_eps=1e-6, max_position_embeddings=40960, hidden_act="silu",
                       bos_token_id=151643, eos_token_id=151645),
    # The same family at toy size, for tests (its vocabulary holds the workloads' token ids, < 10001).
    "tiny-qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=10240, hidden_size=64,
                       intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=32, tie_word_embeddings=True, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                       max_position_embeddings=2048, hidden_act="silu", bos_token_id=0, eos_token_id=1),
}


def resolve_config(preset_or_file: str) -> dict:
    """A preset name, or a path to a config.json (HF field names)."""
    if preset_or_file in PRESETS:
        return dict(PRESETS[preset_or_file])
    if os.path.isfile(preset_or_file):
        with open(preset_or_file) as f:
            return json.load(f)
    raise ValueError(f"random model {preset_or_file!r}: neither a preset ({', '.join(PRESETS)}) nor a config.json file")


def _tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, d, inter = cfg["hidden_size"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"], \
        cfg["intermediate_size"]
    nq, nkv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    arch = cfg["architectures"][0]
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], h), "model.norm.weight": (h,)}
    if not cfg.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (cfg["vocab_size"], h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (nq * d, h), p + "self_attn.k_proj.weight": (nkv * d, h),
            p + "self_attn.v_proj.weight": (nkv * d, h), p + "self_attn.o_proj.weight": (h, nq * d),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        })
        if arch == "Qwen3ForCausalLM":
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        if arch == "Qwen2ForCausalLM":
            for n, size in (("q", nq * d), ("k", nkv * d), ("v", nkv * d)):
                shapes[p + f"self_attn.{n}_proj.bias"] = (size,)
    return shapes


def make_random_checkpoint(path: str, preset_or_file: str = "qwen3-0.6b", dtype: str = "bfloat16",
                           seed: int = 0) -> str:
    """Write a random-weight checkpoint into folder `path` and return it."""
    from safetensors.torch import save_file

    from picovllm.config import dtype_from_name

    torch_dtype = dtype_from_name(dtype)
    cfg = resolve_config(preset_or_file)
    cfg["torch_dtype"] = str(torch_dtype).removeprefix("torch.")
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in _tensor_shapes(cfg).items():
        if len(shape) == 1 and "norm" in name:
            t = torch.ones(shape)
        else:
            t = torch.randn(shape, generator=gen) * 0.02
        tensors[name] = t.to(torch_dtype)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return path


def write_word_tokenizer(path: str, vocab_size: int) -> str:
    """Add a tokenizer to a random checkpoint: token i is the word `t<i>`, words are space-separated. Every
    token then decodes to text, which an online benchmark needs to time each one (servers stream text)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(path)
    return path
