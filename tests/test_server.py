"""The OpenAI-compatible server in a subprocess, queried with the official openai client and raw HTTP.

Oracle: LLM.generate / LLM.chat in this process on the same weights and engine settings."""
import asyncio
import json
import random
import signal

import httpx
import openai
import pytest

from picovllm import LLM, SamplingParams
from serving_fixtures import ServerProcess, chat_model  # noqa: F401 - a fixture

ENGINE_ARGS = ["--block-size", "16", "--num-kv-blocks", "512", "--max-model-len", "256"]
PROMPTS = ["Hello, how are you", "The capital of France is", "Tell me a story about a cat",
           "Numbers: 0 1 2", "A server streams tokens"]


@pytest.fixture(scope="module")
def server(chat_model, tmp_path_factory):
    srv = ServerProcess(chat_model, str(tmp_path_factory.mktemp("log") / "server.log"), *ENGINE_ARGS,
                        "--max-request-bytes", str(2**20), "--trust-request-chat-template")
    yield srv
    assert srv.stop(signal.SIGINT) == 0, srv.log()   # SIGINT here; the lifecycle tests send SIGTERM


@pytest.fixture(scope="module")
def llm(chat_model):
    return LLM(chat_model, block_size=16, num_kv_blocks=512, max_model_len=256)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


# -- parity with the offline API ---------------------------------------------------------------------
def test_completions_match_llm_generate(client, llm):
    sp = SamplingParams(temperature=0, max_tokens=12, logprobs=2)
    ref = llm.generate(PROMPTS, sp, use_tqdm=False)
    model = client.models.list().data[0].id
    for prompt, r in zip(PROMPTS, ref):
        rc = r.outputs[0]
        got = client.completions.create(model=model, prompt=prompt, max_tokens=12,
                                        temperature=0, logprobs=2)
        c = got.choices[0]
        assert c.text == rc.text and c.finish_reason == rc.finish_reason
        assert got.usage.prompt_tokens == len(r.prompt_token_ids)
        assert got.usage.completion_tokens == len(rc.token_ids)
        assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens
        want_lp = [d[t].logprob for d, t in zip(rc.logprobs, rc.token_ids)]
        assert c.logprobs.token_logprobs == pytest.approx(want_lp, abs=1e-4)
        streamed, finish, usage = "", None, None
        for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                               stream_options={"include_usage": True}):
            if chunk.choices:
                streamed += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                usage = chunk.usage
        assert streamed == rc.text and finish == rc.finish_reason
        assert usage.completion_tokens == len(rc.token_ids) and usage.prompt_tokens == len(r.prompt_token_ids)


def test_token_id_prompt_matches(client, llm, chat_model):
    ids = [5, 17, 200, 33, 9, 101]
    ref = llm.generate([ids], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    got = client.completions.create(model=chat_model, prompt=ids, max_tokens=10, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == ref.outputs[0].text
    assert got.usage.completion_tokens == 10 and got.choices[0].finish_reason == "length"


def test_chat_matches_llm_chat(client, llm):
    model = client.models.list().data[0].id
    for conv in ([{"role": "user", "content": "Hello, how are you"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story"}]):
        r = llm.chat(conv, SamplingParams(temperature=0, max_tokens=12, logprobs=2), use_tqdm=False)[0]
        rc = r.outputs[0]
        got = client.chat.completions.create(model=model, messages=conv, max_tokens=12, temperature=0,
                                             logprobs=True, top_logprobs=2)
        c = got.choices[0]
        assert c.message.role == "assistant" and c.message.content == rc.text
        assert c.finish_reason == rc.finish_reason
        assert got.usage.prompt_tokens == len(r.prompt_token_ids)
        assert [e.logprob for e in c.logprobs.content] == pytest.approx(
            [d[t].logprob for d, t in zip(rc.logprobs, rc.token_ids)], abs=1e-4)
        assert all(len(e.top_logprobs) == 2 for e in c.logprobs.content)
        parts, roles, usage = [], [], None
        for chunk in client.chat.completions.create(model=model, messages=conv, max_tokens=12, temperature=0,
                                                    stream=True, stream_options={"include_usage": True}):
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
                roles.append(chunk.choices[0].delta.role)
            if chunk.usage:
                usage = chunk.usage
        assert "".join(parts) == rc.text and roles[0] == "assistant"
        assert usage.completion_tokens == len(rc.token_ids)


def test_stop_strings_and_seeded_sampling(client, llm):
    model = client.models.list().data[0].id
    base = llm.generate(["Tell me a story about a cat"], SamplingParams(temperature=0, max_tokens=20,
                                                                         ignore_eos=True), use_tqdm=False)[0]
    text = base.outputs[0].text
    stop = next(text[i:i + 3] for i in range(4, len(text) - 3) if text[i:i + 3].strip() and "\ufffd" not in text[i:i + 3])
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop])
    ref = llm.generate(["Tell me a story about a cat"], sp, use_tqdm=False)[0].outputs[0]
    assert ref.finish_reason == "stop" and len(ref.text) < len(text)
    kw = dict(model=model, prompt="Tell me a story about a cat", max_tokens=20, temperature=0, stop=[stop],
              extra_body={"ignore_eos": True})
    got = client.completions.create(**kw).choices[0]
    assert got.text == ref.text and got.finish_reason == "stop"
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(stream=True, **kw))
    assert streamed == ref.text   # held back text never leaks past a stop string that spans chunks
    kw["extra_body"]["include_stop_str_in_output"] = True     # vLLM's: the stop string stays, streamed or not
    kept = ref.text + ref.stop_reason
    assert client.completions.create(**kw).choices[0].text == kept
    assert "".join(ch.choices[0].text for ch in client.completions.create(stream=True, **kw)) == kept
    # seeded sampling is batch-independent, so the server reproduces the offline result
    sp = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    ref = llm.generate(["Hello, how are you"], sp, use_tqdm=False)[0].outputs[0]
    got = client.completions.create(model=model, prompt="Hello, how are you", temperature=0.9, top_p=0.95,
                                    seed=1234, max_tokens=16, extra_body={"top_k": 50, "ignore_eos": True})
    assert got.choices[0].text == ref.text


def test_penalties_and_logit_bias_match_llm(client, llm):
    """Both endpoints, streaming or not, give what LLM.generate/LLM.chat give with the same fields
    (the offline API is checked against HF's logits processors in test_penalties.py)."""
    model = client.models.list().data[0].id
    fields = dict(presence_penalty=0.5, frequency_penalty=1.2, logit_bias={"17": 3.0, "40": -100})
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.4,
                        **{**fields, "logit_bias": {17: 3.0, 40: -100}})
    prompt = "Tell me a story about a cat"
    ref = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    assert ref.token_ids != plain.token_ids
    kw = dict(model=model, max_tokens=16, temperature=0, **fields,
              extra_body={"repetition_penalty": 1.4, "ignore_eos": True})
    assert client.completions.create(prompt=prompt, **kw).choices[0].text == ref.text
    assert "".join(c.choices[0].text for c in client.completions.create(prompt=prompt, stream=True, **kw)) == ref.text
    conv = [{"role": "user", "content": "Hello, how are you"}]
    rc = llm.chat(conv, sp, use_tqdm=False)[0].outputs[0]
    assert client.chat.completions.create(messages=conv, **kw).choices[0].message.content == rc.text
    allowed = sorted(set(plain.token_ids))[:3] + [17]     # vLLM's allowed_token_ids, both endpoints
    only = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, allowed_token_ids=allowed)
    ref = llm.generate([prompt], only, use_tqdm=False)[0].outputs[0]
    assert set(ref.token_ids) <= set(allowed) and ref.token_ids != plain.token_ids
    kw = dict(model=model, max_tokens=16, temperature=0, extra_body={"allowed_token_ids": allowed, "ignore_eos": True})
    assert client.completions.create(prompt=prompt, **kw).choices[0].text == ref.text
    assert client.chat.completions.create(messages=conv, **kw).choices[0].message.content == \
        llm.chat(conv, only, use_tqdm=False)[0].outputs[0].text
    for bad, field in [({"extra_body": {"allowed_token_ids": [384]}}, "allowed_token_ids"),
                       ({"extra_body": {"allowed_token_ids": []}}, "allowed_token_ids"),
                       ({"logit_bias": {"384": 1}}, "logit_bias"), ({"logit_bias": {"a": 1}}, "logit_bias"),
                       ({"logit_bias": {"3": 101}}, "logit_bias"), ({"presence_penalty": 2.5}, "presence_penalty"),
                       ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=model, prompt=prompt, max_tokens=4, **bad)
        assert field in str(e.value), (bad, str(e.value))


def test_models_health_and_named_errors(server, client, chat_model):
    models = client.models.list().data
    assert [m.id for m in models] == [chat_model]   # served under the --model it was given
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.url + "/ping").json() == httpx.post(server.url + "/ping").json() == {"status": "ok"}
    from importlib.metadata import version
    assert httpx.get(server.url + "/version").json() == {"version": version("picovllm")}
    model = models[0].id
    with pytest.raises(openai.NotFoundError, match="'nope' does not exist") as e:     # OpenAI's and vLLM's 404
        client.completions.create(model="nope", prompt="hi")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    assert client.completions.create(model="", prompt="hi", max_tokens=1).choices     # none given: this one
    cases = [
        (dict(model=model, prompt="hi", temperature=-1), "temperature"),
        (dict(model=model, prompt="hi", top_p=0), "top_p"),
        (dict(model=model, prompt="hi", n=0), "n"),
        (dict(model=model, prompt="hi", n=65), "n"),
        (dict(model=model, prompt="hi", n=3, best_of=2), "best_of"),
        (dict(model=model, prompt="hi", n=1, best_of=2, stream=True), "best_of"),
        (dict(model=model, prompt="hi", max_tokens=0), "max_tokens"),
        (dict(model=model, prompt="hi", logprobs=21), "logprobs"),
        (dict(model=model, prompt="hi " * 400), "max_model_len"),
        (dict(model=model, prompt=[1, 2, 384]), "token ids"),
        (dict(model=model, prompt=""), "empty"),
        (dict(model=model, prompt="hi", max_tokens=4, extra_body={"min_tokens": 9}), "min_tokens"),
        (dict(model=model, prompt="hi", max_tokens=4, extra_body={"min_tokens": 2, "stop_token_ids": [5000]}),
         "stop_token_ids"),
    ]
    for kw, needle in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**kw)
        assert e.value.status_code == 400 and needle in str(e.value), (kw, str(e.value))
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=model, messages=[])
    # OpenAI's batched prompts: prompt i's n choices at i * n .., each what the prompt alone gets (greedy), usage
    # summed; a bad one refuses the request before any runs; streamed, one prompt a request
    prompts = ["Hello, how are you", "The capital of France is"]
    alone = [client.completions.create(model=model, prompt=p, max_tokens=4, temperature=0, n=2) for p in prompts]
    both = client.completions.create(model=model, prompt=prompts, max_tokens=4, temperature=0, n=2)
    assert [(c.index, c.text) for c in both.choices] == [(i * 2 + c.index, c.text) for i, r in enumerate(alone)
                                                         for c in r.choices]
    assert both.usage.prompt_tokens == sum(r.usage.prompt_tokens for r in alone)
    assert both.usage.completion_tokens == sum(r.usage.completion_tokens for r in alone)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=["hi", ""], max_tokens=4)
    assert e.value.body["param"] == "prompt"
    # streamed, as vLLM streams it: the prompts' chunks interleaved under one id, each choice's text what it is
    # unstreamed, the usage summed once at the end
    texts, ids, usages = {}, set(), []
    for chunk in client.completions.create(model=model, prompt=prompts, max_tokens=4, temperature=0, n=2,
                                           stream=True, stream_options={"include_usage": True}):
        ids.add(chunk.id)
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
        if chunk.usage is not None:
            usages.append(chunk.usage)
    assert texts == {c.index: c.text for c in both.choices} and len(ids) == 1
    assert [(u.prompt_tokens, u.completion_tokens) for u in usages] == [(both.usage.prompt_tokens,
                                                                         both.usage.completion_tokens)]
    # echo with max_tokens 0 (prompt scoring), streamed over a batch: each prompt back at its indexes
    scored = {}
    for chunk in client.completions.create(model=model, prompt=prompts, max_tokens=0, echo=True, stream=True):
        for c in chunk.choices:
            scored[c.index] = scored.get(c.index, "") + c.text
    assert scored == {0: prompts[0], 1: prompts[1]}
    with pytest.raises(openai.BadRequestError) as e:     # a bad prompt among them: refused before any streams
        client.completions.create(model=model, prompt=["a", "hi " * 400], max_tokens=4, stream=True)
    assert e.value.body["param"] == "prompt"
    r = httpx.post(server.url + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": "5"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    # the engine's refusals name the request's field: the prompt's ("messages" in chat), min_tokens with a grammar
    # (which may end before min_tokens: it would end the request in an error)
    long_chat = [{"role": "user", "content": "hi " * 400}]
    for call, kw, param in [(client.completions.create, dict(prompt="hi " * 400), "prompt"),
                            (client.completions.create, dict(prompt=""), "prompt"),
                            (client.chat.completions.create, dict(messages=long_chat), "messages"),
                            (client.chat.completions.create,
                             dict(messages=[{"role": "user", "content": "yes?"}],
                                  extra_body={"guided_choice": ["yes", "no"], "min_tokens": 3}), "min_tokens"),
                            (client.completions.create, dict(prompt="a", extra_body={"guided_regex": "x",
                                                                                     "min_tokens": 5}), "min_tokens")]:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as e:
                call(model=model, max_tokens=8, stream=stream, **kw)
            assert e.value.body["param"] == param, (kw, e.value.body)
    # more tokens than the context has room for: refused as vLLM refuses them (the offline API caps them)
    limit = httpx.get(server.url + "/v1/models").json()["data"][0]["max_model_len"]
    hi = [{"role": "user", "content": "hi"}]
    for call, kw, param in [(client.completions.create, dict(prompt="hi", max_tokens=limit), "max_tokens"),
                            (client.chat.completions.create, dict(messages=hi, max_tokens=limit), "max_tokens"),
                            (client.completions.create, dict(prompt="hi", n=2, max_tokens=limit,
                                                             extra_body={"use_beam_search": True}), "max_tokens"),
                            (client.chat.completions.create, dict(messages=hi, max_tokens=4,
                                                                  max_completion_tokens=limit), "max_completion_tokens")]:
        with pytest.raises(openai.BadRequestError) as e:
            call(model=model, **kw)
        assert e.value.body["param"] == param and "is too large" in e.value.body["message"], (kw, e.value.body)
    room = limit - len(httpx.post(server.url + "/tokenize", json={"model": model, "prompt": "hi"}).json()["tokens"])
    assert client.completions.create(model=model, prompt="hi", max_tokens=room, stop=["."]).choices   # it fits


def test_unhonoured_requests_are_refused_never_ignored(server, client):
    """What is not implemented is a 400 naming the field (streaming or not, either endpoint), never an answer
    as if it had been honoured."""
    model = client.models.list().data[0].id
    before = server.metrics()
    msgs = [{"role": "user", "content": "Answer in JSON"}]
    cases = [(dict(extra_body={"guided_decoding_backend": "outlines"}), "guided_decoding_backend"),
             (dict(extra_body={"guided_whitespace_pattern": " "}), "guided_whitespace_pattern"),
             (dict(extra_body={"functions": [{"name": "f"}]}), "functions")]
    for kw, field in cases:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model=model, messages=msgs, max_tokens=4, stream=stream, **kw)
            assert e.value.status_code == 400 and e.value.body["param"] == field, (kw, e.value.body)
            assert "not supported" in e.value.body["message"]
    # a priority without --scheduling-policy priority: refused by the engine (test_priority.py: the policy itself)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=model, prompt="hi", max_tokens=4, stream=stream,
                                      extra_body={"priority": 2})
        assert e.value.body["param"] == "priority" and "scheduling policy" in e.value.body["message"], e.value.body
    # asking for plain text, or priority 0 (FCFS's), is what the server does
    ok = client.chat.completions.create(model=model, messages=msgs, max_tokens=4, response_format={"type": "text"},
                                        extra_body={"priority": 0})
    assert ok.choices[0].finish_reason in ("stop", "length")
    after = server.wait_idle()
    assert after["picovllm:requests_total.rejected"] - before["picovllm:requests_total.rejected"] == 2 * len(cases) + 2


# Small enough for a random-weight model to finish: bounded strings, integers in ranges, enums.
PERSON = {"type": "object", "required": ["name", "age", "pets"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0,
                                                                               "maximum": 99},
                         "pets": {"type": "array", "maxItems": 2, "items": {"enum": ["cat", "dog"]}}}}


def _streamed(chunks) -> tuple[str, str]:
    text, finish = "", None
    for c in chunks:
        if c.choices:
            text += c.choices[0].delta.content or "" if hasattr(c.choices[0], "delta") else c.choices[0].text
            finish = c.choices[0].finish_reason or finish
    return text, finish


def test_structured_outputs_round_trip(server, client):
    """response_format and guided_* through the openai client, streamed and not: outputs validate against
    the schema (jsonschema), fullmatch the regex, or are one of the choices."""
    import re
    import jsonschema
    model = client.models.list().data[0].id
    msgs = [{"role": "user", "content": "Give me a person as JSON"}]
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in range(3):
        for stream in (False, True):
            kw = dict(model=model, messages=msgs, max_tokens=80, temperature=1.0, seed=seed, stream=stream)
            r = client.chat.completions.create(response_format=rf, **kw)
            text, finish = _streamed(r) if stream else (r.choices[0].message.content, r.choices[0].finish_reason)
            assert finish == "stop", text
            jsonschema.validate(json.loads(text), PERSON)
            r = client.chat.completions.create(response_format={"type": "json_object"}, **kw)
            text, finish = _streamed(r) if stream else (r.choices[0].message.content, r.choices[0].finish_reason)
            assert finish == "stop" and isinstance(json.loads(text), dict), text
            kw = dict(model=model, prompt="Pick:", max_tokens=20, temperature=1.0, seed=seed, stream=stream)
            r = client.completions.create(extra_body={"guided_choice": ["alpha", "beta", "gamma delta"]}, **kw)
            text, _ = _streamed(r) if stream else (r.choices[0].text, None)
            assert text in ("alpha", "beta", "gamma delta")
            r = client.completions.create(extra_body={"guided_regex": r"[a-c]{2}-\d{1,3}"}, **kw)
            text, _ = _streamed(r) if stream else (r.choices[0].text, None)
            assert re.fullmatch(r"[a-c]{2}-\d{1,3}", text), text
    server.wait_idle()


def test_bad_constraints_get_400_naming_the_field(server, client):
    model = client.models.list().data[0].id
    msgs = [{"role": "user", "content": "hi"}]
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}
    for kw, param in [(dict(response_format=bad_schema), "response_format.json_schema.schema"),
                      (dict(extra_body={"guided_json": "{oops"}), "guided_json"),
                      (dict(extra_body={"guided_regex": "(unclosed"}), "guided_regex"),
                      (dict(extra_body={"guided_grammar": "root ::= nothing_here"}), "guided_grammar")]:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model=model, messages=msgs, max_tokens=4, stream=stream, **kw)
            assert e.value.body["param"] == param and param in e.value.body["message"], e.value.body
    ok = client.chat.completions.create(model=model, messages=msgs, max_tokens=4)   # the server is fine
    assert ok.choices[0].finish_reason in ("stop", "length")
    server.wait_idle()


CITY_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                              "parameters": {"type": "object", "required": ["city", "days"],
                                                             "properties": {"city": {"type": "string", "maxLength": 8},
                                                                            "days": {"type": "integer", "minimum": 1,
                                                                                     "maximum": 7}}}}}
CLOCK_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}


def _streamed_tool_calls(chunks) -> tuple[list[dict], str, int]:
    """The calls as a client accumulates them from tool_calls deltas (by index), the finish reason, and how
    many tool_calls deltas came."""
    calls, finish, count = {}, None, 0
    for c in chunks:
        if not c.choices:
            continue
        for d in c.choices[0].delta.tool_calls or []:
            count += 1
            call = calls.setdefault(d.index, {"name": "", "arguments": "", "id": None})
            call["id"] = d.id or call["id"]
            call["name"] += (d.function.name or "") if d.function else ""
            call["arguments"] += (d.function.arguments or "") if d.function else ""
        finish = c.choices[0].finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish, count


@pytest.fixture(scope="module")
def tool_client(tmp_path_factory):
    """A server whose tiny model takes long prompts: its ChatML template has no tools, so they come as a
    system message of some 500 of its tokens. Its tokenizer adds a BOS token to a text (chat prompts have none)."""
    from serving_fixtures import build_tiny_chat_model
    path = build_tiny_chat_model(str(tmp_path_factory.mktemp("toolmodel") / "model"), bos=True,
                                 max_position_embeddings=2048)
    srv = ServerProcess(path, str(tmp_path_factory.mktemp("log") / "tools.log"), "--num-kv-blocks", "512",
                        "--max-model-len", "2048")
    yield srv, openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    assert srv.stop(signal.SIGINT) == 0, srv.log()


RAG = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}{% for d in documents or [] %}"
       "<doc {{ d['title'] }}>{{ d['text'] }}</doc>\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")


def test_request_chat_template_documents_and_special_tokens(server, client, llm, tool_client):
    """A request's own chat_template (on a server started with --trust-request-chat-template) and documents render as
    HF's apply_chat_template renders them (the oracle), on /tokenize and /v1/chat/completions, whose greedy reply is
    LLM.generate's on those ids; documents a template does not render, a template that does not compile, and a
    template sent to a server that does not trust them are 400s naming the field. add_special_tokens: the BOS a text
    prompt gets (on completions by default, on chat only when asked), counted against the tokenizer's encode."""
    from transformers import AutoTokenizer
    tok, model = llm.get_tokenizer(), client.models.list().data[0].id
    conv = [{"role": "user", "content": "Tell me a story about a cat"}]
    docs = [{"title": "moon", "text": "A cat lives on the moon."}]
    want = tok.encode(tok.apply_chat_template(conv, chat_template=RAG, documents=docs, tokenize=False,
                                              add_generation_prompt=True), add_special_tokens=False)
    assert "<doc moon>" in tok.decode(want)
    body = {"messages": conv, "chat_template": RAG, "documents": docs}
    assert httpx.post(server.url + "/tokenize", json=body).json()["tokens"] == want
    got = client.chat.completions.create(model=model, messages=conv, max_tokens=6, temperature=0,
                                         extra_body={"chat_template": RAG, "documents": docs, "ignore_eos": True})
    ref = llm.generate([want], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    assert got.usage.prompt_tokens == len(want) and got.choices[0].message.content == ref.outputs[0].text
    tool_server, tool_openai = tool_client
    for url, extra, param in [(server.url, {"documents": docs}, "documents"),          # ChatML renders none
                              (server.url, {"chat_template": "{% for %}"}, "chat_template"),
                              (tool_server.url, {"chat_template": RAG}, "chat_template")]:   # not trusted there
        for path in ("/tokenize", "/v1/chat/completions"):
            e = httpx.post(url + path, json={"messages": conv, "max_tokens": 2, **extra} if "chat" in path
                           else {"messages": conv, **extra})
            assert e.status_code == 400 and e.json()["error"]["param"] == param, (url, path, extra, e.text)
    bos_tok = AutoTokenizer.from_pretrained(tool_server.model)
    text = "Tell me a story about a cat"
    plain = bos_tok.encode(text, add_special_tokens=False)
    assert bos_tok.encode(text) == [bos_tok.bos_token_id] + plain
    for extra, n in [({}, len(plain) + 1), ({"add_special_tokens": False}, len(plain))]:
        r = tool_openai.completions.create(model=tool_server.model, prompt=text, max_tokens=1, extra_body=extra)
        assert r.usage.prompt_tokens == n, extra
    chat_ids = bos_tok.encode(bos_tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True),
                              add_special_tokens=False)
    for extra, n in [({}, len(chat_ids)), ({"add_special_tokens": True}, len(chat_ids) + 1)]:
        r = tool_openai.chat.completions.create(model=tool_server.model, messages=conv, max_tokens=1,
                                                extra_body=extra)
        assert r.usage.prompt_tokens == n, extra


def test_tool_calls_round_trip(tool_client):
    """Named and required tool_choice through the openai client, streamed and not: every call names a given
    tool and its arguments validate against that tool's schema (jsonschema); finish_reason is tool_calls under
    "required", stop under a named function (OpenAI's and vLLM's)."""
    import jsonschema
    server, client = tool_client
    model = client.models.list().data[0].id
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (CITY_TOOL, CLOCK_TOOL)}
    named = {"type": "function", "function": {"name": "get_time"}}
    for seed in range(3):
        for choice in (named, "required"):
            # one call: a random-weight model would otherwise add calls until max_tokens
            kw = dict(model=model, messages=msgs, tools=[CITY_TOOL, CLOCK_TOOL], tool_choice=choice,
                      max_tokens=120, temperature=1.0, seed=seed, parallel_tool_calls=False)
            r = client.chat.completions.create(**kw)
            want_finish = "stop" if choice is named else "tool_calls"
            assert r.choices[0].finish_reason == want_finish, r
            got = [{"name": c.function.name, "arguments": c.function.arguments, "id": c.id}
                   for c in r.choices[0].message.tool_calls]
            streamed, finish, count = _streamed_tool_calls(client.chat.completions.create(stream=True, **kw))
            assert finish == want_finish
            # named: the call opens (id, name), then its arguments come as they are generated (coalesced when
            # the client reads slower than the engine decodes)
            assert (count >= 2 if choice is named else count == len(streamed)), (choice, count, streamed)
            assert [(c["name"], c["arguments"]) for c in streamed] == [(c["name"], c["arguments"]) for c in got]
            for call in got + streamed:
                assert call["id"] and (choice == "required" or call["name"] == "get_time")
                jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])
    plain = client.chat.completions.create(model=model, messages=msgs, tools=[CITY_TOOL], tool_choice="none",
                                           max_tokens=8)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason in ("stop", "length")
    # auto streams its content as it comes (AutoToolStream; its calls are checked in test_tool_calls.py):
    # the pieces add up to the unstreamed reply
    kw = dict(model=model, messages=msgs, tools=[CITY_TOOL], max_tokens=24, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0]
    pieces = []        # content chunks a run; a client slower than the engine (a loaded CI machine) gets them coalesced
    for _ in range(3):
        chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kw) if c.choices]
        assert "".join(c.delta.content or "" for c in chunks) == (whole.message.content or "")
        assert chunks[-1].finish_reason == whole.finish_reason
        pieces.append(sum(bool(c.delta.content) for c in chunks))
        if pieces[-1] > 1:
            break
    assert max(pieces) > 1, pieces
    server.wait_idle()


def test_completion_echo(server, client):
    """echo: the choice's text is the prompt (as sent; token ids decoded) followed by the very completion the
    same request without echo gets (greedy), streamed or not."""
    model = client.models.list().data[0].id
    for prompt, prefix in [("The capital of France is", "The capital of France is"), ([5, 6, 7], None)]:
        kw = dict(model=model, prompt=prompt, max_tokens=8, temperature=0)
        plain = client.completions.create(**kw).choices[0].text
        if prefix is None:
            prefix = httpx.post(server.url + "/detokenize", json={"tokens": prompt}).json()["prompt"]
        assert client.completions.create(echo=True, **kw).choices[0].text == prefix + plain
        streamed = "".join(c.choices[0].text for c in client.completions.create(echo=True, stream=True, **kw)
                           if c.choices)
        assert streamed == prefix + plain
    server.wait_idle()


def test_truncate_prompt_tokens(server, client, llm):
    """vLLM's truncate_prompt_tokens: both endpoints run the prompt's last k tokens (usage counts k), as
    LLM.generate does on those ids; echo returns what is left of the prompt; k < 1 is a 400 naming the field."""
    model, tok = client.models.list().data[0].id, llm.get_tokenizer()
    prompt = "Tell me a story about a cat who lives on the moon"
    ids = tok.encode(prompt)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = llm.generate([{"prompt_token_ids": ids[-4:]}], sp, use_tqdm=False)[0].outputs[0]
    kw = dict(model=model, max_tokens=8, temperature=0, extra_body={"truncate_prompt_tokens": 4, "ignore_eos": True})
    got = client.completions.create(prompt=prompt, echo=True, **kw)
    assert got.usage.prompt_tokens == 4 and got.choices[0].text == tok.decode(ids[-4:]) + ref.text
    conv = [{"role": "user", "content": prompt}]
    chat_ids = llm.apply_chat_template(conv)
    ref = llm.generate([{"prompt_token_ids": chat_ids[-6:]}], sp, use_tqdm=False)[0].outputs[0]
    kw["extra_body"]["truncate_prompt_tokens"] = 6
    got = client.chat.completions.create(messages=conv, **kw)
    assert got.usage.prompt_tokens == 6 and got.choices[0].message.content == ref.text
    kw["extra_body"]["truncate_prompt_tokens"] = -1      # as many as the model takes: all of this one
    assert client.completions.create(prompt=prompt, **kw).usage.prompt_tokens == len(ids)
    longest = httpx.get(server.url + "/v1/models").json()["data"][0]["max_model_len"]
    for k in (0, -2, longest + 1):          # past max_model_len: vLLM's 400 too
        e = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "truncate_prompt_tokens": k})
        assert e.status_code == 400 and e.json()["error"]["param"] == "truncate_prompt_tokens"
    e = httpx.post(server.url + "/v1/chat/completions", json={"messages": conv, "truncate_prompt_tokens": longest + 1})
    assert e.status_code == 400 and "greater than max_model_len" in e.json()["error"]["message"]


def test_prompt_logprobs_and_echo_with_logprobs(server, client, llm):
    """prompt_logprobs (vLLM's field) and echo + logprobs (OpenAI's legacy completions) return what
    LLM.generate's RequestOutput.prompt_logprobs holds (itself checked against HF in test_prompt_logprobs.py)."""
    model = client.models.list().data[0].id
    prompt = [5, 6, 7, 8, 9, 10]
    ref = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, logprobs=2, prompt_logprobs=2),
                       use_tqdm=False)[0]

    def same(got):
        assert got[0] is None and len(got) == len(prompt)
        for d, want in zip(got[1:], ref.prompt_logprobs[1:]):
            assert set(d) == {str(t) for t in want}
            assert [d[str(t)]["logprob"] for t in want] == pytest.approx([lp.logprob for lp in want.values()], abs=1e-4)

    kw = dict(model=model, prompt=prompt, max_tokens=3, temperature=0)
    same(client.completions.create(extra_body={"prompt_logprobs": 2}, **kw).choices[0].prompt_logprobs)
    chunks = [c for c in client.completions.create(stream=True, extra_body={"prompt_logprobs": 2}, **kw) if c.choices]
    same(chunks[0].choices[0].prompt_logprobs)
    assert all(getattr(c.choices[0], "prompt_logprobs", None) is None for c in chunks[1:])
    for stream in (False, True):
        got = client.completions.create(echo=True, logprobs=2, stream=stream, **kw)
        choices = [c.choices[0] for c in got if c.choices] if stream else [got.choices[0]]
        tokens = [t for c in choices for t in c.logprobs.tokens]
        lps = [x for c in choices for x in c.logprobs.token_logprobs]
        assert len(tokens) == len(prompt) + 3 and lps[0] is None
        assert lps[1:len(prompt)] == pytest.approx([d[t].logprob for d, t in zip(ref.prompt_logprobs[1:], prompt[1:])],
                                                   abs=1e-4)
        assert lps[len(prompt):] == pytest.approx([d[t].logprob for d, t in zip(ref.outputs[0].logprobs,
                                                                                ref.outputs[0].token_ids)], abs=1e-4)
        assert "".join(c.text for c in choices).endswith(ref.outputs[0].text)
    # max_tokens 0 with echo (OpenAI's prompt scoring, as vLLM answers it): the prompt's logprobs only, n choices,
    # no completion token counted; without echo, a 400 naming max_tokens
    text = llm.get_tokenizer().decode(prompt)
    for stream in (False, True):
        got = client.completions.create(echo=True, logprobs=2, stream=stream, n=2,
                                        stream_options={"include_usage": True} if stream else None,
                                        **{**kw, "max_tokens": 0})
        parts = list(got) if stream else [got]
        choices = sorted((c for p in parts for c in p.choices), key=lambda c: c.index)
        assert [(c.index, c.text, c.finish_reason) for c in choices] == [(0, text, "length"), (1, text, "length")]
        lps = choices[1].logprobs.token_logprobs
        assert lps[0] is None and len(lps) == len(prompt)
        assert lps[1:] == pytest.approx([d[t].logprob for d, t in zip(ref.prompt_logprobs[1:], prompt[1:])], abs=1e-4)
        use = [p.usage for p in parts if p.usage is not None][-1]
        assert (use.prompt_tokens, use.completion_tokens) == (len(prompt), 0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**{**kw, "max_tokens": 0})
    assert e.value.body["param"] == "max_tokens"
    msgs = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model=model, messages=msgs, max_tokens=2, extra_body={"prompt_logprobs": 0})
    assert chat.prompt_logprobs[0] is None and all(len(d) == 1 for d in chat.prompt_logprobs[1:])
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=msgs, max_tokens=2, stream=True,
                                       extra_body={"prompt_logprobs": 0})
    assert e.value.body["param"] == "prompt_logprobs"
    server.wait_idle()


def test_tokens_as_ids_and_continuous_usage(server, client, llm):
    """return_tokens_as_token_ids names each logprobs token "token_id:<id>" (chosen and top ones alike), the ids
    LLM.generate samples; continuous_usage_stats puts in every chunk its choice's usage so far, which counts the
    tokens streamed until then (each token comes with one logprobs entry)."""
    model = client.models.list().data[0].id
    prompt = [5, 6, 7, 8, 9, 10]
    ref = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, logprobs=2, prompt_logprobs=2),
                       use_tqdm=False)[0]
    out = ref.outputs[0]
    names = [f"token_id:{t}" for t in out.token_ids]
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, logprobs=2)
    kw = dict(model=model, prompt=prompt, max_tokens=6, temperature=0, logprobs=2,
              extra_body={"return_tokens_as_token_ids": True})
    for stream in (False, True):
        got = client.completions.create(stream=stream, **kw)
        choices = [c.choices[0] for c in got if c.choices] if stream else [got.choices[0]]
        lp = [c.logprobs for c in choices if c.logprobs is not None]
        assert [t for x in lp for t in x.tokens] == names
        tops = [d for x in lp for d in x.top_logprobs]
        assert [set(d) for d in tops] == [{f"token_id:{t}" for t in step} for step in out.logprobs]
        assert [d[f"token_id:{t}"] for d, t in zip(tops, out.token_ids)] == pytest.approx(
            [step[t].logprob for step, t in zip(out.logprobs, out.token_ids)], abs=1e-4)
        # offsets still count characters of the text
        assert [o for x in lp for o in x.text_offset] == plain.choices[0].logprobs.text_offset
    echoed = client.completions.create(echo=True, **kw).choices[0].logprobs
    assert echoed.tokens == [f"token_id:{t}" for t in prompt] + names
    assert set(echoed.top_logprobs[1]) == {f"token_id:{t}" for t in ref.prompt_logprobs[1]}

    msgs = [{"role": "user", "content": "Say something"}]
    chat_ref = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=6, logprobs=2), use_tqdm=False)[0].outputs[0]
    got = client.chat.completions.create(model=model, messages=msgs, max_tokens=6, temperature=0, logprobs=True,
                                         top_logprobs=2, extra_body={"return_tokens_as_token_ids": True})
    content = got.choices[0].logprobs.content
    assert [c.token for c in content] == [f"token_id:{t}" for t in chat_ref.token_ids]
    assert all(c.bytes == list(c.token.encode()) for c in content)
    for c, step in zip(content, chat_ref.logprobs):
        best = sorted((lp.rank, t) for t, lp in step.items() if lp.rank <= 2)
        assert [x.token for x in c.top_logprobs] == [f"token_id:{t}" for _, t in best]

    prompt_len = len(llm.apply_chat_template(msgs))
    opts = {"include_usage": True, "continuous_usage_stats": True}
    for endpoint in ("chat", "completions"):
        if endpoint == "chat":
            chunks = list(client.chat.completions.create(model=model, messages=msgs, max_tokens=6, n=2, stream=True,
                                                         logprobs=True, stream_options=opts,
                                                         extra_body={"ignore_eos": True}))   # 6 tokens each
            counted = lambda ch: len(ch.logprobs.content) if ch.logprobs else 0          # noqa: E731
            plen = prompt_len
        else:
            chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=6, n=2, stream=True,
                                                    logprobs=0, stream_options=opts, extra_body={"ignore_eos": True}))
            counted = lambda ch: len(ch.logprobs.tokens) if ch.logprobs else 0           # noqa: E731
            plen = len(prompt)
        *streamed, final = chunks
        assert not final.choices and final.usage.completion_tokens == 12
        seen = {0: 0, 1: 0}
        for ch in streamed:
            (choice,) = ch.choices
            seen[choice.index] += counted(choice)
            assert ch.usage.prompt_tokens == plen, endpoint
            assert ch.usage.completion_tokens == seen[choice.index], (endpoint, ch)
            assert ch.usage.total_tokens == plen + seen[choice.index]
        assert seen == {0: 6, 1: 6}
    # echo with max_tokens 0 (prompt scoring) too: each choice's chunk carries its prompt's usage, no completion token
    *streamed, final = client.completions.create(model=model, prompt=[prompt, prompt[:3]], max_tokens=0, echo=True,
                                                 n=2, stream=True, stream_options=opts)
    assert [(c.choices[0].index, c.usage.prompt_tokens, c.usage.completion_tokens) for c in streamed] == [
        (0, 6, 0), (1, 6, 0), (2, 3, 0), (3, 3, 0)]
    assert not final.choices and (final.usage.prompt_tokens, final.usage.completion_tokens) == (9, 0)
    # without include_usage it does nothing, as vLLM's; a non-boolean value is a 400 naming it
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=2, stream=True,
                                            stream_options={"continuous_usage_stats": True}))
    assert all(c.usage is None for c in chunks)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=prompt, max_tokens=2, stream=True,
                                  stream_options={"include_usage": True, "continuous_usage_stats": "yes"})
    assert e.value.body["param"] == "stream_options" and "continuous_usage_stats" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:      # not streamed: refused, as vLLM and OpenAI refuse it
        client.completions.create(model=model, prompt=prompt, max_tokens=2, stream_options={"include_usage": True})
    assert e.value.body["param"] == "stream_options" and "stream: true" in e.value.body["message"]
    server.wait_idle()


def test_spaces_between_special_tokens_as_hf_decodes(server, client, llm):
    """Adjacent special tokens in the text (skip_special_tokens: false): both values of the flag give what HF's
    tokenizer.decode gives with it (a fast tokenizer puts no space there either way)."""
    model = client.models.list().data[0].id
    tok = llm.get_tokenizer()
    special = tok.convert_tokens_to_ids("<|im_start|>")
    for flag in (True, False):
        got = client.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0, logprobs=0,
                                        extra_body={"skip_special_tokens": False, "ignore_eos": True,
                                                    "logit_bias": {str(special): 100},
                                                    "spaces_between_special_tokens": flag,
                                                    "return_tokens_as_token_ids": True}).choices[0]
        ids = [int(t.split(":")[1]) for t in got.logprobs.tokens]
        assert ids == [special] * 3
        assert got.text == tok.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=flag)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="Hello", max_tokens=1,
                                  extra_body={"spaces_between_special_tokens": "no"})
    assert e.value.body["param"] == "spaces_between_special_tokens"


def test_beam_search_served_as_llm_beam_search(server, client, llm):
    """use_beam_search on both endpoints equals LLM.beam_search (itself checked against a float64 beam search over
    HF's logits in test_beam_search.py); what beam search does not honour is a 400 naming the field."""
    from picovllm import BeamSearchParams
    model = client.models.list().data[0].id
    want = llm.beam_search(["Once upon a time"], BeamSearchParams(beam_width=3, max_tokens=8,
                                                                  length_penalty=0.5))[0].sequences
    got = client.completions.create(model=model, prompt="Once upon a time", n=3, max_tokens=8,
                                    extra_body={"use_beam_search": True, "length_penalty": 0.5})
    assert [c.text for c in got.choices] == [b.text for b in want] and len(set(b.text for b in want)) > 1
    assert [c.finish_reason for c in got.choices] == [b.finish_reason for b in want]
    assert got.usage.completion_tokens == sum(len(b.output_token_ids) for b in want)
    conv = [{"role": "user", "content": "Tell me a story about a cat"}]
    want = llm.beam_search([llm.apply_chat_template(conv)], BeamSearchParams(beam_width=2, max_tokens=6))[0]
    got = client.chat.completions.create(model=model, messages=conv, n=2, max_tokens=6, temperature=0,
                                         top_p=1, extra_body={"use_beam_search": True})     # defaults are fine
    assert [c.message.content for c in got.choices] == [b.text for b in want.sequences]
    for kw, field in [(dict(top_p=0.5), "top_p"), (dict(logprobs=2), "logprobs"), (dict(stream=True), "stream"),
                      (dict(temperature=0.8), "temperature"), (dict(stop=["x"]), "stop"),
                      (dict(extra_body={"guided_choice": ["a", "b"]}), "guided_choice")]:
        extra = {"use_beam_search": True, **kw.pop("extra_body", {})}
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=model, prompt="Hi", n=2, max_tokens=4, extra_body=extra, **kw)
        assert e.value.body["param"] == field, (field, e.value.body)
    server.wait_idle()


def test_bad_words_served_as_llm_generate(server, client, llm):
    """bad_words (checked against HF in test_bad_words.py) reach the engine from both endpoints, streamed or not;
    what cannot be honoured with them is a 400 naming the field."""
    model = client.models.list().data[0].id
    tok = llm.get_tokenizer()

    def effective_words(generate):
        """A word of the plain greedy output whose ban changes that output, and the output under the ban."""
        plain = generate(SamplingParams(temperature=0, max_tokens=10))
        for t in plain.token_ids[1:]:
            word = tok.decode([t])
            if word.strip() and "\ufffd" not in word:
                got = generate(SamplingParams(temperature=0, max_tokens=10, bad_words=[word]))
                if got.token_ids != plain.token_ids:
                    return [word], got
        raise AssertionError("no word of the output changes it when banned")

    prompt, msgs = "The capital of France is", [{"role": "user", "content": "Hello"}]
    words, ref = effective_words(lambda sp: llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0])
    for stream in (False, True):
        got = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0,
                                        stream=stream, extra_body={"bad_words": words})
        assert (_streamed(got)[0] if stream else got.choices[0].text) == ref.text
    words, ref = effective_words(lambda sp: llm.chat(msgs, sp, use_tqdm=False)[0].outputs[0])
    got = client.chat.completions.create(model=model, messages=msgs, max_tokens=10, temperature=0,
                                         extra_body={"bad_words": words})
    assert got.choices[0].message.content == ref.text
    for extra in ({"bad_words": ["x"], "guided_choice": ["a", "b"]}, {"bad_words": ["x"], "allowed_token_ids": [5]},
                  {"bad_words": [""]}, {"bad_words": "x"}):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=model, prompt="Hi", max_tokens=2, extra_body=extra)
        assert e.value.body["param"] == "bad_words", (extra, e.value.body)
    server.wait_idle()


def test_n_samples_and_best_of(server, client, llm):
    """n seeded samples equal LLM.generate's (sample i: seed + i), streamed or not, on both endpoints;
    best_of returns the samples with the highest cumulative logprob."""
    model = client.models.list().data[0].id
    prompt = "Tell me a story about a cat"
    sp = SamplingParams(n=3, temperature=1.0, seed=21, max_tokens=10, ignore_eos=True, logprobs=0)
    ref = llm.generate([prompt], sp, use_tqdm=False)[0].outputs
    assert len({r.text for r in ref}) == 3
    kw = dict(model=model, prompt=prompt, n=3, temperature=1.0, seed=21, max_tokens=10, extra_body={"ignore_eos": True})
    got = client.completions.create(**kw)
    assert [(c.index, c.text) for c in got.choices] == [(i, r.text) for i, r in enumerate(ref)]
    assert got.usage.completion_tokens == 30 and got.usage.prompt_tokens == len(llm.get_tokenizer().encode(prompt))
    texts, finishes, usage = [""] * 3, [None] * 3, None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
            finishes[c.index] = c.finish_reason or finishes[c.index]
        usage = chunk.usage or usage
    assert texts == [r.text for r in ref] and finishes == ["length"] * 3 and usage.completion_tokens == 30
    best = sorted(ref, key=lambda r: -r.cumulative_logprob)[:2]
    got = client.completions.create(best_of=3, **dict(kw, n=2))
    assert [c.text for c in got.choices] == [r.text for r in best] and got.usage.completion_tokens == 30
    assert [c.index for c in got.choices] == [0, 1] and got.choices[0].logprobs is None
    conv = [{"role": "user", "content": "Hello, how are you"}]
    ref = llm.chat(conv, SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=8), use_tqdm=False)[0].outputs
    ckw = dict(model=model, messages=conv, n=2, temperature=1.0, seed=5, max_tokens=8)
    got = client.chat.completions.create(**ckw)
    assert [c.message.content for c in got.choices] == [r.text for r in ref]
    parts, roles = ["", ""], [None, None]
    for chunk in client.chat.completions.create(stream=True, **ckw):
        for c in chunk.choices:
            parts[c.index] += c.delta.content or ""
            roles[c.index] = roles[c.index] or c.delta.role
    assert parts == [r.text for r in ref] and roles == ["assistant"] * 2
    with client.completions.create(stream=True, **dict(kw, max_tokens=200)) as stream:   # hang up early
        next(iter(stream))
    server.wait_idle()                       # every sample aborted, every block free


def test_tokenize_and_detokenize(server, client, llm):
    """The ids /tokenize gives are the ids the generation endpoints run (their usage counts them), and
    the tokenizer's own encode/decode (what LLM.generate/LLM.chat use) is the oracle."""
    tok = llm.get_tokenizer()
    model = client.models.list().data[0].id
    text = "Tell me a story about a cat"
    r = httpx.post(server.url + "/tokenize", json={"model": model, "prompt": text}).json()
    assert r == {"count": len(tok.encode(text)), "max_model_len": 256, "tokens": tok.encode(text), "token_strs": None}
    assert client.completions.create(model=model, prompt=text, max_tokens=1).usage.prompt_tokens == r["count"]
    r = httpx.post(server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False,
                                                   "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode(text, add_special_tokens=False)
    assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    r = httpx.post(server.url + "/tokenize", json={"messages": conv}).json()
    assert r["tokens"] == llm.apply_chat_template(conv) and r["count"] == len(r["tokens"])
    assert client.chat.completions.create(model=model, messages=conv, max_tokens=1).usage.prompt_tokens == r["count"]
    r2 = httpx.post(server.url + "/tokenize", json={"messages": conv, "add_generation_prompt": False}).json()
    assert r2["tokens"] == llm.apply_chat_template(conv, add_generation_prompt=False) != r["tokens"]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    rt = httpx.post(server.url + "/tokenize", json={"messages": conv, "tools": tools}).json()   # as chat renders them
    assert rt["tokens"] == llm.apply_chat_template(conv, tools=tools) != r["tokens"]
    long = httpx.post(server.url + "/v1/chat/completions", json={"messages": conv, "tools": tools, "max_tokens": 1})
    assert f"prompt is {rt['count']} tokens" in long.json()["error"]["message"]     # past this server's 256: the count
    d = httpx.post(server.url + "/detokenize", json={"model": model, "tokens": r["tokens"]}).json()
    assert d == {"prompt": tok.decode(r["tokens"], skip_special_tokens=False)} and "<|im_start|>" in d["prompt"]
    ids = tok.encode(text)
    assert httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["prompt"] == text
    for path, body, param in [("/tokenize", {"prompt": "a", "messages": conv}, "prompt"), ("/tokenize", {}, "prompt"),
                              ("/tokenize", {"messages": conv, "chat_template": "x"}, "chat_template"),
                              ("/tokenize", {"prompt": "a", "tools": tools}, "tools"),
                              ("/tokenize", {"messages": conv, "tools": tools * 2}, "tools"),
                              ("/detokenize", {"tokens": [1, 384]}, "tokens"), ("/detokenize", {"tokens": [-1]}, "tokens")]:
        e = httpx.post(server.url + path, json=body)
        assert e.status_code == 400 and e.json()["error"]["param"] == param, (path, body, e.text)
    e = httpx.post(server.url + "/tokenize", json={"prompt": "a", "model": "nope"})
    assert e.status_code == 404 and e.json()["error"]["code"] == "model_not_found"


def test_chat_template_options(server, client, llm):
    """chat_template_kwargs reach the template and continue_final_message leaves the last message open, on /tokenize
    and /v1/chat/completions alike, as HF's apply_chat_template renders them (the oracle) and as LLM.chat runs them;
    a bad combination is a 400 naming the field."""
    model = client.models.list().data[0].id
    tok = llm.get_tokenizer()
    conv = [{"role": "user", "content": "Tell me a story about a cat"}]
    cont = conv + [{"role": "assistant", "content": "The cat"}]

    def hf(c, **kw):
        return tok.encode(tok.apply_chat_template(c, tokenize=False, **kw), add_special_tokens=False)

    def ids(body):
        return httpx.post(server.url + "/tokenize", json=body).json()["tokens"]

    no_think = ids({"messages": conv, "chat_template_kwargs": {"enable_thinking": False}})
    assert no_think == hf(conv, add_generation_prompt=True, enable_thinking=False) != ids({"messages": conv})
    open_end = ids({"messages": cont, "add_generation_prompt": False, "continue_final_message": True})
    assert open_end == hf(cont, add_generation_prompt=False, continue_final_message=True)
    assert tok.decode(open_end).endswith("The cat")
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for kw in ({"chat_template_kwargs": {"enable_thinking": False}},
               {"add_generation_prompt": False, "continue_final_message": True}):
        msgs = cont if kw.get("continue_final_message") else conv
        got = client.chat.completions.create(model=model, messages=msgs, max_tokens=6, temperature=0,
                                             extra_body=dict(kw, ignore_eos=True))
        want = llm.chat(msgs, sp, use_tqdm=False, **kw)[0]
        assert got.choices[0].message.content == want.outputs[0].text
        assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    for body, param in [({"messages": cont, "continue_final_message": True}, "continue_final_message"),
                        ({"messages": conv, "add_generation_prompt": False, "continue_final_message": True},
                         "continue_final_message"),
                        ({"messages": conv, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
                        ({"messages": conv, "chat_template_kwargs": ["x"]}, "chat_template_kwargs")]:
        for path in ("/tokenize", "/v1/chat/completions"):
            e = httpx.post(server.url + path, json=dict(body, max_tokens=2) if "chat" in path else body)
            assert e.status_code == 400 and e.json()["error"]["param"] == param, (path, body, e.text)
    e = httpx.post(server.url + "/tokenize", json={"prompt": "a", "continue_final_message": True})
    assert e.status_code == 400 and e.json()["error"]["param"] == "continue_final_message"
    # echo: a continued assistant message leads each choice's content (streamed: after the role's chunk); a reply
    # to a user's message echoes nothing
    want = llm.chat(cont, sp, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    kw = dict(model=model, messages=cont, max_tokens=6, temperature=0,
              extra_body={"ignore_eos": True, "echo": True, "add_generation_prompt": False,
                          "continue_final_message": True})
    assert client.chat.completions.create(**kw).choices[0].message.content == "The cat" + want.outputs[0].text
    parts = [ch.choices[0].delta.content or "" for ch in client.chat.completions.create(stream=True, **kw)]
    assert parts[1] == "The cat" and "".join(parts) == "The cat" + want.outputs[0].text
    plain = llm.chat(conv, sp, use_tqdm=False)[0].outputs[0].text
    got = client.chat.completions.create(model=model, messages=conv, max_tokens=6, temperature=0,
                                         extra_body={"ignore_eos": True, "echo": True})
    assert got.choices[0].message.content == plain


def test_oversize_bodies_rejected(server):
    big = json.dumps({"prompt": "x" * (2**20 + 10)}).encode()
    r = httpx.post(server.url + "/v1/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]

    def chunks():   # no Content-Length: the limit applies as the body streams in
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536]
    r = httpx.post(server.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"


def test_nonstreaming_client_that_hangs_up_aborts_its_request(tmp_path):
    """A server of its own, whose 32k positions give a request far more than the client's 50 ms: the module's 256
    positions ran a whole 250-token request inside them on a fast CPU."""
    from serving_fixtures import build_tiny_chat_model
    model = build_tiny_chat_model(str(tmp_path / "model"), max_position_embeddings=32768)
    srv = ServerProcess(model, str(tmp_path / "server.log"), "--block-size", "16", "--num-kv-blocks", "4096",
                        "--max-model-len", "32768")
    try:
        before = srv.metrics()
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/completions", timeout=httpx.Timeout(10, read=0.05),
                       json={"model": model, "prompt": "hi", "max_tokens": 30000, "ignore_eos": True})
        after = srv.wait_idle()
    finally:
        srv.stop()
    assert after["picovllm:requests_total.abort"] - before["picovllm:requests_total.abort"] == 1
    assert after["picovllm:requests_total.length"] == before["picovllm:requests_total.length"]


# -- load: 200 concurrent streams, a third of them hanging up early -----------------------------------
def test_200_concurrent_streams_with_disconnects(server, llm):
    ids = [[(7 * i + j) % 380 + 3 for j in range(5 + i % 7)] for i in range(10)]
    ref = [o.outputs[0].text for o in llm.generate(ids, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                                    use_tqdm=False)]
    before = server.metrics()
    url = server.url + "/v1/completions"

    async def one(client, i):
        leaver = i % 3 == 0
        body = {"prompt": ids[i % 10], "max_tokens": 200 if leaver else 8, "temperature": 0, "stream": True,
                "ignore_eos": True}
        text, finish = "", None
        async with client.stream("POST", url, json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                ch = json.loads(line[6:])
                text += ch["choices"][0]["text"]
                finish = ch["choices"][0]["finish_reason"] or finish
                if leaver and ch["choices"][0]["text"]:
                    return None        # hang up mid-stream: closes the connection
        return i, text, finish

    async def health_during(client, stop):
        worst = 0.0
        while not stop.is_set():
            t = asyncio.get_running_loop().time()
            r = await client.get(server.url + "/health")
            assert r.status_code == 200
            worst = max(worst, asyncio.get_running_loop().time() - t)
            await asyncio.sleep(0.2)
        return worst

    async def main():
        limits = httpx.Limits(max_connections=300, max_keepalive_connections=300)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client, \
                httpx.AsyncClient(timeout=30) as probe:
            stop = asyncio.Event()
            watcher = asyncio.create_task(health_during(probe, stop))
            results = await asyncio.gather(*(one(client, i) for i in range(200)))
            stop.set()
            return results, await watcher

    results, worst_health = asyncio.run(main())
    done = [r for r in results if r is not None]
    assert len(done) == 200 - len(range(0, 200, 3))
    for i, text, finish in done:
        assert finish == "length" and text == ref[i % 10]
    assert worst_health < 10.0
    after = server.wait_idle()
    aborted = after["picovllm:requests_total.abort"] - before["picovllm:requests_total.abort"]
    length = after["picovllm:requests_total.length"] - before["picovllm:requests_total.length"]
    # every leaver aborted, unless the engine had generated its 200 tokens before the server saw the hang-up (on a
    # loaded host the first chunk written can hold them all: it then ends as "length"); nothing else aborted
    leavers = len(range(0, 200, 3))
    assert aborted + length == 200 and length >= len(done) and aborted >= leavers // 2, (aborted, length)


# -- fuzz: hostile bodies never get a 5xx and never hurt the server -----------------------------------
def hostile(rng: random.Random, depth: int = 0):
    kinds = ["bigint", "negint", "float", "inf", "str", "hugestr", "bool", "null", "list", "dict", "unicode", "zero"]
    k = rng.choice(kinds if depth < 3 else kinds[:8])
    return {"bigint": lambda: rng.choice([2**63, 2**64 + 1, 10**30, 10**300]),
            "negint": lambda: -rng.choice([1, 2, 2**31, 10**40]),
            "float": lambda: rng.choice([0.5, -0.0, 1e-300, 3.7, -2.5, 1e308]),
            "inf": lambda: rng.choice([1e309, -1e309]),          # json.dumps writes Infinity
            "str": lambda: rng.choice(["", "1", "true", "null", "gpt-4", "\x00", "-1"]),
            "hugestr": lambda: "A" * rng.choice([10**4, 10**5]),
            "bool": lambda: rng.choice([True, False]),
            "null": lambda: None,
            "list": lambda: [hostile(rng, depth + 1) for _ in range(rng.randint(0, 4))],
            "dict": lambda: {rng.choice(["a", "role", "content", "text", "type"]): hostile(rng, depth + 1)
                             for _ in range(rng.randint(0, 3))},
            "unicode": lambda: "".join(chr(rng.choice([0xD800, 0xDFFF, 0x1F600, 0x202E, 0xFFFD, 0x10FFFF]))
                                       for _ in range(rng.randint(1, 50))),
            "zero": lambda: 0}[k]()


def valid_body(rng: random.Random, chat: bool, model: str) -> dict:
    body = {"model": model, "max_tokens": rng.randint(1, 6), "temperature": rng.choice([0, 0.7, 1.0]),
            "stream": rng.random() < 0.5}
    if chat:
        body["messages"] = [{"role": "user", "content": rng.choice(PROMPTS)}]
    else:
        body["prompt"] = rng.choice(PROMPTS + [[1, 2, 3, 4]])
    for k, v in [("top_p", 0.9), ("top_k", 5), ("seed", 3), ("stop", ["a"]), ("logprobs", 2 if not chat else True),
                 ("stream_options", {"include_usage": True})]:
        if rng.random() < 0.3 and (k != "stream_options" or body["stream"]):     # stream_options: streams only
            body[k] = v
    return body


def fuzz_cases(schema: dict, model: str, n: int, seed: int = 0) -> list[tuple[str, bytes, str]]:
    """(path, body bytes, content-type): schema-guided field mutations plus raw junk."""
    rng = random.Random(seed)
    comps = schema["components"]["schemas"]
    fields = {"/v1/completions": list(comps["CompletionRequest"]["properties"]),
              "/v1/chat/completions": list(comps["ChatCompletionRequest"]["properties"])}
    assert {"prompt", "max_tokens", "temperature", "logprobs"} <= set(fields["/v1/completions"])
    raw = [b"", b"{", b"nonsense", b"[]", b"123", b'"str"', b"null", b'{"prompt": NaN}', b'{"prompt": "a",}',
           b"\xff\xfe\xfa", b"[" * 50000 + b"]" * 50000, b'{"prompt": ' + b"9" * 5000 + b"}",
           b'{"prompt": "hi", "max_tokens": 1e999}', b'{"messages": {"role": "user"}}', b"\x00" * 100,
           b'{"prompt": "a\\ud800b"}', b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
           b'{"prompt": "hi", "model": "\\ud800"}']
    cases = []
    for i in range(n):
        path = rng.choice(list(fields))
        chat = path.endswith("chat/completions")
        if i < len(raw) * 2:
            cases.append((path, raw[i % len(raw)], "application/json" if i < len(raw) else "text/plain"))
            continue
        body = valid_body(rng, chat, model)
        for _ in range(rng.choice([0, 1, 1, 2, 3])):
            r = rng.random()
            if r < 0.7:
                body[rng.choice(fields[path])] = hostile(rng)
            elif r < 0.85 and body:
                body.pop(rng.choice(list(body)))
            elif chat:
                body["messages"] = [{"role": hostile(rng), "content": hostile(rng)}]
            else:
                body["prompt"] = [hostile(rng) for _ in range(rng.randint(0, 3))]
        cases.append((path, json.dumps(body).encode(), "application/json"))
    return cases


def test_fuzz_hostile_bodies(server):
    schema = httpx.get(server.url + "/openapi.json").json()
    model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    cases = fuzz_cases(schema, model, 520)
    statuses: dict[int, int] = {}
    before = server.metrics()

    async def send(client, sem, path, body, ctype):
        async with sem:
            async with client.stream("POST", server.url + path, content=body,
                                     headers={"content-type": ctype}) as r:
                data = await r.aread()
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code < 500, (path, body[:300], data[:300])
        if r.status_code != 200:
            err = json.loads(data)["error"]
            assert err["message"] and err["type"], data[:300]
        elif b"data:" in data[:10]:
            assert b'"error"' not in data and data.rstrip().endswith(b"data: [DONE]"), data[-300:]
        else:
            assert json.loads(data)["choices"][0]["finish_reason"] in ("stop", "length")

    async def main():
        sem = asyncio.Semaphore(8)
        async with httpx.AsyncClient(timeout=120) as client:
            await asyncio.gather(*(send(client, sem, *c) for c in cases))

    asyncio.run(main())
    assert statuses.get(400, 0) > 250 and statuses.get(200, 0) > 30, statuses
    assert set(statuses) <= {200, 400, 404}, statuses     # 404: a model name this server does not serve
    assert httpx.get(server.url + "/health").status_code == 200
    after = server.wait_idle()
    assert after["picovllm:requests_total.rejected"] - before["picovllm:requests_total.rejected"] == \
        statuses[400] + statuses.get(404, 0)
    finished = sum(after[f"picovllm:requests_total.{o}"] - before[f"picovllm:requests_total.{o}"]
                   for o in ("stop", "length", "abort", "error"))
    assert finished == statuses[200]


# -- the online benchmark against this server ---------------------------------------------------------
def test_bench_serve_writes_report_and_plot(server, tmp_path):
    import os
    import subprocess
    import sys

    out_json, out_png = tmp_path / "bench.json", tmp_path / "itl.png"
    before = server.metrics()
    cmd = [sys.executable, "-m", "picovllm.entrypoints.cli", "bench", "serve", "--base-url", server.url,
           "--dataset", "random", "--num-prompts", "12", "--request-rate", "30", "--burstiness", "0.5",
           "--input-len", "16", "--output-len", "6", "--goodput", "ttft:60000", "tpot:60000",
           "--result-json", str(out_json), "--plot", str(out_png)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([os.getcwd()] + sys.path))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Serving Benchmark Result" in proc.stdout
    s = json.loads(out_json.read_text())
    assert s["completed"] == 12 and s["failed"] == 0
    assert s["total_input_tokens"] == 12 * 16 and s["total_output_tokens"] == 12 * 6   # ignore_eos: exact
    after = server.metrics()   # the server saw exactly that work

    def delta(name):
        return after[name] - before[name]

    assert delta("picovllm:requests_total.length") == 12
    assert delta("picovllm:time_to_first_token_seconds_count") == 12
    assert delta("picovllm:e2e_request_latency_seconds_count") == 12
    assert delta("picovllm:inter_token_latency_seconds_count") == 12 * 5       # 6 tokens: 5 gaps each
    assert delta("picovllm:decode_tokens_total") == 12 * 5                      # token 1 comes from prefill
    assert delta("picovllm:prefill_tokens_total") + delta("picovllm:prefix_cache_hits_total") == 12 * 16
    assert delta("picovllm:prefix_cache_queries_total") == 12 * 16
    for m in ("ttft", "tpot", "itl", "e2el"):
        assert 0 <= s[f"median_{m}_ms"] <= s[f"p90_{m}_ms"] <= s[f"p99_{m}_ms"]
        assert m == "itl" or s[f"median_{m}_ms"] > 0     # (tokens a loaded machine coalesces arrive 0 ms apart)
    assert s["mean_e2el_ms"] >= s["mean_ttft_ms"]
    assert s["request_goodput"] == pytest.approx(s["request_throughput"])   # SLOs generous enough for all
    assert s["request_throughput"] == pytest.approx(12 / s["duration"])
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out_png.stat().st_size > 5000


def test_bench_serve_workers_share_one_schedule(server, tmp_path):
    """--num-workers N: N client processes send the one workload (the same prompts as one client, from the seed),
    each request at its own time of the common schedule; the report merges them in the workload's order."""
    import itertools
    import os
    import subprocess
    import sys
    import time
    from picovllm.bench.serve import arrival_gaps, random_dataset

    n, rate, seed = 12, 20.0, 3
    runs = {}
    for workers in (1, 3):
        out = tmp_path / f"w{workers}.json"
        cmd = [sys.executable, "-m", "picovllm.entrypoints.cli", "bench", "serve", "--base-url", server.url,
               "--num-prompts", str(n), "--request-rate", str(rate), "--input-len", "8", "--random-range-ratio", "0.5",
               "--output-len", "4", "--seed", str(seed), "--num-workers", str(workers), "--result-json", str(out)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([os.getcwd()] + sys.path))
        before = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        runs[workers] = json.loads(out.read_text())
        # the common start as a wall time (server-side logs line up with it), within the command's run
        assert before < runs[workers]["start_time"] < time.time() - runs[workers]["duration"]
    vocab = httpx.get(server.url + "/v1/models").json()["data"][0]["vocab_size"]
    rng = random.Random(seed)
    want = random_dataset(n, 8, 4, 0.5, vocab, rng)
    due = list(itertools.accumulate(arrival_gaps(n, rate, 1.0, rng)))
    for s in runs.values():
        assert s["completed"] == n and s["failed"] == 0
        assert s["total_output_tokens"] == sum(r.output_len for r in want)   # ignore_eos: exact
        assert [r["prompt_len"] for r in s["requests"]] == [len(r.prompt) for r in want]
        assert all(abs(r["start"] - d) < 0.25 for r, d in zip(s["requests"], due)), [r["start"] for r in s["requests"]]
    assert runs[3]["config"]["num_workers"] == 3
    server.wait_idle()


def test_bench_serve_reports_the_servers_prefix_cache_hits_and_plan_warns(server, tmp_path):
    """bench serve records the share of its prompt tokens the servers took from their prefix cache (their counters
    before and after): a run that repeats an earlier run's prompts (the same seed) is almost all hits, by hand
    ((40 - 1) // 16 = 2 full blocks of each 40-token prompt), a run of new prompts none; `picovllm plan --measured`
    warns of the first, whose TTFT the simulation (no prefix cache) cannot predict, and not of the second."""
    import os
    import subprocess
    import sys
    from picovllm.planner.profile import StepProfile

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([os.getcwd()] + sys.path))
    runs = []
    for k, seed in enumerate((11, 11, 12)):
        out = tmp_path / f"run{k}.json"
        before = server.metrics()
        cmd = [sys.executable, "-m", "picovllm.entrypoints.cli", "bench", "serve", "--base-url", server.url,
               "--num-prompts", "6", "--request-rate", "50", "--input-len", "40", "--output-len", "3",
               "--seed", str(seed), "--result-json", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        after = server.metrics()
        s = json.loads(out.read_text())
        hits = after["picovllm:prefix_cache_hits_total"] - before["picovllm:prefix_cache_hits_total"]
        queries = after["picovllm:prefix_cache_queries_total"] - before["picovllm:prefix_cache_queries_total"]
        assert queries == 6 * 40 and s["prefix_cache_hit_rate"] == pytest.approx(hits / queries)
        runs.append((out, s["prefix_cache_hit_rate"], proc.stdout))
    assert runs[0][1] == 0.0 and runs[2][1] == 0.0
    assert runs[1][1] == pytest.approx(6 * 32 / (6 * 40))
    assert "Prefix cache hit rate (servers, %)" in runs[1][2]
    profile = tmp_path / "profile.json"
    StepProfile([1e-3, 2e-3, 1e-5, 0.0, 2e-4, 1e-7], kv_bytes_per_token=1000).save(str(profile))
    cmd = [sys.executable, "-m", "picovllm.entrypoints.cli", "plan", "--profile", str(profile), "--input-len", "40",
           "--output-len", "3", "--request-rate", "50", "--calibrate", f"colocated-1:512:{runs[0][0]}",
           "--measured", *(f"colocated-1:512:{out}" for out, _, _ in runs)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    warned = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    assert len(warned) == 1 and str(runs[1][0]) in warned[0] and "80%" in warned[0], proc.stderr
    server.wait_idle()


def test_bench_serve_round_robins_over_servers(server, chat_model, tmp_path):
    """Several --base-url: requests alternate between the servers (one colocated server per GPU)."""
    import os
    import subprocess
    import sys

    second = ServerProcess(chat_model, str(tmp_path / "second.log"), *ENGINE_ARGS)
    try:
        before = [s.metrics()["picovllm:requests_total.length"] for s in (server, second)]
        out_json = tmp_path / "bench.json"
        cmd = [sys.executable, "-m", "picovllm.entrypoints.cli", "bench", "serve", "--base-url", server.url,
               second.url, "--num-prompts", "9", "--input-len", "8", "--output-len", "3", "--result-json",
               str(out_json)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([os.getcwd()] + sys.path))
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert json.loads(out_json.read_text())["completed"] == 9
        after = [s.metrics()["picovllm:requests_total.length"] for s in (server, second)]
        assert [a - b for a, b in zip(after, before)] == [5, 4]
    finally:
        assert second.stop(signal.SIGINT) == 0, second.log()


# -- /v1/responses (OpenAI's Responses API, stateless, over the chat pipeline) ---------------------------------------
def _responses_stream(events) -> tuple[list[str], str, object]:
    """The event types in order (sequence numbers checked), the text deltas joined, and the final response."""
    types, text, final = [], "", None
    for k, e in enumerate(events):
        assert e.sequence_number == k, (k, e)
        types.append(e.type)
        if e.type == "response.output_text.delta":
            text += e.delta
        if e.type in ("response.completed", "response.incomplete"):
            final = e.response
    return types, text, final


def test_responses_match_llm_chat(server, client, llm):
    """instructions + input as chat messages: the same reply as LLM.chat, streamed (OpenAI's event order) or not;
    usage counts the chat prompt and the tokens; a stopped-by-length reply is incomplete."""
    model = client.models.list().data[0].id
    sys_msg = {"role": "system", "content": "Answer briefly."}
    cases = [("Hello, how are you", [sys_msg, {"role": "user", "content": "Hello, how are you"}]),
             ([{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
               {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
               {"role": "user", "content": "Numbers: 0 1 2"}],
              [sys_msg, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
               {"role": "user", "content": "Numbers: 0 1 2"}])]
    for inp, conv in cases:
        for limit in (12, 150):     # 150: within the 256-token context after these prompts (more is a 400)
            ref = llm.chat(conv, SamplingParams(temperature=0, max_tokens=limit), use_tqdm=False)[0]
            status = "incomplete" if ref.outputs[0].finish_reason == "length" else "completed"
            kw = dict(model=model, input=inp, instructions="Answer briefly.", max_output_tokens=limit, temperature=0)
            r = client.responses.create(**kw)
            assert r.output_text == ref.outputs[0].text and r.status == status
            assert (r.usage.input_tokens, r.usage.output_tokens) == (len(ref.prompt_token_ids),
                                                                       len(ref.outputs[0].token_ids))
            types, text, final = _responses_stream(client.responses.create(stream=True, **kw))
            assert text == ref.outputs[0].text and final.output_text == text and final.status == status
            head = ["response.created", "response.in_progress", "response.output_item.added",
                    "response.content_part.added"]
            tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                    f"response.{status}"]
            assert types[:4] == head and types[-4:] == tail and set(types[4:-4]) == {"response.output_text.delta"}
    # include the output's logprobs: each token's as LLM.chat's, top_logprobs of them, streamed or not
    ref = llm.chat(cases[0][1], SamplingParams(temperature=0, max_tokens=8, logprobs=2), use_tqdm=False)[0].outputs[0]
    want = [d[t].logprob for d, t in zip(ref.logprobs, ref.token_ids)]
    kw = dict(model=model, input=cases[0][0], instructions="Answer briefly.", max_output_tokens=8, temperature=0,
              include=["message.output_text.logprobs"], top_logprobs=2)
    part = client.responses.create(**kw).output[0].content[0]
    assert [e.logprob for e in part.logprobs] == pytest.approx(want, abs=1e-4)
    assert all(len(e.top_logprobs) == 2 for e in part.logprobs)
    streamed = [lp.logprob for e in client.responses.create(stream=True, **kw)
                if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert streamed == pytest.approx(want, abs=1e-4)
    server.wait_idle()


def test_responses_text_format_json_schema(server, client):
    """text.format json_schema constrains the output as chat's response_format does: it parses and validates."""
    import jsonschema
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "age"], "additionalProperties": False}
    model = client.models.list().data[0].id
    for seed in range(3):
        r = client.responses.create(model=model, input="A person as JSON", max_output_tokens=60, temperature=1.0,
                                    text={"format": {"type": "json_schema", "name": "person", "schema": schema}},
                                    extra_body={"seed": seed})
        assert r.status == "completed"
        jsonschema.validate(json.loads(r.output_text), schema)


@pytest.mark.parametrize("body, param", [
    ({"store": True}, "store"), ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True}, "background"), ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ({"include": ["message.output_text.logprobs", "file_search_call.results"]}, "include[1]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"temperature": 3}, "temperature"), ({"top_k": "many"}, "top_k"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text.format.schema"),
])
def test_responses_refuse_what_they_cannot_honour(server, body, param):
    r = httpx.post(server.url + "/v1/responses", json={"input": "hi", "max_output_tokens": 2, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_responses_tool_calls(tool_client):
    """Function tools: a named call's item has the chat endpoint's name and arguments (same seed), streamed as
    argument deltas too; a function_call and its output in the input continue the conversation as the chat
    endpoint's tool_calls and tool message do."""
    server, client = tool_client
    model = client.models.list().data[0].id
    tools = [{"type": "function", **t["function"]} for t in (CITY_TOOL, CLOCK_TOOL)]
    ask = "What is the weather in Paris?"
    for seed in range(2):
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": ask}], tools=[CITY_TOOL, CLOCK_TOOL], seed=seed,
            tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=120, temperature=1.0)
        want = chat.choices[0].message.tool_calls[0].function
        kw = dict(model=model, input=ask, tools=tools, tool_choice={"type": "function", "name": "get_time"},
                  max_output_tokens=120, temperature=1.0, extra_body={"seed": seed})
        r = client.responses.create(**kw)
        calls = [o for o in r.output if o.type == "function_call"]
        assert [(c.name, c.arguments) for c in calls] == [("get_time", want.arguments)] and calls[0].call_id
        events = list(client.responses.create(stream=True, **kw))
        args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        done = [e.item for e in events if e.type == "response.output_item.done"]
        assert args == want.arguments and [(d.type, d.name, d.arguments) for d in done] == \
            [("function_call", "get_time", want.arguments)]
        with client.responses.stream(**kw) as stream:      # the SDK's accumulator takes the events as OpenAI's
            final = stream.get_final_response()
        assert [(o.type, o.name, o.arguments) for o in final.output] == [("function_call", "get_time", want.arguments)]
    history = [{"role": "user", "content": ask},
               {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}]
    want = client.chat.completions.create(model=model, messages=history, tools=[CITY_TOOL], tool_choice="none",
                                          max_tokens=10, temperature=0).choices[0].message.content
    items = [{"role": "user", "content": ask},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "Paris", "days": 1}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C"}]
    r = client.responses.create(model=model, input=items, tools=[tools[0]], tool_choice="none", max_output_tokens=10,
                                temperature=0)
    assert r.output_text == want
    server.wait_idle()
