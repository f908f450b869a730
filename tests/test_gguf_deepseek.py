"""DeepSeek-V2 and -V3 from GGUF files as llama.cpp writes them (architecture "deepseek2"), written here from tiny
random HF checkpoints the way llama.cpp's converter (DeepseekV2Model) lays them out: experts stacked per projection,
shared experts as ffn_*_shexp, the router as ffn_gate_inp (F32), the correction bias as exp_probs_b.bias, the rope
rows as the checkpoint has them (interleaved pairs, not permuted); kv_b_proj either whole (attn_kv_b, with the older
files' key_length / value_length, head_count_kv = heads, no gating or group keys) or split per head into attn_k_b
(transposed) and attn_v_b (the newer files' form, with key_length_mla / value_length_mla, head_count_kv 1), YaRN's
mscale_all_dim as 0.1 times it (rope.scaling.yarn_log_multiplier).

The oracle is HF transformers on the HF folder (fp32, CPU): greedy tokens and logprobs; an F16 file against HF on the
folder rounded to float16. An F32 file fills the very parameters picovllm fills from the HF folder. V2: q from
q_proj (V2-Lite's), softmax routing limited to 2 of 4 groups (group_limited_greedy) scaled by 1.5, two shared experts,
a dense first layer. V3: q through its latent, sigmoid routing with a correction bias, 2 of 4 groups, renormalised
and scaled by 2.5, YaRN with mscale = mscale_all_dim = 0.707 (cos/sin unscaled, the scores' scale changed). A Q8_0
file's matrices stay quantized, each the weight the file dequantized gives (rope rows reordered alike); what a file
says and picovllm cannot do is refused, naming the key or tensor.
"""
import json
import os

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from picovllm import LLM
from gguf_writing import assert_packed_as_float, greedy, hf_folders, random_prompts, set_or_remove, write_file
from test_parity_hf import LOGPROB_ATOL, hf_greedy

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 384
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
            pad_token_id=0, initializer_range=0.1, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16,
            n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, moe_intermediate_size=32,
            first_k_dense_replace=1)
CASES = {
    "v2": ("DeepseekV2Config", dict(q_lora_rank=None, v_head_dim=24, topk_method="group_limited_greedy",
                                    routed_scaling_factor=1.5, n_shared_experts=2)),
    # V2-Lite's routing (greedy, no groups): what an older file, without group keys, can say
    "v2_lite": ("DeepseekV2Config", dict(q_lora_rank=None, v_head_dim=24, topk_method="greedy", n_group=1,
                                         topk_group=1, routed_scaling_factor=1.5, n_shared_experts=2)),
    "v3": ("DeepseekV3Config", dict(q_lora_rank=64, v_head_dim=56, routed_scaling_factor=2.5, norm_topk_prob=True,
                                    n_shared_experts=1, rope_interleave=True,
                                    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                     "original_max_position_embeddings": 64, "mscale": 0.707,
                                                     "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1})),
}


def build(path: str, case: str, f16: bool = False) -> str:
    """A random checkpoint of the case (weights scaled so that every norm, routing choice and the rope's pairing
    matter); f16: its matrices rounded to float16 (the router's excepted: the converter keeps it F32)."""
    import transformers

    cls, extra = CASES[case]
    torch.manual_seed(len(case) + 7 * (case == "v3"))
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**{**BASE, **extra}),
                                                          dtype=torch.float32)
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("gate.weight"):
                p.copy_(0.5 * torch.randn_like(p))
            elif name.endswith("e_score_correction_bias"):
                p.copy_(0.3 * torch.randn_like(p))
            elif "q_proj" in name or "q_b_proj" in name or "kv_a_proj" in name:
                p.mul_(4)
            if f16 and p.dim() >= 2 and not name.endswith("gate.weight"):
                p.copy_(p.half().float())
    model.save_pretrained(path)
    return path


# -- the writer: llama.cpp's converter's layout -----------------------------------------------------------------
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm",
          "self_attn.q_b_proj": "attn_q_b", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
          "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.kv_b_proj": "attn_kv_b",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp", "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
          "mlp.shared_experts.up_proj": "ffn_up_shexp", "mlp.shared_experts.down_proj": "ffn_down_shexp"}
_EXPERT = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def _tensors(sd: dict, cfg: dict, split: bool) -> dict[str, np.ndarray]:
    """GGUF name -> array (torch dimension order), in the converter's order of kinds."""
    out, experts = {}, {}
    h, nope, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    for name, t in sd.items():
        w = t.float().numpy()
        if name in _TOP:
            out[_TOP[name]] = w
            continue
        parts = name.split(".")
        blk, rest = f"blk.{parts[2]}.", ".".join(parts[3:])
        if rest == "mlp.gate.e_score_correction_bias":
            out[blk + "exp_probs_b.bias"] = w
        elif rest.startswith("mlp.experts."):                     # mlp.experts.E.gate_proj.weight
            e, proj = int(parts[5]), parts[6]
            experts.setdefault(blk + _EXPERT[proj] + ".weight", {})[e] = w
        elif rest == "self_attn.kv_b_proj.weight" and split:      # [H * (nope + v), rank] -> k_b^T, v_b
            kv = w.reshape(h, nope + v, -1)
            out[blk + "attn_k_b.weight"] = np.ascontiguousarray(kv[:, :nope].transpose(0, 2, 1))
            out[blk + "attn_v_b.weight"] = np.ascontiguousarray(kv[:, nope:])
        else:
            module, kind = rest.rsplit(".", 1)
            out[blk + _LAYER[module] + "." + kind] = w
    for name, by_expert in experts.items():
        out[name] = np.stack([by_expert[e] for e in sorted(by_expert)])
    return out


def write_gguf(folder: str, path: str, kind: str = "F32", split: bool = True, extra=None) -> str:
    """split: the newer converter's file (attn_k_b/attn_v_b, key_length_mla, head_count_kv 1, gating and group keys);
    else the older one's (attn_kv_b, key_length = the heads', no gating key, no group keys). kind: the matrices'
    type (F32, F16, Q8_0: 2-D matrices only); norms, biases and the router F32, as the converter keeps them."""
    cfg = json.load(open(os.path.join(folder, "config.json")))
    sd = load_file(os.path.join(folder, "model.safetensors"))
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kv_rank, nope, rd = cfg["kv_lora_rank"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
    w = gguf.GGUFWriter(path, "deepseek2")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(1 if split else cfg["num_attention_heads"])
    w.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(cfg["n_routed_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    sigmoid = cfg["model_type"] == "deepseek_v3"
    if split:
        w.add_expert_group_count(cfg["n_group"])
        w.add_expert_group_used_count(cfg["topk_group"])
    if split or sigmoid:              # V3's files always had it; V2's older ones did not
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if sigmoid else gguf.ExpertGatingFuncType.SOFTMAX)
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    w.add_vocab_size(cfg["vocab_size"])
    if cfg.get("q_lora_rank"):
        w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_kv_lora_rank(kv_rank)
    if split:
        w.add_key_length(kv_rank + rd)
        w.add_value_length(kv_rank)
        w.add_key_length_mla(nope + rd)
        w.add_value_length_mla(cfg["v_head_dim"])
    else:
        w.add_key_length(nope + rd)
        w.add_value_length(cfg["v_head_dim"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    if cfg.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(rd)
    w.add_bos_token_id(cfg["bos_token_id"])             # the tokenizer's special ids (no vocabulary here)
    w.add_eos_token_id(cfg["eos_token_id"])
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    write_file(w, _tensors(sd, cfg, split), kind, _converter_keeps_f32, extra)
    return path


def _converter_keeps_f32(name: str) -> bool:
    """Biases (exp_probs_b's included) and the router."""
    return not name.endswith(".weight") or "gate_inp" in name


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    """case -> HF folder; "<case>_f16": the same weights rounded to float16, built at first use."""
    return hf_folders(tmp_path_factory.mktemp("gguf_deepseek"), build)


def prompts(seed: int = 0) -> list[list[int]]:
    return random_prompts(seed, (1, 7, 20, 33), VOCAB)


# case -> (HF folder, the file's matrices, split kv_b)
PARITY = {"v2_f32_split": ("v2", "F32", True), "v2_lite_f16_whole": ("v2_lite_f16", "F16", False),
          "v3_f16_split": ("v3_f16", "F16", True), "v3_f32_whole": ("v3", "F32", False)}


@pytest.mark.parametrize("case", list(PARITY))
def test_gguf_matches_hf(folders, tmp_path, case):
    """Greedy tokens and logprobs of HF on the same weights, chunked prefill over a paged cache."""
    folder, kind, split = PARITY[case]
    folder = folders(folder)
    if case == "v3_f32_whole":    # an older V3 file has no group keys: llama.cpp runs it, and so do we, unlimited
        folder = _without_groups(folder, str(tmp_path / "ungrouped"))
    path = write_gguf(folder, str(tmp_path / f"{case}.gguf"), kind, split)
    ps = prompts()
    ref, ref_lp = hf_greedy(folder, ps, 8)
    llm = LLM(path, block_size=4, num_kv_blocks=64, device="cpu", max_num_batched_tokens=16, quantization="none")
    assert llm.engine.model_config.architecture == ("DeepseekV3ForCausalLM" if case.startswith("v3")
                                                    else "DeepseekV2ForCausalLM")
    toks, lps = greedy(llm, ps, 8)
    assert toks == ref
    for lp, want in zip(lps, ref_lp):
        assert lp == pytest.approx(want, abs=LOGPROB_ATOL)


def _without_groups(folder: str, dst: str) -> str:
    """A copy of the V3 folder routing without a group limit (n_group 1), as an older file without the keys."""
    import shutil
    shutil.copytree(folder, dst)
    cfg = json.load(open(os.path.join(dst, "config.json")))
    json.dump(dict(cfg, n_group=1, topk_group=1), open(os.path.join(dst, "config.json"), "w"))
    return dst


@pytest.mark.parametrize("case,split", [("v2", True), ("v3", True), ("v3", False)])
def test_the_parameters_are_the_hf_folders(folders, tmp_path, case, split):
    """Every parameter an F32 file fills (kv_b_proj put back together from attn_k_b and attn_v_b, the rope rows of
    q and kv_a_proj_with_mqa in rotate-half order, experts, shared experts, router, correction bias) equals the one
    picovllm fills from the HF folder, and the config is the folder's (but for the rope rows' order, which the
    GGUF loader has already undone, and the group limit an older file does not carry)."""
    folder = folders(case)
    hf = LLM(folder, num_kv_blocks=16, device="cpu")
    ours = LLM(write_gguf(folder, str(tmp_path / "f.gguf"), split=split), num_kv_blocks=16, device="cpu",
               quantization="none")
    want = dict(hf.engine.runner.model.named_parameters())
    got = dict(ours.engine.runner.model.named_parameters())
    assert sorted(got) == sorted(want)
    for name, p in got.items():
        assert torch.equal(p, want[name]), name
    cfg, ref = ours.engine.model_config, hf.engine.model_config
    assert (cfg.rotary_interleaved, ref.rotary_interleaved) == (False, True)
    for field in ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta",
                  "max_position_embeddings", "tie_word_embeddings", "q_lora_rank", "kv_lora_rank",
                  "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_experts", "num_experts_per_tok",
                  "moe_intermediate_size", "norm_topk_prob", "shared_expert_intermediate_size",
                  "shared_expert_gated", "scoring_func", "routed_scaling_factor", "moe_layers", "eos_token_ids",
                  "bos_token_id") + (("n_group", "topk_group") if split else ()):
        assert getattr(cfg, field) == getattr(ref, field), field
    assert cfg.attention_multiplier == pytest.approx(ref.attention_multiplier, rel=1e-6)
    assert cfg.rms_norm_eps == pytest.approx(ref.rms_norm_eps, rel=1e-6)       # the file's float32
    if case == "v3":
        assert {k: cfg.rope_scaling[k] for k in ("rope_type", "factor", "original_max_position_embeddings",
                                                  "mscale", "mscale_all_dim")} == \
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.707,
             "mscale_all_dim": 0.707}
    if not split:
        assert (cfg.n_group, cfg.topk_group) == (1, 1)


def test_q8_0_matrices_run_quantized(folders, tmp_path):
    """A Q8_0 file: the attention's matrices (q with its rope rows reordered, the latent projections, kv_b_proj, o)
    and the MLPs' stay quantized on the CPU, each holding the very weight the same file dequantized at load gives
    (the reordered rows included: no float path corrects them afterwards), and the model runs on them."""
    from picovllm.kernels.cpu.quant_gemm import isa
    if isa() is None:
        pytest.skip("the quantized CPU kernels need a C compiler and AVX2")
    path = write_gguf(folders("v3"), str(tmp_path / "q.gguf"), "Q8_0", split=False)
    quantized = LLM(path, device="cpu", num_kv_blocks=32)
    floats = LLM(path, device="cpu", num_kv_blocks=32, quantization="none")
    assert_packed_as_float(quantized, floats, [f"{layer}self_attn.{proj}" for layer in ("layers.0.", "layers.1.")
                                               for proj in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                                                            "o_proj")])
    toks, _ = greedy(quantized, prompts(2), 4)
    assert all(len(t) == 4 for t in toks)


def _with_bias(w, tensors):
    """exp_probs_b (V3's correction bias) in a softmax file."""
    tensors["blk.1.exp_probs_b.bias"] = np.zeros(8, dtype=np.float32)


@pytest.mark.parametrize("case,split,extra,match", [
    ("v3", True, set_or_remove("deepseek2.expert_gating_func", 3), "expert_gating_func=3"),
    ("v3", True, set_or_remove("deepseek2.expert_gating_func"), "expert_gating_func' is missing"),
    ("v3", True, set_or_remove("blk.1.exp_probs_b.bias"), "blk.1.exp_probs_b.bias' is missing"),
    ("v2", True, _with_bias, "correction bias on softmax routing"),
    ("v2", False, None, None),           # an older V2 file: no gating key, llama.cpp's softmax
    ("v3", True, set_or_remove("deepseek2.rope.scaling.yarn_log_multiplier"), "yarn_log_multiplier' is missing"),
    ("v3", True, set_or_remove("deepseek2.attention.q_lora_rank"), "q_lora_rank=None does not match"),
    ("v3", True, set_or_remove("deepseek2.expert_group_count", 3), "expert_group_count=3"),
    ("v3", True, set_or_remove("deepseek2.expert_group_used_count", 5), "expert_group_used_count=5"),
    ("v2", True, set_or_remove("deepseek2.attention.kv_lora_rank"), "kv_lora_rank' is missing"),
    ("v2", True, set_or_remove("blk.1.attn_v_b.weight"), "kv_b_proj.weight' is made of 1 file tensor"),
    ("v2", True, set_or_remove("deepseek2.attention.value_length_mla", 16), "attn_v_b.weight': shape"),
    ("v3", True, set_or_remove("deepseek2.rope.scaling.yarn_ext_factor", 0.5), "yarn_ext_factor"),
])
def test_what_cannot_be_honoured_is_refused(folders, tmp_path, case, split, extra, match):
    path = write_gguf(folders(case), str(tmp_path / "bad.gguf"), split=split, extra=extra)
    from picovllm.loader.gguf_file import open_gguf
    if match is None:
        cfg = open_gguf(path).config
        assert (cfg.architecture, cfg.scoring_func, cfg.n_group) == ("DeepseekV2ForCausalLM", "softmax", 1)
        return
    with pytest.raises(ValueError, match=match):
        open_gguf(path)
