"""GLM-4 and GLM-4.5 from GGUF files as llama.cpp writes them (architectures "glm4" and "glm4moe"), written here from
tiny random HF checkpoints (test_glm.py's shapes) the way llama.cpp's converter (Glm4Model, Glm4MoeModel) lays them
out: q/k rows as the checkpoint has them (glm4's rope is llama.cpp's interleaved kind, glm4moe's rotate-half; no
permutation), rope.dimension_count the rotated half of head_dim; GLM-4's post-attention norm as post_attention_norm,
its pre-MLP norm as ffn_norm, its post-MLP norm as post_ffw_norm, gate/up fused in ffn_up; GLM-4.5's pre-MLP norm as
post_attention_norm, experts stacked per projection, shared experts as ffn_*_shexp, the router F32, the correction
bias as exp_probs_b.bias, the routing keys (sigmoid gating, groups, scale, norm, leading dense blocks), and its MTP
layer appended as one more block (block_count + nextn_predict_layers, with its nextn.* tensors).

The oracle is HF transformers on the HF folder (fp32, CPU): greedy tokens and logprobs; an F16 file against HF on the
folder rounded to float16. An F32 file fills the very parameters picovllm fills from the HF folder, and its config is
the folder's. A Q8_0 file's matrices stay quantized (GLM-4's reordered q/k rows and split gate/up too), each the
weight the same file dequantized gives. What a file says and picovllm cannot do is refused, naming the key or tensor.
"""
import dataclasses
import json
import os

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from picovllm import LLM
from gguf_writing import (assert_packed_as_float, greedy, hf_folders, prompt_logprob_errors, random_prompts,
                          set_or_remove, write_file)
from test_parity_hf import LOGPROB_ATOL, hf_greedy

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 384
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=1, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1,
            eos_token_id=2, pad_token_id=0, initializer_range=0.1)
CASES = {
    "glm4": ("Glm4Config", dict(partial_rotary_factor=0.5)),
    "glm4_moe": ("Glm4MoeConfig", dict(partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True,
                                       n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
                                       routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
                                       n_shared_experts=1, moe_intermediate_size=32, num_nextn_predict_layers=1)),
}


def build(path: str, case: str, f16: bool = False) -> str:
    """A random checkpoint of the case (every norm, bias and routing choice matters; peaked attention, so the
    rotation's pairing shows); GLM-4.5's with an MTP layer's tensors (model.layers.2.*); f16: its matrices rounded
    to float16 (the router's excepted: the converter keeps it F32)."""
    import transformers
    from safetensors.torch import save_file

    cls, extra = CASES[case]
    torch.manual_seed(len(case))
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**BASE, **extra),
                                                          dtype=torch.float32)
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("gate.weight"):
                p.copy_(0.5 * torch.randn_like(p))
            elif name.endswith(("e_score_correction_bias", "bias")):
                p.copy_(0.3 * torch.randn_like(p))
            elif "q_proj" in name or "k_proj" in name:
                p.mul_(4)
            if f16 and p.dim() >= 2 and not name.endswith("gate.weight"):
                p.copy_(p.half().float())
    model.save_pretrained(path)
    if case == "glm4_moe":
        file = os.path.join(path, "model.safetensors")
        tensors = load_file(file)
        g = torch.Generator().manual_seed(1)
        mtp = {k.replace("model.layers.1.", "model.layers.2."): v.clone() for k, v in tensors.items()
               if k.startswith("model.layers.1.")}
        mtp.update({"model.layers.2.eh_proj.weight": torch.randn(64, 128, generator=g),
                    "model.layers.2.enorm.weight": torch.ones(64), "model.layers.2.hnorm.weight": torch.ones(64),
                    "model.layers.2.shared_head.norm.weight": torch.ones(64),
                    "model.layers.2.shared_head.head.weight": torch.randn(VOCAB, 64, generator=g),
                    "model.layers.2.embed_tokens.weight": torch.randn(VOCAB, 64, generator=g)})
        save_file({**tensors, **mtp}, file, metadata={"format": "pt"})
    return path


# -- the writer: llama.cpp's converter's layout -----------------------------------------------------------------
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}
_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "mlp.gate_up_proj": "ffn_up", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
          "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
          "mlp.shared_experts.down_proj": "ffn_down_shexp", "eh_proj": "nextn.eh_proj", "enorm": "nextn.enorm",
          "hnorm": "nextn.hnorm", "shared_head.head": "nextn.shared_head_head",
          "shared_head.norm": "nextn.shared_head_norm", "embed_tokens": "nextn.embed_tokens"}
_GLM4_NORMS = {"post_self_attn_layernorm": "post_attention_norm", "post_attention_layernorm": "ffn_norm",
               "post_mlp_layernorm": "post_ffw_norm"}
_GLM4_MOE_NORMS = {"post_attention_layernorm": "post_attention_norm"}
_EXPERT = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def _tensors(sd: dict, moe: bool) -> dict[str, np.ndarray]:
    """GGUF name -> array (torch dimension order)."""
    out, experts = {}, {}
    norms = _GLM4_MOE_NORMS if moe else _GLM4_NORMS
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
            experts.setdefault(blk + _EXPERT[parts[6]] + ".weight", {})[int(parts[5])] = w
        else:
            module, kind = rest.rsplit(".", 1)
            out[blk + (norms.get(module) or _LAYER[module]) + "." + kind] = w
    for name, by_expert in experts.items():
        out[name] = np.stack([by_expert[e] for e in sorted(by_expert)])
    return out


def write_gguf(folder: str, path: str, kind: str = "F32", extra=None) -> str:
    """kind: the matrices' type (F32, F16, Q8_0: the 2-D ones); norms, biases and the router F32, as the converter
    keeps them."""
    cfg = json.load(open(os.path.join(folder, "config.json")))
    sd = load_file(os.path.join(folder, "model.safetensors"))
    moe = cfg["model_type"] == "glm4_moe"
    arch = "glm4moe" if moe else "glm4"
    rope = cfg.get("rope_parameters") or {}
    w = gguf.GGUFWriter(path, arch)
    nextn = cfg.get("num_nextn_predict_layers", 0) if moe else 0
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"] + nextn)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_dimension_count(int(cfg["head_dim"] * rope.get("partial_rotary_factor",
                                                                cfg.get("partial_rotary_factor", 0.5))))
    if moe:
        w.add_expert_count(cfg["n_routed_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_group_count(cfg["n_group"])
        w.add_expert_group_used_count(cfg["topk_group"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_shared_count(cfg["n_shared_experts"])
        w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_scale(cfg["routed_scaling_factor"])
        w.add_expert_weights_norm(cfg["norm_topk_prob"])
        w.add_nextn_predict_layers(nextn)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    write_file(w, _tensors(sd, moe), kind, lambda name: "gate_inp" in name, extra)      # the router
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """case -> HF folder; "<case>_f16": the same weights rounded to float16, built at first use."""
    return hf_folders(tmp_path_factory.mktemp("gguf_glm"), build)


def prompts(seed: int = 0) -> list[list[int]]:
    return random_prompts(seed, (1, 7, 19, 36), VOCAB)


# case -> (HF folder, the file's matrices)
PARITY = {"glm4_f32": ("glm4", "F32"), "glm4_f16": ("glm4_f16", "F16"), "glm4_moe_f16": ("glm4_moe_f16", "F16")}


@pytest.mark.parametrize("case", list(PARITY))
def test_gguf_matches_hf(folders, tmp_path, case):
    """Greedy tokens and logprobs of HF on the same weights, chunked prefill over a paged cache."""
    folder, kind = PARITY[case]
    folder = folders(folder)
    path = write_gguf(folder, str(tmp_path / f"{case}.gguf"), kind)
    ps = prompts()
    ref, ref_lp = hf_greedy(folder, ps, 8)
    llm = LLM(path, block_size=4, num_kv_blocks=64, device="cpu", max_num_batched_tokens=16, quantization="none")
    assert llm.engine.model_config.architecture == ("Glm4MoeForCausalLM" if "moe" in case else "Glm4ForCausalLM")
    toks, lps = greedy(llm, ps, 8)
    assert toks == ref
    for lp, want in zip(lps, ref_lp):
        assert lp == pytest.approx(want, abs=LOGPROB_ATOL)


@pytest.mark.parametrize("case", list(CASES))
def test_the_parameters_and_config_are_the_hf_folders(folders, tmp_path, case):
    """Every parameter an F32 file fills (q/k rows, biases and q/k norms in the rotary order, GLM-4's split gate/up
    and four norms, GLM-4.5's experts, shared expert, router and correction bias; the MTP block not read) equals the
    one picovllm fills from the HF folder, and every config field is the folder's."""
    folder = folders(case)
    hf = LLM(folder, num_kv_blocks=16, device="cpu")
    ours = LLM(write_gguf(folder, str(tmp_path / "f.gguf")), num_kv_blocks=16, device="cpu", quantization="none")
    want = dict(hf.engine.runner.model.named_parameters())
    got = dict(ours.engine.runner.model.named_parameters())
    assert sorted(got) == sorted(want)
    for name, p in got.items():
        assert torch.equal(p, want[name]), name
    cfg, ref = ours.engine.model_config, hf.engine.model_config
    for field in dataclasses.fields(cfg):
        if field.name == "norm_topk_prob" and not ref.num_experts:    # no meaning without experts
            continue
        value, expected = getattr(cfg, field.name), getattr(ref, field.name)
        if isinstance(expected, float):
            assert value == pytest.approx(expected, rel=1e-6), field.name       # the file's float32
        else:
            assert value == expected, field.name
    if case == "glm4_moe":
        assert (cfg.num_hidden_layers, cfg.moe_layers, cfg.n_group, cfg.topk_group) == (2, [False, True], 4, 2)
    else:
        assert (cfg.rotary_dim, cfg.rotary_interleaved, cfg.attention_bias) == (8, True, True)


def test_q8_0_matrices_run_quantized(folders, tmp_path):
    """A Q8_0 GLM-4 file: q/k/v (q's and k's rows in the rotary order), o, the fused gate/up (split in two) and down
    stay quantized on the CPU, each holding the very weight the same file dequantized at load gives, and the model
    runs on them near the float file."""
    from picovllm.kernels.cpu.quant_gemm import isa
    if isa() is None:
        pytest.skip("the quantized CPU kernels need a C compiler and AVX2")
    path = write_gguf(folders("glm4"), str(tmp_path / "q.gguf"), "Q8_0")
    quantized = LLM(path, device="cpu", num_kv_blocks=32)
    floats = LLM(path, device="cpu", num_kv_blocks=32, quantization="none")
    assert_packed_as_float(quantized, floats, [layer + name for layer in ("layers.0.", "layers.1.") for name in (
        "self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")])
    errs = prompt_logprob_errors(floats, quantized, prompts(2)[2:])
    assert np.mean(errs) < 0.06 and max(errs) < 0.3, (np.mean(errs), max(errs))


@pytest.mark.parametrize("case,extra,match", [
    ("glm4_moe", set_or_remove("glm4moe.expert_gating_func", 1), "expert_gating_func=1"),
    ("glm4_moe", set_or_remove("glm4moe.expert_gating_func"), None),      # none: llama.cpp's sigmoid
    ("glm4_moe", set_or_remove("blk.1.exp_probs_b.bias"), "blk.1.exp_probs_b.bias' is missing"),
    ("glm4_moe", set_or_remove("blk.1.ffn_gate_inp.weight"), "blk.1.ffn_gate_inp.weight' is missing"),
    ("glm4_moe", set_or_remove("glm4moe.expert_weights_scale"), "expert_weights_scale' is missing"),
    ("glm4_moe", set_or_remove("glm4moe.expert_shared_count"), "expert_shared_count' is missing"),
    ("glm4_moe", set_or_remove("glm4moe.expert_group_count", 3), "expert_group_count=3"),
    ("glm4_moe", set_or_remove("glm4moe.expert_group_used_count", 5), "expert_group_used_count=5"),
    ("glm4_moe", set_or_remove("glm4moe.nextn_predict_layers", 3), "nextn_predict_layers=3"),
    # the MTP block read as a layer
    ("glm4_moe", set_or_remove("glm4moe.nextn_predict_layers"), "blk.2.nextn.eh_proj.weight"),
    ("glm4", set_or_remove("blk.1.post_ffw_norm.weight"), "blk.1.post_ffw_norm.weight' is missing"),
    ("glm4", set_or_remove("glm4.rope.dimension_sections", [2, 1, 1, 0]), "M-RoPE"),
    ("glm4", set_or_remove("glm4.feed_forward_length", 80), "'blk.0.ffn_up.weight': 192 rows"),
])
def test_what_cannot_be_honoured_is_refused(folders, tmp_path, case, extra, match):
    from picovllm.loader.gguf_file import open_gguf
    path = write_gguf(folders(case), str(tmp_path / "bad.gguf"), extra=extra)
    if match is None:
        cfg = open_gguf(path).config
        assert (cfg.scoring_func, cfg.num_hidden_layers) == ("sigmoid", 2)
        return
    with pytest.raises(ValueError, match=match):
        open_gguf(path)
