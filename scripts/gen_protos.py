"""Regenerate the gRPC/protobuf stubs beside the .proto files: `python scripts/gen_protos.py`.

Needs grpcio-tools (the `dev` extra pins the version the committed stubs were made with).
`--out DIR` writes into another directory instead (the drift test uses that)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"


def proto_files() -> list[str]:
    return sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "logicpipe" / "v1").glob("*.proto"))


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{PROTO_ROOT}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", *proto_files()]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=PROTO_ROOT)
    generate(ap.parse_args().out)


if __name__ == "__main__":
    sys.exit(main())
