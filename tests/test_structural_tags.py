"""Structural tags (vLLM's response_format {"type": "structural_tag", ...} and structured_outputs.structural_tag,
compiled by xgrammar): free text until a trigger, then the begin string, JSON the schema admits, the end string.

The tiny chat model has random weights, so a logit bias makes the trigger ("<", a prefix of the begin string, as
xgrammar requires) likely in the free text, and another keeps EOS out of it; the grammar's mask does the rest.
Oracles: the text's parts by string search, json's decoder and jsonschema for the tag's content."""
from __future__ import annotations

import json

import jsonschema
import pytest

from serving_fixtures import chat_model  # noqa: F401 - a fixture

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "days"], "additionalProperties": False}
BEGIN, END = "<function=f>", "</function>"
TAG = {"type": "tag", "begin": BEGIN, "content": {"type": "json_schema", "json_schema": SCHEMA}, "end": END}
# vLLM's older form: text outside the tags goes on after each, so a stop string ends the output at the first's end
LEGACY = {"type": "structural_tag", "structures": [{"begin": BEGIN, "schema": SCHEMA, "end": END}], "triggers": ["<"]}
# xgrammar's: after the first tag the grammar ends (only EOS may follow)
FORMAT = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<"], "tags": [TAG],
                                               "stop_after_first": True}}
MESSAGES = [{"role": "user", "content": "Call f for a trip."}]
SEEDS = range(4)


def free_text(text: str) -> str:
    """The text before the tag, after checking that text is that free text (without the trigger), the begin string,
    JSON valid against SCHEMA and the end string."""
    at = text.index(BEGIN)
    assert "<" not in text[:at], text
    value, stop = json.JSONDecoder().raw_decode(text, at + len(BEGIN))
    jsonschema.validate(value, SCHEMA)
    assert text[stop:] == END, text
    return text[:at]


def check_all(texts: list[str]) -> None:
    """Every text is tagged as it must be, and some have text before the tag (the trigger came in free text)."""
    before = [free_text(t) for t in texts]
    assert any(before), texts


def bias(tokenizer, eos_ids) -> dict[int, float]:
    (lt,) = tokenizer.encode("<", add_special_tokens=False)
    return {lt: 5.0, **{e: -100.0 for e in eos_ids}}


@pytest.fixture(scope="module")
def llm(chat_model):
    from picovllm import LLM
    with LLM(chat_model, num_kv_blocks=96, max_model_len=512, async_scheduling=False) as llm:
        yield llm


def offline_params(llm, tag: dict, seed: int, **kw):
    from picovllm import SamplingParams
    from picovllm.sampling_params import StructuredOutputsParams
    eng = llm.engine
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=240, logit_bias=bias(eng.tokenizer, eng.eos_token_ids),
                          structured_outputs=StructuredOutputsParams(structural_tag=json.dumps(tag)), **kw)


def test_offline_both_forms(llm):
    """StructuredOutputsParams.structural_tag, either form: the older one stopped at the end string, the newer one
    ending its grammar (and the request) after its one tag."""
    params = [offline_params(llm, LEGACY, s, stop=[END], include_stop_str_in_output=True) for s in SEEDS]
    params += [offline_params(llm, FORMAT, s) for s in SEEDS]
    outs = [o.outputs[0] for o in llm.generate(["Call f:"] * len(params), params, use_tqdm=False)]
    assert all(c.finish_reason == "stop" for c in outs), [(c.text, c.finish_reason) for c in outs]
    check_all([c.text for c in outs[:len(SEEDS)]])
    check_all([c.text for c in outs[len(SEEDS):]])


def test_compiled_once_per_text(llm):
    """The compiler's cache keeps a structural tag by its text: the same tag again compiles nothing new."""
    llm.generate(["Call f:"], offline_params(llm, FORMAT, 0), use_tqdm=False)
    compiler = llm.engine.grammar_masks.compiler._compiler
    size = compiler.get_cache_size_bytes()
    llm.generate(["Call f:"], offline_params(llm, FORMAT, 1), use_tqdm=False)
    assert compiler.get_cache_size_bytes() == size


@pytest.mark.parametrize("tag,match", [
    ("{not json", "invalid structural tag"),
    (json.dumps({"type": "structural_tag", "format": {"type": "nonsense"}}), "invalid structural tag"),
    (json.dumps({"structures": [{"begin": "<a>", "schema": SCHEMA, "end": "</a>"}], "triggers": ["<b"]}),
     "invalid structural tag"),                                       # the trigger is no prefix of the begin string
    (json.dumps({"structures": [{"begin": "<a>", "end": "</a>"}], "triggers": ["<"]}), r"structures\[0\]"),
    (json.dumps({**LEGACY, "structures": [{"begin": BEGIN, "end": END, "schema": {
        "type": "array", "uniqueItems": True}}]}), "uniqueItems at /structures/0/schema"),
    (json.dumps({"type": "structural_tag", "format": {**TAG, "content": {"type": "json_schema", "json_schema": {
        "not": {"type": "integer"}}}}}), "not at /format/content/json_schema"),
])
def test_bad_tags_name_the_field(llm, tag, match):
    from picovllm import SamplingParams
    from picovllm.sampling_params import StructuredOutputsParams
    so = StructuredOutputsParams(structural_tag=tag)
    with pytest.raises(ValueError, match="^SamplingParams.structured_outputs.structural_tag: .*" + match):
        llm.engine.add_request("Hi", SamplingParams(structured_outputs=so))


def test_params_take_text_only():
    """The tag is JSON text (vLLM's type); params carrying one survive the P/D wire's dict form."""
    import dataclasses
    from picovllm import SamplingParams
    from picovllm.sampling_params import StructuredOutputsParams
    sp = SamplingParams(structured_outputs=StructuredOutputsParams(structural_tag=json.dumps(FORMAT)))
    assert SamplingParams(**dataclasses.asdict(sp)) == sp
    with pytest.raises(ValueError, match="structural_tag must be a structural tag's JSON text"):
        StructuredOutputsParams(structural_tag=LEGACY)
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(structural_tag=json.dumps(LEGACY), regex="a")


@pytest.fixture(scope="module")
def http(chat_model):
    """An in-process server over the tiny chat model."""
    from fastapi.testclient import TestClient
    from picovllm import EngineConfig
    from picovllm.engine.llm_engine import Engine
    from picovllm.entrypoints.openai.api_server import ServerSettings, build_app
    from picovllm.entrypoints.openai.async_engine import AsyncEngine
    from picovllm.entrypoints.openai.metrics import ServerMetrics
    from picovllm.entrypoints.openai.serving import ServingContext
    from picovllm.entrypoints.openai.tokenizer_worker import TokenizerWorker
    engine = Engine(EngineConfig(model=chat_model, num_kv_blocks=96, max_model_len=512, async_scheduling=False))
    ctx = ServingContext(AsyncEngine(engine), TokenizerWorker(engine.tokenizer), ServerMetrics("m"), "m",
                         sampling_defaults={})
    with TestClient(build_app(ctx, ServerSettings())) as client:
        client.logit_bias = {str(k): v for k, v in bias(engine.tokenizer, engine.eos_token_ids).items()}
        yield client
    engine.shutdown()


def streamed(client, route: str, body: dict) -> dict[int, str]:
    """Each choice's text, joined from its streamed deltas."""
    texts: dict[int, str] = {}
    with client.stream("POST", route, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                piece = c["delta"].get("content") if "delta" in c else c.get("text")
                texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
    return texts


@pytest.mark.parametrize("fmt", [LEGACY, FORMAT], ids=["structures", "format"])
def test_chat_response_format_streamed_and_not(http, fmt):
    """Chat's response_format structural_tag, both forms: each choice obeys the tags, and the stream says the same."""
    body = {"messages": MESSAGES, "response_format": fmt, "n": len(SEEDS), "seed": 3, "temperature": 1.0,
            "max_tokens": 240, "logit_bias": http.logit_bias}
    if fmt is LEGACY:
        body.update(stop=[END], include_stop_str_in_output=True)
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert all(c["finish_reason"] == "stop" for c in choices), choices
    texts = [c["message"]["content"] for c in choices]
    check_all(texts)
    assert [streamed(http, "/v1/chat/completions", body)[i] for i in range(len(SEEDS))] == texts


def test_completions_structured_outputs_structural_tag(http):
    """Completions' structured_outputs.structural_tag (JSON text, vLLM's), streamed and not."""
    body = {"prompt": "Call f:", "structured_outputs": {"structural_tag": json.dumps(FORMAT)}, "n": len(SEEDS),
            "seed": 11, "temperature": 1.0, "max_tokens": 240, "logit_bias": http.logit_bias}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    texts = [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    check_all(texts)
    assert [streamed(http, "/v1/completions", body)[i] for i in range(len(SEEDS))] == texts


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "structural_tag"}}, "response_format"),
    ({"response_format": {**LEGACY, "triggers": None}}, "response_format"),
    ({"response_format": {**LEGACY, "format": FORMAT["format"]}}, "response_format"),
    ({"response_format": {"type": "structural_tag", "format": {"type": "nonsense"}}}, "response_format"),
    ({"response_format": {**LEGACY, "triggers": ["<b"]}}, "response_format"),
    ({"structured_outputs": {"structural_tag": "{not json"}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": LEGACY}}, "structured_outputs"),       # an object, not its text
    ({"structured_outputs": {"structural_tag": json.dumps(LEGACY), "regex": "a"}}, "structured_outputs"),
])
def test_bad_requests_are_400s_naming_the_field(http, extra, param):
    for route, body in [("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions", {"prompt": "Hi"})]:
        r = http.post(route, json={**body, "max_tokens": 4, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (route, r.text)
