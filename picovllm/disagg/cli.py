"""`picovllm generate --disagg ...`: an offline disaggregated generation from the command line.

The main CLI wires it as: add_disagg_arguments(generate_parser), and when args.disagg is set,
return run_disagg_generate(args). Standalone: python -m picovllm.disagg.cli "prompt" ...
"""
from __future__ import annotations

import argparse
import statistics
import sys

# The names of picovllm.disagg.transfer.BACKENDS, written out so that building the CLI's parser does not import
# the backends (and torch); tests/test_cli.py checks the two agree.
BACKEND_NAMES = ("cuda_ipc", "torch_dist")


def add_disagg_arguments(parser: argparse.ArgumentParser, switch: bool = True) -> None:
    """switch: add --disagg too (a command that is always disaggregated leaves it out)."""
    g = parser.add_argument_group("prefill/decode disaggregation")
    if switch:
        g.add_argument("--disagg", action="store_true", help="run prefill and decode in two processes")
    g.add_argument("--kv-transfer", choices=BACKEND_NAMES, default="torch_dist", help="KV transfer backend")
    g.add_argument("--sync-transfer", action="store_true", help="engines wait on each transfer (default: async)")
    g.add_argument("--prefill-device", default="auto")
    g.add_argument("--decode-device", default="auto")
    g.add_argument("--decode-num-kv-blocks", type=int, default=None, help="size the decode cache by hand")
    g.add_argument("--prefill-tp", type=int, default=None, help="tensor-parallel size of the prefill engine")
    g.add_argument("--decode-tp", type=int, default=None, help="tensor-parallel size of the decode engine "
                   "(may differ from --prefill-tp: KV heads are re-split; torch_dist only)")
    g.add_argument("--transfer-timeout", type=float, default=30.0, help="seconds before a transfer fails")
    g.add_argument("--lease", type=float, default=10.0, help="seconds of silence before a peer counts as dead")
    g.add_argument("--host", default="127.0.0.1", help="the interface this process's PD sockets bind "
                   "(0.0.0.0: every one; default: this host only)")
    g.add_argument("--advertise-host", default=None, help="this host's address as its peers reach it "
                   "(default: --host; required with 0.0.0.0)")


def run_disagg_generate(args: argparse.Namespace) -> int:
    """Generate for args.prompts with P and D in their own processes; print text, TTFT and ITL."""
    from picovllm.disagg.driver import generate_disaggregated
    from picovllm.sampling_params import SamplingParams

    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    outs = generate_disaggregated(getattr(args, "model", None), list(args.prompts), params, **disagg_options(args))
    failed = 0
    for out in outs:
        comp = out.outputs[0]
        print(f"[{out.request_id}] {out.prompt or out.prompt_token_ids!r} -> {comp.text or comp.token_ids!r}")
        m = out.metrics
        if out.error:
            failed += 1
            print(f"    error: {out.error}")
        elif m is not None and m.ttft is not None:
            itl = m.itls
            print(f"    TTFT {m.ttft * 1e3:.1f} ms, ITL mean {statistics.mean(itl) * 1e3 if itl else 0:.1f} ms, "
                  f"max {max(itl) * 1e3 if itl else 0:.1f} ms, finish {comp.finish_reason}")
    return 1 if failed else 0


def disagg_options(args: argparse.Namespace) -> dict:
    """The DisaggLLM / generate_disaggregated keyword arguments the flags give (the model aside)."""
    engine = {k: getattr(args, k) for k in ("dtype", "max_model_len", "block_size", "num_kv_blocks", "disk_cache",
                                            "kv_cache_dtype", "revision", "download_dir", "hf_overrides",
                                            "max_logprobs")
              if getattr(args, k, None) is not None}
    decode = {"num_kv_blocks": args.decode_num_kv_blocks} if args.decode_num_kv_blocks else {}
    if getattr(args, "speculative_config", None) is not None:    # D's alone: a prefill engine never decodes
        decode["speculative_config"] = args.speculative_config
    prefill = {}
    for side, tp in ((prefill, args.prefill_tp), (decode, args.decode_tp)):
        if tp is not None:
            side["tensor_parallel_size"] = tp
    return dict(backend=args.kv_transfer, async_transfer=not args.sync_transfer, prefill_device=args.prefill_device,
                decode_device=args.decode_device, prefill=prefill, decode=decode,
                transfer_timeout_s=args.transfer_timeout, lease_s=args.lease, host=args.host,
                advertise_host=args.advertise_host, **engine)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="picovllm-disagg", description=__doc__.splitlines()[0])
    parser.add_argument("prompts", nargs="+")
    parser.add_argument("--model", default=None, help="HF folder or .gguf (default: the default model)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--kv-cache-dtype", default=None, help="auto (the model's dtype) or fp8 (e4m3, both sides)")
    add_disagg_arguments(parser)
    return run_disagg_generate(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
