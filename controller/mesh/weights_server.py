"""PullWeights: the controller sends named tensors of its model directory to a stage node that
does not have the model on disk.

Each tensor's bytes are read straight from its safetensors file by the header's data_offsets (no
torch, no whole-file load) and sent in CHUNK_BYTES messages; its first chunk carries dtype, shape,
size and the sha256 of the whole tensor, so the node can check what it stores. The sha256 needs a
first pass over the tensor; it is remembered per (file, size, mtime, tensor), so later pulls read
each tensor once. Only one chunk is in memory at a time, and every read runs in a worker thread:
the controller keeps serving while it sends.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Iterable

from logicpipe.common.modeldir import ModelError, checkpoint_index, safetensors_layout
from logicpipe.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from logicpipe.v1 import controller_pb2

log = logging.getLogger(__name__)

CHUNK_BYTES = 2**20           # data bytes per WeightChunk message
MAX_TENSORS_PER_REQUEST = 4096  # tensor names in one PullWeightsRequest
# files a node may ask for: the config, and the tokenizer (a last stage compiles structured-output
# grammars against it); the optional ones that are absent are skipped
ALLOWED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json")


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor's bytes lie in the checkpoint."""

    name: str
    file: Path
    dtype: str         # safetensors dtype ("F32", "BF16", ...)
    shape: tuple[int, ...]
    start: int         # absolute byte offset of its data in `file`
    size: int          # bytes

    @property
    def key(self) -> tuple:
        """Identifies these bytes across requests: a rewritten file gets a new key."""
        st = self.file.stat()
        return (str(self.file), st.st_size, st.st_mtime_ns, self.name)


_sha256_cache: dict[tuple, str] = {}  # TensorRef.key -> hex sha256 of the tensor's bytes


async def stream_weights(model_dir: Path, digest: str, request: controller_pb2.PullWeightsRequest, *,
                         peer: str = "") -> AsyncIterator[controller_pb2.WeightChunk]:
    """The chunks answering `request`: the requested files first, then each tensor in request
    order. Raises a MeshError (before the first chunk) for a request that cannot be served."""
    model_dir = Path(model_dir)
    if request.model_digest != digest:
        raise FailedPrecondition(f"this controller serves model digest {digest}, not "
                                 f"{request.model_digest or '(none)'}; the node must be assigned by this controller")
    files = list(dict.fromkeys(request.files))
    names = list(dict.fromkeys(request.tensors))
    refused = [f for f in files if f not in ALLOWED_FILES]
    if refused:
        raise InvalidArgument(f"files {refused[:3]} cannot be pulled; allowed: {', '.join(ALLOWED_FILES)}")
    if len(names) > MAX_TENSORS_PER_REQUEST:
        raise InvalidArgument(f"{len(names)} tensors asked for in one request; at most "
                              f"{MAX_TENSORS_PER_REQUEST}: split it into several")
    table = await asyncio.to_thread(tensor_table, model_dir)
    unknown = [n for n in names if n not in table]
    if unknown:
        raise NotFound(f"the model {model_dir.name} (digest {digest}) has no tensor(s) {unknown[:3]}"
                       f"{f' and {len(unknown) - 3} more' if len(unknown) > 3 else ''}")

    t0 = time.perf_counter()
    sent = 0
    for name in files:
        data = await asyncio.to_thread(_read_file, model_dir / name)
        if data is None:  # all but config.json are optional: the node sees one is absent
            continue
        for chunk in _file_chunks(name, data):
            yield chunk
    for name in names:
        ref = table[name]
        async for chunk in _tensor_chunks(ref):
            yield chunk
        sent += ref.size
    took = time.perf_counter() - t0
    if names:
        log.info("sent %d tensor(s), %.1f MiB%s to %s in %.2f s (%.0f MiB/s)", len(names), sent / 2**20,
                 f" and {len(files)} file(s)" if files else "", peer or "a node", took,
                 sent / 2**20 / max(took, 1e-9))
    else:
        log.info("sent %s to %s", ", ".join(files) or "nothing", peer or "a node")


def tensor_table(model_dir: Path) -> dict[str, TensorRef]:
    """Tensor name -> where its bytes lie, from the safetensors headers (the file for each name
    from the index of a sharded checkpoint, as the stages read it)."""
    try:
        owner = checkpoint_index(model_dir)
    except ModelError as e:
        raise FailedPrecondition(f"the controller cannot read its model: {e}") from e
    table = {}
    for file in sorted(set(owner.values())):
        try:
            header, data_start = safetensors_layout(file)
        except (ModelError, OSError) as e:
            raise FailedPrecondition(f"the controller cannot read {file}: {e}") from e
        for name, meta in header.items():
            if name == "__metadata__" or owner.get(name) != file:
                continue
            begin, end = meta["data_offsets"]
            table[name] = TensorRef(name, file, meta["dtype"], tuple(meta["shape"]), data_start + begin, end - begin)
    return table


def _read_file(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _file_chunks(name: str, data: bytes) -> Iterable[controller_pb2.WeightChunk]:
    """A small file held in memory, as chunks."""
    sha256 = hashlib.sha256(data).hexdigest()
    for offset in range(0, max(len(data), 1), CHUNK_BYTES):
        yield controller_pb2.WeightChunk(name=name, is_file=True, offset=offset, total_bytes=len(data),
                                         data=data[offset: offset + CHUNK_BYTES],
                                         sha256=sha256 if offset == 0 else "")


async def _tensor_chunks(ref: TensorRef) -> AsyncIterator[controller_pb2.WeightChunk]:
    key = await asyncio.to_thread(lambda: ref.key)
    sha = _sha256_cache.get(key)
    if sha is None:
        sha = _sha256_cache[key] = await asyncio.to_thread(_sha256_of, ref)
    for offset in range(0, max(ref.size, 1), CHUNK_BYTES):
        data = await asyncio.to_thread(_read, ref, offset, min(CHUNK_BYTES, ref.size - offset))
        first = offset == 0
        yield controller_pb2.WeightChunk(
            name=ref.name, dtype=ref.dtype if first else "", shape=ref.shape if first else (),
            offset=offset, total_bytes=ref.size, data=data, sha256=sha if first else "")


def _read(ref: TensorRef, offset: int, n: int) -> bytes:
    """Worker thread: n bytes of the tensor at `offset` (the file opened per chunk: cheap, and no
    descriptor outlives a call the client cancelled)."""
    with open(ref.file, "rb") as f:
        f.seek(ref.start + offset)
        data = f.read(n)
    if len(data) != n:
        raise Unavailable(f"{ref.file} ended inside tensor {ref.name}: was the model changed while it was sent?")
    return data


def _sha256_of(ref: TensorRef) -> str:
    h = hashlib.sha256()
    with open(ref.file, "rb") as f:
        f.seek(ref.start)
        left = ref.size
        while left:
            block = f.read(min(CHUNK_BYTES * 8, left))
            if not block:
                raise Unavailable(f"{ref.file} ended inside tensor {ref.name}: was the model changed?")
            h.update(block)
            left -= len(block)
    return h.hexdigest()
