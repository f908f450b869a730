"""GPT-OSS's harmony replies in the chat server (entrypoints/openai/harmony.py): reasoning, content and tool calls.

The oracle is the format as OpenAI's harmony guide writes it (its examples, by hand); the served round trip runs a
tiny model trained here to say harmony replies, so the server reads what a model wrote."""
import asyncio
import json
import random
import signal

import openai
import pytest

from picovllm.entrypoints.openai.harmony import HarmonyStream, parse_harmony, speaks_harmony
from picovllm.entrypoints.openai.protocol import APIError, ChatCompletionRequest
from picovllm.entrypoints.openai.tokenizer_worker import TokenizerWorker
from serving_fixtures import CHATML, ServerProcess

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}

# the guide's reply to "What is 2 + 2?" (the prompt ends with <|start|>assistant; <|return|> stops the engine)
ANSWER = ('<|channel|>analysis<|message|>User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.<|end|>'
          '<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.')
# the guide's tool call: the recipient in the channel's part of the header, <|constrain|>json; <|call|> stops it
CALL = ('<|channel|>analysis<|message|>Need to use function get_weather.<|end|><|start|>assistant'
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"San Francisco"}')
# HF's gpt-oss chat template's form: the recipient after the role, the content type as a word
CALL_AFTER_ROLE = ('<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|end|>'
                   '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
                   '<|message|>{"city": "Oslo"}')


def policy(tools=(WEATHER, TIME), **kw):
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=list(tools), **kw).tool_policy()


def calls_of(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_the_guides_replies_by_hand():
    assert parse_harmony(ANSWER, policy(), cut=False)[:2] == (
        'User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.', "2 + 2 = 4.")
    assert parse_harmony(ANSWER + "<|return|>", None, cut=False) == parse_harmony(ANSWER, None, cut=False)
    thought, content, calls = parse_harmony(CALL, policy(), cut=False)
    assert (thought, content) == ("Need to use function get_weather.", None)
    assert calls_of(calls) == [("get_weather", {"city": "San Francisco"})]
    thought, content, calls = parse_harmony(CALL_AFTER_ROLE, policy(), cut=False)
    assert (thought, content) == (None, None)
    assert calls_of(calls) == [("get_time", {}), ("get_weather", {"city": "Oslo"})]
    assert len({c.id for c in calls}) == 2
    assert calls_of(parse_harmony(CALL_AFTER_ROLE, policy(parallel_tool_calls=False), cut=False)[2]) == [
        ("get_time", {})]


def test_what_is_not_a_call_stays_text():
    """A call cut short, with broken arguments, to a tool not offered, under tool_choice none, or a built-in tool's
    in the reasoning: never a call; its text goes where its channel's goes."""
    args = '{"city":"San Francisco"}'
    assert parse_harmony(CALL, policy(), cut=True) == ("Need to use function get_weather.", args, [])
    assert parse_harmony(CALL[:-3], policy(), cut=False)[1:] == (args[:-3], [])
    assert parse_harmony(CALL, policy(tools=[TIME]), cut=False)[1:] == (args, [])
    assert parse_harmony(CALL, policy(tool_choice="none"), cut=False)[1:] == (args, [])
    assert parse_harmony(CALL, None, cut=False)[1:] == (args, [])
    browse = ('<|channel|>analysis to=browser.search <|constrain|>json<|message|>{"query": "x"}<|end|>'
              '<|start|>assistant<|channel|>final<|message|>Done.')
    assert parse_harmony(browse, policy(), cut=False) == ('{"query": "x"}', "Done.", [])


def test_replies_without_harmony_and_cut_short():
    """No header (a grammar governed the whole reply): all content, reasoning null; a reply max_tokens cut inside
    its reasoning: reasoning, content null; inside a header: nothing of it."""
    assert parse_harmony(' {"a": 1}', policy(), cut=False) == (None, ' {"a": 1}', [])
    assert parse_harmony("<|channel|>analysis<|message|>Thinking", None, cut=True) == ("Thinking", None, [])
    assert parse_harmony("<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|chan", None, cut=True) == (
        "Hm.", None, [])
    assert parse_harmony("", None, cut=True) == (None, None, [])


@pytest.mark.parametrize("text", [ANSWER, CALL, CALL_AFTER_ROLE, '{"a": [1, 2]}', ANSWER[:-7]])
def test_the_stream_adds_up_to_the_parse_and_never_shows_a_marker(text):
    """Any split into pieces gives what the whole text gives; no piece shows a marker or a part of one; each call
    comes whole once its message ends."""
    want = parse_harmony(text, policy(), cut=False)
    rng = random.Random(0)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(12, len(text) - 1))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        s = HarmonyStream(policy())
        thought = content = ""
        calls = []
        for k, piece in enumerate(pieces):
            d = s.feed(piece, k == len(pieces) - 1)
            assert "<|" not in d.reasoning + d.content and "|>" not in d.reasoning + d.content
            thought, content, calls = thought + d.reasoning, content + d.content, calls + d.calls
        assert (thought if s.reasoned else None, content or None) == want[:2]
        assert calls_of(calls) == calls_of(want[2])


# -- a tiny model trained here to answer in harmony, served ---------------------------------------------------------
MARKERS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
# a harmony chat template of this test's own (GPT-OSS's renders more: dates, tools as TypeScript, ...)
TEMPLATE = ("{% if reasoning_effort %}<|start|>system<|message|>Reasoning: {{ reasoning_effort }}<|end|>{% endif %}"
            "{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}"
            "{% if m.thinking %} ({{ m.thinking }}){% endif %}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|start|>assistant{% endif %}")
ASK = [{"role": "user", "content": "The capital of France?"}]
ASK_TOOL = [{"role": "user", "content": "Tell me the weather in Paris."}]
THOUGHT, FINAL = "The capital of France is Paris.", "Paris."
TOOL_THOUGHT = "A server streams tokens."
REPLY = f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant<|channel|>final<|message|>{FINAL}<|return|>"
TOOL_REPLY = (f"<|channel|>analysis<|message|>{TOOL_THOUGHT}<|end|><|start|>assistant<|channel|>commentary "
              'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')


def _prompt_ids(tok, messages, tools=None) -> list[int]:
    """The prompt the server renders (tools: described in a system message, as for any template without them)."""
    worker = TokenizerWorker(tok)
    try:
        return asyncio.run(worker.encode_chat(messages, True, tools=tools))
    finally:
        worker.shutdown()


@pytest.fixture(scope="module")
def harmony_model(tmp_path_factory) -> str:
    """The tiny chat model's tokenizer with harmony's markers as special tokens and a harmony template, and a tiny
    Llama trained (teacher-forced, to a loss near 0) to answer ASK with REPLY and ASK_TOOL (WEATHER offered) with
    TOOL_REPLY, so that it says them greedily; <|return|> and <|call|> are its EOS tokens, as GPT-OSS's."""
    from transformers import AutoTokenizer
    from serving_fixtures import build_tiny_chat_model, train_replies

    path = build_tiny_chat_model(str(tmp_path_factory.mktemp("harmony") / "model"), vocab_size=400)
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": MARKERS})
    tok.chat_template = TEMPLATE
    assert speaks_harmony(tok) and max(tok.convert_tokens_to_ids(MARKERS)) < 400
    tok.save_pretrained(path)
    seqs = [(_prompt_ids(tok, messages, tools), tok.encode(reply, add_special_tokens=False))
            for messages, tools, reply in [(ASK, None, REPLY), (ASK_TOOL, [WEATHER], TOOL_REPLY)]]
    return train_replies(path, seqs, tok.convert_tokens_to_ids(["<|return|>", "<|call|>"]))


@pytest.fixture(scope="module")
def client(harmony_model, tmp_path_factory):
    srv = ServerProcess(harmony_model, str(tmp_path_factory.mktemp("log") / "server.log"), "--block-size", "16",
                        "--num-kv-blocks", "128", "--max-model-len", "1024")
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    assert srv.stop(signal.SIGINT) == 0, srv.log()


def _streamed(client, **kw) -> tuple:
    """(reasoning, content, calls, finish reason, reasoning tokens) of a streamed reply, as a client adds them up."""
    reasoning = content = ""
    calls, finish, tokens = {}, None, None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens_details.reasoning_tokens
        if not chunk.choices:
            continue
        d, finish = chunk.choices[0].delta, chunk.choices[0].finish_reason or finish
        reasoning += (d.model_extra or {}).get("reasoning") or ""
        content += d.content or ""
        for c in d.tool_calls or []:
            calls.setdefault(c.index, [c.function.name, ""])[1] += c.function.arguments or ""
    return reasoning, content, [(n, json.loads(a)) for _, (n, a) in sorted(calls.items())], finish, tokens


def _tokens(tok, text: str) -> int:
    return len(tok.encode(text, add_special_tokens=False))


def test_served_reasoning_answer_and_tool_call(client, harmony_model):
    """The trained replies come back split as the guide reads them, streamed or not: the analysis message as
    reasoning, the final one as content (finish stop), the call to functions.get_weather as a tool call (finish
    tool_calls); usage counts the analysis message's tokens (its header and end included) as reasoning tokens; no
    marker reaches the client."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(harmony_model)
    model = client.models.list().data[0].id
    kw = dict(model=model, messages=ASK, temperature=0, max_tokens=200)
    thinking = _tokens(tok, f"<|channel|>analysis<|message|>{THOUGHT}<|end|>")
    got = client.chat.completions.create(**kw)
    msg = got.choices[0].message
    assert (msg.model_extra["reasoning"], msg.model_extra["reasoning_content"], msg.content) == (THOUGHT, THOUGHT, FINAL)
    assert got.choices[0].finish_reason == "stop" and msg.tool_calls is None
    assert got.usage.completion_tokens == _tokens(tok, REPLY)     # <|return|> counted, not shown
    assert got.usage.completion_tokens_details.reasoning_tokens == thinking
    assert _streamed(client, **kw) == (THOUGHT, FINAL, [], "stop", thinking)
    got = client.chat.completions.create(**kw, extra_body={"include_reasoning": False})
    assert (got.choices[0].message.model_extra["reasoning"], got.choices[0].message.content) == (None, FINAL)
    got = client.responses.create(model=model, input=ASK, temperature=0, max_output_tokens=200)
    assert [(o.type, o.content[0].text) for o in got.output] == [("reasoning", THOUGHT), ("message", FINAL)]
    got = client.responses.create(model=model, input=ASK, max_output_tokens=4, reasoning={"effort": "high"})
    assert got.reasoning.effort == "high"     # the template's variable (what it does to the prompt: below)

    kw = dict(model=model, messages=ASK_TOOL, tools=[WEATHER], temperature=0, max_tokens=200)
    got = client.chat.completions.create(**kw)
    msg = got.choices[0].message
    assert (msg.model_extra["reasoning"], msg.content) == (TOOL_THOUGHT, None)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    assert got.choices[0].finish_reason == "tool_calls"
    thinking = _tokens(tok, f"<|channel|>analysis<|message|>{TOOL_THOUGHT}<|end|>")
    assert _streamed(client, **kw) == (TOOL_THOUGHT, "", [("get_weather", {"city": "Paris"})], "tool_calls", thinking)


def test_served_beam_search_replies_are_read_as_harmony(client, harmony_model):
    """use_beam_search: the best beam (the trained reply) is split as a sampled reply is, reasoning tokens counted;
    it had come back as content with the markers dropped and the channel names glued to the text."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(harmony_model)
    kw = dict(model=client.models.list().data[0].id, messages=ASK, max_tokens=200)
    got = client.chat.completions.create(**kw, n=2, extra_body={"use_beam_search": True})
    msg = got.choices[0].message
    assert (msg.model_extra["reasoning"], msg.content, got.choices[0].finish_reason) == (THOUGHT, FINAL, "stop")
    assert all("<|" not in (c.message.content or "") + (c.message.model_extra["reasoning"] or "") and
               "assistantfinal" not in (c.message.content or "") for c in got.choices)
    beams = [tok.encode(c.message.model_extra["reasoning"] or "", add_special_tokens=False) for c in got.choices]
    assert got.usage.completion_tokens_details.reasoning_tokens >= sum(len(b) for b in beams) > 0
    greedy = client.chat.completions.create(**kw, temperature=0, n=1, extra_body={"use_beam_search": True})
    assert greedy.usage.completion_tokens_details.reasoning_tokens == \
        _tokens(tok, f"<|channel|>analysis<|message|>{THOUGHT}<|end|>")


def test_responses_message_logprobs_are_the_final_messages_tokens(harmony_model):
    """/v1/responses with the message's logprobs: with harmony they are the final message's body tokens (not its
    header's, the analysis', or the markers'), streamed or not, also where one output carries the end of the
    analysis and the answer (stream_interval); they had carried the headers (not streamed) or been lost (streamed).
    The chat API's logprobs still cover every token."""
    from fastapi.testclient import TestClient
    from transformers import AutoTokenizer
    from conftest import assert_engine_clean
    from picovllm import EngineConfig
    from picovllm.engine.llm_engine import Engine
    from picovllm.entrypoints.openai.api_server import ServerSettings, build_app
    from picovllm.entrypoints.openai.async_engine import AsyncEngine
    from picovllm.entrypoints.openai.harmony import ContentTokens, HarmonyTokens
    from picovllm.entrypoints.openai.metrics import ServerMetrics
    from picovllm.entrypoints.openai.serving import ServingContext
    tok = AutoTokenizer.from_pretrained(harmony_model)
    final = [tok.decode([t]) for t in tok.encode(FINAL, add_special_tokens=False)]
    ids = tok.encode(REPLY, add_special_tokens=False)       # by hand: the final body's tokens, fed in any pieces
    for size in (1, 5, len(ids)):
        kinds = ContentTokens(HarmonyTokens(tok))
        keep = [k for j in range(0, len(ids), size) for k in kinds.feed(ids[j:j + size])]
        assert [tok.decode([t]) for t, k in zip(ids, keep) if k] == final
    for interval in (1, 3, 64):
        engine = Engine(EngineConfig(model=harmony_model, num_kv_blocks=64, max_model_len=1024,
                                     async_scheduling=False, stream_interval=interval))
        ctx = ServingContext(AsyncEngine(engine), TokenizerWorker(engine.tokenizer), ServerMetrics("m"), "m")
        with TestClient(build_app(ctx, ServerSettings())) as http:
            client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
            kw = dict(model="m", input=ASK, temperature=0, max_output_tokens=200,
                      include=["message.output_text.logprobs"])
            whole = client.responses.create(**kw)
            streamed = list(client.responses.create(stream=True, **kw))
            for got in (whole, streamed[-1].response):
                assert [(o.type, o.content[0].text) for o in got.output] == [("reasoning", THOUGHT), ("message", FINAL)]
                assert [lp.token for lp in got.output[-1].content[0].logprobs] == final, interval
            assert [lp.token for e in streamed if e.type == "response.output_text.delta" for lp in e.logprobs] == final
            chat = client.chat.completions.create(model="m", messages=ASK, temperature=0, logprobs=True)
            assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens
        assert_engine_clean(engine)


def test_served_reply_cut_short(client, harmony_model):
    """max_tokens inside the reasoning: the reasoning so far, content null, finish length; inside the call's
    arguments: no call, the arguments so far as text (never a call with broken arguments)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(harmony_model)
    model = client.models.list().data[0].id
    head = "<|channel|>analysis<|message|>"
    n = _tokens(tok, head + "The capital")
    got = client.chat.completions.create(model=model, messages=ASK, temperature=0, max_tokens=n)
    msg = got.choices[0].message
    assert (msg.model_extra["reasoning"], msg.content, got.choices[0].finish_reason) == ("The capital", None, "length")
    ids = tok.encode(TOOL_REPLY, add_special_tokens=False)[:-4]       # <|call|> and the arguments' last 3 tokens
    args = tok.decode(ids, skip_special_tokens=False).rsplit("<|message|>", 1)[1]
    assert args and '{"city": "Paris"}'.startswith(args) and args != '{"city": "Paris"}'
    got = client.chat.completions.create(model=model, messages=ASK_TOOL, tools=[WEATHER], temperature=0,
                                         max_tokens=len(ids))
    msg = got.choices[0].message
    assert msg.tool_calls is None and got.choices[0].finish_reason == "length"
    assert (msg.model_extra["reasoning"], msg.content) == (TOOL_THOUGHT, args)


def test_reasoning_effort_and_earlier_reasoning_reach_the_template(harmony_model):
    """reasoning_effort sets the template's variable of that name, and is a 400 naming it where the template has
    none; an assistant message's reasoning reaches the template as `thinking` (GPT-OSS's name) and
    `reasoning_content` (Qwen3's)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(harmony_model)
    worker, chatml = TokenizerWorker(tok), TokenizerWorker(tok, chat_template=CHATML)
    try:
        text = tok.decode(asyncio.run(worker.encode_chat(ASK, True, reasoning_effort="high")))
        assert text.startswith("<|start|>system<|message|>Reasoning: high<|end|>")
        assert "Reasoning" not in tok.decode(asyncio.run(worker.encode_chat(ASK, True)))
        with pytest.raises(APIError) as e:
            asyncio.run(chatml.encode_chat(ASK, True, reasoning_effort="high"))
        assert e.value.status == 400 and e.value.param == "reasoning_effort"
    finally:
        worker.shutdown()
        chatml.shutdown()
    req = ChatCompletionRequest(messages=[*ASK, {"role": "assistant", "content": "Paris.", "reasoning": "Easy."}])
    assert req.messages[1].as_template_dict() == {"role": "assistant", "content": "Paris.",
                                                  "reasoning_content": "Easy.", "thinking": "Easy."}
    # a reply this server gave (reasoning, a preamble as content, a call), sent back: GPT-OSS's template refuses
    # both content and thinking before a call, so the reasoning goes by Qwen3's name only
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    back = ChatCompletionRequest(messages=[*ASK_TOOL, {"role": "assistant", "content": "Let me check.",
                                                       "reasoning": "Need it.", "tool_calls": [call]}])
    d = back.messages[1].as_template_dict()
    assert d["reasoning_content"] == "Need it." and "thinking" not in d


# GPT-OSS's template's rule for an assistant message with a call: its content or its thinking is the analysis before
# the call, and both at once are refused (its words); transformers copies reasoning_content into thinking
GPTOSS_CALL_RULE = (
    "{% for m in messages %}{% if m.tool_calls %}{% if m.content and m.thinking %}{{ raise_exception('Cannot pass "
    "both content and thinking in an assistant message with tool calls!') }}{% endif %}{% if m.content or "
    "m.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ m.content or m.thinking }}<|end|>{% endif %}"
    "<|start|>assistant to=functions.{{ m.tool_calls[0].function.name }}<|channel|>commentary json<|message|>"
    "{{ m.tool_calls[0].function.arguments | tojson }}<|call|>{% else %}<|start|>{{ m.role }}<|message|>"
    "{{ m.content }}<|end|>{% endif %}{% endfor %}<|start|>assistant")


def test_a_reply_with_reasoning_preamble_and_call_sent_back_renders(harmony_model):
    """The server's own harmony reply (analysis as reasoning, a commentary preamble as content, a call), sent back
    as the next turn's history, renders through GPT-OSS's rule with the reasoning as the call's analysis: it had
    been a 400 (the template refused content beside the thinking transformers made of reasoning_content)."""
    from transformers import AutoTokenizer
    from picovllm.entrypoints.openai.harmony import harmony_template_messages
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    req = ChatCompletionRequest(messages=[*ASK_TOOL, {"role": "assistant", "content": "Let me check.",
                                                      "reasoning": "Need it.", "tool_calls": [call]},
                                          {"role": "tool", "tool_call_id": "c1", "content": "Sunny"}])
    worker = TokenizerWorker(AutoTokenizer.from_pretrained(harmony_model), chat_template=GPTOSS_CALL_RULE)
    try:
        msgs = harmony_template_messages([m.as_template_dict() for m in req.messages])
        text = worker.tokenizer.decode(asyncio.run(worker.encode_chat(msgs, True)))
    finally:
        worker.shutdown()
    assert ('<|start|>assistant<|channel|>analysis<|message|>Need it.<|end|><|start|>assistant to=functions.'
            'get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|><|start|>tool<|message|>Sunny'
            in text), text
    # a call without reasoning keeps its content as the template's analysis, and other messages are as they were
    plain = [m.as_template_dict() for m in ChatCompletionRequest(messages=[*ASK_TOOL, {
        "role": "assistant", "content": "Checking.", "tool_calls": [call]}]).messages]
    assert harmony_template_messages(plain) == plain


def test_a_reply_continuing_a_prompts_message(harmony_model):
    """A prompt that ends inside a message's body (continue_final_message) leaves the reply in that message: its
    text goes where that message's channel says, markers never shown; the header is read from the prompt."""
    from transformers import AutoTokenizer
    from picovllm.entrypoints.openai.harmony import HarmonyTokens
    tok = AutoTokenizer.from_pretrained(harmony_model)
    marks = HarmonyTokens(tok)
    ids = tok.encode("<|start|>user<|message|>Hi<|end|><|start|>assistant<|channel|>final<|message|>The capital",
                     add_special_tokens=False)
    header = marks.open_header(ids)
    assert header == "assistant<|channel|>final<|message|>"
    assert marks.open_header(ids + tok.encode("<|end|>", add_special_tokens=False)) is None
    assert marks.open_header(tok.encode("<|start|>user<|message|>Hi<|end|><|start|>assistant",
                                        add_special_tokens=False)) is None
    reply = " is Paris.<|end|><|start|>assistant<|channel|>analysis<|message|>Done?<|end|>"
    assert parse_harmony(reply, None, False, header) == ("Done?", " is Paris.", [])
    analysis = "assistant<|channel|>analysis<|message|>"
    assert parse_harmony(" is Paris.", None, False, analysis) == (" is Paris.", None, [])
    # reasoning tokens (usage): an analysis body the prompt opened counts, as one the reply opens (it had counted 0)
    rest = tok.encode(" more.<|end|><|start|>assistant<|channel|>final<|message|>Paris.<|return|>",
                      add_special_tokens=False)
    assert marks.reasoning_tokens(rest, analysis) == len(tok.encode(" more.<|end|>", add_special_tokens=False))
    assert marks.reasoning_tokens(rest, header) == marks.reasoning_tokens(rest) == 0
    whole = tok.encode("<|message|> more.<|end|>", add_special_tokens=False)
    assert marks.reasoning_tokens(whole, "assistant<|channel|>analysis") == len(whole)
    # a generation prompt part way through the final header (the grammar gate's case too): the reply finishes the
    # header, and only the body is content (the markers had reached the content)
    partial = marks.open_header(tok.encode("<|start|>user<|message|>Hi<|end|><|start|>assistant<|channel|>final",
                                           add_special_tokens=False))
    assert partial == "assistant<|channel|>final"
    reply = ' <|constrain|>json<|message|>{"city": "Paris"}<|return|>'
    assert parse_harmony(reply, None, False, partial) == (None, '{"city": "Paris"}', [])
    for h in (partial, header):     # streamed in pieces of any size, the same as the whole
        for size in (1, 3, 7):
            stream = HarmonyStream(None, h)
            pieces = [stream.feed(reply[j:j + size], j + size >= len(reply)) for j in range(0, len(reply), size)]
            assert ("".join(d.content for d in pieces), "".join(d.reasoning for d in pieces)) == \
                (parse_harmony(reply, None, False, h)[1], ""), (h, size)
    with pytest.raises(ValueError):
        ChatCompletionRequest(messages=ASK, reasoning_effort="extreme")


def test_responses_reasoning_items_go_with_the_next_assistant_message():
    """A Responses input's reasoning item (as this server returns it) is the reasoning of the assistant message
    after it (GPT-OSS's template renders it before a call: the model's thread of thought between calls); a
    summary-only item, as other servers return, carries none."""
    from picovllm.entrypoints.openai.serving_responses import ResponsesRequest, chat_messages
    user = {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]}
    rs = {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Need it."}]}
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    done = {"type": "function_call_output", "call_id": "c1", "output": "Sunny"}
    msgs = chat_messages(ResponsesRequest(input=[user, rs, call, done]))
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool"] and msgs[1]["reasoning"] == "Need it."
    chat = ChatCompletionRequest(messages=msgs)
    assert chat.messages[1].as_template_dict()["thinking"] == "Need it."
    answer = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]}
    msgs = chat_messages(ResponsesRequest(input=[user, rs, answer]))
    assert msgs[1] == {"role": "assistant", "content": "Sunny.", "reasoning": "Need it."}
    msgs = chat_messages(ResponsesRequest(input=[user, {"type": "reasoning", "id": "rs_2", "summary": []}, answer]))
    assert "reasoning" not in msgs[1]
    # a reply of reasoning, a preamble and a call comes back as one assistant message, as chat returned it: the
    # reasoning then reaches GPT-OSS's template as the call's analysis (it had gone with the preamble alone, which
    # that template renders as a final answer, dropping the reasoning)
    pre = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me check."}]}
    msgs = chat_messages(ResponsesRequest(input=[user, rs, pre, call, done]))
    assert msgs[1:] == [{"role": "assistant", "content": "Let me check.", "reasoning": "Need it.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny"}]


def test_parallel_calls_sent_back_reach_a_one_call_template(harmony_model):
    """GPT-OSS's HF template renders an assistant message's first tool call only: with harmony the server splits a
    message of several calls into one a call, each followed by its result (by tool_call_id, else in order), so none
    is lost from the prompt; the first part keeps the content and reasoning."""
    from transformers import AutoTokenizer
    from picovllm.entrypoints.openai.harmony import one_call_per_message
    call = {"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    msgs = [ASK_TOOL[0], {"role": "assistant", "content": "Checking.", "tool_calls": [
        dict(call, id="a", function={"name": "get_weather", "arguments": '{"city": "Paris"}'}),
        dict(call, id="b", function={"name": "get_weather", "arguments": '{"city": "Oslo"}'})]},
        {"role": "tool", "tool_call_id": "b", "content": "Snow"}, {"role": "tool", "tool_call_id": "a", "content": "Sun"}]
    req = ChatCompletionRequest(messages=msgs)
    split = one_call_per_message([m.as_template_dict() for m in req.messages])
    assert [(m["role"], m.get("tool_calls", [{}])[0].get("id"), m["content"]) for m in split] == [
        ("user", None, ASK_TOOL[0]["content"]), ("assistant", "a", "Checking."), ("tool", None, "Sun"),
        ("assistant", "b", ""), ("tool", None, "Snow")]
    assert one_call_per_message(split) == split
    # the template's way (GPT-OSS's: the first call of each assistant message, the tool's result after it)
    first_only = ("{% for m in messages %}{% if m.tool_calls %}<|start|>assistant to=functions."
                  "{{ m.tool_calls[0].function.name }}<|channel|>commentary json<|message|>"
                  "{{ m.tool_calls[0].function.arguments | tojson }}<|call|>{% else %}<|start|>{{ m.role }}"
                  "<|message|>{{ m.content }}<|end|>{% endif %}{% endfor %}<|start|>assistant")
    tok = AutoTokenizer.from_pretrained(harmony_model)
    text = tok.apply_chat_template(split, tokenize=False, chat_template=first_only)
    assert '"Paris"' in text and '"Oslo"' in text and text.index("Sun") < text.index("Oslo") < text.index("Snow")


# -- structured outputs on a harmony model: the grammar governs the final message's body ------------------------------
def test_harmony_gate_by_hand():
    """HarmonyTags: where a prompt leaves the output (plain text: the answer; a header or another channel's body
    opened, a message ended: reasoning, part way through a final header if it ends in one; a final header, with
    vLLM's up to 20 tokens between `final` and <|message|> (`final <|constrain|>json`), or its body: the answer), and
    the final header found in the sampled tokens, false starts included. Ids by hand: <|start|> 1, <|end|> 2,
    <|message|> 3, <|channel|> 4, <|constrain|> 5, <|return|> 6, <|call|> 7; "final" 10, "analysis" 11, "json" 40."""
    from picovllm.reasoning import ANSWER, REASONING, HarmonyTags
    gate = HarmonyTags(4, (10,), 3, frozenset({1, 2, 6, 7}), frozenset(range(1, 8)))
    user, me = [1, 30, 3, 40, 41, 2], [1, 31]
    assert [gate.begin(p) for p in ([], [20, 21], user + me, user + me + [4], user + me + [4, 10],
                                    user + me + [4, 10, 5, 40], user + me + [4, 10, 3], user + me + [4, 10, 5, 40, 3, 50],
                                    user + me + [4, 11, 3, 50], user + me + [4, 10, 3, 50, 2])] == [
        (ANSWER, 0), (ANSWER, 0), (REASONING, 0), (REASONING, 1), (REASONING, 2), (REASONING, 4), (ANSWER, 0),
        (ANSWER, 0), (REASONING, 0), (REASONING, 0)]

    def phases(tokens, phase=REASONING, progress=0):
        seen = []
        for t in tokens:
            passes, phase, progress = gate.advance(phase, progress, t)
            assert passes
            seen.append(phase)
        return seen
    # analysis, a message's end, then a constrained final header (a stray <|channel|> before it)
    assert phases([4, 11, 3, 60, 2, 1, 31, 4, 4, 10, 5, 40, 3]) == [REASONING] * 12 + [ANSWER]
    assert phases([10, 5, 40, 3], progress=1) == [REASONING] * 3 + [ANSWER]      # the prompt gave <|channel|>
    assert phases([4, 10] + [40] * 21 + [3]) == [REASONING] * 24                  # past 20 tokens: not a header
    assert phases([4, 10] + [40] * 20 + [3])[-1] == ANSWER
    assert phases([4, 10, 2, 3]) == [REASONING] * 4                                # a message ended in between


def _harmony_prompt(harmony_model) -> list[int]:
    from transformers import AutoTokenizer
    return _prompt_ids(AutoTokenizer.from_pretrained(harmony_model), ASK)


def test_a_prompt_part_way_through_the_final_header(harmony_model):
    """The real tokenizer's gate (HarmonyTags.of) and a grammar's state: a prompt that ends in `<|channel|>final`
    leaves the output inside the header, so its <|message|> opens the masked answer; after the full header in the
    prompt the grammar masks from the first token; after `<|start|>assistant` nothing is masked until the header."""
    from transformers import AutoTokenizer
    from picovllm.layers.structured_output import StructuredOutputCompiler
    from picovllm.reasoning import ANSWER, REASONING, HarmonyTags
    from picovllm.sampling_params import StructuredOutputsParams
    tok = AutoTokenizer.from_pretrained(harmony_model)
    gate = HarmonyTags.of(tok, "test")
    compiler = StructuredOutputCompiler(tok, 400, tok.convert_tokens_to_ids(["<|return|>", "<|call|>"]))
    so = StructuredOutputsParams(choice=["Lyon"])
    prompt = _prompt_ids(tok, ASK)
    enc = lambda text: tok.encode(text, add_special_tokens=False)      # noqa: E731
    state = compiler.new_state(so, gate, *gate.begin(prompt + enc("<|channel|>final")))
    assert state.phase == REASONING and not state.masked
    assert state.accept(enc("<|message|>")[0]) and state.phase == ANSWER and state.masked
    state = compiler.new_state(so, gate, *gate.begin(prompt + enc("<|channel|>final<|message|>")))
    assert state.phase == ANSWER and state.masked
    state = compiler.new_state(so, gate, *gate.begin(prompt))
    assert state.phase == REASONING and all(state.accept(t) for t in enc("<|channel|>analysis<|message|>x<|end|>"))
    assert state.phase == REASONING


def test_offline_grammar_waits_for_the_final_message(harmony_model):
    """EngineConfig.reasoning_parser "openai_gptoss" (vLLM's): the trained analysis message and the final header pass
    unmasked, the final body is one of the choices (the model would say "Paris."), and only an EOS may follow it.
    Without the parser the grammar governs the whole reply (no harmony in it)."""
    from picovllm import LLM, SamplingParams
    from picovllm.sampling_params import StructuredOutputsParams
    choices = ["Lyon", "Nice"]
    params = SamplingParams(temperature=0, max_tokens=100, skip_special_tokens=False,
                            structured_outputs=StructuredOutputsParams(choice=choices))
    prompt = _harmony_prompt(harmony_model)
    head = REPLY[:REPLY.index("<|channel|>final<|message|>")] + "<|channel|>final<|message|>"
    out = LLM(harmony_model, reasoning_parser="openai_gptoss", num_kv_blocks=64).generate(
        [prompt], params, use_tqdm=False)[0].outputs[0]
    assert out.text.startswith(head) and out.text[len(head):] in choices and out.finish_reason == "stop"
    out = LLM(harmony_model, num_kv_blocks=64).generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert out.text in choices
    with pytest.raises(ValueError, match="openai_gptoss'.*no harmony markers"):
        from serving_fixtures import build_tiny_chat_model
        import tempfile
        with tempfile.TemporaryDirectory() as d:
            LLM(build_tiny_chat_model(d + "/m", vocab_size=400), reasoning_parser="openai_gptoss", num_kv_blocks=8)


def test_served_structured_output_keeps_the_reasoning(client, harmony_model):
    """Through the openai client, streamed or not, no flag: guided_choice and a json_schema response_format govern
    the final message (the analysis comes back as reasoning, the content is a choice or parses against the
    schema); a completion's grammar governs its whole output (no flag); tool_choice "required" still constrains the
    whole reply to a call (one: the tiny model, unconstrained, repeats calls to max_tokens)."""
    model = client.models.list().data[0].id
    kw = dict(model=model, messages=ASK, temperature=0, max_tokens=200)
    choices = ["Lyon", "Nice"]
    got = client.chat.completions.create(**kw, extra_body={"guided_choice": choices})
    msg = got.choices[0].message
    assert msg.model_extra["reasoning"] == THOUGHT and msg.content in choices
    reasoning, content, calls, finish, _ = _streamed(client, **kw, extra_body={"guided_choice": choices})
    assert (reasoning, content, calls, finish) == (THOUGHT, msg.content, [], "stop")
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": choices}}, "required": ["city"]}
    got = client.chat.completions.create(**kw, response_format={"type": "json_schema", "json_schema": {
        "name": "city", "schema": schema}})
    msg = got.choices[0].message
    assert msg.model_extra["reasoning"] == THOUGHT and json.loads(msg.content)["city"] in choices
    # completions without --reasoning-parser openai_gptoss (vLLM's): the grammar governs the whole output
    got = client.completions.create(model=model, prompt=_harmony_prompt(harmony_model), temperature=0, max_tokens=20,
                                    extra_body={"guided_choice": choices})
    assert got.choices[0].text in choices
    got = client.chat.completions.create(**kw, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    call = got.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)


def test_messages_that_alternate_come_out_in_the_reply_s_order():
    """A reply whose analysis, preamble, call and final messages alternate: each piece that closes one message and
    opens the next gives out their texts in that order (HarmonyDelta.parts), and the chat stream's chunks follow it,
    so the Responses items (made from them, streamed or not) are the reply's messages in order; the reasoning had
    gone out before the content of one piece (a preamble's end after the next analysis), and the response object
    had merged all reasoning into one item before all content, then the calls."""
    from picovllm.entrypoints.openai.serving_chat import ChatHandler
    reply = ("<|channel|>analysis<|message|>Think one.<|end|><|start|>assistant<|channel|>commentary<|message|>"
             "Let me see.<|end|><|start|>assistant<|channel|>analysis<|message|>Think two.<|end|><|start|>assistant"
             '<|channel|>commentary to=functions.get_weather json<|message|>{"city": "Oslo"}<|end|>'
             "<|start|>assistant<|channel|>final<|message|>Done.")
    d = HarmonyStream(policy()).feed(reply, True)
    assert [(k, w if isinstance(w, str) else calls_of([w])) for k, w in d.parts] == [
        ("reasoning", "Think one."), ("content", "Let me see."), ("reasoning", "Think two."),
        ("call", [("get_weather", {"city": "Oslo"})]), ("content", "Done.")]
    assert (d.reasoning, d.content) == ("Think one.Think two.", "Let me see.Done.")
    s = HarmonyStream(policy())
    head = reply.index("see.") + 1          # a piece that ends the preamble and carries the next analysis
    s.feed(reply[:head], False)

    class Out:      # a step's output, not the last
        finish_reason, stop_reason = None, None

    class Handler:  # the chunks' deltas alone
        def _chunk(self, rid, i, delta, *rest):
            return {"choices": [{"delta": delta}]}
    piece = reply[head:reply.index("<|end|><|start|>assistant<|channel|>commentary to=")]
    chunks = ChatHandler._harmony_chunks(Handler(), "r", 0, piece, Out(), None, s, True)
    assert [c["choices"][0]["delta"].get("content") or c["choices"][0]["delta"].get("reasoning")
            for c in chunks] == ["ee.", "Think two."]
