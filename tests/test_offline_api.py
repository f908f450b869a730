"""The offline API as a vLLM user's code calls it: vLLM's argument names and positions on LLM.generate, .chat,
.beam_search, .embed and .encode, its SamplingParams conventions, and a clear ValueError naming what picovllm does
not honour (LoRA adapters, ...) instead of a TypeError or a silent difference. Oracle for numbers: HF transformers."""
import dataclasses

import pytest
import torch

from picovllm import LLM, BeamSearchParams, PoolingRequestOutput, SamplingParams
from picovllm.entrypoints.streaming import StreamedRequest

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPT = list(range(5, 30))


@pytest.fixture(scope="module")
def tiny_llm(tiny_models):
    return LLM(tiny_models["llama"], block_size=4, num_kv_blocks=64)


# -- SamplingParams --------------------------------------------------------------------------------------------


def test_sampling_params_reads_vllms_conventions():
    assert SamplingParams(seed=-1).seed is None             # vLLM's "no seed", not the seeded stream -1
    assert SamplingParams(seed=-1, n=2, temperature=1).seed is None
    assert SamplingParams(logprobs=True).logprobs == 1
    sp = SamplingParams(stop=["x"], logit_bias={3: 1.0}, spaces_between_special_tokens=False)
    copy = sp.clone()
    assert copy == sp and copy.stop is not sp.stop and copy.logit_bias is not sp.logit_bias
    assert SamplingParams(2).n == 2


def test_sampling_params_refuses_by_field_name():
    with pytest.raises(TypeError):      # vLLM's second positional field is presence_penalty, not temperature
        SamplingParams(1, 0.5)
    for kw in [dict(detokenize=False), dict(ignore_eos="yes"), dict(skip_special_tokens="no"),
               dict(spaces_between_special_tokens=None), dict(detokenize=1)]:
        with pytest.raises(ValueError, match=rf"SamplingParams\.{next(iter(kw))}"):
            SamplingParams(**kw)


# -- LLM.generate ----------------------------------------------------------------------------------------------


def test_generate_takes_vllms_keywords(tiny_llm):
    want = tiny_llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    out = tiny_llm.generate({"prompt_token_ids": PROMPT}, GREEDY, use_tqdm=False, lora_request=None,
                            tokenization_kwargs=None)[0]
    assert out.outputs[0].token_ids == want
    outs = tiny_llm.generate(({"prompt_token_ids": PROMPT} for _ in range(2)), GREEDY, use_tqdm=False)   # a generator
    assert [o.outputs[0].token_ids for o in outs] == [want, want]
    cut = tiny_llm.generate([PROMPT], dataclasses.replace(GREEDY, truncate_prompt_tokens=7), use_tqdm=False)[0]
    by_kwargs = tiny_llm.generate([PROMPT], GREEDY, use_tqdm=False, tokenization_kwargs={"truncate_prompt_tokens": 7})
    assert by_kwargs[0].prompt_token_ids == cut.prompt_token_ids == PROMPT[-7:]
    assert by_kwargs[0].outputs[0].token_ids == cut.outputs[0].token_ids


def test_generate_beside_a_request_of_the_step_api(tiny_llm):
    """LLM.generate on an engine that runs a request added through llm.engine.add_request (the step-by-step API):
    generate waits for its own prompts' samples, not for any request's end. It counted the other request's final
    output as one of its own, stopped early and raised KeyError, its own request left running in the engine.
    The other request's final output, which generate's steps made, is the next engine.step()'s (it was lost)."""
    want = tiny_llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    alone = tiny_llm.generate([[7, 8, 9]], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].token_ids
    eng = tiny_llm.engine

    def other_final(other: str) -> list[int]:
        assert eng.has_unfinished_requests()        # its final output is still to be taken
        outs = eng.step()
        assert [o.request_id for o in outs] == [other] and outs[0].finished
        assert not eng.has_unfinished_requests() and eng.step() == []
        return outs[0].outputs[0].token_ids

    other = eng.add_request([7, 8, 9], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    out = tiny_llm.generate([PROMPT], GREEDY, use_tqdm=False)       # the other one ends first, after one token
    assert [o.outputs[0].token_ids for o in out] == [want]
    assert other not in eng.requests and other_final(other) == alone
    other = eng.add_request([7, 8, 9], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    out = tiny_llm.generate([PROMPT, PROMPT[:9]], dataclasses.replace(GREEDY, n=2), use_tqdm=False)
    assert [len(c.token_ids) for o in out for c in o.outputs] == [4] * 4
    assert other not in eng.requests and other_final(other) == alone
    other = eng.add_request([7, 8, 9], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    streamed = StreamedRequest(eng, PROMPT, GREEDY)     # the CLI's streamed generate steps the engine alike
    list(streamed)
    assert streamed.output.outputs[0].token_ids == want and other_final(other) == alone


def test_tokens_prompt_text_is_the_outputs_prompt(tiny_llm):
    """vLLM's TokensPrompt may carry its text ("prompt"): RequestOutput.prompt shows it; the ids are what runs."""
    outs = tiny_llm.generate([{"prompt_token_ids": PROMPT, "prompt": "some text"}, {"prompt_token_ids": PROMPT}],
                             GREEDY, use_tqdm=False)
    assert [o.prompt for o in outs] == ["some text", None]
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_generate_refuses_what_it_does_not_honour(tiny_llm):
    for kw, name in [(dict(lora_request=object()), "lora_request"),
                     (dict(tokenization_kwargs={"add_special_tokens": False}), "tokenization_kwargs")]:
        with pytest.raises(ValueError, match=name):
            tiny_llm.generate([PROMPT], GREEDY, use_tqdm=False, **kw)
    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams"):
        tiny_llm.generate([PROMPT], {"temperature": 0}, use_tqdm=False)
    assert not tiny_llm.engine.requests


def test_logprobs_match_hf(tiny_models, tiny_llm):
    """Sample logprobs are the model's own (vLLM's raw_logprobs: before temperature), the sampled token's among
    them even when it is not in the top k; cumulative_logprob is their sum."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float64).eval()
    out = tiny_llm.generate([PROMPT], SamplingParams(temperature=0.7, seed=3, max_tokens=4, logprobs=1,
                                                     ignore_eos=True), use_tqdm=False)[0].outputs[0]
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT + out.token_ids])).logits[0, len(PROMPT) - 1:-1].log_softmax(-1)
    for i, (tok, top) in enumerate(zip(out.token_ids, out.logprobs)):
        assert tok in top and len(top) <= 2
        assert abs(top[tok].logprob - ref[i, tok].item()) < 1e-4
        best = int(ref[i].argmax())
        assert best in top and top[best].rank == 1
    assert out.cumulative_logprob == pytest.approx(sum(top[t].logprob for t, top in zip(out.token_ids, out.logprobs)))


# -- LLM.beam_search -------------------------------------------------------------------------------------------


def test_beam_search_takes_vllms_arguments(tiny_llm):
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    prompts = [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT[:9]}, {"prompt_token_ids": PROMPT[4:]}]
    whole = tiny_llm.beam_search(prompts, params)
    positional = tiny_llm.beam_search(prompts, params, None, False)      # vLLM's order: lora_request, use_tqdm
    batched = tiny_llm.beam_search(prompts, params, concurrency_limit=2)

    def tokens(outs):
        return [[b.tokens for b in o.sequences] for o in outs]

    assert tokens(positional) == tokens(batched) == tokens(whole) and len(whole) == 3
    with pytest.raises(ValueError, match="lora_request"):
        tiny_llm.beam_search(prompts, params, lora_request=object())
    with pytest.raises(ValueError, match="concurrency_limit"):
        tiny_llm.beam_search(prompts, params, concurrency_limit=0)


# -- LLM.embed / LLM.encode ------------------------------------------------------------------------------------


def test_encode_and_embed_as_vllms(tiny_models):
    llm = LLM(tiny_models["qwen3"], runner="pooling", block_size=16, num_kv_blocks=32)
    prompts = [PROMPT, PROMPT[:6]]
    emb = llm.embed(prompts, use_tqdm=False, lora_request=None)
    enc = llm.encode(prompts, use_tqdm=False, pooling_task="embed")
    assert all(isinstance(o, PoolingRequestOutput) for o in enc)
    for e, p in zip(enc, emb):
        assert isinstance(e.outputs.data, torch.Tensor) and e.prompt_token_ids == p.prompt_token_ids
        assert torch.allclose(e.outputs.data, torch.tensor(p.outputs.embedding))
    again = llm.embed([PROMPT], use_tqdm=False)[0]
    assert again.num_cached_tokens == 16          # vLLM's field: the full block taken from the prefix cache
    cut = llm.embed([PROMPT], use_tqdm=False, tokenization_kwargs={"truncate_prompt_tokens": 5})[0]
    assert cut.prompt_token_ids == PROMPT[-5:]
    for kw, name in [(dict(pooling_task=None), "pooling_task"), (dict(pooling_task="classify"), "pooling_task"),
                     (dict(pooling_task="embed", lora_request=object()), "lora_request")]:
        with pytest.raises(ValueError, match=name):
            llm.encode(prompts, use_tqdm=False, **kw)


# -- LLM.chat (the default model: it has a chat template) ------------------------------------------------------


def test_chat_takes_vllms_arguments_in_its_order(default_llm):
    msgs = [{"role": "user", "content": "Say hi"}]
    sp = SamplingParams(temperature=0, max_tokens=3)
    want = default_llm.chat(msgs, sp, use_tqdm=False)[0]
    # vLLM's positions: messages, sampling_params, use_tqdm, lora_request, chat_template, content format, ...
    got = default_llm.chat(msgs, sp, False, None, None, "auto", True, False)[0]
    assert got.prompt == want.prompt and got.outputs[0].token_ids == want.outputs[0].token_ids
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": "hi"}]}]
    joined = [{"role": "user", "content": "Say\nhi"}]
    as_string = default_llm.chat(parts, sp, use_tqdm=False, chat_template_content_format="string")[0]
    assert as_string.prompt_token_ids == default_llm.chat(joined, sp, use_tqdm=False)[0].prompt_token_ids
    for kw, name in [(dict(lora_request=object()), "lora_request"), (dict(mm_processor_kwargs={"a": 1}),
                                                                      "mm_processor_kwargs"),
                     (dict(chat_template_content_format="openai"), "chat_template_content_format"),
                     (dict(tokenization_kwargs={"add_special_tokens": True}), "tokenization_kwargs")]:
        with pytest.raises(ValueError, match=name):
            default_llm.chat(msgs, sp, use_tqdm=False, **kw)
