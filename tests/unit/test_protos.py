"""The committed stubs are exactly what the pinned grpcio-tools makes of the .proto files."""
from __future__ import annotations

import filecmp
import importlib.metadata
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ROOT / "protos" / "logicpipe" / "v1"


def test_generated_code_matches_protos(tmp_path):
    pinned = next(r for r in importlib.metadata.requires("logicpipe") if r.startswith("grpcio-tools"))
    installed = importlib.metadata.version("grpcio-tools")
    assert pinned.split("==")[1].split(";")[0].strip() == installed, (
        f"grpcio-tools {installed} installed but the stubs are pinned to {pinned}: pip install -e '.[dev]'")
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--out", str(tmp_path)], check=True)
    fresh = sorted(p.name for p in (tmp_path / "logicpipe" / "v1").iterdir())
    committed = sorted(p.name for p in GENERATED.iterdir() if p.name.endswith((".py", ".pyi")) and "_pb2" in p.name)
    assert fresh == committed
    drift = [n for n in fresh if not filecmp.cmp(tmp_path / "logicpipe" / "v1" / n, GENERATED / n, shallow=False)]
    assert not drift, f"stale generated code {drift}: run `python scripts/gen_protos.py` and commit"


def test_tensor_codec_round_trip_and_rejects():
    import pytest
    import torch

    from logicpipe import tensor_codec

    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32):
        t = (torch.arange(24).reshape(2, 3, 4) * 3).to(dtype)
        assert torch.equal(tensor_codec.decode(tensor_codec.encode(t)), t)
    msg = tensor_codec.encode(torch.zeros(2, 3))
    with pytest.raises(tensor_codec.TensorError, match="needs 24"):
        tensor_codec.decode(type(msg)(dtype="float32", shape=[2, 3], data=msg.data[:-1]))
    with pytest.raises(tensor_codec.TensorError, match="not allowed"):
        tensor_codec.decode(type(msg)(dtype="object", shape=[2, 3], data=msg.data))
    with pytest.raises(tensor_codec.TensorError, match="cap"):
        tensor_codec.decode(type(msg)(dtype="float32", shape=[2**20, 2**10], data=b""), max_bytes=2**20)
    with pytest.raises(tensor_codec.TensorError, match="rank"):
        tensor_codec.decode(msg, rank=3)
    with pytest.raises(tensor_codec.TensorError, match="negative"):
        tensor_codec.decode(type(msg)(dtype="float32", shape=[-2, -3], data=msg.data))
