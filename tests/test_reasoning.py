"""--reasoning-parser (vLLM's): a thinking model's <think> ... </think> apart from its answer.

Oracles: hand-split texts; the whole answer's split against every way of streaming it in pieces; and a served
model's reasoning and content against LLM.chat's text on the same weights and seed, split where the text (found by
the test) has its </think>."""
import random
import re
import signal

import openai
import pytest

from picovllm import LLM, SamplingParams, StructuredOutputsParams
from picovllm.layers.structured_output import GrammarState
from picovllm.entrypoints.openai.reasoning import ReasoningSplitter, opened_in_prompt, split_reasoning
from serving_fixtures import ServerProcess, thinking_model  # noqa: F401 - a fixture


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


def test_where_a_prompt_leaves_the_output_by_hand(thinking_model):
    """Scanning back from the prompt's end, its last <think>, </think> or turn boundary (a special token) decides;
    an earlier message's unclosed <think> sits behind a boundary; a continued assistant message inside its block is
    in it, one after its block is past it. The server's split reads the same."""
    from transformers import AutoTokenizer

    from picovllm.reasoning import ANSWER, MAY_OPEN, REASONING, ThinkTags
    tok = AutoTokenizer.from_pretrained(thinking_model)
    tags = ThinkTags.of(tok, "x")
    cases = [("<|im_start|>assistant\n<think>\n", REASONING),                      # R1's template opens it
             ("<|im_start|>assistant\n<think>\n\n</think>\n\n", ANSWER),           # thinking off
             ("<|im_start|>assistant\n", MAY_OPEN),                                   # Qwen3's: the model may
             ("<|im_start|>assistant\n<think><|im_end|>\n<|im_start|>assistant\n", MAY_OPEN),   # an old one
             ("<|im_start|>assistant\n<think>\nLet me see", REASONING),               # continued inside its block
             ("<|im_start|>assistant\n<think>a</think>\nThe answer", ANSWER),         # continued past it
             ("plain text, no tags", MAY_OPEN), ("<think>old</think> then <think>", REASONING)]
    for text, want in cases:
        ids = tok.encode(text, add_special_tokens=False)
        assert tags.phase(ids) == want, text
        assert opened_in_prompt(tags, ids) == (want == REASONING)
    assert tok.convert_tokens_to_ids("<|im_start|>") in tags.boundaries and tags.start not in tags.boundaries


ENGINE_ARGS = ["--block-size", "16", "--num-kv-blocks", "256", "--max-model-len", "512"]   # tools: a long prompt
# DeepSeek-R1's way (and Qwen3.5's): the generation prompt opens the think block, unless thinking is off
THINKING = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
            "{% else %}<think>\n{% endif %}{% endif %}")
ASK = [{"role": "user", "content": "Why is the sky blue?"}]
OFF = {"enable_thinking": False}


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


def _biased_seeds(llm, tok, n: int = 40, template: str = THINKING) -> tuple[dict, list]:
    """A logit bias that leaves only the tokens of "a</think>b" (while nothing masks them), and the seeds where
    LLM.chat's sampled text under it (no grammar) closes a block: (seed, output) pairs."""
    bias = {t: 100.0 for t in tok.encode("a</think>b", add_special_tokens=False)}
    params = [SamplingParams(seed=s, temperature=1.0, max_tokens=24, logit_bias=bias) for s in range(n)]
    outs = llm.chat([ASK] * n, params, use_tqdm=False, chat_template=template)
    return bias, [(p.seed, o.outputs[0]) for p, o in zip(params, outs) if "</think>" in o.outputs[0].text[:-1]]


REGEX = "[ab]{2,6}"


def test_served_structured_outputs_follow_the_reasoning(client, llm, thinking_model):
    """With the parser, serve's engine holds a grammar back until the block ends (vLLM's way): the reasoning is the
    unconstrained sample's text up to its </think> (same seed: the grammar touched none of it), the content after
    it matches the grammar, streamed or not. Without a parser (LLM.chat here) the grammar governs the whole output."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(thinking_model)
    bias, closing = _biased_seeds(llm, tok)
    assert closing
    model = client.models.list().data[0].id
    end_id = tok.convert_tokens_to_ids("</think>")
    for seed, out in closing[:3]:
        thought = out.text[:out.text.index("</think>")]
        kw = dict(model=model, messages=ASK, seed=seed, temperature=1.0, max_tokens=24,
                  logit_bias={str(t): b for t, b in bias.items()}, extra_body={"guided_regex": REGEX})
        got = client.chat.completions.create(**kw)
        msg = got.choices[0].message
        assert msg.model_extra["reasoning"] == thought and re.fullmatch(REGEX, msg.content), (thought, msg)
        assert got.usage.completion_tokens_details.reasoning_tokens == out.token_ids.index(end_id) + 1
        assert _streamed(client, **kw) == (thought, msg.content)
    sp = SamplingParams(temperature=1.0, seed=closing[0][0], max_tokens=24, logit_bias=bias,
                        structured_outputs=StructuredOutputsParams(regex=REGEX))
    whole = llm.chat([ASK], sp, use_tqdm=False, chat_template=THINKING)[0].outputs[0].text
    assert re.fullmatch(REGEX, whole)


def test_served_named_tool_call_after_the_reasoning(client, thinking_model):
    """A named tool_choice constrains the answer after the block: the reply has the reasoning, then a call whose
    arguments validate against the function's schema, streamed or not."""
    import json
    import jsonschema
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(thinking_model)
    schema = {"type": "object", "properties": {"x": {"enum": ["a", "b"]}}, "required": ["x"],
              "additionalProperties": False}
    kw = dict(model=client.models.list().data[0].id, messages=ASK, temperature=1.0, max_tokens=64,
              tools=[{"type": "function", "function": {"name": "pick", "parameters": schema}}],
              tool_choice={"type": "function", "function": {"name": "pick"}},
              logit_bias={str(t): 100.0 for t in tok.encode("a</think>b", add_special_tokens=False)})
    for seed in range(3):
        msg = client.chat.completions.create(seed=seed, **kw).choices[0].message
        thought = msg.model_extra["reasoning"]
        assert thought is not None and "</think>" not in thought, msg
        assert [c.function.name for c in msg.tool_calls] == ["pick"]
        jsonschema.validate(json.loads(msg.tool_calls[0].function.arguments), schema)
        reasoning, args = "", ""
        for chunk in client.chat.completions.create(seed=seed, stream=True, **kw):
            d = chunk.choices[0].delta if chunk.choices else None
            reasoning += (d.model_extra or {}).get("reasoning") or "" if d else ""
            args += "".join(c.function.arguments or "" for c in (d.tool_calls or [])) if d else ""
        assert (reasoning, args) == (thought, msg.tool_calls[0].function.arguments)
    required = dict(kw, tool_choice="required", max_tokens=140)    # the calls come whole at the end, from the content
    for seed in range(2):
        got = client.chat.completions.create(seed=seed, **required).choices[0]
        assert got.finish_reason == "tool_calls" and {c.function.name for c in got.message.tool_calls} == {"pick"}
        assert got.message.model_extra["reasoning"] is not None
        calls, content, finish = [], "", None
        for chunk in client.chat.completions.create(seed=seed, stream=True, **required):
            d = chunk.choices[0].delta if chunk.choices else None
            calls += [(c.function.name, c.function.arguments) for c in (d.tool_calls or [])] if d else []
            content += (d.content or "") if d else ""
            finish = chunk.choices[0].finish_reason if chunk.choices and chunk.choices[0].finish_reason else finish
        assert (calls, content, finish) == ([(c.function.name, c.function.arguments) for c in got.message.tool_calls],
                                            "", "tool_calls")
    # an output that ends inside the block (the end of text at once) has no call, streamed or not
    eos = dict(kw, logit_bias={str(tok.convert_tokens_to_ids("<|im_end|>")): 100.0})
    got = client.chat.completions.create(**eos).choices[0]
    assert (got.message.tool_calls, got.message.content, got.finish_reason) == (None, None, "stop")
    chunks = list(client.chat.completions.create(stream=True, **eos))
    assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


# Qwen3's way: the model opens the block itself (the generation prompt leaves it to the model), unless thinking is off
QWEN3 = THINKING.replace("{% else %}<think>\n{% endif %}", "{% endif %}")


@pytest.fixture(scope="module", params=[("config", False), ("request", True)], ids=["config", "request-overlap"])
def gated(thinking_model, request):
    """An engine that holds structured outputs' grammar back until the think block ends: for every request
    (EngineConfig.reasoning_parser), or for those whose constraint asks (StructuredOutputsParams.reasoning_parser,
    an OpenAI front end's way), overlapped (the grammar's late masks); and the constraint's extra field."""
    by_config, overlap = request.param[0] == "config", request.param[1]
    llm = LLM(thinking_model, block_size=16, num_kv_blocks=256, max_model_len=256, async_scheduling=overlap,
              reasoning_parser="qwen3" if by_config else None)
    return llm, {} if by_config else {"reasoning_parser": "deepseek_r1"}


def test_grammar_waits_for_the_block_the_prompt_opens(gated, llm, thinking_model):
    """DeepSeek-R1's template opens the block: the gated engine's tokens up to </think> are the unconstrained
    sample's (same seed), the text after it matches the grammar; every block free afterwards."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(thinking_model)
    bias, closing = _biased_seeds(llm, tok)
    assert closing
    end_id = tok.convert_tokens_to_ids("</think>")
    gated_llm, extra = gated
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=24, logit_bias=bias,
                             structured_outputs=StructuredOutputsParams(regex=REGEX, **extra)) for seed, _ in closing]
    outs = gated_llm.chat([ASK] * len(params), params, use_tqdm=False, chat_template=THINKING)
    for (seed, free), o in zip(closing, outs):
        ids, text = o.outputs[0].token_ids, o.outputs[0].text
        cut = free.token_ids.index(end_id) + 1
        assert ids[:cut] == free.token_ids[:cut], seed
        assert re.fullmatch(REGEX, text[text.index("</think>") + len("</think>"):]), text
    bm = gated_llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_grammar_waits_in_a_continued_message_s_open_block(gated, llm, thinking_model):
    """continue_final_message with an assistant message cut inside its think block: the output goes on in the block
    (its tokens up to </think> are the unconstrained sample's), then the grammar governs."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(thinking_model)
    gated_llm, extra = gated
    bias = {t: 100.0 for t in tok.encode("a</think>b", add_special_tokens=False)}
    conv = ASK + [{"role": "assistant", "content": "<think>\nLet me see"}]
    kw = dict(use_tqdm=False, chat_template=QWEN3, add_generation_prompt=False, continue_final_message=True)
    free = [SamplingParams(seed=s, temperature=1.0, max_tokens=24, logit_bias=bias) for s in range(12)]
    frees = [o.outputs[0] for o in llm.chat([conv] * len(free), free, **kw)]
    end_id = tok.convert_tokens_to_ids("</think>")
    closing = [(p.seed, o) for p, o in zip(free, frees) if end_id in o.token_ids[:-1]]
    assert closing
    params = [SamplingParams(seed=seed, temperature=1.0, max_tokens=24, logit_bias=bias,
                             structured_outputs=StructuredOutputsParams(regex=REGEX, **extra)) for seed, _ in closing]
    for (seed, f), o in zip(closing, gated_llm.chat([conv] * len(params), params, **kw)):
        ids, cut = o.outputs[0].token_ids, f.token_ids.index(end_id) + 1
        assert ids[:cut] == f.token_ids[:cut], seed
        assert re.fullmatch(REGEX, tok.decode(ids[cut:], skip_special_tokens=True)), o.outputs[0].text


def test_grammar_lets_the_model_open_a_block_or_starts_after_a_closed_one(gated, thinking_model):
    """Qwen3's template: the first token may be <think> (besides the grammar's), a block the model opens holds no
    mask until its </think>, and the grammar governs the rest; with thinking off (the prompt closes an empty
    block) the grammar governs from the first token, <think> masked however it is biased."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(thinking_model)
    start, end = tok.convert_tokens_to_ids(["<think>", "</think>"])
    bias = {start: 30.0, end: 30.0}     # under no mask, these two outweigh the rest
    gated_llm, extra = gated
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=40, logit_bias=bias,
                             structured_outputs=StructuredOutputsParams(regex=REGEX, **extra)) for s in range(8)]
    for kwargs in (None, OFF):
        outs = gated_llm.chat([ASK] * len(params), params, use_tqdm=False, chat_template=QWEN3,
                              chat_template_kwargs=kwargs)
        for o in outs:
            ids, text = o.outputs[0].token_ids, o.outputs[0].text
            if kwargs is None:
                assert ids[0] == start and end in ids, text
                k = ids.index(end)
                assert set(ids[1:k]) <= {start}, text      # inside the block only the biased two: no mask there
                text = tok.decode(ids[k + 1:], skip_special_tokens=True)
            assert re.fullmatch(REGEX, text), text


def test_a_gate_by_hand(thinking_model):
    """The gate's phases, token by token, against xgrammar's own verdicts and masks on a matcher of the same
    grammar; the first token's mask is the grammar's plus <think> (at bit 31 of a word too); a tokenizer without the
    tags is refused naming the field."""
    import torch
    from transformers import AutoTokenizer
    from picovllm.layers.structured_output import BitmaskBuffers, StructuredOutputCompiler
    from picovllm.reasoning import ANSWER, MAY_OPEN, REASONING, ThinkTags, think_token_ids
    tok = AutoTokenizer.from_pretrained(thinking_model)
    so = StructuredOutputsParams(regex=REGEX)
    compiler = StructuredOutputCompiler(tok, 400, [tok.eos_token_id])
    gate = ThinkTags.of(tok, "EngineConfig.reasoning_parser 'qwen3'")
    a, q = tok.encode("a", add_special_tokens=False)[0], tok.encode("Q", add_special_tokens=False)[0]

    def mask(state) -> list[int]:
        buffers = BitmaskBuffers(400, torch.device("cpu"))
        m = buffers.for_step(1)
        m.fill([0], [state])
        return [t for t in range(400) if (int(m.words[0, t // 32]) >> (t % 32)) & 1]

    plain = compiler.new_state(so)
    s = compiler.new_state(so, gate, MAY_OPEN)
    assert mask(s) == sorted(mask(plain) + [gate.start]) and gate.end not in mask(s)
    assert s.accept(gate.start) and s.phase == REASONING and not s.masked
    for t in (q, gate.start, a, q):        # anything inside the block, a second <think> included
        assert s.accept(t) and s.phase == REASONING
    assert s.accept(gate.end) and s.phase == ANSWER and s.masked and s.num_accepted == 6
    assert mask(s) == mask(plain)
    assert not s.accept(q) and not s.accept(gate.start) and s.accept(a) and plain.accept(a)
    assert mask(s) == mask(plain)
    s = compiler.new_state(so, gate, MAY_OPEN)      # a first token of the grammar's: no block, the grammar's from now
    assert not s.accept(q) and s.phase == MAY_OPEN
    assert s.accept(a) and s.phase == ANSWER and not s.accept(gate.start)
    r, g = compiler.new_state(so, gate, REASONING), compiler.new_state(so)     # accept_all with a gated row
    assert GrammarState.accept_all([r, g], [q, q]) == [True, False] and r.phase == REASONING
    assert GrammarState.accept_all([r, g], [gate.end, a]) == [True, True] and r.phase == ANSWER
    base = mask(compiler.new_state(so))
    for start in (31, 63):      # the sign bit of an int32 word
        fake = ThinkTags(start, gate.end)
        assert start not in base and mask(compiler.new_state(so, fake, MAY_OPEN)) == sorted(base + [start])

    class Untagged:
        def encode(self, text, add_special_tokens=False):
            return [1, 2, 3]
    with pytest.raises(ValueError, match="EngineConfig.reasoning_parser 'qwen3': the tokenizer has no <think>"):
        think_token_ids(Untagged(), "EngineConfig.reasoning_parser 'qwen3'")


def test_reasoning_parser_is_validated(tmp_path_factory):
    """Bad names, and a tokenizer without the think tokens, are refused naming the field (the other requests run)."""
    from picovllm.config import EngineConfig
    from serving_fixtures import build_tiny_chat_model
    with pytest.raises(ValueError, match="EngineConfig.reasoning_parser must be None or one of 'qwen3'"):
        EngineConfig(reasoning_parser="qwen")
    with pytest.raises(ValueError, match="structured_outputs.reasoning_parser must be None or one of 'qwen3'"):
        StructuredOutputsParams(regex="a", reasoning_parser="r1")
    plain = build_tiny_chat_model(str(tmp_path_factory.mktemp("plain") / "model"))
    with pytest.raises(ValueError, match="EngineConfig.reasoning_parser 'qwen3': the tokenizer has no <think>"):
        LLM(plain, num_kv_blocks=16, reasoning_parser="qwen3")
    llm = LLM(plain, block_size=16, num_kv_blocks=32, max_model_len=128)
    so = StructuredOutputsParams(regex="a+", reasoning_parser="qwen3")
    asks = SamplingParams(max_tokens=2, structured_outputs=so)
    with pytest.raises(ValueError, match="structured_outputs.reasoning_parser 'qwen3': the tokenizer has no <think>"):
        llm.engine.add_request("hi", asks)
    out = llm.generate(["hi"], SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(regex="a+")),
                       use_tqdm=False)[0].outputs[0]
    assert re.fullmatch("a+", out.text) and llm.engine.block_manager.num_free_blocks == 32


def test_responses_empty_reasoning_makes_no_item_streamed_or_not(client, thinking_model):
    """A block that closes at once (`</think>` first: the reasoning is empty) gives no reasoning item, streamed or
    not: the response object had an empty one that its stream never announced (no delta, no item)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(thinking_model)
    end = tok.convert_tokens_to_ids("</think>")
    model = client.models.list().data[0].id
    got = _responses(client, model=model, input=ASK, temperature=0, max_output_tokens=1,
                     extra_body={"logit_bias": {str(end): 100}})
    assert got == [1]      # no item; the </think> is the reasoning's token
