"""Fuzz the OpenAI server's request handling: many bodies made by mutating valid ones, sent to a `serve` of a tiny
model on the CPU, while good greedy streams run beside them. Not a benchmark: a check of the project's rule that bad
input gets a 4xx naming its field, never takes down other requests, never loses data or leaks an engine's request or
block, and that what the engine cannot honour is refused.

    python benchmarks/fuzz_server.py [--requests 1500] [--seed 0] [--sweep] [--modes process thread tight pooling]
                                     [--workers 6] [--timeout 120] [--show-accepted]

Modes, one server each: process (serve's default, --engine-process), thread (--no-engine-process), tight (an engine
process with 20 KV blocks: requests wait and are preempted all the time), pooling (--runner pooling: /v1/embeddings).
The model is tests/serving_fixtures' tiny Llama with a trained tokenizer and a ChatML template, built in a temporary
folder. Routes: /v1/completions, /v1/chat/completions, /v1/responses, /tokenize, /detokenize, /v1/embeddings (the
pooling server's, and a generating one's 400), and other methods on them. Each request is one mutation of a valid body
(KINDS): a declared field set to a value of the wrong type or out of range (field), a message's, tool's or other
nested object's field (nested), a random combination of plausible values (combo) or of values each valid alone
(valid), an unknown field, a duplicated key, a body that is no JSON object or not sent as JSON (raw), token ids out of
the vocabulary (tokens), a long reply the client leaves after its first chunk (leave) or before it ends (hangup), a
seeded n > 1 request sent twice (seeded), another method. --sweep adds every declared field of every route set to
every odd value (WEIRD), and lone surrogates in what the chat template renders. The kinds' counts are printed.

Checked for each response: no 5xx, no dropped connection, no hang past --timeout; a 4xx body is OpenAI's error object,
and where one declared field was mutated its message or param names that field; text that is no Unicode (a lone
surrogate) in a field the model reads is never taken; a 200 is a whole answer (a stream's every event is JSON and its
last is [DONE], with no error event in between) and gives what the body asked (unhonoured: the choices for n and the
prompts, max_tokens, logprobs, echo, stop strings, usage chunks, token ids, structured outputs, forced tool calls); a
seeded request says the same twice. Beside the fuzzing, good greedy streams must say what they said before it. After
each mode: /health is 200, a greedy request says what it said before, the engine holds no request and every KV block
is free (/metrics), and the log has no traceback. Exit 1 on any failure, printing each distinct one (route, kind,
field, what happened) with one body that shows it.
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import math
import os
import random
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import httpx  # noqa: E402

from picovllm.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,  # noqa: E402
                                                  DetokenizeRequest, EmbeddingRequest, TokenizeRequest)
from picovllm.entrypoints.openai.serving_responses import ResponsesRequest  # noqa: E402

ENGINE_ARGS = ["--block-size", "16", "--num-kv-blocks", "256", "--max-model-len", "256", "--max-num-seqs", "16"]
GOOD_PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Tell me a story about a cat"}]
SEEDS = {     # route -> valid bodies the mutations start from
    "/v1/completions": [{"prompt": GOOD_PROMPT, "max_tokens": 4, "temperature": 0},
                        {"prompt": [5, 6, 7], "max_tokens": 3, "stream": True},
                        {"prompt": ["Hello", "Numbers: 0 1"], "max_tokens": 2, "n": 2, "logprobs": 1}],
    "/v1/chat/completions": [{"messages": CHAT, "max_tokens": 4, "temperature": 0},
                             {"messages": CHAT, "max_completion_tokens": 3, "stream": True,
                              "stream_options": {"include_usage": True}},
                             {"messages": [{"role": "system", "content": "Be brief."}, *CHAT], "max_tokens": 3,
                              "logprobs": True, "top_logprobs": 2}],
    "/v1/responses": [{"input": "Hello, how are you", "max_output_tokens": 4},
                      {"input": [{"role": "user", "content": "Hi"}], "max_output_tokens": 3, "stream": True}],
    "/tokenize": [{"prompt": GOOD_PROMPT}, {"messages": CHAT, "return_token_strs": True}],
    "/detokenize": [{"tokens": [5, 6, 7]}],
    "/v1/embeddings": [{"input": "Hello, how are you"}, {"input": [[5, 6], [7]], "encoding_format": "base64"}],
}
MODELS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
          "/v1/responses": ResponsesRequest, "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest,
          "/v1/embeddings": EmbeddingRequest}


def deep(depth: int, leaf) -> object:
    for _ in range(depth):
        leaf = [leaf]
    return leaf


# fields whose text the model reads or its output is matched against: a lone surrogate in them cannot be honoured
MODEL_TEXT = {"prompt", "messages", "input", "instructions", "stop", "bad_words", "tools", "documents",
              "guided_regex", "guided_choice", "guided_grammar", "guided_json", "chat_template"}
# (field mutated, field a 400 names) -> what its message says: refusals of two fields together, which name the other
# one (a batch of prompts with use_beam_search; instructions that make the whole prompt, with the input, too long)
COMBINED = {("use_beam_search", "prompt"): "beam search", ("instructions", "input"): "longer than max_model_len"}
# the field that makes a reply long, by route
LONGEST = {"/v1/completions": "max_tokens", "/v1/chat/completions": "max_completion_tokens",
           "/v1/responses": "max_output_tokens"}
# Values of the wrong type or out of range, each with a label for the report.
WEIRD = [("null", None), ("str", "x"), ("numeric str", "1"), ("empty str", ""), ("long str", "ab " * 60_000),
         ("lone surrogate", "\ud800"), ("surrogate in text", "a\udfffb"), ("zero", 0), ("-1", -1), ("one", 1),
         ("2**31", 2**31), ("2**63", 2**63), ("2**64", 2**64), ("2**70", 2**70), ("-2**70", -(2**70)),
         ("0.5", 0.5), ("-0.5", -0.5), ("1e308", 1e308), ("-1e308", -1e308), ("1e-308", 1e-308),
         ("NaN", math.nan), ("Infinity", math.inf), ("-Infinity", -math.inf), ("true", True), ("false", False),
         ("empty list", []), ("[null]", [None]), ("[1]", [1]), ("[-1]", [-1]), ("[2**70]", [2**70]), ("['a']", ["a"]),
         ("[[]]", [[]]), ("[{}]", [{}]), ("['\\ud800']", ["\ud800"]), ("empty dict", {}), ("dict", {"a": 1}),
         ("text part", {"type": "text", "text": 1}), ("nested 40", deep(40, 1)), ("long list", list(range(5000)))]
ROLES = ["system", "developer", "user", "assistant", "tool", "function", "", "USER", None, 5, "\ud800"]
PARTS = [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
         {"type": "input_audio"}, {"type": "refusal", "refusal": "no"}, {"type": "text"}, {"type": 7}, {"text": "hi"},
         {"type": None, "text": "a"}, "hi", 5, None, [], {"type": "text", "text": "\ud800"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "the weather",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
# Plausible values, valid or at the edge, for the combinations: which fields fit together is what they test
PLAUSIBLE = {
    "n": [1, 2, 3, 64, 65], "best_of": [1, 2, 4, 64], "logprobs": [0, 1, 5, 20, 21, -1, True, False],
    "top_logprobs": [0, 1, 20, 21, -1], "prompt_logprobs": [0, 1, 20, -1, 21], "echo": [True, False],
    "stream": [True, False], "stream_options": [{"include_usage": True}, {"continuous_usage_stats": True},
                                                {"include_usage": True, "continuous_usage_stats": True}, {}],
    "max_tokens": [0, 1, 2, 8, 250, 255, 256], "min_tokens": [0, 1, 3, 250], "seed": [0, -1, 2**63, 2**64 - 1],
    "stop": ["", " ", "the", ["a", "b"], [], ["\n"] * 16, ["x"] * 17, ["\ud800"]], "temperature": [0, 0.0, 1e-9, 2],
    "top_p": [1e-9, 1], "top_k": [-1, 0, 1, 384, 385, 2**31 - 1], "min_p": [0, 1], "ignore_eos": [True],
    "stop_token_ids": [[0], [2], [383], [384], []], "logit_bias": [{"5": 100}, {"383": -100}, {"384": 1}, {"05": 1},
                                                                   {"-1": 1}, {" 5": 1}, {"5": True}],
    "allowed_token_ids": [[5], [2], [0, 383], [384]], "bad_words": [["the"], ["ab cd"], [" "]],
    "use_beam_search": [True], "length_penalty": [0.5, -1.0], "truncate_prompt_tokens": [-1, 0, 1, 255, 256, 1000],
    "response_format": [{"type": "json_object"}, {"type": "text"}, {"type": "json_schema"},
                        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}},
                        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
                        {"type": "structural_tag"}, {"type": "regex"}],
    "guided_regex": ["[0-9]+", "(", ""], "guided_choice": [["yes", "no"], [], [""]], "guided_json": ['{"a"', {}],
    "guided_grammar": ["root ::= \"a\"", "nonsense"], "structured_outputs": [{"regex": "a+"}, {"choice": []}, {}],
    "tools": [[TOOL], [TOOL, TOOL], [], [{"type": "function", "function": {"name": "bad name!"}}]],
    "tool_choice": ["none", "auto", "required", {"type": "function", "function": {"name": "get_weather"}},
                    {"type": "function", "function": {"name": "missing"}}, "any"],
    "parallel_tool_calls": [False], "return_token_ids": [True], "return_tokens_as_token_ids": [True],
    "include_stop_str_in_output": [True], "skip_special_tokens": [False], "spaces_between_special_tokens": [False],
    "add_special_tokens": [True, False], "priority": [1, -1], "request_id": ["a", "dup", "has space", "x" * 257],
    "cache_salt": ["s", ""], "continue_final_message": [True], "add_generation_prompt": [False],
    "chat_template_kwargs": [{"enable_thinking": False}, {"messages": []}, {"add_generation_prompt": 1}],
    "chat_template": ["{{ messages[0]['content'] }}", "{% bad", "{{ raise_exception('no') }}"],
    "reasoning_effort": ["low", "high"], "include_reasoning": [False], "documents": [[{"title": "t", "text": "x"}]],
    "presence_penalty": [2, -2], "frequency_penalty": [2], "repetition_penalty": [0.01, 100, 1e-300, 1e300],
    "max_completion_tokens": [1, 250], "suffix": ["", "x"], "user": ["u"], "model": ["", "other", None],
    "encoding_format": ["base64", "float"], "dimensions": [1, 64, 65], "normalize": [True, False],
    "embed_dtype": ["float16", "bfloat16"], "endianness": ["big", "little"],
    "return_token_strs": [True], "tokens": [[0], [383], [384], [1, 2] * 100],
}

# Values each valid on its own, for the combinations whose replies are checked against what they asked (unhonoured)
VALID = {
    "prompt": [GOOD_PROMPT, [5, 6, 7, 8], ["Hello", "Numbers: 0 1"], [[5, 6], [7, 8, 9]]],
    "messages": [CHAT, [*CHAT, {"role": "assistant", "content": "Once"}],
                 [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]],
    "n": [1, 2, 3], "best_of": [3, 4], "logprobs": [0, 1, 5, True], "top_logprobs": [0, 2, 5], "echo": [True],
    "stream": [True, False, True], "stream_options": [{"include_usage": True},
                                                      {"include_usage": True, "continuous_usage_stats": True}],
    "max_tokens": [0, 1, 5, 12], "min_tokens": [0, 3, 12], "stop": [" ", "e", ["a", "o"], "Numbers"],
    "include_stop_str_in_output": [True], "seed": [0, 7], "temperature": [0, 0.8], "top_k": [1, 5], "top_p": [0.5],
    "logit_bias": [{"5": 100}, {"2": -100}], "allowed_token_ids": [[5, 6, 7], [2, 5]], "return_token_ids": [True],
    "return_tokens_as_token_ids": [True], "prompt_logprobs": [0, 1, 3], "truncate_prompt_tokens": [2, -1],
    "response_format": [{"type": "json_object"}], "guided_choice": [["yes", "no"]], "skip_special_tokens": [False],
    "ignore_eos": [True], "stop_token_ids": [[5], [2]], "bad_words": [["the"]], "min_p": [0.1],
    "presence_penalty": [1.5], "repetition_penalty": [1.3], "max_completion_tokens": [1, 6],
    "tools": [[TOOL]], "tool_choice": ["required", {"type": "function", "function": {"name": "get_weather"}}, "none"],
    "continue_final_message": [True], "add_generation_prompt": [False], "use_beam_search": [True],
    "request_id": ["same-id"], "priority": [0],
}


# How often each kind of mutation is drawn
KINDS = {"field": 30, "nested": 14, "combo": 20, "valid": 25, "unknown": 3, "duplicate": 3, "raw": 6, "leave": 4,
         "hangup": 3, "method": 2, "tokens": 8, "seeded": 3}
JSON = "application/json"


def dumps(body) -> bytes:
    """JSON as Python writes it: NaN and Infinity as literals, a lone surrogate as its escape."""
    return json.dumps(body).encode()


def mutations(rng: random.Random, route: str, server_routes: list[str]) -> tuple:
    """One request: (kind, the declared field it tests or None, route, method, body bytes, content type)."""
    body = json.loads(json.dumps(rng.choice(SEEDS[route])))
    kind = rng.choices(list(KINDS), list(KINDS.values()))[0]
    if kind == "duplicate":     # the last of a key's values wins in Python's json (and FastAPI's)
        text = dumps(body)[:-1] + b", " + dumps(rng.choice(list(body))) + b": " + dumps(rng.choice(WEIRD)[1]) + b"}"
        return kind, None, route, "POST", text, JSON
    if kind == "raw":
        return (kind, None, route, "POST", *_raw(rng, body))
    if kind == "method":
        return kind, None, rng.choice(server_routes + ["/v1/nope", "/v1/models/x"]), rng.choice(
            ["GET", "PUT", "DELETE", "PATCH"]), dumps(body), JSON
    if kind == "tokens" and route not in TOKEN_FIELDS:
        kind = "field"
    kind, field = MUTATE[kind](rng, route, body)
    return kind, field, route, "POST", dumps(body), JSON


def _odd_field(rng: random.Random, route: str, body: dict) -> tuple[str, str]:
    field = rng.choice(list(MODELS[route].model_fields))
    label, body[field] = rng.choice(WEIRD)
    if field == "stream":
        body.pop("stream_options", None)
    return f"field:{label}", field


def _fields_from(values: dict, k: tuple[int, int]):
    """A mutation that sets k[0] to k[1] of the route's fields to values of theirs in `values`."""
    def mutate(rng: random.Random, route: str, body: dict) -> tuple[str, None]:
        names = [f for f in values if f in MODELS[route].model_fields]
        for name in rng.sample(names, k=min(rng.randint(*k), len(names))):
            body[name] = rng.choice(values[name])
        if not body.get("stream"):
            body.pop("stream_options", None)
        return "valid" if values is VALID else "combo", None
    return mutate


def _unknown(rng: random.Random, route: str, body: dict) -> tuple[str, None]:
    body[rng.choice(["foo", "Prompt", "max-tokens", "", "\ud800", "__proto__"])] = rng.choice(WEIRD)[1]
    return "unknown", None


def _token_ids(rng: random.Random, route: str, body: dict) -> tuple[str, str]:
    """Token ids where a prompt or input takes them: out of the vocabulary, negative, of the wrong type, empty."""
    field = TOKEN_FIELDS[route]
    body[field] = rng.choice([[-1], [384], [2**31], [2**63], [5, -5], [[5], [-1]], [[5], []], [[]], [1.5], [True],
                              [5] * 300, [[5] * 300], [0], [383], ["5"], [[5], "a"]])
    return "tokens", field


def _long_reply(rng: random.Random, route: str, body: dict, kind: str) -> tuple[str, None]:
    """A long reply the client leaves: streamed, after its first chunk ("leave"), or before it ends ("hangup")."""
    if route not in LONGEST:
        return kind, None
    body.pop("max_tokens", None)
    body.pop("stream_options", None)
    body.update({"stream": kind == "leave", LONGEST[route]: 200})
    for name in rng.sample(["n", "best_of", "use_beam_search", "logprobs", "echo"], k=rng.randint(0, 2)):
        if name in MODELS[route].model_fields:
            body[name] = {"n": 3, "best_of": 4, "use_beam_search": True, "logprobs": 2, "echo": True}[name]
    return kind, None


def _seeded(rng: random.Random, route: str, body: dict) -> tuple[str, None]:
    """Seeded samples (n of them), sent twice: the same texts both times."""
    if route in ("/v1/completions", "/v1/chat/completions"):
        body.update(temperature=1.0, n=rng.randint(2, 4), stream=rng.random() < 0.5,
                    seed=rng.choice([-4, -2, 0, 7, 2**63, 2**64 - 1, -(2**63)]))
        body.pop("stream_options", None)
    return "seeded", None


def _raw(rng: random.Random, body: dict) -> tuple[bytes, str]:
    """A body that is no JSON object, or not sent as JSON: (bytes, content type)."""
    return rng.choice([
        (b"", JSON), (b"{", JSON), (b"not json", JSON), (b'{"prompt": "a",}', JSON), (b"\xff\xfe{}", JSON),
        (b"\xef\xbb\xbf" + dumps(body), JSON), (dumps(body), "text/plain"), (dumps(body), "multipart/form-data"),
        (dumps(body), "application/x-www-form-urlencoded"), (dumps(body), ""), (b"[" * 100_000, JSON),
        (b'{"a":' * 5000 + b"1" + b"}" * 5000, JSON), (b"null", JSON), (b"[]", JSON), (b"12", JSON),
        (b'"\\ud800"', JSON), (dumps(body)[:len(dumps(body)) // 2], JSON), (b"\x00" * 64, JSON)])


TOKEN_FIELDS = {"/v1/completions": "prompt", "/v1/embeddings": "input", "/detokenize": "tokens"}
MUTATE = {"field": _odd_field, "nested": lambda rng, route, body: ("nested", _nested(rng, route, body)),
          "combo": _fields_from(PLAUSIBLE, (1, 4)), "valid": _fields_from(VALID, (2, 6)), "unknown": _unknown,
          "tokens": _token_ids, "leave": lambda rng, route, body: _long_reply(rng, route, body, "leave"),
          "hangup": lambda rng, route, body: _long_reply(rng, route, body, "hangup"), "seeded": _seeded}


def _nested(rng: random.Random, route: str, body: dict) -> str | None:
    """A field inside an object: a message's, a tool's, stream_options', response_format's, a responses' input
    item's; returns the request's top-level field it belongs to."""
    if route in ("/v1/chat/completions", "/tokenize") and "messages" in body:
        msgs = body["messages"]
        m = rng.choice(msgs)
        what = rng.choice(["role", "content", "parts", "name", "tool_calls", "tool_call_id", "drop", "extra",
                           "not a dict", "reasoning"])
        if what == "role":
            m["role"] = rng.choice(ROLES)
        elif what == "content":
            m["content"] = rng.choice(WEIRD)[1]
        elif what == "parts":
            m["content"] = rng.sample(PARTS, k=rng.randint(1, 3))
        elif what == "name":
            m["name"] = rng.choice(WEIRD)[1]
        elif what == "tool_calls":
            m["role"] = "assistant"
            m["tool_calls"] = rng.choice([[{"id": "c1", "type": "function", "function": {"name": "f",
                                                                                         "arguments": "{\"a\": 1}"}}],
                                          [{"type": "function", "function": {"name": "f", "arguments": "not json"}}],
                                          [{"function": {"name": "f"}}], [{}], "x", [None],
                                          [{"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]])
        elif what == "tool_call_id":
            m["role"], m["tool_call_id"] = "tool", rng.choice(["c1", None, 5, ""])
        elif what == "drop":
            m.pop("content", None) if rng.random() < 0.5 else m.pop("role", None)
        elif what == "extra":
            m[rng.choice(["function_call", "audio", "refusal", "weight"])] = rng.choice(WEIRD)[1]
        elif what == "not a dict":
            msgs[msgs.index(m)] = rng.choice(WEIRD)[1]
        else:
            m[rng.choice(["reasoning", "reasoning_content"])] = rng.choice(WEIRD)[1]
        return "messages"
    if route == "/v1/responses" and isinstance(body["input"], list):
        item = body["input"][0]
        item[rng.choice(["role", "content", "type", "call_id", "output"])] = rng.choice(
            [*[w[1] for w in WEIRD[:8]], "function_call_output", "message", [{"type": "input_image"}],
             [{"type": "input_text", "text": "hi"}], [{"type": "output_text"}]])
        return "input"
    field = rng.choice(["stream_options", "response_format", "tools", "logit_bias", "structured_outputs"])
    if field == "stream_options":
        body["stream"] = True
        body[field] = {rng.choice(["include_usage", "continuous_usage_stats", "x"]): rng.choice(WEIRD)[1]}
    elif field == "response_format":
        body[field] = {"type": rng.choice(["json_schema", "json_object", "text", None, 5]),
                       rng.choice(["json_schema", "format", "structures", "triggers"]): rng.choice(WEIRD)[1]}
    elif field == "tools":
        tool = json.loads(json.dumps(TOOL))
        tool["function"][rng.choice(["name", "parameters", "description", "strict"])] = rng.choice(WEIRD)[1]
        body[field] = [tool]
    elif field == "logit_bias":
        body[field] = {rng.choice(["5", "384", "-1", "x", "", "1e3", "\ud800"]): rng.choice(WEIRD)[1]}
    else:
        body[field] = {rng.choice(["json", "regex", "choice", "grammar", "json_object", "structural_tag", "x"]):
                       rng.choice(WEIRD)[1]}
    return field


def sweep(routes: list[str]) -> list:
    """Every declared field of every route set to every odd value, one request each (the seeds taken in turn)."""
    reqs, i = [], 0
    for route in routes:
        for field in MODELS[route].model_fields:
            for label, value in WEIRD:
                body = json.loads(json.dumps(SEEDS[route][i % len(SEEDS[route])]))
                i += 1
                body[field] = value
                if field == "stream" and "stream_options" in body:
                    del body["stream_options"]
                reqs.append((f"field:{label}", field, route, "POST", dumps(body), JSON))
    for route in set(routes) & {"/v1/chat/completions", "/tokenize"}:     # text the template renders, nested
        user = {"role": "user", "content": "Hi"}
        for field, value in [("messages", [{"role": "user", "content": "a\udfffb"}]),
                             ("messages", [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]),
                             ("tools", [{"type": "function", "function": {"name": "f", "description": "\ud800"}}]),
                             ("tools", [{"type": "function", "function": {"name": "f", "parameters": {
                                 "type": "object", "properties": {"\ud800": {"type": "string"}}}}}]),
                             ("documents", [{"title": "t", "text": "\ud800"}]),
                             ("chat_template_kwargs", {"enable_thinking": "\ud800"})]:
            body = {"messages": [user], field: value} if field != "messages" else {"messages": value}
            reqs.append(("nested", field, route, "POST", dumps(body), JSON))
    return reqs


def replies(route: str, resp: dict | None, events: list[dict]) -> tuple[dict[int, dict], dict | None]:
    """A completion's or chat reply's choices by index, a stream's put together ({text, finish, stop_reason,
    logprobs: a list a token, token_ids, tool_calls, ...}), and its usage."""
    out: dict[int, dict] = {}
    for chunk in ([resp] if resp is not None else events):
        for c in chunk.get("choices", []):
            r = out.setdefault(c["index"], {"text": "", "logprobs": None, "token_ids": None, "tool_calls": []})
            part = c.get("message") or c.get("delta") or {}
            r["text"] += (c.get("text") or "") + (part.get("content") or "")
            r["tool_calls"] += part.get("tool_calls") or []
            r["finish"] = c.get("finish_reason") or r.get("finish")
            r["stop_reason"] = c.get("stop_reason") if c.get("finish_reason") else r.get("stop_reason")
            lp = c.get("logprobs")
            if lp is not None:
                r["logprobs"] = (r["logprobs"] or []) + (lp["content"] if "content" in lp else [
                    {"token": t, "top": top} for t, top in zip(lp["tokens"], lp["top_logprobs"])])
            if c.get("token_ids") is not None:
                r["token_ids"] = (r["token_ids"] or []) + c["token_ids"]
            for key in ("prompt_logprobs", "prompt_token_ids"):
                if key in c:
                    r[key] = c[key]
    usage = resp.get("usage") if resp is not None else next((e["usage"] for e in reversed(events) if e.get("usage")),
                                                            None)
    return out, usage


def unhonoured(route: str, b: dict, resp: dict | None, events: list[dict]) -> str | None:
    """What a 200 reply to a completion or chat body b leaves out of what b asked (n, logprobs, echo, stops, usage,
    token ids, structured output, tools, ...), or None."""
    chat = route == "/v1/chat/completions"
    prompt = b.get("prompt")
    batch = 1 if chat or isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else len(prompt)
    n = b.get("n") or 1
    got, usage = replies(route, resp, events)
    if sorted(got) != list(range(batch * n)):
        return f"choices {sorted(got)[:8]} for {batch} prompt(s) x n={n}"
    mt = b.get("max_completion_tokens") or b.get("max_tokens") if chat else b.get("max_tokens", 16)
    mt = 16 if mt is None and not chat else mt
    samples = batch * max(n, b.get("best_of") or 1)
    options = (b.get("stream_options") or {}) if b.get("stream") else {}
    if options.get("include_usage") and usage is None:
        return "stream_options.include_usage: no usage chunk"
    if options.get("include_usage") and options.get("continuous_usage_stats") and \
            any("usage" not in e for e in events if e["choices"]):
        return "stream_options.continuous_usage_stats: a chunk without usage"
    if usage is not None and mt is not None and usage["completion_tokens"] > samples * mt:
        return f"max_tokens {mt}: {usage['completion_tokens']} tokens for {samples} samples"
    ids = [r["token_ids"] for r in got.values()]
    if usage is not None and b.get("return_token_ids") and None not in ids and (b.get("best_of") or n) == n and \
            not (b.get("echo") and b.get("max_tokens") == 0) and sum(map(len, ids)) != usage["completion_tokens"]:
        return f"usage: {usage['completion_tokens']} completion tokens, the choices' token_ids {sum(map(len, ids))}"
    k = b.get("top_logprobs") if chat else b.get("logprobs")
    wants_lp = b.get("logprobs") is True if chat else b.get("logprobs") is not None
    stops = [b["stop"]] if isinstance(b.get("stop"), str) else b.get("stop") or []
    for i, r in got.items():
        if wants_lp != (r["logprobs"] is not None):
            return f"choice {i}: logprobs {'missing' if wants_lp else 'not asked for'}"
        # completions' top logprobs are keyed by the token's text, and tokens of one text (an incomplete character's
        # bytes) collapse into one key (OpenAI's format, vLLM's too): counted only where keyed by the ids
        counted = chat or b.get("return_tokens_as_token_ids")
        if wants_lp and counted and k and k > 0 and any(e["top_logprobs" if chat else "top"] is not None and
                                            len(e["top_logprobs" if chat else "top"]) < k for e in r["logprobs"]):
            return f"choice {i}: fewer than {k} top logprobs"
        if b.get("return_token_ids") and (r["token_ids"] is None or
                                          "prompt_token_ids" not in (r if not chat else (resp or events[0]))):
            return f"choice {i}: return_token_ids: no token ids"
        if b.get("prompt_logprobs") is not None and not chat and "prompt_logprobs" not in r:
            return f"choice {i}: prompt_logprobs missing"
        if wants_lp and r["token_ids"] is not None and not b.get("echo") and \
                len(r["logprobs"]) != len(r["token_ids"]):
            return f"choice {i}: {len(r['logprobs'])} logprobs for {len(r['token_ids'])} tokens"
        text, echoed = r["text"], prompt if isinstance(prompt, str) else prompt[i // n] if batch > 1 else None
        if b.get("echo") and not chat:
            if not isinstance(echoed, str) or b.get("truncate_prompt_tokens") is not None:
                continue     # the echoed text is the prompt's ids decoded: its end is not known here
            if not text.startswith(echoed):
                return f"choice {i}: echo: the text does not start with the prompt"
            text = text[len(echoed):]
        if b.get("echo") and chat and isinstance(b.get("messages"), list) and b["messages"] and \
                isinstance(b["messages"][-1], dict) and b["messages"][-1].get("role") == "assistant":
            last = b["messages"][-1].get("content")
            if not isinstance(last, str):
                continue     # content parts: the echoed text is their join, not rebuilt here
            if not text.startswith(last):
                return f"choice {i}: echo: the content does not start with the last (assistant) message's"
            text = text[len(last):]     # echo puts that message's content first: a stop string may be in it
        # no stop string ends a reply before min_tokens, nor is one looked for in the EOS's text (skip_special_tokens
        # false shows it)
        for stop in stops if not (b.get("min_tokens") or b.get("skip_special_tokens") is False) else []:
            at = text.find(stop) if stop else -1
            if at >= 0 and not (b.get("include_stop_str_in_output") and at + len(stop) == len(text)):
                return f"choice {i}: stop {stop!r} in the text {text!r}"
        ids = r["token_ids"]
        if ids is not None and b.get("allowed_token_ids") and not set(ids) <= set(b["allowed_token_ids"]) | {2}:
            return f"choice {i}: allowed_token_ids {b['allowed_token_ids']}: made {ids}"
        if ids is not None and b.get("bad_words") is None and b.get("temperature") == 0 and b.get("logit_bias") and \
                list(b["logit_bias"].values()).count(100) == 1 and not structured(b) and \
                not b.get("allowed_token_ids") and set(ids) - {int(t) for t, v in b["logit_bias"].items() if v == 100}:
            return f"choice {i}: logit_bias {b['logit_bias']}: made {ids}"
        # a structured output's whole text, unless a stop (string or token) or the EOS's text cut it short or longer
        whole = r["finish"] == "stop" and not (stops or b.get("stop_token_ids") or b.get("include_stop_str_in_output")
                                               or b.get("skip_special_tokens") is False)
        if whole and structured(b) == "json" and not r["tool_calls"]:
            try:
                json.loads(text)
            except ValueError:
                return f"choice {i}: {structured(b)}: the text is not JSON: {text[:80]!r}"
        if whole and structured(b) == "choice" and text not in b["guided_choice"]:
            return f"choice {i}: guided_choice: {text[:80]!r}"
        forced = chat and b.get("tools") and (b.get("tool_choice") == "required" or isinstance(b.get("tool_choice"),
                                                                                              dict))
        if forced and r["finish"] in ("stop", "tool_calls") and not r["tool_calls"]:
            return f"choice {i}: tool_choice {b['tool_choice']}: no tool call"
    return None


def structured(b: dict) -> str | None:
    rf = b.get("response_format") or {}
    if rf.get("type") in ("json_object", "json_schema") or b.get("guided_json") is not None:
        return "json"
    return "choice" if b.get("guided_choice") else None


def check(route: str, kind: str, field: str | None, resp: httpx.Response, stream_body: str | None,
          body: dict | None) -> str | None:
    """What is wrong with the response to body (None: not a JSON object), or None."""
    status = resp.status_code
    if status == 200 and field in MODEL_TEXT and kind in ("field:lone surrogate", "field:surrogate in text",
                                                         "field:['\\ud800']"):
        return f"{field}: text that is not Unicode taken (no tokenizer encodes it, no output holds it)"
    if status >= 500:
        return f"status {status}"
    if not (200 <= status < 500):
        return f"status {status}"
    if status >= 400:
        if status == 405 or (status == 404 and kind == "method"):
            return None
        try:
            err = json.loads(resp.content)["error"]
            assert isinstance(err["message"], str) and isinstance(err["type"], str) and "param" in err
        except Exception:
            return f"{status} body not OpenAI's error object: {resp.content[:200]!r}"
        pooling_only = "needs a pooling model" in err["message"]      # a generating server's every embeddings request
        if field is not None and status == 400 and field not in err["message"] and err["param"] != field \
                and not pooling_only and COMBINED.get((field, err["param"]), "\0") not in err["message"]:
            return f"400 does not name {field}"
        return None
    if stream_body is None:
        try:
            reply = json.loads(resp.content)
        except ValueError:
            return "200 body not JSON"
        if route in ("/v1/completions", "/v1/chat/completions") and not body.get("use_beam_search"):
            return unhonoured(route, body, reply, [])
        return None
    events = [line[len("data: "):] for line in stream_body.split("\n") if line.startswith("data: ")]
    if route == "/v1/responses":      # events, each JSON, the last response.completed or .incomplete
        try:
            types = [json.loads(e)["type"] for e in events]
        except (ValueError, KeyError):
            return "responses event not JSON with a type"
        if "error" in types:
            return "responses stream error event"
        return None if types and types[-1] in ("response.completed", "response.incomplete") else \
            "responses stream did not complete"
    if not events or events[-1] != "[DONE]":
        return "stream did not end with [DONE]"
    for e in events[:-1]:
        try:
            chunk = json.loads(e)
        except ValueError:
            return f"stream event not JSON: {e[:100]}"
        if "error" in chunk:
            return f"stream error event: {chunk['error'].get('message', '')[:200]}"
    return unhonoured(route, body, None, [json.loads(e) for e in events[:-1]])


def send(client: httpx.Client, req: tuple, timeout: float) -> tuple[str, str | None, str, str | None, str, bytes]:
    """(kind, field, route, failure or None, the status as text, the body sent)."""
    kind, field, route, method, body, ctype = req
    headers = {"content-type": ctype} if ctype else {}
    try:     # as the server reads it (a UTF-8 BOM, a duplicated key's last value)
        sent = json.loads(body)
    except (ValueError, RecursionError):
        sent = None
    sent = sent if isinstance(sent, dict) else None
    streamed = route in LONGEST and sent is not None and sent.get("stream") is True
    try:
        if kind == "hangup":     # the client gives up before the answer comes
            try:
                resp = client.request(method, route, content=body, headers=headers,
                                      timeout=httpx.Timeout(timeout, read=random.Random(body).uniform(0.01, 0.5)))
            except httpx.ReadTimeout:
                return kind, field, route, None, "hung up", body
            return kind, field, route, check(route, kind, field, resp, None, sent), str(resp.status_code), body
        if kind == "seeded" and route in ("/v1/completions", "/v1/chat/completions"):
            return (kind, field, route, *_reproduced(client, route, body, headers, streamed), body)
        with client.stream(method, route, content=body, headers=headers) as resp:
            if kind == "leave" and streamed and resp.status_code == 200:
                next(resp.iter_raw(), None)       # the first chunk, then hang up
                return kind, field, route, None, "200 left", body
            text = resp.read().decode("utf-8", "replace")
        problem = check(route, kind, field, resp, text if streamed and resp.status_code == 200 else None, sent)
        return kind, field, route, problem, str(resp.status_code), body
    except httpx.TimeoutException:
        return kind, field, route, "timed out", "timeout", body
    except httpx.HTTPError as e:
        return kind, field, route, f"connection: {type(e).__name__}: {e}", "dropped", body


def _reproduced(client: httpx.Client, route: str, body: bytes, headers: dict, streamed: bool) -> tuple[str | None, str]:
    """A seeded body sent twice: (failure or None, the status as text)."""
    texts = []
    for _ in range(2):
        resp = client.post(route, content=body, headers=headers)
        if resp.status_code != 200:
            return f"seeded: status {resp.status_code}: {resp.text[:200]}", str(resp.status_code)
        texts.append({i: r["text"] for i, r in replies(route, *_reply(resp, streamed))[0].items()})
    return (None if texts[0] == texts[1] else f"seeded, not reproduced: {texts}"), "200"


def _reply(resp: httpx.Response, streamed: bool) -> tuple[dict | None, list[dict]]:
    """A 200's body, or its stream's events (replies' arguments)."""
    if not streamed:
        return resp.json(), []
    return None, [json.loads(line[6:]) for line in resp.text.split("\n")
                  if line.startswith("data: ") and line != "data: [DONE]"]


class GoodStreams:
    """Greedy streams sent over and over beside the fuzzing; each must say what the first said."""

    def __init__(self, url: str, n_threads: int = 2) -> None:
        self.url, self.stop, self.errors, self.count = url, threading.Event(), [], 0
        self.ref = {"completion": self._completion(), "chat": self._chat()}
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(n_threads)]
        for t in self.threads:
            t.start()

    def _stream(self, route: str, body: dict) -> str:
        text = ""
        with httpx.Client(base_url=self.url, timeout=120) as c, c.stream("POST", route, json=body) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    for ch in chunk["choices"]:
                        text += ch.get("text") or ch.get("delta", {}).get("content") or ""
        return text

    def _completion(self) -> str:
        return self._stream("/v1/completions", {"prompt": GOOD_PROMPT, "max_tokens": 24, "temperature": 0,
                                                "ignore_eos": True, "stream": True})

    def _chat(self) -> str:
        return self._stream("/v1/chat/completions", {"messages": CHAT, "max_tokens": 24, "temperature": 0,
                                                     "ignore_eos": True, "stream": True})

    def _loop(self, i: int) -> None:
        while not self.stop.is_set():
            which = ("completion", "chat")[(self.count + i) % 2]
            try:
                got = self._completion() if which == "completion" else self._chat()
                if got != self.ref[which]:
                    self.errors.append(f"good {which} stream said {got!r}, not {self.ref[which]!r}")
            except Exception as e:
                self.errors.append(f"good {which} stream failed: {type(e).__name__}: {e}")
            self.count += 1

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


def fuzz_mode(mode: str, model: str, args, tmp: str) -> tuple[collections.Counter, dict, collections.Counter]:
    """One mode's server fuzzed: (the counts by kind and by status, the failures, the odd values taken)."""
    from serving_fixtures import ServerProcess
    extra = {"process": ["--engine-process"], "thread": ["--no-engine-process"],
             "pooling": ["--no-engine-process", "--runner", "pooling"],
             # room for one longest request and a little: requests wait and are preempted all the time
             "tight": ["--engine-process", "--num-kv-blocks", "20"]}[mode]
    srv = ServerProcess(model, os.path.join(tmp, f"{mode}.log"), *ENGINE_ARGS, *extra, startup_timeout=300)
    routes = (["/v1/embeddings", "/tokenize", "/detokenize"] if mode == "pooling" else
              ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize", "/detokenize",
               "/v1/embeddings"])
    weights = {"/v1/completions": 5, "/v1/chat/completions": 5, "/v1/responses": 2, "/tokenize": 2,
               "/detokenize": 1, "/v1/embeddings": 1 if mode != "pooling" else 6}
    rng = random.Random(f"{args.seed}-{mode}")
    counts: collections.Counter = collections.Counter()
    failures: dict = {}
    accepted: collections.Counter = collections.Counter()   # (route, field, value): a declared field's odd value
    try:                                                     # answered with 200 (to read: is it honoured?)
        good = None if mode == "pooling" else GoodStreams(srv.url)
        before = None if good is None else dict(good.ref)
        reqs = [mutations(rng, rng.choices(routes, [weights[r] for r in routes])[0], routes)
                for _ in range(args.requests)]
        if args.sweep:
            reqs += sweep(routes)
            rng.shuffle(reqs)
        with httpx.Client(base_url=srv.url, timeout=args.timeout) as client, \
                concurrent.futures.ThreadPoolExecutor(args.workers) as pool:
            for kind, field, route, problem, status, body in pool.map(lambda r: send(client, r, args.timeout), reqs):
                counts[(route, kind.split(":")[0])] += 1
                counts[("status", status)] += 1
                if kind.startswith("field:") and status.startswith("200"):
                    accepted[(route, field, kind[len("field:"):])] += 1
                if problem is not None:     # one line a distinct failure (seeded: whatever the texts)
                    key = (route, kind, field, problem if "names" in problem or "status" in problem else
                           problem.split(":")[0] if kind == "seeded" else problem[:60])
                    failures.setdefault(key, body[:600])
        if good is not None:
            good.close()
            counts[("good streams", "")] += good.count
            for e in dict.fromkeys(good.errors):
                failures.setdefault(("good streams", "", None, e[:300]), b"")
        _after(srv, good, before, failures)
    finally:
        srv.stop()
    if any(w in srv.log() for w in ("Traceback", "unhandled error")):
        failures.setdefault(("log", "", None, "a traceback in the server's log"), srv.log()[-3000:].encode())
    return counts, failures, accepted


def _after(srv, good, before, failures: dict) -> None:
    try:
        health = httpx.get(srv.url + "/health", timeout=10).status_code
    except httpx.HTTPError as e:
        health = repr(e)
    if health != 200:
        failures[("after", "", None, f"/health {health}")] = b""
        return
    if good is not None:
        again = {"completion": good._completion(), "chat": good._chat()}
        if again != before:
            failures[("after", "", None, f"greedy outputs changed: {before} -> {again}")] = b""
    try:
        srv.wait_idle(30.0)
    except AssertionError as e:
        failures[("after", "", None, f"engine not idle after the run: {e}")] = b""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1500, help="fuzzed requests per mode")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", nargs="+", default=["process", "thread", "tight", "pooling"],
                    choices=["process", "thread", "tight", "pooling"])
    ap.add_argument("--workers", type=int, default=6, help="fuzzed requests in flight at once")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds before a request counts as hung")
    ap.add_argument("--sweep", action="store_true",
                    help="also every declared field of every route set to every odd value (~9,000 requests a mode)")
    ap.add_argument("--show-accepted", action="store_true",
                    help="list the declared fields whose odd values were answered with 200")
    args = ap.parse_args()
    from serving_fixtures import build_tiny_chat_model
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_chat_model(os.path.join(tmp, "model"))
        for mode in args.modes:
            t0 = time.time()
            counts, failures, accepted = fuzz_mode(mode, model, args, tmp)
            print(f"== {mode}: {args.requests} fuzzed requests in {time.time() - t0:.0f} s")
            for (a, b), n in sorted(counts.items(), key=lambda kv: (kv[0][0] != "status", kv[0])):
                print(f"   {a:22} {b:10} {n}")
            if args.show_accepted:
                for (route, field, label), n in sorted(accepted.items()):
                    print(f"   accepted: {route} {field} = {label} ({n})")
            for (route, kind, field, problem), body in failures.items():
                failed = True
                print(f"FAIL {route} {kind} {field}: {problem}\n     body: {body[:300]!r}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
