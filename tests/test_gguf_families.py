"""GGUF files of Mistral and Mixtral (llama.cpp's llama architecture, with a window and with experts), Llama 3's
rope scaling (rope_freqs), Gemma 2 and 3, Qwen3-MoE, Qwen2-MoE, Phi-3, Granite, SmolLM3 and OLMo 2, written here from tiny random HF
checkpoints as llama.cpp's converter lays them out (q/k rows interleaved for llama, granite and smollm3, experts
stacked per projection, Gemma's norms stored as 1 + w, Phi-3's q/k/v and gate/up fused, LongRoPE factors and Llama 3's
divisors as tensors, Granite's scalings as metadata). The oracle is HF transformers on the HF folder (fp32, CPU): greedy tokens and
logprobs. F16 files are checked against HF on the same weights rounded to float16; Q8_0 files run quantized and
stay near the float file; what a file asks and picovllm cannot do is refused, naming it.
"""
import json
import math
import os
import random

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file

from picovllm import LLM, SamplingParams
from gguf_writing import prompt_logprob_errors
from test_parity_hf import LOGPROB_ATOL, hf_greedy

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 384
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
            pad_token_id=0)
# case -> (GGUF architecture, HF config class, config fields)
CASES = {
    "mistral_window": ("llama", "MistralConfig", dict(num_attention_heads=6, sliding_window=9)),
    "mixtral": ("llama", "MixtralConfig", dict(head_dim=16, num_local_experts=8, num_experts_per_tok=2,
                                               sliding_window=None)),
    # soft-caps that bite, a layer pattern that is not llama.cpp's default (so the file's must be read), F16
    "gemma2_f16": ("gemma2", "Gemma2Config", dict(head_dim=32, query_pre_attn_scalar=32, attn_logit_softcapping=2.0,
                                                  final_logit_softcapping=3.0, sliding_window=6,
                                                  layer_types=["full_attention", "sliding_attention"])),
    # 7 layers: llama.cpp's default pattern (every 6th global); query scale other than head_dim (attention.scale)
    "gemma3": ("gemma3", "Gemma3TextConfig", dict(
        head_dim=80, query_pre_attn_scalar=64, sliding_window=7, num_hidden_layers=7, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}})),
    # top-2 of 8, not renormalised (expert_weights_norm=false in the file), layer 1 dense
    "qwen3_moe": ("qwen3moe", "Qwen3MoeConfig", dict(head_dim=16, num_experts=8, num_experts_per_tok=2,
                                                     moe_intermediate_size=32, mlp_only_layers=[1],
                                                     norm_topk_prob=False)),
    # top-1 of 64, renormalised (llama.cpp's default: no key in the file)
    "qwen3_moe_64": ("qwen3moe", "Qwen3MoeConfig", dict(head_dim=16, num_experts=64, num_experts_per_tok=1,
                                                        moe_intermediate_size=32, norm_topk_prob=True)),
    # Llama 3's rope scaling (llama.cpp writes it as rope_freqs, a divisor per frequency): a 64-token original
    # context puts the 8 frequencies of head_dim 16 in all three bands (kept, blended, slowed by `factor`)
    "llama3": ("llama", "LlamaConfig", dict(rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    # YaRN as Qwen's long-context setting writes it (type, factor, original context): a 16-token original context
    # and the config's 32 positions, stretched to 64 (the longest prompt and its answer: 46)
    "qwen3_yarn": ("qwen3", "Qwen3Config", dict(head_dim=16, max_position_embeddings=32, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0})),
    "granite": ("granite", "GraniteConfig", dict(embedding_multiplier=3.0, residual_multiplier=0.5,
                                                  attention_multiplier=0.6, logits_scaling=2.5, initializer_range=0.2)),
    # 4 layers: llama.cpp's rule puts NoPE on the 4th (HF's default no_rope_layer_interval)
    "smollm3": ("smollm3", "SmolLM3Config", dict(num_hidden_layers=4, initializer_range=0.2)),
    # partial rotary (Phi-4-mini's kind): 12 of head_dim 16 rotate
    "phi3_partial": ("phi3", "Phi3Config", dict(num_attention_heads=4, partial_rotary_factor=0.75, sliding_window=None,
                                                initializer_range=0.2)),
    # top-2 of 8 beside a sigmoid-gated shared expert, q/k/v biases, layer 1 dense
    "qwen2_moe": ("qwen2moe", "Qwen2MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                                     shared_expert_intermediate_size=48, mlp_only_layers=[1],
                                                     norm_topk_prob=False)),
    "olmo2": ("olmo2", "Olmo2Config", dict(initializer_range=0.2)),
    "phi3_window": ("phi3", "Phi3Config", dict(num_attention_heads=6, num_key_value_heads=6, sliding_window=20)),
    "phi3_longrope": ("phi3", "Phi3Config", dict(
        sliding_window=None, original_max_position_embeddings=32, max_position_embeddings=512,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + 0.3 * i for i in range(8)],
                      "long_factor": [3.0 + 1.1 * i for i in range(8)]})),
}


def build(path: str, case: str) -> str:
    """A tiny random HF checkpoint; for an F16 case, its matrices rounded to float16 (what the file will hold)."""
    import transformers

    _, cls, extra = CASES[case]
    cfg = getattr(transformers, cls)(**{**BASE, **extra})
    torch.manual_seed(len(case))
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gemma = case.startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:        # HF starts norms at 1 (Gemma's at 0, as 1 + w): make each one matter
                p.copy_((not gemma) + 0.3 * torch.randn_like(p))
            elif name.endswith("gate.weight"):     # routers: decisive top-k choices
                p.copy_(0.5 * torch.randn_like(p))
            elif gemma and ("q_proj" in name or "k_proj" in name):   # scores of a few units: the soft-cap bites
                p.mul_(10)
            if case.endswith("f16") and p.dim() >= 2:
                p.copy_(p.half().float())
    model.save_pretrained(path)
    return path


# -- the writer: llama.cpp's converter's layout -----------------------------------------------------------
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.qkv_proj": "attn_qkv", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
          "block_sparse_moe.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
          "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
          "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
_GEMMA = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
          "post_feedforward_layernorm": "post_ffw_norm"}
_OLMO2 = {"post_attention_layernorm": "post_attention_norm", "post_feedforward_layernorm": "post_ffw_norm"}
_EXPERT = {"gate_proj": "ffn_gate_exps", "w1": "ffn_gate_exps", "up_proj": "ffn_up_exps", "w3": "ffn_up_exps",
           "down_proj": "ffn_down_exps", "w2": "ffn_down_exps"}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k permutation: each head's two rotary halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensors(sd: dict, cfg: dict, arch: str) -> dict[str, np.ndarray]:
    """GGUF name -> array, experts stacked [E, rows, cols]."""
    out, experts = {}, {}
    for name, t in sd.items():
        w = t.float().numpy()
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            gg = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm",
                  "lm_head.weight": "output"}[name]
        else:
            layer, rest = name.split(".")[2], ".".join(name.split(".")[3:-1])
            if ".experts." in f".{rest}.":
                _, e, proj = rest.rsplit(".", 2)
                experts.setdefault(f"blk.{layer}.{_EXPERT[proj]}", {})[int(e)] = w
                continue
            post = _GEMMA if arch.startswith("gemma") else _OLMO2 if arch == "olmo2" else {}
            gg = f"blk.{layer}.{post.get(rest) or _LAYER[rest]}"
            if arch in ("llama", "granite", "smollm3") and rest in ("self_attn.q_proj", "self_attn.k_proj"):
                w = _permute(w, cfg["num_attention_heads" if "q_proj" in rest else "num_key_value_heads"])
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            w = w + 1
        if name.endswith("shared_expert_gate.weight"):      # llama.cpp's loader takes it as a vector
            w = w.reshape(-1)
        out[f"{gg}.{name.rsplit('.', 1)[1]}"] = w
    for gg, by_e in experts.items():
        out[f"{gg}.weight"] = np.stack([by_e[e] for e in sorted(by_e)])
    return out


def _rope(cfg: dict, kind: str = "full_attention") -> dict:
    params = cfg.get("rope_parameters") or {}
    return params.get(kind, params) if kind in params else {"rope_theta": cfg.get("rope_theta", 10000.0), **params}


def write_gguf(folder: str, case: str, path: str, kind: str = "F32", extra=None) -> str:
    arch = CASES[case][0]
    cfg = json.load(open(os.path.join(folder, "config.json")))
    sd = load_file(os.path.join(folder, "model.safetensors"))
    w = gguf.GGUFWriter(path, arch)
    heads, layers = cfg["num_attention_heads"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(layers)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(int(head_dim * (cfg.get("partial_rotary_factor")
                                               or _rope(cfg).get("partial_rotary_factor", 1.0))))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = _rope(cfg)
    w.add_rope_freq_base(rope["rope_theta"])
    if cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])
    if arch.startswith("gemma"):
        for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
            if cfg.get(cap):
                getattr(w, f"add_{cap}")(cfg[cap])
        if cfg["query_pre_attn_scalar"] != head_dim:
            w.add_attention_scale(cfg["query_pre_attn_scalar"] ** -0.5)
        if arch == "gemma2":      # the converter of newer models writes the per-layer pattern
            w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
        else:
            w.add_rope_freq_base_swa(_rope(cfg, "sliding_attention")["rope_theta"])
        if rope.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if arch == "granite":
        w.add_embedding_scale(cfg["embedding_multiplier"])
        w.add_residual_scale(cfg["residual_multiplier"])
        w.add_attention_scale(cfg["attention_multiplier"])
        w.add_logit_scale(cfg["logits_scaling"])
    n_experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if n_experts:
        w.add_expert_count(n_experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if cfg.get("moe_intermediate_size"):
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("norm_topk_prob") is False and arch != "qwen2moe":     # llama.cpp's default for qwen2moe
            w.add_expert_weights_norm(False)
        if cfg.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    tensors = _tensors(sd, cfg, arch)
    rs = cfg.get("rope_scaling") or (rope if rope.get("rope_type") == "longrope" else None)
    if arch == "phi3" and rs:                       # LongRoPE: the factors as tensors, the attention factor
        orig = cfg["original_max_position_embeddings"]
        w.add_rope_scaling_orig_ctx_len(orig)
        scale = cfg["max_position_embeddings"] / orig
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)))
        tensors["rope_factors_short.weight"] = np.array(rs["short_factor"], dtype=np.float32)
        tensors["rope_factors_long.weight"] = np.array(rs["long_factor"], dtype=np.float32)
    if arch == "llama" and rope.get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = _llama3_divisors(rope, head_dim)
    if extra is not None:
        extra(w, tensors)
    for name, data in tensors.items():
        if data.ndim >= 2 and kind == "F16":
            w.add_tensor(name, data.astype(np.float16))
        elif data.ndim >= 2 and kind == "Q8_0" and data.shape[-1] % 32 == 0 and "gate_inp" not in name:
            w.add_tensor(name, gguf.quants.quantize(data, Q.Q8_0), raw_dtype=Q.Q8_0)
        else:                                       # norms and the router stay float32, as the converter keeps them
            w.add_tensor(name, data.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _llama3_divisors(rope: dict, head_dim: int) -> np.ndarray:
    """What llama.cpp's converter stores for Llama 3's scaling: per rotary frequency, what it is divided by (1 for
    wavelengths under original / high_freq_factor, `factor` over original / low_freq_factor, blended between)."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    original = rope["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * rope["rope_theta"] ** (i / head_dim)
        if wavelength < original / high:
            out.append(1.0)
        elif wavelength > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("gguf_families")
    return {case: build(str(root / case), case) for case in CASES}


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 7, 19, 36)]


EXPECTED = {"mistral_window": "MistralForCausalLM", "mixtral": "MixtralForCausalLM", "gemma2_f16": "Gemma2ForCausalLM",
            "gemma3": "Gemma3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "qwen3_moe_64": "Qwen3MoeForCausalLM",
            "phi3_window": "Phi3ForCausalLM", "phi3_longrope": "Phi3ForCausalLM", "llama3": "LlamaForCausalLM",
            "granite": "GraniteForCausalLM", "smollm3": "SmolLM3ForCausalLM", "phi3_partial": "Phi3ForCausalLM",
            "qwen2_moe": "Qwen2MoeForCausalLM", "olmo2": "Olmo2ForCausalLM", "qwen3_yarn": "Qwen3ForCausalLM"}


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_matches_hf(models, tmp_path, case):
    kind = "F16" if case.endswith("f16") else "F32"
    path = write_gguf(models[case], case, str(tmp_path / f"{case}.gguf"), kind)
    ps = prompts()
    if case == "phi3_longrope":          # within the original 32 positions, and a prompt past them
        ps = [p[:20] for p in ps[:3]] + [ps[3] + ps[2]]
    ref, ref_lp = hf_greedy(models[case], ps, 10)
    llm = LLM(path, block_size=4, num_kv_blocks=128, device="cpu", max_num_batched_tokens=16, quantization="none")
    assert llm.engine.model_config.architecture == EXPECTED[case]
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    for o, lp in zip(outs, ref_lp):
        assert [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] == \
            pytest.approx(lp, abs=LOGPROB_ATOL)


def test_config_read_from_the_metadata(models, tmp_path):
    """What the parity above rests on, field by field, where a wrong reading could still pass by chance."""
    from picovllm.loader.gguf_file import open_gguf

    def no_attention_scale(w, tensors):
        for kv in w.kv_data:
            kv.pop("granite.attention.scale", None)
    # Granite without attention.scale: llama.cpp's rule, head_dim ** -0.5 (the multiplier left unset)
    cfg = open_gguf(write_gguf(models["granite"], "granite", str(tmp_path / "gr.gguf"), extra=no_attention_scale)).config
    assert cfg.attention_multiplier is None and cfg.logits_scaling == 2.5
    cfg = open_gguf(write_gguf(models["gemma3"], "gemma3", str(tmp_path / "g3.gguf"))).config
    assert cfg.sliding_layers == [True] * 5 + [False, True] and cfg.sliding_window == 7
    assert (cfg.query_pre_attn_scalar, cfg.rope_local_theta, cfg.rope_theta) == pytest.approx((64, 100.0, 10000.0))
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0} and cfg.hidden_act == "gelu_pytorch_tanh"
    cfg = open_gguf(write_gguf(models["qwen3_yarn"], "qwen3_yarn", str(tmp_path / "y.gguf"))).config
    assert cfg.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    assert cfg.max_position_embeddings == 64          # 16 x 4, past the file's context_length of 32
    cfg = open_gguf(write_gguf(models["gemma2_f16"], "gemma2_f16", str(tmp_path / "g2.gguf"))).config
    assert cfg.sliding_layers == [False, True] and cfg.query_pre_attn_scalar == 32
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (2.0, 3.0)
    cfg = open_gguf(write_gguf(models["qwen3_moe"], "qwen3_moe", str(tmp_path / "q.gguf"))).config
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.intermediate_size) == \
        (8, 2, 32, 96)
    assert cfg.moe_layers == [True, False] and cfg.norm_topk_prob is False


@pytest.mark.parametrize("case", ["mixtral", "phi3_window", "gemma3", "qwen2_moe"])
def test_q8_0_gguf_runs_quantized_and_close_to_float(models, tmp_path, case):
    """Q8_0 matrices (Phi-3's fused q/k/v split into the three layers' rows) stay quantized on the CPU; the stacked
    experts are dequantized to float; the prompt's logprobs stay near the float file's."""
    from picovllm.kernels.cpu.quant_gemm import QuantizedWeight, isa
    if isa() is None:
        pytest.skip("the quantized CPU kernels need a C compiler and AVX2")
    f32 = LLM(write_gguf(models[case], case, str(tmp_path / "f.gguf")), device="cpu", num_kv_blocks=64,
              quantization="none")
    q8 = LLM(write_gguf(models[case], case, str(tmp_path / "q.gguf"), "Q8_0"), device="cpu", num_kv_blocks=64)
    packed = [n for n, m in q8.engine.runner.model.named_modules()
              if isinstance(getattr(m, "packed", None), QuantizedWeight)]
    assert any("qkv_proj" in n for n in packed) and "lm_head" in packed
    errs = prompt_logprob_errors(f32, q8, prompts(2)[2:])
    assert 0 < np.mean(errs) < 0.06 and max(errs) < 0.3, (np.mean(errs), max(errs))


def test_partial_rotary_rows_reordered_alike_quantized_and_float(models, tmp_path):
    """Partial rotary reorders q's and k's rows (layers/rotary.rotary_order): the quantized layer's rows are the
    float file's, each within its Q8_0 step, so both paths took the same order."""
    from picovllm.kernels.cpu.quant_gemm import isa
    if isa() is None:
        pytest.skip("the quantized CPU kernels need a C compiler and AVX2")
    f = LLM(write_gguf(models["phi3_partial"], "phi3_partial", str(tmp_path / "f.gguf")), device="cpu",
            num_kv_blocks=64, quantization="none")
    q = LLM(write_gguf(models["phi3_partial"], "phi3_partial", str(tmp_path / "q.gguf"), "Q8_0"), device="cpu",
            num_kv_blocks=64)
    for i in range(2):
        want = f.engine.runner.model.layers[i].self_attn.qkv_proj.weight
        got = q.engine.runner.model.layers[i].self_attn.qkv_proj.packed.dequantize()
        # Q8_0: a step of max / 127 a block, the step rounded to float16 (up to 127 x 2^-11 of a step more)
        step = want.abs().reshape(len(want), -1, 32).amax(-1, keepdim=True) / 127
        assert ((got - want).abs().reshape(step.shape[0], -1, 32) <= step * 0.57 + 1e-6).all()


def _set(key: str, value):
    """A writer hook: a tensor added, or a metadata key set (replacing the writer's own)."""
    def extra(w, tensors):
        if key.endswith(".weight"):
            tensors[key] = np.asarray(value, dtype=np.float32)
            return
        for kv in w.kv_data:
            kv.pop(key, None)
        (w.add_string if isinstance(value, str) else w.add_uint32)(key, value)
    return extra


@pytest.mark.parametrize("case,key,value,match", [
    ("mistral_window", "rope_freqs.weight", [1.0] * 4, "'rope_freqs.weight' has 4 values"),
    ("gemma3", "rope_freqs.weight", [1.0] * 40, "with another rope scaling"),
    ("mixtral", "llama.expert_gating_func", 2, "expert_gating_func"),
    ("qwen3_moe", "qwen3moe.expert_shared_count", 1, "shared experts"),
    ("qwen2_moe", "qwen2moe.expert_shared_count", 2, "shared experts"),
    ("olmo2", "olmo2.attention.sliding_window", 8, "OLMo 3"),
    ("gemma3", "gemma3.rope.scaling.type", "longrope", "rope.scaling.type"),     # without its factors
    ("gemma3", "gemma3.rope.scaling.type", "yarn", "rope.scaling.original_context_length"),
    ("qwen3_yarn", "qwen3.rope.scaling.yarn_log_multiplier", 1, "yarn_log_multiplier"),
    ("mistral_window", "llama.rope.dimension_count", 4, "full rotary"),
])
def test_what_cannot_be_honoured_is_refused(models, tmp_path, case, key, value, match):
    path = write_gguf(models[case], case, str(tmp_path / "bad.gguf"), extra=_set(key, value))
    with pytest.raises(ValueError, match=match):
        LLM(path, device="cpu", num_kv_blocks=16)
