"""Beam search (LLM.beam_search, the server's use_beam_search) against a float64 beam search written here over HF
transformers' logits on the same weights, with the rule entrypoints/beam_search.py states (HF's: max(2, 1 + E) W
candidates a beam for E end-of-sequence ids, an end-of-sequence candidate finishes if among the first W, the rest
fill W live beams; ranked at the end by cumulative log-probability / generated length (a final end-of-sequence token
counted) ** length_penalty, the power saturated at e^+-700), and against HF's generate(num_beams=W) itself."""
import math

import pytest
import torch

from picovllm import LLM, BeamSearchParams
from test_parity_hf import make_prompts


def reference(model, prompt, width, max_tokens, eos, ignore_eos, length_penalty):
    def next_logprobs(tokens):
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0, -1].double()
        return torch.log_softmax(logits, -1)

    live, finished = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        if not live:
            break
        cands = []
        for tokens, cum in live:
            lps = next_logprobs(tokens)
            k = max(2, 1 + (0 if ignore_eos else len(set(eos)))) * width
            order = sorted(range(lps.numel()), key=lambda t: (-lps[t].item(), t))[:k]
            cands += [(tokens + [t], cum + lps[t].item()) for t in order]
        cands.sort(key=lambda c: -c[1])
        live = []
        for i, (tokens, cum) in enumerate(cands):
            if not ignore_eos and tokens[-1] in eos:
                if i < width:
                    finished.append((tokens, cum, True))
            elif len(live) < width:
                live.append((tokens, cum))
    everything = finished + [(t, c, False) for t, c in live]

    def score(b):
        power = length_penalty * math.log(max(len(b[0]) - len(prompt), 1))
        return b[1] / math.exp(min(max(power, -700.0), 700.0))
    return sorted(everything, key=lambda b: -score(b))[:width], len(finished)


@pytest.fixture(scope="module")
def hf_and_llm(tiny_models):
    from transformers import AutoModelForCausalLM
    path = tiny_models["llama"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="eager").eval()
    return model, LLM(path, block_size=4, num_kv_blocks=256, device="cpu")


@pytest.mark.parametrize("width,length_penalty,num_eos", [(1, 1.0, 1), (3, 0.0, 1), (4, 2.0, 1), (2, 1000.0, 1),
                                                         (2, -1000.0, 1)])
def test_beams_match_the_float64_reference(hf_and_llm, width, length_penalty, num_eos):
    """A length_penalty of +-1000 ranks the beams (it had overflowed)."""
    model, llm = hf_and_llm
    prompts = make_prompts(3)[1:]        # 5 and 16 tokens
    # end-of-sequence tokens the search meets: the second (to fourth) most likely first tokens of the first prompt
    first, _ = reference(model, prompts[0], 4, 1, (), True, 1.0)
    eos = [b[0][-1] for b in first[1:1 + num_eos]] if width > 1 else [first[0][0][-1]]
    ended = 0
    llm.engine.eos_token_ids, saved = eos, llm.engine.eos_token_ids
    try:
        for ignore_eos in (False, True):
            params = BeamSearchParams(beam_width=width, max_tokens=5, ignore_eos=ignore_eos,
                                      length_penalty=length_penalty)
            got = llm.beam_search(prompts, params, use_tqdm=ignore_eos)     # vLLM's keyword, a bar or not
            for prompt, out in zip(prompts, got):
                want, n = reference(model, prompt, width, 5, eos, ignore_eos, length_penalty)
                ended += n
                assert [b.tokens for b in out.sequences] == [w[0] for w in want]
                assert [b.cum_logprob for b in out.sequences] == pytest.approx([w[1] for w in want], abs=1e-4)
                assert [b.finish_reason for b in out.sequences] == ["stop" if w[2] else "length" for w in want]
                assert all(b.num_prompt_tokens == len(prompt) and len(b.logprobs) == len(b.output_token_ids)
                           and b.stop_reason is None for b in out.sequences)    # vLLM's field, None in a search
        assert ended > 0        # the end-of-sequence token did finish beams (kept at the end or not)
    finally:
        llm.engine.eos_token_ids = saved


def test_several_end_of_sequence_ids_keep_w_beams_live(hf_and_llm):
    """Llama 3's and Qwen2.5's configs have several end-of-sequence ids. With each prompt's 2nd to 4th likeliest
    first tokens ending sequences, 2W candidates a beam had left fewer than W beams live (4 of 12 of these prompts
    ended otherwise than the reference)."""
    import random
    model, llm = hf_and_llm
    rng, saved = random.Random(0), llm.engine.eos_token_ids
    try:
        for _ in range(12):
            prompt = [rng.randrange(1, 384) for _ in range(6)]
            first, _ = reference(model, prompt, 4, 1, (), True, 1.0)
            eos = [b[0][-1] for b in first[1:4]]
            llm.engine.eos_token_ids = eos
            got = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=0.0))
            want, _ = reference(model, prompt, 2, 3, eos, False, 0.0)
            assert [b.tokens for b in got[0].sequences] == [w[0] for w in want], prompt
    finally:
        llm.engine.eos_token_ids = saved


def test_beams_are_hf_generates(hf_and_llm):
    """HF transformers' generate(num_beams=W) itself, on random prompts, widths, lengths, length penalties and
    end-of-sequence tokens: the same W beams in the same order. A finished beam's length counts its end-of-sequence
    token, as HF's does (2 of these 16 searches had ranked otherwise)."""
    import random
    model, llm = hf_and_llm
    rng, saved = random.Random(1), llm.engine.eos_token_ids
    try:
        for _ in range(16):
            prompt = [rng.randrange(1, 384) for _ in range(rng.randrange(3, 12))]
            width, steps, length_penalty = rng.randrange(2, 9), rng.randrange(2, 6), rng.choice([1.0, 0.5, 2.0])
            with torch.no_grad():
                first = model(torch.tensor([prompt])).logits[0, -1].topk(4).indices.tolist()
            eos = first[rng.randrange(1, 4)]
            llm.engine.eos_token_ids = [eos]
            got = llm.beam_search([prompt], BeamSearchParams(beam_width=width, max_tokens=steps,
                                                             length_penalty=length_penalty))[0].sequences
            with torch.no_grad():
                out = model.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width,
                                     do_sample=False, max_new_tokens=steps, eos_token_id=eos, pad_token_id=eos,
                                     length_penalty=length_penalty)
            want = [s[:len(prompt)] + (s[len(prompt):s.index(eos, len(prompt)) + 1] if eos in s[len(prompt):] else
                                       s[len(prompt):]) for s in out.tolist()]
            assert [b.tokens for b in got] == want, (prompt, width, steps, length_penalty)
    finally:
        llm.engine.eos_token_ids = saved


def test_a_beam_width_past_half_the_vocabulary_searches(hf_and_llm):
    """200 beams over the tiny model's 384 tokens: the 2W candidates a beam proposes are more than the vocabulary, so
    each step asks for all of it (the steps had been refused: SamplingParams.logprobs, a field the caller never set,
    past the vocabulary size), and the beams are the float64 reference's."""
    model, llm = hf_and_llm
    prompt = make_prompts(2)[1]
    first, _ = reference(model, prompt, 4, 1, (), True, 1.0)
    eos = [first[2][0][-1]]          # the third likeliest first token ends a sequence
    llm.engine.eos_token_ids, saved = eos, llm.engine.eos_token_ids
    try:
        got = llm.beam_search([prompt], BeamSearchParams(beam_width=200, max_tokens=3))[0].sequences
    finally:
        llm.engine.eos_token_ids = saved
    want, ended = reference(model, prompt, 200, 3, eos, False, 1.0)
    assert ended > 0
    assert [b.tokens for b in got] == [w[0] for w in want]
    assert [b.cum_logprob for b in got] == pytest.approx([w[1] for w in want], abs=1e-4)


def test_bad_beam_search_params_are_refused_by_name(hf_and_llm):
    _, llm = hf_and_llm
    for kw, field in [(dict(beam_width=0), "beam_width"), (dict(max_tokens=0), "max_tokens"),
                      (dict(temperature=0.7), "temperature"), (dict(length_penalty=float("nan")), "length_penalty"),
                      (dict(length_penalty=True), "length_penalty")]:
        args = dict(beam_width=2, max_tokens=3) | kw
        with pytest.raises(ValueError, match=f"BeamSearchParams.{field}"):
            llm.beam_search([[1, 2, 3]], BeamSearchParams(**args))
    with pytest.raises(ValueError, match="max_model_len"):
        llm.beam_search([[1] * (llm.engine.max_model_len - 2)], BeamSearchParams(beam_width=2, max_tokens=3))
    with pytest.raises(ValueError, match="BeamSearchParams.ignore_eos must be a bool"):
        llm.beam_search([[1, 2, 3]], BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos="no"))
    assert not llm.engine.requests
