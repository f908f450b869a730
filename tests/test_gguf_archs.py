"""GGUF files of the qwen2 and qwen3 architectures (llama.cpp's names, NeoX rope: q/k rows not permuted), written
here from tiny HF checkpoints as llama.cpp's converter lays them out; the oracle is HF transformers on the HF
folder (fp32, CPU), greedy tokens and logprobs."""
import json
import os

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file

from picovllm import LLM, SamplingParams
from gguf_writing import prompt_logprob_errors
from test_parity_hf import LOGPROB_ATOL, hf_greedy, make_prompts

# HF name -> llama.cpp's ({} the layer)
HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    **{f"model.layers.{{}}.{hf}": f"blk.{{}}.{gg}" for hf, gg in [
        ("input_layernorm.weight", "attn_norm.weight"), ("post_attention_layernorm.weight", "ffn_norm.weight"),
        ("self_attn.q_proj.weight", "attn_q.weight"), ("self_attn.k_proj.weight", "attn_k.weight"),
        ("self_attn.v_proj.weight", "attn_v.weight"), ("self_attn.o_proj.weight", "attn_output.weight"),
        ("self_attn.q_proj.bias", "attn_q.bias"), ("self_attn.k_proj.bias", "attn_k.bias"),
        ("self_attn.v_proj.bias", "attn_v.bias"), ("self_attn.q_norm.weight", "attn_q_norm.weight"),
        ("self_attn.k_norm.weight", "attn_k_norm.weight"), ("mlp.gate_proj.weight", "ffn_gate.weight"),
        ("mlp.up_proj.weight", "ffn_up.weight"), ("mlp.down_proj.weight", "ffn_down.weight")]},
}


def gguf_name(name: str) -> str:
    parts = name.split(".")
    if parts[:2] == ["model", "layers"]:
        return HF_TO_GGUF["model.layers.{}." + ".".join(parts[3:])].format(parts[2])
    return HF_TO_GGUF[name]


def write_gguf(folder: str, arch: str, path: str, kind: str = "F32") -> str:
    cfg = json.load(open(os.path.join(folder, "config.json")))
    sd = load_file(os.path.join(folder, "model.safetensors"))
    w = gguf.GGUFWriter(path, arch)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg.get("rope_theta") or cfg.get("rope_parameters", {}).get("rope_theta", 10000.0))
    for name, t in sd.items():
        data = t.float().numpy()
        if kind == "Q8_0" and data.ndim == 2 and data.shape[1] % 32 == 0:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(data, Q.Q8_0), raw_dtype=Q.Q8_0)
        else:
            w.add_tensor(gguf_name(name), data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_gguf_matches_hf(tiny_models, tmp_path, arch):
    path = write_gguf(tiny_models[arch], arch, str(tmp_path / f"{arch}.gguf"))
    prompts = make_prompts()
    ref, ref_lp = hf_greedy(tiny_models[arch], prompts, 8)
    llm = LLM(path, device="cpu", num_kv_blocks=64, quantization="none")
    cfg = llm.engine.model_config
    assert cfg.architecture == {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
    assert (cfg.attention_bias, cfg.qk_norm) == (arch == "qwen2", arch == "qwen3")
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    for o, lp in zip(outs, ref_lp):
        assert [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] == \
            pytest.approx(lp, abs=LOGPROB_ATOL)


def test_qwen3_q8_0_gguf_runs_quantized_and_close_to_float(tiny_models, tmp_path):
    """Q8_0 matrices stay quantized on the CPU (quantization="auto"); the logprobs of the prompt stay near the
    float file's (8-bit weights, int8 activations)."""
    from picovllm.kernels.cpu.quant_gemm import QuantizedWeight, isa
    if isa() is None:
        pytest.skip("the quantized CPU kernels need a C compiler and AVX2")
    folder = tiny_models["qwen3"]
    f32 = LLM(write_gguf(folder, "qwen3", str(tmp_path / "f.gguf")), device="cpu", num_kv_blocks=64,
              quantization="none")
    q8 = LLM(write_gguf(folder, "qwen3", str(tmp_path / "q.gguf"), "Q8_0"), device="cpu", num_kv_blocks=64)
    assert any(isinstance(getattr(m, "packed", None), QuantizedWeight) for m in q8.engine.runner.model.modules())
    errs = prompt_logprob_errors(f32, q8, make_prompts()[3:6])
    assert np.mean(errs) < 0.06 and max(errs) < 0.3, (np.mean(errs), max(errs))


def test_end_of_generation_tokens_as_llama_cpp_reads_them():
    """A GGUF's stop tokens as llama.cpp takes them (llama-vocab.cpp): eos, eot and eom from the metadata, and
    control tokens whose text ends a turn; a token of that text that is not a control token does not stop, nor
    gpt-oss's <|end|> (it ends a message there, not the reply). Hand-written vocabularies."""
    from picovllm.loader.gguf_archs import end_of_generation
    normal, control = 1, 3
    vocab = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "hello", "<end_of_turn>", "<|end|>", "<|eot_id|>"]
    types = [control, control, control, normal, normal, control, control]
    meta = {"tokenizer.ggml.tokens": vocab, "tokenizer.ggml.token_type": types}
    assert end_of_generation({**meta, "tokenizer.ggml.eos_token_id": 0}) == [0, 2, 5, 6]
    assert end_of_generation({**meta, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.eot_token_id": 3,
                              "tokenizer.ggml.eom_token_id": 4}) == [2, 3, 4, 0, 5, 6]
    assert end_of_generation({**meta, "general.architecture": "gpt-oss", "tokenizer.ggml.eos_token_id": 6}) == [6, 0, 2]
    assert end_of_generation({"tokenizer.ggml.eos_token_id": 7}) == [7]       # no vocabulary: the metadata's only
    assert end_of_generation({}) == []


def test_default_model_stops_at_its_end_of_text_too():
    """SmolLM2's GGUF: eos <|im_end|> (2); <|endoftext|> (0), a control token, ends generation too, as in llama.cpp."""
    from picovllm.loader.default_model import default_model_path
    from picovllm.loader.source import open_model_source
    assert open_model_source(default_model_path()).config.eos_token_ids == [2, 0]
