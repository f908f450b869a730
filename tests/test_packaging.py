"""The package as pip installs it from a wheel (not the editable install set-up makes): every file the source tree's
package holds, the C kernels' headers included (a non-editable install compiles the CPU kernels from its copy)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_wheel_holds_every_package_file_and_each_c_include(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(os.path.join(ROOT, "picovllm"), src / "picovllm", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(src),   # builds as pip install does
                    "-w", str(tmp_path / "dist")], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("picovllm-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    tree = {os.path.relpath(os.path.join(d, f), src) for d, _, fs in os.walk(src / "picovllm") for f in fs}
    assert tree - names == set()
    for name in (n for n in names if n.endswith((".c", ".h"))):
        text = zipfile.ZipFile(wheel).read(name).decode()
        for inc in re.findall(r'#include "([^"]+)"', text):
            assert os.path.join(os.path.dirname(name), inc) in names, (name, inc)
