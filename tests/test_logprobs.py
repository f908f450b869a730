"""Logprobs as vLLM returns them, against independent oracles: ranks where logprobs tie (a hand-computed case),
logprobs=-1 and prompt_logprobs=-1 (the whole vocabulary) and the distribution inside a structured output's grammar
against HF transformers' float64 logits on the same weights, and the JSON (server, batch lines) of a forbidden token's
-inf.
(The sampled and prompt logprobs' values and ranks: test_sampling.py, test_offline_api.py, test_prompt_logprobs.py.)"""
import json
import math

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
    """logprobs=-1 and prompt_logprobs=-1 (vLLM's): every token's logprob and rank at each output and prompt
    position, HF's; the sampled token's among them, cumulative_logprob their sum."""
    path = tiny_models["llama"]
    prompt = list(range(5, 17))
    llm = LLM(path, block_size=4, num_kv_blocks=64, dtype="float32")
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


def test_server_logprobs_json(chat_model):
    """A grammar's forbidden tokens (-inf) go out as -9999.0 (vLLM's and OpenAI's), so the body and every SSE event
    stay JSON (json.dumps would write -Infinity); a logprobs count of -1 (the whole vocabulary) is refused naming its
    field, past this server's max_logprobs (vLLM's default 20)."""
    from fastapi.testclient import TestClient
    from transformers import AutoTokenizer

    from picovllm import EngineConfig
    from picovllm.engine.llm_engine import Engine
    from picovllm.entrypoints.openai.api_server import ServerSettings, build_app
    from picovllm.entrypoints.openai.async_engine import AsyncEngine
    from picovllm.entrypoints.openai.metrics import ServerMetrics
    from picovllm.entrypoints.openai.serving import ServingContext
    from picovllm.entrypoints.openai.tokenizer_worker import TokenizerWorker

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
    ctx = ServingContext(AsyncEngine(engine), TokenizerWorker(engine.tokenizer), ServerMetrics("m"), "m")
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "logprobs": True, "top_logprobs": 5,
            "guided_choice": CHOICES}
    completion = {"prompt": "Hello", "max_tokens": 1, "logprobs": 5, "guided_choice": CHOICES}
    with TestClient(build_app(ctx, ServerSettings())) as http:
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
        for path, body, field in (("/v1/completions", {"prompt": "a", "logprobs": -1}, "logprobs"),
                                  ("/v1/completions", {"prompt": "a", "prompt_logprobs": -1}, "prompt_logprobs"),
                                  ("/v1/chat/completions", {**chat, "top_logprobs": -1}, "top_logprobs")):
            r = http.post(path, json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
            assert "whole vocabulary" in r.json()["error"]["message"] and "20" in r.json()["error"]["message"]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
