"""The package as pip installs it from a wheel (not the editable install set-up makes): every file the source tree's
package holds, the C kernels' headers included (a non-editable install compiles the CPU kernels from its copy), and
nothing of the checkout beside it (tests/, benchmarks/) that an installed copy would miss."""
from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> tuple[str, str]:
    """(the wheel, the source copy it was built from)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(os.path.join(ROOT, "picovllm"), src / "picovllm", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(src),   # builds as pip install does
                    "-w", str(tmp / "dist")], check=True, capture_output=True, timeout=300)
    (path,) = (tmp / "dist").glob("picovllm-*.whl")
    return str(path), str(src)


def test_the_wheel_holds_every_package_file_and_each_c_include(wheel):
    path, src = wheel
    names = set(zipfile.ZipFile(path).namelist())
    tree = {os.path.relpath(os.path.join(d, f), src) for d, _, fs in os.walk(os.path.join(src, "picovllm")) for f in fs}
    assert tree - names == set()
    for name in (n for n in names if n.endswith((".c", ".h"))):
        text = zipfile.ZipFile(path).read(name).decode()
        for inc in re.findall(r'#include "([^"]+)"', text):
            assert os.path.join(os.path.dirname(name), inc) in names, (name, inc)
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"picovllm"}


def test_no_module_of_the_package_imports_the_checkouts_tests_or_benchmarks():
    # tests/ and benchmarks/ are not installed; their modules are imported by bare name (tests put their folder on
    # sys.path), so a bare `import gguf_writing` in the package would work in the checkout only
    outside = {"tests", "benchmarks"} | {os.path.splitext(f)[0] for d in ("tests", "benchmarks")
                                         for f in os.listdir(os.path.join(ROOT, d)) if f.endswith(".py")}
    found = []
    for d, _, fs in os.walk(os.path.join(ROOT, "picovllm")):
        for f in (f for f in fs if f.endswith(".py")):
            with open(os.path.join(d, f)) as fh:
                tree = ast.parse(fh.read())
            for node in ast.walk(tree):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
                found += [(os.path.relpath(os.path.join(d, f), ROOT), n) for n in names if n.split(".")[0] in outside]
    assert found == []


@pytest.mark.skipif(not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")
def test_an_installed_copy_compiles_its_kernels_into_the_cache_and_writes_nothing_beside_itself(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel[0]).extractall(site)
    before = sorted(map(str, site.rglob("*")))
    for p in site.rglob("*"):
        p.chmod(0o555 if p.is_dir() else 0o444)     # read-only, as a system install leaves it
    # -S: no site-packages, so the extracted copy is the one imported, not the checkout's editable install (the
    # build module needs nothing beyond the standard library); a source with its own header (gemm_parts.h)
    code = ("import picovllm.kernels.cpu.build as b; lib = b.compile_library('small_gemm.c', flags=b.OPENMP); "
            "print(b.HERE); print(lib._name if lib else None)")
    env = {**os.environ, "PYTHONPATH": str(site), "PICOVLLM_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("PICOVLLM_NO_CACHE", None)
    try:
        out = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=120, check=True).stdout.split()
    finally:
        for p in site.rglob("*"):
            p.chmod(0o755 if p.is_dir() else 0o644)
    assert out[0] == str(site / "picovllm" / "kernels" / "cpu")
    assert out[1].startswith(str(tmp_path / "cache" / "kernels")), out[1]
    assert sorted(map(str, site.rglob("*"))) == before
