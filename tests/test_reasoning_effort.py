"""Chat's reasoning_effort as vLLM passes it to the chat template: its variable of that name, and enable_thinking
(effort != "none") unless chat_template_kwargs sets it. Oracle: the prompt transformers' apply_chat_template renders
with the equivalent kwargs, on the same tokenizer and messages."""
from __future__ import annotations

import pytest

from serving_fixtures import CHATML, build_tiny_chat_model

USER = [{"role": "user", "content": "Hello"}]
# reads reasoning_effort (GPT-OSS's way: a line of the system message) and, through CHATML, enable_thinking (Qwen3's)
WITH_EFFORT = "{% if reasoning_effort %}<|im_start|>system\nReasoning: {{ reasoning_effort }}<|im_end|>\n{% endif %}" \
              + CHATML
# reads neither
PLAIN = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
EFFORTS = ["none", "minimal", "low", "medium", "high", "xhigh", "max"]     # vLLM's ChatCompletionRequest's


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(the tokenizer, an in-process server over the tiny chat model that takes a request's chat_template)."""
    from fastapi.testclient import TestClient
    from picovllm import EngineConfig
    from picovllm.engine.llm_engine import Engine
    from picovllm.entrypoints.openai.api_server import ServerSettings, build_app
    from picovllm.entrypoints.openai.async_engine import AsyncEngine
    from picovllm.entrypoints.openai.metrics import ServerMetrics
    from picovllm.entrypoints.openai.serving import ServingContext
    from picovllm.entrypoints.openai.tokenizer_worker import TokenizerWorker
    path = build_tiny_chat_model(str(tmp_path_factory.mktemp("effort") / "model"))
    engine = Engine(EngineConfig(model=path, num_kv_blocks=64, max_model_len=256, async_scheduling=False))
    ctx = ServingContext(AsyncEngine(engine), TokenizerWorker(engine.tokenizer, None, True), ServerMetrics("m"), "m",
                         sampling_defaults={})
    with TestClient(build_app(ctx, ServerSettings())) as http:
        yield engine.tokenizer, http
    engine.shutdown()


def prompt_ids(http, **body) -> list[int]:
    r = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1, "return_token_ids": True, **body})
    assert r.status_code == 200, r.text
    return r.json()["prompt_token_ids"]


def hf_ids(tok, template: str, **kw) -> list[int]:
    return list(tok.apply_chat_template(USER, tokenize=True, add_generation_prompt=True, return_dict=False,
                                        chat_template=template, **kw))


@pytest.mark.parametrize("effort", EFFORTS)
def test_qwen3_style_template_gets_enable_thinking(served, effort):
    """A template with enable_thinking and no reasoning_effort variable (Qwen3's): "none" turns thinking off, every
    other effort on, as vLLM sets it."""
    tok, http = served
    got = prompt_ids(http, chat_template=CHATML, reasoning_effort=effort)
    assert got == hf_ids(tok, CHATML, enable_thinking=effort != "none")
    if effort == "none":
        assert got != hf_ids(tok, CHATML)       # (the template's own default: thinking on)


def test_chat_template_kwargs_enable_thinking_wins(served):
    """chat_template_kwargs.enable_thinking is the caller's own: the effort does not override it (vLLM's)."""
    tok, http = served
    for effort, thinking in [("high", False), ("none", True)]:
        got = prompt_ids(http, chat_template=CHATML, reasoning_effort=effort,
                         chat_template_kwargs={"enable_thinking": thinking})
        assert got == hf_ids(tok, CHATML, enable_thinking=thinking), effort


@pytest.mark.parametrize("effort", ["none", "minimal", "xhigh", "max"])
def test_template_variable_and_enable_thinking_together(served, effort):
    """A template that reads both gets both; the request's effort overrides chat_template_kwargs' (vLLM's merge)."""
    tok, http = served
    expect = hf_ids(tok, WITH_EFFORT, reasoning_effort=effort, enable_thinking=effort != "none")
    assert prompt_ids(http, chat_template=WITH_EFFORT, reasoning_effort=effort) == expect
    assert prompt_ids(http, chat_template=WITH_EFFORT, reasoning_effort=effort,
                      chat_template_kwargs={"reasoning_effort": "low"}) == expect


def test_no_effort_changes_nothing(served):
    tok, http = served
    assert prompt_ids(http, chat_template=WITH_EFFORT) == hf_ids(tok, WITH_EFFORT)


def test_refusals_name_the_field(served):
    """A template that reads neither variable (the effort would be ignored: vLLM drops it silently), a value vLLM
    does not take, and completions (a chat field) are 400s naming reasoning_effort."""
    _, http = served
    r = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1, "chat_template": PLAIN,
                                                "reasoning_effort": "high"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort", r.text
    r = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1, "reasoning_effort": "extreme"})
    assert r.status_code == 400 and "reasoning_effort" in r.text, r.text
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "reasoning_effort": "low"})
    assert r.status_code == 400 and "reasoning_effort" in r.text, r.text


def test_options_function_directly():
    """chat_template.reasoning_effort_options, the decision alone; the request takes exactly vLLM's values."""
    import typing
    from picovllm.entrypoints.chat_template import REASONING_EFFORTS, reasoning_effort_options
    from picovllm.entrypoints.openai.protocol import ChatCompletionRequest
    annotation = ChatCompletionRequest.model_fields["reasoning_effort"].annotation
    assert typing.get_args(typing.get_args(annotation)[0]) == REASONING_EFFORTS == tuple(EFFORTS)
    assert reasoning_effort_options(CHATML, "none", None) == (None, {"enable_thinking": False})
    assert reasoning_effort_options(WITH_EFFORT, "low", {"x": 1}) == ("low", {"x": 1, "enable_thinking": True})
    assert reasoning_effort_options(CHATML, None, {"x": 1}) == (None, {"x": 1})
    with pytest.raises(ValueError, match="^reasoning_effort"):
        reasoning_effort_options(PLAIN, "low", None)


def test_responses_reasoning_effort(served):
    """The Responses API's reasoning.effort is chat's reasoning_effort: "none" turns the model's template's thinking
    off (the prompt's length says so); a value vLLM does not take is a 400 naming reasoning.effort."""
    tok, http = served
    for effort, thinking in [("none", False), ("high", True)]:
        r = http.post("/v1/responses", json={"input": "Hello", "max_output_tokens": 1, "reasoning": {"effort": effort}})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["input_tokens"] == len(hf_ids(tok, CHATML, enable_thinking=thinking)), effort
    r = http.post("/v1/responses", json={"input": "Hello", "max_output_tokens": 1, "reasoning": {"effort": "extreme"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning.effort", r.text
