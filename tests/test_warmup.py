"""The start-up warm-up (engine/warmup.py): which steps it plans, that they cover every Triton specialization
a run meets, and that they leave nothing behind.

On the CPU the kernels run under TRITON_INTERPRET=1, which compiles nothing; so the coverage test computes
each launch's specialization key with Triton's own specializer (what a compiled launch would look up in its
cache) and checks that a run after the warm-up meets no key the warm-up did not."""
import inspect
import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from picovllm.engine.warmup import plan_warmup, powers_of_two_upto, warmup_step   # noqa: E402
from picovllm.kernels import decode_attention, prefill_attention, store_kv        # noqa: E402
from picovllm.kernels.decode_attention import num_splits_for                       # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")


def _direct(hkv):
    return lambda b: num_splits_for(b, hkv) == 1


@pytest.mark.parametrize("tokens,seqs,max_len,hkv", [(16384, 256, 4096, 8), (2048, 256, 40960, 2),
                                                     (32, 4, 128, 2), (8, 16, 6, 1), (1, 1, 1, 8)])
def test_plan_covers_every_decode_variant_within_limits(tokens, seqs, max_len, hkv):
    plan = plan_warmup(tokens, seqs, max_len, _direct(hkv))
    reachable = {num_splits_for(b, hkv) == 1 for b in range(1, min(seqs, tokens) + 1)}
    assert {num_splits_for(b, hkv) == 1 for b in plan.decode_batches} == reachable
    assert plan.decode_batches[0] == 1
    budget = min(tokens, seqs * max_len)
    assert plan.prefill_tokens[0] == budget
    assert set(plan.prefill_tokens) == {budget} | {2 ** i for i in range(budget.bit_length()) if 2 ** i <= budget}
    for step_seqs, _ in plan.steps():
        assert sum(n for _, n in step_seqs) <= tokens and len(step_seqs) <= seqs
        assert all(c + n <= max_len and n >= 1 for c, n in step_seqs)
        ns = [n for _, n in step_seqs]
        assert ns == sorted(ns, key=lambda n: n != 1), "decodes first"
    if seqs > 1 and min(tokens, max_len) >= 3:
        assert any(n == 1 for s, _ in plan.steps() for _, n in s[:-1]) and plan.mixed_decodes
    assert plan.cached[0] > 0 or max_len <= 2


def test_h200_nano_plan():
    """The nano workload's settings on Qwen3-0.6B (8 KV heads): decode batches 1 (split-K) and 193 (one split)."""
    plan = plan_warmup(16384, 256, 4096, _direct(8))
    assert plan.decode_batches == [1, 193] and plan.mixed_decodes == [1, 193]
    assert plan.prefill_tokens == powers_of_two_upto(16384) == [2 ** i for i in range(14, -1, -1)]


def test_warmup_step_writes_nowhere():
    step = warmup_step([(5, 1), (5, 1), (8, 3)], block_size=4, vocab_size=50)
    assert step.slot_mapping == [-1] * 5 and step.num_decodes == 2
    assert step.query_start_loc == [0, 1, 2, 5] and step.seq_lens == [6, 6, 11]
    assert step.block_tables == [[0, 0], [0, 0], [0, 0, 0]]
    assert step.positions == [5, 5, 8, 9, 10] and step.sample_indices == [0, 1, 4]


# -- against Triton's specializer --------------------------------------------------------------------------
KERNELS = [(store_kv, "_store_kv_kernel"), (decode_attention, "_decode_partial_kernel"),
           (decode_attention, "_decode_reduce_kernel"), (prefill_attention, "_prefill_kernel")]


def specialization_key(kernel, args, kwargs) -> tuple:
    """What a compiled launch of `kernel` would be cached under: constexpr values, tensors' dtype and 16-byte
    alignment, ints by Triton's own rules (type, divisible by 16, == 1) unless do_not_specialize."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    fn = kernel.fn
    params = inspect.signature(fn).parameters
    bound = dict(zip(params, args), **kwargs)
    dns = set(kernel.kwargs.get("do_not_specialize") or ())
    key = []
    for name, p in params.items():
        v = bound[name]
        if "constexpr" in str(p.annotation):
            key.append((name, v))
        elif isinstance(v, torch.Tensor):
            key.append((name, str(v.dtype), v.data_ptr() % 16 == 0))
        else:
            spec = name not in dns
            key.append((name, native_specialize_impl(BaseBackend, v, False, spec, spec)))
    return tuple(key) + tuple(sorted((k, v) for k, v in kwargs.items() if k not in params))


class Recorder:
    """Stands in for a kernel: records each launch's specialization key, then launches."""

    def __init__(self, kernel):
        self.kernel, self.keys = kernel, set()

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.keys.add(specialization_key(self.kernel, args, kwargs))
            return launch(*args, **kwargs)
        return run


def _prompts(lengths, seed, vocab=384):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


@interpreted
def test_run_after_warmup_meets_no_new_specialization(tiny_models, monkeypatch):
    """Chunked prefills, prefix-cache hits, mixed and decode-only steps of every batch size, after the warm-up:
    every kernel launch's specialization key was met by the warm-up already (so nothing compiles mid-run).
    The split-K target is lowered so that batches of 3+ decodes take the one-split (DIRECT) variant."""
    from picovllm import LLM, SamplingParams
    monkeypatch.setattr(decode_attention, "SPLIT_TARGET_PROGRAMS", 8)   # 2 KV heads: batch >= 3 is DIRECT
    recorders = {}
    for module, name in KERNELS:
        recorders[name] = Recorder(getattr(module, name))
        monkeypatch.setattr(module, name, recorders[name])
    llm = LLM(tiny_models["qwen3"], device="cpu", attention_backend="triton", warmup=True, block_size=8,
              num_kv_blocks=40, max_num_seqs=4, max_num_batched_tokens=24, max_model_len=96)
    warm = {name: set(r.keys) for name, r in recorders.items()}
    assert all(warm.values()), "the warm-up launched every kernel"
    assert len(warm["_decode_partial_kernel"]) == 2, "both decode variants (split-K and DIRECT)"
    prompts = _prompts([3, 30, 9, 17, 1], seed=4)
    prompts.append(prompts[1][:16] + [1, 2])                # a prefix-cache hit (two blocks)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (6, 3, 9, 5, 7, 4)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert outs[-1].num_cached_tokens == 16
    for name, r in recorders.items():
        assert r.keys <= warm[name], f"{name}: a specialization the warm-up missed: {r.keys - warm[name]}"


@interpreted
def test_warmup_leaves_no_state(tiny_models):
    """The warm-up run between two identical generates (greedy and seeded sampling, prefix caching off): the
    same tokens and logprobs after it; it writes nothing into the KV cache, holds no block and draws nothing
    from the random generator."""
    from picovllm import LLM, SamplingParams
    prompts = _prompts([5, 3], seed=6)       # one 8-token step: an interpreted step takes seconds
    params = [SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.9, top_p=0.8, seed=3, max_tokens=2, ignore_eos=True, logprobs=2)]
    llm = LLM(tiny_models["qwen3"], device="cpu", attention_backend="triton", block_size=8, num_kv_blocks=24,
              max_num_seqs=4, max_num_batched_tokens=8, max_model_len=32, enable_prefix_caching=False)
    eng = llm.engine
    assert eng.runner.warmup_seconds is None, "off by default on the CPU"
    first = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params, use_tqdm=False)]
    cache, rng = eng.runner.kv_cache.clone(), torch.random.get_rng_state()
    assert eng.runner.warm_up() > 0
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert torch.equal(eng.runner.kv_cache, cache), "nothing written into the KV cache"
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    again = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert again == first


def test_warmup_needs_triton_backend(tiny_models):
    from picovllm import LLM
    with pytest.raises(ValueError, match="EngineConfig.warmup needs the triton attention backend"):
        LLM(tiny_models["llama"], device="cpu", attention_backend="torch", warmup=True, num_kv_blocks=8)
    from picovllm.config import EngineConfig
    with pytest.raises(ValueError, match="EngineConfig.warmup"):
        EngineConfig(warmup="yes")
    assert EngineConfig(device="cpu").warmup is None


def test_packed_step_tensors_are_aligned_and_exact():
    """A step's inputs travel in one buffer; each tensor starts 16-byte aligned (else Triton would compile
    another variant mid-run for a misaligned pointer) and holds exactly its list, empty ones included."""
    import numpy as np
    from picovllm.engine.step_input import pack_upload
    parts = [([5, 6, 7], np.int64), ([], np.int64), ([1], np.int32), (np.arange(15, dtype=np.int32).reshape(3, 5),
                                                                       np.int32), ([2 ** 40, -1], np.int64)]
    out = pack_upload(parts, torch.device("cpu"))
    assert [t.dtype for t in out] == [torch.int64, torch.int64, torch.int32, torch.int32, torch.int64]
    for t, (data, _) in zip(out, parts):
        assert t.data_ptr() % 16 == 0
        assert t.tolist() == (data.tolist() if isinstance(data, np.ndarray) else data)
    assert out[3].shape == (3, 5) and out[3].is_contiguous()
    assert all(t.untyped_storage().data_ptr() == out[0].untyped_storage().data_ptr() for t in out), "one buffer"


def _compiled_variants() -> dict[str, int]:
    """Compiled variants per Triton kernel of the engine's CUDA path (Triton's in-process kernel caches)."""
    from picovllm.kernels import activation, argmax, rmsnorm, sampling
    out = {}
    for module, name in KERNELS + [(rmsnorm, "_rmsnorm_kernel"), (rotary_module(), "_rope_kernel"),
                                   (activation, "_silu_and_mul_kernel"), (sampling, "_gumbel_chunk_kernel"),
                                   (sampling, "_gumbel_pick_kernel"), (argmax, "_argmax_chunk_kernel"),
                                   (argmax, "_argmax_pick_kernel")]:
        caches = getattr(getattr(module, name), "device_caches", None)
        if caches is None:
            pytest.skip("this Triton keeps no device_caches to count compiled kernels in")
        out[name] = sum(len(c[0]) for c in caches.values())
    return out


def rotary_module():
    from picovllm.kernels import rotary
    return rotary


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs CUDA")
def test_gpu_run_after_warmup_compiles_nothing(tiny_models):
    """bf16 on the GPU: after the start-up warm-up, a run of chunked prefills, prefix-cache hits, mixed steps and
    every sampler (greedy, temperature, top-p, penalties, logprobs, min_tokens) compiles no Triton kernel."""
    from picovllm import LLM, SamplingParams
    llm = LLM(tiny_models["qwen3"], block_size=16, num_kv_blocks=128, max_num_seqs=8, max_num_batched_tokens=64)
    assert llm.engine.runner.warmup_seconds is not None
    before = _compiled_variants()
    prompts = _prompts([3, 70, 17, 33, 1, 129, 2], seed=9)
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=1, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.7, top_p=0.9, max_tokens=25, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0.9, presence_penalty=0.5, repetition_penalty=1.2, max_tokens=12),
              SamplingParams(temperature=1.0, min_tokens=5, max_tokens=9, logit_bias={3: 2.0}),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=2),
              SamplingParams(temperature=0.5, max_tokens=8, ignore_eos=True)]
    llm.generate(prompts, params, use_tqdm=False)
    out = llm.generate([prompts[1][:64] + [5, 6]], params[1], use_tqdm=False)[0]   # 64 tokens from the cache
    assert out.num_cached_tokens == 64
    assert _compiled_variants() == before
