"""POST /v1/embeddings, as vLLM serves it from a pooling model (`serve --runner pooling`; engine/pooling.py): one
engine request per input, each a prompt that is prefilled and never decoded; the embeddings come back as floats or as
base64 (little-endian float32, as OpenAI's). A generating server answers with a 400, and so does a proxy or router
(the P and D engines behind them generate)."""
from __future__ import annotations

import asyncio
import base64
import struct
import time
import uuid

from fastapi import Request, Response

from picovllm.entrypoints.openai.engine_client import RequestStream
from picovllm.entrypoints.openai.protocol import APIError, EmbeddingRequest
from picovllm.entrypoints.openai.serving import ENGINE_ERRORS, JSONBody, ServingContext, now, until_disconnected
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
        params = PoolingParams(dimensions=req.dimensions, normalize=req.normalize)
        request_id = f"embd-{uuid.uuid4().hex}"
        streams: list[RequestStream] = []
        finals: list[asyncio.Future] = []
        try:
            for i, ids in enumerate(prompts):
                streams.append(await ctx.add(ids, params, f"{request_id}-{i}", arrival, req.priority, "input"))
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
        data = [{"object": "embedding", "index": i, "embedding": _encoded(_embedding(out, i), req.encoding_format)}
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
        prompts = []
        for i, x in enumerate(inputs):
            ids = await self.ctx.tokenizer.encode(x, req.add_special_tokens) if isinstance(x, str) else list(x)
            ids = ids[-keep:] if keep is not None else ids
            where = "input" if len(inputs) == 1 else f"input[{i}]"
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


def _encoded(embedding: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return embedding
    return base64.b64encode(struct.pack(f"<{len(embedding)}f", *embedding)).decode("ascii")
