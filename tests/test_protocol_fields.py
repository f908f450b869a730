"""Request fields against vLLM's newest OpenAI protocol: each is honoured as vLLM honours it or refused with a 400
naming it, never dropped. Driven through the real app (in-process) over the tiny chat model."""
from __future__ import annotations

import json

import pytest

from conftest import assert_engine_clean
from test_chat_templates import _served, model  # noqa: F401 - a fixture

USER = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def http(model):
    engine, client = _served(model)
    with client:
        yield client
    assert_engine_clean(engine)


def _refused(r, field: str) -> None:
    assert r.status_code == 400, (field, r.status_code, r.text)
    assert r.json()["error"]["param"] == field, r.text


@pytest.mark.parametrize("field,value", [
    ("repetition_detection", {"max_pattern_size": 3, "min_count": 2}),   # vLLM ends a repeating output early
    ("ec_transfer_params", {"do_remote_decode": True}),                   # encoder-cache disaggregation
    ("return_prompt_text", True),                                         # vLLM answers with the rendered prompt
    ("stream_interval", 4),                                               # vLLM batches 4 tokens a chunk
])
@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
def test_vllm_fields_this_server_does_not_honour_are_refused_by_name(http, endpoint, field, value):
    """They had been dropped as unknown fields: the request ran as if they had been honoured."""
    base = {"messages": USER} if "chat" in endpoint else {"prompt": "Hello"}
    _refused(http.post(endpoint, json={**base, "max_tokens": 2, "stream": True, field: value}), field)


def test_no_op_values_and_fields_vllm_ignores_too_are_accepted(http):
    """stream_interval 1 and return_prompt_text false ask for nothing; session_id, return_token_offsets,
    return_mm_kwargs and routed_experts_prompt_start change nothing in vLLM's generation endpoints either (their
    types are still checked)."""
    body = {"messages": USER, "max_tokens": 2, "stream_interval": 1, "return_prompt_text": False, "session_id": "s1",
            "return_token_offsets": True, "return_mm_kwargs": False, "routed_experts_prompt_start": 3}
    assert http.post("/v1/chat/completions", json=body).status_code == 200
    _refused(http.post("/v1/chat/completions", json={**body, "routed_experts_prompt_start": -1}),
             "routed_experts_prompt_start")


def test_empty_tools_list_is_a_400(http):
    """OpenAI's and vLLM's: tools [] is refused (omit it instead); it had run as if no tools were given."""
    _refused(http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2, "tools": []}), "tools")


def test_completion_max_tokens_null_is_the_default_16(http):
    """vLLM reads max_tokens null as OpenAI's default, 16; it had generated until the context was full."""
    r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": None, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16, r.text
    chunks = [json.loads(line[6:]) for line in http.post("/v1/completions", json={
        "prompt": "Hello", "max_tokens": None, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}}).text.splitlines() if line.startswith("data: {")]
    assert chunks[-1]["usage"]["completion_tokens"] == 16


def test_tokenize_refuses_media_io_kwargs(http):
    """vLLM's chat /tokenize takes media_io_kwargs (media loading); this server takes text only."""
    _refused(http.post("/tokenize", json={"messages": USER, "media_io_kwargs": {"image": {"x": 1}}}),
             "media_io_kwargs")


def _events(r) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]


def test_responses_honour_vllm_fields(http):
    """vLLM's Responses fields that had been dropped: structured_outputs constrains the output, request_id is the
    response's id (streamed too), skip_special_tokens and include_stop_str_in_output reach the sampling."""
    r = http.post("/v1/responses", json={"input": "Hello", "max_output_tokens": 5,
                                         "structured_outputs": {"choice": ["yes", "no"]}}).json()
    assert r["output"][0]["content"][0]["text"] in ("yes", "no"), r
    assert http.post("/v1/responses", json={"input": "Hello", "max_output_tokens": 2, "request_id": "abc-1"}
                     ).json()["id"] == "abc-1"
    events = _events(http.post("/v1/responses", json={"input": "Hello", "max_output_tokens": 2, "stream": True,
                                                       "request_id": "abc-2"}))
    assert {e["response"]["id"] for e in events if "response" in e} == {"abc-2"}
    _refused(http.post("/v1/responses", json={"input": "Hello", "request_id": "has space"}), "request_id")
    # the output's special tokens shown: an end token the model is steered to (logit_bias) and kept (ignore_eos)
    body = {"input": "Hello", "max_output_tokens": 2, "logit_bias": {"2": 100}, "ignore_eos": True,
            "temperature": 0}
    hidden = http.post("/v1/responses", json=body).json()
    shown = http.post("/v1/responses", json={**body, "skip_special_tokens": False}).json()
    assert hidden["output"] == [] and shown["output"][0]["content"][0]["text"] == "<|im_end|><|im_end|>"


def test_responses_stop_string_kept_with_include_stop_str_in_output(http, model):
    """A stop string the output ends on (a token the model is steered to) is cut, or kept when asked."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    piece = tok.decode([50])
    body = {"input": "Hello", "max_output_tokens": 4, "logit_bias": {"50": 100}, "temperature": 0, "stop": [piece]}
    cut = http.post("/v1/responses", json=body).json()
    kept = http.post("/v1/responses", json={**body, "include_stop_str_in_output": True}).json()
    assert cut["output"] == [] and kept["output"][0]["content"][0]["text"] == piece


@pytest.mark.parametrize("field,value", [
    ("mm_processor_kwargs", {"num_crops": 4}), ("vllm_xargs", {"k": 1}), ("enable_response_messages", True),
    ("previous_input_messages", [{"role": "user", "content": "x"}]), ("previous_response", {"id": "resp_1"}),
])
def test_responses_refuse_vllm_fields_not_honoured(http, field, value):
    _refused(http.post("/v1/responses", json={"input": "Hello", "max_output_tokens": 2, field: value}), field)


def test_responses_structured_outputs_with_text_format_is_a_400(http):
    """vLLM's: one or the other; the error names the Responses fields, not the chat request's."""
    r = http.post("/v1/responses", json={"input": "Hello", "structured_outputs": {"choice": ["a"]},
                                         "text": {"format": {"type": "json_object"}}})
    _refused(r, "structured_outputs")
    assert "text.format" in r.json()["error"]["message"]
