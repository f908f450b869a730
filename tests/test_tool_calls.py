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
    # cut by max_tokens: the call as far as it came (finish_reason length says so), as vLLM answers it and as it
    # was streamed already
    assert named.tool_policy().parse('{"city": "Ro')[1][0].arguments == '{"city": "Ro'
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
    # a call without arguments (""): an empty object, as vLLM passes it (a template iterating them would fail on "")
    empty = ChatCompletionRequest(messages=[{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": ""}}]}], tools=[TIME])
    assert empty.messages[0].as_template_dict()["tool_calls"][0]["function"] == {"name": "get_time", "arguments": {}}


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
    'Never closed: <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n',   # a call (vLLM's)
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call><tool_call>{"name": "get_weather", '
    '"arguments": {"city": "Rome"}}',                                                 # a closed block, then an open one
])
@pytest.mark.parametrize("parallel", [True, False])
def test_auto_stream_adds_up_to_the_parse_and_sends_each_call_when_its_block_closes(text, parallel):
    import random
    from picovllm.entrypoints.openai.tool_parsers.registry import tool_parser
    policy = request(tools=[WEATHER, TIME], parallel_tool_calls=parallel).tool_policy()
    parser = tool_parser(policy.parser)
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
            for call in closed:      # sent as soon as its block is complete and past the held characters (a block
                # never closed: at the end)
                assert cut == len(text) or text[:cut - hold].count("</tool_call>") >= len(calls) + 1
                calls.append(call)
            if cut < len(text):      # and not later: every call whose block closed before the held characters
                blocks = [m for m in parser.block_re.finditer(text[:max(0, cut - hold)])
                          if parser.block_call(policy, m.group(1)) is not None]
                assert len(calls) == (len(blocks) if parallel else min(1, len(blocks))), (cut, hold)
        assert (content or None) == want_content
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in want_calls]


def test_an_unclosed_last_block_is_a_call_where_its_json_is_one():
    """vLLM's hermes parser reads `<tool_call>(.*)` to the end beside the closed blocks: a last block the model
    never closed is a call where its inside is one, else the text stays content."""
    policy = request(tools=[WEATHER, TIME]).tool_policy()
    content, calls = policy.parse('Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n')
    assert (content, [(c.name, json.loads(c.arguments)) for c in calls]) == ("Sure.", [("get_weather",
                                                                                         {"city": "Oslo"})])
    broken = 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Os'
    assert policy.parse(broken) == (broken, [])


def test_auto_stream_takes_a_text_that_shrank():
    """A text shorter than the last one fed (a stop string's cut): what the stream found past its end is forgotten,
    by hand: a call's block gone below its start, an open tag gone and the text grown again without it."""
    policy = request(tools=[TIME]).tool_policy()
    call = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    stream = AutoToolStream(policy)
    assert [c.name for c in stream.feed("hi " + call, False)[1]] == ["get_time"]
    assert stream.feed("hi", False) == ("", [])
    stream = AutoToolStream(policy)
    assert stream.feed("abc <tool_call>{", False) == ("abc", [])
    assert stream.feed("abc", False) == ("", [])
    assert stream.feed("abc xyz more", False) == (" xyz more", [])


def test_auto_stream_sends_content_before_the_call_is_known():
    policy = request(tools=[WEATHER]).tool_policy()
    stream = AutoToolStream(policy)
    assert stream.feed("Checking the wea", False) == ("Checking the wea", [])
    assert stream.feed("Checking the weather.\n<tool", False) == ("ther.", [])      # the newline and "<tool" wait
    block = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    new, calls = stream.feed("Checking the weather.\n" + block, False)
    assert new == "" and [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Oslo"}')]
    assert stream.feed("Checking the weather.\n" + block + "\nDone.", True) == ("", [])


def policy_of(parser: str, **kw) -> ToolPolicy:
    policy = request(tools=[WEATHER, TIME], **kw).tool_policy()
    policy.parser = parser
    return policy


def named_args(calls) -> list:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("text, want", [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', (None, [("get_weather", {"city": "Paris"})])),
    ('<|python_tag|>{"name": "get_weather", "arguments": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}',
     (None, [("get_weather", {"city": "Oslo"}), ("get_time", {})])),          # Llama 3.1's tag, two calls
    ('  {"name": "get_time", "parameters": {}} ', (None, [("get_time", {})])),
    ("The weather is fine.", ("The weather is fine.", [])),
    ('Sure: {"name": "get_time", "parameters": {}}', ('Sure: {"name": "get_time", "parameters": {}}', [])),
    ('{"name": "get_weather", "parameters": {"city": "Par', None),                # cut short: no call
    ('{"name": "unknown", "parameters": {}}', None),                              # not an offered tool
    ('{"name": "get_time", "parameters": {}} and then prose', None),              # all calls or none
    ('{"name": "get_weather", "parameters": "Paris"}', None),                     # arguments not an object
])
def test_llama3_json_calls_by_hand(text, want):
    """Llama 3.1-3.3's format (vLLM's llama3_json): the whole output is calls, or it is all content."""
    content, calls = policy_of("llama3_json").parse(text)
    assert (content, named_args(calls)) == (want if want is not None else (text, []))


@pytest.mark.parametrize("text, want", [
    ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
     (None, [("get_weather", {"city": "Paris"})])),                               # v3 tokenizers: a JSON list
    ('Let me look.\n[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}, '
     '{"name": "get_time", "arguments": {}}]', ("Let me look.", [("get_weather", {"city": "Rome"}), ("get_time", {})])),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{}',   # v11+: NAME[ARGS]{...} each
     (None, [("get_weather", {"city": "Oslo"}), ("get_time", {})])),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}get_time[ARGS]{}', (None, [("get_weather", {"city": "Oslo"}),
                                                                         ("get_time", {})])),
    ("No call here.", ("No call here.", [])),
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city"', None),         # cut short
    ('[TOOL_CALLS][{"name": "nope", "arguments": {}}]', None),
    ('[TOOL_CALLS]get_weather{"city": "Oslo"}', None),                            # no [ARGS]
    ('[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Oslo"}', (None, [("get_weather", {"city": "Oslo"})])),
])
def test_mistral_calls_by_hand(text, want):
    """Where the calls do not parse, all content, without the special tokens the server kept for the parser
    (vLLM's mistral parser strips [TOOL_CALLS] too)."""
    content, calls = policy_of("mistral").parse(text)
    shown = text.replace("[TOOL_CALLS]", "").replace("[ARGS]", "").replace("[CALL_ID]", "")
    assert (content, named_args(calls)) == (want if want is not None else (shown, []))
    assert "[TOOL_CALLS]" not in (content or "") and "[ARGS]" not in (content or "")


def test_mistral_call_ids_are_nine_letters_and_digits():
    """Mistral's chat templates refuse a tool call id that is not 9 letters and digits when the call comes back: with
    id_style "mistral" every call gets such an id (the model's own from [CALL_ID] where it is one), in every tool_choice
    mode; without, OpenAI's call_ ids."""
    import re
    nine = re.compile(r"[A-Za-z0-9]{9}")
    policy = policy_of("mistral")
    policy.id_style = "mistral"
    text = '[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Oslo"}get_time[CALL_ID]bad id[ARGS]{}'
    calls = policy.parse(text)[1]
    assert named_args(calls) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert calls[0].id == "a1B2c3D4e" and nine.fullmatch(calls[1].id)
    assert nine.fullmatch(policy.parse('[TOOL_CALLS][{"name": "get_time", "arguments": {}}]')[1][0].id)
    for choice, out in [("required", '[{"name": "get_time", "arguments": {}}]'),
                        ({"type": "function", "function": {"name": "get_time"}}, "{}")]:
        strict = ChatCompletionRequest(messages=ASK_TOOL, tools=[WEATHER, TIME], tool_choice=choice).tool_policy()
        strict.id_style = "mistral"
        assert nine.fullmatch(strict.parse(out)[1][0].id)
    assert policy_of("mistral").parse(text)[1][0].id.startswith("call_")


def test_kimi_call_ids_count_the_conversations_calls():
    """Kimi-K2's template writes each call's id back as functions.NAME:IDX, IDX counting the conversation's calls:
    under tool_choice "required" and a named function the calls get such ids, after the earlier messages' calls."""
    out = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", "arguments": {}}]'
    strict = ChatCompletionRequest(messages=ASK_TOOL, tools=[WEATHER, TIME], tool_choice="required").tool_policy()
    strict.id_style, strict.calls_before = "kimi", 2
    assert [c.id for c in strict.parse(out)[1]] == ["functions.get_weather:2", "functions.get_time:3"]
    named = ChatCompletionRequest(messages=ASK_TOOL, tools=[WEATHER, TIME],
                                  tool_choice={"type": "function", "function": {"name": "get_time"}}).tool_policy()
    named.id_style = "kimi"
    assert named.parse("{}")[1][0].id == "functions.get_time:0"


@pytest.mark.parametrize("parser, text", [
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'),
    ("llama3_json", "  Plain prose, streamed as it comes."),
    ("llama3_json", '{"name": "get_weather", "parameters": {"ci'),
    ("mistral", 'Let me look.\n[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}]'),
    ("mistral", 'Checking [TOOL_'),
    ("mistral", "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Oslo\"}[TOOL_CALLS]get_time[ARGS]{}"),
    ("mistral", 'Let me look.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Pa'),     # cut short
    ("mistral", 'Let me look.[TOOL_CALLS]get_weather[ARGS]{"city": "Pa'),
])
def test_whole_call_streams_add_up_to_the_parse(parser, text):
    """llama3_json and mistral streamed: the content as it comes (up to where calls may start), the calls at the
    end, adding up to the parse of the whole text; nothing sent is taken back."""
    import random
    for parallel in (True, False):
        policy = policy_of(parser, parallel_tool_calls=parallel)
        want_content, want_calls = policy.parse(text)
        rng = random.Random(len(text))
        stream, content, calls, cut = AutoToolStream(policy), "", [], 0
        while cut < len(text):
            cut = min(len(text), cut + rng.randint(1, 6))
            new, got = stream.feed(text[:cut], cut == len(text))
            content += new
            assert (want_content or "").startswith(content)
            assert not got or cut == len(text)
            calls += got
        assert (content or None, named_args(calls)) == (want_content, named_args(want_calls))
    prose = policy_of("llama3_json")
    assert AutoToolStream(prose).feed("The weather", False) == ("The weather", [])   # content at once


def test_the_call_format_is_the_models():
    """Detected from the tokenizer (a [TOOL_CALLS] token: mistral) and the template (Llama 3's: llama3_json), else
    hermes; a template that does not render tools falls back to Hermes in a system message whatever the flag."""
    from picovllm.entrypoints.openai.tool_calls import detect_tool_parser

    class Tok:
        def __init__(self, special):
            self.special = special

        def encode(self, text, add_special_tokens=False):
            return [1] if text in self.special else list(text.encode())

    llama3 = '{{- "Environment: ipython\\n" }}{%- for t in tools %}{{ t | tojson }}{% endfor %}<|python_tag|>'
    assert detect_tool_parser(Tok({"[TOOL_CALLS]"}), "{{ tools }}") == "mistral"
    assert detect_tool_parser(Tok(set()), llama3) == "llama3_json"
    assert detect_tool_parser(Tok(set()), "{{ tools }} <tool_call>") == "hermes"
    assert detect_tool_parser(None, None) == "hermes"


# -- served: a tiny model trained to call tools in Mistral's format -------------------------------------------------
MISTRAL_TEMPLATE = ("{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
                    "{% for m in messages %}[INST]{{ m['content'] }}[/INST]{% endfor %}")
ASK_TOOL = [{"role": "user", "content": "Tell me the weather in Paris."}]
MISTRAL_REPLY = 'Let me look.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'


@pytest.fixture(scope="module")
def mistral_tool_model(tmp_path_factory) -> str:
    """The tiny chat model's tokenizer with Mistral's control tokens as special tokens and a template that renders
    the tools, its weights trained to answer ASK_TOOL (WEATHER offered) with MISTRAL_REPLY."""
    markers = ["[TOOL_CALLS]", "[ARGS]", "[INST]", "[/INST]"]
    return tool_model(str(tmp_path_factory.mktemp("mistral") / "model"), markers, MISTRAL_TEMPLATE, MISTRAL_REPLY)


def tool_model(path: str, markers: list[str], template: str, reply: str, special: bool = True) -> str:
    """The tiny chat model at path with `markers` as special tokens (special False: tokens of their own, as Qwen3's
    <think>) and the chat template `template`, its weights trained to answer ASK_TOOL (WEATHER offered, through the
    template) with `reply` and <|im_end|>."""
    from transformers import AutoTokenizer
    from serving_fixtures import build_tiny_chat_model, train_replies
    path = build_tiny_chat_model(path, vocab_size=400)
    tok = AutoTokenizer.from_pretrained(path)
    if special:
        tok.add_special_tokens({"additional_special_tokens": markers})
    else:
        tok.add_tokens(markers)
    tok.chat_template = template
    tok.save_pretrained(path)
    worker = TokenizerWorker(tok)
    try:
        prompt = asyncio.run(worker.encode_chat(ASK_TOOL, True, tools=[WEATHER]))
    finally:
        worker.shutdown()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    return train_replies(path, [(prompt, tok.encode(reply, add_special_tokens=False) + [eos])], [eos])


def test_served_mistral_tool_calls(mistral_tool_model, tmp_path):
    """A server on a model whose tokenizer has [TOOL_CALLS] reads its calls in Mistral's format with no flag (the
    special token kept in the text for it, never shown), streamed or not: the content before the calls, then the
    call, finish tool_calls; --tool-call-parser hermes (vLLM's flag) reads none."""
    import signal
    import openai
    from serving_fixtures import ServerProcess
    kw = dict(messages=ASK_TOOL, tools=[WEATHER], temperature=0, max_tokens=100)
    for flags, want in [((), ("Let me look.", [("get_weather", {"city": "Paris"})], "tool_calls")),
                        (("--tool-call-parser", "hermes", "--enable-auto-tool-choice"),
                         ("Let me look." + MISTRAL_REPLY.split("look.")[1].replace("[TOOL_CALLS]", ""), [], "stop"))]:
        srv = ServerProcess(mistral_tool_model, str(tmp_path / f"server{len(flags)}.log"), "--block-size", "16",
                            "--num-kv-blocks", "64", "--max-model-len", "1024", *flags)
        try:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
            r = client.chat.completions.create(model=client.models.list().data[0].id, **kw)
            msg = r.choices[0].message
            got = [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls or []]
            assert (msg.content, got, r.choices[0].finish_reason) == want
            assert all(len(c.id) == 9 and c.id.isalnum() for c in msg.tool_calls or [])     # Mistral's ids
            content, calls, finish = "", {}, None
            for chunk in client.chat.completions.create(model=client.models.list().data[0].id, stream=True, **kw):
                d, finish = chunk.choices[0].delta, chunk.choices[0].finish_reason or finish
                content += d.content or ""
                for c in d.tool_calls or []:
                    calls.setdefault(c.index, [c.function.name, ""])[1] += c.function.arguments or ""
            got = [(n, json.loads(a)) for _, (n, a) in sorted(calls.items())]
            assert (content, got, finish) == want
        finally:
            assert srv.stop(signal.SIGINT) == 0, srv.log()


COUNT = {"type": "function", "function": {"name": "count", "parameters": {"type": "object", "properties": {
    "n": {"type": "integer"}, "label": {"type": "string"}, "opts": {"type": "object"}}}}}


@pytest.mark.parametrize("text, want", [
    ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",   # GLM-4.5's
     (None, [("get_weather", {"city": "Paris"})])),
    ("Let me see.\n<tool_call>count<arg_key>n</arg_key><arg_value>3</arg_value><arg_key>label</arg_key>"   # 4.7's
     "<arg_value>123</arg_value><arg_key>opts</arg_key><arg_value>{\"a\": [1]}</arg_value></tool_call>"
     "<tool_call>get_time</tool_call>",
     ("Let me see.", [("count", {"n": 3, "label": "123", "opts": {"a": [1]}}), ("get_time", {})])),
    ("<tool_call>count\n<arg_key>n</arg_key>\n<arg_value>many</arg_value>\n</tool_call>",    # not JSON: as text
     (None, [("count", {"n": "many"})])),
    ("<tool_call>nope\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>", None),   # not offered
    ("<tool_call>count\n<arg_key>n</arg_key>\n<arg_value>1</arg_value> junk\n</tool_call>", None),
    ("cut <tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par", None),
])
def test_glm45_calls_by_hand(text, want):
    """GLM-4.5 to 4.7's format (vLLM's glm45): a value is text where the tool's schema says string (label "123"),
    else JSON where it parses; the content is what stands before the first call."""
    policy = request(tools=[WEATHER, TIME, COUNT]).tool_policy()
    policy.parser = "glm45"
    content, calls = policy.parse(text)
    assert (content, named_args(calls)) == (want if want is not None else (text, []))
    rng = __import__("random").Random(len(text))
    stream, sent, streamed, cut = AutoToolStream(policy), "", [], 0
    while cut < len(text):        # streamed: each call as soon as its block closes, adding up to the parse
        cut = min(len(text), cut + rng.randint(1, 6))
        new, got = stream.feed(text[:cut], cut == len(text))
        sent, streamed = sent + new, streamed + got
    assert (sent or None, named_args(streamed)) == (content, named_args(calls))


def test_glm_template_is_detected():
    from picovllm.entrypoints.openai.tool_calls import detect_tool_parser
    glm = "{{ '<tool_call>' + tc.name }}{% for k, v in tc.arguments.items() %}<arg_key>{{ k }}</arg_key>{% endfor %}"
    assert detect_tool_parser(None, glm) == "glm45"


@pytest.mark.parametrize("text, want", [
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
     (None, [("get_weather", {"city": "Paris"})])),                         # Qwen3-Coder's, as its template writes
    ("I will count.\n<tool_call>\n<function=count>\n<parameter=n>\n3\n</parameter>\n<parameter=label>\n007\n"
     "</parameter>\n<parameter=opts>\n{\"a\": true}\n</parameter>\n</function>\n</tool_call>\n"
     "<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
     ("I will count.", [("count", {"n": 3, "label": "007", "opts": {"a": True}}), ("get_time", {})])),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nLine one\nLine two\n\n</parameter>\n</function>\n"
     "</tool_call>", (None, [("get_weather", {"city": "Line one\nLine two\n"})])),   # one newline dropped each side
    ("<tool_call>\n<function=nope>\n</function>\n</tool_call>", None),
    ("<tool_call>\n<function=get_time>\n</function>\nextra\n</tool_call>", None),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", None),
])
def test_qwen3_coder_calls_by_hand(text, want):
    """Qwen3-Coder's format (vLLM's qwen3_coder): values typed by the tool's schema (label "007" stays text)."""
    policy = request(tools=[WEATHER, TIME, COUNT]).tool_policy()
    policy.parser = "qwen3_coder"
    content, calls = policy.parse(text)
    assert (content, named_args(calls)) == (want if want is not None else (text, []))
    rng = __import__("random").Random(len(text))
    stream, sent, streamed, cut = AutoToolStream(policy), "", [], 0
    while cut < len(text):
        cut = min(len(text), cut + rng.randint(1, 6))
        new, got = stream.feed(text[:cut], cut == len(text))
        sent, streamed = sent + new, streamed + got
    assert (sent or None, named_args(streamed)) == (content, named_args(calls))
    from picovllm.entrypoints.openai.tool_calls import detect_tool_parser
    coder = "{{ '<tool_call>\\n<function=' + tc.name + '>\\n' }}{{ '<parameter=' + k + '>\\n' }}"
    assert detect_tool_parser(None, coder) == "qwen3_coder"


# -- the section formats: DeepSeek-V3 / R1-0528, DeepSeek-V3.1, Kimi-K2 ----------------------------------------------
DS_BEGIN, DS_END, DS_CALL, DS_CALL_END, DS_SEP = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                                                 "<｜tool▁call▁end｜>", "<｜tool▁sep｜>")
KIMI_BEGIN, KIMI_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL, KIMI_CALL_END, KIMI_ARGS = "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"


def v3_call(name: str, args: str) -> str:
    return f"{DS_CALL}function{DS_SEP}{name}\n```json\n{args}\n```{DS_CALL_END}"


def v31_call(name: str, args: str) -> str:
    return f"{DS_CALL}{name}{DS_SEP}{args}{DS_CALL_END}"


def kimi_call(name: str, idx: int, args: str) -> str:
    return f"{KIMI_CALL}functions.{name}:{idx}{KIMI_ARGS}{args}{KIMI_CALL_END}"


PARIS, NONE = '{"city": "Paris"}', "{}"
SECTION_CASES = [      # (parser, the model's text, (content, [(name, arguments)]) as the format says)
    ("deepseek_v3", DS_BEGIN + v3_call("get_weather", PARIS) + DS_END, (None, [("get_weather", {"city": "Paris"})])),
    ("deepseek_v3", "Let me look.\n\n" + DS_BEGIN + v3_call("get_weather", PARIS) + "\n" + v3_call("get_time", NONE)
     + DS_END, ("Let me look.", [("get_weather", {"city": "Paris"}), ("get_time", {})])),
    ("deepseek_v3", "Plain answer.", ("Plain answer.", [])),
    ("deepseek_v3", "Hm. " + DS_BEGIN + DS_CALL + "function" + DS_SEP + 'get_weather\n```json\n{"ci',        # cut
     ("Hm. function" + 'get_weather\n```json\n{"ci', [])),
    ("deepseek_v3", DS_BEGIN + v3_call("nope", NONE) + DS_END, ("function" + "nope\n```json\n{}\n```", [])),
    ("deepseek_v3", DS_BEGIN + v3_call("get_weather", '{"city": Paris}') + DS_END,                       # broken
     ('function' + 'get_weather\n```json\n{"city": Paris}\n```', [])),
    ("deepseek_v3", DS_BEGIN + v3_call("get_time", NONE) + v3_call("get_weather", '{"city"') + DS_END,  # one broken
     (None, [("get_time", {})])),
    ("deepseek_v31", DS_BEGIN + v31_call("get_weather", PARIS) + DS_END, (None, [("get_weather", {"city": "Paris"})])),
    ("deepseek_v31", "Checking both.\n" + DS_BEGIN + v31_call("get_weather", PARIS) + v31_call("get_time", NONE)
     + DS_END, ("Checking both.", [("get_weather", {"city": "Paris"}), ("get_time", {})])),
    ("deepseek_v31", "So " + DS_BEGIN + v31_call("get_weather", PARIS)[:-len(DS_CALL_END)],       # no end marker
     ("So " + 'get_weather{"city": "Paris"}', [])),
    ("deepseek_v31", DS_BEGIN + v31_call("nope", NONE) + DS_END, ("nope{}", [])),
    ("deepseek_v31", DS_BEGIN + v31_call("get_weather", '{"city": "Paris"') + DS_END,
     ('get_weather{"city": "Paris"', [])),
    ("deepseek_v31", DS_BEGIN + v31_call("get_weather", '"Paris"') + DS_END, ('get_weather"Paris"', [])),  # no object
    ("kimi_k2", KIMI_BEGIN + kimi_call("get_weather", 0, PARIS) + KIMI_END,
     (None, [("get_weather", {"city": "Paris"})])),
    ("kimi_k2", "I'll check.\n" + KIMI_BEGIN + kimi_call("get_weather", 3, PARIS) + kimi_call("get_time", 4, NONE)
     + KIMI_END, ("I'll check.", [("get_weather", {"city": "Paris"}), ("get_time", {})])),
    ("kimi_k2", "Cut " + KIMI_BEGIN + KIMI_CALL + "functions.get_weather:0" + KIMI_ARGS + '{"city": "Pa',
     ("Cut functions.get_weather:0" + '{"city": "Pa', [])),
    ("kimi_k2", KIMI_BEGIN + kimi_call("nope", 0, NONE) + KIMI_END, ("functions.nope:0{}", [])),
    ("kimi_k2", KIMI_BEGIN + kimi_call("get_weather", 0, "{city: Paris}") + KIMI_END,
     ("functions.get_weather:0{city: Paris}", [])),
    ("kimi_k2", KIMI_BEGIN + KIMI_CALL + "get_weather" + KIMI_ARGS + PARIS + KIMI_CALL_END + KIMI_END,      # no :IDX
     ("get_weather" + PARIS, [])),
]


@pytest.mark.parametrize("parser, text, want", SECTION_CASES)
def test_section_format_calls_by_hand(parser, text, want):
    """DeepSeek-V3's, V3.1's and Kimi-K2's calls (vLLM's deepseek_v3, deepseek_v31, kimi_k2): the content before the
    section; a call cut short, of a tool not offered or with arguments that are no JSON object is none; where no
    call comes, the text is the content without the format's markers (special tokens: never shown)."""
    content, calls = policy_of(parser).parse(text)
    assert (content, named_args(calls)) == want
    assert named_args(policy_of(parser, parallel_tool_calls=False).parse(text)[1]) == want[1][:1]


@pytest.mark.parametrize("parser, text, want", SECTION_CASES)
def test_section_format_streams_add_up_to_the_parse(parser, text, want):
    """Streamed: the content as it comes up to where a marker is or may be starting, each call once its end marker
    is in (past the held characters), adding up to the parse of the whole text; nothing sent is taken back."""
    import random
    call_end = DS_CALL_END if parser.startswith("deepseek") else KIMI_CALL_END
    for parallel, hold in [(True, 0), (False, 0), (True, 3)]:
        policy = policy_of(parser, parallel_tool_calls=parallel)
        want_content, want_calls = policy.parse(text)
        rng = random.Random(len(text) + hold)
        stream, content, calls, cut = AutoToolStream(policy, hold), "", [], 0
        while cut < len(text):
            cut = min(len(text), cut + rng.randint(1, 6))
            new, got = stream.feed(text[:cut], cut == len(text))
            content += new
            assert (want_content or "").startswith(content)
            assert not any(m in content for m in (DS_BEGIN, DS_CALL, DS_SEP, KIMI_BEGIN, KIMI_CALL, KIMI_ARGS))
            if got:
                assert text[:cut - (0 if cut == len(text) else hold)].count(call_end) >= len(calls) + len(got)
            calls += got
            if cut < len(text):      # and each as soon as its end marker is in: the calls of the text so far
                assert len(calls) == len(policy.parse(text[:max(0, cut - hold)])[1]), (cut, hold)
        assert (content or None, named_args(calls)) == (want_content, named_args(want_calls))


def test_kimi_call_ids_are_the_models():
    """Kimi-K2's template writes a call's id back as `functions.NAME:IDX`: a call keeps the id the model gave it."""
    text = KIMI_BEGIN + kimi_call("get_weather", 2, PARIS) + kimi_call("get_time", 3, NONE) + KIMI_END
    assert [c.id for c in policy_of("kimi_k2").parse(text)[1]] == ["functions.get_weather:2", "functions.get_time:3"]
    assert policy_of("deepseek_v31").parse(DS_BEGIN + v31_call("get_time", NONE))[1][0].id.startswith("call_")


def test_section_formats_are_detected_from_tokenizer_and_template():
    """A single-token <｜tool▁calls▁begin｜>: deepseek_v3, or deepseek_v31 where the template writes V3.1's calls (the
    name right after <｜tool▁call▁begin｜>, no ```json); a <|tool_calls_section_begin|> token: kimi_k2; the same text
    in several tokens is no such model's. --tool-call-parser takes the names."""
    import argparse
    from picovllm.entrypoints.openai.cli_proxy import add_tool_args
    from picovllm.entrypoints.openai.tool_calls import detect_tool_parser

    class Tok:
        def __init__(self, special):
            self.special = special

        def encode(self, text, add_special_tokens=False):
            return [1] if text in self.special else list(text.encode())

    v3 = ("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + "
          "'\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}"
          " {{ tools }}")
    v31 = ("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'+ tool['function']['name'] + '<｜tool▁sep｜>' + "
           "tool['function']['arguments'] + '<｜tool▁call▁end｜>'}} {{ tools }}")
    kimi = "{{ '<|tool_call_begin|>' + tc.id + '<|tool_call_argument_begin|>' }} {{ tools }}"
    deepseek, moonshot = Tok({DS_BEGIN}), Tok({KIMI_BEGIN})
    assert detect_tool_parser(deepseek, v3) == "deepseek_v3"
    assert detect_tool_parser(deepseek, None) == "deepseek_v3"
    assert detect_tool_parser(deepseek, v31) == "deepseek_v31"
    assert detect_tool_parser(moonshot, kimi) == "kimi_k2"
    assert detect_tool_parser(Tok(set()), v31) == "hermes" and detect_tool_parser(Tok(set()), kimi) == "hermes"
    p = argparse.ArgumentParser()
    add_tool_args(p)
    for name in ("deepseek_v3", "deepseek_v31", "kimi_k2"):
        assert p.parse_args(["--tool-call-parser", name]).tool_call_parser == name


# -- served: a tiny model trained to call tools in Kimi-K2's format --------------------------------------------------
KIMI_TEMPLATE = ("{% if tools %}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{% endif %}"
                 "{% for m in messages %}<|im_user|>{{ m['content'] }}<|im_end|>{% endfor %}<|im_assistant|>")
KIMI_REPLY = "Let me look." + KIMI_BEGIN + kimi_call("get_weather", 0, PARIS) + KIMI_END


@pytest.fixture(scope="module")
def kimi_tool_model(tmp_path_factory) -> str:
    """The tiny chat model's tokenizer with Kimi-K2's markers as special tokens and a template that renders the
    tools, its weights trained to answer ASK_TOOL (WEATHER offered) with KIMI_REPLY."""
    markers = [KIMI_BEGIN, KIMI_END, KIMI_CALL, KIMI_CALL_END, KIMI_ARGS, "<|im_system|>", "<|im_middle|>",
               "<|im_user|>", "<|im_assistant|>"]
    return tool_model(str(tmp_path_factory.mktemp("kimi") / "model"), markers, KIMI_TEMPLATE, KIMI_REPLY)


def test_served_kimi_tool_calls(kimi_tool_model, tmp_path):
    """A server on a model whose tokenizer has <|tool_calls_section_begin|> reads its calls in Kimi-K2's format with
    no flag (the markers kept in the text for it, never shown), streamed or not: the content before the section,
    then the call with the model's id functions.NAME:IDX, finish tool_calls."""
    import signal
    import openai
    from serving_fixtures import ServerProcess
    kw = dict(messages=ASK_TOOL, tools=[WEATHER], temperature=0, max_tokens=100)
    want = ("Let me look.", [("functions.get_weather:0", "get_weather", {"city": "Paris"})], "tool_calls")
    srv = ServerProcess(kimi_tool_model, str(tmp_path / "server.log"), "--block-size", "16", "--num-kv-blocks", "64",
                        "--max-model-len", "1024")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        r = client.chat.completions.create(model=model, **kw)
        msg = r.choices[0].message
        got = [(c.id, c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls or []]
        assert (msg.content, got, r.choices[0].finish_reason) == want
        content, calls, finish = "", {}, None
        for chunk in client.chat.completions.create(model=model, stream=True, **kw):
            d, finish = chunk.choices[0].delta, chunk.choices[0].finish_reason or finish
            content += d.content or ""
            for c in d.tool_calls or []:
                calls.setdefault(c.index, [c.id, c.function.name, ""])[2] += c.function.arguments or ""
        got = [(i, n, json.loads(a)) for _, (i, n, a) in sorted(calls.items())]
        assert (content, got, finish) == want
    finally:
        assert srv.stop(signal.SIGINT) == 0, srv.log()


def _chat_in_process(engine, body: dict) -> tuple[dict, dict]:
    """(the non-streamed choice, the streamed one gathered: finish_reason and each call's name and arguments) of
    one chat request through the server's app in this process."""
    from fastapi.testclient import TestClient
    from picovllm.entrypoints.openai.api_server import ServerSettings, build_app
    from picovllm.entrypoints.openai.async_engine import AsyncEngine
    from picovllm.entrypoints.openai.metrics import ServerMetrics
    from picovllm.entrypoints.openai.serving import ServingContext
    from picovllm.entrypoints.openai.tokenizer_worker import TokenizerWorker
    ctx = ServingContext(AsyncEngine(engine), TokenizerWorker(engine.tokenizer), ServerMetrics("m"), "m")
    with TestClient(build_app(ctx, ServerSettings())) as http:
        whole = http.post("/v1/chat/completions", json=body).json()
        text = http.post("/v1/chat/completions", json={**body, "stream": True}).text
    streamed = {"finish_reason": None, "calls": {}}
    for line in text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in json.loads(line[6:]).get("choices", []):
            streamed["finish_reason"] = choice.get("finish_reason") or streamed["finish_reason"]
            for c in choice["delta"].get("tool_calls") or []:
                call = streamed["calls"].setdefault(c["index"], [None, ""])
                call[0] = c["function"].get("name") or call[0]
                call[1] += c["function"].get("arguments") or ""
    return {**whole["choices"][0], "usage": whole["usage"]}, streamed


def test_finish_reasons_of_named_and_required_calls_as_openai(chat_model):
    """OpenAI's and vLLM's finish reasons, the same streamed and not: a named function's call finishes "stop" (its
    grammar ended the output) or "length" (max_tokens reached the arguments' last token before the end), "required"
    finishes "tool_calls" when the output ended by itself and "length" when max_tokens cut it after the calls."""
    from conftest import assert_engine_clean
    from picovllm import EngineConfig
    from picovllm.engine.llm_engine import Engine
    engine = Engine(EngineConfig(model=chat_model, num_kv_blocks=64, max_model_len=512, async_scheduling=False))
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "required": ["city"], "properties": {"city": {"enum": ["Paris"]}},
        "additionalProperties": False}}}
    base = {"messages": [{"role": "user", "content": "weather?"}], "tools": [tool], "temperature": 0,
            "parallel_tool_calls": False}
    for choice, ended, cut in [({"type": "function", "function": {"name": "get_weather"}}, "stop", "length"),
                               ("required", "tool_calls", "length")]:
        whole, streamed = _chat_in_process(engine, {**base, "tool_choice": choice, "max_tokens": 100})
        assert whole["message"].get("tool_calls"), whole
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in whole["message"]["tool_calls"]]
        assert json.loads(calls[0][1]) == {"city": "Paris"}
        assert (whole["finish_reason"], streamed["finish_reason"]) == (ended, ended), choice
        assert [tuple(c) for c in streamed["calls"].values()] == calls
        # the output's tokens but the end the grammar added: the calls whole, the output cut by max_tokens
        n = whole["usage"]["completion_tokens"] - 1
        whole, streamed = _chat_in_process(engine, {**base, "tool_choice": choice, "max_tokens": n})
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole["message"]["tool_calls"]] == calls
        assert (whole["finish_reason"], streamed["finish_reason"]) == (cut, cut), choice
        assert [tuple(c) for c in streamed["calls"].values()] == calls
    assert_engine_clean(engine)


def test_responses_items_the_same_streamed_or_not(tmp_path_factory):
    """/v1/responses with the message's logprobs asked for: a reply that is only a tool call is one function_call
    item, and a reply with a reasoning block is a reasoning item then the message, streamed or not (no empty message
    item for the tokens that have no text of their own: a call's held-back text, a <think>); not streamed, the
    message's logprobs are those of its tokens, streamed or not, also where one step's output carries the end of
    the reasoning and the message's start (stream_interval: outputs N tokens at a time)."""
    import openai
    from fastapi.testclient import TestClient
    from picovllm import EngineConfig
    from picovllm.engine.llm_engine import Engine
    from picovllm.entrypoints.openai.api_server import ServerSettings, build_app
    from picovllm.entrypoints.openai.async_engine import AsyncEngine
    from picovllm.entrypoints.openai.metrics import ServerMetrics
    from picovllm.entrypoints.openai.serving import ServingContext
    from conftest import assert_engine_clean
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    for reply, markers, parser, want, tokens in [
            (call, [], None, [("function_call", '{"city": "Paris"}')], None),
            ("<think>plan</think>Hello.", ["<think>", "</think>"], "qwen3",
             [("reasoning", "plan"), ("message", "Hello.")], "Hello.<|im_end|>")]:     # its end token too
        path = tool_model(str(tmp_path_factory.mktemp("responses") / "model"), markers, CHATML, reply, special=False)
        for interval in ((1, 2, 3, 64) if tokens else (1,)):     # 2, 3: </think> and the text in one output
            engine = Engine(EngineConfig(model=path, num_kv_blocks=64, max_model_len=1024, async_scheduling=False,
                                         stream_interval=interval))
            ctx = ServingContext(AsyncEngine(engine), TokenizerWorker(engine.tokenizer), ServerMetrics("m"), "m",
                                 reasoning_parser=parser)
            with TestClient(build_app(ctx, ServerSettings())) as http:
                client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
                kw = dict(model="m", input=ASK_TOOL, tools=[{"type": "function", **WEATHER["function"]}],
                          temperature=0, max_output_tokens=200, include=["message.output_text.logprobs"])
                whole = client.responses.create(**kw)
                streamed = list(client.responses.create(stream=True, **kw))
                for got in (whole, streamed[-1].response):
                    items = [(o.type, o.arguments if o.type == "function_call" else o.content[0].text)
                             for o in got.output]
                    assert items == want, reply
                    if tokens is not None:
                        assert "".join(lp.token for lp in got.output[-1].content[0].logprobs) == tokens, interval
                if tokens is not None:     # the deltas carry them too
                    assert "".join(lp.token for e in streamed if e.type == "response.output_text.delta"
                                   for lp in e.logprobs) == tokens, interval
            assert_engine_clean(engine)


BIG = "1" + "0" * 5000            # Python's json refuses an integer past 4,300 digits (ValueError)
DEEP = "[" * 5000 + "]" * 5000     # and nesting past its recursion limit (RecursionError)


@pytest.mark.parametrize("value", [BIG, DEEP], ids=["5000-digit integer", "5000-deep nesting"])
def test_a_call_python_cannot_parse_is_content(value):
    """A model's call whose JSON Python's json cannot hold parses as a call that does not parse: content, no call
    (it raised out of the parser: a 500, and a stream cut short)."""
    args = '{"city": ' + value + '}'
    cases = {
        "hermes": '<tool_call>{"name": "get_weather", "arguments": ' + args + '}</tool_call>',
        "llama3_json": '{"name": "get_weather", "parameters": ' + args + '}',
        "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": ' + args + '}]',
        "deepseek_v3": DS_BEGIN + v3_call("get_weather", args) + DS_END,
        "deepseek_v31": DS_BEGIN + v31_call("get_weather", args) + DS_END,
    }
    for parser, text in cases.items():
        content, calls = policy_of(parser).parse(text)
        assert calls == [] and isinstance(content, str) and value in content, parser
    mistral_args = '[TOOL_CALLS]get_weather[ARGS]' + args
    assert policy_of("mistral").parse(mistral_args) == (mistral_args.replace("[TOOL_CALLS]", "").replace("[ARGS]", ""),
                                                        [])
    required = '[{"name": "get_weather", "arguments": ' + args + '}]'
    assert policy_of("hermes", tool_choice="required").parse(required) == (required, [])
