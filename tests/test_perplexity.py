"""Quality of the quantized path: the default model's perplexity on public-domain English (tests/data, Alice's
Adventures in Wonderland, chapters I-II) with the GGUF's weights kept quantized, against the float32 dequantized
path on the same tokens: within 1% (benchmarks/perplexity.py runs the whole 6,039 tokens and llama.cpp too)."""
import os

import pytest

from picovllm import LLM
from picovllm.bench.perplexity import perplexity, token_logprobs
from picovllm.kernels.cpu.quant_gemm import QuantizedWeight

TEXT = os.path.join(os.path.dirname(__file__), "data", "alice_ch1-2.txt")
TOKENS = 1024


def test_quantized_perplexity_within_one_percent_of_float32():
    with open(TEXT) as f:
        text = f.read()
    ppl = {}
    for quantization in ("auto", "none"):
        with LLM(quantization=quantization, enable_prefix_caching=False, num_kv_blocks=TOKENS // 16 + 8) as llm:
            qkv = llm.engine.runner.model.layers[0].self_attn.qkv_proj.packed
            assert isinstance(qkv, QuantizedWeight) == (quantization == "auto")
            ids = llm.get_tokenizer()(text).input_ids[:TOKENS]
            assert len(ids) == TOKENS
            ppl[quantization] = perplexity(token_logprobs(llm, ids))
    assert abs(ppl["auto"] / ppl["none"] - 1) < 0.01, ppl
