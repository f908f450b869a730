"""Cohere (Command R, Aya) and Cohere 2 (Command R7B, Command A) from GGUF files as llama.cpp writes them
(architectures "command-r" and "cohere2"), written here from tiny random HF checkpoints (test_more_families.py's
kinds) the way llama.cpp's converter (CommandR2Model, Cohere2Model) lays them out: q/k rows as the checkpoint has
them (llama.cpp's rope for both is the interleaved kind: no permutation), the parallel block's one LayerNorm (no
bias) as attn_norm with attention.layer_norm_epsilon, logit_scale, no output.weight (tied embeddings); Cohere 2's
window as attention.sliding_window (three layers of four slide, the fourth is global and NoPE: llama.cpp's rule).

The oracle is HF transformers on the HF folder (fp32, CPU): greedy tokens and logprobs; an F16 file against HF on the
folder rounded to float16. An F32 file fills the very parameters picovllm fills from the HF folder, and its config is
the folder's. A Q8_0 file's matrices stay quantized (q/k rows in the rotary order), each the weight the same file
dequantized gives. What a file says and picovllm cannot do is refused, naming the key or tensor.
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
            num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            initializer_range=0.2, logit_scale=0.5)
# case -> (GGUF architecture, HF config class, config fields); Cohere 2: four layers, a window under the longer prompts
CASES = {
    "cohere": ("command-r", "CohereConfig", {}),
    "cohere2": ("cohere2", "Cohere2Config", dict(num_hidden_layers=4, sliding_window=6)),
}


def build(path: str, case: str, f16: bool = False) -> str:
    """A random checkpoint of the case (norms away from 1, peaked attention so that the rotation's pairing shows);
    f16: its matrices rounded to float16."""
    import transformers

    _, cls, extra = CASES[case]
    torch.manual_seed(len(case))
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**{**BASE, **extra}),
                                                          dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif "q_proj" in name or "k_proj" in name:
                p.mul_(3)
            if f16 and p.dim() >= 2:
                p.copy_(p.half().float())
    model.save_pretrained(path)
    return path


# -- the writer: llama.cpp's converter's layout -----------------------------------------------------------------
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}
_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _tensors(sd: dict) -> dict[str, np.ndarray]:
    out = {}
    for name, t in sd.items():
        w = t.float().numpy()
        if name in _TOP:
            out[_TOP[name]] = w
            continue
        parts = name.split(".")
        module, kind = ".".join(parts[3:-1]), parts[-1]
        out[f"blk.{parts[2]}.{_LAYER[module]}.{kind}"] = w
    return out


def write_gguf(folder: str, case: str, path: str, kind: str = "F32", extra=None) -> str:
    """kind: the matrices' type (F32, F16, Q8_0); the norms F32, as the converter keeps them."""
    arch = CASES[case][0]
    cfg = json.load(open(os.path.join(folder, "config.json")))
    sd = load_file(os.path.join(folder, "model.safetensors"))
    rope = cfg.get("rope_parameters") or {}
    heads = cfg["num_attention_heads"]
    w = gguf.GGUFWriter(path, arch)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    w.add_layer_norm_eps(cfg["layer_norm_eps"])
    w.add_logit_scale(cfg["logit_scale"])
    w.add_rope_scaling_type(gguf.RopeScalingType.NONE)
    if arch == "cohere2":
        w.add_sliding_window(cfg["sliding_window"])
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(cfg["hidden_size"] // heads)     # rotary_pct 1
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    write_file(w, _tensors(sd), kind, extra=extra)
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """case -> HF folder; "<case>_f16": the same weights rounded to float16, built at first use."""
    return hf_folders(tmp_path_factory.mktemp("gguf_cohere"), build)


def prompts(seed: int = 0) -> list[list[int]]:
    return random_prompts(seed, (1, 7, 19, 36), VOCAB)


# case -> (the architecture's case, HF folder, the file's matrices)
PARITY = {"cohere_f32": ("cohere", "cohere", "F32"), "cohere2_f32": ("cohere2", "cohere2", "F32"),
          "cohere2_f16": ("cohere2", "cohere2_f16", "F16")}


@pytest.mark.parametrize("case", list(PARITY))
def test_gguf_matches_hf(folders, tmp_path, case):
    """Greedy tokens and logprobs of HF on the same weights, chunked prefill over a paged cache (Cohere 2's window
    of 6 under the longer prompts)."""
    arch_case, folder, kind = PARITY[case]
    folder = folders(folder)
    path = write_gguf(folder, arch_case, str(tmp_path / f"{case}.gguf"), kind)
    ps = prompts()
    ref, ref_lp = hf_greedy(folder, ps, 8)
    llm = LLM(path, block_size=4, num_kv_blocks=64, device="cpu", max_num_batched_tokens=16, quantization="none")
    assert llm.engine.model_config.architecture == CASES[arch_case][1].replace("Config", "ForCausalLM")
    toks, lps = greedy(llm, ps, 8)
    assert toks == ref
    for lp, want in zip(lps, ref_lp):
        assert lp == pytest.approx(want, abs=LOGPROB_ATOL)


@pytest.mark.parametrize("case", list(CASES))
def test_the_parameters_and_config_are_the_hf_folders(folders, tmp_path, case):
    """Every parameter an F32 file fills (q/k rows in the rotary order, the LayerNorms, the tied embedding) equals
    the one picovllm fills from the HF folder, and every config field is the folder's (logit scale, epsilon,
    interleaved pairs; Cohere 2's window, sliding and NoPE layers)."""
    folder = folders(case)
    hf = LLM(folder, num_kv_blocks=16, device="cpu")
    ours = LLM(write_gguf(folder, case, str(tmp_path / "f.gguf")), num_kv_blocks=16, device="cpu",
               quantization="none")
    want = dict(hf.engine.runner.model.named_parameters())
    got = dict(ours.engine.runner.model.named_parameters())
    assert sorted(got) == sorted(want)
    for name, p in got.items():
        assert torch.equal(p, want[name]), name
    cfg, ref = ours.engine.model_config, hf.engine.model_config
    for field in dataclasses.fields(cfg):
        if field.name == "norm_topk_prob":          # no meaning without experts
            continue
        value, expected = getattr(cfg, field.name), getattr(ref, field.name)
        if isinstance(expected, float):
            assert value == pytest.approx(expected, rel=1e-6), field.name       # the file's float32
        else:
            assert value == expected, field.name
    assert cfg.tie_word_embeddings and cfg.rotary_interleaved and cfg.logits_scaling == 2.0
    if case == "cohere2":
        assert (cfg.sliding_window, cfg.sliding_layers, cfg.rope_layers) == (6, [True] * 3 + [False],
                                                                              [True] * 3 + [False])


def test_q8_0_matrices_run_quantized(folders, tmp_path):
    """A Q8_0 Cohere 2 file: q/k/v (q's and k's rows in the rotary order), o, gate/up, down and the tied
    embedding's head stay quantized on the CPU, each holding the very weight the same file dequantized at load gives,
    and the model runs on them near the float file."""
    from picovllm.kernels.cpu.quant_gemm import isa
    if isa() is None:
        pytest.skip("the quantized CPU kernels need a C compiler and AVX2")
    path = write_gguf(folders("cohere2"), "cohere2", str(tmp_path / "q.gguf"), "Q8_0")
    quantized = LLM(path, device="cpu", num_kv_blocks=32)
    floats = LLM(path, device="cpu", num_kv_blocks=32, quantization="none")
    assert_packed_as_float(quantized, floats, [layer + name for layer in ("layers.0.", "layers.3.") for name in (
        "self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")])
    errs = prompt_logprob_errors(floats, quantized, prompts(2)[2:])
    # looser than test_gguf_families' bound: the peaked attention (q/k scaled by 3) and the quantized tied head
    # both magnify Q8_0's steps (the weights themselves are checked exactly above)
    assert np.mean(errs) < 0.1 and max(errs) < 0.6, (np.mean(errs), max(errs))


@pytest.mark.parametrize("case,extra,match", [
    ("cohere", set_or_remove("command-r.logit_scale"), "logit_scale' is missing"),
    ("cohere", set_or_remove("command-r.attention.layer_norm_epsilon"), "layer_norm_epsilon' is missing"),
    ("cohere", set_or_remove("command-r.rope.dimension_count", 8), "rope.dimension_count=8"),
    ("cohere", set_or_remove("blk.0.attn_q_norm.weight", np.ones((4, 16))), "attn_q_norm.weight': Cohere's q/k"),
    ("cohere2", set_or_remove("cohere2.attention.sliding_window"), "sliding_window' is missing"),
    ("cohere2", set_or_remove("blk.1.attn_norm.bias", np.zeros(64)), "blk.1.attn_norm.bias': unknown tensor name"),
])
def test_what_cannot_be_honoured_is_refused(folders, tmp_path, case, extra, match):
    from picovllm.loader.gguf_file import open_gguf
    path = write_gguf(folders(case), case, str(tmp_path / "bad.gguf"), extra=extra)
    with pytest.raises(ValueError, match=match):
        open_gguf(path)
