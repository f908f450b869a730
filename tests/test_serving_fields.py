"""vLLM's request fields beyond OpenAI's, against what they must equal: cache_salt (prefix-cache hits only within a
salt), return_token_ids (the ids the engine ran and produced: the prompt's as /tokenize gives them, the output's
as the text decodes from them), request_id, and the embeddings' embed_dtype and endianness (torch's rounding)."""
from __future__ import annotations

import base64
import json
import struct

import pytest

from conftest import assert_engine_clean
from test_chat_templates import _served, model  # noqa: F401 - a fixture


def test_return_token_ids_and_request_id(model):
    """return_token_ids: chat's prompt ids at the top, each choice's ids; completions' both in each choice; streamed,
    the prompt's in the first chunk and each chunk's new ids, which add up to the unstreamed ones. The prompt's are
    /tokenize's, the output's decode to the text. request_id names the response."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    messages = [{"role": "user", "content": "Tell me a story"}]
    engine, http = _served(model)
    with http:
        chat_ids = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
        kw = {"max_tokens": 12, "temperature": 0, "return_token_ids": True}
        r = http.post("/v1/chat/completions", json={"messages": messages, "n": 2, "request_id": "abc-1", **kw}).json()
        assert r["id"] == "chatcmpl-abc-1" and r["prompt_token_ids"] == chat_ids
        for c in r["choices"]:
            assert len(c["token_ids"]) == r["usage"]["completion_tokens"] // 2
            # (an incomplete character at the end is held back from the text)
            assert tok.decode(c["token_ids"], skip_special_tokens=True).rstrip("\ufffd") == \
                c["message"]["content"].rstrip("\ufffd")
        plain = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 12}).json()
        assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
        chunks = [json.loads(line[6:]) for line in http.post("/v1/chat/completions", json={
            "messages": messages, "stream": True, **kw}).text.splitlines()
            if line.startswith("data: {")]
        assert chunks[0]["prompt_token_ids"] == chat_ids
        assert all("prompt_token_ids" not in c for c in chunks[1:])
        streamed = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []]
        assert streamed == r["choices"][0]["token_ids"]

        prompts = ["Hello, how are you", "The capital of France is"]
        ids = [http.post("/tokenize", json={"prompt": p}).json()["tokens"] for p in prompts]
        r = http.post("/v1/completions", json={"prompt": prompts, "request_id": "xyz", **kw}).json()
        assert r["id"] == "cmpl-xyz" and [c["prompt_token_ids"] for c in r["choices"]] == ids
        for c in r["choices"]:
            assert tok.decode(c["token_ids"]).rstrip("\ufffd") == c["text"].rstrip("\ufffd")
            assert len(c["token_ids"]) == 12
        chunks = [json.loads(line[6:]) for line in http.post("/v1/completions", json={
            "prompt": prompts, "stream": True, **kw}).text.splitlines() if line.startswith("data: {")]
        for i in range(2):
            mine = [ch for c in chunks for ch in c["choices"] if ch["index"] == i]
            assert mine[0]["prompt_token_ids"] == ids[i] and all("prompt_token_ids" not in ch for ch in mine[1:])
            assert [t for ch in mine for t in ch["token_ids"]] == r["choices"][i]["token_ids"]
        scored = http.post("/v1/completions", json={"prompt": prompts[0], "max_tokens": 0, "echo": True,
                                                    "return_token_ids": True}).json()["choices"][0]
        assert scored["prompt_token_ids"] == ids[0] and scored["token_ids"] == []
        bad = http.post("/v1/completions", json={"prompt": "hi", "request_id": "has space"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "request_id"
    assert_engine_clean(engine)


def test_beam_search_takes_the_generation_config_cap_and_leaves_its_end_token_out(model):
    """Served beam search is capped by the model's generation config's max_tokens as any request is (it had run
    each beam to the end of the context); a beam that ended on an end-of-sequence token leaves that token's text
    out unless include_stop_str_in_output (vLLM's), offline and served."""
    from picovllm import LLM, BeamSearchParams, SamplingParams
    llm = LLM(model, num_kv_blocks=64, max_model_len=256, async_scheduling=False)
    prompt = "The capital of France is"
    first = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)[0].outputs[0]
    llm.engine.eos_token_ids = [first.token_ids[0]]      # an ordinary token, greedy's first: a beam ends on it
    for keep in (False, True):
        beams = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=4,
                                                           include_stop_str_in_output=keep))[0].sequences
        ended = next(b for b in beams if b.finish_reason == "stop")
        text = llm.engine.tokenizer.decode(first.token_ids, skip_special_tokens=True)
        assert ended.output_token_ids == first.token_ids and ended.text == (text if keep else "") and text
    assert_engine_clean(llm.engine)
    engine, http = _served(model, sampling_defaults={"max_tokens": 4})
    with http:
        for extra in ({}, {"max_tokens": 50}):
            r = http.post("/v1/completions", json={"prompt": prompt, "n": 2, "use_beam_search": True,
                                                   "ignore_eos": True, **extra}).json()
            assert r["usage"]["completion_tokens"] == 2 * 4, extra
    assert_engine_clean(engine)


def test_responses_cut_by_max_output_tokens_mark_their_last_item_incomplete(model):
    """A response max_output_tokens cut is incomplete, and so is its last output item (OpenAI's), streamed or not;
    a named function's call cut short is that call, with the arguments so far, both ways (as chat answers it)."""
    tool = {"type": "function", "name": "get_weather", "parameters": {     # arguments 3 tokens cannot finish
        "type": "object", "properties": {"city": {"type": "string", "minLength": 40}}, "required": ["city"]}}
    engine, http = _served(model, max_model_len=512)     # the tools' system message is ~340 tokens
    with http:
        for extra, kind in (({}, "message"), ({"tools": [tool], "tool_choice": {"type": "function",
                                                                                 "name": "get_weather"}},
                                              "function_call")):
            body = {"input": "Tell me a story", "max_output_tokens": 3, **extra}
            whole = http.post("/v1/responses", json=body).json()
            events = [json.loads(line[6:]) for line in http.post("/v1/responses", json={**body, "stream": True})
                      .text.splitlines() if line.startswith("data: ")]
            streamed = events[-1]["response"]
            assert events[-1]["type"] == "response.incomplete"
            for got in (whole, streamed):
                assert got["status"] == "incomplete" and got["incomplete_details"] == {"reason": "max_output_tokens"}
                assert [(o["type"], o["status"]) for o in got["output"]] == [(kind, "incomplete")], got["output"]
            done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
            assert [o["status"] for o in done] == ["incomplete"]
            if kind == "function_call":
                assert whole["output"][0]["arguments"] == streamed["output"][0]["arguments"] != ""
    assert_engine_clean(engine)


def test_cache_salt_keeps_prefix_caches_apart(model):
    """vLLM's cache_salt: a prompt cached under one salt is no hit under another, or without one; under the same salt
    it is (the server and LLM's prompt dicts). The salt changes nothing else: greedy outputs are the same."""
    from picovllm import LLM, SamplingParams
    prompt = "The capital of France is Paris. Tell me a story about a cat who lives on the moon."
    engine, http = _served(model)
    with http:
        def cached(**extra) -> tuple[int, str]:
            r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "temperature": 0, **extra})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"], r.json()["choices"][0]["text"]

        first, text = cached(cache_salt="tenant-a")
        again, other, unsalted, same = (cached(cache_salt="tenant-a"), cached(cache_salt="tenant-b"), cached(),
                                        cached(cache_salt="tenant-a"))
        assert first == 0 and again[0] > 0 and other[0] == 0 and unsalted[0] == 0 and same[0] == again[0]
        assert {text, again[1], other[1], unsalted[1]} == {text}
        r = http.post("/v1/completions", json={"prompt": prompt, "cache_salt": ""})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
    assert_engine_clean(engine)
    llm = LLM(model, num_kv_blocks=64, max_model_len=256, async_scheduling=False)
    params = SamplingParams(max_tokens=2, temperature=0)
    outs = [llm.generate(p, params, use_tqdm=False)[0] for p in (
        {"prompt": prompt, "cache_salt": "a"}, {"prompt": prompt, "cache_salt": "b"}, {"prompt": prompt},
        {"prompt": prompt, "cache_salt": "b"})]
    assert [o.num_cached_tokens > 0 for o in outs] == [False, False, False, True]
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate({"prompt": prompt, "cache_salt": 7}, params, use_tqdm=False)
    assert_engine_clean(llm.engine)


def test_embeddings_in_vllm_dtypes_and_byte_orders(model):
    """/v1/embeddings' base64 in vLLM's embed_dtype (float32, float16, bfloat16) and endianness, against the float
    embedding rounded by torch; "float" in another dtype gives the rounded values."""
    import torch
    engine, http = _served(model, runner="pooling")
    with http:
        def embed(**extra):
            r = http.post("/v1/embeddings", json={"input": "hello there", **extra})
            assert r.status_code == 200, r.text
            return r.json()["data"][0]["embedding"]

        floats = torch.tensor(embed(), dtype=torch.float64)
        for dtype, torch_dtype, fmt in (("float32", torch.float32, "f"), ("float16", torch.float16, "e"),
                                        ("bfloat16", torch.bfloat16, None)):
            rounded = floats.to(torch_dtype)
            for order, prefix in (("little", "<"), ("big", ">"), ("native", "=")):
                raw = base64.b64decode(embed(encoding_format="base64", embed_dtype=dtype, endianness=order))
                assert len(raw) == floats.numel() * rounded.element_size()
                if fmt is None:     # bfloat16: the top half of float32's bits
                    bits = struct.unpack(f"{prefix}{floats.numel()}H", raw)
                    got = torch.tensor([struct.unpack("<f", struct.pack("<I", b << 16))[0] for b in bits])
                else:
                    got = torch.tensor(struct.unpack(f"{prefix}{floats.numel()}{fmt}", raw))
                assert torch.equal(got.to(torch_dtype), rounded), (dtype, order)
            as_floats = torch.tensor(embed(embed_dtype=dtype), dtype=torch.float64)
            assert torch.equal(as_floats, rounded.to(torch.float64)), dtype
        r = http.post("/v1/embeddings", json={"input": "hi", "embed_dtype": "fp8_e4m3"})
        assert r.status_code == 400 and "embed_dtype" in r.json()["error"]["message"]
    assert_engine_clean(engine)


def test_embeddings_take_vllms_request_id(model):
    """/v1/embeddings' request_id (vLLM's) names the response, embd-<id>, as the generation endpoints' ids do (it had
    been dropped: a random id came back); two requests of one id at once each get their own embeddings, those of the
    same inputs without an id. An id that is not printable ASCII without spaces is a 400 naming it."""
    from concurrent.futures import ThreadPoolExecutor
    engine, http = _served(model, runner="pooling")
    inputs = [["hello there", "the capital of France"], ["a cat on the moon"]]
    with http:
        plain = [http.post("/v1/embeddings", json={"input": x}).json() for x in inputs]
        assert all(p["id"].startswith("embd-") for p in plain)
        with ThreadPoolExecutor(2) as pool:
            named = list(pool.map(lambda x: http.post("/v1/embeddings", json={"input": x, "request_id": "e-1"}),
                                  inputs))
        for r, p in zip(named, plain):
            assert r.status_code == 200, r.text
            assert r.json()["id"] == "embd-e-1" and r.json()["data"] == p["data"]
        bad = http.post("/v1/embeddings", json={"input": "hi", "request_id": "has space"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "request_id"
    assert_engine_clean(engine)

def test_request_ids_clients_choose_never_meet_in_the_engine(model):
    """Clients choose request ids: one sends "c-1" while another's n=2 request "c" runs its samples; the same id
    twice at once. Each gets its own answer under its id: the engine's ids carry a random tag (an n=2 sample had
    been `c-1` too, and one of them got a 500 "already in use")."""
    from concurrent.futures import ThreadPoolExecutor
    engine, http = _served(model)
    with http:
        def post(body: dict) -> tuple[int, dict]:
            r = http.post("/v1/completions", json={"prompt": "Tell me a story", "temperature": 0, **body})
            return r.status_code, r.json()
        bodies = [{"request_id": "c-1", "max_tokens": 40, "ignore_eos": True},
                  {"request_id": "c", "n": 2, "max_tokens": 5, "ignore_eos": True},
                  {"request_id": "same", "max_tokens": 5}, {"request_id": "same", "max_tokens": 5}]
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(post, bodies))
    assert [code for code, _ in answers] == [200] * 4, answers
    assert [a["id"] for _, a in answers] == ["cmpl-c-1", "cmpl-c", "cmpl-same", "cmpl-same"]
    assert len(answers[1][1]["choices"]) == 2 and answers[2][1]["choices"] == answers[3][1]["choices"]
    assert_engine_clean(engine)


def _wordpiece_model(model: str, path: str):
    """model's weights with a WordPiece tokenizer, whose decoder joins tokens with spaces, special ones too (BERT's):
    '[CLS] [SEP]' where two added tokens meet."""
    import shutil
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    shutil.copytree(model, path)     # its tokenizer's files overwritten below
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "[CLS]", "[SEP]", "hello", "world", "##s"])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Whitespace(), decoders.WordPiece()
    tok = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                  cls_token="[CLS]", sep_token="[SEP]")
    tok.save_pretrained(path)
    return tok


def test_spaces_between_special_tokens_false_is_served(model, tmp_path):
    """spaces_between_special_tokens: false (with skip_special_tokens: false) leaves out the space a WordPiece decoder
    puts between two special tokens in a row, on both endpoints and in a beam's text (the server had dropped the
    field: the text kept the spaces). True is the tokenizer's own decode."""
    import asyncio
    from picovllm.entrypoints.openai.tokenizer_worker import TokenizerWorker
    tok = _wordpiece_model(model, str(tmp_path / "wordpiece"))
    cls, sep = tok.convert_tokens_to_ids(["[CLS]", "[SEP]"])
    hello, world = tok.convert_tokens_to_ids(["hello", "world"])
    engine, http = _served(str(tmp_path / "wordpiece"))
    with http:
        texts = {}
        for flag in (True, False):
            r = http.post("/v1/completions", json={
                "prompt": "hello", "max_tokens": 3, "temperature": 0, "logit_bias": {str(cls): 100},
                "ignore_eos": True, "skip_special_tokens": False, "spaces_between_special_tokens": flag,
                "return_token_ids": True}).json()["choices"][0]
            assert r["token_ids"] == [cls] * 3
            texts[flag] = r["text"]
        prompt = tok.encode("hello", add_special_tokens=False)
        assert texts[True] == tok.decode(prompt + [cls] * 3)[len(tok.decode(prompt)):] == " [CLS] [CLS] [CLS]"
        assert texts[False] == " [CLS][CLS][CLS]"
        # skipping the special tokens, the switch changes nothing (vLLM's)
        r = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3, "temperature": 0,
                                               "logit_bias": {str(cls): 100}, "ignore_eos": True,
                                               "spaces_between_special_tokens": False}).json()["choices"][0]
        assert r["text"] == ""
    assert_engine_clean(engine)
    # a beam's text is decoded whole (serving_beam.serve_beam_search): the same rule
    worker = TokenizerWorker(tok)
    ids = [hello, cls, sep, cls, world]
    assert tok.decode(ids) == "hello [CLS] [SEP] [CLS] world"
    assert asyncio.run(worker.decode(ids, False, True)) == tok.decode(ids)
    assert asyncio.run(worker.decode(ids, False, False)) == "hello [CLS][SEP][CLS] world"
    assert asyncio.run(worker.decode(ids, True, False)) == tok.decode(ids, skip_special_tokens=True) == "hello world"
    worker.shutdown()
