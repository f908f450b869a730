"""Build a C source of this folder into a shared library at run time and load it with ctypes.

The machine's C compiler (CC, cc or gcc), no torch headers. -ffast-math is given when compiling only:
linking with it would add crtfastmath.o, which sets flush-to-zero for the whole process. ctypes releases
the GIL during a call, so callers split work between threads (pool()).
"""
from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
COMPILE = ["-O3", "-march=native", "-ffast-math", "-fPIC", "-c"]
LINK = ["-shared", "-lm"]


def compile_library(source: str, defines: dict[str, int] | None = None,
                    flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """picovllm/kernels/cpu/<source> built with -D<name>=<value> each and `flags` (compile and link, e.g.
    -fopenmp); None without a working compiler."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    macros = [f"-D{name}={value}" for name, value in (defines or {}).items()]
    out_dir = tempfile.mkdtemp(prefix="picovllm-cpu-")
    stem = os.path.splitext(source)[0]
    obj, lib_path = os.path.join(out_dir, stem + ".o"), os.path.join(out_dir, stem + ".so")
    try:
        subprocess.run([cc, *COMPILE, *macros, *flags, os.path.join(HERE, source), "-o", obj], check=True,
                       capture_output=True, timeout=60)
        subprocess.run([cc, obj, "-o", lib_path, *LINK, *flags], check=True, capture_output=True, timeout=60)
        return ctypes.CDLL(lib_path)
    except (OSError, subprocess.SubprocessError):
        return None
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)   # the loaded library stays mapped


@functools.lru_cache(maxsize=4)
def pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(threads, thread_name_prefix="picovllm-cpu")


def run_split(fn, args: tuple, bounds: list[int]) -> None:
    """fn(*args, lo, hi) for each run [lo, hi) of bounds, the first on this thread, the others in the pool."""
    runs = [(lo, hi) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]
    futures = [pool(len(runs) - 1).submit(fn, *args, lo, hi) for lo, hi in runs[1:]]
    if runs:
        fn(*args, *runs[0])
    for f in futures:
        f.result()
