"""Structured outputs (layers/structured_output.py) on the default model. Oracles: jsonschema validation for
JSON schemas, re.fullmatch for regexes, the choice list itself; for the masking of the logits, a hand-computed
float64 oracle and xgrammar's own bitmask application."""
from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch

from picovllm import LLM, SamplingParams
from picovllm.kernels.cpu import token_mask
from picovllm.layers.structured_output import (BitmaskBuffers, GrammarState, TokenBitmasks, apply_token_bitmasks,
                                               mask_logits)
from picovllm.sampling_params import StructuredOutputsParams
from serving_fixtures import chat_model  # noqa: F401 - a fixture

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = "Answer with one JSON object only."


def allowed_oracle(words: torch.Tensor, vocab: int) -> list[list[bool]]:
    """Token t of row r is allowed iff bit t % 32 of word t // 32 is set (no word: not allowed), by Python ints."""
    w = words.tolist()
    return [[t // 32 < len(row) and (row[t // 32] >> (t % 32)) & 1 == 1 for t in range(vocab)] for row in w]


@pytest.mark.parametrize("vocab,num_words", [(1000, 32), (1000, 30), (64, 2)])   # 30 words: tokens past 960
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mask_logits_matches_a_hand_computed_oracle(vocab, num_words, dtype):
    g = torch.Generator().manual_seed(vocab + num_words)
    words = torch.randint(-2**31, 2**31 - 1, (5, num_words), dtype=torch.int32, generator=g)
    words[1] = 0            # nothing allowed
    words[2] = -1           # everything (within 32 W)
    logits = (torch.randn(5, vocab, generator=g, dtype=torch.float64) * 10)
    logits[3, :7] = float("-inf")           # already banned (e.g. min_tokens) stays banned
    out = mask_logits(logits.to(dtype), words)
    expect = logits.clone()
    for r, row_ok in enumerate(allowed_oracle(words, vocab)):
        for t, ok in enumerate(row_ok):
            if not ok:
                expect[r, t] = float("-inf")
    assert out.dtype == dtype
    assert torch.equal(out.double(), expect.to(dtype).double())
    if dtype == torch.float32 and token_mask.usable(logits.float()):     # the CPU's C path, rows 1 and 3 unmasked
        c_out = token_mask.mask_logits(logits.float(), words[[4, 0, 2]], [1, -1, 2, -1, 0])
        masked = torch.stack([expect[0], logits[1], expect[2], logits[3], expect[4]]).float()
        assert torch.equal(c_out, masked)


def filled_masks(words: torch.Tensor, rows: list[int]) -> TokenBitmasks:
    """TokenBitmasks as the engine would hand the sampler, with `words` already in its buffer."""
    buffers = BitmaskBuffers(32 * words.shape[1], torch.device("cpu"))
    masks = buffers.for_step(words.shape[0])
    masks.words.copy_(words)
    masks.filled = list(rows)
    return masks


def test_bitmask_rows_match_xgrammar_application():
    xgr = pytest.importorskip("xgrammar")
    vocab, g = 1000, torch.Generator().manual_seed(0)
    words = torch.randint(-2**31, 2**31 - 1, (4, (vocab + 31) // 32), dtype=torch.int32, generator=g)
    logits = torch.randn(4, vocab, generator=g)
    out = apply_token_bitmasks(logits, filled_masks(words, [0, 2, 3]))      # row 1: no grammar
    expect = logits.clone()
    xgr.apply_token_bitmask_inplace(expect, words, indices=[0, 2, 3])
    assert torch.equal(out, expect)
    assert torch.isinf(out).any()
    every = apply_token_bitmasks(logits[[0, 2, 3]], filled_masks(words[[0, 2, 3]], [2, 0, 1]))   # all rows
    assert torch.equal(every, expect[[0, 2, 3]])
    assert apply_token_bitmasks(logits, filled_masks(words, [])) is logits   # no row filled: nothing copied
    assert apply_token_bitmasks(logits, None) is logits
    assert not torch.isinf(logits).any()                               # raw logits (logprobs) untouched


def new_grammar(eng, kw: dict) -> GrammarState:
    """The engine's matcher for a request constrained by StructuredOutputsParams(**kw)."""
    return eng.grammar_masks.new_state(SamplingParams(structured_outputs=StructuredOutputsParams(**kw)), (),
                                       eng.eos_token_ids)


def test_buffers_alternate_and_fill_rows_in_place(default_llm: LLM):
    """Two steps in a row get different buffers (a step in flight keeps its own); the batched fill writes
    exactly the rows it is given, each what the grammar's own single-row fill gives."""
    xgr = pytest.importorskip("xgrammar")
    eng = default_llm.engine
    vocab = eng.model_config.vocab_size
    states = [new_grammar(eng, kw)
              for kw in ({"choice": ["yes", "no"]}, {"regex": "[0-9]+"}, {"json_object": True})]
    buffers = BitmaskBuffers(vocab, torch.device("cpu"), fill_threads=2)
    first, second = buffers.for_step(5), buffers.for_step(5)
    assert first.words.data_ptr() != second.words.data_ptr()
    assert buffers.for_step(3).words.data_ptr() == first.words.data_ptr()      # then the first again
    first.words.fill_(7)
    first.fill([4, 0, 2], states)
    assert first.filled == [4, 0, 2]
    assert (first.words[[1, 3]] == 7).all()                             # rows not asked for: untouched
    for row, state in zip([4, 0, 2], states):
        one = xgr.allocate_token_bitmask(1, vocab)
        state._matcher.fill_next_token_bitmask(one, 0)
        assert torch.equal(first.words[row], one[0])


def accept_scripts(eng) -> tuple[list[dict], list[list[int]]]:
    """Four constraints and a token script each: allowed tokens, refused ones, stop tokens, tokens after the end."""
    enc = lambda s: eng.tokenizer.encode(s, add_special_tokens=False)    # noqa: E731
    eos, refused = eng.eos_token_ids[0], enc("Z")[0]
    kinds = [{"choice": ["yes", "no"]}, {"regex": "[0-9]+"}, {"regex": "(ab)+"}, {"json_object": True}]
    scripts = [enc("yes") + [eos, eos], enc("12") + [refused] + enc("3") + [eos],
               enc("ab") + enc("x") + [eos], enc("{}") + [eos]]
    steps = max(map(len, scripts))
    return kinds, [s + [refused] * (steps - len(s)) for s in scripts]


def test_accept_all_matches_one_accept_a_row(default_llm: LLM):
    """GrammarState.accept_all (one call into xgrammar for the batch) leaves each state as GrammarState.accept
    does: the same answer for allowed, refused and stop tokens (and any token after the end), the same count,
    termination and next mask."""
    eng = default_llm.engine
    kinds, scripts = accept_scripts(eng)
    new = lambda: [new_grammar(eng, kw)  # noqa: E731
                   for kw in kinds]
    one, batch = new(), new()
    buffers = BitmaskBuffers(eng.model_config.vocab_size, torch.device("cpu"))
    seen = set()
    for k in range(len(scripts[0])):
        tokens = [s[k] for s in scripts]
        expect = [state.accept(t) for state, t in zip(one, tokens)]
        assert GrammarState.accept_all(batch, tokens) == expect, k
        seen.update(expect)
        for x, y in zip(one, batch):
            assert (x.num_accepted, x.is_terminated) == (y.num_accepted, y.is_terminated), k
        live = [i for i, x in enumerate(one) if not x.is_terminated]     # a terminated matcher has no mask
        a, b = buffers.for_step(len(kinds)), buffers.for_step(len(kinds))
        a.fill(live, [one[i] for i in live])
        b.fill(live, [batch[i] for i in live])
        assert torch.equal(a.words[live], b.words[live]), k
    assert seen == {True, False} and all(s.is_terminated for s in batch)
    assert GrammarState.accept_all([], []) == []


def test_public_xgrammar_calls_match_the_native_ones(default_llm: LLM, monkeypatch):
    """Where xgrammar's private native handles are not there (another version than the pinned one), the states and
    mask buffers take its public calls, with the native path's verdicts, counts, termination and masks at every
    step of the scripts."""
    import xgrammar as xgr
    from picovllm.layers import structured_output as so
    eng = default_llm.engine
    kinds, scripts = accept_scripts(eng)

    def trace() -> tuple[list, list]:
        """Each step's (verdicts, counts, terminations, masks), and the states' handles."""
        states = [new_grammar(eng, kw)
                  for kw in kinds]
        buffers, steps = BitmaskBuffers(eng.model_config.vocab_size, torch.device("cpu")), []
        for k in range(len(scripts[0])):
            verdicts = GrammarState.accept_all(states, [s[k] for s in scripts])
            live = [i for i, x in enumerate(states) if not x.is_terminated]
            masks = buffers.for_step(len(kinds))
            masks.fill(live, [states[i] for i in live])
            steps.append((verdicts, [(x.num_accepted, x.is_terminated) for x in states], live,
                          masks.words[live].clone()))
        return steps, [s.handle for s in states]

    native, native_handles = trace()
    so._batch_accept.cache_clear()
    monkeypatch.setattr(so, "_native", lambda: False)
    try:
        public, public_handles = trace()
    finally:
        so._batch_accept.cache_clear()      # the native call again once the patch is undone
    assert all(type(h) is xgr.GrammarMatcher for h in public_handles)
    assert not any(type(h) is xgr.GrammarMatcher for h in native_handles)
    for k, (a, b) in enumerate(zip(native, public)):
        assert a[:3] == b[:3] and torch.equal(a[3], b[3]), k
    assert {v for step in public for v in step[0]} == {True, False} and all(t for _, t in public[-1][1])


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """Nested objects, arrays, enums, bounded numbers and strings, required fields; small enough that a
    135M model finishes each instance within the test's max_tokens."""
    kinds = ["integer", "number", "string", "boolean", "enum"] + (["object", "array"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "object" or depth == 0:
        props = {f"k{i}_{rng.choice('abcxyz')}": random_schema(rng, depth + 1) for i in range(rng.randint(1, 3))}
        return {"type": "object", "properties": props,
                "required": rng.sample(list(props), rng.randint(1, len(props)))}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": rng.randint(0, 1),
                "maxItems": rng.randint(1, 3)}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 100)}
    if kind == "number":
        return {"type": "number", "minimum": -10, "maximum": rng.choice([1, 10, 1000])}
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 12)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "a b", 'q"uote', "ünï"], rng.randint(1, 4))}
    return {"type": "boolean"}


def so_params(temperature: float, seed: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=160,
                          structured_outputs=StructuredOutputsParams(**kw))


def test_random_json_schemas_validate(default_llm: LLM):
    rng = random.Random(17)
    schemas = [random_schema(rng) for _ in range(100)]
    params = [so_params(0.0 if i % 2 == 0 else 1.0, i, json=s) for i, s in enumerate(schemas)]
    outs = default_llm.generate([PROMPT] * len(schemas), params, use_tqdm=False)
    for s, o in zip(schemas, outs):
        c = o.outputs[0]
        assert c.finish_reason == "stop", (s, c.text)
        jsonschema.validate(json.loads(c.text), s)


def test_choice_regex_json_object_and_grammar(default_llm: LLM):
    choices = ["yes", "no", "it depends", "ünïcode \"quoted\""]
    regex = r"(\d{3}-[a-z]{2,5})|(id:[A-F0-9]{4})"
    grammar = 'root ::= "(" num (" + " num)* ")"\nnum ::= [1-9] [0-9]?'
    params = ([so_params(1.0, s, choice=choices) for s in range(8)] + [so_params(1.0, s, regex=regex) for s in range(8)]
              + [so_params(1.0, s, grammar=grammar) for s in range(4)])
    # (a bare "Describe a person as JSON:" led the quantized default model, greedy, into a number without end)
    prompts = ["Pick one:"] * len(params) + ["Describe a person as a JSON object with a name and an age:"] * 2
    params += [so_params(t, 1, json_object=True) for t in (0.0, 1.0)]
    outs = [o.outputs[0] for o in default_llm.generate(prompts, params, use_tqdm=False)]
    assert all(c.finish_reason == "stop" for c in outs), [(c.text, c.finish_reason) for c in outs if c.finish_reason != "stop"]
    assert all(c.text in choices for c in outs[:8])
    assert all(re.fullmatch(regex, c.text) for c in outs[8:16]), [c.text for c in outs[8:16]]
    assert all(re.fullmatch(r"\((\d+)( \+ \d+)*\)", c.text) for c in outs[16:20]), [c.text for c in outs[16:20]]
    assert all(isinstance(json.loads(c.text), dict) for c in outs[20:])


@pytest.mark.parametrize("kw,match", [
    ({"json": {"type": "nonsense"}}, "structured_outputs.json: invalid JSON schema"),
    ({"json": "{not json"}, "structured_outputs.json: invalid JSON schema"),
    ({"regex": "(unclosed"}, "structured_outputs.regex: invalid regular expression"),
    ({"grammar": "root ::= missing_rule"}, "structured_outputs.grammar: invalid EBNF grammar"),
    # valid, but no text matches them (their requests had failed at the first token, a 500 in the server)
    ({"json": {"$ref": "#/$defs/n", "$defs": {"n": {"$ref": "#/$defs/n"}}}}, "json: the JSON schema matches no text"),
    ({"regex": "[^\\x00-\\U0010FFFF]"}, "regex: the regular expression matches no text"),
    ({"grammar": 'root ::= root "a"'}, "grammar: the EBNF grammar matches no text"),
    # keywords xgrammar's grammar would not enforce (it admitted [1, 1], "ab", 3): refused by name, as vLLM's
    # xgrammar backend refuses them
    ({"json": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}, "uniqueItems at /: the grammar"),
    ({"json": {"type": "object", "properties": {"s": {"type": "string", "pattern": "^[a-z]+$", "minLength": 3}}}},
     "pattern with minLength/maxLength at /properties/s"),
    ({"json": {"allOf": [{"type": "integer"}, {"minimum": 10}]}}, "allOf of 2 schemas"),
    ({"json": {"$defs": {"n": {"not": {"type": "integer"}}}, "$ref": "#/$defs/n"}}, "not at /\\$defs/n"),
    # xgrammar 0.2.8 compiles these and drops the keyword (its grammar admitted the instance in the comment)
    ({"json": {"type": "number", "multipleOf": 0.5}}, "multipleOf at /"),                          # 0.3
    ({"json": {"type": "integer", "multipleOf": 7, "minimum": 10}}, "multipleOf at /"),            # 15
    ({"json": {"type": "object", "required": ["a"]}}, "required 'a' not in properties at /"),     # {}
    ({"json": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]}},
     "required 'b' not in properties"),                                                           # {"a": 1}
    ({"json": {"type": "string", "pattern": "^(?!ab)[a-c]{2}$"}}, "pattern .* lookaround"),      # "ab"
    ({"json": {"type": "object", "patternProperties": {"^(?<=x)y$": {"type": "integer"}}}}, "patternProperties"),
    ({"json": {"type": "string", "format": "regex"}}, "format 'regex' at /"),                      # "("
    ({"json": {"type": "string", "format": "idn-hostname"}}, "format 'idn-hostname'"),            # "-a-"
    ({"json": {"type": "integer", "enum": [1, 2.5, "x"]}}, "enum beside type 'integer'"),         # "x"
    ({"json": {"type": "string", "const": 5}}, "const beside type 'string'"),                     # 5
    ({"json": {"enum": [1, 5, 10], "minimum": 4}}, "enum beside minimum"),                        # 1
    ({"json": {"allOf": [{"type": "integer"}], "maximum": 3}}, "allOf beside maximum"),           # 5
    ({"json": {"type": "integer", "anyOf": [{"type": "string"}, {"type": "integer"}]}}, "anyOf beside type"),  # "s"
    ({"json": {"$defs": {"a": {"$anchor": "A", "type": "integer"}}, "$ref": "#A"}}, "\\$ref '#A'"),  # "s"
    ({"json": {"$ref": "https://example.com/s.json"}}, "\\$ref 'https"),                          # anything
    ({"json": {"type": "object", "properties": {"a": {"type": "integer"}}, "propertyNames": {"maxLength": 0}}},
     "propertyNames beside properties"),                                                          # {"a": 1}
    ({"json": {"type": "object", "properties": {"n1": {"type": "string"}},
               "patternProperties": {"^n": {"type": "integer"}}}}, "patternProperties '\\^n' matching"),  # {"n1": "s"}
    ({"json": {"type": "object", "properties": {"a": {"type": "integer"}}, "dependencies": {"a": ["b"]}}},
     "dependencies at /"),
])
def test_bad_constraint_names_the_field_and_others_run(default_llm: LLM, kw, match):
    with pytest.raises(ValueError, match=match):
        default_llm.engine.add_request(PROMPT, SamplingParams(structured_outputs=StructuredOutputsParams(**kw)))
    out = default_llm.generate([PROMPT], so_params(0.0, 0, choice=["ok"]), use_tqdm=False)[0].outputs[0]
    assert out.text == "ok"


@pytest.mark.parametrize("kw", [{}, {"json": {}, "regex": "a"}, {"choice": []}, {"choice": ["a", 1]},
                                {"regex": 5}, {"json_object": "yes"}])
def test_params_validation_names_the_field(kw):
    with pytest.raises(ValueError, match="structured_outputs"):
        StructuredOutputsParams(**kw)


def test_dict_form_and_parallel_samples(default_llm: LLM):
    sp = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=20, structured_outputs={"choice": ["x1", "y2"]})
    (out,) = default_llm.generate(["Pick:"], sp, use_tqdm=False)
    assert len(out.outputs) == 3 and all(c.text in ("x1", "y2") for c in out.outputs)


def test_overlapped_scheduling_matches_plain(default_model_path):
    """Overlap: a constrained request's mask waits for its pending token (filled late); the outputs equal
    the non-overlapped engine's, greedy and seeded, and the unconstrained batch-mate is unaffected."""
    rng = random.Random(3)
    schemas = [random_schema(rng) for _ in range(6)]
    params = [so_params(float(i % 2), i, json=s) for i, s in enumerate(schemas)]
    params.append(SamplingParams(temperature=0, max_tokens=12))
    runs = []
    for overlap in (False, True):
        llm = LLM(default_model_path, async_scheduling=overlap, num_kv_blocks=64)
        runs.append([o.outputs[0].text for o in llm.generate([PROMPT] * len(params), params, use_tqdm=False)])
        llm.engine.shutdown()
    assert runs[0] == runs[1]
    for s, text in zip(schemas, runs[1]):
        jsonschema.validate(json.loads(text), s)


def test_overlap_decodes_constrained_requests_every_step(default_model_path):
    """Overlap fills a constrained request's mask late (after the step in flight lands, while the next forward
    runs), so it takes a token every step: 16 tokens in at most 16 + 2 steps, where skipping every other step
    would need ~32; the tokens match the regex and the non-overlapped engine's."""
    sp = SamplingParams(temperature=0.8, seed=5, max_tokens=16, ignore_eos=True,
                        structured_outputs=StructuredOutputsParams(regex="[a-z]{40}"))
    texts = []
    for overlap in (False, True):
        llm = LLM(default_model_path, async_scheduling=overlap, num_kv_blocks=32)
        eng = llm.engine
        rid = eng.add_request(PROMPT, sp)
        steps, done = 0, None
        while done is None:
            steps += 1
            done = next((o for o in eng.step() if o.request_id == rid and o.finished), None)
            assert steps < 40
        texts.append(done.outputs[0].text)
        assert len(done.outputs[0].token_ids) == 16 and re.fullmatch("[a-z]+", texts[-1])
        if overlap:
            assert steps <= 18, steps
        eng.shutdown()
    assert texts[0] == texts[1]


def test_overlap_finishes_a_grammar_that_ends(default_model_path):
    """Under overlap the grammar takes the token in flight early (to fill the next mask); when that token ends the
    grammar (its stop token, allowed once the regex is complete), the request still finishes there, under
    ignore_eos too, as without overlap: same text, finish reason stop, no error."""
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                        structured_outputs=StructuredOutputsParams(regex="(yes|no)"))
    outs = []
    for overlap in (False, True):
        llm = LLM(default_model_path, async_scheduling=overlap, num_kv_blocks=32)
        (out,) = llm.generate([PROMPT] * 1, sp, use_tqdm=False)
        outs.append(out.outputs[0])
        llm.engine.shutdown()
    assert outs[0].text == outs[1].text and outs[1].text in ("yes", "no")
    assert outs[0].finish_reason == outs[1].finish_reason == "stop"


def test_bounded_strings_admit_no_raw_control_characters(default_llm: LLM):
    """JSON strings hold no raw control characters and UTF-8 text no surrogates (json.loads and bytes.decode
    are the oracles); xgrammar 0.2.8 admits both unless picovllm's grammar fixes it."""
    from picovllm.layers.structured_output import StructuredOutputCompiler
    eng = default_llm.engine
    compiler = StructuredOutputCompiler(eng.tokenizer, eng.model_config.vocab_size, eng.eos_token_ids)
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 5}}, "required": ["s"]}
    for tail, ok in [("ab\"}", True), ("a\x08\"}", False), ("a\\n\"}", False), ("\"}", True)]:
        state = compiler.new_state(StructuredOutputsParams(json=schema))
        accepted = state._matcher.accept_string('{"s": "' + tail)
        valid = True
        try:
            json.loads('{"s": "' + tail)
        except json.JSONDecodeError:
            valid = False
        assert accepted == ok, tail
        assert valid or not accepted, tail   # never accepts what json.loads rejects
    tokens = {b: i for i, b in enumerate(compiler._info.decoded_vocab) if b in (b"\xed", b"\xa0", b"\x9f")}
    for string in ({"type": "string", "maxLength": 5}, {"type": "string"}):   # bounded and unbounded
        schema = {"type": "object", "properties": {"s": string}, "required": ["s"]}
        for second, ok in [(b"\xa0", False), (b"\x9f", True)]:   # ED A0: a surrogate; ED 9F: U+D7C0-U+D7FF
            state = compiler.new_state(StructuredOutputsParams(json=schema, source="s"))
            assert state._matcher.accept_string('{"s": "')
            got = state.accept(tokens[b"\xed"]) and state.accept(tokens[second])
            assert got == ok, (string, second)


def test_schema_strings_keep_their_characters(default_llm: LLM):
    """Enum values and property names with a character in U+0080-U+00FF before a hex digit ("°C", "größe",
    "café2go") come out as themselves: the only string the grammar forces, json.loads'd, is the schema's (xgrammar's
    EBNF text writes such a character as \\xHH and read it back greedily: "°C" became U+0B0C)."""
    from picovllm.layers.structured_output import StructuredOutputCompiler
    eng = default_llm.engine
    compiler = StructuredOutputCompiler(eng.tokenizer, eng.model_config.vocab_size, eng.eos_token_ids)
    for schema, value in [({"enum": ["°C"]}, "°C"), ({"const": "ÿF ñ0 \u00a0A"}, "ÿF ñ0 \u00a0A"),
                          ({"type": "object", "properties": {"café2go": {"const": True}}, "required": ["café2go"],
                            "additionalProperties": False}, {"café2go": True})]:
        state = compiler.new_state(StructuredOutputsParams(json=schema))
        forced = state._matcher.find_jump_forward_string()
        assert json.loads(forced) == value, (schema, forced)
        assert state._matcher.accept_string(json.dumps(value, ensure_ascii=False)), schema


def test_tensor_parallel_matches_one_rank(chat_model, one_thread_in_children):
    """TP=2: the sampling rows (and their bitmasks) stay on rank 0; the constrained outputs equal one rank's and
    meet their constraints (choice list, regex)."""
    prompts = ["Pick:", "Choose one of them", "Which?"] * 2
    params = [so_params(0.0, 0, choice=["alpha", "beta", "gamma"])] * 3 + [so_params(0.0, 0, regex=r"[a-e]{2,4}-\d")] * 3
    runs = []
    device = "cpu" if torch.cuda.device_count() == 1 else "auto"     # TP=2 on one GPU: both ranks on the CPU
    for tp in (1, 2):   # greedy: TP's all-reduce may move logits by rounding, not their order here
        with LLM(chat_model, tensor_parallel_size=tp, num_kv_blocks=64, device=device) as llm:
            runs.append([o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)])
    assert runs[0] == runs[1]
    assert all(t in ("alpha", "beta", "gamma") for t in runs[1][:3])
    assert all(re.fullmatch(r"[a-e]{2,4}-\d", t) for t in runs[1][3:]), runs[1]


def test_compiled_grammars_are_cached_by_text(default_llm: LLM):
    """A second request with the same schema compiles nothing new (the compiler's cache does not grow); another
    schema does."""
    eng = default_llm.engine
    run = lambda schema: default_llm.generate([PROMPT], so_params(0.0, 0, json=schema), use_tqdm=False)  # noqa: E731
    a = {"type": "object", "properties": {"x": {"enum": ["p", "q"]}}, "required": ["x"]}
    run(a)
    size = eng.grammar_masks.compiler._compiler.get_cache_size_bytes()
    assert size > 0
    run(dict(a))                       # an equal schema, another dict object
    assert eng.grammar_masks.compiler._compiler.get_cache_size_bytes() == size
    run({"type": "object", "properties": {"y": {"enum": ["r"]}}, "required": ["y"]})
    assert eng.grammar_masks.compiler._compiler.get_cache_size_bytes() > size


def test_keyword_names_as_property_names_are_names():
    """A property called "not" or "contains" is a name, not a keyword: only subschemas are searched; annotations
    beside anyOf (Pydantic's Optional fields: title, default) are no constraint."""
    from picovllm.layers.structured_output import unenforced_keyword
    assert unenforced_keyword({"type": "object", "properties": {"not": {"type": "integer"},
                                                                "contains": {"enum": ["uniqueItems"]}}}) is None
    assert unenforced_keyword({"anyOf": [{"type": "integer"}, {"type": "null"}], "title": "X", "default": None}) is None
    assert unenforced_keyword({"type": "array", "uniqueItems": False}) is None
    # what xgrammar does enforce stays allowed: an integer's multipleOf alone, enum values of the schema's type
    # (Pydantic's enums), an escaped "(?" in a pattern, properties listed and required, the formats it writes out
    for ok in ({"type": "integer", "multipleOf": 7}, {"enum": ["a", "b"], "type": "string", "title": "E"},
               {"type": ["integer", "null"], "enum": [1, None]}, {"type": "string", "pattern": "^\\(\\?$"},
               {"type": "object", "properties": {"a": {"format": "date-time", "type": "string"}}, "required": ["a"]},
               {"$defs": {"x": {"type": "integer"}}, "properties": {"x": {"$ref": "#/$defs/x"}}, "required": ["x"]},
               {"type": "string", "pattern": "^(?:ab)+(?P<c>c)?$"}, {"type": "integer", "format": "int32"},
               {"type": {"not": "a name"}, "enum": [1]}, {"required": [{"a": 1}], "properties": {"b": {}}},
               {"type": "integer", "enum": [10 ** 400, 2.0]}):
        assert unenforced_keyword(ok) is None, ok
