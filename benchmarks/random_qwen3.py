"""Build a Qwen3-0.6B-shaped HF folder with random bf16 weights (no download needed).

    python benchmarks/random_qwen3.py /tmp/qwen3-0.6b-random
"""
from __future__ import annotations

import json
import os
import sys

import torch
from safetensors.torch import save_file

QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                  rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=True)


def build(path: str, seed: int = 0, **overrides) -> str:
    cfg = dict(QWEN3_0_6B, **overrides)
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    os.makedirs(path, exist_ok=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(seed)
    h, d, i = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def rnd(*shape):
        return (torch.randn(*shape, generator=g, device=dev) * 0.02).to(torch.bfloat16).cpu()

    w = {"model.embed_tokens.weight": rnd(cfg["vocab_size"], h),
         "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = rnd(cfg["vocab_size"], h)
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        w.update({p + "self_attn.q_proj.weight": rnd(hq * d, h), p + "self_attn.k_proj.weight": rnd(hkv * d, h),
                  p + "self_attn.v_proj.weight": rnd(hkv * d, h), p + "self_attn.o_proj.weight": rnd(h, hq * d),
                  p + "self_attn.q_norm.weight": torch.ones(d, dtype=torch.bfloat16),
                  p + "self_attn.k_norm.weight": torch.ones(d, dtype=torch.bfloat16),
                  p + "mlp.gate_proj.weight": rnd(i, h), p + "mlp.up_proj.weight": rnd(i, h),
                  p + "mlp.down_proj.weight": rnd(h, i),
                  p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                  p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)})
    save_file(w, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(dict(cfg, architectures=["Qwen3ForCausalLM"], model_type="qwen3", torch_dtype="bfloat16",
                       bos_token_id=151643, eos_token_id=151645), f, indent=1)
    return path


if __name__ == "__main__":
    print(build(sys.argv[1] if len(sys.argv) > 1 else "/tmp/qwen3-0.6b-random"))
