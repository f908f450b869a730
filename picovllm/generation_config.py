"""A model's recommended sampling defaults: its HF `generation_config.json`, as vLLM reads it.

vLLM (`--generation-config auto`, its default) takes temperature, top_p, top_k, min_p, repetition_penalty and
max_new_tokens from the model folder's generation_config.json and uses them for every request that leaves the field
unset (max_new_tokens caps max_tokens); "vllm" ignores the file; a folder path reads that folder's file instead.
`--override-generation-config '{"temperature": 0.5}'` sets or replaces values on top. Which fields a request set is
the server's to say (entrypoints/openai/protocol.py); offline, `LLM.generate` without sampling params uses them
(`LLM.get_default_sampling_params`). A GGUF file carries no generation config: nothing changes for it.

Torch-free: the proxy and the router read it too.
"""
from __future__ import annotations

import json
import os

# generation_config.json's name -> SamplingParams' (the keys vLLM reads; do_sample and the rest are not sampling
# defaults a request could override)
KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
MODES = ("auto", "vllm")    # or a folder path


def _read(folder: str, required: bool) -> dict:
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        if required:
            raise ValueError(f"generation_config: {folder!r} has no generation_config.json")
        return {}
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"generation_config: cannot read {path}: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"generation_config: {path} is not a JSON object")
    return raw


def parse_override(value) -> dict | None:
    """--override-generation-config's value: a dict, or its JSON text (None: no override)."""
    from picovllm.config import parse_json_object
    return parse_json_object(value, "override_generation_config", "generation config fields")


def _local(model: str | None, revision: str | None = None, download_dir: str | None = None) -> str | None:
    """The model's local folder or file (a Hub repository's configs in the Hub's cache); None where there is none.
    A Hub repository that cannot be fetched is a ValueError naming it (its defaults would silently be lost)."""
    if model is None or model.startswith("random:"):
        return None
    from picovllm.loader.source import is_hub_id, resolve_model
    if not is_hub_id(model):
        return model if os.path.exists(model) else None
    return resolve_model(model, False, revision, download_dir)


def sampling_defaults(model: str | None, mode: str = "auto", override: dict | str | None = None,
                      revision: str | None = None, download_dir: str | None = None) -> dict:
    """SamplingParams keyword arguments a request that leaves them unset gets, e.g. {"temperature": 0.6, "top_k":
    20}; {} for none. model: the model's folder or file (a GGUF, None or "random:..." has no generation config);
    override: a dict or its JSON text (parse_override). Raises ValueError naming the bad key or value."""
    from picovllm.sampling_params import SamplingParams

    override = parse_override(override)

    if mode == "vllm":
        raw = {}
    elif mode == "auto":
        local = _local(model, revision, download_dir)
        raw = _read(local, False) if local is not None and os.path.isdir(local) else {}
    else:
        raw = _read(mode, True)
    raw = {k: raw[k] for k in KEYS if raw.get(k) is not None}
    for k in override or {}:
        if k not in KEYS:
            raise ValueError(f"override_generation_config: {k!r} is not one of {', '.join(KEYS)}")
    raw.update(override or {})
    defaults = {KEYS[k]: v for k, v in raw.items()}
    try:
        SamplingParams(**defaults)
    except ValueError as e:   # SamplingParams names the field
        raise ValueError(f"generation config {raw}: {e} (generation_config 'vllm', --generation-config vllm, "
                         "ignores the model's file)") from None
    return defaults


def describe(defaults: dict) -> str:
    """The start-up log line (vLLM logs the same)."""
    return (f"default sampling parameters from the model's generation config: {defaults} (a request's own values "
            "win, but max_tokens is capped by the config's; --generation-config vllm ignores the file)")
