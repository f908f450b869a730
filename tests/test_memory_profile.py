"""The GPU memory profile (engine/kv_cache.py) runs the sampler's costliest step: the most rows a step samples, each
with penalties, logit bias, banned and allowed tokens, top-k, top-p, min-p and logprobs at max_logprobs, with the
engine's penalty count table at its full size (max_num_seqs rows) and kept. On the CPU the profile forward is
called directly (a CPU engine sizes its cache from cpu_kv_cache_gib); on a GPU a step of max_num_seqs such rows must
take no more memory above what is in use than the profile measured."""
import pytest
import torch

from picovllm import LLM, SamplingParams
from picovllm.distributed import TPGroup
from picovllm.engine import kv_cache, sampling, scheduler
from picovllm.layers import sampler
from picovllm.layers.logits_processors import PenaltyCounts
from conftest import TINY, build_tiny_checkpoint

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.mark.parametrize("seqs,budget,spec,sampled", [
    (4, 512, None, 4),           # a row a sequence
    (8, 6, None, 6),             # no more rows than the step's tokens
    (4, 512, SPEC, 4 + 4 * 4),   # speculative: a row a sequence, and a row a draft (4 rows a decode)
])
def test_profile_samples_the_most_rows_with_every_costly_option(tiny_models, monkeypatch, seqs, budget, spec, sampled):
    llm = LLM(tiny_models["qwen3"], device="cpu", attention_backend="torch", max_num_batched_tokens=budget,
              max_num_seqs=seqs, max_logprobs=7, num_kv_blocks=64, speculative_config=spec)
    runner, config = llm.engine.executor.runner, llm.engine.config
    counts = runner.penalty_counts
    assert counts.counts is None          # num_kv_blocks given: nothing was profiled yet
    calls, filtered, penalized, gathered = [], [], [], []
    real_sample, real_filter = kv_cache.sample_logits, sampler.apply_top_k_top_p_min_p
    real_rows, real_gathered = PenaltyCounts.rows, sampling._gathered

    def sample_logits(logits, rows, *args, **kw):
        calls.append((logits.shape, rows, kw.get("penalty_counts")))
        return real_sample(logits, rows, *args, **kw)

    def apply_filters(logits, t):
        filtered.append((logits.shape[0], t.any_top_k, t.any_top_p, t.any_min_p))
        return real_filter(logits, t)

    def penalty_rows(self, rows, vocab, prompts):
        penalized.append((len(rows), prompts, self.counts.shape))
        return real_rows(self, rows, vocab, prompts)

    def gather(logp, targets, k):
        gathered.append((logp.shape[0], k))
        return real_gathered(logp, targets, k)
    monkeypatch.setattr(kv_cache, "sample_logits", sample_logits)
    monkeypatch.setattr(sampler, "apply_top_k_top_p_min_p", apply_filters)
    monkeypatch.setattr(PenaltyCounts, "rows", penalty_rows)
    monkeypatch.setattr(sampling, "_gathered", gather)
    torch.manual_seed(1234)
    rng = torch.get_rng_state()
    kv_cache._profile_forward(runner.model, config, runner.device, runner.max_model_len, counts)
    # its draws leave the generator as it was: a run draws the same numbers with or without the profile
    assert torch.equal(torch.get_rng_state(), rng)

    vocab = TINY["vocab_size"]
    [(shape, rows, given)] = calls
    assert tuple(shape) == (sampled, vocab) and given is counts
    assert all(r.temperature > 0 and r.logprobs == 7 and r.bias_token_ids and r.banned and r.allowed
               and r.presence_penalty and r.frequency_penalty and r.repetition_penalty != 1 and r.penalty_key
               for r in rows)
    # row 0 alone unfiltered: on a GPU the rest go to the torch sampler as a copy (here the CPU's takes them all)
    assert [r.filtered for r in rows] == [False] + [True] * (sampled - 1)
    assert all(r.top_k > 0 and r.top_p < 1 and r.min_p > 0 for r in rows[1:])
    assert filtered == [(sampled, True, True, True)]
    # the kept table at max_num_seqs rows before the rows are counted, and kept by the engine after
    assert penalized == [(sampled, True, (seqs, vocab))]
    assert counts.counts.shape == counts.in_prompt.shape == (seqs, vocab)
    assert not counts.slots and sorted(counts.free) == list(range(seqs))     # no made-up request's slot kept
    # the sampled rows' logprobs at max_logprobs, then the prompt-logprob rows'
    assert gathered == [(sampled, 7), (min(budget, scheduler.PROMPT_LOGPROB_ROWS), 7)]


def test_only_the_rank_that_samples_profiles_the_sampler(tiny_models, monkeypatch):
    """A tensor-parallel worker never samples: its profile leaves the sampler (and the count table) out."""
    llm = LLM(tiny_models["qwen3"], device="cpu", attention_backend="torch", max_num_seqs=4, num_kv_blocks=64)
    runner, given = llm.engine.executor.runner, []
    monkeypatch.setattr(kv_cache, "profile_num_blocks", lambda *args: given.append(args[-1]) or 1)
    runner.profile_num_blocks()
    monkeypatch.setattr(runner, "tp", TPGroup(rank=1, size=2))
    runner.profile_num_blocks()
    assert given == [runner.penalty_counts, None]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_sampling_step_stays_within_the_profiled_peak(tmp_path, monkeypatch):
    """A step of max_num_seqs rows with penalties, logit bias, top-k, top-p, min-p and logprobs (the first, which
    also fills the penalty count table) takes no more memory above what is in use than the profile measured and the
    KV budget kept free for it. A vocabulary large against the model, so that the sampler's memory is most of it."""
    seqs, vocab = 256, 32768
    path = build_tiny_checkpoint(str(tmp_path / "m"), "qwen3", vocab_size=vocab)
    profiled = []
    real_forward = kv_cache._profile_forward

    def profile_forward(*args):
        real_forward(*args)
        torch.cuda.synchronize()
        profiled.append(torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated())
    monkeypatch.setattr(kv_cache, "_profile_forward", profile_forward)
    llm = LLM(path, device="cuda", gpu_memory_utilization=0.5, max_num_seqs=seqs, max_num_batched_tokens=2 * seqs)
    assert len(profiled) == 1
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.01, presence_penalty=0.5,
                            frequency_penalty=0.5, repetition_penalty=1.2, logit_bias={3: 1.0},
                            logprobs=llm.engine.config.max_logprobs, max_tokens=3, ignore_eos=True)
    prompts = [[4 + i % 100] for i in range(seqs)]     # one token each: every request samples in the first step
    torch.cuda.synchronize()
    in_use = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    outs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    assert all(len(o.outputs[0].token_ids) == 3 and len(o.outputs[0].logprobs[0]) >= 20 for o in outs)
    assert torch.cuda.max_memory_allocated() - in_use <= profiled[0]
