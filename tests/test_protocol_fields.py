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
    # vLLM's Responses request has these too (they had been dropped as unknown fields, the request run without them)
    ("kv_transfer_params", {"do_remote_decode": True}), ("media_io_kwargs", {"video": {"num_frames": 8}}),
])
def test_responses_refuse_vllm_fields_not_honoured(http, field, value):
    _refused(http.post("/v1/responses", json={"input": "Hello", "max_output_tokens": 2, field: value}), field)


def test_responses_structured_outputs_with_text_format_is_a_400(http):
    """vLLM's: one or the other; the error names the Responses fields, not the chat request's."""
    r = http.post("/v1/responses", json={"input": "Hello", "structured_outputs": {"choice": ["a"]},
                                         "text": {"format": {"type": "json_object"}}})
    _refused(r, "structured_outputs")
    assert "text.format" in r.json()["error"]["message"]


# -- found by fuzzing the request bodies ------------------------------------------------------------------------------
def _post_raw(http, path: str, body: bytes, content_type: str = "application/json"):
    return http.post(path, content=body, headers={"content-type": content_type})


@pytest.mark.parametrize("body,content_type,says", [
    (b"", "application/json", "the body is empty"),                        # was "Field required"
    (b"[1, 2]", "application/json", "the body is not a JSON object"),      # was "Input should be a valid dictionary"
    (b'{"prompt": "Hello"}', "text/plain", "the body is not a JSON object"),                      # (the same)
    (b'{"prompt": "\xff"}', "application/json", "not UTF-8 text"),        # was "There was an error parsing the body"
    (b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", "application/json", "nested too deeply"),     # (the same)
])
def test_a_body_that_is_no_json_object_says_why(http, body, content_type, says):
    r = _post_raw(http, "/v1/completions", body, content_type)
    assert r.status_code == 400 and says in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("path,body,param", [      # (\ud800 in the JSON text: a lone surrogate)
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}', "messages"),
    ("/tokenize", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
    ("/v1/responses", '{"input": "\\ud800", "max_output_tokens": 2}', "input"),
])
def test_a_lone_surrogate_names_the_field_it_came_in(http, path, body, param):
    """Valid JSON, no text a tokenizer takes: the 400 named "prompt" whatever the endpoint (chat has no such field)."""
    r = _post_raw(http, path, body.encode())
    _refused(r, param)
    assert r.json()["error"]["message"] == f"{param}: cannot be tokenized (it holds a lone surrogate, which is not " \
                                           f"Unicode text)", r.text      # was "(TypeError)"


TOOL = '{"type": "function", "function": {"name": "f", "description": "a \\udfff"}}'


@pytest.mark.parametrize("path,body,param", [
    # a stop string no output can hold: it was taken, and never matched
    ("/v1/completions", '{"prompt": "Hello", "max_tokens": 2, "stop": ["a", "\\ud800"]}', "stop"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stop": "\\ud800"}',
     "stop"),
    # text the template renders beside the messages: the tokenizer's refusal had named the messages (the input)
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "Hi"}], "tools": [' + TOOL + ']}', "tools"),
    ("/tokenize", '{"messages": [{"role": "user", "content": "Hi"}], "tools": [' + TOOL + ']}', "tools"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "Hi"}], "documents": [{"text": "\\ud800"}]}',
     "documents"),
    ("/v1/responses", '{"input": "Hi", "instructions": "\\ud800", "max_output_tokens": 2}', "instructions"),
])
def test_text_that_is_no_unicode_is_refused_by_its_field(http, path, body, param):
    r = _post_raw(http, path, body.encode())
    _refused(r, param)
    assert "holds a lone surrogate" in r.json()["error"]["message"], r.text


def test_text_nested_as_deep_as_json_reads_is_checked_without_recursing(http):
    """The lone-surrogate check walks a field's lists and dicts: nested as deep as the body's JSON may be (json.loads
    takes ~900 levels here), it had recursed two frames a level and answered a 500 (RecursionError) from ~450. Such
    text is the template's to refuse, as before the check (a 400)."""
    def nested(leaf: str, depth: int = 700) -> str:
        return "[" * depth + leaf + "]" * depth
    body = '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "chat_template_kwargs": {"x": %s}}'
    r = _post_raw(http, "/v1/chat/completions", (body % nested('"a"')).encode())
    assert r.status_code == 400 and "the chat template rejected them" in r.json()["error"]["message"], r.text
    r = _post_raw(http, "/v1/chat/completions", (body % nested('"\\ud800"')).encode())
    _refused(r, "chat_template_kwargs")
    assert "chat_template_kwargs.x[0][0]" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("content,param", [
    (5, "input[0].content"),                                    # was a 500 (iterated)
    ("a thought", "input[0].content"),                          # was dropped without a word
    ([{"type": "summary_text", "text": "x"}], "input[0].content[0]"),     # (the same)
    ([{"type": "reasoning_text", "text": "x"}, 5], "input[0].content[1]"),
])
def test_responses_reasoning_item_content_is_checked(http, content, param):
    item = {"type": "reasoning", "content": content}
    _refused(http.post("/v1/responses", json={"input": [item, {"role": "user", "content": "Hello"}],
                                              "max_output_tokens": 2}), param)


@pytest.mark.parametrize("arguments", ["1" + "0" * 5000, "[" * 3000 + "]" * 3000])
def test_earlier_call_arguments_python_cannot_parse_go_to_the_template_as_text(http, arguments):
    """JSON text past Python's int digit limit or its recursion limit: was a 500; now as any arguments that are not
    JSON (the template gets the text)."""
    messages = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]}]
    r = http.post("/tokenize", json={"messages": messages})
    assert r.status_code == 200 and r.json()["count"] > 0, r.text
    assert http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2}).status_code == 200


def test_a_named_tool_schema_the_grammar_refuses_names_tools(http):
    """A function's parameters are in tools; a named tool_choice's 400 had named tool_choice (tool_choice "required"'s
    named tools already). The template renders the tools itself: the fallback's system message would not fit this
    server's context."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "city": {"type": 5}}}}}]
    template = "{{ tools | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    r = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2, "tools": tools,
                                                "tool_choice": {"type": "function", "function": {"name": "f"}},
                                                "chat_template": template})
    _refused(r, "tools")
    assert r.json()["error"]["message"].startswith("tools: invalid JSON schema"), r.text


def test_an_unhandled_error_is_a_500_that_closes_the_connection(http, monkeypatch):
    """uvicorn drops the connection after an error the app re-raises (Starlette's ServerErrorMiddleware does); without
    Connection: close a client sent its next request on it and was reset (every 500 cost the request after it)."""
    from fastapi.testclient import TestClient

    from picovllm.entrypoints.openai import api_server

    async def broken(ctx, req):
        raise RuntimeError("injected")
    monkeypatch.setattr(api_server, "detokenize", broken)
    r = TestClient(http.app, raise_server_exceptions=False).post("/detokenize", json={"tokens": [5]})
    assert r.status_code == 500 and r.json()["error"]["type"] == "internal_error", r.text
    assert r.headers["connection"] == "close"
