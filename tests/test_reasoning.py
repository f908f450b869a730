"""--reasoning-parser (vLLM's): a thinking model's <think> ... </think> apart from its answer.

Oracles: hand-split texts; the whole answer's split against every way of streaming it in pieces; and a served
model's reasoning and content against LLM.chat's text on the same weights and seed, split where the text (found by
the test) has its </think>."""
import random
import signal

import openai
import pytest

from picovllm import LLM, SamplingParams
from picovllm.entrypoints.openai.reasoning import ReasoningSplitter, opened_in_prompt, split_reasoning
from serving_fixtures import ServerProcess, build_tiny_chat_model


@pytest.mark.parametrize("text, opened, want", [
    ("<think>plan it</think>\n\nThe answer", False, ("plan it", "\n\nThe answer")),    # Qwen3: the model opens
    ("  \n<think>a</think>b", False, ("a", "b")),                                       # after whitespace
    ("The answer", False, (None, "The answer")),                                        # no block: all content
    ("<thinking>x", False, (None, "<thinking>x")),                                      # not the tag
    ("<think>cut off by max_tokens", False, ("cut off by max_tokens", None)),          # never closed
    ("plan</think>answer", True, ("plan", "answer")),                                   # R1: the prompt opened it
    ("<think>plan</think>answer", True, ("plan", "answer")),                            # its own <think> dropped
    ("plan with no end", True, ("plan with no end", None)),
    ("a</think>b</think>c", True, ("a", "b</think>c")),                                 # the first end closes it
    ("", False, (None, "")),
])
def test_split_by_hand(text, opened, want):
    assert split_reasoning(text, opened) == want


def test_streamed_pieces_add_up_to_the_whole_split():
    """Every text, cut at every one and two places, and in random pieces, streams to the split of the whole."""
    texts = ["<think>ab</think>cd", " <think></think>x", "<thi", "<think>a</thin", "a</think>", "x</think>y</think>",
             "<think>a<b</think>c<", "plain <think> later", "", "  "]
    rng = random.Random(0)
    for text in texts:
        for opened in (False, True):
            want = split_reasoning(text, opened)
            cuts = [[i] for i in range(len(text) + 1)] + [[i, j] for i in range(len(text) + 1)
                                                           for j in range(i, len(text) + 1)]
            cuts += [sorted(rng.sample(range(len(text) + 1), min(3, len(text) + 1))) for _ in range(20)]
            for cut in cuts:
                bounds = [0, *cut, len(text)]
                pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
                s = ReasoningSplitter(opened)
                got = [s.feed(p, k == len(pieces) - 1) for k, p in enumerate(pieces)]
                reasoning, content = "".join(r for r, _ in got), "".join(c for _, c in got)
                assert reasoning == (want[0] or "") and content == (want[1] or ""), (text, opened, pieces)


def test_a_prompt_opens_a_block_when_it_ends_with_think():
    assert opened_in_prompt("<|im_start|>assistant\n<think>\n")
    assert not opened_in_prompt("<|im_start|>assistant\n<think>\n\n</think>\n\n")      # enable_thinking false
    assert not opened_in_prompt("<|im_start|>assistant\n")
    assert not opened_in_prompt("<|im_start|>assistant\n<think><|im_end|>\n<|im_start|>assistant\n")  # an old one
    assert opened_in_prompt("<think>old</think> then <think>")


ENGINE_ARGS = ["--block-size", "16", "--num-kv-blocks", "256", "--max-model-len", "256"]
# DeepSeek-R1's way (and Qwen3.5's): the generation prompt opens the think block, unless thinking is off
THINKING = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
            "{% else %}<think>\n{% endif %}{% endif %}")
ASK = [{"role": "user", "content": "Why is the sky blue?"}]
OFF = {"enable_thinking": False}


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory) -> str:
    """The tiny chat model with <think> and </think> as tokens of their own (added, not special: as Qwen3's and
    DeepSeek-R1's tokenizers have them)."""
    from transformers import AutoTokenizer
    path = build_tiny_chat_model(str(tmp_path_factory.mktemp("thinking") / "model"), vocab_size=400)
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_tokens(["<think>", "</think>"])
    assert max(tok.convert_tokens_to_ids(["<think>", "</think>"])) < 400
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(thinking_model, tmp_path_factory):
    srv = ServerProcess(thinking_model, str(tmp_path_factory.mktemp("log") / "server.log"), *ENGINE_ARGS,
                        "--reasoning-parser", "deepseek_r1", "--chat-template", THINKING)
    yield srv
    assert srv.stop(signal.SIGINT) == 0, srv.log()


@pytest.fixture(scope="module")
def llm(thinking_model):
    return LLM(thinking_model, block_size=16, num_kv_blocks=256, max_model_len=256)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _streamed(client, **kw) -> tuple:
    """(reasoning, content) of a streamed chat reply, and its reasoning tokens where it asked for usage."""
    reasoning = content = ""
    tokens = ()
    for chunk in client.chat.completions.create(stream=True, **kw):
        if chunk.usage is not None:
            tokens = (chunk.usage.completion_tokens_details.reasoning_tokens,)
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        extra = d.model_extra or {}
        assert extra.get("reasoning") == extra.get("reasoning_content")
        reasoning += extra.get("reasoning") or ""
        content += d.content or ""
    return (reasoning, content) + tokens


def _responses(client, **kw) -> list:
    """(type, text) of each output item, from the response object, then its reasoning tokens; streamed, the same
    from the last event, and the deltas add up to the items."""
    def texts(r):
        return [(o.type, o.content[0].text if o.type in ("reasoning", "message") else o.arguments)
                for o in r.output] + [r.usage.output_tokens_details.reasoning_tokens]
    whole = texts(client.responses.create(**kw))
    deltas, final = {}, None
    for e in client.responses.create(stream=True, **kw):
        if e.type in ("response.reasoning_text.delta", "response.output_text.delta"):
            deltas[e.output_index] = deltas.get(e.output_index, "") + e.delta
        elif e.type in ("response.completed", "response.incomplete"):   # incomplete: max_output_tokens cut it
            final = texts(e.response)
    assert final == whole and [deltas.get(i, "") for i in range(len(final) - 1)] == [t for _, t in final[:-1]]
    return whole


def test_served_reasoning_and_content_match_llm_chat(client, llm, thinking_model):
    """The template opens the block: the output up to its </think> is reasoning, the rest content, streamed or
    not (include_reasoning false: the content alone); /v1/responses gives a reasoning item, then the message. The seeds are picked offline where LLM.chat's
    sampled text (biased to the tokens of "a</think>b", so that a close comes by chance) has one inside."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(thinking_model)
    bias = {t: 100.0 for t in tok.encode("a</think>b", add_special_tokens=False)}    # in effect, only these
    params = [SamplingParams(seed=s, temperature=1.0, max_tokens=24, logit_bias=bias) for s in range(40)]
    outs = llm.chat([ASK] * len(params), params, use_tqdm=False, chat_template=THINKING)
    closing = [(p.seed, o.outputs[0]) for p, o in zip(params, outs) if "</think>" in o.outputs[0].text[1:-9]]
    assert closing, [o.outputs[0].text for o in outs]
    model = client.models.list().data[0].id
    end_id = tok.convert_tokens_to_ids("</think>")
    for seed, out in closing[:2]:
        text = out.text
        end = text.index("</think>")
        want = (text[:end], text[end + len("</think>"):])
        thinking = out.token_ids.index(end_id) + 1         # the reasoning's tokens, its </think> included
        kw = dict(model=model, messages=ASK, seed=seed, temperature=1.0, max_tokens=24,
                  logit_bias={str(t): b for t, b in bias.items()})
        got = client.chat.completions.create(**kw)
        msg = got.choices[0].message
        assert (msg.model_extra["reasoning"], msg.content) == want
        assert msg.model_extra["reasoning_content"] == want[0]
        assert got.usage.completion_tokens_details.reasoning_tokens == thinking
        assert _streamed(client, **kw, stream_options={"include_usage": True}) == want + (thinking,)
        kw["extra_body"] = {"include_reasoning": False}      # vLLM's: the reasoning left out, the answer as before
        got = client.chat.completions.create(**kw)
        assert (got.choices[0].message.model_extra["reasoning"], got.choices[0].message.content) == (None, want[1])
        assert got.usage.completion_tokens_details.reasoning_tokens == thinking
        assert _streamed(client, **kw) == ("", want[1])
        del kw["extra_body"]
        got = _responses(client, model=model, input=ASK, temperature=1.0, max_output_tokens=24,
                         extra_body={"seed": seed, "logit_bias": {str(t): b for t, b in bias.items()}})
        assert got == [("reasoning", want[0]), ("message", want[1]), thinking]


def test_served_blocks_that_do_not_close_and_thinking_off(client, llm):
    """A block the output never closes is all reasoning (content null); with thinking off (the template closes an
    empty block) all content (reasoning null): both as LLM.chat's greedy text, streamed or not, and as the
    Responses' items; an earlier turn's reasoning item in the Responses input is accepted (templates drop it)."""
    model = client.models.list().data[0].id
    greedy = SamplingParams(temperature=0, max_tokens=12)
    for kwargs in (None, OFF):
        out = llm.chat([ASK], greedy, use_tqdm=False, chat_template=THINKING, chat_template_kwargs=kwargs)[0]
        text = out.outputs[0].text
        assert "</think>" not in text and not text.lstrip().startswith("<think>")
        want = (text, None) if kwargs is None else (None, text)
        thinking = len(out.outputs[0].token_ids) if kwargs is None else 0      # all of it, or none
        kw = dict(model=model, messages=ASK, temperature=0, max_tokens=12,
                  extra_body={"chat_template_kwargs": kwargs} if kwargs else None)
        got = client.chat.completions.create(**kw)
        assert (got.choices[0].message.model_extra["reasoning"], got.choices[0].message.content) == want
        assert got.usage.completion_tokens_details.reasoning_tokens == thinking
        assert _streamed(client, **kw) == tuple(x or "" for x in want)
    out = llm.chat([ASK], greedy, use_tqdm=False, chat_template=THINKING)[0].outputs[0]
    got = _responses(client, model=model, input=[{"type": "reasoning", "id": "rs_1", "summary": []}, *ASK],
                     temperature=0, max_output_tokens=12)
    assert got == [("reasoning", out.text), len(out.token_ids)]


def test_structured_outputs_are_not_split(client, llm):
    """A grammar governs the whole output: the reply is the constrained text as content, no reasoning."""
    model = client.models.list().data[0].id
    from picovllm import StructuredOutputsParams
    sp = SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex="[a-z]{3,8}"))
    text = llm.chat([ASK], sp, use_tqdm=False, chat_template=THINKING)[0].outputs[0].text
    msg = client.chat.completions.create(model=model, messages=ASK, temperature=0, max_tokens=12,
                                         extra_body={"guided_regex": "[a-z]{3,8}"}).choices[0].message
    assert msg.content == text and msg.model_extra.get("reasoning") is None
