"""POST /tokenize and POST /detokenize, as vLLM's: token ids for a prompt or a conversation (the ids the
generation endpoints would run, e.g. to build a logit_bias), and text for token ids."""
from __future__ import annotations

from picovllm.entrypoints.openai.protocol import APIError, DetokenizeRequest, TokenizeRequest
from picovllm.entrypoints.openai.serving import ServingContext


async def tokenize(ctx: ServingContext, req: TokenizeRequest) -> dict:
    ctx.check_model(req.model)
    req.checked()
    if req.messages is not None:
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None   # as chat's "auto"
        ids = await ctx.tokenizer.encode_chat(ctx.template_messages(req.messages), req.add_generation_prompt,
                                              req.special_tokens, tools=tools,
                                              continue_final_message=req.continue_final_message,
                                              chat_template_kwargs=req.chat_template_kwargs,
                                              documents=req.documents, chat_template=req.chat_template)
    else:
        ids = await ctx.tokenizer.encode(req.prompt, req.special_tokens)
    return {"count": len(ids), "max_model_len": ctx.engine.model_info()["max_model_len"], "tokens": ids,
            "token_strs": await ctx.tokenizer.token_strs(ids) if req.return_token_strs else None}   # vLLM's null


async def detokenize(ctx: ServingContext, req: DetokenizeRequest) -> dict:
    ctx.check_model(req.model)
    vocab = ctx.engine.model_info()["vocab_size"]
    bad = next((t for t in req.tokens if t >= vocab), None)
    if bad is not None:
        raise APIError(400, f"tokens: ids must be in [0, {vocab}), got {bad}", param="tokens")
    return {"prompt": await ctx.tokenizer.decode(req.tokens)}
