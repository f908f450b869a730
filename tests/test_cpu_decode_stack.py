"""The CPU decode stack (picovllm/kernels/cpu/decode_stack.c: a decode-only step's layers, final norm and LM
head in one C call) against HF transformers on the same weights, greedy tokens identical and logprobs within
LOGPROB_ATOL, with every decode step counted as run by the stack; and each step's logits against the torch
modules' on the same inputs. Llama, Qwen2 (qkv bias), Qwen3 (q/k norm), Llama 3 rope; one and two threads; and the
other families the stack runs."""
import functools

import pytest
import torch

from picovllm import LLM, SamplingParams
from picovllm.kernels.cpu import decode_stack
from test_parity_hf import LOGPROB_ATOL, hf_greedy, make_prompts

MAX_TOKENS = 12


@functools.lru_cache(maxsize=None)
def hf_reference(path: str):
    return hf_greedy(path, make_prompts(), MAX_TOKENS)


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "llama3"])
def test_decode_steps_match_hf_and_the_modules(tiny_models, arch, threads):
    path = tiny_models[arch]
    llm = LLM(path, block_size=8, num_kv_blocks=96, enable_prefix_caching=False, device="cpu")
    runner = llm.engine.runner
    stack = runner.cpu_decode
    if stack is None:
        pytest.skip("the decode stack does not build here (no C compiler, AVX2/FMA or a second OpenMP runtime)")
    gaps, run = [], stack.run

    def checked_run(ids, positions, meta):
        logits = run(ids, positions, meta)
        hidden = runner.model(ids, positions, meta)    # stores the same K/V again, then the torch modules
        gaps.append((logits - runner.model.compute_logits(hidden)).abs().max().item())
        return logits

    stack.run = checked_run
    prompts = make_prompts()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0),
                        use_tqdm=False)
    ref_tokens, ref_logprobs = hf_reference(path)
    assert len(gaps) == MAX_TOKENS - 1     # one prefill step samples the first tokens; every decode step ran here
    assert max(gaps) < 1e-4, gaps
    for o, toks, lps in zip(outs, ref_tokens, ref_logprobs):
        assert o.outputs[0].token_ids == toks
        ours = [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
        assert ours == pytest.approx(lps, abs=LOGPROB_ATOL)


def test_steps_past_small_m_and_mixed_steps_take_the_modules(tiny_models, monkeypatch):
    """More rows than SMALL_M, or a prefill in the step: the torch modules run it; the tokens stay HF's."""
    monkeypatch.setattr(decode_stack, "SMALL_M", 3)
    llm = LLM(tiny_models["qwen3"], block_size=8, num_kv_blocks=96, max_num_batched_tokens=64,
              enable_prefix_caching=False, device="cpu")
    stack = llm.engine.runner.cpu_decode
    if stack is None:
        pytest.skip("the decode stack does not build here")
    sizes, run = [], stack.run
    stack.run = lambda ids, positions, meta: sizes.append(len(ids)) or run(ids, positions, meta)
    outs = llm.generate(make_prompts(), SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_reference(tiny_models["qwen3"])[0]
    assert sizes and max(sizes) <= 3


def test_enforce_eager_and_other_dtypes_do_not_build_it(tiny_models):
    eager = LLM(tiny_models["llama"], num_kv_blocks=16, enforce_eager=True, device="cpu")
    assert eager.engine.runner.cpu_decode is None
    assert LLM(tiny_models["llama"], num_kv_blocks=16, dtype="bfloat16", device="cpu").engine.runner.cpu_decode is None


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
@pytest.mark.parametrize("kind", ["Q4_1", "mixed"])
def test_quantized_decode_steps_match_the_modules(tmp_path, monkeypatch, kind, isa, threads):
    """A GGUF run quantized (its layers QuantizedWeights, "mixed": a layer of two forms and a float32 one, see
    test_gguf): each decode step's logits from the stack against the torch modules' (the same quantized GEMMs
    one by one), on the AVX2 and the AVX-512 build of both. Their float32 norms and attention round differently,
    which now and then moves one activation across an int8 rounding boundary: one quantization step of one
    element, ~1e-3 of the logits. So most steps agree to float32 rounding, and none by more than 1%."""
    from picovllm.kernels.cpu import quant_gemm
    from picovllm.kernels.cpu.build import cpu_isas
    from test_gguf import LAYERS, PROMPTS, write_tiny_gguf
    if isa not in cpu_isas():
        pytest.skip(f"this CPU has no {isa}")
    monkeypatch.setenv("PICOVLLM_CPU_ISA", isa)
    path = str(tmp_path / f"{kind}.gguf")
    override = {f"blk.{i}.{t}.weight": q for i in range(LAYERS)
                for t, q in [("attn_v", "Q6_K"), ("ffn_gate", "F16"), ("ffn_down", "Q8_0")]} if kind == "mixed" else {}
    write_tiny_gguf(path, "Q4_K" if kind == "mixed" else kind, override=override)
    llm = LLM(path, block_size=8, num_kv_blocks=64, enable_prefix_caching=False, disk_cache=False)
    runner = llm.engine.runner
    stack = runner.cpu_decode
    assert isinstance(runner.model.layers[0].self_attn.qkv_proj.packed, quant_gemm.QuantizedWeight)
    assert runner.model.layers[0].self_attn.qkv_proj.packed.isa == isa
    if stack is None:
        pytest.skip("the decode stack does not build here")
    gaps, run = [], stack.run

    def checked_run(ids, positions, meta):
        logits = run(ids, positions, meta)
        want = runner.model.compute_logits(runner.model(ids, positions, meta))
        gaps.append(((logits - want).abs().max() / want.abs().max()).item())
        return logits

    stack.run = checked_run
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    assert len(gaps) == MAX_TOKENS - 1
    assert sorted(gaps)[len(gaps) // 2] < 1e-5 and max(gaps) < 1e-2, gaps


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    import test_gemma_moe
    import test_more_families
    root = tmp_path_factory.mktemp("stack_families")
    cases = ("gemma2", "gemma2_hd256_mqa", "gemma3", "qwen3_moe", "qwen3_moe_64", "mixtral")
    out = {case: test_gemma_moe.build(str(root / case), case) for case in cases}
    return out | {case: test_more_families.build(str(root / case), case) for case in ("granite", "smollm3")}


@pytest.mark.parametrize("case", ["gemma2", "gemma2_hd256_mqa", "gemma3", "qwen3_moe", "qwen3_moe_64", "mixtral",
                                  "granite", "smollm3"])
def test_family_decode_steps_match_hf_and_the_modules(family_models, case, threads):
    """Gemma 2 and 3 in the stack: post-norms, GeGLU, scaled embeddings, soft-capped scores (hard enough to bite)
    and logits, sliding windows shorter than the prompts on alternate layers, Gemma 3's q/k norms and local rope
    base; head_dim 256 with one KV head. MoE: top-2 of 8 not renormalised with a dense layer (Qwen3-MoE), top-1
    of 64, Mixtral's top-2 renormalised. Granite's four scalings; SmolLM3's NoPE layer. Every decode step runs in
    C, its logits checked against the modules'."""
    from test_gemma_moe import prompts
    llm = LLM(family_models[case], block_size=4, num_kv_blocks=128, enable_prefix_caching=False, device="cpu")
    runner = llm.engine.runner
    stack = runner.cpu_decode
    if stack is None:
        pytest.skip("the decode stack does not build here")
    gaps, run = [], stack.run

    def checked_run(ids, positions, meta):
        logits = run(ids, positions, meta)
        want = runner.model.compute_logits(runner.model(ids, positions, meta))
        gaps.append((logits - want).abs().max().item())
        return logits

    stack.run = checked_run
    ps = prompts()
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0),
                        use_tqdm=False)
    ref_tokens, ref_logprobs = hf_greedy(family_models[case], ps, MAX_TOKENS)
    assert len(gaps) == MAX_TOKENS - 1 and max(gaps) < 1e-4, gaps
    for o, toks, lps in zip(outs, ref_tokens, ref_logprobs):
        assert o.outputs[0].token_ids == toks
        ours = [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
        assert ours == pytest.approx(lps, abs=LOGPROB_ATOL)
