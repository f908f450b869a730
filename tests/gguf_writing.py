"""For the GGUF family tests (test_gguf_gpt_oss, _deepseek, _glm, _cohere): what their writers share once a file's
metadata is written (the tensors added by kind, the file closed), their HF folders built at first use, their
prompts, greedy generation with logprobs, the writer hooks their refusal tests pass, and (test_gguf_archs and
_families too) a quantized file's checks against the same file run float.

Each test module keeps what is its family's own: the metadata keys, the tensor names (llama.cpp's converter's
layout), which tensors the converter keeps float32, the prompts' lengths.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from picovllm import LLM, SamplingParams

# GGUF name -> float array, or (ggml type name, its raw bytes) for a tensor already packed (gpt-oss's MXFP4 experts)
Tensors = dict[str, "np.ndarray | tuple[str, np.ndarray]"]
# A writer hook: called with the writer (metadata written) and the tensors (not yet added); may change either
WriterHook = Callable[[gguf.GGUFWriter, Tensors], None]


def write_file(w: gguf.GGUFWriter, tensors: Tensors, kind: str, keep_f32: Callable[[str], bool] | None = None,
               extra: WriterHook | None = None) -> None:
    """Adds `tensors` to the writer `w` (its metadata written) and writes and closes the file. `extra` first, as a
    test's hook. kind: the matrices' type, F32, F16 or Q8_0 (Q8_0 for the 2-D ones only: stacked experts stay
    F32); 1-D tensors and those `keep_f32` names stay F32, as the converter keeps them; packed tensors are written
    as their bytes."""
    if extra is not None:
        extra(w, tensors)
    for name, data in tensors.items():
        if isinstance(data, tuple):
            w.add_tensor(name, data[1], raw_dtype=Q[data[0]])
        elif data.ndim < 2 or (keep_f32 is not None and keep_f32(name)) or kind == "F32":
            w.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
        elif kind == "F16":
            w.add_tensor(name, data.astype(np.float16))
        elif data.ndim == 2:
            w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(data), Q.Q8_0), raw_dtype=Q.Q8_0)
        else:
            w.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def hf_folders(root: Path, build: Callable[[str, str, bool], str]) -> Callable[[str], str]:
    """name -> an HF folder under `root`, built at first use by build(folder, case, f16): "<case>" the case's
    random weights, "<case>_f16" the same weights rounded to float16."""
    made = {}

    def get(name: str) -> str:
        if name not in made:
            case, f16 = name.removesuffix("_f16"), name.endswith("_f16")
            made[name] = build(str(root / name), case, f16)
        return made[name]
    return get


def random_prompts(seed: int, lengths: tuple[int, ...], vocab: int) -> list[list[int]]:
    """One prompt of each length, random ids from 3 (past the pad, bos and eos ids) to vocab."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def greedy(llm: LLM, ps: list[list[int]], new: int) -> tuple[list[list[int]], list[list[float]]]:
    """`new` greedy tokens after each prompt (eos ignored), and each token's logprob."""
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, logprobs=0),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], \
        [[d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]


def prompt_logprob_errors(floats: LLM, quantized: LLM, ps: list[list[int]]) -> list[float]:
    """|quantized's - floats'| logprob of each prompt token but the first (which has none), the same file run
    float (quantization "none") and quantized."""
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=0)
    return [abs(a[t].logprob - b[t].logprob)
            for x, y in zip(floats.generate(ps, sp, use_tqdm=False), quantized.generate(ps, sp, use_tqdm=False))
            for a, b, t in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:], x.prompt_token_ids[1:])]


def assert_packed_as_float(quantized: LLM, floats: LLM, names: list[str]) -> None:
    """Each module `names` of quantized's model holds its weight quantized (the CPU kernels' packed form), the very
    weight floats' model (the same file dequantized at load) holds."""
    from picovllm.kernels.cpu.quant_gemm import QuantizedWeight
    params = dict(floats.engine.runner.model.named_parameters())
    packed = {n: m.packed for n, m in quantized.engine.runner.model.named_modules()
              if isinstance(getattr(m, "packed", None), QuantizedWeight)}
    for name in names:
        assert name in packed, (name, sorted(packed))
        assert torch.allclose(packed[name].dequantize(), params[name + ".weight"], rtol=0, atol=1e-6), name


def set_or_remove(key: str, value=None) -> WriterHook:
    """A writer hook for a refusal test. A tensor `key` (a name ending in .weight or .bias, no architecture prefix)
    is removed or, given `value`, set to it (float32). A metadata key `key` is removed, the writer's own value with
    it, and, given `value`, written again: a list as an array, a float as float32, an int as uint32."""
    def extra(w: gguf.GGUFWriter, tensors: Tensors) -> None:
        for kv in w.kv_data:
            kv.pop(key, None)
        if key.endswith((".weight", ".bias")):
            if value is None:
                del tensors[key]
            else:
                tensors[key] = np.asarray(value, dtype=np.float32)
        elif isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif value is not None:
            w.add_uint32(key, value)
    return extra
