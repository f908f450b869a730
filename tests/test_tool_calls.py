"""Tool calling pieces that need no server: the tool policy (tool_choice -> constraint and parser), the prompt
(template or fallback system message). The server round trip is in test_server.py."""
import asyncio
import json

import jsonschema
import pytest

from picovllm.entrypoints.openai.protocol import APIError, ChatCompletionRequest
from picovllm.entrypoints.openai.tokenizer_worker import TokenizerWorker
from picovllm.entrypoints.openai.tool_calls import AutoToolStream, ToolPolicy, template_renders_tools
from serving_fixtures import CHATML, chat_model  # noqa: F401 - a fixture

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "required": ["city"],
                                                           "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **kw)


def test_auto_parses_hermes_blocks_and_keeps_the_rest_as_content():
    policy = request(tools=[WEATHER, TIME]).tool_policy()
    assert policy.mode == "auto" and policy.constraint() is None
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    content, calls = policy.parse(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert len({c.id for c in calls}) == 2
    for plain in ["no call here", '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',
                  '<tool_call>{"name": "unknown_tool", "arguments": {}}</tool_call>']:
        assert policy.parse(plain) == (plain, [])     # never a call that does not parse or names no tool


def test_required_and_named_constraints_validate_and_parse():
    req = request(tools=[WEATHER, TIME], tool_choice="required")
    so = req.sampling_params(8, None).structured_outputs
    calls_text = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", "arguments": {}}]'
    jsonschema.validate(json.loads(calls_text), so.json)
    with pytest.raises(jsonschema.ValidationError):   # the schema ties each name to its own arguments
        jsonschema.validate([{"name": "get_weather", "arguments": {}}], so.json)
    content, calls = req.tool_policy().parse(calls_text)
    assert content is None and [c.name for c in calls] == ["get_weather", "get_time"]
    named = request(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.sampling_params(8, None).structured_outputs.json == WEATHER["function"]["parameters"]
    assert named.tool_policy().parse('{"city": "Rome"}')[1][0].arguments == '{"city": "Rome"}'
    assert named.tool_policy().parse('{"city": "Ro')[1] == []    # cut by max_tokens: no broken call
    single = request(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    schema = single.sampling_params(8, None).structured_outputs.json
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(calls_text), schema)
    jsonschema.validate(json.loads(calls_text)[:1], schema)


@pytest.mark.parametrize("kw,param", [
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tools=[WEATHER, WEATHER]), "tools"),
    (dict(tools=[WEATHER], tool_choice="required", guided_regex="a"), "guided_regex"),
])
def test_bad_tool_requests_name_the_field(kw, param):
    with pytest.raises(APIError) as e:
        request(**kw).sampling_params(8, None)
    assert e.value.status == 400 and e.value.param == param


def test_tools_reach_the_prompt_through_the_template_or_a_system_message(chat_model):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(chat_model)
    assert not template_renders_tools(tok.chat_template)      # the tiny model's ChatML template: fallback
    msgs = [{"role": "user", "content": "weather?"}]
    worker = TokenizerWorker(tok)
    try:
        text = tok.decode(asyncio.run(worker.encode_chat(msgs, True, tools=[WEATHER])))
        assert text.startswith("<|im_start|>system\n") and '"name": "get_weather"' in text and "<tool_call>" in text
        tool_template = CHATML.replace("{% for m in messages %}", "{% if tools %}TOOLS:{{ tools | tojson }}{% endif %}"
                                                                  "{% for m in messages %}")
        worker.tokenizer.chat_template = tool_template
        assert template_renders_tools(tool_template)
        text = tok.decode(asyncio.run(worker.encode_chat(msgs, True, tools=[WEATHER])))
        assert text.startswith("TOOLS:") and "get_weather" in text and "<tool_call>" not in text
    finally:
        worker.shutdown()


def test_assistant_tool_calls_and_tool_results_go_to_the_template():
    req = ChatCompletionRequest(messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}], tools=[WEATHER])
    msgs = [m.as_template_dict() for m in req.messages]
    assert msgs[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Oslo"}}
    assert msgs[2] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}


def test_offline_chat_renders_tools_as_the_server_does(chat_model):
    """LLM.apply_chat_template(tools=...) gives the ids the server's chat endpoint runs; LLM.chat(tools=...) with
    a structured output returns valid arguments (jsonschema)."""
    from picovllm import LLM, SamplingParams
    llm = LLM(chat_model, num_kv_blocks=128, max_model_len=512)
    msgs = [{"role": "user", "content": "weather?"}]
    worker = TokenizerWorker(llm.engine.tokenizer)
    try:
        assert llm.apply_chat_template(msgs, tools=[WEATHER]) == asyncio.run(worker.encode_chat(msgs, True, tools=[WEATHER]))
    finally:
        worker.shutdown()
    schema = {"type": "object", "required": ["city"], "properties": {"city": {"enum": ["Oslo", "Rome"]}}}
    sp = SamplingParams(temperature=1.0, seed=3, max_tokens=40, structured_outputs={"json": schema})
    out = llm.chat(msgs, sp, use_tqdm=False, tools=[WEATHER])[0].outputs[0]
    jsonschema.validate(json.loads(out.text), schema)


@pytest.mark.parametrize("text", [
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    'between <tool_call>{"name": "get_time", "arguments": {}}</tool_call> after',
    'plain text, no call < tool_call> <tool',                                       # ends in a partial tag
    '<tool_call>{"name": "unknown", "arguments": {}}</tool_call> so content <tool_call>{"name": "get_time", '
    '"arguments": {}}</tool_call>',                                                   # a block that is no call
    '  <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>',
    'cut short <tool_call>{"name": "get_weather", "argum',                            # max_tokens inside a block
])
@pytest.mark.parametrize("parallel", [True, False])
def test_auto_stream_adds_up_to_the_parse_and_sends_each_call_when_its_block_closes(text, parallel):
    import random
    policy = request(tools=[WEATHER, TIME], parallel_tool_calls=parallel).tool_policy()
    want_content, want_calls = policy.parse(text)
    rng = random.Random(len(text))
    for hold in (0, 3):
        stream = AutoToolStream(policy, hold)
        content, calls, cut = "", [], 0
        while cut < len(text):
            cut = min(len(text), cut + rng.randint(1, 6))
            new, closed = stream.feed(text[:cut], cut == len(text))
            content += new
            assert (want_content or "").startswith(content)    # nothing sent is ever taken back
            for call in closed:      # sent as soon as its block is complete and past the held characters
                assert text[:cut - (0 if cut == len(text) else hold)].count("</tool_call>") >= len(calls) + 1
                calls.append(call)
        assert (content or None) == want_content
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in want_calls]


def test_auto_stream_sends_content_before_the_call_is_known():
    policy = request(tools=[WEATHER]).tool_policy()
    stream = AutoToolStream(policy)
    assert stream.feed("Checking the wea", False) == ("Checking the wea", [])
    assert stream.feed("Checking the weather.\n<tool", False) == ("ther.", [])      # the newline and "<tool" wait
    block = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    new, calls = stream.feed("Checking the weather.\n" + block, False)
    assert new == "" and [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Oslo"}')]
    assert stream.feed("Checking the weather.\n" + block + "\nDone.", True) == ("", [])
