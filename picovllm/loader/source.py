from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

from picovllm.config import ModelConfig

if TYPE_CHECKING:
    import torch

WeightIterator = Iterator[tuple[str, "torch.Tensor"]]


@dataclass
class ModelSource:
    path: str
    config: ModelConfig
    weights: Callable[[], WeightIterator]                # HF-named tensors, full (unsharded)
    load_tokenizer: Callable[[], object] | None          # None: no tokenizer files (token-id prompts only)
    identity: tuple | None = None                        # what the weights' content rests on (cache keys)
    # GGUF: its tensors as the file stores them, HF-named: quantized ones as gguf_quants.DecodedBlocks, the
    # others as float32 tensors (None: no quantized form, e.g. an HF folder)
    stored_weights: Callable[[], Iterator[tuple[str, object]]] | None = None
    fp8: "Fp8Checkpoint | None" = None                   # an FP8 checkpoint's (its weights() dequantized)


@dataclass(frozen=True)
class Fp8Checkpoint:
    """What an FP8 HF checkpoint's tensors say, beside its dequantized weights: on a GPU they run as fp8 again
    (layers/fp8_weights.py, quantization "auto" or "fp8")."""
    quantized: frozenset[str]        # the names of its float8 weights (NAME.weight with a scale)
    weights: frozenset[str]          # the names of all its NAME.weight tensors
    # its scale blocks (rows, cols), quantized again in which its codes come back; None: per tensor or channel, or
    # rows the loader reorders (then per row)
    block: tuple[int, int] | None = None
    pow2_scales: bool = False        # its block scales are powers of two (scale_fmt "ue8m0")
    per_channel: bool = False        # a scale per output row: quantized again per row, its codes come back

    @property
    def comes_back(self) -> bool:
        """Whether quantizing its dequantized weights again gives back its codes (blocks or rows whose largest code
        is e4m3's largest, as its quantizers make them; per-tensor scales would be re-rounded row by row)."""
        return self.block is not None or self.per_channel


def engine_model_source(config, weights_needed: bool = True) -> ModelSource:
    """The model an EngineConfig names: its model, revision, download_dir, hf_overrides and disk_cache."""
    return open_model_source(config.model, config.disk_cache, weights_needed, config.revision, config.download_dir,
                             config.hf_overrides)


def open_model_source(model: str | None, disk_cache: bool = True, weights_needed: bool = True,
                      revision: str | None = None, download_dir: str | None = None,
                      hf_overrides: dict | str | None = None) -> ModelSource:
    """model: an HF folder, a .gguf file, a Hugging Face Hub repository (resolve_model), "random:<preset>" (random
    weights of a benchmark preset's shape, made as they are loaded: picovllm/bench/random_checkpoint.py), or None for
    the default model. disk_cache: keep what is derived from a GGUF (tokenizer, dequantized weights) in the artifact
    cache (picovllm/artifact_cache.py).
    weights_needed=False: a front end's, the config and tokenizer only (a Hub repository's weights not fetched).
    revision, download_dir: a Hub repository's (resolve_model; refused for any other model). hf_overrides (a dict
    or its JSON text): config.json fields set before the model is read (an HF folder's; refused for another kind of
    model, before anything is fetched)."""
    from picovllm.artifact_cache import ArtifactCache
    from picovllm.config import parse_hf_overrides
    from picovllm.loader.default_model import default_model_path

    hf_overrides = parse_hf_overrides(hf_overrides)
    if model is None or model.startswith("random:"):
        what = "the default model" if model is None else model
        _hub_only(revision, download_dir, what)
        _no_overrides(hf_overrides, what)
        if model is None:
            path = default_model_path()
        else:
            from picovllm.bench.random_checkpoint import random_source
            return random_source(model[len("random:"):])
    else:
        if model.endswith(".gguf"):
            _no_overrides(hf_overrides, model)
        path = resolve_model(model, weights_needed, revision, download_dir)
    if os.path.isdir(path):
        from picovllm.loader import hf_folder
        return hf_folder.open_folder(path, weights_needed, hf_overrides)
    _no_overrides(hf_overrides, path)
    if path.endswith(".gguf"):
        from picovllm.loader import gguf_file   # needs the gguf package, which an HF-only setup may lack
        return gguf_file.open_gguf(path, ArtifactCache.from_env() if disk_cache else None)
    raise ValueError(f"model path {path!r} is neither a folder nor a .gguf file")


def _no_overrides(hf_overrides: dict | None, model: str) -> None:
    if hf_overrides:
        raise ValueError(f"hf_overrides: they set config.json fields of an HF folder; {model!r} has none")


def _hub_only(revision: str | None, download_dir: str | None, what: str) -> None:
    """revision and download_dir name where a Hub repository comes from: refused for a model that is none."""
    for field, value in (("revision", revision), ("download_dir", download_dir)):
        if value is not None:
            raise ValueError(f"{field} {value!r} applies to a Hugging Face Hub repository id; {what!r} is not one")


# a Hub repository id ("org/name"), or one GGUF file in one ("org/name/file.gguf")
_REPO = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(/[^/]+\.gguf)?")
# what an HF folder needs of a repository: configs, tokenizer files, chat templates (and the weights); not its
# subfolders' files (fnmatch's * matches "/") nor Mistral's consolidated.safetensors (the weights again, its names)
HUB_FILES = ["*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
HUB_IGNORED = ["*/*", "consolidated*"]


def is_hub_id(model: str) -> bool:
    """Does `model` name a Hub repository (or a GGUF in one) rather than a local path?"""
    return not os.path.exists(model) and not model.startswith((".", "/", "~")) and bool(_REPO.fullmatch(model))


@functools.lru_cache(maxsize=None)
def resolve_model(model: str, weights_needed: bool = True, revision: str | None = None,
                  download_dir: str | None = None) -> str:
    """A local path as it is; else a Hugging Face Hub repository id, as vLLM takes one: "org/name" (its configs,
    tokenizer files and, if weights_needed, safetensors) or "org/name/file.gguf" (that file), at `revision` (a
    branch, tag or commit; None: main), fetched into download_dir (None: the Hub's cache, HF_HOME / HF_HUB_CACHE)
    or found there (HF_HUB_OFFLINE=1: only there). ValueError naming the model otherwise, and naming `revision` or
    `download_dir` given with a local path (a folder or file has neither)."""
    if os.path.exists(model):
        _hub_only(revision, download_dir, model)
        return model
    if not is_hub_id(model):
        raise ValueError(f"model path {model!r} does not exist (give an HF model folder, a .gguf file or a Hugging "
                         "Face Hub repository id such as Qwen/Qwen3-0.6B)")
    try:
        import huggingface_hub
        if model.endswith(".gguf"):
            org, name, file = model.split("/", 2)
            return huggingface_hub.hf_hub_download(f"{org}/{name}", file, revision=revision, cache_dir=download_dir)
        patterns = HUB_FILES + (["*.safetensors"] if weights_needed else [])
        return huggingface_hub.snapshot_download(model, revision=revision, cache_dir=download_dir,
                                                 allow_patterns=patterns, ignore_patterns=HUB_IGNORED)
    except Exception as e:  # noqa: BLE001 - offline, unknown, gated: one error naming the model and the cause
        at = f" at revision {revision!r}" if revision is not None else ""
        raise ValueError(f"model {model!r} is no local path, and fetching it{at} from the Hugging Face Hub failed: "
                         f"{type(e).__name__}: {e}") from None

