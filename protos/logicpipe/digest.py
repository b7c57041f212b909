"""Model digest: the controller and every stage compute it the same way, so an assignment can
require that a node's model directory holds the controller's model."""
from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path


class DigestError(ValueError):
    """The directory cannot be digested (missing, no config.json, corrupt safetensors header)."""


def safetensors_header(file: Path) -> dict:
    """The JSON header of a safetensors file: tensor name -> {dtype, shape, data_offsets}."""
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise DigestError(f"{file} is truncated (no safetensors header)")
        (size,) = struct.unpack("<Q", head)
        try:
            return json.loads(f.read(size))
        except ValueError as e:
            raise DigestError(f"{file} has a corrupt safetensors header: {e}") from e


def model_digest(model_dir: str | Path) -> str:
    """16 hex chars of sha256 over config.json and the tensor table: every tensor's name, dtype and
    shape from the safetensors headers, sorted by name, so it does not depend on how the weights are
    split into files. The weights themselves are not read: fast, and tells models apart, not bit flips."""
    path = Path(model_dir)
    config = path / "config.json"
    if not config.is_file():
        raise DigestError(f"{path} has no config.json")
    h = hashlib.sha256(config.read_bytes())
    table = {}
    for file in sorted(path.glob("*.safetensors")):
        for name, meta in safetensors_header(file).items():
            if name != "__metadata__":
                table[name] = (meta["dtype"], list(meta["shape"]))
    h.update(json.dumps(sorted(table.items()), separators=(",", ":")).encode())
    return h.hexdigest()[:16]
