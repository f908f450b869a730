"""Sampling: seeds, greedy equivalents, stop conditions, logprobs, and the sampled distribution.

Oracles: HF transformers on the same weights (greedy, EOS/min_new_tokens, full logits), the
tokenizer's own decode, and a float64 numpy reimplementation of temperature/min-p/top-k/top-p.
"""
import json
import os
import shutil

import numpy as np
import pytest
import torch

from conftest import build_tiny_checkpoint
from picovllm import LLM, SamplingParams
from picovllm.layers.sampler import SamplingTensors, apply_top_k_top_p_min_p, sample, seeded_stream
from test_parity_hf import hf_greedy, make_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SIGMAS = 5.0   # empirical frequency within 5 binomial standard deviations of the analytic probability


# -- fixtures and oracles ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def word_model(tmp_path_factory) -> str:
    """A tiny llama with a 32-token vocabulary and a word-level tokenizer whose tokens carry a leading
    '▁' as SentencePiece's do: decoding such a token alone drops its leading space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = build_tiny_checkpoint(str(tmp_path_factory.mktemp("words")), "llama", vocab_size=32,
                                 bos_token_id=1, eos_token_id=2)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"\u2581w{i}": i for i in range(3, 32)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)
    return path


def hf_model(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_generate(model, prompt: list[int], max_new: int, eos: int, min_new: int = 0) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, min_new_tokens=min_new,
                           do_sample=False, pad_token_id=eos, eos_token_id=eos)
    return g[0, len(prompt):].tolist()


def hf_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """float64 log-softmax of the next-token logits at each output position (teacher forced)."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1]
    return logits.double().log_softmax(-1)


def filtered_probs(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0,
                   min_p: float = 0.0) -> np.ndarray:
    """The distribution sampling must follow, in float64: temperature, then min-p, top-k, top-p."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    keep = np.ones(len(z), bool)
    if min_p > 0:
        keep &= p >= min_p * p.max()
    order = np.argsort(-z, kind="stable")
    if top_k > 0:
        keep[order[top_k:]] = False
    if top_p < 1:
        q = np.where(keep, p, 0.0)
        q /= q.sum()
        ahead = np.cumsum(q[order]) - q[order]        # mass of the more likely tokens
        keep[order[ahead >= top_p]] = False
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def assert_follows(counts: np.ndarray, probs: np.ndarray) -> None:
    n = counts.sum()
    freq = counts / n
    assert (counts[probs == 0] == 0).all(), f"filtered-out tokens were sampled: {counts}, p={probs}"
    tol = SIGMAS * np.sqrt(probs * (1 - probs) / n) + 1e-12
    assert (np.abs(freq - probs) <= tol).all(), f"freq {freq.round(4)} vs p {probs.round(4)} (tol {tol.round(4)})"


# -- seeds ---------------------------------------------------------------------------------------
def test_seeded_request_reproduces_alone_and_in_any_batch(tiny_models):
    path = tiny_models["llama"]
    prompts = make_prompts()
    target = prompts[3]
    sp = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)
    alone = LLM(path, num_kv_blocks=64).generate([target], sp, use_tqdm=False)[0].outputs[0].token_ids

    # a batch of seeded and unseeded requests, under chunked prefill and preemption
    llm = LLM(path, block_size=4, max_num_batched_tokens=7, num_kv_blocks=40)
    preempted = []
    real = llm.engine.scheduler.preempt
    llm.engine.scheduler.preempt = lambda r: (preempted.append(r.request_id), real(r))
    other = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=99, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=1.3, min_p=0.05, max_tokens=12, ignore_eos=True)]
    batch = [prompts[0], prompts[7], target, prompts[1], target, prompts[5]]
    params = [other[0], other[1], sp, other[2], sp, other[3]]
    outs = llm.generate(batch, params, use_tqdm=False)
    assert preempted, "the cache was meant to force preemption"
    assert outs[2].outputs[0].token_ids == alone
    assert outs[4].outputs[0].token_ids == alone
    # the other seed gives other tokens: the check above could fail
    assert outs[1].outputs[0].token_ids != LLM(path, num_kv_blocks=64).generate(
        [prompts[7]], SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=12,
                                     ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids


def test_the_engine_seed_makes_unseeded_sampling_repeat(tiny_models, tmp_path):
    """LLM(seed=...) (vLLM's, default 0) seeds the generators unseeded requests draw from: the same requests in the
    same order sample the same tokens in another engine of the same seed, in this process or a fresh one, and other
    tokens under another seed; seed=None (vLLM's "not seeded") differs engine to engine."""
    import subprocess
    import sys

    path, prompts = tiny_models["llama"], make_prompts()[:3]
    kws = [dict(temperature=1.0), dict(temperature=0.8, top_k=40, top_p=0.9), dict(temperature=1.2, min_p=0.02)]
    params = [SamplingParams(max_tokens=10, ignore_eos=True, **kw) for kw in kws]

    def tokens(seed="default"):
        llm = LLM(path, num_kv_blocks=64) if seed == "default" else LLM(path, num_kv_blocks=64, seed=seed)
        torch.rand(7)            # the caller's own draws between start-up and the requests move the generator alike
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    first = tokens()
    assert tokens(0) == first                # the default seed is 0
    assert tokens(5) != first and tokens(5) == tokens(5)
    assert tokens(None) != tokens(None)
    code = (f"import json, torch; from picovllm import LLM, SamplingParams; "
            f"p = [SamplingParams(max_tokens=10, ignore_eos=True, **kw) for kw in {kws!r}]; "
            f"llm = LLM({path!r}, num_kv_blocks=64); torch.rand(7); "
            f"print(json.dumps([o.outputs[0].token_ids for o in llm.generate({prompts!r}, p, use_tqdm=False)]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == first


def test_degenerate_filters_equal_greedy(tiny_models):
    """top_k=1, min_p=1 and a tiny top_p leave one token: sampling must pick the greedy one."""
    path = tiny_models["llama"]
    prompts = make_prompts()[:6]
    ref, _ = hf_greedy(path, prompts, 10)
    common = dict(max_tokens=10, ignore_eos=True)
    params = [SamplingParams(temperature=1.0, top_k=1, **common),
              SamplingParams(temperature=2.5, top_k=1, seed=3, **common),
              SamplingParams(temperature=1.0, min_p=1.0, **common),
              SamplingParams(temperature=1.0, top_p=1e-6, seed=5, **common),
              SamplingParams(temperature=0, **common),
              SamplingParams(temperature=3.0, top_k=1, top_p=0.5, **common),
              SamplingParams(temperature=1e-45, seed=9, **common),    # 1 / T overflows: must act greedy
              SamplingParams(temperature=1.0, top_p=1e-50, seed=7, **common)]   # 0 in float32: the top token stays
    prompts = prompts + prompts[:2]
    ref = ref + ref[:2]
    outs = LLM(path, num_kv_blocks=64).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref


# -- stop conditions -----------------------------------------------------------------------------
def first_new_token_at(tokens: list[int], lo: int, hi: int) -> int | None:
    for k in range(lo, hi):
        if tokens[k] not in tokens[:k]:
            return k
    return None


@pytest.fixture(scope="module")
def stop_case(tiny_models):
    """A prompt whose greedy output (HF, 16 tokens) has a token first appearing at position k >= 3."""
    path = tiny_models["llama"]
    for prompt in make_prompts(seed=1):
        ref, _ = hf_greedy(path, [prompt], 16)
        k = first_new_token_at(ref[0], 3, 10)
        if k is not None:
            return path, prompt, ref[0], k
    pytest.fail("no prompt with a usable stop token")


def test_stop_token_ids_max_tokens_and_min_tokens(stop_case):
    path, prompt, ref, k = stop_case
    t = ref[k]
    llm = LLM(path, num_kv_blocks=64)
    hf = hf_model(path)
    with_min = hf_generate(hf, prompt, 16, eos=t, min_new=k + 2)
    assert with_min[:k] == ref[:k] and with_min[k] != t       # HF's own check that min_new_tokens banned t
    params = [SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[t], ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[t], min_tokens=k + 2, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)]
    stop, min_tok, short = (o.outputs[0] for o in llm.generate([prompt] * 3, params, use_tqdm=False))
    assert stop.token_ids == ref[:k + 1]                       # the stop token is included
    assert (stop.finish_reason, stop.stop_reason) == ("stop", t)
    assert min_tok.token_ids == with_min
    assert min_tok.finish_reason == ("stop" if with_min[-1] == t else "length")
    assert short.token_ids == ref[:5] and short.finish_reason == "length" and short.stop_reason is None


def test_eos_ignore_eos_and_min_tokens(stop_case, tmp_path):
    path, prompt, ref, k = stop_case
    eos = ref[k]
    model_dir = str(tmp_path / "eos_model")
    shutil.copytree(path, model_dir)
    for name in ("config.json", "generation_config.json"):
        file = os.path.join(model_dir, name)
        if os.path.exists(file):
            with open(file) as f:
                cfg = json.load(f)
            cfg["eos_token_id"] = eos
            with open(file, "w") as f:
                json.dump(cfg, f)
    llm = LLM(model_dir, num_kv_blocks=64)
    assert llm.engine.eos_token_ids == [eos]
    with_min = hf_generate(hf_model(path), prompt, 16, eos=eos, min_new=k + 3)
    params = [SamplingParams(temperature=0, max_tokens=16),
              SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=16, min_tokens=k + 3)]
    plain, ignored, min_tok = (o.outputs[0] for o in llm.generate([prompt] * 3, params, use_tqdm=False))
    assert plain.token_ids == ref[:k + 1] and plain.finish_reason == "stop" and plain.stop_reason is None
    assert ignored.token_ids == ref and ignored.finish_reason == "length"
    assert min_tok.token_ids == with_min and eos not in with_min[:k + 3]


def test_stop_strings_across_token_boundaries(default_llm):
    """Stop strings on the default model's known greedy answer ' Paris.\\n\\nThe ...': a string spanning
    two tokens, one spanning three, one inside a single token; matched and trimmed from the text."""
    tok = default_llm.get_tokenizer()
    prompt = "The capital of France is"
    stops = [None, "ris.", ["zzz", "\n\nThe"], "ari"]
    params = [SamplingParams(temperature=0, max_tokens=8, stop=s) for s in stops]
    base, *stopped = (o.outputs[0] for o in default_llm.generate([prompt] * len(stops), params, use_tqdm=False))
    assert base.text.startswith(" Paris.\n\n"), base.text
    ids = tok(prompt).input_ids
    assert base.text == tok.decode(ids + base.token_ids)[len(tok.decode(ids)):]
    pieces = [tok.decode([t]) for t in base.token_ids[:3]]
    assert pieces[0].endswith("ris") and pieces[1] == "."        # "ris." does span two tokens
    for s, out in zip(stops[1:], stopped):
        for n in range(1, len(base.token_ids) + 1):             # the first token whose text completes a stop string
            text = tok.decode(base.token_ids[:n])
            hits = [text.find(x) for x in ([s] if isinstance(s, str) else s) if x in text]
            if hits:
                break
        assert out.token_ids == base.token_ids[:n], s
        assert out.text == text[:min(hits)], s
        assert out.finish_reason == "stop" and out.stop_reason in ([s] if isinstance(s, str) else s)
    assert [o.text for o in stopped] == [" Pa", " Paris.", " P"]


def test_include_stop_str_in_output_keeps_the_matched_string(default_llm):
    """include_stop_str_in_output: the text ends with the stop string that matched, cut right after it (the
    decode of the tokens is the oracle, as in the test above); the tokens and the reason are those without it."""
    tok = default_llm.get_tokenizer()
    prompt = "The capital of France is"
    base = default_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    for stop in ("ris.", ["zzz", "\n\nThe"]):
        plain, kept = (default_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, stop=stop,
                                                                      include_stop_str_in_output=inc),
                                            use_tqdm=False)[0].outputs[0] for inc in (False, True))
        assert kept.token_ids == plain.token_ids and kept.stop_reason == plain.stop_reason
        full = tok.decode(base.token_ids[:len(kept.token_ids)])
        assert kept.text == full[:full.find(kept.stop_reason) + len(kept.stop_reason)] == plain.text + kept.stop_reason


def test_a_stop_tokens_text_stays_out_unless_asked_for(default_llm):
    """As vLLM's: the token that stops a request (stop_token_ids, or EOS) is in its token ids but not in its text,
    unless include_stop_str_in_output; with skip_special_tokens=false a special one would show. The decode of the
    tokens is the oracle."""
    tok = default_llm.get_tokenizer()
    prompt = "The capital of France is"
    base = default_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    k = next(i for i in range(2, 8) if base.token_ids[i] not in base.token_ids[:i])
    stop = base.token_ids[k]
    for inc in (False, True):
        out = default_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop],
                                                            include_stop_str_in_output=inc), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == base.token_ids[:k + 1] and out.stop_reason == stop
        assert out.text == tok.decode(base.token_ids[:k + inc])
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    chat = [{"role": "user", "content": "Say hi."}]
    for inc in (False, True):
        out = default_llm.chat([chat], SamplingParams(temperature=0, max_tokens=64, skip_special_tokens=False,
                                                      include_stop_str_in_output=inc), use_tqdm=False)[0].outputs[0]
        assert out.token_ids[-1] == eos and out.finish_reason == "stop"
        assert out.text.endswith("<|im_end|>") == inc
        assert out.text == tok.decode(out.token_ids[:len(out.token_ids) - 1 + inc], skip_special_tokens=False)


@pytest.mark.parametrize("engine", [
    dict(),
    pytest.param(dict(device="cuda", dtype="float32"),     # CUDA graphs, overlapped scheduling, the fused sampler
                 marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]),
])
def test_allowed_token_ids_match_hf_restricted_argmax(tiny_models, engine):
    """allowed_token_ids: greedy picks HF's fp32 argmax over the allowed ids at every step (HF run token by token
    as the oracle); sampled rows never leave the set, beside an unrestricted row in the same batch; bad sets are
    refused naming the field."""
    path = tiny_models["qwen3"]
    llm = LLM(path, **{"num_kv_blocks": 64, **engine})
    allowed, prompt = [5, 17, 42, 99, 300, 301], [3, 1, 4, 1, 5, 9, 2, 6]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, allowed_token_ids=allowed)
    got = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
    model, ids = hf_model(path), list(prompt)
    with torch.no_grad():
        for _ in range(8):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(allowed[int(logits[allowed].argmax())])
    assert got == ids[len(prompt):]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=24, ignore_eos=True, allowed_token_ids=allowed)
              for s in (1, 2)] + [SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True)]
    outs = [o.outputs[0].token_ids for o in llm.generate([prompt] * 3, params, use_tqdm=False)]
    assert set(outs[0]) <= set(allowed) and set(outs[1]) <= set(allowed) and not set(outs[2]) <= set(allowed)
    vocab = llm.engine.model_config.vocab_size
    for kw in ({"allowed_token_ids": []}, {"allowed_token_ids": [vocab]}, {"allowed_token_ids": [-1]},
               {"allowed_token_ids": [7], "stop_token_ids": [7], "min_tokens": 2},
               {"allowed_token_ids": [5], "structured_outputs": {"regex": "a+"}}):
        with pytest.raises(ValueError, match="allowed_token_ids"):
            llm.generate([prompt], SamplingParams(max_tokens=4, **kw), use_tqdm=False)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_truncate_prompt_tokens_keeps_the_last_k(tiny_models):
    """truncate_prompt_tokens=k runs the prompt's last k tokens: greedy output as HF's on those k (the oracle), the
    output's prompt ids are them; a prompt shorter than k runs whole; -1 (vLLM's) keeps as many as the model takes
    (max_model_len - 1: one position to generate); other k < 1 are refused naming the field."""
    path = tiny_models["llama"]
    llm, model = LLM(path, num_kv_blocks=64), hf_model(path)
    prompt = [7, 3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    for k in (5, 12, 40):
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                    truncate_prompt_tokens=k), use_tqdm=False)[0]
        assert out.prompt_token_ids == prompt[-k:]
        assert out.outputs[0].token_ids == hf_generate(model, prompt[-k:], 6, eos=-1)
    short = LLM(path, num_kv_blocks=64, max_model_len=10)
    out = short.generate([prompt], SamplingParams(temperature=0, max_tokens=1, truncate_prompt_tokens=-1),
                         use_tqdm=False)[0]
    assert out.prompt_token_ids == prompt[-9:] and out.outputs[0].token_ids == hf_generate(model, prompt[-9:], 1, eos=-1)
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens \(11\) is greater than max_model_len \(10\)"):
        short.generate([prompt], SamplingParams(max_tokens=1, truncate_prompt_tokens=11), use_tqdm=False)  # vLLM's
    for k in (0, -2, 2.5):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=k)


def test_detokenized_text_keeps_leading_spaces(word_model):
    """Output text must equal decode(prompt + output) minus decode(prompt), also for tokenizers whose
    tokens decode alone without their leading space (SentencePiece style)."""
    llm = LLM(word_model, num_kv_blocks=16)
    tok = llm.get_tokenizer()
    outs = llm.generate(["w5 w9 w11", "w30"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)
    for o in outs:
        ids, out = o.prompt_token_ids, o.outputs[0].token_ids
        full, head = tok.decode(ids + out, skip_special_tokens=True), tok.decode(ids, skip_special_tokens=True)
        assert full.startswith(head)
        assert o.outputs[0].text == full[len(head):]


def test_native_decode_equals_the_tokenizers_decode(default_llm):
    """The detokenizer's native decode (the `tokenizers` object, transformers' wrapper skipped) gives exactly
    tokenizer.decode on random id runs of the default vocabulary, special tokens kept and skipped, byte pieces of
    split characters included; a tokenizer that cleans up spaces decodes as without the clean-up (vLLM's: a clean-up
    can take back a space already streamed), natively too."""
    import copy
    import random
    from picovllm.engine.detokenizer import Detokenizer, native_decoder
    tok = default_llm.get_tokenizer()
    assert native_decoder(tok) is not None
    detok, rng = Detokenizer(tok), random.Random(0)
    specials = list(tok.all_special_ids)
    for _ in range(400):
        ids = [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(len(tok))
               for _ in range(rng.randint(1, 12))]
        for skip in (False, True):
            assert detok._decode(ids, skip) == tok.decode(ids, skip_special_tokens=skip), (ids, skip)
    asked = copy.copy(tok)          # asked to clean up: transformers 5 still skips it for a BPE model (this one)
    asked.clean_up_tokenization_spaces = True
    assert type(tok.backend_tokenizer.model).__name__ == "BPE" and native_decoder(asked) is not None
    ids = tok.encode("Hello , world ! It 's fine .")
    assert Detokenizer(asked)._decode(ids, True) == asked.decode(ids, skip_special_tokens=True)
    forced = copy.copy(asked)       # ... unless forced: the detokenizer still leaves the spaces as they are
    forced.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    assert native_decoder(forced) is not None and native_decoder(None) is None
    assert Detokenizer(forced)._decode(ids, True) == tok.decode(ids, skip_special_tokens=True) != \
        forced.decode(ids, skip_special_tokens=True)


def _fed(tok, prompt: list[int], out: list[int], **params) -> list[str]:
    """The texts of the outputs a request makes as the engine feeds it out's tokens one by one (Engine.append_token,
    Engine.make_output on an engine of this tokenizer alone; no EOS)."""
    from types import SimpleNamespace
    from picovllm.engine.detokenizer import Detokenizer
    from picovllm.engine.llm_engine import Engine
    from picovllm.engine.request import Request
    eng = SimpleNamespace(eos_token_ids=[], detokenizer=Detokenizer(tok), max_model_len=10**9, primary_eos=None,
                          _decode_tokens=lambda d: None, stream_deltas=False)
    req = Request("r", prompt, SamplingParams(max_tokens=len(out), **params))
    req.max_tokens = len(out)
    texts = []
    for t in out:
        if req.is_finished:
            break
        Engine.append_token(eng, req, t, None, 0.0)
        texts.append(Engine.make_output(eng, req).outputs[0].text)
    return texts


def test_incremental_text_against_the_tokenizers_decode(default_llm):
    """Token by token, against the tokenizer's own decode: a tokenizer that cleans up spaces streams the text
    without the clean-up, every character there (the clean-up had taken back a streamed space and cut the next
    character: " 'top'"); a prompt ending part way through a character leaves it to the output token that finishes
    it (that character had been lost); cumulative outputs never take back text (a stop string may cut the
    running text's tail: it is held back, as DELTA's is)."""
    import copy
    from picovllm.sampling_params import RequestOutputKind
    tok = default_llm.get_tokenizer()
    cleans = copy.copy(tok)
    cleans.clean_up_tokenization_spaces = True
    cleans.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    prompt, out = tok.encode("Quote:"), tok.encode(" He said 'stop' and 'go' now.")
    assert cleans.decode(out) != tok.decode(out)      # the clean-up does change this text
    deltas = _fed(cleans, prompt, out, output_kind=RequestOutputKind.DELTA)
    assert "".join(deltas) == tok.decode(prompt + out)[len(tok.decode(prompt)):] == " He said 'stop' and 'go' now."
    ids = tok.encode("Smile 😀 and 中文 ok")
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    whole = tok.decode(ids)
    head = tok.decode(ids[:cut - 1])          # the prompt's text up to the token that starts that character
    assert not head.endswith("\ufffd")
    assert "".join(_fed(tok, ids[:cut], ids[cut:], output_kind=RequestOutputKind.DELTA)) == whole[len(head):]
    texts = _fed(tok, prompt, out, stop=["and 'x"])
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:])) and texts[-1] == " He said 'stop' and 'go' now."
    texts = _fed(tok, prompt, out, stop=["and 'go"])
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:])) and texts[-1] == " He said 'stop' "


def test_prompt_ending_inside_a_character_after_a_whole_one_in_bytes(default_llm):
    """A token prompt whose last 4 tokens hold no character's end (SmolLM2 writes an emoji as 3 byte tokens: the
    window starts inside "🍕" and ends inside the next one): the output starts with the character it finishes, not
    with U+FFFDs for the earlier emoji's bytes, which the prompt had already shown ("��🍕 now")."""
    from picovllm.sampling_params import RequestOutputKind
    tok = default_llm.get_tokenizer()
    ids = tok.encode("I love pizza 🍕🍕 now")
    starts = [i - 1 for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd")
              and not tok.decode(ids[:i - 1]).endswith("\ufffd")]     # the tokens that start a character
    assert len(starts) == 2 and len(ids) - starts[1] == 4    # the second emoji: its 3 tokens, then " now"
    whole = tok.decode(ids)
    for cut in (starts[1] + 1, starts[1] + 2):               # a prompt ending inside the second emoji
        head = tok.decode(ids[:starts[1]])                    # its text up to the token that starts that character
        assert head.endswith("🍕") and whole[len(head):] == "🍕 now"
        for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
            texts = _fed(tok, ids[:cut], ids[cut:], output_kind=kind)
            text = "".join(texts) if kind == RequestOutputKind.DELTA else texts[-1]
            assert text == "🍕 now", (cut, text)


def test_stop_strings_wait_for_min_tokens_text(default_llm):
    """min_tokens protects its tokens' text from stop strings too (vLLM's): with min_tokens 1, a first token that
    is a stop string does not stop the request (it had stopped at once, empty); a stop string that starts in that
    text and ends after it does."""
    tok = default_llm.get_tokenizer()
    out = tok.encode("\nHello world\nmore")
    texts = _fed(tok, tok.encode("Hi"), out, min_tokens=1, stop=["\n"])
    assert texts[-1] == "\nHello world"
    assert _fed(tok, tok.encode("Hi"), out, stop=["\n"])[-1] == ""
    out = tok.encode(" Hello world and more")
    assert tok.decode(out[:1]) == " Hello"
    assert _fed(tok, tok.encode("Hi"), out, min_tokens=1, stop=["o world"])[-1] == " Hell"


# -- logprobs ------------------------------------------------------------------------------------
def test_logprobs_and_ranks_match_hf(tiny_models):
    path = tiny_models["llama"]
    prompts = make_prompts()[2:5]
    params = [SamplingParams(temperature=1.5, seed=7, max_tokens=8, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0),
              SamplingParams(temperature=2.0, seed=8, max_tokens=8, ignore_eos=True, logprobs=5)]
    outs = LLM(path, num_kv_blocks=64).generate(prompts, params, use_tqdm=False)
    hf = hf_model(path)
    ranks_seen = set()
    for prompt, sp, o in zip(prompts, params, outs):
        c = o.outputs[0]
        ref = hf_logprobs(hf, prompt, c.token_ids)
        assert len(c.logprobs) == len(c.token_ids)
        for step, (tok, d) in enumerate(zip(c.token_ids, c.logprobs)):
            lp = ref[step]
            want_rank = int((lp > lp[tok] + 1e-9).sum()) + 1
            assert d[tok].logprob == pytest.approx(float(lp[tok]), abs=1e-3)
            assert d[tok].rank == want_rank
            ranks_seen.add(want_rank)
            top = lp.topk(sp.logprobs).indices.tolist()
            assert set(d) == set(top) | {tok}
            for r, t in enumerate(top):
                assert d[t].rank == r + 1 and d[t].logprob == pytest.approx(float(lp[t]), abs=1e-3)
        assert c.cumulative_logprob == pytest.approx(sum(d[t].logprob for d, t in zip(c.logprobs, c.token_ids)))
    assert ranks_seen - {1}, "sampling at high temperature should pick some non-top tokens"


# -- the sampled distribution --------------------------------------------------------------------
LOGITS = np.array([1.0, -0.5, 2.0, 0.3, -3.0, 1.6, 0.0, -1.2])   # no ties, not sorted
CONFIGS = [  # temperature, top_k, top_p, min_p
    (1.0, 0, 1.0, 0.0),
    (0.6, 0, 1.0, 0.0),
    (1.0, 3, 1.0, 0.0),
    (1.4, 0, 0.8, 0.0),
    (1.0, 0, 1.0, 0.25),
    (0.8, 5, 0.9, 0.05),
]


def tensors(rows: int, temperature: float, top_k: int, top_p: float, min_p: float, seeds) -> SamplingTensors:
    full = lambda v, dt: torch.full((rows,), v, dtype=dt)
    return SamplingTensors(full(temperature, torch.float32), full(top_k, torch.long), full(top_p, torch.float32),
                           full(min_p, torch.float32), seeds, all_greedy=False, any_top_k=top_k > 0,
                           any_top_p=top_p < 1, any_min_p=min_p > 0)


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", CONFIGS)
def test_sample_follows_filtered_softmax(temperature, top_k, top_p, min_p):
    n = 40_000
    torch.manual_seed(0)
    logits = torch.tensor(LOGITS, dtype=torch.float32).expand(n, -1).contiguous()
    toks = sample(logits, tensors(n, temperature, top_k, top_p, min_p, [None] * n))
    assert_follows(np.bincount(toks.numpy(), minlength=len(LOGITS)), filtered_probs(LOGITS, temperature, top_k, top_p, min_p))


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [CONFIGS[0], CONFIGS[-1]])
def test_seeded_sample_follows_filtered_softmax(temperature, top_k, top_p, min_p):
    """Per-request seeds (one stream per (seed, token index)) must not bias the draw."""
    n = 10_000
    logits = torch.tensor(LOGITS, dtype=torch.float32).expand(n, -1).contiguous()
    seeds = [seeded_stream(s, s % 7) for s in range(n)]
    toks = sample(logits, tensors(n, temperature, top_k, top_p, min_p, seeds))
    assert_follows(np.bincount(toks.numpy(), minlength=len(LOGITS)), filtered_probs(LOGITS, temperature, top_k, top_p, min_p))
    again = sample(logits[:50], tensors(50, temperature, top_k, top_p, min_p, seeds[:50]))
    assert again.tolist() == toks[:50].tolist()


def test_a_batch_mates_top_p_leaves_a_row_without_it_whole():
    """A row with top_p 1 keeps every token the float64 oracle gives a probability, whatever its batch-mates ask: its
    float32 cumulative sum reaches 1 long before its last tokens (here ~138k of 152k, ~1e-5 of the mass)."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(152_064, generator=g, dtype=torch.float64) * 6).numpy()
    rows = torch.tensor(logits, dtype=torch.float32).expand(2, -1).contiguous()
    t = SamplingTensors(torch.ones(2), torch.zeros(2, dtype=torch.long), torch.tensor([1.0, 0.5]), torch.zeros(2),
                        [None, None], all_greedy=False, any_top_k=False, any_top_p=True, any_min_p=False)
    kept = torch.isfinite(apply_top_k_top_p_min_p(rows, t)[0]).numpy()
    assert (kept == (filtered_probs(logits, 1.0) > 0)).all(), f"{(~kept).sum()} tokens cut from a row without top-p"


@pytest.mark.parametrize("temperature,top_k,top_p,min_p,seeded", [(1.3, 0, 0.9, 0.0, True), (0.9, 8, 1.0, 0.02, False)])
def test_engine_samples_the_models_distribution(word_model, temperature, top_k, top_p, min_p, seeded):
    """Many one-token requests on a 32-token model: their tokens follow HF's next-token softmax,
    filtered and renormalised in float64."""
    n, prompt = 3000, [5, 9, 11, 4]
    with torch.no_grad():
        logits = hf_model(word_model)(torch.tensor([prompt])).logits[0, -1].double().numpy()
    want = filtered_probs(logits, temperature, top_k, top_p, min_p)
    torch.manual_seed(0)
    llm = LLM(word_model, num_kv_blocks=300, max_num_seqs=256, max_num_batched_tokens=1024)
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, max_tokens=1,
                             ignore_eos=True, seed=i if seeded else None) for i in range(n)]
    outs = llm.generate([prompt] * n, params, use_tqdm=False)
    toks = [o.outputs[0].token_ids[0] for o in outs]
    assert_follows(np.bincount(toks, minlength=len(logits)), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_seeded_row_ignores_batch_mates():
    """On CUDA, temperature-only rows use a fused kernel and filtered rows the torch path; a seeded
    row must draw the same token whichever kind of rows share its batch."""
    from picovllm.layers.sampler import SamplingTensors, sample, seeded_stream

    def tensors(temps, top_ps, seeds):
        dev = "cuda"
        return SamplingTensors(torch.tensor(temps, device=dev), torch.zeros(len(temps), dtype=torch.long, device=dev),
                               torch.tensor(top_ps, device=dev), torch.zeros(len(temps), device=dev), seeds,
                               False, False, any(p < 1 for p in top_ps), False, [p < 1 for p in top_ps])

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 1000, generator=g).cuda()
    for i in range(20):
        s = seeded_stream(7, i)
        alone = sample(logits[:1], tensors([0.9], [1.0], [s]))
        mixed = sample(logits, tensors([0.9, 1.0, 0.7], [1.0, 0.8, 1.0], [s, None, None]))
        assert alone.item() == mixed[0].item()
