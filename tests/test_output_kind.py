"""SamplingParams.output_kind (vLLM's RequestOutputKind): what Engine.step's outputs of a running request hold.

Oracle: the same seeded request run CUMULATIVE: a DELTA request's pieces add up to its final output (text, tokens,
logprobs), the prompt's logprobs in the first piece alone, and no piece holds text a stop string later cut; a
FINAL_ONLY request has the one final output. LLM.generate returns whole outputs whatever the kind."""
import dataclasses

import pytest

from picovllm import LLM, EngineConfig, RequestOutputKind, SamplingParams
from picovllm.engine.llm_engine import Engine
from serving_fixtures import chat_model  # noqa: F401 - a fixture


@pytest.fixture(scope="module")
def engine(chat_model):
    return Engine(EngineConfig(chat_model, block_size=16, num_kv_blocks=64, max_model_len=256))


def run(engine: Engine, params: SamplingParams) -> list:
    """Every output Engine.step gave the request, in order."""
    rid = engine.add_request("Tell me a story about", params)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == rid]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return outs


def test_delta_pieces_add_up_to_the_cumulative_output(engine):
    base = SamplingParams(temperature=1.0, seed=7, max_tokens=40, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    text = run(engine, base)[-1].outputs[0].text
    stop = text[12:15]          # a stop string the output meets: the text is cut before it
    assert len(stop) == 3 and text.index(stop) >= 3
    params = dataclasses.replace(base, stop=[stop])
    whole = run(engine, params)
    pieces = run(engine, dataclasses.replace(params, output_kind=RequestOutputKind.DELTA))
    final = whole[-1].outputs[0]
    assert final.text == text[:text.index(stop)] and final.finish_reason == "stop"
    assert len(pieces) == len(whole) and pieces[-1].finished and not any(p.finished for p in pieces[:-1])
    assert "".join(p.outputs[0].text for p in pieces) == final.text
    for k in range(len(pieces)):    # every piece so far is a prefix of the final text: nothing is taken back
        assert final.text.startswith("".join(p.outputs[0].text for p in pieces[:k + 1]))
    assert [t for p in pieces for t in p.outputs[0].token_ids] == final.token_ids
    assert [lp for p in pieces for lp in p.outputs[0].logprobs] == final.logprobs
    assert [len(p.outputs[0].token_ids) for p in pieces] == [1] * len(pieces)      # stream_interval 1
    assert pieces[-1].outputs[0].cumulative_logprob == pytest.approx(final.cumulative_logprob)
    assert pieces[0].prompt_logprobs == whole[-1].prompt_logprobs and len(pieces[0].prompt_logprobs) > 1
    assert all(p.prompt_logprobs is None for p in pieces[1:])
    # both kinds hold back the last (longest stop - 1) characters while the request runs (vLLM's): the pieces so far
    # are the cumulative output of the same step, and a cumulative output never takes back what one showed
    for k in range(len(pieces)):
        assert "".join(q.outputs[0].text for q in pieces[:k + 1]) == whole[k].outputs[0].text
    assert all(b.outputs[0].text.startswith(a.outputs[0].text) for a, b in zip(whole, whole[1:]))
    # a stop string longer than the text for a while: nothing goes out until there is more text, nothing twice
    long_stop = dataclasses.replace(base, stop=["\u2603" * 60], output_kind=RequestOutputKind.DELTA)
    assert "".join(p.outputs[0].text for p in run(engine, long_stop)) == text


def test_final_only_gives_one_output(engine):
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    whole = run(engine, params)
    [final] = run(engine, dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY))
    assert len(whole) == 12 and final.finished
    assert (final.outputs[0].text, final.outputs[0].token_ids) == (whole[-1].outputs[0].text,
                                                                     whole[-1].outputs[0].token_ids)


def test_llm_returns_whole_outputs_whatever_the_kind(chat_model):
    llm = LLM(chat_model, block_size=16, num_kv_blocks=64, max_model_len=256)
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=10, ignore_eos=True, n=2)
    want = llm.generate(["Once upon"], params, use_tqdm=False)[0]
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY):
        asked = dataclasses.replace(params, output_kind=kind)
        got = llm.generate(["Once upon"], asked, use_tqdm=False)[0]
        assert [(c.text, c.token_ids) for c in got.outputs] == [(c.text, c.token_ids) for c in want.outputs]
        assert asked.output_kind == kind        # the caller's params are left as they were


def test_output_kind_is_validated_and_travels_as_an_int():
    with pytest.raises(ValueError, match="SamplingParams.output_kind must be a RequestOutputKind"):
        SamplingParams(output_kind=5)
    with pytest.raises(ValueError, match="SamplingParams.output_kind"):
        SamplingParams(output_kind="delta")
    p = SamplingParams(output_kind=1)
    assert p.output_kind is RequestOutputKind.DELTA
    wire = dataclasses.asdict(SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY))
    back = SamplingParams(**dict(wire, output_kind=int(wire["output_kind"])))
    assert back.output_kind is RequestOutputKind.FINAL_ONLY
