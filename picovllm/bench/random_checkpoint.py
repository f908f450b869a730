"""Random-weight HF checkpoints of a real model's shape, for benchmarks that need no real weights.

The folder holds config.json and model.safetensors (no tokenizer), so prompts are token ids.
Weights are N(0, 0.02), norms are ones (Gemma's zeros: its norms scale by 1 + w): numerically tame, so the speed is
the speed of real weights. A model too large to write (Qwen3-30B-A3B: 61 GB) need not be: the model path
"random:<preset>" (random_source) generates each tensor as it is loaded, on the GPU if there is one, the same
tensor for the same name and seed every time (random_tensor), so a peer can be given the same weights.
"""
from __future__ import annotations

import json
import os
import zlib

import torch

PRESETS: dict[str, dict] = {
    # Qwen3-0.6B's shape: the model nano-vllm's benchmark uses.
    "qwen3-0.6b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936,
                       hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, rope_theta=1_000_000.0,
                       rms_norm_eps=1e-6, max_position_embeddings=40960, hidden_act="silu",
                       bos_token_id=151643, eos_token_id=151645),
    # Qwen3-30B-A3B: 128 experts, top-8 (renormalised), 3.3B of 30.5B parameters active per token.
    "qwen3-30b-a3b": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936,
                          hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                          num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          tie_word_embeddings=False, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                          max_position_embeddings=40960, hidden_act="silu", bos_token_id=151643, eos_token_id=151645),
    # Mistral-7B-v0.3 (no sliding window).
    "mistral-7b": dict(architectures=["MistralForCausalLM"], model_type="mistral", vocab_size=32768, hidden_size=4096,
                       intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=128, tie_word_embeddings=False, rope_theta=1_000_000.0, rms_norm_eps=1e-5,
                       max_position_embeddings=32768, sliding_window=None, hidden_act="silu", bos_token_id=1,
                       eos_token_id=2),
    # Gemma-2-2B: alternating 4096-token windows, soft-caps, GeGLU, head_dim 256, a 256k vocabulary.
    "gemma2-2b": dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", vocab_size=256000, hidden_size=2304,
                      intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                      head_dim=256, query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0,
                      final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
                      rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=8192, bos_token_id=2,
                      eos_token_id=1, pad_token_id=0),
    # gpt-oss-20b: 32 experts top-4 with biases, attention sinks, 128-token windows on every other layer, YaRN x32
    # (the Hub's checkpoint is MXFP4; this one is the dense bf16 form, 20.9B parameters)
    "gpt-oss-20b": dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", vocab_size=201088,
                        hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
                        num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                        sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 12,
                        attention_bias=True, tie_word_embeddings=False, rms_norm_eps=1e-5,
                        rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                         "truncate": False, "original_max_position_embeddings": 4096,
                                         "rope_theta": 150000.0},
                        max_position_embeddings=131072, swiglu_limit=7.0, bos_token_id=199998, eos_token_id=200002),
    # GLM-4.5-Air: 128 experts top-8 (sigmoid routing, one group), a shared expert, layer 0 dense, q/k/v biases, half
    # of each head rotating; 106B parameters, 12B active (its MTP layer, read only by speculative decoding, left out)
    "glm-4.5-air": dict(architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", vocab_size=151552,
                        hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=128,
                        num_experts_per_tok=8, n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=1.0,
                        norm_topk_prob=True, first_k_dense_replace=1, num_hidden_layers=46, num_attention_heads=96,
                        num_key_value_heads=8, head_dim=128, partial_rotary_factor=0.5, attention_bias=True,
                        use_qk_norm=False, tie_word_embeddings=False, rope_theta=1_000_000.0, rms_norm_eps=1e-5,
                        max_position_embeddings=131072, hidden_act="silu", num_nextn_predict_layers=0,
                        pad_token_id=151329, eos_token_id=[151329, 151336, 151338]),
    # DeepSeek-V2-Lite: multi-head latent attention (q direct, a 512-dim KV latent, 128 + 64 / 128 head dims), 64
    # routed experts top-6 (softmax, greedy) beside 2 shared, layer 0 dense, YaRN; 15.7B parameters, 2.4B active
    "deepseek-v2-lite": dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", vocab_size=102400,
                             hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
                             n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2, first_k_dense_replace=1,
                             moe_layer_freq=1, topk_method="greedy", n_group=1, topk_group=1,
                             routed_scaling_factor=1.0, norm_topk_prob=False, num_hidden_layers=27,
                             num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512,
                             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, tie_word_embeddings=False,
                             rope_theta=10000.0, rope_scaling={"type": "yarn", "factor": 40, "beta_fast": 32,
                                                              "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707,
                                                              "original_max_position_embeddings": 4096},
                             max_position_embeddings=163840, rms_norm_eps=1e-6, hidden_act="silu",
                             bos_token_id=100000, eos_token_id=100001),
    # The same family at toy size, for tests (its vocabulary holds the workloads' token ids, < 10001).
    "tiny-qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=10240, hidden_size=64,
                       intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=32, tie_word_embeddings=True, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                       max_position_embeddings=2048, hidden_act="silu", bos_token_id=0, eos_token_id=1),
}
# The three families above at toy size (benchmarks/families_gpu.py --tiny, its test).
PRESETS["tiny-qwen3-moe"] = dict(PRESETS["qwen3-30b-a3b"], vocab_size=10240, hidden_size=64, intermediate_size=128,
                                 moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 max_position_embeddings=2048, bos_token_id=0, eos_token_id=1)
PRESETS["tiny-mistral"] = dict(PRESETS["mistral-7b"], vocab_size=10240, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               max_position_embeddings=2048, bos_token_id=0, eos_token_id=1)
PRESETS["tiny-gpt-oss"] = dict(PRESETS["gpt-oss-20b"], vocab_size=10240, hidden_size=64, intermediate_size=32,
                               num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, sliding_window=16,
                               layer_types=["sliding_attention", "full_attention"], max_position_embeddings=2048,
                               bos_token_id=0, eos_token_id=1)
PRESETS["tiny-glm-4.5"] = dict(PRESETS["glm-4.5-air"], vocab_size=10240, hidden_size=64, intermediate_size=128,
                               moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                               topk_group=2, routed_scaling_factor=2.5, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, pad_token_id=0,
                               bos_token_id=0, eos_token_id=1)
PRESETS["tiny-deepseek-v2-lite"] = dict(PRESETS["deepseek-v2-lite"], vocab_size=10240, hidden_size=64,
                                        intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
                                        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
                                        qk_rope_head_dim=16, v_head_dim=16, max_position_embeddings=2048,
                                        bos_token_id=0, eos_token_id=1)
PRESETS["tiny-gemma2"] = dict(PRESETS["gemma2-2b"], vocab_size=10240, hidden_size=64, intermediate_size=128,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                              query_pre_attn_scalar=32, sliding_window=64, max_position_embeddings=2048)


def resolve_config(preset_or_file: str) -> dict:
    """A preset name, or a path to a config.json (HF field names)."""
    if preset_or_file in PRESETS:
        return dict(PRESETS[preset_or_file])
    if os.path.isfile(preset_or_file):
        with open(preset_or_file) as f:
            return json.load(f)
    raise ValueError(f"random model {preset_or_file!r}: neither a preset ({', '.join(PRESETS)}) nor a config.json file")


def _tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """HF name -> shape, as the Hub's checkpoints of the family name their tensors (one per expert)."""
    h, d, inter = cfg["hidden_size"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"], \
        cfg["intermediate_size"]
    nq, nkv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    arch = cfg["architectures"][0]
    experts = cfg.get("num_experts") or cfg.get("n_routed_experts")     # GLM-4.5's name
    dense = set(cfg.get("mlp_only_layers") or range(cfg.get("first_k_dense_replace", 0)))
    if arch.startswith("Deepseek"):      # routed from first_k_dense_replace on, every moe_layer_freq-th layer
        freq = cfg.get("moe_layer_freq") or 1
        dense |= {i for i in range(cfg["num_hidden_layers"]) if i % freq}
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], h), "model.norm.weight": (h,)}
    if not cfg.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (cfg["vocab_size"], h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
        if cfg.get("kv_lora_rank"):         # DeepSeek's latent attention
            a, rank, qk = p + "self_attn.", cfg["kv_lora_rank"], cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
            qr = cfg.get("q_lora_rank")
            shapes.update({a + "kv_a_proj_with_mqa.weight": (rank + cfg["qk_rope_head_dim"], h),
                           a + "kv_a_layernorm.weight": (rank,),
                           a + "kv_b_proj.weight": (nq * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), rank),
                           a + "o_proj.weight": (h, nq * cfg["v_head_dim"])})
            if qr:          # q through its own latent
                shapes.update({a + "q_a_proj.weight": (qr, h), a + "q_a_layernorm.weight": (qr,),
                               a + "q_b_proj.weight": (nq * qk, qr)})
            else:
                shapes[a + "q_proj.weight"] = (nq * qk, h)
            if cfg.get("attention_bias"):
                for n, size in (("q_a_proj", qr), ("kv_a_proj_with_mqa", rank + cfg["qk_rope_head_dim"]),
                                ("o_proj", h)):
                    if size:
                        shapes[a + n + ".bias"] = (size,)
        else:
            shapes.update({
                p + "self_attn.q_proj.weight": (nq * d, h), p + "self_attn.k_proj.weight": (nkv * d, h),
                p + "self_attn.v_proj.weight": (nkv * d, h), p + "self_attn.o_proj.weight": (h, nq * d),
            })
        if arch == "GptOssForCausalLM":      # stacked experts, [E, in, out] (gate/up interleaved), biases, sinks
            e, mi = cfg["num_local_experts"], cfg["intermediate_size"]
            q = p + "mlp.experts."
            shapes.update({p + "mlp.router.weight": (e, h), p + "mlp.router.bias": (e,),
                           q + "gate_up_proj": (e, h, 2 * mi), q + "gate_up_proj_bias": (e, 2 * mi),
                           q + "down_proj": (e, mi, h), q + "down_proj_bias": (e, h),
                           p + "self_attn.sinks": (nq,), p + "self_attn.o_proj.bias": (h,)})
            for n, size in (("q", nq * d), ("k", nkv * d), ("v", nkv * d)):
                shapes[p + f"self_attn.{n}_proj.bias"] = (size,)
        elif experts and i not in dense:
            mi = cfg["moe_intermediate_size"]
            shapes[p + "mlp.gate.weight"] = (experts, h)
            for e in range(experts):
                q = f"{p}mlp.experts.{e}."
                shapes.update({q + "gate_proj.weight": (mi, h), q + "up_proj.weight": (mi, h),
                               q + "down_proj.weight": (h, mi)})
            shared = cfg.get("n_shared_experts", 1) if arch == "Glm4MoeForCausalLM" else cfg.get("n_shared_experts")
            if shared and arch in ("Glm4MoeForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
                si, q = mi * shared, p + "mlp.shared_experts."       # the shared experts as one MLP
                shapes.update({q + "gate_proj.weight": (si, h), q + "up_proj.weight": (si, h),
                               q + "down_proj.weight": (h, si)})
            if arch in ("Glm4MoeForCausalLM", "DeepseekV3ForCausalLM"):     # the router's correction bias
                shapes[p + "mlp.gate.e_score_correction_bias"] = (experts,)
        else:
            shapes.update({p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                           p + "mlp.down_proj.weight": (h, inter)})
        if arch.startswith("Gemma"):
            shapes[p + "pre_feedforward_layernorm.weight"] = shapes[p + "post_feedforward_layernorm.weight"] = (h,)
        if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM") or (arch == "Glm4MoeForCausalLM"
                                                                   and cfg.get("use_qk_norm")):
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        if arch == "Qwen2ForCausalLM" or (arch == "Glm4MoeForCausalLM" and cfg.get("attention_bias")):
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
    gemma = cfg["architectures"][0].startswith("Gemma")
    tensors = {name: random_tensor(name, shape, seed, torch_dtype, gemma=gemma)
               for name, shape in _tensor_shapes(cfg).items()}
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return path


def random_tensor(name: str, shape: tuple[int, ...], seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                  device: str | torch.device = "cpu", gemma: bool = False) -> torch.Tensor:
    """The tensor `name` of a random checkpoint: N(0, 0.02) from a generator seeded by the name and `seed` (the
    same on every call, on a given device), a norm all ones (Gemma's all zeros)."""
    if len(shape) == 1 and "norm" in name:
        return torch.full(shape, 0.0 if gemma else 1.0, dtype=dtype, device=device)
    gen = torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()) ^ seed)
    return (torch.randn(shape, generator=gen, device=device) * 0.02).to(dtype)


def random_source(preset_or_file: str, seed: int = 0):
    """A ModelSource (loader/source.py) whose weights are generated as they are loaded: the model path
    "random:<preset>" or "random:<config.json>" (with the tokenizer saved beside that file, if one is). The tensors
    are made on the GPU when there is one (a 30B model's in seconds), bf16."""
    from picovllm.config import ModelConfig
    from picovllm.layers.rotary import head_order
    from picovllm.loader.hf_folder import _in_rotary_order
    from picovllm.loader.source import ModelSource

    cfg = resolve_config(preset_or_file)
    config = ModelConfig.from_hf_dict(cfg)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gemma = cfg["architectures"][0].startswith("Gemma")
    order = head_order(config)      # partial rotary (GLM-4.5): q/k rows reordered, as the HF folder's loader does

    def weights():
        for name, shape in _tensor_shapes(cfg).items():
            t = random_tensor(name, shape, seed, torch.bfloat16, device, gemma)
            yield name, t if order is None else _in_rotary_order(name, t, config, order)

    tokenizer = None          # a config.json beside a tokenizer's files: that tokenizer (benchmarks that need text)
    folder = os.path.dirname(os.path.abspath(preset_or_file))
    if preset_or_file not in PRESETS and os.path.isfile(os.path.join(folder, "tokenizer.json")):
        def tokenizer():
            from transformers import AutoTokenizer
            return AutoTokenizer.from_pretrained(folder)

    return ModelSource(f"random:{preset_or_file}", config, weights, tokenizer)   # nothing cached


def write_word_tokenizer(path: str, vocab_size: int) -> str:
    """Add a tokenizer to a random checkpoint: token i is the word `t<i>`, words are space-separated. Every
    token then decodes to text, which an online benchmark needs to time each one (servers stream text)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(path)
    return path
