"""vLLM's command lines and keyword arguments as picovllm reads them: users paste `vllm serve MODEL ...` and
`LLM(...)`.

Four things, as vLLM's FlexibleArgumentParser does them: a flag may be spelt with underscores (`--max_model_len`),
`--config FILE.yaml` reads flags from a YAML file (the command line's win), sizes take k/K/m/M suffixes
(`--max-model-len 32k`), and a JSON flag's keys may be given one by one (`--hf-overrides.rope_theta 1e6`). And
vLLM's arguments that have no setting here (ENGINE_ARGS, SERVE_ARGS): each one is either meaningless here, and
accepted with any value, or taken only with the values that mean what picovllm does anyway, and any other value
refused naming the argument and why (at parse time for a flag, by LLM(...) for a keyword). A flag in none of them
is argparse's unrecognized argument, as a flag vLLM does not know is vLLM's.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import warnings
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class VllmArg:
    """One of vLLM's engine or server arguments without a field of its own here."""
    name: str                       # the keyword (the flag: --name-with-dashes)
    accepts: tuple | None           # the values that mean what picovllm does anyway (vLLM's default first);
                                    # None: every value (the argument means nothing here)
    why: str                        # what picovllm does instead: the help line, and the refusal's reason
    type: Callable | None = str     # the flag's value type; None: a bool (--name / --no-name)
    short: tuple[str, ...] = ()     # vLLM's short spellings (-pp, -O)
    nargs: str | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def refusal(self, value: Any, shown: Callable[[Any], str] = repr) -> str | None:
        """Why value is refused (each value written by shown), or None where it is taken."""
        if self.accepts is None or value in self.accepts:
            return None
        takes = [shown(a) for a in self.accepts if a is not None]
        return f"{shown(value)} is not supported by picovllm ({self.why}); " + \
            (f"it takes {', '.join(takes)}" if takes else "leave it unset")


def _as_flag_value(value: Any) -> str:
    """A value as a flag writes it: a bool as on or off."""
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


ANY = None
_TEXT_ONLY = "picovllm runs text-only models: no multi-modal inputs"
_NO_LORA = "LoRA adapters are not supported"
_PERFORMANCE = "torch.compile and CUDA-graph settings: picovllm runs its own kernels (performance only)"

# vLLM's engine arguments (EngineArgs; LLM(...) and every command that builds an engine)
ENGINE_ARGS: tuple[VllmArg, ...] = (
    VllmArg("enable_chunked_prefill", (None, True), "prompts longer than --max-num-batched-tokens always prefill in "
            "chunks here", type=None),
    VllmArg("pipeline_parallel_size", (1,), "a model is sharded by --tensor-parallel-size only", int, ("-pp",)),
    VllmArg("data_parallel_size", (1,), "one engine a server: run several servers behind a load balancer", int,
            ("-dp",)),
    VllmArg("distributed_executor_backend", (None, "mp", "uni"), "tensor-parallel ranks run as local processes "
            "picovllm starts (vLLM's mp), or in the torchrun world it is launched in"),
    VllmArg("cpu_offload_gb", (0,), "every weight stays on the engine's device", float),
    VllmArg("tokenizer_mode", ("auto", "hf"), "the model's HF tokenizer is loaded, its fast one where it has one"),
    VllmArg("tokenizer_revision", (None,), "a Hub tokenizer is read at its default branch, the model's at "
                                           "--revision"),
    VllmArg("load_format", ("auto", "safetensors", "gguf"), "an HF folder's safetensors or a GGUF file is read, by "
                                                            "what the model is"),
    VllmArg("disable_sliding_window", (False,), "a model's sliding window is always kept", type=None),
    VllmArg("enable_expert_parallel", ANY, "experts shard with --tensor-parallel-size (performance only)",
            type=None),
    VllmArg("enable_lora", (False,), _NO_LORA, type=None),
    VllmArg("max_loras", ANY, "read with --enable-lora only: " + _NO_LORA, int),
    VllmArg("max_lora_rank", ANY, "read with --enable-lora only: " + _NO_LORA, int),
    VllmArg("limit_mm_per_prompt", ANY, _TEXT_ONLY),
    VllmArg("swap_space", ANY, "a preempted request's KV is recomputed, never swapped to CPU memory", float),
    VllmArg("max_seq_len_to_capture", ANY, "CUDA-graph sizes are picovllm's own (performance only; --enforce-eager "
                                           "turns graphs off)", int),
    VllmArg("compilation_config", ANY, _PERFORMANCE, short=("-O",)),
    VllmArg("optimization_level", ANY, _PERFORMANCE),
    VllmArg("disable_custom_all_reduce", ANY, "an all-reduce kernel choice (performance only)", type=None),
    VllmArg("disable_log_stats", ANY, "no periodic statistics are logged; /metrics is always served", type=None),
    VllmArg("code_revision", ANY, "a checkpoint's own code never runs here (as --trust-remote-code)"),
)

# vLLM's server arguments (FrontendArgs, AsyncEngineArgs) `serve` takes without a setting of its own
SERVE_ARGS: tuple[VllmArg, ...] = (
    VllmArg("response_role", ("assistant",), "a chat reply's role is always assistant"),
    VllmArg("lora_modules", (None,), _NO_LORA, nargs="+"),
    VllmArg("disable_log_requests", ANY, "vLLM's deprecated flag: requests are logged with --enable-log-requests "
                                         "only", type=None),
)


class VllmArgAction(argparse.Action):
    """A VllmArg's flag: the value is refused at parse time (argparse's error line, naming the flag) unless it is
    one picovllm takes; a bool's flag has a --no- form, as vLLM's."""

    def __init__(self, option_strings, dest, arg: VllmArg, **kwargs):
        self.arg = arg
        if arg.type is None:
            option_strings = [*option_strings, *(s.replace("--", "--no-", 1) for s in option_strings
                                                  if s.startswith("--"))]
            kwargs["nargs"] = 0
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        if self.arg.type is None:
            values = not option_string.startswith("--no-")
        why = self.arg.refusal(values, _as_flag_value if self.arg.type is None else repr)
        if why is not None:
            raise argparse.ArgumentError(self, why)
        setattr(namespace, self.dest, values)

    def format_usage(self) -> str:
        return " | ".join(self.option_strings) if self.arg.type is None else self.option_strings[0]


def add_vllm_args(parser: argparse.ArgumentParser, args: tuple[VllmArg, ...], title: str) -> None:
    """args' flags, in a help group of their own: each says what picovllm does, and the values it takes."""
    group = parser.add_argument_group(title)
    for arg in args:
        takes = [_as_flag_value(a) for a in arg.accepts or () if a is not None]
        text = (f"accepted, no effect: {arg.why}" if arg.accepts is None else
                f"{arg.why}: only {', '.join(takes)}" if takes else f"refused: {arg.why}").replace("%", "%%")
        group.add_argument(arg.flag, *arg.short, dest=arg.name, action=VllmArgAction, arg=arg, default=None,
                           type=arg.type, nargs=arg.nargs, help=text,
                           metavar=None if arg.type is None else arg.name.upper())


# vLLM's names of EngineConfig's fields (and the flags' second spellings)
RENAMED = {"num_gpu_blocks_override": "num_kv_blocks"}


def llm_kwargs(kwargs: dict) -> dict:
    """LLM(**kwargs)'s EngineConfig fields: vLLM's arguments of ENGINE_ARGS taken out (a value picovllm does not
    take: ValueError naming the keyword), RENAMED's under EngineConfig's names."""
    known = {a.name: a for a in ENGINE_ARGS}
    out = {}
    for name, value in kwargs.items():
        if name in RENAMED:
            if RENAMED[name] in kwargs:
                raise ValueError(f"{name} and {RENAMED[name]} are one argument: give one")
            out[RENAMED[name]] = value
        elif name not in known:
            out[name] = value
        elif (why := known[name].refusal(value)) is not None:
            raise ValueError(f"{name}: {why}")
    return out


def human_readable_int(text: str) -> int:
    """vLLM's sizes: 32k is 32,000, 32K 32,768 (M, G likewise); 25.6k is 25,600 (no decimals with K, M, G)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgG])", text.strip())
    if m is None:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an int (or 32k, 32K, ...), got {text!r}") from None
    number, suffix = m.groups()
    if suffix.isupper():
        if "." in number:
            raise argparse.ArgumentTypeError(f"decimals go with k, m, g only (1000s), got {text!r}")
        return int(number) * 1024 ** "KMG".index(suffix) * 1024
    return int(float(number) * 1000 ** ("kmg".index(suffix) + 1))


def vllm_argv(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """A subcommand's arguments as vLLM's parser reads them: --config FILE's flags first (where the command takes
    --config), then every long flag's name with dashes for underscores (not its value, nor anything after --), and
    a JSON flag's keys given one by one (_with_dotted_keys)."""
    if "--config" in parser._option_string_actions:
        argv = _with_config_file(argv, parser)
    out, ended = [], False
    for arg in argv:
        if not ended and arg.startswith("--") and len(arg) > 2:
            name, eq, value = arg.partition("=")
            base, dot, keys = name.partition(".")
            arg = base.replace("_", "-") + dot + keys + eq + value
        ended = ended or arg == "--"
        out.append(arg)
    return _with_dotted_keys(out, parser)


def _with_dotted_keys(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """vLLM's JSON flags key by key: `--hf-overrides.rope_theta 1e6 --hf-overrides.rope_scaling.factor 2` is
    `--hf-overrides '{"rope_theta": 1000000.0, "rope_scaling": {"factor": 2}}'` (a value is JSON where it parses,
    else a string; `key+ a,b` appends to a list), merged over the flag's own JSON object if it is given too, in the
    first dotted key's place. A flag argparse does not know stays as it is (its error names it)."""
    out, objects, ended, i = [], {}, False, 0
    while i < len(argv):
        arg, i = argv[i], i + 1
        name, eq, value = arg.partition("=")
        base, _, keys = name.partition(".")
        if ended or not keys or not arg.startswith("--") or base not in parser._option_string_actions:
            ended = ended or arg == "--"
            out.append(arg)
            continue
        if not eq:
            if i == len(argv):
                parser.error(f"argument {name}: expected one argument")
            value, i = argv[i], i + 1
        if base not in objects:
            objects[base] = {}
            out.append(objects[base])          # a slot: the merged object goes here
        *path, last = keys.split(".")
        node = objects[base]
        for key in path:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                parser.error(f"argument {name}: {key!r} is given a value and keys")
        if last.endswith("+"):
            items = node.setdefault(last[:-1], [])
            if not isinstance(items, list):
                parser.error(f"argument {name}: {last[:-1]!r} is given a value, not a list to append to")
            items.extend(_json_or_text(v) for v in value.split(","))
        else:
            node[last] = _json_or_text(value)
    merged, j = [], 0
    while j < len(out):
        arg, j = out[j], j + 1
        if isinstance(arg, dict):
            merged.append(arg)
            continue
        base, eq, text = arg.partition("=")
        if base in objects and not eq and j < len(out) and isinstance(out[j], str):
            text, j = out[j], j + 1            # --flag JSON: its JSON is the next argument
        elif base not in objects or not eq:
            merged.append(arg)
            continue
        given = _json_or_text(text)             # the flag's own object: under the dotted keys
        if not isinstance(given, dict):
            parser.error(f"argument {base}: its keys are given one by one, so it must be a JSON object, got {text!r}")
        objects[base].update(_merged(given, objects[base]))
    slots = {id(obj): base for base, obj in objects.items()}
    return [x for a in merged for x in ([slots[id(a)], json.dumps(a)] if isinstance(a, dict) else [a])]


def _json_or_text(value: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _merged(base: dict, over: dict) -> dict:
    """base with over's keys set, nested mappings merged."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _with_config_file(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """--config FILE (or --config=FILE) replaced by the file's flags, put before the command line's (which win);
    its model where the command line gives none (a positional first, or --model)."""
    at = [i for i, a in enumerate(argv) if a == "--config" or a.startswith("--config=")]
    if not at:
        return argv
    if len(at) > 1:
        parser.error("argument --config: give one config file")
    i = at[0]
    if argv[i] == "--config":
        if i + 1 == len(argv):
            parser.error("argument --config: expected one argument")
        path, rest = argv[i + 1], argv[:i] + argv[i + 2:]
    else:
        path, rest = argv[i].split("=", 1)[1], argv[:i] + argv[i + 1:]
    flags = config_file_flags(path, parser)
    first = rest[:1] if rest and not rest[0].startswith("-") else []     # a positional model stays first
    if (first or any(re.match(r"--model(=|$)", a) for a in rest)) and "--model" in flags:
        at = flags.index("--model")
        del flags[at:at + 2]
    return first + flags + rest[len(first):]


def config_file_flags(path: str, parser: argparse.ArgumentParser) -> list[str]:
    """A vLLM config file's flags: a YAML mapping of flag names (dashes or underscores) to values; true is the
    flag, false its --no- form where it has one (else nothing: the default), a list the flag's values, a mapping
    JSON. A file that is not one: the parser's error naming --config."""
    import yaml

    if not path.endswith((".yaml", ".yml")):
        parser.error(f"argument --config: a YAML file (.yaml or .yml), got {path!r}")
    try:
        with open(path) as f:
            config = yaml.safe_load(f)
    except OSError as e:
        parser.error(f"argument --config: cannot read {path!r}: {e.strerror}")
    except yaml.YAMLError as e:
        parser.error(f"argument --config: {path!r} is not valid YAML: {' '.join(str(e).split())}")
    if config is None:
        return []
    if not isinstance(config, dict):
        parser.error(f"argument --config: {path!r} must hold a mapping of flag names to values")
    flags = []
    for key, value in config.items():
        flag = "--" + str(key).replace("_", "-")
        if isinstance(value, bool):
            no = flag.replace("--", "--no-", 1)
            flags += [flag] if value else [no] if no in parser._option_string_actions else []
        elif isinstance(value, list):
            flags += [flag, *map(str, value)] if value else []
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


# vLLM's environment variables picovllm reads (serve's --api-key); any other VLLM_* one has no effect here
READ_ENV = ("VLLM_API_KEY",)


def warn_unread_env(environ: dict[str, str] = os.environ) -> None:
    """A warning naming the VLLM_* environment variables set that picovllm does not read (they change what vLLM
    does: VLLM_CPU_KVCACHE_SPACE is --cpu-kv-cache-gib here, VLLM_ATTENTION_BACKEND --attention-backend)."""
    unread = sorted(k for k in environ if k.startswith("VLLM_") and k not in READ_ENV)
    if unread:
        warnings.warn(f"picovllm reads no VLLM_* environment variable but {', '.join(READ_ENV)}: "
                      f"{', '.join(unread)} {'has' if len(unread) == 1 else 'have'} no effect (see the flags)",
                      stacklevel=2)
