"""Shared fixtures: tiny random-weight HF checkpoints built on the spot, and the KV-leak check."""
from __future__ import annotations

import gc
import os
import shutil
import sys
import tempfile
import weakref
import zlib

import pytest

# Under pytest-xdist (the README's test command runs two workers on a 2-core machine): one intra-op thread a worker,
# and in the processes it spawns, so that two workers' OpenMP threads do not wait on each other (one_torch_thread);
# set before torch is imported, which reads it then
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

import triton_interpreter  # noqa: E402

# The suite's own artifact cache (tokenizers, weights, compiled kernels), new for every run and shared by the
# subprocesses the tests start: the first test to load a model pays the miss, as on a fresh machine, and the
# user's cache is never touched. tests/test_artifact_cache.py points single tests at folders of their own.
_CACHE = tempfile.mkdtemp(prefix="picovllm-test-cache-")
os.environ["PICOVLLM_CACHE_DIR"] = _CACHE
os.environ.pop("PICOVLLM_NO_CACHE", None)


def pytest_runtest_setup(item):
    """Under TRITON_INTERPRET=1 (set by the kernel test modules at collection, before triton is imported: importing
    it earlier would compile instead), memoize a pure step of each interpreted launch (tests/triton_interpreter.py)."""
    if os.environ.get("TRITON_INTERPRET") == "1" and "triton" in sys.modules:
        triton_interpreter.install()


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_CACHE, ignore_errors=True)

TINY = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            initializer_range=0.2, rms_norm_eps=1e-5)


def build_tiny_checkpoint(path: str, arch: str = "llama", **overrides) -> str:
    """Save a tiny random-weight HF model (fp32 safetensors, no tokenizer) and return its folder."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    kw = dict(TINY, **overrides)
    if arch == "llama":
        cfg = LlamaConfig(**kw)
    elif arch == "llama3":  # Llama 3 rope scaling
        kw.setdefault("rope_scaling", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        kw.setdefault("rope_theta", 500000.0)
        cfg = LlamaConfig(**kw)
    elif arch == "qwen2":
        cfg = Qwen2Config(**kw)
    elif arch == "qwen3":
        cfg = Qwen3Config(head_dim=kw.pop("head_dim", 32), **kw)
    else:
        raise ValueError(arch)
    torch.manual_seed(zlib.crc32(arch.encode()) % 1000)   # str hash() changes per process
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():   # HF starts norm weights at 1 and biases at 0: make each one matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for arch, extra in [("llama", {}), ("qwen2", {}), ("qwen3", {}), ("llama3", {}),
                        ("llama_untied", {"tie_word_embeddings": False}), ("qwen3_tied", {"tie_word_embeddings": True})]:
        base = arch.split("_")[0]
        out[arch] = build_tiny_checkpoint(str(root / arch), base, **extra)
    return out


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from picovllm.loader.default_model import default_model_path
    return default_model_path()


_GGUF_READERS: dict = {}


def hf_from_gguf(loader, path: str, **kw):
    """`loader.from_pretrained` (an HF Auto class) on a GGUF file, the oracle for our own reading of it, with the gguf
    package's two slow pure steps memoized. transformers 5.x builds a GGUFReader of the file twice per model load
    (config, then weights; ~6 s each for the default model: a numpy view per vocabulary string) and a tensor-name map
    per module (~7 s in all). Readers are kept per (path, size, mtime); what HF computes from them is unchanged."""
    import functools

    import gguf

    def reader(p, mode="r"):
        st = os.stat(p)
        key = (os.path.realpath(p), st.st_size, st.st_mtime_ns, mode)
        if key not in _GGUF_READERS:
            _GGUF_READERS[key] = real_reader(p, mode)
        return _GGUF_READERS[key]

    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(real_map)
    try:
        return loader.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path), **kw)
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map


@pytest.fixture(scope="module")
def one_torch_thread():
    """Run a module's tests on one intra-op thread. On a shared 2-core machine, OpenMP's two threads
    wait on each other for every small op (one tiny attention call: 0.2 ms alone, 13 ms contended)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def one_thread_in_children(one_torch_thread):
    """One intra-op thread in this process and in the processes it spawns (they inherit OMP_NUM_THREADS)."""
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    yield
    if old is None:
        del os.environ["OMP_NUM_THREADS"]
    else:
        os.environ["OMP_NUM_THREADS"] = old


# Engines that outlive one test (session fixtures); no_kv_leaks checks them after every test too.
_engines: list = []


@pytest.fixture(scope="session")
def default_llm():
    """LLM() on the default model (SmolLM2-135M-Instruct GGUF), loaded once: it takes ~10-20 s."""
    from picovllm import LLM
    # exactly LLM() on CPU (fp32); a GPU would default to bf16, too coarse for greedy parity with HF's fp32
    llm = LLM(dtype="float32") if torch.cuda.is_available() else LLM()
    _engines.append(llm.engine)
    yield llm
    _engines.remove(llm.engine)


def fail_a_launch(engine) -> dict:
    """Wrap engine's runner.launch so that its launch number calls["fail_at"] (None: none) raises
    RuntimeError("injected failure"); returns calls ({"n": launches so far, "fail_at": None}) for the test to set."""
    real, calls = engine.runner.launch, {"n": 0, "fail_at": None}

    def flaky(step, *args):
        calls["n"] += 1
        if calls["n"] == calls["fail_at"]:
            raise RuntimeError("injected failure")
        return real(step, *args)
    engine.runner.launch = flaky
    return calls


def assert_engine_clean(eng) -> None:
    """No unfinished request; every block free (unreferenced), cached or not; the cache index consistent."""
    bm = eng.block_manager
    assert not eng.has_unfinished_requests(), f"engine left unfinished requests: {eng.scheduler.running}"
    assert not eng.requests, f"engine still tracks requests: {list(eng.requests)}"
    assert bm.num_free_blocks == bm.num_blocks, f"KV leak: {bm.num_blocks - bm.num_free_blocks} blocks held"
    assert all(r == 0 for r in bm.ref_counts)
    for h, b in bm.hash_to_block.items():
        assert bm.block_hash[b] == h, f"cache index maps hash to block {b}, which holds another hash"


# -- every engine built during a test must end it with all KV blocks free ------------------------


@pytest.fixture(autouse=True)
def no_kv_leaks(monkeypatch):
    from picovllm.engine import llm_engine

    created = []
    real_init = llm_engine.Engine.__init__

    def tracking_init(self, *a, **kw):
        real_init(self, *a, **kw)
        created.append(weakref.ref(self))

    monkeypatch.setattr(llm_engine.Engine, "__init__", tracking_init)
    yield
    engines = [e for e in (ref() for ref in created) if e is not None] + list(_engines)
    for eng in engines:
        assert_engine_clean(eng)
    if created:
        gc.collect()        # frees this test's engines (their caches) now; ~0.1 s, so not after tests that made none
