"""GGUF files (the architectures of loader/gguf_archs.py, llama.cpp's names), dequantized to float at load time
(or mapped from the artifact cache), or kept quantized (stored_weights: as stored where the CPU kernels run the
type, else requantized to their 8-bit form).

The artifact cache keeps two entries a file: "gguf" (config and converted tokenizer), made at the first open, and
"gguf_float" (the dequantized weights), made the first time they are asked for. The CPU's default, quantized weights
(stored_weights) never ask: a first start of the default model writes 94 MB, not 611, and takes ~5 s less."""
from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
from typing import Iterator

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType

from picovllm.artifact_cache import ArtifactCache, file_identity, make_key
from picovllm.config import ModelConfig
from picovllm.loader import gguf_quants, gguf_tokenizer, tensor_file
from picovllm.loader.gguf_archs import ARCHITECTURES, Arch, Part, hf_specs, hf_tensors, model_config, tensor_parts
from picovllm.loader.gguf_format import GGUFFile, GGUFTensor
from picovllm.loader.quantize_at_load import quantize_q8
from picovllm.loader.source import ModelSource, WeightIterator

# Read as they are: floats, and the quantized types the CPU kernels run (gguf_quants). Requantized on the CPU: types
# the kernels do not run, dequantized by the gguf package and quantized again into the kernels' 8-bit form (a scale
# per 16 weights: within half a step of max / 127 of the file's weight, far inside these formats' own steps). MXFP4
# (GPT-OSS's experts, which are float in the model) is dequantized by gguf_quants.dequantize_mxfp4.
SUPPORTED_TYPES = ("F32", "F16", "BF16") + gguf_quants.QUANTIZED_TYPES + ("Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q5_K",
                                                                      "IQ4_NL", "IQ4_XS", "MXFP4")


def _model_config(gf: GGUFFile) -> tuple[ModelConfig, Arch]:
    return model_config(gf.metadata, gf.tensors, gf.path)


def _layout(gf: GGUFFile, config: ModelConfig, arch: Arch) -> list[tuple[GGUFTensor, list[Part]]]:
    """Each file tensor (in file order) with the HF tensors it holds; unsupported types and names refused, and HF
    tensors assembled from several file tensors (GPT-OSS's gate_up_proj) some of which are missing."""
    out = []
    for t in gf.tensors.values():
        kind = GGMLQuantizationType(t.ggml_type).name
        if kind not in SUPPORTED_TYPES:
            raise ValueError(f"GGUF tensor {t.name!r}: quantization {kind} is unsupported "
                             f"(supported: {', '.join(SUPPORTED_TYPES)})")
        out.append((t, tensor_parts(t.name, tuple(reversed(t.shape)), config, arch)))
    try:
        hf_specs(part for _, parts in out for part in parts)
    except ValueError as e:
        raise ValueError(f"GGUF {gf.path!r}: {e}") from None
    return out


def _float(t: GGUFTensor) -> torch.Tensor:
    """The whole file tensor dequantized to float32, in torch's dimension order."""
    shape = tuple(reversed(t.shape))
    rows = max(1, int(np.prod(shape[:-1], dtype=np.int64)))
    if GGMLQuantizationType(t.ggml_type).name == "MXFP4":
        return torch.from_numpy(gguf_quants.dequantize_mxfp4(t.data, rows, shape[-1])).reshape(shape)
    w = np.array(gguf.quants.dequantize(t.data.reshape(rows, -1), GGMLQuantizationType(t.ggml_type)),
                 dtype=np.float32)
    return torch.from_numpy(w).reshape(shape)


def _dequantized(gf: GGUFFile, config: ModelConfig, arch: Arch) -> WeightIterator:
    def pieces():
        for t, parts in _layout(gf, config, arch):
            if parts:
                w = _float(t)
                yield from ((part, part.of(w)) for part in parts)
    return hf_tensors(pieces())


def _stored(gf: GGUFFile, config: ModelConfig, arch: Arch) -> Iterator[tuple[str, object]]:
    """ModelSource.stored_weights: the linear layers' quantized 2-d tensors as DecodedBlocks (rows in HF order),
    the rest (norms, routers, experts, float tensors) as float."""
    def pieces():
        for t, parts in _layout(gf, config, arch):
            kind = GGMLQuantizationType(t.ggml_type).name
            linear = parts and len(t.shape) == 2 and all(p.linear for p in parts)
            if linear and kind in gguf_quants.QUANTIZED_TYPES:
                blocks = gguf_quants.decode_blocks(kind, t.data, *reversed(t.shape))
                yield from ((part, blocks.take_rows(part.take)) for part in parts)
            elif linear and kind not in ("F32", "F16", "BF16"):          # requantized (SUPPORTED_TYPES)
                blocks = quantize_q8(_float(t))
                yield from ((part, blocks.take_rows(part.take)) for part in parts)
            elif parts:
                w = _float(t)
                yield from ((part, part.of(w)) for part in parts)
    return hf_tensors(pieces())


def open_gguf(path: str, cache: ArtifactCache | None = None) -> ModelSource:
    """A GGUF file as a ModelSource. With a cache, the first start stores the config and the converted
    tokenizer, the first call of weights() the dequantized weights, and later starts map those instead of reading
    the file again."""
    identity = ("gguf", file_identity(path))
    if cache is not None:
        config_fields = [f.name for f in dataclasses.fields(ModelConfig)]     # config.json's schema
        key = make_key(identity, _transformers_version(), config_fields)
        entry_key = make_key(key, gguf_tokenizer.CONVERSION_VERSION)      # the float weights do not depend on it
        folder = cache.get_or_build("gguf", entry_key, lambda entry: _write_entry(GGUFFile(path), entry),
                                    os.path.abspath(path))
        if folder is not None:
            return _source_from_entry(path, folder, identity, lambda: _float_weights(path, cache, key))
    return _source_from_file(GGUFFile(path), identity)


def _source_from_file(gf: GGUFFile, identity: tuple) -> ModelSource:
    config, arch = _model_config(gf)
    _layout(gf, config, arch)            # refuse unsupported tensors now, not halfway through loading
    has_tok = "tokenizer.ggml.tokens" in gf.metadata
    return ModelSource(gf.path, config, lambda: _dequantized(gf, config, arch),
                       (lambda: gguf_tokenizer.from_metadata(gf.metadata, gf.path)) if has_tok else None, identity,
                       lambda: _stored(gf, config, arch))


# -- the cache entries: "gguf" (config.json, tokenizer/ by save_pretrained), "gguf_float" (weights.safetensors) --
def _write_entry(gf: GGUFFile, folder: str) -> None:
    src = _source_from_file(gf, ())
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"model": dataclasses.asdict(src.config), "has_tokenizer": src.load_tokenizer is not None}, f)
    if src.load_tokenizer is not None:
        src.load_tokenizer().save_pretrained(os.path.join(folder, "tokenizer"))


def _write_float_entry(gf: GGUFFile, folder: str) -> None:
    config, arch = _model_config(gf)
    specs = hf_specs(part for _, parts in _layout(gf, config, arch) for part in parts)
    tensor_file.write(os.path.join(folder, "weights.safetensors"), specs, _dequantized(gf, config, arch))


def _float_weights(path: str, cache: ArtifactCache, key: str) -> WeightIterator:
    """The dequantized weights: mapped from their entry, made now if there is none (read from the file if it
    cannot be stored)."""
    folder = cache.get_or_build("gguf_float", key, lambda entry: _write_float_entry(GGUFFile(path), entry),
                                os.path.abspath(path))
    if folder is None:
        gf = GGUFFile(path)
        config, arch = _model_config(gf)
        return _dequantized(gf, config, arch)
    return tensor_file.read(os.path.join(folder, "weights.safetensors"))


def _source_from_entry(path: str, folder: str, identity: tuple, weights) -> ModelSource:
    with open(os.path.join(folder, "config.json")) as f:
        entry = json.load(f)
    config = ModelConfig(**entry["model"])
    tok_dir = os.path.join(folder, "tokenizer")
    return ModelSource(path, config, weights,
                       (lambda: gguf_tokenizer.load_saved(tok_dir)) if entry["has_tokenizer"] else None, identity,
                       lambda: _stored_from_file(path, config))


def _stored_from_file(path: str, config: ModelConfig) -> Iterator[tuple[str, object]]:
    gf = GGUFFile(path)
    return _stored(gf, config, ARCHITECTURES[gf.metadata["general.architecture"]])


def _transformers_version() -> str:
    """The tokenizer conversion is transformers': a new version may convert differently."""
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return "none"
