"""Two engines of different shapes, one after another in one process (benchmarks/families_gpu.py runs Mistral-7B,
then Gemma-2-2B): each gives HF transformers' greedy tokens and logprobs on its tiny random weights (fp32, CPU),
and the start-up's profile step (the GPU's peak-memory forward, kv_cache._profile_forward, run here on the CPU
too) stays inside each model's rotary table.

The second model is the one whose table is shorter than the step budget, as Gemma-2-2B's 8192 positions are under
families_gpu.py's 16384-token budget: a profile step of one sequence as long as the budget read cos/sin rows past
the table's end on the GPU (an illegal memory access wherever nothing is mapped behind the table: the likely cause
of Gemma-2-2B's start-up crash after a Mistral-7B engine). Here the check stands in front of the lookup.
"""
import random

import pytest
import torch

from picovllm import LLM, SamplingParams
from picovllm.engine import kv_cache
from picovllm.layers.rotary import RotaryEmbedding
from test_gemma_moe import build_checkpoint
from test_parity_hf import LOGPROB_ATOL, hf_greedy

BASE = dict(num_hidden_layers=2, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)
CASES = {   # in the order they run: Mistral's shape first, then Gemma 2's (wider heads, vocabulary and hidden size)
    "mistral": ("MistralConfig", dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_attention_heads=8,
                                      num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                                      sliding_window=None)),
    "gemma2": ("Gemma2Config", dict(vocab_size=640, hidden_size=96, intermediate_size=160, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, sliding_window=6,
                                    attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                                    max_position_embeddings=64)),
}
BUDGET = 96    # max_num_batched_tokens: above Gemma's 64 positions, below Mistral's 512


def build(path: str, case: str) -> str:
    cls, extra = CASES[case]
    return build_checkpoint(path, case, cls, {**BASE, **extra})


def test_two_shapes_in_one_process_match_hf_and_profile_within_the_rope_table(tmp_path, monkeypatch):
    profiled = []      # (model, the highest position its rotary saw during the profile step)
    real_profile, real_rope = kv_cache.profile_num_blocks, RotaryEmbedding.forward

    def rope(self, positions, q, k):
        top = int(positions.max()) if positions.numel() else -1
        # checked before the lookup: the C kernel (and the GPU's Triton one) read past the table unchecked
        assert top < self.cos_sin.shape[0], f"position {top} past the rotary table's {self.cos_sin.shape[0]} rows"
        if profiling:
            profiling[-1] = max(profiling[-1], top)
        return real_rope(self, positions, q, k)

    def profile(model, config, device, *rest):
        """The CPU sizes its cache from cpu_kv_cache_gib; run the GPU's profile forward here first."""
        profiling.append(-1)
        kv_cache._profile_forward(model, config, device, *rest)
        profiled.append((type(model).__name__, profiling.pop()))
        return real_profile(model, config, device, *rest)

    profiling: list[int] = []
    monkeypatch.setattr(RotaryEmbedding, "forward", rope)
    monkeypatch.setattr(kv_cache, "profile_num_blocks", profile)
    rng = random.Random(0)
    for case in CASES:     # one after another, each dropped before the next is built
        path = build(str(tmp_path / case), case)
        vocab = CASES[case][1]["vocab_size"]
        ps = [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 9, 30)]
        ref, ref_lp = hf_greedy(path, ps, 10)
        llm = LLM(path, device="cpu", block_size=4, num_kv_blocks=96, max_num_batched_tokens=BUDGET)
        outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0),
                            use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref, case
        for o, lp in zip(outs, ref_lp):
            ours = [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
            assert ours == pytest.approx(lp, abs=LOGPROB_ATOL), case
        assert profiled[-1][1] == min(BUDGET, llm.engine.max_model_len) - 1, profiled   # the longest real prompt
        llm.shutdown()
        del llm
    assert [name for name, _ in profiled] == ["LlamaForCausalLM", "GemmaForCausalLM"]


@pytest.mark.parametrize("budget,seqs,max_len,lens", [
    (16384, 256, 4096, [4096] * 4),        # families_gpu.py's Gemma-2-2B engine
    (16384, 256, 32768, [16384]),          # its Mistral-7B engine: one sequence, as before
    (100, 256, 64, [64, 36]),
    (100, 1, 64, [64]),                    # one sequence at a time: the scheduler never batches more tokens
    (10, 4, 64, [10]),
])
def test_profile_sequences_are_prompts_the_scheduler_could_batch(budget, seqs, max_len, lens):
    assert kv_cache.profile_sequences(budget, seqs, max_len) == lens
