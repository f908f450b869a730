"""The offline API, named as in vLLM: LLM(...).generate(prompts, sampling_params), .chat(...) and .beam_search(...);
LLM(model, runner="pooling").embed(prompts)."""
from __future__ import annotations

import dataclasses
import time
from typing import Sequence

from tqdm import tqdm

from picovllm.config import EngineConfig
from picovllm.engine.admission import encode_text
from picovllm.engine.llm_engine import Engine
from picovllm.engine.step_loop import StepLoop
from picovllm.entrypoints.beam_search import BeamSearchOutput, BeamSearchParams, search, step_params
from picovllm.entrypoints.parallel_sampling import SampleBatch
from picovllm.entrypoints.vllm_args import llm_kwargs
from picovllm.generation_config import sampling_defaults
from picovllm.outputs import (EmbeddingOutput, EmbeddingRequestOutput, PoolingOutput, PoolingRequestOutput,
                              RequestOutput)
from picovllm.pooling_params import PoolingParams
from picovllm.sampling_params import SamplingParams

Prompt = str | list[int] | dict


def prompt_list(prompts) -> list:
    """One prompt (text, token ids, or a prompt dict) or a sequence of them -> a list of them."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def tokens_prompt_texts(prompts) -> list[str | None]:
    """Per prompt: a TokensPrompt's own "prompt" text (vLLM's RequestOutput.prompt then shows it), else None."""
    return [p.get("prompt") if isinstance(p, dict) and "prompt_token_ids" in p else None for p in prompt_list(prompts)]


def tokenization_truncation(tokenization_kwargs: dict | None, default: int | None = None) -> int | None:
    """vLLM's tokenization_kwargs: its truncate_prompt_tokens (else default); ValueError naming any other key, which
    is not honoured here."""
    extra = dict(tokenization_kwargs or {})
    truncate = extra.pop("truncate_prompt_tokens", default)
    if extra:
        raise ValueError(f"tokenization_kwargs: {sorted(extra)[0]!r} is not supported (only 'truncate_prompt_tokens')")
    return truncate


def refuse_unsupported(**given) -> None:
    """vLLM's arguments picovllm does not honour (LoRA adapters, multi-modal processing): ValueError naming the one
    given, rather than running without it. None (vLLM's default) passes."""
    for name, value in given.items():
        if value is not None:
            raise ValueError(f"{name}: not supported by picovllm (got {value!r}); leave it None")


def normalize_prompts(prompts, sampling_params, name: str = "sampling_params") -> tuple[list, list[SamplingParams]]:
    """generate()'s inputs as vLLM takes them -> a list of prompts (text or token ids) and one
    SamplingParams per prompt (with a prompt dict's cache_salt). sampling_params None: beam search's prompts,
    which take no cache_salt. name: the caller's argument (errors name it)."""
    prompts = prompt_list(prompts)
    salts = [p.get("cache_salt") if isinstance(p, dict) else None for p in prompts]
    prompts = [_dict_prompt(p) if isinstance(p, dict) else p for p in prompts]
    beams = sampling_params is None
    if sampling_params is None:
        sampling_params = SamplingParams()
    params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"{name} has {len(params)} entries for {len(prompts)} prompts")
    for i, salt in enumerate(salts):
        if salt is not None:
            if beams:
                raise ValueError("prompt: the key 'cache_salt' is not supported by beam search")
            params[i] = dataclasses.replace(params[i], cache_salt=salt)    # a ValueError unless a non-empty string
    return prompts, params


def _dict_prompt(p: dict) -> str | list[int]:
    """vLLM's TextPrompt ({"prompt": text}) or TokensPrompt ({"prompt_token_ids": ids}; its "prompt" text, if given,
    is not read), either with a cache_salt (normalize_prompts puts it in the prompt's params); any other key
    (multi_modal_data, prompt_embeds, ...) is not honoured here: a ValueError naming it."""
    unknown = sorted(set(p) - {"prompt", "prompt_token_ids", "cache_salt"})
    if unknown:
        raise ValueError(f"prompt: the key {unknown[0]!r} is not supported (a prompt dict takes \"prompt\" or "
                         f"\"prompt_token_ids\", and \"cache_salt\")")
    if "prompt_token_ids" in p:
        return p["prompt_token_ids"]
    if "prompt" not in p:
        raise ValueError("prompt: a prompt dict needs \"prompt\" (text) or \"prompt_token_ids\" (token ids)")
    return p["prompt"]


def _progress_bar(use_tqdm, total: int, desc: str):
    """A progress bar, hidden unless use_tqdm; use_tqdm may be a tqdm-like factory (vLLM's), which then makes it."""
    return (use_tqdm if callable(use_tqdm) else tqdm)(total=total, desc=desc, disable=not use_tqdm,
                                                      dynamic_ncols=True)


class _TokenRates:
    """The progress bar's prefill and decode rates since a run began (the engine's token counts)."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.t0, self.start = engine, time.time(), dataclasses.replace(engine.stats)

    def text(self) -> str:
        dt = max(time.time() - self.t0, 1e-9)
        now = self.engine.stats
        return (f"prefill {(now.prefill_tokens - self.start.prefill_tokens) / dt:.0f} tok/s, "
                f"decode {(now.decode_tokens - self.start.decode_tokens) / dt:.0f} tok/s")


# vLLM's older task= argument -> EngineConfig.runner (its other tasks, classify, score, reward, ..., are not run here)
TASK_RUNNERS = {"auto": "auto", "generate": "generate", "embed": "pooling", "embedding": "pooling"}


class LLM:
    def __init__(self, model: str | None = None, **kwargs) -> None:
        """kwargs: EngineConfig's fields; vLLM's older task="embed" for runner="pooling"; and vLLM's arguments
        without a field here (entrypoints/vllm_args.py: a value other than those meaning what picovllm does anyway
        is refused naming it)."""
        kwargs = llm_kwargs(kwargs)
        task = kwargs.pop("task", None)
        if task is not None:
            if task not in TASK_RUNNERS:
                raise ValueError(f"task {task!r} is not supported: {', '.join(map(repr, TASK_RUNNERS))} "
                                 "(or runner='generate' | 'pooling')")
            if "runner" in kwargs and kwargs["runner"] != TASK_RUNNERS[task]:
                raise ValueError(f"task {task!r} and runner {kwargs['runner']!r} disagree: give one")
            kwargs["runner"] = TASK_RUNNERS[task]
        self.config = EngineConfig(model=model, **kwargs)
        if self.config.role != "pd":      # before the model loads: its engine would wait for a peer it never gets
            raise ValueError(f"EngineConfig.role {self.config.role!r}: LLM runs colocated ('pd'); a prefill or decode "
                             "engine runs behind `picovllm serve --role p|d` (with the proxy or router), or use "
                             "DisaggLLM / `picovllm generate --disagg`")
        self.sampling_defaults = sampling_defaults(self.config.model, self.config.generation_config,
                                                   self.config.override_generation_config, self.config.revision,
                                                   self.config.download_dir)
        self.engine = Engine(self.config)

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: SamplingParams with the model's generation config (picovllm/generation_config.py) on top of
        SamplingParams' own defaults; what generate() and chat() use without sampling_params."""
        return SamplingParams(**self.sampling_defaults)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def shutdown(self) -> None:
        """Stop tensor-parallel workers, if any; the LLM cannot generate afterwards. Idempotent.

        Also happens on `with LLM(...) as llm:` exit, when the LLM is garbage collected, and at exit."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None, *, lora_request=None,
                 tokenization_kwargs: dict | None = None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order, with params.n CompletionOutputs (parallel_sampling.py).
        priority: one per prompt, for the "priority" scheduling policy (lower first). lora_request: vLLM's, refused
        unless None. tokenization_kwargs: vLLM's; only {"truncate_prompt_tokens": k} (SamplingParams')."""
        refuse_unsupported(lora_request=lora_request)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        prompts = prompt_list(prompts)      # once: a generator of prompts is read here only
        texts = tokens_prompt_texts(prompts)
        prompts, params = normalize_prompts(prompts, sampling_params)
        truncate = tokenization_truncation(tokenization_kwargs)
        params = [self._checked_params(sp, truncate) for sp in params]
        priorities = self._priorities(priority, len(prompts))
        batch = SampleBatch(self.engine)
        try:
            for p, sp, pr in zip(prompts, params, priorities):
                batch.add(p, sp, pr)
        except Exception:
            batch.abort()      # leave the engine as we found it
            raise
        outs = self.run_batch(batch, use_tqdm)
        for out, text in zip(outs, texts):
            if text is not None:
                out.prompt = text
        return outs

    def _checked_params(self, params: SamplingParams, truncate: int | None) -> SamplingParams:
        """params with tokenization_kwargs' truncate_prompt_tokens (truncate); ValueError naming what is not
        honoured."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams (or a list of them), got {params!r}")
        if not params.spaces_between_special_tokens and not getattr(self.engine.tokenizer, "is_fast", True):
            # a slow tokenizer's decode would put the spaces in, which the engine's detokenizer never does
            raise ValueError("SamplingParams.spaces_between_special_tokens: False is not supported with this "
                             "model's (slow) tokenizer")
        return params if truncate is None else dataclasses.replace(params, truncate_prompt_tokens=truncate)

    @staticmethod
    def _priorities(priority: Sequence[int] | None, n: int) -> list[int]:
        if priority is None:
            return [0] * n
        if isinstance(priority, (str, bytes)) or not hasattr(priority, "__len__") or len(priority) != n:
            raise ValueError(f"priority must be a list with one int per prompt ({n}), got {priority!r}")
        return list(priority)

    def run_batch(self, batch: SampleBatch, use_tqdm: bool = True) -> list[RequestOutput]:
        """Step until every sample of the batch has finished: one RequestOutput per prompt, its samples merged (the
        batch's siblings added as their first samples compute the prompt). Aborts what is left if it raises."""
        total = batch.num_requests
        final: dict[str, RequestOutput] = {}
        bar = _progress_bar(use_tqdm, total, "Processed prompts" if total == len(batch.prompts) else
                            "Processed samples")
        rates = _TokenRates(self.engine) if use_tqdm else None

        others: list[RequestOutput] = []    # of requests added through self.engine beside the batch: theirs

        def collect(outputs: list[RequestOutput]) -> None:
            for out in outputs:
                if out.request_id not in batch.ids:
                    others.append(out)
                elif out.finished:
                    final[out.request_id] = out
                    bar.update(1)
            batch.add_ready_siblings()
            if rates is not None:
                bar.set_postfix_str(rates.text(), refresh=False)

        try:        # no input comes while it runs: the loop never waits
            batch.add_ready_siblings()
            StepLoop(self.engine, unfinished_outputs=False).run_until(
                lambda: len(final) == total or not (self.engine.has_unfinished_requests() or batch.waiting), collect)
        except BaseException:
            batch.abort(final)
            raise
        finally:
            self.engine.hold_outputs(others)    # the next engine.step() returns them
            bar.close()
        return batch.outputs(final)

    def embed(self, prompts: Prompt | Sequence[Prompt],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, use_tqdm: bool = True,
              truncate_prompt_tokens: int | None = None, *, lora_request=None,
              tokenization_kwargs: dict | None = None) -> list[EmbeddingRequestOutput]:
        """vLLM's: one EmbeddingRequestOutput per prompt, in order (outputs.embedding: a list of floats), from an
        LLM(model, runner="pooling") (engine/pooling.py). truncate_prompt_tokens: each prompt's last k tokens only
        (PoolingParams.truncate_prompt_tokens). lora_request, tokenization_kwargs: as generate()'s."""
        finals = self._pooled(prompts, pooling_params, use_tqdm, truncate_prompt_tokens, lora_request,
                              tokenization_kwargs)
        return [EmbeddingRequestOutput(out.request_id, EmbeddingOutput(out.embedding), out.prompt_token_ids, True,
                                       out.num_cached_tokens) for out in finals]

    def encode(self, prompts: Prompt | Sequence[Prompt],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *,
               truncate_prompt_tokens: int | None = None, use_tqdm: bool = True, lora_request=None,
               pooling_task: str | None = None, tokenization_kwargs: dict | None = None) -> list[PoolingRequestOutput]:
        """vLLM's: one PoolingRequestOutput per prompt, its outputs.data a tensor. pooling_task must be given, as
        vLLM asks; only "embed" is run here (embed() is the same with lists of floats)."""
        if pooling_task is None:
            raise ValueError("pooling_task: required for LLM.encode (\"embed\"), or use LLM.embed")
        if pooling_task != "embed":
            raise ValueError(f"pooling_task {pooling_task!r} is not supported: only 'embed'")
        import torch
        finals = self._pooled(prompts, pooling_params, use_tqdm, truncate_prompt_tokens, lora_request,
                              tokenization_kwargs)
        return [PoolingRequestOutput(out.request_id, PoolingOutput(torch.tensor(out.embedding)), out.prompt_token_ids,
                                     True, out.num_cached_tokens) for out in finals]

    def _pooled(self, prompts, pooling_params, use_tqdm, truncate_prompt_tokens, lora_request,
                tokenization_kwargs) -> list[RequestOutput]:
        """Each prompt's finished pooling request, in order, its embedding set."""
        refuse_unsupported(lora_request=lora_request)
        if self.engine.pooler is None:
            raise ValueError("LLM.embed needs a pooling model: LLM(model, runner='pooling') (or vLLM's task='embed')")
        truncate = tokenization_truncation(tokenization_kwargs, truncate_prompt_tokens)
        prompts, params = normalize_prompts(prompts, PoolingParams() if pooling_params is None else pooling_params,
                                           "pooling_params")
        if truncate is not None:
            params = [dataclasses.replace(p, truncate_prompt_tokens=truncate) for p in params]
        batch = SampleBatch(self.engine)       # one request a prompt (PoolingParams have no n)
        try:
            for p, pp in zip(prompts, params):
                batch.add_request(p, pp)
        except Exception:
            batch.abort()      # leave the engine as we found it
            raise
        outs = self.run_batch(batch, use_tqdm)
        for out in outs:
            if out.embedding is None:
                raise RuntimeError(f"request {out.request_id} ended without its embedding: "
                                   f"{out.error or out.outputs[0].finish_reason}")
        return outs

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             lora_request=None, chat_template: str | None = None, chat_template_content_format: str = "auto",
             add_generation_prompt: bool = True, continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None, tokenization_kwargs: dict | None = None,
             mm_processor_kwargs: dict | None = None) -> list[RequestOutput]:
        """vLLM's, its arguments in its order. messages: one conversation or a list of them. tools: OpenAI tool
        objects, rendered as the server renders them (entrypoints/openai/tool_calls.py); constrain or parse the
        calls with its ToolPolicy. chat_template_content_format: "auto" (text parts kept a list where the template
        loops over them, else joined) or "string" (always joined); "openai" is refused. continue_final_message: the
        last (assistant) message is left open for the model to continue (add_generation_prompt must be False).
        chat_template_kwargs: more variables for the template (e.g. Qwen3's {"enable_thinking": False}).
        lora_request, mm_processor_kwargs: refused unless None."""
        refuse_unsupported(lora_request=lora_request, mm_processor_kwargs=mm_processor_kwargs)
        if chat_template_content_format not in ("auto", "string"):
            raise ValueError(f"chat_template_content_format {chat_template_content_format!r} is not supported: "
                             f"'auto' or 'string'")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        if chat_template_content_format == "string":
            convs = [_string_contents(c) for c in convs]
        rendered = [chat_prompt(self.engine.tokenizer, c, add_generation_prompt, chat_template, tools,
                                continue_final_message, chat_template_kwargs) for c in convs]
        outs = self.generate([ids for _, ids in rendered], sampling_params, use_tqdm,
                             tokenization_kwargs=tokenization_kwargs)
        for out, (text, _) in zip(outs, rendered):
            out.prompt = text          # as vLLM's: the rendered template's text
        return outs

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams, lora_request=None,
                    use_tqdm: bool = False, concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's (its arguments in its order): each prompt's params.beam_width best beams by beam search
        (entrypoints/beam_search.py), best first; each beam's tokens hold the prompt's, then the generated ones.
        use_tqdm: a bar over the steps. concurrency_limit: at most this many prompts searched at once (the results
        are the same). lora_request: refused unless None."""
        refuse_unsupported(lora_request=lora_request)
        c = concurrency_limit
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
            raise ValueError(f"concurrency_limit must be None or an int >= 1, got {c!r}")
        prompts = prompt_list(prompts)
        if c is not None and len(prompts) > c:     # batches of c prompts, one after the other
            return [o for i in range(0, len(prompts), c)
                    for o in self.beam_search(prompts[i:i + c], params, use_tqdm=use_tqdm)]
        if not isinstance(params, BeamSearchParams):
            raise ValueError("params must be a BeamSearchParams")
        params.validate()
        texts, _ = normalize_prompts(prompts, None)
        ids = [self.engine.tokenize(p) for p in texts]
        for p in ids:
            if not p:
                raise ValueError("prompt is empty")
            if len(p) + params.max_tokens > self.engine.max_model_len:
                raise ValueError(f"prompt ({len(p)} tokens) + BeamSearchParams.max_tokens ({params.max_tokens}) "
                                 f"exceed max_model_len {self.engine.max_model_len}")
        eos = self.engine.eos_token_ids
        steps, step = search(ids, params, eos), step_params(params, eos, self.engine.model_config.vocab_size)
        bar = _progress_bar(use_tqdm, params.max_tokens, "Beam search steps")
        try:
            batch = next(steps)
            while True:
                outs = self.generate(batch, step, use_tqdm=False)
                bar.update(1)
                batch = steps.send([o.outputs[0].logprobs[0] for o in outs])
        except StopIteration as done:
            results = done.value
        finally:
            bar.close()
        tok = self.engine.tokenizer
        for beams in results:
            for beam in beams:
                beam.text = tok.decode(beam.text_token_ids(params.include_stop_str_in_output),
                                       skip_special_tokens=True) if tok is not None else None
        return [BeamSearchOutput(beams) for beams in results]

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = True,
                            chat_template: str | None = None, tools: list[dict] | None = None,
                            continue_final_message: bool = False, chat_template_kwargs: dict | None = None
                            ) -> list[int]:
        return chat_prompt_ids(self.engine.tokenizer, conversation, add_generation_prompt, chat_template, tools,
                               continue_final_message, chat_template_kwargs)


def _string_contents(conversation):
    """chat_template_content_format "string": each message's list of text parts joined by newlines (as "auto" does
    for a template that does not loop over them); anything else as it is, for conversation_messages to check."""
    if not isinstance(conversation, list):
        return conversation
    return [dict(m, content="\n".join(p["text"] for p in m["content"]))
            if isinstance(m, dict) and _text_parts(m.get("content")) else m for m in conversation]


def _text_parts(content) -> bool:
    return isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                             and isinstance(p.get("text"), str) for p in content)


def chat_prompt_ids(tokenizer, conversation: list[dict], add_generation_prompt: bool = True,
                    chat_template: str | None = None, tools: list[dict] | None = None,
                    continue_final_message: bool = False, chat_template_kwargs: dict | None = None) -> list[int]:
    """The conversation through the tokenizer's chat template, as token ids. tools: through the template if it
    renders them, else described in a system message. The other options: LLM.chat's."""
    return chat_prompt(tokenizer, conversation, add_generation_prompt, chat_template, tools, continue_final_message,
                       chat_template_kwargs)[1]


def chat_prompt(tokenizer, conversation: list[dict], add_generation_prompt: bool = True,
                chat_template: str | None = None, tools: list[dict] | None = None,
                continue_final_message: bool = False, chat_template_kwargs: dict | None = None
                ) -> tuple[str, list[int]]:
    """chat_prompt_ids' rendered text and its token ids."""
    from jinja2 import TemplateError

    from picovllm.entrypoints.chat_template import (content_for_template, conversation_messages, resolved_template,
                                                    template_kwargs)
    from picovllm.entrypoints.openai.tool_calls import template_renders_tools, with_tool_prompt
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer, and this model has none")
    conversation = conversation_messages(conversation)
    options = template_kwargs(conversation, add_generation_prompt, continue_final_message, chat_template_kwargs)
    chat_template = resolved_template(tokenizer, chat_template, tools)
    conversation = content_for_template(conversation, chat_template)
    if tools and not template_renders_tools(chat_template):
        conversation, tools = with_tool_prompt(conversation, tools), None
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False, chat_template=chat_template,
                                             tools=tools or None, **options)
    except TemplateError as e:      # the template's own refusal (raise_exception), or a message it cannot render
        raise ValueError(f"messages: the chat template cannot render them: {e}") from None
    # The template already holds any BOS it wants; don't let the tokenizer add a second.
    return text, encode_text(tokenizer, text, "messages", add_special_tokens=False)
