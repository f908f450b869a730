"""POST /v1/embeddings, as vLLM serves it from a pooling model (`serve --runner pooling`; engine/pooling.py): one
engine request per input, each a prompt that is prefilled and never decoded; the embeddings come back as floats or as
base64 (float32, as OpenAI's, or vLLM's embed_dtype and endianness). A generating server answers with a 400, and so
does a proxy or router (the P and D engines behind them generate)."""
from __future__ import annotations

import asyncio
import base64
import struct
import time
import uuid

from fastapi import Request, Response

from picovllm.entrypoints.openai.engine_client import RequestStream
from picovllm.entrypoints.openai.protocol import APIError, EmbeddingRequest
from picovllm.entrypoints.openai.serving import (ENGINE_ERRORS, JSONBody, ServingContext, engine_request_id, now,
                                                 until_disconnected)
from picovllm.outputs import RequestOutput
from picovllm.pooling_params import PoolingParams


class EmbeddingHandler:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def __call__(self, req: EmbeddingRequest, raw: Request) -> Response:
        arrival = time.time()
        ctx = self.ctx
        ctx.check_model(req.model)
        info = ctx.engine.model_info()
        if info.get("runner") != "pooling":
            raise APIError(400, "/v1/embeddings needs a pooling model, and this server's model generates (serve it "
                                "with --runner pooling)")
        prompts = await self._prompt_ids(req, info["max_model_len"])
        params = PoolingParams(dimensions=req.dimensions, normalize=req.normalize, cache_salt=req.cache_salt)
        request_id = f"embd-{req.request_id or uuid.uuid4().hex}"
        engine_id = engine_request_id(request_id)     # a client's id may be another's too
        streams: list[RequestStream] = []
        finals: list[asyncio.Future] = []
        try:
            for i, ids in enumerate(prompts):
                streams.append(await ctx.add(ids, params, f"{engine_id}-{i}", arrival, req.priority, "input"))
            finals = [asyncio.ensure_future(_final(s)) for s in streams]
            task = await until_disconnected(raw, asyncio.gather(*finals))
        finally:
            for f in finals:              # one failed, or the client left: the others' waits end too
                f.cancel()
            for stream in streams:        # aborts those that have not finished (frees their blocks)
                stream.close()
        if task is None:
            return Response(status_code=499)     # the client is gone; nobody reads this
        try:
            outs = task.result()
        except ENGINE_ERRORS as e:
            raise APIError(503, str(e), type="service_unavailable") from None
        data = [{"object": "embedding", "index": i, "embedding": _encoded(_embedding(out, i), req)}
                for i, out in enumerate(outs)]
        tokens = sum(len(out.prompt_token_ids) for out in outs)
        return JSONBody({"id": request_id, "object": "list", "created": now(), "model": ctx.model_name, "data": data,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    async def _prompt_ids(self, req: EmbeddingRequest, max_model_len: int) -> list[list[int]]:
        """Each input's token ids, truncated as asked; a 400 naming input for one that is empty or too long."""
        inputs = req.inputs()
        keep = max_model_len if req.truncate_prompt_tokens == -1 else req.truncate_prompt_tokens
        if keep == 0:
            raise APIError(400, "truncate_prompt_tokens must be >= 1, or -1 (the model's maximum length)",
                           param="truncate_prompt_tokens")
        if keep is not None and keep > max_model_len:     # as vLLM's
            raise APIError(400, f"truncate_prompt_tokens ({keep}) is greater than max_model_len ({max_model_len})",
                           param="truncate_prompt_tokens")
        prompts = []
        for i, x in enumerate(inputs):
            where = "input" if len(inputs) == 1 else f"input[{i}]"
            ids = await self.ctx.tokenizer.encode(x, req.add_special_tokens, where) if isinstance(x, str) else list(x)
            ids = ids[-keep:] if keep is not None else ids
            if not ids:
                raise APIError(400, f"{where} is empty", param="input")
            if len(ids) > max_model_len:
                raise APIError(400, f"{where} is {len(ids)} tokens, longer than the model's maximum length "
                                    f"{max_model_len} (truncate_prompt_tokens keeps its last ones)", param="input")
            prompts.append(ids)
        return prompts


async def _final(stream: RequestStream) -> RequestOutput:
    out = None
    async for out in stream.outputs():
        pass
    return out


def _embedding(out: RequestOutput, index: int) -> list[float]:
    if out.embedding is None:       # aborted (the server is shutting down) or failed
        raise APIError(503, f"input {index}: {out.error or 'the request was aborted'}", type="service_unavailable")
    return out.embedding


def _encoded(embedding: list[float], req: EmbeddingRequest) -> list[float] | str:
    """The embedding as the request asks: floats, or base64 of its values in vLLM's embed_dtype (float32, float16
    or bfloat16) and endianness (native: this machine's); floats in another embed_dtype are its values rounded to
    it."""
    order = {"native": "=", "little": "<", "big": ">"}[req.endianness]
    if req.embed_dtype == "bfloat16":
        bits = [_bf16_bits(x) for x in embedding]
        if req.encoding_format == "float":
            return [struct.unpack("<f", struct.pack("<I", b << 16))[0] for b in bits]
        return base64.b64encode(struct.pack(f"{order}{len(bits)}H", *bits)).decode("ascii")
    code = {"float32": "f", "float16": "e"}[req.embed_dtype]
    if req.encoding_format == "float":
        return embedding if code == "f" else list(struct.unpack(f"<{len(embedding)}e",
                                                                 struct.pack(f"<{len(embedding)}e", *embedding)))
    return base64.b64encode(struct.pack(f"{order}{len(embedding)}{code}", *embedding)).decode("ascii")


def _bf16_bits(x: float) -> int:
    """x's bfloat16 bits, rounded to nearest even as torch rounds it."""
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    if (bits & 0x7F800000) == 0x7F800000 and bits & 0x7FFFFF:     # NaN
        return 0x7FC0
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF
