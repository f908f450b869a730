"""Triton kernels for the GPU fast path, and (kernels/cpu) a C decode-attention kernel for the CPU.

One module per kernel kind; each launcher has a torch reference (in picovllm.layers, or beside
the launcher) that is its test oracle. The Triton modules need triton; under TRITON_INTERPRET=1
they also run on CPU tensors (slowly), which is how CI tests them. kernels/cpu needs a C compiler
at run time and nothing else.
"""


def use_triton(x) -> bool:
    """Whether the layers run their fused Triton kernels on this activation (CUDA) rather than the CPU's C
    kernels or torch. The one place that decides it, so a CPU test can route a model through the kernels under
    TRITON_INTERPRET=1 by replacing it."""
    return x.is_cuda
