"""Logit bias and the presence, frequency and repetition penalties.

Oracles: HF transformers' logits processors (SequenceBiasLogitsProcessor, RepetitionPenaltyLogitsProcessor)
on the same logits, and a float64 hand-written presence/frequency penalty (HF has none) as OpenAI
documents it: logit - frequency * count - presence * (count > 0), counting generated tokens only.
End to end: greedy decoding with those processors on HF's model, token for token.
"""
import functools
import random

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, RepetitionPenaltyLogitsProcessor, \
    SequenceBiasLogitsProcessor

from picovllm import LLM, SamplingParams
from picovllm.engine.model_runner import SamplingRow
from picovllm.layers.logits_processors import adjust_logits
from test_parity_hf import make_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class PresenceFrequencyFloat64(LogitsProcessor):
    """OpenAI's penalties over the tokens generated after the first prompt_len, in float64."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        out = scores.double().clone()
        for b in range(out.shape[0]):
            counts = torch.bincount(input_ids[b, self.prompt_len:], minlength=out.shape[-1]).double()
            out[b] -= self.frequency * counts + self.presence * (counts > 0).double()
        return out.to(scores.dtype)


def reference_processors(prompt_len: int, sp: SamplingParams) -> LogitsProcessorList:
    """In the engine's (vLLM's) order: bias, then repetition, then frequency and presence."""
    procs = []
    if sp.logit_bias:
        procs.append(SequenceBiasLogitsProcessor([[[t], float(b)] for t, b in sp.logit_bias.items()]))
    if sp.repetition_penalty != 1:
        procs.append(RepetitionPenaltyLogitsProcessor(sp.repetition_penalty))
    if sp.presence_penalty or sp.frequency_penalty:
        procs.append(PresenceFrequencyFloat64(prompt_len, sp.presence_penalty, sp.frequency_penalty))
    return LogitsProcessorList(procs)


def row_for(sp: SamplingParams, prompt: list[int], output: list[int]) -> SamplingRow:
    row = SamplingRow(0.0, 0, 1.0, 0.0, None, [], None, sp.presence_penalty, sp.frequency_penalty,
                      sp.repetition_penalty, list(sp.logit_bias), list(sp.logit_bias.values()))
    if sp.has_penalties:
        row.output_token_ids, row.prompt_token_ids = list(output), list(prompt)
    return row


CASES = [
    SamplingParams(),                                                          # untouched row in the batch
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(repetition_penalty=0.7),                                    # < 1 rewards repeats
    SamplingParams(frequency_penalty=0.8),
    SamplingParams(presence_penalty=-1.5),
    SamplingParams(presence_penalty=0.5, frequency_penalty=-0.3, repetition_penalty=1.2),
    SamplingParams(logit_bias={3: 5.0, 7: -100, 40: 0.25}),
    SamplingParams(logit_bias={"11": -2.0}, frequency_penalty=2.0, repetition_penalty=1.9),
]


def test_adjusted_logits_match_hf_processors_and_float64():
    rng = random.Random(0)
    vocab = 50
    torch.manual_seed(0)
    logits = torch.randn(len(CASES), vocab) * 3            # both signs: the repetition penalty treats them apart
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 12))] for _ in CASES]
    outputs = [[rng.randrange(vocab) for _ in range(rng.randint(0, 30))] for _ in CASES]   # repeats: counts > 1
    rows = [row_for(sp, p, o) for sp, p, o in zip(CASES, prompts, outputs)]
    got = adjust_logits(logits, rows)
    assert got.dtype == torch.float32 and not torch.equal(logits, got)
    for i, (sp, p, o) in enumerate(zip(CASES, prompts, outputs)):
        ids = torch.tensor([p + o]) if p + o else torch.zeros(1, 0, dtype=torch.long)
        want = reference_processors(len(p), sp)(ids, logits[i:i + 1].double())[0]
        torch.testing.assert_close(got[i].double(), want, rtol=1e-6, atol=1e-5, msg=f"row {i}: {sp}")
    assert torch.equal(got[0], logits[0])


def test_no_adjustment_is_the_same_tensor_and_banned_tokens_stay_banned():
    logits = torch.randn(2, 20)
    plain = [SamplingRow(0.0, 0, 1.0, 0.0, None, [], None) for _ in range(2)]
    assert adjust_logits(logits, plain) is logits
    rows = [row_for(SamplingParams(repetition_penalty=1.5, logit_bias={4: 100}), [4], [4]), plain[1]]
    rows[0].banned = [4, 5]                                  # min_tokens: EOS beats any bias or penalty
    got = adjust_logits(logits, rows)
    assert got[0, 4] == got[0, 5] == float("-inf") and torch.equal(got[1], logits[1])


@pytest.mark.parametrize("penalty", [1e-300, 1e-36, 1e300])
def test_an_extreme_repetition_penalty_stays_in_float32(penalty):
    """A penalty past float32's range (1e-300 is 0 there, 1e-36 takes a logit of 2 past it at a small temperature,
    1e300 is inf) had made logits inf or NaN, the row's softmax NaN and its token 0 (a served request with
    repetition_penalty 1e-300 said token 0 each step). Held in range: the seen tokens it favours tie at the top, those
    it disfavours sink, unseen tokens are untouched, a banned token stays banned, and every temperature that samples
    draws a token it favours."""
    from picovllm.layers.sampler import GREEDY_BELOW, SamplingTensors, sample
    logits = torch.tensor([[3.0, 2.0, 0.5, -1.0, 4.0]])
    row = row_for(SamplingParams(repetition_penalty=penalty), [1, 2, 3], [])
    row.banned = [2]
    got = adjust_logits(logits, [row])[0]
    assert got[2] == float("-inf") and torch.isfinite(got[[0, 1, 3, 4]]).all()
    assert torch.equal(got[[0, 4]], logits[0, [0, 4]])       # unseen: untouched
    # a tiny penalty: only the seen token with a positive logit (1); a huge one: any but the seen negative one (3)
    drawable = {1} if penalty < 1 else {0, 1, 4}
    assert got.argmax() == (1 if penalty < 1 else 4) and (got[3] > -1 if penalty < 1 else got[3] < -1e30)
    for temperature in (1.0, GREEDY_BELOW):
        t = SamplingTensors(torch.tensor([temperature] * 16), torch.zeros(16, dtype=torch.long), torch.ones(16),
                            torch.zeros(16), [None] * 16, False, False, False, False)
        assert set(sample(got.expand(16, -1).contiguous(), t).tolist()) <= drawable


def test_pending_output_token_counts_from_the_step_in_flight():
    """Overlapped scheduling: the last output token is only on the device (the previous step's tokens)."""
    torch.manual_seed(1)
    logits = torch.randn(2, 30)
    sp = SamplingParams(frequency_penalty=1.0, presence_penalty=0.5, repetition_penalty=1.4)
    known = [row_for(sp, [1, 2], [9, 9, 3, 17]), row_for(sp, [4], [5])]
    pending = [row_for(sp, [1, 2], [9, 9, 3]), row_for(sp, [4], [5])]
    pending[0].pending_src = 2                               # the in-flight step sampled 17 in its row 2
    prev = torch.tensor([0, 0, 17, 0])
    torch.testing.assert_close(adjust_logits(logits, pending, prev), adjust_logits(logits, known))
    with pytest.raises(ValueError, match="pending"):
        adjust_logits(logits, pending)


def test_kept_counts_give_what_counts_built_anew_give(monkeypatch):
    """PenaltyCounts (an engine's rows: counts kept on the device from step to step, only new outputs added) against
    the same rows without a key (every count built anew from the lists, the path the tests above check against HF):
    40 random steps over 12 requests, a few in each step, with outputs growing by one or several tokens (a skipped
    step, accepted drafts), outputs the rows do not count yet (num_outputs behind its list, and falling back now and
    then), drafts ahead, a pending token from the step in flight, two rows of one request (speculative rows, the
    same outputs counted), a request id used again by a new
    request, and two slots to start with, so slots are taken over from requests left out of a step; the table,
    doubling, stops at its 5 slots (a step's most requests, as an engine's max_num_seqs)."""
    from picovllm.layers.logits_processors import PenaltyCounts
    monkeypatch.setattr(PenaltyCounts, "MIN_SLOTS", 2)
    rng, vocab = random.Random(5), 50
    kept = PenaltyCounts(torch.device("cpu"), max_slots=5)
    sps = [SamplingParams(frequency_penalty=0.7, presence_penalty=0.3, repetition_penalty=rng.choice([1.0, 1.3]))
           for _ in range(12)]
    reqs = {i: ([rng.randrange(vocab) for _ in range(rng.randrange(1, 6))], []) for i in range(12)}
    for step in range(40):
        if step == 20:
            reqs[3] = ([7, 7], [])                          # id 3 again: a new request, new lists
        logits = torch.randn(8, vocab) * 3
        rows, anew, prev = [], [], torch.randint(0, vocab, (8,))
        for i in rng.sample(range(12), rng.randrange(1, 6)):
            prompt, outputs = reqs[i]
            outputs += [rng.randrange(vocab) for _ in range(rng.choice([0, 1, 1, 3]))]
            counted = rng.randrange(max(0, len(outputs) - 2), len(outputs) + 1)     # may fall: counted anew
            for _ in range(rng.choice([1, 1, 2])):
                ahead = [rng.randrange(vocab) for _ in range(rng.choice([0, 0, 2]))]
                pending = rng.choice([-1, rng.randrange(8)])
                row = row_for(sps[i], prompt, [])
                row.penalty_key, row.output_token_ids, row.num_outputs = str(i), outputs, counted
                row.prompt_token_ids = prompt if sps[i].repetition_penalty != 1 else []
                row.ahead, row.pending_src = ahead, pending
                rows.append(row)
                plain = row_for(sps[i], prompt, outputs[:counted] + ahead)
                plain.pending_src = pending
                anew.append(plain)
        logits = logits[:len(rows)]
        torch.testing.assert_close(adjust_logits(logits, rows, prev, kept), adjust_logits(logits, anew, prev),
                                   rtol=0, atol=0)
        assert kept.counts.shape[0] <= 5     # doubling from 2 to 4, then to its max_slots, not to 8
    assert kept.counts.shape[0] == 5


# -- end to end: greedy decoding against HF's model with the reference processors ----------------------------------
@functools.lru_cache(maxsize=2)
def hf_model(path: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy_with(path: str, prompt: list[int], sp: SamplingParams, max_new: int) -> list[int]:
    model = hf_model(path)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                           logits_processor=reference_processors(len(prompt), sp), pad_token_id=0, eos_token_id=None)
    return g[0, len(prompt):].tolist()


E2E = [SamplingParams(repetition_penalty=1.5), SamplingParams(frequency_penalty=1.5),
       SamplingParams(presence_penalty=2.0), SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5,
                                                            presence_penalty=0.5, logit_bias={33: 3.0}),
       SamplingParams(logit_bias={200: 8.0, 301: -100})]


@pytest.mark.parametrize("engine", [
    dict(),                                                                 # CPU decode stack (graph-like path)
    dict(async_scheduling=True, block_size=4, max_num_batched_tokens=7, num_kv_blocks=256),   # pending tokens
    dict(enforce_eager=True, block_size=16, max_num_batched_tokens=64, num_kv_blocks=9),     # preemption
    pytest.param(dict(device="cuda", dtype="float32"),     # CUDA graphs, overlapped scheduling, Triton kernels
                 marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]),
])
def test_greedy_with_penalties_matches_hf(tiny_models, engine):
    path = tiny_models["llama"]
    prompts = [make_prompts()[i] for i in (0, 1, 2, 4, 6)]   # prompts on which each penalty has an effect
    max_new = 16
    params = [SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True, **_penalty_kwargs(sp))
              for sp in E2E]
    want = [hf_greedy_with(path, p, sp, max_new) for p, sp in zip(prompts, params)]
    plain = [hf_greedy_with(path, p, SamplingParams(), max_new) for p in prompts]
    assert all(w != q for w, q in zip(want, plain)), "each penalty must change the greedy tokens"
    llm = LLM(path, **{"num_kv_blocks": 64, **engine})
    # each request in a batch with the others, unpenalized ones too: penalties are per row
    outs = llm.generate(prompts + prompts, params + [SamplingParams(temperature=0, max_tokens=max_new,
                                                                    ignore_eos=True)] * len(prompts), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want + plain


def _penalty_kwargs(sp: SamplingParams) -> dict:
    return dict(presence_penalty=sp.presence_penalty, frequency_penalty=sp.frequency_penalty,
                repetition_penalty=sp.repetition_penalty, logit_bias=sp.logit_bias)


def test_seeded_penalized_sampling_reproduces_in_any_batch(tiny_models):
    """Sampling (not greedy) from penalized logits: a seeded request gets the same tokens alone and batched."""
    path = tiny_models["llama"]
    llm = LLM(path, num_kv_blocks=64)
    sp = SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=12, ignore_eos=True,
                        frequency_penalty=2.0, repetition_penalty=1.5, logit_bias={5: 6.0})
    prompts = make_prompts()
    alone = llm.generate([prompts[2]], sp, use_tqdm=False)[0].outputs[0].token_ids
    batched = llm.generate(prompts, sp, use_tqdm=False)[2].outputs[0].token_ids
    unpenalized = llm.generate([prompts[2]], SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=12,
                                                            ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    assert alone == batched, (alone, batched)
    assert alone != unpenalized
