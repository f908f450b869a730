"""Chat templates as transformers renders them (the oracle: its apply_chat_template on the same tokenizer and
messages), through the server's /tokenize and chat routes and LLM.chat."""
from __future__ import annotations

import shutil

import pytest

from conftest import assert_engine_clean
from serving_fixtures import CHATML, build_tiny_chat_model

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
USER = [{"role": "user", "content": "Hello"}]
# loops over a message's parts, as Gemma 3's template does
PARTS_LOOP = ("{{ bos_token }}{%- for message in messages -%}<start_of_turn>{{ message['role'] }}\n"
              "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
              "{%- else -%}{%- for item in message['content'] -%}{%- if item['type'] == 'text' -%}"
              "{{ item['text'] | trim }}{%- endif -%}{%- endfor -%}{%- endif -%}<end_of_turn>\n{%- endfor -%}"
              "{%- if add_generation_prompt -%}<start_of_turn>model\n{%- endif -%}")
# renders tools, and an assistant's earlier calls with their arguments through tojson (Qwen's way)
WITH_TOOLS = ("{% if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t.function.name }} {% endfor %}"
              "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
              "{% for tc in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ tc.function.name }}\", \"arguments\": "
              "{{ tc.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return build_tiny_chat_model(str(tmp_path_factory.mktemp("templates") / "model"))


def _served(path: str, template: str | None = None, sampling_defaults: dict | None = None, **engine_kw):
    from fastapi.testclient import TestClient
    from picovllm import EngineConfig
    from picovllm.engine.llm_engine import Engine
    from picovllm.entrypoints.openai.api_server import ServerSettings, build_app
    from picovllm.entrypoints.openai.async_engine import AsyncEngine
    from picovllm.entrypoints.openai.metrics import ServerMetrics
    from picovllm.entrypoints.openai.serving import ServingContext
    from picovllm.entrypoints.openai.tokenizer_worker import TokenizerWorker
    engine = Engine(EngineConfig(**{"model": path, "num_kv_blocks": 64, "max_model_len": 256,
                                    "async_scheduling": False, **engine_kw}))
    ctx = ServingContext(AsyncEngine(engine), TokenizerWorker(engine.tokenizer, template, True), ServerMetrics("m"),
                         "m", sampling_defaults=sampling_defaults or {})
    return engine, TestClient(build_app(ctx, ServerSettings()))


def _hf_ids(tok, messages, **kw) -> list[int]:
    return list(tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False, **kw))


def test_named_templates_as_transformers_picks_them(model, tmp_path):
    """A tokenizer with several named templates (Hermes-2-Pro's, Command-R's): "default", or "tool_use" when tools
    come, as transformers picks; the server, /tokenize and LLM.chat had failed on the dict."""
    from transformers import AutoTokenizer
    from picovllm import LLM, SamplingParams
    path = str(tmp_path / "named")
    shutil.copytree(model, path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = {"default": CHATML, "tool_use": "{% if tools %}TOOLS {{ tools | length }}\n{% endif %}" + CHATML}
    tok.save_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    plain, with_tools = _hf_ids(tok, USER), _hf_ids(tok, USER, tools=TOOLS)
    assert plain != with_tools
    engine, http = _served(path)
    with http:
        assert http.post("/tokenize", json={"messages": USER}).json()["tokens"] == plain
        assert http.post("/tokenize", json={"messages": USER, "tools": TOOLS}).json()["tokens"] == with_tools
        r = http.post("/v1/chat/completions", json={"messages": USER, "tools": TOOLS, "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(with_tools)
    assert_engine_clean(engine)
    llm = LLM(path, num_kv_blocks=64, max_model_len=256, async_scheduling=False)
    params = SamplingParams(max_tokens=1)
    assert llm.chat(USER, params, use_tqdm=False)[0].prompt_token_ids == plain
    assert llm.chat(USER, params, use_tqdm=False, tools=TOOLS)[0].prompt_token_ids == with_tools


def test_templates_with_loop_controls_and_generation_blocks(model):
    """{% break %}, {% continue %} and {% generation %} (transformers compiles templates with them) are taken by
    --chat-template and a request's chat_template, and render as transformers renders them."""
    from transformers import AutoTokenizer
    from picovllm.entrypoints.chat_template import check_request_template, load_chat_template
    tok = AutoTokenizer.from_pretrained(model)
    loops = ("{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{% if m.role == 'system' %}"
             "{% continue %}{% endif %}<|im_start|>{{ m.role }}\n{% generation %}{{ m.content }}{% endgeneration %}"
             "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    assert load_chat_template(loops) == loops and check_request_template(loops) == loops
    with pytest.raises(ValueError, match="chat_template"):
        check_request_template("{% for m in messages %}{% generation %}{% endfor %}")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": "Hi"}]
    engine, http = _served(model)
    with http:
        got = http.post("/tokenize", json={"messages": messages, "chat_template": loops}).json()["tokens"]
    assert got == _hf_ids(tok, messages, chat_template=loops)
    assert_engine_clean(engine)


def test_content_parts_as_the_template_takes_them(model):
    """Text parts reach a template that loops over a message's content as a list (transformers' rendering, vLLM's
    "openai" content format), and are joined by newlines for one that prints the content (vLLM's "string" format);
    a part that is not text is a 400 naming its type."""
    from transformers import AutoTokenizer
    from picovllm.entrypoints.llm import chat_prompt
    tok = AutoTokenizer.from_pretrained(model)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "how are you"}]}]
    joined = [{"role": "user", "content": "Hello\nhow are you"}]
    looped = _hf_ids(tok, parts, chat_template=PARTS_LOOP)
    assert looped != _hf_ids(tok, joined, chat_template=PARTS_LOOP)
    assert chat_prompt(tok, parts, chat_template=PARTS_LOOP)[1] == looped
    assert chat_prompt(tok, parts)[1] == _hf_ids(tok, joined)
    for template, want in ((PARTS_LOOP, looped), (None, _hf_ids(tok, joined))):
        engine, http = _served(model, template)
        with http:
            assert http.post("/tokenize", json={"messages": parts}).json()["tokens"] == want
            image = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                  {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
            r = http.post("/v1/chat/completions", json={"messages": image, "max_tokens": 1})
            assert r.status_code == 400 and "content[1]" in r.json()["error"]["message"] \
                and "'image_url' is not supported" in r.json()["error"]["message"]
        assert_engine_clean(engine)


def test_tools_and_earlier_calls_in_the_prompt(model):
    """tool_choice "none" still shows the tools to a template that renders them (as transformers and vLLM render
    them); an assistant's earlier call reaches the template with its arguments as an object from LLM.chat as from
    the server."""
    from transformers import AutoTokenizer
    from picovllm.entrypoints.llm import chat_prompt
    tok = AutoTokenizer.from_pretrained(model)
    with_tools = _hf_ids(tok, USER, tools=TOOLS, chat_template=WITH_TOOLS)
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    as_object = [history[0], {**history[1], "content": "", "tool_calls": [
        {**call, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}, history[2]]
    want = _hf_ids(tok, as_object, chat_template=WITH_TOOLS)
    assert chat_prompt(tok, history, chat_template=WITH_TOOLS)[1] == want
    engine, http = _served(model, WITH_TOOLS)
    with http:
        for choice in ("auto", "none"):
            r = http.post("/v1/chat/completions", json={"messages": USER, "tools": TOOLS, "tool_choice": choice,
                                                         "max_tokens": 1})
            assert r.json()["usage"]["prompt_tokens"] == len(with_tools), choice
        assert http.post("/tokenize", json={"messages": history}).json()["tokens"] == want
    assert_engine_clean(engine)
    engine, http = _served(model)      # ChatML renders no tools: under "none" no system message asks for calls
    with http:
        r = http.post("/v1/chat/completions", json={"messages": USER, "tools": TOOLS, "tool_choice": "none",
                                                     "max_tokens": 1}).json()
        assert r["usage"]["prompt_tokens"] == len(_hf_ids(tok, USER))
        described = http.post("/tokenize", json={"messages": USER, "tools": TOOLS}).json()["count"]   # as "auto"
        assert described > len(_hf_ids(tok, USER)) + 100
    assert_engine_clean(engine)
