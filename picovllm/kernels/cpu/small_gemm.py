"""Small-M float32 GEMM on the CPU through a C kernel (small_gemm.c): y = x @ W.T (+ b) for decode steps.

At decode the linear layers see a few rows (one per running sequence) and their time is the weights
streaming from memory; oneDNN reaches only about half the memory bandwidth there. small_gemm.c reads
a weight packed once into 16-column panels front to back, with the next panel prefetched. It is
compiled with the machine's C compiler when first needed and called through ctypes.
Its threads are OpenMP's, the same runtime and threads as torch's (the library is linked against
libgomp.so.1, which the dynamic linker resolves to the copy torch already loaded): a Python thread
pool cost 25-150 us per call on a 2-core machine, more than a 576x576 layer takes. available() is
False (use oneDNN) without a compiler, on a CPU without AVX2 and FMA (the build fails), or if loading
it brought a new OpenMP runtime into the process (torch uses another one), whose threads would fight
torch's. Other runtimes already loaded (sentencepiece bundles its own libgomp) do not matter.
"""
from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from picovllm.kernels.cpu.build import compile_openmp_library

NR = 16   # output columns per panel, as in small_gemm.c


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    """Build and load the kernel once per process; None without a C compiler or AVX2/FMA, or if it does not
    share torch's OpenMP runtime."""
    lib = compile_openmp_library("small_gemm.c")
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.small_gemm.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, i64, i64]
    lib.small_gemm.restype = None
    return lib


def available() -> bool:
    return _library() is not None


def pack_panels(weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """weight [N, K] -> [ceil(N / 16), K, 16] in dtype (float32, or bfloat16: rounded to nearest even), zero
    columns past N: the layout small_gemm reads."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"small_gemm panels are float32 or bfloat16, not {dtype}")
    n, k = weight.shape
    w = weight.detach().float()
    if n % NR:
        w = F.pad(w, (0, 0, 0, -n % NR))
    return w.view(-1, NR, k).transpose(1, 2).to(dtype).contiguous()


def small_gemm(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None,
               threads: int | None = None) -> torch.Tensor:
    """x [M, K] float32; packed = pack_panels(W) of W [n, K] (float32 or bfloat16 panels); bias [n] or None.
    Returns x @ W.T + bias, [M, n], summed in float32. threads: default torch's intra-op thread count."""
    m, k = x.shape
    if packed.shape[1] != k:
        raise ValueError(f"x has {k} columns, the packed weight {packed.shape[1]}")
    x = x.contiguous()
    bias = bias.detach().contiguous() if bias is not None else None
    y = torch.empty(m, n, dtype=torch.float32)
    args = (x.data_ptr(), m, k, packed.data_ptr(), packed.dtype == torch.bfloat16,
            bias.data_ptr() if bias is not None else None, y.data_ptr(), n)
    _library().small_gemm(*args, threads or torch.get_num_threads())
    return y
