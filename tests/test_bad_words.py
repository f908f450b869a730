"""SamplingParams.bad_words (vLLM's): words never generated.

Oracle: HF transformers' NoBadWordsLogitsProcessor over the output tokens only (vLLM's rule: the prompt does not
count), on the same logits and, end to end, inside HF's greedy generation on the same weights. Both the host's
bans and the pairs checked on the device against a pending token (overlapped scheduling) are covered.
"""
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList, NoBadWordsLogitsProcessor

from picovllm import LLM, SamplingParams
from picovllm.engine.step_input import SamplingRow
from picovllm.layers.logits_processors import adjust_logits, bad_word_bans
from serving_fixtures import chat_model  # noqa: F401 - a fixture

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class OutputOnly(NoBadWordsLogitsProcessor):
    """HF's bad-words processor, shown only the tokens generated after prompt_len (vLLM's rule)."""

    def __init__(self, bad_words_ids: list[list[int]], prompt_len: int) -> None:
        super().__init__(bad_words_ids, eos_token_id=None)
        self.prompt_len = prompt_len

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        return super().__call__(input_ids[:, self.prompt_len:], scores)


def plain_row(banned: list[int]) -> SamplingRow:
    return SamplingRow(0.0, 0, 1.0, 0.0, None, banned, None)


def test_bans_match_hf_with_the_last_token_known_or_pending():
    rng = random.Random(0)
    vocab = 24
    torch.manual_seed(0)
    cases = []
    for _ in range(200):
        words = [[rng.randrange(vocab) for _ in range(rng.randint(1, 3))] for _ in range(rng.randint(1, 4))]
        # outputs that end with a word's prefix often, so the multi-token bans fire
        word = rng.choice(words)
        output = [rng.randrange(vocab) for _ in range(rng.randint(0, 4))] + word[:-1] * rng.randint(0, 1)
        cases.append((words, output))
    logits = torch.randn(len(cases), vocab)
    want = torch.stack([OutputOnly(w, 0)(torch.tensor([o], dtype=torch.long).reshape(1, -1), logits[i:i + 1])[0]
                        for i, (w, o) in enumerate(cases)])
    fired = sum(any(len(x) > 1 and o[-(len(x) - 1):] == x[:-1] for x in w) for w, o in cases if o)
    assert fired > 20, "too few cases exercise a multi-token word"
    known = [plain_row(bad_word_bans(w, o, False)[0]) for w, o in cases]
    assert torch.equal(adjust_logits(logits, known).isinf(), want.isinf())
    # overlapped scheduling: the last output token is still on the device, in row 2i + 1 of the step in flight
    rows, prev = [], torch.zeros(2 * len(cases), dtype=torch.long)
    for i, (w, o) in enumerate(cases):
        if not o:
            rows.append(plain_row(bad_word_bans(w, o, False)[0]))
            continue
        now, after, ban = bad_word_bans(w, o[:-1], True)
        row = plain_row(now)
        row.bad_after, row.bad_ban, row.pending_src = after, ban, 2 * i + 1
        prev[2 * i + 1] = o[-1]
        rows.append(row)
    got = adjust_logits(logits, rows, prev)
    assert torch.equal(got.isinf(), want.isinf())
    assert torch.equal(got[~got.isinf()], logits[~want.isinf()])
    with pytest.raises(ValueError, match="pending"):
        adjust_logits(logits, rows)


def vllm_word_ids(tok, word: str) -> list[list[int]]:
    """vLLM's reading of a bad word, by hand: as it is, and after a space if that is as long and starts otherwise."""
    bare = tok.encode(word.lstrip(), add_special_tokens=False)
    spaced = tok.encode(" " + word.lstrip(), add_special_tokens=False)
    return [bare] + ([spaced] if len(spaced) == len(bare) and spaced[0] != bare[0] else [])


PROMPTS = ["Hello, how are you", "The capital of France is", "Numbers: 0 1 2"]


def hf_greedy(model, tok, prompt: str, words: list[str], max_new: int) -> list[int]:
    ids = torch.tensor([tok.encode(prompt)])
    procs = [OutputOnly([x for w in words for x in vllm_word_ids(tok, w)], ids.shape[1])] if words else []
    with torch.no_grad():
        g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                           logits_processor=LogitsProcessorList(procs), pad_token_id=0, eos_token_id=None)
    return g[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module")
def reference(chat_model):
    """Per prompt: bad words taken from its plain greedy output (one of one token, one of two) that change the
    greedy output, and HF's greedy tokens with them."""
    model = AutoModelForCausalLM.from_pretrained(chat_model, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(chat_model)
    cases = []
    for prompt in PROMPTS:
        plain = hf_greedy(model, tok, prompt, [], 16)
        single = next(w for t in plain[2:] if (w := tok.decode([t])).strip() and vllm_word_ids(tok, w)[-1] == [t])
        pair = next(w for a, b in zip(plain[4:], plain[5:]) if (w := tok.decode([a, b])).strip()
                    and [a, b] in vllm_word_ids(tok, w))
        for words in ([single], [pair], [single, pair]):
            want = hf_greedy(model, tok, prompt, words, 16)
            assert want != plain, (prompt, words)      # each case bans something the model would have said
            cases.append((prompt, words, want, plain))
    return cases


@pytest.mark.parametrize("engine", [
    dict(),                                                                 # CPU decode stack
    dict(async_scheduling=True, block_size=4, max_num_batched_tokens=7, num_kv_blocks=256),   # pending tokens
    dict(enforce_eager=True, block_size=16, max_num_batched_tokens=64, num_kv_blocks=12),    # preemption
    pytest.param(dict(device="cuda", dtype="float32"),     # CUDA graphs, overlapped scheduling, Triton kernels
                 marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]),
])
def test_greedy_with_bad_words_matches_hf(chat_model, reference, engine):
    llm = LLM(chat_model, **{"num_kv_blocks": 64, **engine})
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, bad_words=words)
              for _, words, _, _ in reference]
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [p for p, *_ in reference]
    # every request in one batch, beside ones without bad words: the bans are per row
    outs = llm.generate(prompts + prompts, params + [plain] * len(prompts), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [w for *_, w, _ in reference] + [q for *_, q in reference]
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


@pytest.mark.parametrize("overlap", [False, True])
def test_bad_words_travel_to_d(chat_model, reference, overlap):
    """Disaggregated: P samples the first token, D the rest; D reads the words from the params on the wire."""
    from test_disagg_engines import LocalPair
    pair = LocalPair(chat_model, p_kw=dict(num_kv_blocks=64), d_kw=dict(num_kv_blocks=64), overlap=overlap)
    ids = [pair.p.submit(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, bad_words=words))
           for prompt, words, _, _ in reference]
    pair.p.close()
    pair.run()
    assert [pair.final[i].outputs[0].token_ids for i in ids] == [w for *_, w, _ in reference]
    for eng in (pair.p, pair.d):
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_bad_words_refused_where_they_cannot_be_honoured(chat_model):
    llm = LLM(chat_model, num_kv_blocks=64)
    for kw, match in [(dict(bad_words=["  "]), "bad_words"), (dict(bad_words="word"), "bad_words"),
                      (dict(bad_words=["the"], allowed_token_ids=[5, 6]), "allowed_token_ids"),
                      (dict(bad_words=["the"], structured_outputs={"choice": ["a", "b"]}), "structured outputs")]:
        with pytest.raises(ValueError, match=match):
            llm.engine.add_request("Hello", SamplingParams(max_tokens=2, **kw))
    assert not llm.engine.requests
