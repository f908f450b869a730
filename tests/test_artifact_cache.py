"""The artifact cache (picovllm/artifact_cache.py) and what is kept in it.

Oracles: the GGUF read and dequantized without any cache, transformers' own GGUF tokenizer, the greedy tokens of
an engine that never saw the cache. Damaged entries (truncated, overwritten with random bytes) are rebuilt; two
processes that start at once both succeed; a read-only or unusable cache folder means no cache and one warning.
"""
import os
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import hf_from_gguf
from picovllm import LLM, SamplingParams
from picovllm.artifact_cache import ArtifactCache
from picovllm.loader.default_model import default_model_path
from picovllm.loader.gguf_file import open_gguf
from test_gguf import write_tiny_gguf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "Name the capital of France."
WARNING = "picovllm generate: warning: cache folder"   # the CLI prints a warning as one line


def cli(args, cache_dir, timeout=300, prefix=(), **env):
    """`picovllm ARGS` in a process of its own with PICOVLLM_CACHE_DIR=cache_dir."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PICOVLLM_CACHE_DIR=str(cache_dir),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **env)
    return subprocess.run([*prefix, sys.executable, "-m", "picovllm.entrypoints.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(autouse=True)
def _remove_caches(tmp_path):
    """A start of the default model stores ~1.6 GB: remove it when the test ends (pytest keeps tmp_path)."""
    yield
    shutil.rmtree(tmp_path, ignore_errors=True)


def entries(root, kind):
    folder = os.path.join(root, kind)
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def with_compiled_kernels(cache_dir):
    """A fresh cache folder holding the C kernels this session compiled already (their own tests cover their
    entries; compiling them again costs a fresh start ~6 s of the ~12 it takes on the 2-core CPU)."""
    os.makedirs(cache_dir, exist_ok=True)
    src = os.path.join(ArtifactCache.from_env().root, "kernels")
    if os.path.isdir(src):
        shutil.copytree(src, os.path.join(cache_dir, "kernels"), dirs_exist_ok=True)
    return cache_dir


# -- the cache itself ---------------------------------------------------------------------------------
def _builder(counter, files):
    def build(folder):
        counter.append(folder)
        for name, data in files.items():
            with open(os.path.join(folder, name), "wb") as f:
                f.write(data)
    return build


@pytest.mark.parametrize("damage", ["truncate", "random_bytes", "missing_manifest"])
def test_damaged_entry_is_rebuilt(tmp_path, damage):
    big = os.urandom(80 << 20)            # past FULL_CHECK_BYTES: checked by samples
    files = {"small.bin": b"abc" * 1000, "big.bin": big}
    cache, builds = ArtifactCache(str(tmp_path)), []
    folder = cache.get_or_build("k", "key1", _builder(builds, files))
    assert len(builds) == 1 and cache.get_or_build("k", "key1", _builder(builds, files)) == folder
    assert len(builds) == 1                                   # a hit builds nothing
    for name in files:
        victim = os.path.join(folder, name)
        if damage == "truncate":
            os.truncate(victim, os.path.getsize(victim) // 2)
        elif damage == "random_bytes":
            with open(victim, "r+b") as f:
                f.write(os.urandom(os.path.getsize(victim)))
        else:
            os.remove(os.path.join(folder, "MANIFEST"))
        again = cache.get_or_build("k", "key1", _builder(builds, files))
        assert again == folder and len(builds) >= 2
        for n, data in files.items():
            with open(os.path.join(again, n), "rb") as f:
                assert f.read() == data, (damage, name, n)
        if damage == "missing_manifest":
            break
    assert not [p for p in os.listdir(tmp_path / "k") if p.startswith(".")]   # no temporary folder left


def test_concurrent_builders_both_get_the_whole_entry(tmp_path):
    cache, barrier, results, builds = ArtifactCache(str(tmp_path)), threading.Barrier(2), [], []

    def build(folder):
        builds.append(folder)
        barrier.wait(timeout=10)           # both are inside build() before either installs its entry
        with open(os.path.join(folder, "data"), "wb") as f:
            f.write(os.urandom(1 << 20) if len(builds) == 1 else b"x" * 1000)

    threads = [threading.Thread(target=lambda: results.append(cache.get_or_build("k", "key", build)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 2 and results[0] == results[1] is not None
    assert entries(tmp_path, "k") == ["key"]


def test_unusable_root_means_no_cache_and_a_warning(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    cache, builds = ArtifactCache(str(blocker / "cache")), []
    with pytest.warns(RuntimeWarning, match="not usable"):
        assert cache.get_or_build("k", "key", _builder(builds, {"f": b"1"})) is None


# -- GGUF entries: config, tokenizer, weights --------------------------------------------------------
@pytest.mark.parametrize("kind", ["Q4_K", "Q8_0", "F16"])
def test_tiny_gguf_hit_equals_miss_equals_no_cache(tmp_path, kind):
    path = str(tmp_path / f"tiny-{kind}.gguf")
    write_tiny_gguf(path, kind)
    direct = open_gguf(path)
    want = dict(direct.weights())
    cache = ArtifactCache(str(tmp_path / "cache"))
    for attempt in ("miss", "hit"):
        src = open_gguf(path, cache)
        assert src.config == direct.config and src.load_tokenizer is None, attempt
        got = dict(src.weights())
        assert list(got) == list(want)
        for name, w in want.items():
            assert torch.equal(got[name], w), (attempt, name)
    assert len(entries(tmp_path / "cache", "gguf")) == 1 and len(entries(tmp_path / "cache", "gguf_float")) == 1


@pytest.mark.parametrize("damage", ["truncate", "random_bytes"])
def test_damaged_gguf_entry_is_rebuilt(tmp_path, damage):
    """A real entry: its weights file cut short or overwritten, then the next open serves the file's weights."""
    path, cache = str(tmp_path / "m.gguf"), ArtifactCache(str(tmp_path / "cache"))
    write_tiny_gguf(path, "Q4_1")
    want = dict(open_gguf(path).weights())
    src = open_gguf(path, cache)
    assert len(entries(tmp_path / "cache", "gguf")) == 1 and entries(tmp_path / "cache", "gguf_float") == []
    for _ in src.weights():                                   # the dequantized weights' entry: made now
        pass
    (key,) = entries(tmp_path / "cache", "gguf_float")
    victim = tmp_path / "cache" / "gguf_float" / key / "weights.safetensors"
    size = victim.stat().st_size
    if damage == "truncate":
        os.truncate(victim, size - 4096)
    else:
        victim.write_bytes(os.urandom(size))
    got = dict(open_gguf(path, cache).weights())
    assert list(got) == list(want) and all(torch.equal(got[n], w) for n, w in want.items())
    assert victim.stat().st_size == size


def test_changed_model_file_is_never_served_stale(tmp_path):
    path, cache = str(tmp_path / "m.gguf"), ArtifactCache(str(tmp_path / "cache"))
    write_tiny_gguf(path, "Q8_0")
    first = dict(open_gguf(path, cache).weights())
    write_tiny_gguf(path, "Q4_0")          # the same name, other weights
    second = dict(open_gguf(path, cache).weights())
    want = dict(open_gguf(path).weights())
    assert all(torch.equal(second[n], w) for n, w in want.items())
    assert not torch.equal(first["model.layers.0.mlp.up_proj.weight"], second["model.layers.0.mlp.up_proj.weight"])
    assert len(entries(tmp_path / "cache", "gguf")) == 2 and len(entries(tmp_path / "cache", "gguf_float")) == 2


def test_default_model_tokenizer_from_cache_matches_transformers(tmp_path):
    """The tokenizer we convert (from our own read of the file) and save, loaded back, against transformers'
    AutoTokenizer reading the GGUF itself."""
    from transformers import AutoTokenizer

    path = default_model_path()
    ref = hf_from_gguf(AutoTokenizer, path)
    cache = ArtifactCache(str(tmp_path))
    for attempt in ("miss", "hit"):
        tok = open_gguf(path, cache).load_tokenizer()
        for text in ["Hello world", "  leading spaces\tand tabs\n", "naïve café 東京 🙂",
                     "<|im_start|>user\nhi<|im_end|>", "1234567 + 89 = ?", ""]:
            assert tok.encode(text) == ref.encode(text), (attempt, text)
            ids = ref.encode(text)
            assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
        conv = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": PROMPT}]
        assert tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True) == \
            ref.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        assert (tok.eos_token_id, tok.bos_token_id) == (ref.eos_token_id, ref.bos_token_id)


def test_llm_greedy_tokens_same_on_miss_hit_and_no_cache(tmp_path, monkeypatch):
    """The default model: an engine that builds the cache, one that maps it (its weights are never loaded or
    packed again), and one with disk_cache=False give the same greedy tokens."""
    from picovllm.loader import engine_weights

    monkeypatch.setenv("PICOVLLM_CACHE_DIR", str(tmp_path))
    loads = []
    real = engine_weights._load_and_pack
    monkeypatch.setattr(engine_weights, "_load_and_pack", lambda *a: loads.append(1) or real(*a))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = {}
    for attempt, kw in [("miss", {}), ("hit", {}), ("off", {"disk_cache": False})]:
        before = len(loads)
        with LLM(**kw) as llm:
            ids = llm.apply_chat_template([{"role": "user", "content": PROMPT}])
            outs[attempt] = llm.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids
            if attempt == "hit":       # its parameters are views of the cached file, mapped into this process
                with open("/proc/self/maps") as maps:
                    assert "engine_weights.safetensors" in maps.read()
        outs[attempt + " loads"] = len(loads) - before
    assert outs["miss"] == outs["hit"] == outs["off"]
    assert (outs["miss loads"], outs["hit loads"], outs["off loads"]) == (1, 0, 1)
    assert len(entries(tmp_path, "engine")) == 1 and len(entries(tmp_path, "gguf")) == 1
    assert entries(tmp_path, "gguf_float") == []      # the quantized weights never ask for the dequantized ones


# -- whole starts, as a user runs them ----------------------------------------------------------------
def _read_only_prefix(src, dst):
    """A command prefix that runs the rest with `dst` a read-only view of `src`: a read-only bind mount in a
    mount namespace of its own (root ignores file modes); None where that cannot be made here."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return None
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount --bind -o ro {src} {dst} && ! touch {dst}/x"],
                           capture_output=True)
    if probe.returncode != 0:
        return None
    return ["unshare", "-m", "sh", "-c", f'mount --bind -o ro {src} {dst} && exec "$@"', "sh"]


def test_two_concurrent_first_starts_then_a_start_from_the_read_only_cache(tmp_path):
    """Two first starts side by side both succeed and leave one whole entry of each kind; a later start serves
    those entries from a read-only view of the folder, without a warning. (A folder that cannot be written means
    no cache and one warning: test_unusable_cache_folder_and_switches; an empty read-only one is that case too.)"""
    filled, view = with_compiled_kernels(tmp_path / "filled"), tmp_path / "view"
    view.mkdir()
    with ThreadPoolExecutor(2) as pool:      # the two first starts side by side
        results = list(pool.map(lambda _: cli(["generate", PROMPT, "--max-tokens", "8"], filled, timeout=400),
                                range(2)))
    assert all(r.returncode == 0 for r in results), [r.stderr[-1500:] for r in results]
    assert results[0].stdout == results[1].stdout and "Paris" in results[0].stdout
    for kind in ("gguf", "engine"):
        assert len(entries(filled, kind)) == 1, kind
    leftovers = [n for kind in ("gguf", "engine", "kernels") for n in os.listdir(filled / kind) if n.startswith(".")]
    assert leftovers == []
    if os.geteuid() == 0:
        prefix = _read_only_prefix(filled, view)
        if prefix is None:                  # no read-only view here: a plain second start
            prefix, view = (), filled
    else:
        prefix = ()
        for dirpath, _, _ in os.walk(filled):
            os.chmod(dirpath, 0o555)
        shutil.copytree(filled, view, dirs_exist_ok=True)
    again = cli(["generate", PROMPT, "--max-tokens", "8"], view, prefix=prefix)
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stdout == results[0].stdout
    assert again.stderr.count(WARNING) == 0, again.stderr


def test_environment_switches(monkeypatch, tmp_path):
    monkeypatch.setenv("PICOVLLM_CACHE_DIR", str(tmp_path / "here"))
    assert ArtifactCache.from_env().root == str(tmp_path / "here")
    monkeypatch.delenv("PICOVLLM_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert ArtifactCache.from_env().root == str(tmp_path / "xdg" / "picovllm")
    for off in ("1", "yes", "true"):
        monkeypatch.setenv("PICOVLLM_NO_CACHE", off)
        assert ArtifactCache.from_env() is None
    monkeypatch.setenv("PICOVLLM_NO_CACHE", "0")
    assert ArtifactCache.from_env() is not None


def test_unusable_cache_folder_and_switches(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with ThreadPoolExecutor(2) as pool:      # the two starts side by side (one thread each: the suite's time)
        off = pool.submit(cli, ["generate", PROMPT, "--max-tokens", "8", "--no-disk-cache"], tmp_path / "off")
        blocked = pool.submit(cli, ["generate", PROMPT, "--max-tokens", "8"], blocker / "cache")
        want, r = off.result(), blocked.result()
    assert want.returncode == 0 and not (tmp_path / "off").exists()       # --no-disk-cache writes nothing
    assert r.returncode == 0 and r.stdout == want.stdout
    assert r.stderr.count(WARNING) == 1, r.stderr


def test_cache_command_lists_and_clears(tmp_path, monkeypatch, capsys):
    from picovllm.entrypoints.cli import main as cli_main

    monkeypatch.setenv("PICOVLLM_CACHE_DIR", str(tmp_path / "cache"))
    path = str(tmp_path / "m.gguf")
    write_tiny_gguf(path, "Q8_0")
    open_gguf(path, ArtifactCache.from_env())
    assert cli_main(["cache"]) == 0
    listing = capsys.readouterr().out
    assert "1 entries" in listing and "gguf" in listing and os.path.abspath(path) in listing
    assert cli_main(["cache", "--clear", "--kind", "kernels"]) == 0
    assert len(entries(tmp_path / "cache", "gguf")) == 1                # another kind: kept
    assert cli_main(["cache", "--clear"]) == 0
    assert "removed 1 entries" in capsys.readouterr().out
    assert entries(tmp_path / "cache", "gguf") == []


def logging_compiler(tmp_path, line: str):
    """A C compiler wrapper that appends `line` (shell words) to a log, then runs the machine's cc: (log, path)."""
    log, cc = tmp_path / "cc.log", tmp_path / "cc"
    cc.write_text(f'#!/bin/sh\necho {line} >> {log}\nexec {shutil.which("cc") or shutil.which("gcc")} "$@"\n')
    cc.chmod(0o755)
    return log, cc


def test_kernel_build_is_cached_by_source_compiler_and_flags(tmp_path):
    """A second process loads the compiled kernel from the cache without running the compiler; other defines are
    another entry. The compiler is a wrapper that logs each call."""
    log, cc = logging_compiler(tmp_path, '"$@"')
    code = ("import sys; from picovllm.kernels.cpu.build import compile_library; "
            "lib = compile_library('paged_decode.c', {'HQ': 4, 'HKV': int(sys.argv[1]), 'DIM': 64, 'BLOCK': 16}); "
            "assert lib is not None")
    env = dict(os.environ, CC=str(cc), PICOVLLM_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    calls = []
    for hkv in ("2", "2", "1"):
        r = subprocess.run([sys.executable, "-c", code, hkv], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        calls.append(len(log.read_text().splitlines()) if log.exists() else 0)
    assert calls[0] == 2 and calls[1] == 2 and calls[2] == 4      # compile + link; a hit; new defines
    assert len(entries(tmp_path / "cache", "kernels")) == 2


def test_prebuild_compiles_every_kernel_the_engine_loads(tmp_path, tiny_models):
    """A first start compiles the CPU kernels at once (prebuild_cpu_kernels); the kernels the engine then loads are
    all cache hits: the compiler runs in the prebuild's threads only."""
    log, cc = logging_compiler(tmp_path, '"$PICOVLLM_PHASE $@"')
    code = ("import os, picovllm.kernels.cpu as k; from picovllm import LLM, SamplingParams; "
            "real = k.prebuild_cpu_kernels\n"
            "def spy(*a, **kw):\n"
            "    os.environ['PICOVLLM_PHASE'] = 'prebuild'; real(*a, **kw); os.environ['PICOVLLM_PHASE'] = 'later'\n"
            "import picovllm.engine.model_runner as mr; mr.prebuild_cpu_kernels = spy\n"
            f"llm = LLM({tiny_models['llama']!r}, num_kv_blocks=32)\n"
            "llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)\n"
            "assert llm.engine.runner.cpu_decode is not None\n")
    env = dict(os.environ, CC=str(cc), PICOVLLM_CACHE_DIR=str(tmp_path / "cache"), PICOVLLM_PHASE="before",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    phases = [line.split()[0] for line in log.read_text().splitlines()]
    # 5 builds, a compile and a link each: small_gemm, elementwise, paged_decode, and the decode stack linked with
    # small_gemm's object and quant_gemm's (built for it), its parts
    assert phases.count("prebuild") == 10 and set(phases) == {"prebuild"}, phases
    assert len(entries(tmp_path / "cache", "kernels")) == 5
