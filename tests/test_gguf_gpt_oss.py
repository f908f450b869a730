"""GPT-OSS from GGUF files as llama.cpp writes them (architecture "gpt-oss"), written here from a tiny random HF
GptOssForCausalLM checkpoint the way llama.cpp's converter (GptOssModel) lays it out: each projection's experts
stacked [E, out, in] with gate and up apart (the checkpoint's [E, in, 2 out] de-interleaved and transposed), their
biases [E, out], the router as ffn_gate_inp (+ bias), sinks as attn_sinks, the post-attention norm as
post_attention_norm; experts in MXFP4 (the checkpoint's blocks repacked into ggml's nibble order, a scale byte
first) or float; 1-D tensors, biases and the router in F32. The oracle is HF transformers on the same weights (fp32,
CPU): the F32 file's folder, the folder rounded to float16 for an F16 file, the MXFP4 blocks' dense values for an
MXFP4 one. The SwiGLU limit is llama.cpp's (7, hard-coded there): the HF model gets it in its config, and the weights
are large enough that the clamp bites. MXFP4 decoding is checked against gguf-py's own dequantizer and a block worked
out by hand.
"""
import json
import os

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file

from picovllm import LLM
from gguf_writing import greedy, prompt_logprob_errors, random_prompts, set_or_remove, write_file
from test_gpt_oss import CONFIG
from test_parity_hf import LOGPROB_ATOL, hf_greedy

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LIMIT = 7.0       # llama.cpp's SwiGLU limit for gpt-oss (build_moe_ffn: alpha 1.702, limit 7)


def build(path: str, f16: bool = False, soft: bool = False) -> str:
    """A tiny random HF GPT-OSS (init 0.2: activations of a few units; the experts' gate/up scaled up so that
    the clamp at 7 bites); f16: its matrices rounded to float16, as an F16 file holds them; soft: HF's usual scale
    (0.02), where 8-bit weights move the logprobs by thousandths (at 0.2 they flip routing choices: tenths)."""
    import transformers
    cfg = transformers.GptOssConfig(**{**CONFIG, "initializer_range": 0.02 if soft else 0.2}, swiglu_limit=LIMIT)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("sinks"):
                p.copy_((1.0 if soft else 2.0) * torch.randn_like(p))
            elif "bias" in name:
                p.copy_((0.02 if soft else 0.3) * torch.randn_like(p))
            elif "router.weight" in name and not soft:
                p.copy_(0.5 * torch.randn_like(p))
            elif name.endswith("gate_up_proj") and not soft:
                p.mul_(3)
            if f16 and p.dim() >= 2 and "router" not in name:
                p.copy_(p.half().float())
    model.save_pretrained(path)
    return path


def with_mxfp4_experts(folder: str, dst: str, scales_in: tuple[int, int] = (123, 128)) -> tuple[str, dict]:
    """A copy of `folder` whose experts are random MXFP4 weights (their dense values, as transformers dequantizes
    them; scale bytes in scales_in: powers of two 2^-4 .. 2^0), and the blocks and scales, HF's layout:
    NAME_blocks [E, out, in / 32, 16], NAME_scales [E, out, in / 32]."""
    import shutil

    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    shutil.copytree(folder, dst)
    sd = load_file(os.path.join(dst, "model.safetensors"))
    g, packed = torch.Generator().manual_seed(1), {}
    for name, t in list(sd.items()):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):          # [E, in, out]
            e, n_in, n_out = t.shape
            blocks = torch.randint(0, 256, (e, n_out, n_in // 32, 16), dtype=torch.uint8, generator=g)
            scales = torch.randint(*scales_in, (e, n_out, n_in // 32), dtype=torch.uint8, generator=g)
            sd[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            packed[name] = (blocks, scales)
    save_file(sd, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst, packed


# -- the writer: llama.cpp's converter's layout ------------------------------------------------------------------
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}
_LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
          "self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight",
          "mlp.router.bias": "ffn_gate_inp.bias", "mlp.experts.down_proj_bias": "ffn_down_exps.bias"}
_LAYER.update({f"self_attn.{x}_proj.{w}": f"attn_{y}.{w}" for x, y in
               (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output")) for w in ("weight", "bias")})


def ggml_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """HF's MXFP4 blocks (two neighbouring elements a byte, low nibble first) as ggml's: [..., groups * 17] bytes,
    each block its scale byte, then byte j = element j (low nibble) | element j + 16 (high nibble)."""
    codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).flatten(-2)              # [..., G, 32] in order
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    return torch.cat([scales[..., None], qs], dim=-1).flatten(-2).numpy()


def _tensors(sd: dict, packed: dict) -> dict[str, np.ndarray | tuple]:
    """GGUF name -> float array, or ("MXFP4", bytes) for the packed experts."""
    out = {}
    for name, t in sd.items():
        w = t.float().numpy()
        if name in _TOP:
            out[_TOP[name]] = w
            continue
        layer, rest = name.split(".")[2], ".".join(name.split(".")[3:])
        blk = f"blk.{layer}."
        if rest in _LAYER:
            out[blk + _LAYER[rest]] = w
        elif rest == "mlp.experts.gate_up_proj_bias":                     # [E, 2I], gate at even columns
            out[blk + "ffn_gate_exps.bias"], out[blk + "ffn_up_exps.bias"] = w[:, 0::2], w[:, 1::2]
        elif rest == "mlp.experts.gate_up_proj":                          # [E, H, 2I] -> [E, I, H] each
            if name in packed:
                blocks, scales = packed[name]                             # [E, 2I, H / 32, 16]
                for i, proj in enumerate(("gate", "up")):
                    out[f"{blk}ffn_{proj}_exps.weight"] = ("MXFP4", ggml_mxfp4(blocks[:, i::2], scales[:, i::2]))
            else:
                w = w.transpose(0, 2, 1)
                out[blk + "ffn_gate_exps.weight"], out[blk + "ffn_up_exps.weight"] = w[:, 0::2], w[:, 1::2]
        elif rest == "mlp.experts.down_proj":                             # [E, I, H] -> [E, H, I]
            out[blk + "ffn_down_exps.weight"] = ("MXFP4", ggml_mxfp4(*packed[name])) if name in packed \
                else w.transpose(0, 2, 1)
        else:
            raise KeyError(name)
    return out


def write_gguf(folder: str, path: str, kind: str = "F32", packed: dict | None = None, extra=None) -> str:
    """kind: the type of the matrices (F32, F16, Q8_0); 1-D tensors, biases and the router stay F32, as the
    converter keeps them; packed: MXFP4 experts (with_mxfp4_experts)."""
    cfg = json.load(open(os.path.join(folder, "config.json")))
    sd = load_file(os.path.join(folder, "model.safetensors"))
    rope = cfg.get("rope_parameters") or cfg["rope_scaling"]
    w = gguf.GGUFWriter(path, "gpt-oss")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_expert_feed_forward_length(cfg["intermediate_size"])
    write_file(w, _tensors(sd, packed or {}), kind, _converter_keeps_f32, extra)
    return path


def _converter_keeps_f32(name: str) -> bool:
    """Biases (and sinks: no .weight) and the router."""
    return not name.endswith(".weight") or "gate_inp" in name


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("gguf_gpt_oss")
    dense = build(str(root / "dense"))
    mxfp4, packed = with_mxfp4_experts(dense, str(root / "mxfp4"))
    return {"dense": dense, "f16": build(str(root / "f16"), f16=True), "mxfp4": mxfp4, "packed": packed}


def prompts(seed: int = 0) -> list[list[int]]:
    return random_prompts(seed, (1, 7, 16, 33), 384)


# case -> (HF folder, the file's matrices, MXFP4 experts, quantization)
CASES = {"f32": ("dense", "F32", False, "none"), "f16": ("f16", "F16", False, "none"),
         "mxfp4": ("mxfp4", "F32", True, "auto"), "mxfp4_f16": ("mxfp4", "F16", True, "none")}


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_matches_hf(folders, tmp_path, case):
    """Greedy tokens and logprobs of HF on the same weights; "auto" takes the stored-weights path (nothing here is
    of a quantized kernel's type), "none" the dequantized one (and its artifact-cache entry)."""
    folder, kind, mxfp4, quantization = CASES[case]
    if case == "mxfp4_f16":        # the folder's other matrices rounded as the file will hold them
        folder = build(str(tmp_path / "f16_hf"), f16=True)
        folder, packed = with_mxfp4_experts(folder, str(tmp_path / "f16_mxfp4"))
    else:
        folder, packed = folders[folder], folders["packed"] if mxfp4 else None
    path = write_gguf(folder, str(tmp_path / f"{case}.gguf"), kind, packed)
    ps = prompts()
    ref, ref_lp = hf_greedy(folder, ps, 10)
    llm = LLM(path, block_size=4, num_kv_blocks=128, device="cpu", max_num_batched_tokens=16,
              quantization=quantization)
    assert llm.engine.model_config.architecture == "GptOssForCausalLM"
    toks, lps = greedy(llm, ps, 10)
    assert toks == ref
    for lp, want in zip(lps, ref_lp):
        assert lp == pytest.approx(want, abs=LOGPROB_ATOL)


def test_the_parameters_are_the_hf_folders(folders, tmp_path):
    """What the parity rests on, where a wrong reading could pass by chance: every parameter the GGUF fills (experts
    de-interleaved, down transposed, router and its bias, sinks, biases) equals the one the HF folder fills; the clamp
    bites in these experts; the config as llama.cpp reads the file."""
    hf = LLM(folders["mxfp4"], num_kv_blocks=32, device="cpu", quantization="none")
    ours = LLM(write_gguf(folders["mxfp4"], str(tmp_path / "m.gguf"), packed=folders["packed"]), num_kv_blocks=32,
               device="cpu", quantization="none")
    want = dict(hf.engine.runner.model.named_parameters())
    got = dict(ours.engine.runner.model.named_parameters())
    assert sorted(got) == sorted(want)
    for name, p in got.items():
        assert torch.equal(p, want[name]), name
    cfg, ref = ours.engine.model_config, hf.engine.model_config
    assert (cfg.layer_window(0), cfg.layer_window(1), cfg.layer_window(2)) == (6, None, 6)
    assert cfg.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
    for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "swiglu_alpha",
                  "swiglu_limit", "attention_bias", "head_dim", "rope_theta", "max_position_embeddings",
                  "tie_word_embeddings", "sliding_window", "sliding_layers"):
        assert getattr(cfg, field) == getattr(ref, field), field
    # the clamp: some gate or up activation of these experts passes the limit on these prompts
    moe = ours.engine.runner.model.layers[0].mlp
    seen = []
    hook = moe.act.register_forward_hook(lambda m, args, out: seen.append(args[0].abs().max().item()))
    greedy(ours, prompts(3), 2)
    hook.remove()
    assert max(seen) > LIMIT


def test_q8_0_attention_runs_quantized_beside_mxfp4_experts(folders, tmp_path):
    """A file of llama.cpp's usual mix: Q8_0 matrices (q/k/v with their biases, o_proj with its bias, embedding,
    LM head) stay quantized on the CPU, the MXFP4 experts are dequantized; the prompt's logprobs stay near the
    all-float file's (on weights of HF's usual scale: at 0.2, Q8_0's rounding alone moves them by tenths)."""
    from picovllm.kernels.cpu.quant_gemm import QuantizedWeight, isa
    if isa() is None:
        pytest.skip("the quantized CPU kernels need a C compiler and AVX2")
    folder, packed = with_mxfp4_experts(build(str(tmp_path / "soft"), soft=True), str(tmp_path / "soft_mxfp4"),
                                        (119, 123))
    f32 = LLM(write_gguf(folder, str(tmp_path / "f.gguf"), packed=packed), device="cpu", num_kv_blocks=64,
              quantization="none")
    q8 = LLM(write_gguf(folder, str(tmp_path / "q.gguf"), "Q8_0", packed), device="cpu", num_kv_blocks=64)
    packed = [n for n, m in q8.engine.runner.model.named_modules()
              if isinstance(getattr(m, "packed", None), QuantizedWeight)]
    assert any("qkv_proj" in n for n in packed) and any("o_proj" in n for n in packed) and "lm_head" in packed
    errs = prompt_logprob_errors(f32, q8, prompts(2)[2:])
    assert 0 < np.mean(errs) < 0.01 and max(errs) < 0.05, (np.mean(errs), max(errs))


def test_mxfp4_blocks_decoded_as_gguf_py_does():
    """The decoder against gguf-py's (gguf.quants, an independent implementation of ggml's dequantize_row_mxfp4) on
    random blocks with every scale byte, 0 and 255 included, and on one block worked out by hand: scale byte 128
    (x 2), byte j = j | (15 - j) << 4, so element j is 2 * e2m1(j) and element j + 16 is 2 * e2m1(15 - j)."""
    from picovllm.loader.gguf_quants import dequantize_mxfp4
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (16, 16 * 17), dtype=np.uint8)
    raw.reshape(256, 17)[:, 0] = np.arange(256)                            # every scale byte once
    with np.errstate(over="ignore"):                                       # scale 255 x 6: inf, as in ggml
        want = gguf.quants.dequantize(raw, Q.MXFP4)
        got = dequantize_mxfp4(raw, 16, 512)
    assert got.dtype == np.float32 and np.array_equal(got, want)
    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    block = np.array([128] + [j | (15 - j) << 4 for j in range(16)], dtype=np.uint8)
    assert dequantize_mxfp4(block, 1, 32)[0].tolist() == [2 * v for v in e2m1 + e2m1[::-1]]
    with pytest.raises(ValueError, match="not a multiple of its block"):
        dequantize_mxfp4(block, 2, 16)


def test_the_hf_checkpoints_blocks_repacked_are_the_same_weights(folders):
    """The test's own repacking (HF's nibble order -> ggml's) checked against transformers' dequantizer: the same
    weights, so the MXFP4 parity above compares one set of weights."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from picovllm.loader.gguf_quants import dequantize_mxfp4
    blocks, scales = next(iter(folders["packed"].values()))
    e, n_out, groups, _ = blocks.shape
    got = dequantize_mxfp4(ggml_mxfp4(blocks, scales), e * n_out, groups * 32).reshape(e, n_out, groups * 32)
    assert torch.equal(torch.from_numpy(got).transpose(1, 2), convert_moe_packed_tensors(blocks, scales,
                                                                                         dtype=torch.float32))


def test_stop_tokens_by_llama_cpps_rule(folders, tmp_path):
    """gpt-oss's end-of-generation tokens beside the file's eos, found by their text as llama.cpp does (HF's
    generation_config lists the same three): <|return|>, <|call|>, <|endoftext|>."""
    from picovllm.loader.gguf_file import open_gguf

    def vocabulary(w, tensors):
        tokens = [f"t{i}" for i in range(384)]
        tokens[300], tokens[301], tokens[302], tokens[303] = "<|endoftext|>", "<|return|>", "<|call|>", "<|end|>"
        w.add_token_list(tokens)
        w.add_eos_token_id(301)
    cfg = open_gguf(write_gguf(folders["dense"], str(tmp_path / "v.gguf"), extra=vocabulary)).config
    assert cfg.eos_token_ids == [301, 302, 300]


def _fuse_gate_up(w, tensors):
    """The converter's optional fused form: one ffn_gate_up_exps tensor ([gate; up] rows)."""
    gate, up = tensors.pop("blk.0.ffn_gate_exps.weight"), tensors.pop("blk.0.ffn_up_exps.weight")
    tensors["blk.0.ffn_gate_up_exps.weight"] = np.concatenate([gate, up], axis=1)


@pytest.mark.parametrize("extra,match", [
    (set_or_remove("blk.1.attn_sinks.weight"), "missing weights: layers.1.self_attn.attn.sinks"),
    (set_or_remove("blk.0.attn_sinks.weight"), "sinks and biases"),
    (set_or_remove("blk.0.attn_q.bias"), "sinks and biases"),
    (set_or_remove("blk.1.ffn_up_exps.weight"), "gate_up_proj' is made of 1 file tensor"),
    (set_or_remove("blk.1.ffn_gate_exps.bias"), "gate_up_proj_bias' is made of 1 file tensor"),
    (_fuse_gate_up, "fused in one tensor"),
    (set_or_remove("gpt-oss.rope.freq_base_swa", 500.0), "rope.freq_base_swa"),
    (set_or_remove("gpt-oss.expert_weights_scale", 2.0), "expert_weights_scale"),
    (set_or_remove("gpt-oss.expert_count"), "expert_count' is missing"),
])
def test_what_cannot_be_honoured_is_refused(folders, tmp_path, extra, match):
    path = write_gguf(folders["dense"], str(tmp_path / "bad.gguf"), extra=extra)
    with pytest.raises(ValueError, match=match):
        LLM(path, device="cpu", num_kv_blocks=16)
