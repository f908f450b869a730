"""quantization="q8_0": an HF folder's matrices quantized at load (loader/quantize_at_load.py). The blocks
against a hand bound (every weight within half a step of its value), and the model's prompt logprobs against
HF transformers' float logits on the same weights (fp32, CPU)."""
import json
import os

import numpy as np
import pytest
import torch

from picovllm import LLM, SamplingParams
from picovllm.kernels.cpu import quant_gemm
from picovllm.loader.quantize_at_load import quantize_q8
from test_parity_hf import make_prompts
from test_prompt_logprobs import hf_prompt_logprobs

needs_kernels = pytest.mark.skipif(quant_gemm.isa() is None, reason="the quantized CPU kernels need a C compiler and AVX2")


def test_q8_blocks_are_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 96, generator=g, dtype=torch.float64) * torch.logspace(-3, 1, 96, dtype=torch.float64)
    w[3, :16] = 0                                     # an all-zero group: scale 0, codes 0
    b = quantize_q8(w.float())
    assert b.kind == "q8" and b.codes.dtype == np.int8 and b.scales.shape == (24, 96 // 16)
    step = np.repeat(b.scales.astype(np.float64), 16, axis=1)
    err = np.abs(b.dequantize() - w.float().double().numpy())
    assert (err <= step / 2 + 1e-12).all()
    amax = np.abs(w.float().double().numpy()).reshape(24, 6, 16).max(-1)
    assert np.allclose(b.scales, amax / 127, rtol=1e-6) and (b.codes[3, :16] == 0).all()


def rewritten_copy(path: str, out: str, rewrite) -> str:
    """A copy of the checkpoint folder at `out` with each tensor t named n replaced by rewrite(n, t)."""
    import shutil
    from safetensors.torch import load_file, save_file
    shutil.copytree(path, out)
    for f in [x for x in os.listdir(out) if x.endswith(".safetensors")]:
        save_file({n: rewrite(n, t) for n, t in load_file(f"{out}/{f}").items()}, f"{out}/{f}")
    return out


def dequantized_copy(path: str, out: str) -> str:
    """The checkpoint with every matrix q8_0 quantizes replaced by its dequantized blocks: the weights the
    quantized model runs, in float, for HF to run."""
    from picovllm.loader.quantize_at_load import quantizes
    return rewritten_copy(path, out, lambda n, t: torch.from_numpy(quantize_q8(t).dequantize()).float()
                          if quantizes(n, t) else t)


@needs_kernels
def test_q8_0_model_scores_prompts_like_hf(tiny_models, tmp_path):
    path, prompts = tiny_models["qwen3"], make_prompts()
    ref = hf_prompt_logprobs(dequantized_copy(path, str(tmp_path / "dq")), prompts)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=0)
    q8 = LLM(path, device="cpu", num_kv_blocks=128, quantization="q8_0")
    layers = [m for m in q8.engine.runner.model.modules() if isinstance(getattr(m, "packed", None),
                                                                       quant_gemm.QuantizedWeight)]
    assert len(layers) >= 4 * 2          # every layer's qkv, o, gate_up and down (and the head) run quantized
    errs = []
    for out, rows in zip(q8.generate(prompts, sp, use_tqdm=False), ref):
        errs += [abs(d[tok].logprob - lp) for d, (tok, lp, _, _) in zip(out.prompt_logprobs[1:], rows)]
    # The same weights: what is left is the kernels' int8 activations (a scale per 32 values, llama.cpp's
    # way), about 0.7% of a matmul's largest output on this model's shapes; measured: max 0.13, mean 0.035.
    assert max(errs) < 0.25 and np.mean(errs) < 0.06, (max(errs), np.mean(errs))
    weights = sum(qw.nbytes for qw in {id(m.packed): m.packed for m in layers}.values())
    floats = sum(int(np.prod(m.weight.shape)) * 4 for m in layers)
    assert weights < 0.35 * floats        # int8 codes and a float32 scale per 16: 1.25 of 4 bytes a weight


def test_q8_0_refused_where_it_cannot_run(tiny_models, default_model_path):
    with pytest.raises(ValueError, match="quantization 'q8_0' quantizes an HF folder"):
        LLM(default_model_path, device="cpu", num_kv_blocks=16, quantization="q8_0")
    with pytest.raises(ValueError, match="quantization 'q8_0' runs on the CPU in float32"):
        LLM(tiny_models["qwen3"], device="cpu", dtype="bfloat16", num_kv_blocks=16, quantization="q8_0")
    with pytest.raises(ValueError, match="EngineConfig.quantization must be one of"):
        LLM(tiny_models["qwen3"], device="cpu", quantization="int4")


def rounded_copy(path: str, out: str) -> str:
    """The checkpoint with the matrices quantization="bf16" rounds (the linear layers' and the LM head's; a
    tied head is the embedding) rounded to bfloat16 values."""
    tied = json.load(open(f"{path}/config.json")).get("tie_word_embeddings", False)
    return rewritten_copy(path, out, lambda n, t: t.to(torch.bfloat16).float()
                          if t.dim() == 2 and ("embed" not in n or tied) else t)


@pytest.mark.skipif(not __import__("picovllm.kernels.cpu.small_gemm", fromlist=["x"]).available(),
                    reason="needs the small_gemm kernel")
def test_bf16_weights_score_and_decode_like_hf_on_the_rounded_weights(tiny_models, tmp_path):
    """quantization="bf16": every matmul reads bfloat16-valued weights, summed in float32, so the model is HF's on
    the rounded checkpoint: prompt logprobs (prefill) and greedy tokens (the C decode stack's bf16 panels)."""
    from test_parity_hf import hf_greedy
    path, prompts = tiny_models["qwen3"], make_prompts()
    rounded = rounded_copy(path, str(tmp_path / "bf16"))
    ref = hf_prompt_logprobs(rounded, prompts)
    llm = LLM(path, device="cpu", num_kv_blocks=128, quantization="bf16")
    panels = [m.packed.panels for m in llm.engine.runner.model.modules() if getattr(m, "packed", None) is not None]
    assert panels and all(p.dtype == torch.bfloat16 for p in panels)
    assert llm.engine.runner.cpu_decode is not None            # decode steps run the one-call C stack
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0),
                        use_tqdm=False)
    errs = [abs(d[tok].logprob - lp) for out, rows in zip(outs, ref) for d, (tok, lp, _, _) in zip(out.prompt_logprobs[1:], rows)]
    assert max(errs) < 1e-3, max(errs)
    want, _ = hf_greedy(rounded, prompts, 8)
    assert [o.outputs[0].token_ids for o in outs] == want
    with pytest.raises(ValueError, match="quantization 'bf16'"):
        LLM(path, device="cpu", dtype="bfloat16", num_kv_blocks=16, quantization="bf16")


@needs_kernels
def test_q8_0_quantizes_the_parts_of_fused_checkpoint_tensors(tmp_path):
    """Phi-3 stores q/k/v and gate/up fused (qkv_proj, gate_up_proj): each part is quantized, its layer runs
    quantized, and the model scores prompts as HF does on the dequantized blocks (the bound of the test above)."""
    from test_more_families import build
    path, prompts = build(str(tmp_path / "phi3"), "phi3"), make_prompts()
    ref = hf_prompt_logprobs(dequantized_copy(path, str(tmp_path / "dq")), prompts)
    q8 = LLM(path, device="cpu", num_kv_blocks=128, quantization="q8_0")
    layer = q8.engine.runner.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj.packed, quant_gemm.QuantizedWeight)
    assert isinstance(layer.mlp.gate_up_proj.packed, quant_gemm.QuantizedWeight)
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    errs = [abs(d[tok].logprob - lp) for out, rows in zip(q8.generate(prompts, sp, use_tqdm=False), ref)
            for d, (tok, lp, _, _) in zip(out.prompt_logprobs[1:], rows)]
    assert max(errs) < 0.25 and np.mean(errs) < 0.06, (max(errs), np.mean(errs))
