"""Subcommands of the `picovllm` CLI, one module per command group (see picovllm.entrypoints.cli)."""
