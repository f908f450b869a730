"""C kernels for the CPU (float32), built at run time with the machine's C compiler (build.py)."""
from __future__ import annotations


def prebuild_cpu_kernels(shape: tuple[int, int, int, int], attention: bool, stack: bool,
                         quantized_isa: str | None = None) -> None:
    """Compile at once, into the artifact cache, the kernels a float32 CPU engine of this attention shape (query
    heads, kv heads, head dim, block size) will load: the small GEMM and the elementwise kernels, the paged
    attention kernel if `attention`, the one-call decode stack if `stack`; with `quantized_isa` (an ISA_FLAGS name)
    the quantized GEMM, and the decode stack, built for it. Each module still loads its own when
    first used (then from the cache); their build arguments here are theirs (tests/test_artifact_cache.py)."""
    from picovllm.kernels.cpu.build import ISA_FLAGS, OPENMP, prebuild, shape_defines

    isa_flags = ISA_FLAGS[quantized_isa] if quantized_isa else ()
    jobs = [("small_gemm.c", None, OPENMP), ("elementwise.c", None, ())]
    if attention:
        jobs.append(("paged_decode.c", shape_defines(shape), OPENMP))
    if stack:
        jobs.append(("decode_stack.c", shape_defines(shape), OPENMP + isa_flags))
    if quantized_isa:
        jobs.append(("quant_gemm.c", None, OPENMP + isa_flags))
    prebuild(jobs)
