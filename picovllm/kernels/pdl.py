"""Programmatic dependent launch (PDL, Hopper and later): a kernel starts while the one before it finishes.

A batch-1 decode step is ~300 small kernels, each of which spends its first microsecond or so starting up and
waiting for its first loads. Launched with PDL, a kernel's programs are placed on the GPU as soon as every program
of the kernel before it has started (`gdc_launch_dependents`); they may read what no earlier kernel writes (a
weight) and then wait (`gdc_wait`) until the previous kernel has finished and its writes are visible. So the next
layer's weight streams in while this layer's last kernel runs.

The rule every PDL kernel here keeps: nothing before `gdc_wait` reads what an earlier kernel wrote or writes what an
earlier kernel might still read (activations, caches, scratch buffers the allocator reuses); only weights are read
before it. Because each PDL kernel waits for the one before it, and that one waited for its own, every earlier
kernel is complete once a wait returns. A kernel without PDL (cuBLAS, torch) waits for the previous one as usual.

`launch_options(x)` gives a kernel's extra launch arguments: PDL=True and launch_pdl=True on a CUDA device of
compute capability 9 or more, PDL=False elsewhere (the interpreter, the CPU, older GPUs, PICOVLLM_PDL=0)."""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:      # a Triton without grid dependency control: launch_options never turns PDL on
    gdc_launch_dependents = gdc_wait = None


@functools.cache
def _enabled(device: int) -> bool:
    if gdc_wait is None or os.environ.get("PICOVLLM_PDL", "1") == "0" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def launch_options(x: torch.Tensor) -> dict:
    """Extra keyword arguments for a launch whose kernel takes `PDL: tl.constexpr` and calls `wait_for_previous`."""
    if x.is_cuda and _enabled(x.device.index if x.device.index is not None else torch.cuda.current_device()):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """Wait until the previous kernel's writes are visible, and let the next kernel start placing its programs."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
