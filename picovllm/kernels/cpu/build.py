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


OPENMP_RUNTIMES = ("libgomp", "libiomp", "libomp")


def compile_openmp_library(source: str, defines: dict[str, int] | None = None) -> ctypes.CDLL | None:
    """compile_library with -fopenmp, for kernels that run on torch's own OpenMP threads (the library links
    libgomp.so.1, which resolves to the copy torch loaded; a Python thread pool costs 25-150 us a call on a
    2-core machine). None if that fails or if loading it brought in an OpenMP runtime torch does not use,
    whose threads would fight torch's."""
    before = _openmp_runtimes()
    lib = compile_library(source, defines, flags=("-fopenmp",))
    if lib is None or before is None or _openmp_runtimes() != before:
        return None
    return lib


def _openmp_runtimes() -> set[str] | None:
    """The OpenMP runtime files mapped into this process (Linux); None where that cannot be read."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
    except OSError:
        return None
    return {p for p in paths if os.path.basename(p).startswith(OPENMP_RUNTIMES)}


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
