"""Logprobs as vLLM returns them, against independent oracles: ranks where logprobs tie (a hand-computed case),
logprobs=-1 and prompt_logprobs=-1 (the whole vocabulary) and the distribution inside a structured output's grammar
against HF transformers' float64 logits on the same weights, and the JSON (server, batch lines) of a forbidden token's
-inf. The counts a request may ask for: at most max_logprobs (vLLM's, offline and served).
(The sampled and prompt logprobs' values and ranks: test_sampling.py, test_offline_api.py, test_prompt_logprobs.py.)"""
import json
import math
import re

import pytest
import torch

from picovllm import LLM, SamplingParams
from picovllm.engine.sampling import launch_sampling, resolve
from picovllm.engine.step_input import SamplingRow, StepInput
from picovllm.entrypoints.batch_io import BatchItem, result_record
from picovllm.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TIED = [2.0, 0.0, 2.0, 1.0]     # tokens 0 and 2 tie
CHOICES = ["yes", "no"]


def _step(sampling: list[SamplingRow], prompt_targets: list[int] = (), prompt_topk: list[int] = ()) -> StepInput:
    """A step of one sequence: a row per sampling row, then one per prompt target (all rows' logits given)."""
    n = len(sampling) + len(prompt_targets)
    return StepInput(input_ids=[0] * n, positions=list(range(n)), slot_mapping=list(range(n)),
                     query_start_loc=[0, n], seq_lens=[n], block_tables=[[0]], num_decodes=0,
                     sample_indices=list(range(len(sampling))), sampling=sampling,
                     prompt_indices=list(range(len(sampling), n)), prompt_targets=list(prompt_targets),
                     prompt_topk=list(prompt_topk))


def _greedy(logprobs: int, bias: dict[int, float] | None = None) -> SamplingRow:
    row = SamplingRow(temperature=0, top_k=0, top_p=1, min_p=0, seed=None, banned=[], logprobs=logprobs)
    if bias:
        row.bias_token_ids, row.bias_values = list(bias), list(bias.values())
    return row


def test_tied_logprobs_rank_as_vllm_and_the_ranks_in_a_dict_differ():
    """vLLM's rank counts the tokens at least as likely, the token itself included; a token among the top k takes its
    place there. By hand, for TIED: tokens 0 and 2 have logprob 2 - log(2e^2 + e + 1) and rank 2, token 3 rank 3;
    the greedy token (0, the first of the two) ranks 2 where no top-k lists it. In each dict the ranks are 1, 2, ...
    once each, whichever of the tied pair the top k lists first."""
    lse = math.log(2 * math.e ** 2 + math.e + 1)
    want = [x - lse for x in TIED]
    rows = [_greedy(0), _greedy(1), _greedy(2, bias={2: 5.0}), _greedy(0, bias={3: 5.0})]   # bias: raw logprobs
    step = _step(rows, prompt_targets=[2, 2], prompt_topk=[0, 1])
    result = resolve(launch_sampling(torch.tensor([TIED] * 6), step))
    assert result.token_ids == [0, 0, 2, 3]
    (_, _, p0), (_, _, p1) = result.prompt_logprobs
    dicts = [*result.logprobs, p0, p1]
    assert all(lp.logprob == pytest.approx(want[t], abs=1e-6) for d in dicts for t, lp in d.items())
    d0, d1, d2, d3 = result.logprobs
    assert {t: lp.rank for t, lp in d0.items()} == {0: 2} and {t: lp.rank for t, lp in p0.items()} == {2: 2}
    assert {t: lp.rank for t, lp in d3.items()} == {3: 3}
    assert set(d2) == set(p1) == {0, 2} and next(iter(d2)) == next(iter(p1)) == 2    # the token first, as vLLM's
    for d in (d1, d2, p1):
        assert set(d) <= {0, 2} and sorted(lp.rank for lp in d.values()) == list(range(1, len(d) + 1)), d


def _hf_logprobs(path: str, ids: list[int]) -> torch.Tensor:
    """float64 log-softmax of HF's logits at every position of ids: row i predicts token i + 1."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].log_softmax(-1)


def _check_whole_vocabulary(d: dict, ref: torch.Tensor) -> None:
    """d holds every token, each logprob HF's and the ranks 1..V in HF's order (up to float32 rounding)."""
    assert sorted(d) == list(range(ref.shape[0]))
    assert max(abs(lp.logprob - ref[t].item()) for t, lp in d.items()) < 1e-4
    by_rank = sorted(d, key=lambda t: d[t].rank)
    assert [d[t].rank for t in by_rank] == list(range(1, len(d) + 1))
    assert all(ref[a] >= ref[b] - 1e-4 for a, b in zip(by_rank, by_rank[1:]))


def test_minus_one_is_the_whole_vocabulary_as_hf(tiny_models):
    """logprobs=-1 and prompt_logprobs=-1 (vLLM's, with max_logprobs -1): every token's logprob and rank at each
    output and prompt position, HF's; the sampled token's among them, cumulative_logprob their sum."""
    path = tiny_models["llama"]
    prompt = list(range(5, 17))
    llm = LLM(path, block_size=4, num_kv_blocks=64, dtype="float32", max_logprobs=-1)
    out = llm.generate([prompt], SamplingParams(temperature=0.8, seed=1, max_tokens=3, ignore_eos=True, logprobs=-1,
                                                prompt_logprobs=-1), use_tqdm=False)[0]
    c = out.outputs[0]
    ref = _hf_logprobs(path, prompt + c.token_ids)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i, d in enumerate(out.prompt_logprobs[1:]):
        _check_whole_vocabulary(d, ref[i])
    assert len(c.logprobs) == len(c.token_ids) == 3
    for i, (tok, d) in enumerate(zip(c.token_ids, c.logprobs)):
        _check_whole_vocabulary(d, ref[len(prompt) - 1 + i])
        assert next(iter(d)) == tok
    assert c.cumulative_logprob == pytest.approx(sum(d[t].logprob for d, t in zip(c.logprobs, c.token_ids)))


def test_offline_logprobs_are_at_most_max_logprobs(tiny_models):
    """vLLM's max_logprobs, 20 by default: logprobs or prompt_logprobs past it, or -1 (the whole vocabulary, counted
    as its size), is a ValueError naming the field, the limit and how to raise it; 20 is taken. A max_logprobs of at
    least the vocabulary's size takes -1, as vLLM's. Beam search's steps ask for the candidates the search needs
    (2 beam_width here), whatever the limit."""
    from picovllm import BeamSearchParams
    path = tiny_models["llama"]
    llm = LLM(path, block_size=4, num_kv_blocks=64, dtype="float32")
    assert llm.config.max_logprobs == 20
    vocab = llm.engine.model_config.vocab_size
    for kw, says in ((dict(logprobs=21), "SamplingParams.logprobs 21 is more than max_logprobs (20)"),
                     (dict(prompt_logprobs=21), "SamplingParams.prompt_logprobs 21 is more than max_logprobs (20)"),
                     (dict(logprobs=-1), f"SamplingParams.logprobs -1 (the whole vocabulary, {vocab}) is more than "
                                         f"max_logprobs (20)"),
                     (dict(prompt_logprobs=-1), f"SamplingParams.prompt_logprobs -1 (the whole vocabulary, {vocab})")):
        with pytest.raises(ValueError, match=re.escape(says) + ".*LLM\\(max_logprobs=...\\) or --max-logprobs"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, **kw), use_tqdm=False)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, logprobs=20, prompt_logprobs=20), use_tqdm=False)[0]
    for d in out.outputs[0].logprobs + out.prompt_logprobs[1:]:     # the top 20, and the token if not among them
        assert len(d) in (20, 21) and {lp.rank for lp in d.values()} >= set(range(1, 21)), d
    best = llm.beam_search([[5, 6, 7]], BeamSearchParams(beam_width=11, max_tokens=2))[0].sequences[0]  # 22 a step
    assert len(best.logprobs) == 2 and all(len(d) >= 22 for d in best.logprobs)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    with pytest.raises(ValueError, match=r"EngineConfig.max_logprobs must be an int >= 0, or -1 \(no limit\), got -2"):
        LLM(path, max_logprobs=-2)
    whole = LLM(path, block_size=4, num_kv_blocks=64, dtype="float32", max_logprobs=vocab)
    out = whole.generate([[5, 6, 7]], SamplingParams(max_tokens=1, logprobs=-1), use_tqdm=False)[0]
    assert len(out.outputs[0].logprobs[0]) == vocab
    assert whole.engine.block_manager.num_free_blocks == whole.engine.block_manager.num_blocks


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    from serving_fixtures import build_tiny_chat_model
    return build_tiny_chat_model(str(tmp_path_factory.mktemp("logprobs") / "model"))


def _not_json(constant: str):
    pytest.fail(f"not JSON: {constant}")


def _first_tokens(tokenizer, choices: list[str]) -> set[int]:
    """The tokens a choice grammar takes first: those whose text starts one of the choices."""
    return {t for t in range(len(tokenizer)) if (s := tokenizer.decode([t])) and any(c.startswith(s) for c in choices)}


def test_logprobs_under_a_grammar_are_within_it_as_vllm(chat_model):
    """vLLM masks the logits with a structured output's grammar before its sampler reads raw logprobs: the logprobs
    are the model's distribution renormalised over the tokens the grammar takes, -inf elsewhere. Oracle: HF's float64
    logits, the grammar's first tokens read from the tokenizer. Greedy, and sampled at temperature 1 beside it."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(chat_model)
    allowed = sorted(_first_tokens(tok, CHOICES))
    assert 1 <= len(allowed) < 5
    llm = LLM(chat_model, num_kv_blocks=64, dtype="float32")
    prompts = [tok.encode("Hello, how are you"), tok.encode("The capital of France")]
    so = StructuredOutputsParams(choice=CHOICES)
    params = [SamplingParams(temperature=0, max_tokens=1, logprobs=5, structured_outputs=so),
              SamplingParams(temperature=1.0, seed=3, max_tokens=1, logprobs=5, structured_outputs=so)]
    for prompt, p, out in zip(prompts, params, llm.generate(prompts, params, use_tqdm=False)):
        ref = _hf_logprobs(chat_model, prompt)[-1]
        within = ref[allowed] - ref[allowed].logsumexp(0)
        want = dict(zip(allowed, within.tolist()))
        (token,), (d,) = out.outputs[0].token_ids, out.outputs[0].logprobs
        assert token in want
        assert len(d) == 5 and {t for t, lp in d.items() if lp.logprob > -math.inf} == set(allowed)
        assert all(d[t].logprob == pytest.approx(want[t], abs=1e-4) for t in allowed)
        assert out.outputs[0].cumulative_logprob == pytest.approx(want[token], abs=1e-4)
        best = max(want, key=want.get)
        assert d[best].rank == 1 and (p.temperature > 0 or token == best)
        # `picovllm batch`'s output line stays JSON: -inf as -9999.0, as the server writes it
        line = json.loads(json.dumps(result_record(BatchItem(0), out)), parse_constant=_not_json)
        assert sorted(line["logprobs"][0].values())[:5 - len(allowed)] == [-9999.0] * (5 - len(allowed))


def _app(engine):
    """The server's app in front of engine (its loop a thread here)."""
    from picovllm.entrypoints.openai.api_server import ServerSettings, build_app
    from picovllm.entrypoints.openai.async_engine import AsyncEngine
    from picovllm.entrypoints.openai.metrics import ServerMetrics
    from picovllm.entrypoints.openai.serving import ServingContext
    from picovllm.entrypoints.openai.tokenizer_worker import TokenizerWorker
    ctx = ServingContext(AsyncEngine(engine), TokenizerWorker(engine.tokenizer), ServerMetrics("m"), "m")
    return build_app(ctx, ServerSettings())


def test_server_logprobs_json(chat_model):
    """A grammar's forbidden tokens (-inf) go out as -9999.0 (vLLM's and OpenAI's), so the body and every SSE event
    stay JSON (json.dumps would write -Infinity)."""
    from fastapi.testclient import TestClient
    from transformers import AutoTokenizer

    from picovllm import EngineConfig
    from picovllm.engine.llm_engine import Engine

    tok = AutoTokenizer.from_pretrained(chat_model)
    allowed = {tok.decode([t]) for t in _first_tokens(tok, CHOICES)}

    def strict(text: str):
        return json.loads(text, parse_constant=_not_json)

    def top_entries(body: dict) -> list[dict]:
        lp = body["choices"][0]["logprobs"] or {}
        if "content" in lp:     # chat: the first token's top 5
            return lp["content"][0]["top_logprobs"] if lp["content"] else []
        return [{"token": t, "logprob": v} for t, v in lp["top_logprobs"][0].items()] if lp.get("top_logprobs") else []

    engine = Engine(EngineConfig(model=chat_model, num_kv_blocks=64, max_model_len=256, async_scheduling=False))
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "logprobs": True, "top_logprobs": 5,
            "guided_choice": CHOICES}
    completion = {"prompt": "Hello", "max_tokens": 1, "logprobs": 5, "guided_choice": CHOICES}
    with TestClient(_app(engine)) as http:
        for path, body in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
            r = http.post(path, json=body)
            assert r.status_code == 200, r.text
            with http.stream("POST", path, json={**body, "stream": True}) as s:
                events = [strict(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
            tops = [top for got in [strict(r.text)] + events if (top := top_entries(got))]
            assert len(tops) == 2, (path, r.text, events)     # the body's and the streamed token's
            for top in tops:
                assert all((e["token"] in allowed) == (e["logprob"] > -9999.0) for e in top), top
                assert any(e["logprob"] == -9999.0 for e in top), top    # the top 5 reach past the grammar's tokens
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "logprobs": True}
# (route, the request asking for k logprobs, its field)
ASKS = [("/v1/completions", lambda k: {"prompt": "Hello", "max_tokens": 1, "logprobs": k}, "logprobs"),
        ("/v1/completions", lambda k: {"prompt": "Hello", "max_tokens": 1, "prompt_logprobs": k}, "prompt_logprobs"),
        ("/v1/completions", lambda k: {"prompt": "Hello", "max_tokens": 1, "echo": True, "logprobs": k}, "logprobs"),
        ("/v1/chat/completions", lambda k: {**CHAT, "top_logprobs": k}, "top_logprobs"),
        ("/v1/chat/completions", lambda k: {**CHAT, "top_logprobs": k, "stream": True}, "top_logprobs")]


@pytest.mark.parametrize("flags, limit", [([], 20), (["--max-logprobs", "5"], 5), (["--max-logprobs", "-1"], -1)])
def test_served_logprobs_are_at_most_the_engines_max_logprobs(chat_model, flags, limit):
    """The server's limit is its engine's max_logprobs (serve's --max-logprobs, vLLM's default 20): a count past it,
    or -1 (the whole vocabulary) while it is not -1, is a 400 naming the request's own field (completions' logprobs
    and prompt_logprobs, chat's and the Responses API's top_logprobs) and the limit; the limit itself is taken. With
    -1, a -1 is every token: chat's top_logprobs, completions' (the echoed prompt's too) and prompt_logprobs."""
    from fastapi.testclient import TestClient

    from picovllm.engine.llm_engine import Engine
    from picovllm.entrypoints.cli import build_parser
    from picovllm.entrypoints.engine_args import engine_config_from_args

    args = build_parser().parse_args(["serve", chat_model, "--device", "cpu", "--num-kv-blocks", "64",
                                      "--max-model-len", "256", *flags])
    engine = Engine(engine_config_from_args(args, model=chat_model, reasoning_parser=None))
    vocab = engine.model_config.vocab_size
    responses = ("/v1/responses", lambda k: {"input": "hi", "max_output_tokens": 1, "top_logprobs": k}, "top_logprobs")
    with TestClient(_app(engine)) as http:
        if limit != -1:
            for path, body, field in ASKS + [responses]:
                assert http.post(path, json=body(limit)).status_code == 200, (path, field)
                for k, says in ((limit + 1, f"more than max_logprobs ({limit})"), (-1, "the whole vocabulary")):
                    if path == "/v1/responses" and k == -1:
                        continue      # OpenAI's 0-20 there
                    r = http.post(path, json=body(k))
                    error = r.json()["error"]
                    assert r.status_code == 400 and error["param"] == field, (path, k, r.text)
                    openai_range = path == "/v1/responses" and k > 20     # the Responses API's own 400
                    assert (openai_range or says in error["message"]) and field in error["message"], (path, k, r.text)
        else:
            as_ids = {"return_tokens_as_token_ids": True}     # token names that never collide
            for path, body, field in ASKS:
                assert http.post(path, json=body(-1)).status_code == 200, (path, field)
            got = http.post("/v1/chat/completions", json={**CHAT, "top_logprobs": -1, **as_ids}).json()
            assert len(got["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == vocab
            got = http.post("/v1/completions", json={**ASKS[2][1](-1), **as_ids}).json()["choices"][0]
            # the second prompt token's and the output token's (the first prompt token has none)
            assert [len(top) for top in got["logprobs"]["top_logprobs"][1:]] == [vocab] * 2, got
            got = http.post("/v1/completions", json=ASKS[1][1](-1)).json()["choices"][0]
            assert [len(d) for d in got["prompt_logprobs"][1:]] == [vocab], got
            r = http.post("/v1/completions", json=ASKS[0][1](vocab + 1))
            assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("kind", ["CUMULATIVE", "DELTA"])
def test_every_streamed_logprob_carries_its_tokens_text(chat_model, kind):
    """Each output of a running request (an output a step, as a server streams them) has, in every logprob dict it
    holds, each token's text: the tokenizer's decode of that token alone (oracle). Cumulative outputs hold the earlier
    positions again, delta outputs only the new ones; the finished output as well."""
    from transformers import AutoTokenizer
    from picovllm.sampling_params import RequestOutputKind
    tok = AutoTokenizer.from_pretrained(chat_model)
    engine = LLM(chat_model, num_kv_blocks=64, dtype="float32").engine
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True, logprobs=3,
                            output_kind=getattr(RequestOutputKind, kind))
    for i, prompt in enumerate(["Hello, how are you", "The capital of France"]):
        engine.add_request(tok.encode(prompt), params, request_id=str(i))
    seen = {"0": 0, "1": 0}
    while engine.has_unfinished_requests():
        for out in engine.step():
            comp = out.outputs[0]
            assert len(comp.logprobs) == len(comp.token_ids) > 0
            for t, d in zip(comp.token_ids, comp.logprobs):
                assert t in d and len(d) >= 3
                assert all(lp.decoded_token == tok.decode([k]) for k, lp in d.items())
            seen[out.request_id] += len(comp.token_ids) if kind == "DELTA" else 0
    assert kind == "CUMULATIVE" or seen == {"0": 12, "1": 12}


def test_echo_with_more_logprobs_keeps_prompt_logprobs_to_its_own_count(chat_model):
    """Completions' echo with logprobs scores the prompt with the larger of logprobs and prompt_logprobs (the echoed
    tokens' top ones); the prompt_logprobs field still holds, per position, the prompt token and its own top k (HF's
    logits the oracle), streamed, not, and with max_tokens 0. It had held the top `logprobs` ones."""
    from fastapi.testclient import TestClient
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from picovllm import EngineConfig
    from picovllm.engine.llm_engine import Engine

    prompt, k, echo_k = "The capital of France is", 1, 4
    ids = AutoTokenizer.from_pretrained(chat_model).encode(prompt)
    model = AutoModelForCausalLM.from_pretrained(chat_model, dtype=torch.float32).eval()
    with torch.no_grad():
        rows = model(torch.tensor([ids])).logits[0].log_softmax(-1)
    expected = [None] + [{ids[i], *rows[i - 1].topk(k).indices.tolist()} for i in range(1, len(ids))]
    engine = Engine(EngineConfig(model=chat_model, num_kv_blocks=64, max_model_len=256, async_scheduling=False))
    body = {"prompt": prompt, "max_tokens": 2, "echo": True, "logprobs": echo_k, "prompt_logprobs": k,
            "return_tokens_as_token_ids": True}     # (top tokens named apart: two may decode alike)
    with TestClient(_app(engine)) as http:
        choices = [http.post("/v1/completions", json=body).json()["choices"][0],
                   http.post("/v1/completions", json={**body, "max_tokens": 0}).json()["choices"][0]]
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        choices += [c for e in events for c in e["choices"] if "prompt_logprobs" in c]
        assert len(choices) == 3
        for c in choices:
            got = [None if d is None else {int(t) for t in d} for d in c["prompt_logprobs"]]
            assert got == expected, c["prompt_logprobs"]
            # the echoed prompt's tokens keep logprobs' count of top ones (the first prompt token has none)
            assert all(len(top) >= echo_k for top in c["logprobs"]["top_logprobs"][1:len(ids)]), c["logprobs"]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
