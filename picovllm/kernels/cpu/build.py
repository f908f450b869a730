"""Build a C source of this folder into a shared library at run time and load it with ctypes.

The machine's C compiler (CC, cc or gcc), no torch headers. -ffast-math is given when compiling only:
linking with it would add crtfastmath.o, which sets flush-to-zero for the whole process. ctypes releases
the GIL during a call, so callers split work between threads (pool()).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor

from picovllm.artifact_cache import ArtifactCache, make_key

HERE = os.path.dirname(os.path.abspath(__file__))
COMPILE = ["-O3", "-march=native", "-ffast-math", "-fPIC", "-c"]
LINK = ["-shared", "-lm"]


OPENMP = ("-fopenmp",)      # the flags of compile_openmp_library's builds
# Sources built with other sources' objects linked in, each part with no defines and its own flags (None: the build's
# own, e.g. an ISA variant's), kept in its own cache entry: the decode stack is built once per attention shape, the
# GEMMs it calls do not depend on it. small_gemm.c has no ISA variants: its part is small_gemm.py's own build.
PARTS = {"decode_stack.c": (("small_gemm.c", OPENMP), ("quant_gemm.c", None))}
PARTS_LINK = ["-Wl,-Bsymbolic"]     # the library's calls into its parts bind to its own copies


def compile_library(source: str, defines: dict[str, int] | None = None,
                    flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """picovllm/kernels/cpu/<source> built with -D<name>=<value> each and `flags` (compile and link, e.g.
    -fopenmp); None without a working compiler. A build is kept in the artifact cache, keyed by every C source
    of this folder (sources include each other), the compiler, the flags and this CPU (-march=native)."""
    cc = _compiler()
    if cc is None:
        return None
    try:
        cache = ArtifactCache.from_env()
        folder = _cached_build(cache, cc, source, defines, flags) if cache is not None else None
        if folder is not None:
            return ctypes.CDLL(os.path.join(folder, _library_name(source)))
        with tempfile.TemporaryDirectory(prefix="picovllm-cpu-") as tmp:
            parts = _parts(source, flags)
            for part, part_flags in parts:
                _build(cc, part, (), part_flags, tmp)
            _build(cc, source, _macros(defines), flags, tmp, tuple(_object(tmp, part) for part, _ in parts))
            return ctypes.CDLL(os.path.join(tmp, _library_name(source)))   # stays mapped after the folder goes
    except (OSError, subprocess.SubprocessError):
        return None


def prebuild(jobs: list[tuple[str, dict[str, int] | None, tuple[str, ...]]]) -> None:
    """Compile each (source, defines, flags) into the artifact cache, all at once: on a first start the compiler
    runs then take as long as the longest, not their sum, and compile_library later finds them built. A job with
    PARTS waits for them (built beside the other jobs, once each). Loads nothing; does nothing without a cache or a
    compiler, and a failed build is left for compile_library."""
    cc, cache = _compiler(), ArtifactCache.from_env()
    if cc is None or cache is None or not jobs:
        return

    def one(job) -> None:
        try:
            _cached_build(cache, cc, *job)
        except (OSError, subprocess.SubprocessError):
            pass

    linked = [job for job in jobs if job[0] in PARTS]
    parts = [(part, None, part_flags) for source, _, flags in linked for part, part_flags in _parts(source, flags)]
    first = {(s, _macros(d), f): (s, d, f) for s, d, f in [job for job in jobs if job[0] not in PARTS] + parts}
    for batch in (list(first.values()), linked):
        if batch:
            with ThreadPoolExecutor(len(batch), thread_name_prefix="picovllm-cc") as compilers:
                list(compilers.map(one, batch))


# The instruction sets the quantized kernels are built for, best first, each with its flags beside -march=native.
ISA_FLAGS = {"avx512": (), "avx2": ("-mno-avx512f",)}
_ISA_CPU_FLAGS = {"avx512": {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}, "avx2": {"avx2", "fma", "f16c"}}


def cpu_isas() -> tuple[str, ...]:
    """The ISA_FLAGS names this CPU runs (its /proc/cpuinfo flags), best first."""
    flags = set()
    for line in _cpu_identity().splitlines():
        if line.startswith("flags"):
            flags |= set(line.split(":", 1)[1].split())
    return tuple(isa for isa, need in _ISA_CPU_FLAGS.items() if need <= flags)


def shape_defines(shape: tuple[int, int, int, int]) -> dict[str, int]:
    """The -D macros of the attention kernels built for (query heads, kv heads, head dim, block size)."""
    return dict(zip(("HQ", "HKV", "DIM", "BLOCK"), shape))


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _macros(defines: dict[str, int] | None) -> tuple[str, ...]:
    return tuple(f"-D{name}={value}" for name, value in (defines or {}).items())


def _library_name(source: str) -> str:
    return os.path.splitext(source)[0] + ".so"


def _cached_build(cache: ArtifactCache, cc: str, source: str, defines: dict[str, int] | None,
                  flags: tuple[str, ...]) -> str | None:
    """The cache entry holding the build (made now on a miss, its PARTS' entries first); None if it could not be
    stored. An entry keeps its object file beside the library, for the builds that link it as a part."""
    macros, parts = _macros(defines), _parts(source, flags)
    objects = []
    for part, part_flags in parts:
        folder = _cached_build(cache, cc, part, None, part_flags)
        if folder is None:
            return None
        objects.append(_object(folder, part))
    key = make_key(source, _sources_digest(), _compiler_identity(cc), COMPILE, LINK, macros, flags, parts,
                   _cpu_identity())
    return cache.get_or_build("kernels", key,
                              lambda folder: _build(cc, source, macros, flags, folder, tuple(objects)),
                              f"{source} {' '.join(macros)}".strip())


def _parts(source: str, flags: tuple[str, ...]) -> list[tuple[str, tuple[str, ...]]]:
    """(part, the flags it is built with) of each of source's PARTS, for a build of source with `flags`."""
    return [(part, flags if own is None else own) for part, own in PARTS.get(source, ())]


def _object(folder: str, source: str) -> str:
    return os.path.join(folder, os.path.splitext(source)[0] + ".o")


def _build(cc: str, source: str, macros: tuple[str, ...], flags: tuple[str, ...], folder: str,
           parts: tuple[str, ...] = ()) -> None:
    """folder/<source>.o and the library linked from it and the objects `parts` (paths)."""
    obj = _object(folder, source)
    subprocess.run([cc, *COMPILE, *macros, *flags, os.path.join(HERE, source), "-o", obj], check=True,
                   capture_output=True, timeout=60)
    subprocess.run([cc, obj, *parts, "-o", os.path.join(folder, _library_name(source)), *LINK, *flags,
                    *(PARTS_LINK if parts else [])], check=True, capture_output=True, timeout=60)


@functools.lru_cache(maxsize=1)
def _sources_digest() -> str:
    h = hashlib.sha256()
    for name in sorted(os.listdir(HERE)):
        if name.endswith((".c", ".h")):
            with open(os.path.join(HERE, name), "rb") as f:
                h.update(name.encode() + b"\0" + f.read())
    return h.hexdigest()


@functools.lru_cache(maxsize=4)
def _compiler_identity(cc: str) -> tuple:
    path = shutil.which(cc) or cc
    real = os.path.realpath(path)
    st = os.stat(real)
    return real, st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=1)
def _cpu_identity() -> str:
    """The CPU's model and feature flags (what -march=native compiles for); the machine name elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() + platform.machine()


OPENMP_RUNTIMES = ("libgomp", "libiomp", "libomp")


def compile_openmp_library(source: str, defines: dict[str, int] | None = None,
                           flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """compile_library with -fopenmp (and `flags`, e.g. ISA_FLAGS[isa]), for kernels that run on torch's own OpenMP threads (the library links
    libgomp.so.1, which resolves to the copy torch loaded; a Python thread pool costs 25-150 us a call on a
    2-core machine). None if that fails or if loading it brought in an OpenMP runtime torch does not use,
    whose threads would fight torch's."""
    before = _openmp_runtimes()
    lib = compile_library(source, defines, flags=OPENMP + flags)
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
