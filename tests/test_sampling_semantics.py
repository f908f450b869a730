"""SamplingParams read as vLLM reads them, where picovllm had read them otherwise.

Oracles: the tokenizer's own decode, cases worked by hand from vLLM's rules (each test says which), and for the fused
sampler a row whose one finite logit must win.
"""
import os
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")     # before triton is imported: the fused sampler interpreted

import triton                                                          # noqa: E402
import triton.language as tl                                           # noqa: E402

from picovllm import SamplingParams                                    # noqa: E402
from picovllm.engine.detokenizer import Detokenizer                    # noqa: E402
from picovllm.engine.llm_engine import Engine                          # noqa: E402
from picovllm.engine.request import Request                            # noqa: E402
from picovllm.sampling_params import MAX_CACHE_SALT_CHARS              # noqa: E402


def word_tokenizer(words: list[str], decoder: str = "metaspace"):
    """A fast HF tokenizer over whole words: <unk> <s> </s> (special), then `words` in order (ids 3, 4, ...).
    metaspace: each word carries SentencePiece's '▁' (a space before it); wordpiece: the decoder joins tokens with
    spaces, special ones too, as BERT's does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {w: i for i, w in enumerate(words, 3)}
    if decoder == "metaspace":
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    else:
        tok = Tokenizer(models.WordPiece(vocab, unk_token="<unk>"))
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.Whitespace(), decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def feed(tok, prompt: list[int], out: list[int], eos: tuple[int, ...] = (), primary_eos: int | None = None, **params):
    """The request's final (text, finish_reason, stop_reason, token ids) as the engine gives them when it samples out's
    tokens one by one (Engine.append_token and Engine.make_output on an engine of this tokenizer alone)."""
    eng = SimpleNamespace(eos_token_ids=list(eos), detokenizer=Detokenizer(tok), max_model_len=10**9,
                          primary_eos=primary_eos, _decode_tokens=lambda d: None, stream_deltas=False)
    req = Request("r", prompt, SamplingParams(max_tokens=len(out), **params))
    req.max_tokens = len(out)
    for t in out:
        if req.is_finished:
            break
        Engine.append_token(eng, req, t, None, 0.0)
    c = Engine.make_output(eng, req).outputs[0]
    return c.text, c.finish_reason, c.stop_reason, c.token_ids


# -- stop strings ----------------------------------------------------------------------------------------------
def test_a_token_completing_several_stop_strings_is_cut_at_the_first_to_end():
    """One token's text ' x.y;z' completes both stop strings. vLLM takes the first listed that matches (';') and
    returns ' x.y', a text that still holds the stop string '.'; cut at the one that ends first, the text is what
    stopping character by character gives: ' x' (' x.' with include_stop_str_in_output), whatever the list's order.
    Where two end at the same character, the one listed first is taken (vLLM's order)."""
    tok = word_tokenizer(["\u2581hi", "\u2581x.y;z", "\u2581more"])
    prompt, out = [3], [4, 5]
    assert tok.decode(prompt + out)[len(tok.decode(prompt)):] == " x.y;z more"
    for stop in ([";", "."], [".", ";"]):
        assert feed(tok, prompt, out, stop=stop) == (" x", "stop", ".", [4])
        assert feed(tok, prompt, out, stop=stop, include_stop_str_in_output=True) == (" x.", "stop", ".", [4])
    assert feed(tok, prompt, out, stop=["y;", ";"])[:3] == (" x.", "stop", "y;")
    assert feed(tok, prompt, out, stop=[";", "y;"])[:3] == (" x.y", "stop", ";")
    assert feed(tok, prompt, out, stop=["x.y;z m"]) == (" ", "stop", "x.y;z m", [4, 5])   # across tokens, as before


# -- stop_reason -----------------------------------------------------------------------------------------------
def test_stop_reason_is_none_for_the_eos_even_listed_in_stop_token_ids():
    """vLLM's check_stop tests the request's EOS before its stop_token_ids: the EOS (not ignored) gives stop_reason
    None even where the request also lists it; with ignore_eos the stop_token_ids entry stops it, with its id. Another
    EOS of the model (its generation config's) and a plain stop token give their id. The text leaves the stopping
    token out (no include_stop_str_in_output)."""
    tok = word_tokenizer(["\u2581a", "\u2581b", "\u2581c"])
    prompt, eos, other_eos = [3], 2, 5
    fed = lambda out, **kw: feed(tok, prompt, out, eos=(eos, other_eos), primary_eos=eos, **kw)   # noqa: E731
    assert fed([4, eos, 4]) == (" b", "stop", None, [4, eos])
    assert fed([4, eos, 4], stop_token_ids=[eos]) == (" b", "stop", None, [4, eos])
    assert fed([4, eos, 4], stop_token_ids=[eos], ignore_eos=True) == (" b", "stop", eos, [4, eos])
    assert fed([4, other_eos, 4]) == (" b", "stop", other_eos, [4, other_eos])
    assert fed([4, 3, 4], stop_token_ids=[3]) == (" b", "stop", 3, [4, 3])
    assert fed([4, eos, 4], ignore_eos=True) == (" b b", "length", None, [4, eos, 4])    # </s> skipped: special


# -- spaces_between_special_tokens -----------------------------------------------------------------------------
def test_spaces_between_special_tokens_false_joins_added_tokens():
    """A WordPiece decoder puts a space between every two tokens, special ones too: 'hello [CLS] [SEP] worlds'.
    vLLM's fast detokenizer, asked for spaces_between_special_tokens=False with skip_special_tokens=False, gives an
    added token that follows another as its own text: '[CLS][SEP]' (it had been ignored). True is the tokenizer's
    own decode (the oracle); skipping special tokens, the switch does nothing (vLLM's)."""
    tok = word_tokenizer(["[CLS]", "[SEP]", "hello", "world", "##s"], decoder="wordpiece")
    cls, sep, hello, world, s = 3, 4, 5, 6, 7
    tok.add_special_tokens({"cls_token": "[CLS]", "sep_token": "[SEP]"})
    assert {cls, sep} <= set(tok.added_tokens_decoder)
    prompt, out = [hello], [world, cls, sep, cls, hello, world, s]
    decoded = tok.decode(prompt + out, skip_special_tokens=False)
    assert decoded == "hello world [CLS] [SEP] [CLS] hello worlds"
    spaced = feed(tok, prompt, out, skip_special_tokens=False)[0]
    assert spaced == decoded[len("hello"):]
    joined = feed(tok, prompt, out, skip_special_tokens=False, spaces_between_special_tokens=False)[0]
    assert joined == " world [CLS][SEP][CLS] hello worlds"
    assert feed(tok, prompt, out, spaces_between_special_tokens=False)[0] == \
        tok.decode(prompt + out, skip_special_tokens=True)[len("hello"):] == " world hello worlds"


# -- field validation ------------------------------------------------------------------------------------------
def test_cache_salt_is_capped_at_vllms_length():
    """vLLM's serving layer refuses a cache_salt longer than 128 characters; so does SamplingParams (add_request
    validates again), naming the field, with the salt shown by its length rather than in full."""
    assert MAX_CACHE_SALT_CHARS == 128
    assert SamplingParams(cache_salt="s" * 128).cache_salt == "s" * 128
    with pytest.raises(ValueError, match=r"SamplingParams\.cache_salt .*at most 128 characters.*129 characters"):
        SamplingParams(cache_salt="s" * 129)
    sp = SamplingParams()
    sp.cache_salt = "s" * 10**6
    with pytest.raises(ValueError, match=r"SamplingParams\.cache_salt") as e:
        sp.validate()
    assert len(str(e.value)) < 300
    for bad in ("", 5):
        with pytest.raises(ValueError, match=r"SamplingParams\.cache_salt"):
            SamplingParams(cache_salt=bad)


def test_prompt_logprobs_true_is_one_as_vllms():
    """vLLM's __post_init__ reads logprobs=True and prompt_logprobs=True as 1 (prompt_logprobs=True was refused)."""
    sp = SamplingParams(logprobs=True, prompt_logprobs=True)
    assert (sp.logprobs, sp.prompt_logprobs) == (1, 1) and type(sp.prompt_logprobs) is int
    with pytest.raises(ValueError, match=r"SamplingParams\.prompt_logprobs"):
        SamplingParams(prompt_logprobs=False)


# -- the fused sampler -----------------------------------------------------------------------------------------
@triton.jit
def zero_at_quad_one(seed, offset):      # tl.rand4x's stand-in: quad 1 holds tokens 4..7, u = 0 there, 0.5 elsewhere
    u = tl.where(offset == 1, 0.0, 0.5)
    return u, u, u, u


def test_fused_sampler_keeps_a_rows_one_token_when_its_uniform_draw_is_zero(monkeypatch):
    """A row with one finite logit (allowed_token_ids of one token, a grammar's forced token) must sample that token.
    When its uniform draw was exactly 0 (1 in 2**31 from tl.rand), -log(-log(0)) made its score -inf, the row had no
    winner and took token 0, which it forbids. The draws are replaced here with one that is 0 at that token."""
    from picovllm.kernels import sampling
    monkeypatch.setattr(tl, "rand4x", zero_at_quad_one)
    logits = torch.full((2, 64), float("-inf"))
    logits[0, 5] = 1.0                         # row 0: token 5 alone (its u is 0)
    logits[1, 5], logits[1, 9] = 1.0, 0.5      # row 1: token 9's u is 0.5 and token 5's 0: 9 wins
    got = sampling.gumbel_sample(logits, torch.tensor([1.0, 1.0]), torch.tensor([3, 4]), block=16)
    assert got.tolist() == [5, 9]


def test_torch_sampler_keeps_a_rows_one_token_when_its_uniform_draw_is_zero(monkeypatch):
    """The torch sampler's keys are prob / -log(u): a draw of exactly 0 (about 1 in 2**24 from torch.rand) gave the
    row's one allowed token the key 0, tied with every forbidden token's, and argmax took token 0."""
    from picovllm.layers import sampler
    monkeypatch.setattr(sampler.torch, "rand_like", lambda p: torch.where(torch.arange(p.shape[-1]) == 5, 0.0, 0.5)
                        .expand_as(p).clone())
    logits = torch.full((2, 16), float("-inf"))
    logits[0, 5] = 1.0                          # row 0: token 5 alone, its draw 0
    logits[1, 5], logits[1, 9] = 1.0, 0.5       # row 1: token 5's draw 0 is the smallest key: 9 wins
    t = sampler.SamplingTensors(torch.ones(2), torch.zeros(2, dtype=torch.long), torch.ones(2), torch.zeros(2),
                                [None, None], False, False, False, False, [False, False])
    assert sampler._sample_torch(logits, t).tolist() == [5, 9]


def test_pooling_cache_salt_is_capped_as_sampling_s():
    from picovllm import PoolingParams
    assert PoolingParams(cache_salt="s" * MAX_CACHE_SALT_CHARS).cache_salt == "s" * MAX_CACHE_SALT_CHARS
    with pytest.raises(ValueError, match=r"PoolingParams\.cache_salt .*at most 128 characters.*129 characters"):
        PoolingParams(cache_salt="s" * 129)


def test_a_bad_word_that_is_no_token_is_refused_by_name():
    """A bad word the tokenizer turns into no token bans nothing: refused naming bad_words (it was dropped)."""
    from picovllm.layers.logits_processors import bad_words_token_ids
    tok = SimpleNamespace(encode=lambda text, add_special_tokens: [] if text.strip() == "\u200b" else
                          [ord(c) for c in text])
    assert bad_words_token_ids(tok, ["ab"]) == [[97, 98]]
    with pytest.raises(ValueError, match=r"SamplingParams\.bad_words: '\\u200b' is no token"):
        bad_words_token_ids(tok, ["ab", "\u200b"])
