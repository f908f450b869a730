"""`use_beam_search: true` on both endpoints (vLLM's): `n` beams (the beam width), `length_penalty`, `max_tokens`,
`ignore_eos`; the search is entrypoints/beam_search.py's, its steps run as engine requests through the server's
engine like any other request. The beams are known at the end, so the response is not streamed. A field beam search
does not honour (sampling, logprobs, penalties, stop strings, structured outputs, tools, ...) sent with a value
other than its default is a 400 naming it, never ignored.
"""
from __future__ import annotations

import time

from fastapi import Request

from picovllm.entrypoints.beam_search import BeamSearchParams, BeamSearchSequence, search, step_params
from picovllm.entrypoints.openai.protocol import APIError
from picovllm.entrypoints.openai.engine_client import checked
from picovllm.entrypoints.openai.serving import (ENGINE_ERRORS, ServingContext, engine_request_id,
                                                 until_disconnected)

# What a beam-search request may carry besides its prompt: the search's own fields, and those it honours as any
# request does (the prompt's rendering and truncation, the text's decoding, scheduling, who asks).
BEAM_FIELDS = frozenset({
    "model", "prompt", "messages", "use_beam_search", "n", "max_tokens", "max_completion_tokens", "length_penalty",
    "ignore_eos", "temperature", "seed", "stream", "user", "priority", "skip_special_tokens",
    "truncate_prompt_tokens", "add_generation_prompt", "continue_final_message", "chat_template_kwargs",
    "documents", "chat_template", "add_special_tokens", "spaces_between_special_tokens", "request_id",
    "include_stop_str_in_output"})


# Values of other fields that ask for nothing (what clients often send explicitly), besides each field's default.
NEUTRAL = {"top_p": (1,), "top_k": (0, -1), "min_p": (0,), "presence_penalty": (0,), "frequency_penalty": (0,),
           "repetition_penalty": (1,), "min_tokens": (0,), "stop": ([],), "stop_token_ids": ([],),
           "tool_choice": ("none",), "stream_options": ()}


def _asks_nothing(req, name: str) -> bool:
    value = getattr(req, name)
    if value == type(req).model_fields[name].default or value in NEUTRAL.get(name, ()):
        return True
    return name == "response_format" and value.type == "text"


def beam_search_params(req, max_tokens: int | None, num_prompt_tokens: int, max_model_len: int,
                       defaults: dict | None = None) -> BeamSearchParams:
    """The request's BeamSearchParams; APIError(400) naming the field it cannot honour. defaults: the model's
    generation config (its max_tokens caps the request's, as for any request)."""
    for name in sorted(req.model_fields_set - BEAM_FIELDS):
        if not _asks_nothing(req, name):
            raise APIError(400, f"{name} cannot be combined with use_beam_search", param=name)
    if req.stream:
        raise APIError(400, "use_beam_search: the beams are known at the end, so the response is not streamed",
                       param="stream")
    room = max_model_len - num_prompt_tokens     # a max_tokens past it: refused before (serving.check_room)
    if room < 1:
        raise APIError(400, f"the prompt ({num_prompt_tokens} tokens) leaves no room under max_model_len "
                            f"{max_model_len}", param="max_tokens")
    max_tokens = room if max_tokens is None else max_tokens
    cap = (defaults or {}).get("max_tokens")
    if cap is not None:
        max_tokens = min(max_tokens, cap)
    params = BeamSearchParams(beam_width=req.n, max_tokens=max_tokens,
                              ignore_eos=req.ignore_eos, temperature=req.temperature or 0.0,
                              length_penalty=req.length_penalty,
                              include_stop_str_in_output=req.include_stop_str_in_output)
    try:
        params.validate()
    except ValueError as e:
        raise APIError(400, str(e), param=str(e).split(":")[0].split()[0].removeprefix("BeamSearchParams.")) from None
    return params


async def run_beam_search(ctx: ServingContext, raw: Request, ids: list[int], params: BeamSearchParams,
                          request_id: str, priority: int) -> list[BeamSearchSequence] | None:
    """The best beams, best first; None if the client went away first (the steps in flight are aborted)."""
    eos = ctx.engine.eos_token_ids()
    if eos is None:
        raise APIError(400, "use_beam_search is not supported with prefill/decode disaggregation",
                       param="use_beam_search")
    task = await until_disconnected(raw, _search(ctx, ids, params, eos, request_id, priority))
    try:
        return None if task is None else task.result()
    except ENGINE_ERRORS as e:
        raise APIError(500, str(e), type="internal_error") from None


async def _search(ctx: ServingContext, ids: list[int], params: BeamSearchParams, eos: list[int], request_id: str,
                  priority: int) -> list[BeamSearchSequence]:
    step = step_params(params, eos, ctx.engine.model_info()["vocab_size"])
    steps, n, arrival = search([ids], params, eos), 0, time.time()
    base = engine_request_id(request_id)        # each step's engine request: `{base}-{n}`
    try:
        batch = next(steps)
        while True:
            streams = []
            try:
                for tokens in batch:
                    streams.append(await ctx.add(tokens, step, f"{base}-{n}", arrival, priority))
                    n += 1
                outs = [await _last(s) for s in streams]
                if any(o.outputs[0].finish_reason == "abort" for o in outs):    # the server is shutting down
                    raise APIError(503, "the beam search was aborted: the server is shutting down",
                                   type="service_unavailable")
                tops = [o.outputs[0].logprobs[0] for o in outs]
            finally:
                for s in streams:
                    s.close()           # aborts a step still running (the client went away)
            batch = steps.send(tops)
    except StopIteration as done:
        return done.value[0]


async def _last(stream):
    last = None
    async for out in stream.outputs():
        last = checked(out)
    return last


async def serve_beam_search(ctx: ServingContext, req, raw: Request, ids: list[int], max_tokens: int | None,
                            request_id: str, skip_special_tokens: bool | None = None
                            ) -> tuple[list[tuple[str, BeamSearchSequence]], dict] | None:
    """A request's beams, best first, each with its text, and the usage; None if the client went away.
    APIError(400) naming what cannot be honoured. skip_special_tokens: the text's, where not the request's (a
    harmony reply is read at its markers)."""
    params = beam_search_params(req, max_tokens, len(ids), ctx.engine.model_info()["max_model_len"],
                                ctx.sampling_defaults)
    beams = await run_beam_search(ctx, raw, ids, params, request_id, req.priority)
    if beams is None:
        return None
    skip = req.skip_special_tokens if skip_special_tokens is None else skip_special_tokens
    texts = [await ctx.tokenizer.decode(b.text_token_ids(params.include_stop_str_in_output), skip,
                                        req.spaces_between_special_tokens) for b in beams]
    c = sum(len(b.output_token_ids) for b in beams)
    return list(zip(texts, beams)), {"prompt_tokens": len(ids), "completion_tokens": c, "total_tokens": len(ids) + c}
