"""EngineConfig's fields as command-line flags (--max-model-len, --num-kv-blocks, ...), read back into an EngineConfig.

Generated from the dataclass, so a new EngineConfig field is a new flag: give it a line in HELP (and its values in
CHOICES where they are a closed set).
"""
from __future__ import annotations

import argparse
import dataclasses
import warnings

from picovllm.config import AUTO_MODEL_LEN, DTYPES, KV_CACHE_DTYPES, QUANTIZATIONS, EngineConfig
from picovllm.entrypoints.vllm_args import ENGINE_ARGS, add_vllm_args, human_readable_int, warn_unread_env

SKIP = ("model",)   # each command declares --model itself (positional or not)
# vLLM's short flags and other names (vllm_args.RENAMED)
ALIASES = {"tensor_parallel_size": ("-tp",), "quantization": ("-q",), "num_kv_blocks": ("--num-gpu-blocks-override",)}

# The values EngineConfig accepts, where they are a closed set: argparse refuses others and --help lists them
CHOICES = {"dtype": ("auto", *DTYPES), "quantization": QUANTIZATIONS, "kv_cache_dtype": tuple(KV_CACHE_DTYPES),
           "scheduling_policy": ("fcfs", "priority"), "attention_backend": ("auto", "torch", "triton", "cpu"),
           "role": ("pd", "p", "d"), "runner": ("generate", "pooling", "auto")}

# What each flag does (argparse adds the default); a default of None is said in words
HELP = {
    "tokenizer": "load the tokenizer from this HF folder, .gguf file or Hub repository, not the model's",
    "dtype": "weights' and activations' type; auto: bfloat16 on a GPU, float32 on the CPU",
    "device": "auto (a GPU when torch sees one, else the CPU), cpu, cuda or cuda:N",
    "max_model_len": "the longest prompt plus output, in tokens (default: the model's context; -1 or auto: that, or "
                     "what the KV cache holds where it holds less)",
    "block_size": "tokens per KV-cache block",
    "max_num_seqs": "the most requests one step runs",
    "max_num_batched_tokens": "the most tokens one step computes (longer prompts prefill in chunks)",
    "scheduling_policy": "fcfs, or priority (each request's priority, lower first)",
    "gpu_memory_utilization": "share of the GPU's memory for weights, activations and KV cache (GPUs only)",
    "cpu_kv_cache_gib": "the KV cache's size in GiB (the CPU only)",
    "num_kv_blocks": "KV-cache blocks, instead of sizing the cache from the memory budget",
    "enable_prefix_caching": "reuse the KV of a prompt's leading blocks computed before",
    "enforce_eager": "no CUDA graphs (GPU), no one-call decode stack (CPU)",
    "async_scheduling": "overlap the host's work with the device's (default: on for GPUs, without speculation)",
    "prefill_cuda_graphs": "CUDA graphs for one-chunk prefill steps of up to 512 tokens (default: on where decode "
                           "steps have graphs, one rank)",
    "warmup": "compile every Triton kernel variant at start-up (default: on for CUDA with the Triton backend)",
    "attention_backend": "torch, triton (GPU) or cpu (the C paged kernel); auto picks",
    "skip_tokenizer_init": "load no tokenizer: prompts as token ids, outputs without text",
    "trust_remote_code": "accepted for vLLM's command lines: picovllm never runs a checkpoint's own code",
    "revision": "the Hub repository's branch, tag or commit (default: main)",
    "download_dir": "where a Hub repository is fetched to and looked for (default: the Hub's cache)",
    "hf_overrides": "JSON: config.json fields set or replaced before the model is read (HF folders)",
    "tensor_parallel_size": "shard the model over this many ranks (processes)",
    "seed": "seeds torch and random at start-up, so unseeded sampling repeats run to run",
    "role": "pd: colocated; p: prefill only, d: decode only (serve's disaggregated servers)",
    "disk_cache": "keep a GGUF's tokenizer and weights, and compiled kernels, in the cache (`picovllm cache`)",
    "quantization": "auto: a GGUF's own 4/8-bit form on the CPU, an FP8 checkpoint's on a GPU; none: float; q8_0: "
                    "an HF folder quantized at load (CPU); bf16: bfloat16 decode weights (CPU); fp8: float8 weights "
                    "quantized at load (GPU; the CPU keeps their rounded values in float32)",
    "kv_cache_dtype": "auto: the model's dtype; fp8 (fp8_e4m3): float8 e4m3 with scales",
    "stream_interval": "a stream's outputs: its first token, then every this many tokens, and its last",
    "max_logprobs": "the most logprobs and prompt_logprobs a request may ask for (its -1, the whole vocabulary, counts "
                    "as the vocabulary's size); -1: no limit",
    "generation_config": "sampling defaults of requests that leave them unset: auto (the model's "
                         "generation_config.json), vllm (none) or a folder holding one",
    "override_generation_config": "JSON that sets or replaces those defaults, e.g. '{\"temperature\": 0.5}'",
    "reasoning_parser": "the thinking model's format: structured outputs constrain the answer after its thinking",
    "runner": "generate; pooling: prompts in, embeddings out; auto: generate",
    "pooler_config": "JSON: a pooling engine's pooling_type and normalize",
    "speculative_config": "JSON, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}' (default: none)",
}


def model_len_arg(text: str) -> int:
    """--max-model-len: a size as human_readable_int reads it, or vLLM's "auto" / -1 (fit to the KV cache)."""
    if text.strip().lower() in ("auto", "-1"):
        return AUTO_MODEL_LEN
    return human_readable_int(text)


# Sizes in tokens take vLLM's suffixes: --max-model-len 32k (32,000) or 32K (32,768)
TYPES = {"max_model_len": model_len_arg, "max_num_batched_tokens": human_readable_int}

# Flags one kind of device reads: elsewhere a warning, not an error (scripts pass them on every machine)
DEVICE_ONLY = {"gpu_memory_utilization": ("cuda", "GPUs"), "cpu_kv_cache_gib": ("cpu", "the CPU")}


def _flag_type(annotation: str, default):
    if "bool" in annotation:
        return None
    if annotation.startswith("int"):
        return int
    if annotation.startswith("float"):
        return float
    return str


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """skip: fields the command declares itself (e.g. `seed`, which generate uses for sampling)."""
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        if f.name in SKIP or f.name in skip:
            continue
        flags = ["--" + f.name.replace("_", "-"), *ALIASES.get(f.name, ())]
        kind = TYPES.get(f.name) or _flag_type(str(f.type), f.default)
        text = HELP.get(f.name, "").replace("%", "%%")
        if f.default is not None:
            text += f" (default: {('on' if f.default else 'off') if kind is None else '%(default)s'})"
        if kind is None:
            group.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default,
                               help=text)
        else:
            group.add_argument(*flags, dest=f.name, type=kind, default=f.default, choices=CHOICES.get(f.name),
                               help=text)
    add_vllm_args(parser, ENGINE_ARGS, "vLLM's engine flags picovllm has no setting for (a value other than those "
                                       "listed is refused)")


def engine_config_from_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    """Raises ValueError naming the bad field (EngineConfig validates); warns of a flag the device does not read,
    and of vLLM's environment variables, which picovllm does not read."""
    warn_unread_env()
    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if hasattr(args, f.name)}
    kw.update(overrides)
    config = EngineConfig(**kw)
    for name, (device, where) in DEVICE_ONLY.items():
        if name in kw and kw[name] != getattr(EngineConfig, name) and not str(config.device).startswith(device):
            warnings.warn(f"--{name.replace('_', '-')} applies to {where} only; this engine runs on "
                          f"{config.device}", stacklevel=2)
    return config
