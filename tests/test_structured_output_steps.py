"""A step's grammar masks as the engine makes them (engine/grammar_masks.py: GrammarMasks.fill when the step is
prepared, fill_late once the token in flight is known; layers/structured_output.py: TokenBitmasks.accept_and_fill),
over random constraints, random token streams and random step layouts, on the default model's 49,152-token
vocabulary. Oracle: for each request, a matcher of xgrammar's own, advanced by the tokens the request's grammar
should take (a think block's tokens pass it by, as the gate's rules say), filling one row at a time
(GrammarMatcher.fill_next_token_bitmask)."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from picovllm import LLM, SamplingParams
from picovllm.engine.request import DECODING, PREFILL, Request
from picovllm.engine.scheduler import ScheduledChunk, SchedulerOutput
from picovllm.layers.structured_output import BitmaskBuffers, GrammarState
from picovllm.reasoning import ANSWER, MAY_OPEN, REASONING, ThinkTags
from picovllm.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONSTRAINTS = [{"regex": "[a-z ]{4000}"}, {"regex": r"(\d{3}-[a-z]{2,5})|(id:[A-F0-9]{4})"},
               {"regex": "(ab)+c?"}, {"choice": ["yes", "no", "it depends"]}, {"json_object": True},
               {"json": {"type": "object", "required": ["n"], "properties": {
                   "n": {"type": "integer"}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}}}}},
               {"grammar": 'root ::= "(" num (" + " num)* ")"\nnum ::= [1-9] [0-9]?'}]
THINK = ThinkTags(3, 4)     # two special tokens of the default tokenizer as <think> and </think>
CPU = torch.device("cpu")


class Oracle:
    """One request's expected grammar: xgrammar's matcher and the gate's phase, kept by hand."""

    def __init__(self, compiled, vocab: int, phase: str | None) -> None:
        import xgrammar as xgr
        self.matcher, self.vocab, self.phase = xgr.GrammarMatcher(compiled), vocab, phase or ANSWER

    def take(self, token: int) -> bool:
        """Whether the grammar (or its gate) takes `token`; advances by it if so."""
        if self.phase == REASONING:
            self.phase = ANSWER if token == THINK.end else REASONING
            return True
        if self.phase == MAY_OPEN and token == THINK.start:
            self.phase = REASONING
            return True
        if not self.matcher.accept_token(token):
            return False
        self.phase = ANSWER
        return True

    @property
    def ended(self) -> bool:
        return self.matcher.is_terminated()

    @property
    def masked(self) -> bool:
        return self.phase != REASONING and not self.ended

    def mask(self) -> torch.Tensor:
        """Its next token's mask words, one row filled by xgrammar (the gate's <think> added at a first token)."""
        import xgrammar as xgr
        words = xgr.allocate_token_bitmask(1, self.vocab)
        self.matcher.fill_next_token_bitmask(words)
        row = words[0].clone()
        if self.phase == MAY_OPEN:
            row[THINK.start // 32] |= 1 << (THINK.start % 32)
        return row

    def allowed(self) -> list[int]:
        bits = (self.mask()[:, None] >> torch.arange(32, dtype=torch.int32)) & 1     # token 32 i + j: bit j of word i
        return bits.flatten()[:self.vocab].nonzero().flatten().tolist()


def pick(oracle: Oracle, rng: random.Random, vocab: int, odd: float = 0.1) -> int:
    """A token for a row: mostly one its grammar allows (its stop token as often as any); at a rate of `odd`, a
    think tag or (less often) one it refuses."""
    r = rng.random()
    if r < odd * 0.4:
        return rng.randrange(5, vocab)
    if r < odd:
        return rng.choice(THINK.token_ids)
    if oracle.phase == REASONING:
        return rng.randrange(5, vocab)
    allowed = oracle.allowed()
    return rng.choice(allowed) if allowed else rng.randrange(vocab)


def engine_parts(llm: LLM):
    """The engine's GrammarMasks (its compiler built), vocabulary size and EOS ids."""
    eng = llm.engine
    eng.grammar_masks.precompile(SamplingParams(structured_outputs=StructuredOutputsParams(regex="a")),
                                 eng.eos_token_ids)
    return eng.grammar_masks, eng.model_config.vocab_size, eng.eos_token_ids


def new_request(rid: str, params: SamplingParams, prompt: list[int]) -> Request:
    req = Request(rid, prompt, params)
    req.status = DECODING
    return req


def decode_chunk(req: Request, drafts: list[int] | None = None) -> ScheduledChunk:
    drafts = drafts or []
    req.num_computed_tokens = req.num_tokens - 1
    return ScheduledChunk(req, 1 + len(drafts), list(drafts))


@pytest.mark.parametrize("seed,gated", [(0, True), (1, True), (2, False), (3, False)])
def test_step_masks_match_xgrammar_row_by_row(default_llm: LLM, seed: int, gated: bool):
    """Each step's filled rows and their masks, late (overlap) and early ones, beside unconstrained rows, rows with
    drafts and a prefill chunk that samples nothing, with the requests in a new order every step; refused tokens and
    ended grammars leave their rows unfilled and finish the request, as the oracle says. gated: some requests behind
    a reasoning gate, and a token of ten a think tag or a refused one; else none, and one of a hundred refused (most
    steps then take the path where every grammar goes on)."""
    gm, vocab, eos = engine_parts(default_llm)
    rng = random.Random(seed)
    live: list[tuple[Request, Oracle]] = []

    def add(rid: str) -> None:
        so = StructuredOutputsParams(**rng.choice(CONSTRAINTS))
        params = SamplingParams(max_tokens=10_000, structured_outputs=so)
        req = new_request(rid, params, [1, 2, 3])
        phase = rng.choice([None, None, MAY_OPEN, REASONING]) if gated else None
        if phase is None:
            req.grammar = gm.new_state(params, req.prompt_token_ids, eos)
        else:
            req.grammar = gm.compiler.new_state(so, THINK, phase)
        live.append((req, Oracle(gm.compiler.compile(so), vocab, phase)))
    for i in range(14):
        add(f"c{i}")
    plain = SamplingParams(max_tokens=10_000)
    prev_sched, prev_done, filled_seen, refused, ended = None, None, 0, 0, 0
    for step_no in range(30):
        # the engine's apply_results before this step, for requests not left in flight (no overlap for them)
        for req, oracle in list(live):
            if req.num_pending_tokens and rng.random() < 0.3:
                token = prev_done.token_ids[req.pending_row]
                req.output_token_ids.append(token)
                req.num_pending_tokens = 0
                took, ok = oracle.take(token), req.grammar.accept(token)
                assert took == ok, (step_no, req.request_id, token)
                if not ok or req.grammar.is_terminated:
                    assert not ok or oracle.ended
                    live.remove((req, oracle))
        for k in range(14 - len(live)):     # new requests in place of finished ones (masked when the step is prepared)
            add(f"c{step_no}.{k}")
        rng.shuffle(live)
        chunks, drafted = [], {}
        for req, oracle in live:
            drafts = []
            if not req.num_pending_tokens and oracle.phase == ANSWER and rng.random() < 0.3:
                for _ in range(rng.randint(1, 3)):     # drafts the grammar takes (none its end)
                    allowed = [t for t in oracle.allowed() if t not in eos]
                    if not allowed:
                        break
                    drafts.append(rng.choice(allowed))
                    assert oracle.matcher.accept_token(drafts[-1])
                if drafts:
                    oracle.matcher.rollback(len(drafts))
            drafted[req.request_id] = drafts
            chunks.append(decode_chunk(req, drafts))
        for k in range(rng.randint(0, 4)):        # unconstrained rows, some with drafts, anywhere in the step
            extra = decode_chunk(new_request(f"p{step_no}.{k}", plain, [5, 6]), [7] * rng.randint(0, 2))
            chunks.insert(rng.randint(0, len(chunks)), extra)
        params = live[0][0].params if live else plain   # a constrained prompt mid-prefill: it samples nothing
        prefill = new_request(f"f{step_no}", params, list(range(10, 30)))
        prefill.status, prefill.grammar = PREFILL, (live[0][0].grammar if live else None)
        chunks.insert(rng.randint(0, len(chunks)), ScheduledChunk(prefill, 4))
        sched = SchedulerOutput(chunks)
        first_row, row = {}, 0
        for c in sched.chunks:          # the oracle's rows: ScheduledChunk.num_samples a chunk, in order
            if c.num_samples:
                first_row[c.request.request_id] = row
            row += c.num_samples
        step = SimpleNamespace(sampling=[None] * row, token_bitmasks=None)

        late = gm.fill(step, sched, CPU)
        if late:
            gm.fill_late(step, late, prev_sched, prev_done)

        expect: dict[int, torch.Tensor] = {}
        finishing = set()
        for req, oracle in live:
            r = first_row[req.request_id]
            if req.num_pending_tokens:       # late: the grammar takes the token in flight now
                token = prev_done.token_ids[req.pending_row]
                if not oracle.take(token):
                    finishing.add(req.request_id)
                    refused += 1
                    continue
                if oracle.ended:
                    finishing.add(req.request_id)
                    ended += 1
                    continue
            if oracle.masked:
                expect[r] = oracle.mask()
                for i, token in enumerate(drafted[req.request_id]):
                    assert oracle.matcher.accept_token(token)
                    expect[r + 1 + i] = oracle.mask()
                if drafted[req.request_id]:
                    oracle.matcher.rollback(len(drafted[req.request_id]))
        masks = step.token_bitmasks
        got = sorted(masks.filled) if masks is not None else []
        assert got == sorted(expect), (step_no, got, sorted(expect))
        for r, words in expect.items():
            assert torch.equal(masks.words[r], words), (step_no, r)
        filled_seen += len(expect)

        # apply_results for the step in flight: the late requests' tokens, already taken by their grammars
        for req, oracle in list(live):
            if req.num_pending_tokens:
                token = prev_done.token_ids[req.pending_row]
                req.output_token_ids.append(token)
                req.num_pending_tokens = 0
                grammar = req.grammar
                assert grammar.num_accepted == len(req.output_token_ids) or req.request_id in finishing
                if grammar.num_accepted < len(req.output_token_ids):
                    assert not grammar.accept(token)
                if req.request_id in finishing:
                    assert grammar.num_accepted < len(req.output_token_ids) or grammar.is_terminated
                    live.remove((req, oracle))
        # this step's tokens, and advance(): each sampling request has one in flight at its first row
        tokens = [rng.randrange(vocab) for _ in range(row)]
        for req, oracle in live:
            r = first_row[req.request_id]
            tokens[r] = pick(oracle, rng, vocab, 0.1 if gated else 0.01)
            req.num_pending_tokens, req.pending_row = 1, r
        prev_sched, prev_done = sched, SimpleNamespace(token_ids=tokens)
    assert filled_seen > 100 and refused and ended, (filled_seen, refused, ended)


def test_accept_and_fill_matches_accept_then_fill(default_llm: LLM):
    """TokenBitmasks.accept_and_fill (one batched accept, one batched fill) leaves each state as the oracle says
    (taken or not, its phase, its end) and fills exactly the rows whose state took its token and goes on masked,
    each with xgrammar's own one-row mask, the others untouched; rows in any order, refused and ending tokens, and
    gated states (a think block's first token, its inside, its end) among them."""
    gm, vocab, eos = engine_parts(default_llm)
    rng = random.Random(5)
    buffers = BitmaskBuffers(vocab, CPU)
    for trial in range(16):
        n = rng.randint(1, 24)
        kinds = [StructuredOutputsParams(**rng.choice(CONSTRAINTS)) for _ in range(n)]
        phases = [rng.choice([None, None, MAY_OPEN, REASONING]) if trial % 2 else None for _ in range(n)]
        states = [gm.compiler.new_state(so, THINK, p) if p else gm.compiler.new_state(so)
                  for so, p in zip(kinds, phases)]
        oracles = [Oracle(gm.compiler.compile(so), vocab, p) for so, p in zip(kinds, phases)]
        for _ in range(rng.randint(0, 6)):       # a few tokens in first, the same for both
            for s, o in zip(states, oracles):
                if o.masked:
                    t = rng.choice(o.allowed())
                    if t not in eos and o.take(t):
                        assert s.accept(t)
        states, oracles = zip(*[(s, o) for s, o in zip(states, oracles) if not o.ended])
        tokens = [pick(o, rng, vocab) for o in oracles]
        before = [s.num_accepted for s in states]
        rows = rng.sample(range(len(states) + 3), len(states))
        masks = buffers.for_step(len(states) + 3)
        masks.words.fill_(7)
        masks.accept_and_fill(rows, list(states), tokens)
        expect = {}
        for r, s, o, t, n0 in zip(rows, states, oracles, tokens, before):
            took = o.take(t)
            assert (s.num_accepted, s.phase, s.is_terminated) == (n0 + took, o.phase, took and o.ended), (trial, t)
            if took and o.masked:
                expect[r] = o.mask()
        assert sorted(masks.filled) == sorted(expect), trial
        for r, words in expect.items():
            assert torch.equal(masks.words[r], words), (trial, r)
        assert all((masks.words[r] == 7).all() for r in range(len(states) + 3) if r not in expect), trial
    masks = buffers.for_step(2)
    masks.accept_and_fill([], [], [])
    assert masks.filled == [] and GrammarState.accept_all([], []) == []
