"""Model digest: the controller and every stage compute it the same way, so an assignment can
require that a node's model directory holds the controller's model."""
from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path


def _safetensors_header(path: Path) -> bytes:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return f.read(n)


def model_digest(model_dir: str | Path) -> str:
    """16 hex chars of sha256 over config.json and the safetensors headers (tensor names, dtypes,
    shapes and offsets). Fast: the weights themselves are not read."""
    path = Path(model_dir)
    h = hashlib.sha256()
    h.update(json.dumps(json.loads((path / "config.json").read_text()), sort_keys=True).encode())
    for f in sorted(path.glob("*.safetensors")):
        h.update(f.name.encode())
        h.update(_safetensors_header(f))
    return h.hexdigest()[:16]
