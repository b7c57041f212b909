"""Weights pulled from the controller, for a stage node that does not have the model on disk.

The cache of a model is the directory `cache_root/<digest>/`: config.json (+ generation_config.json
when the controller has it) and safetensors files `part-<8 hex>.safetensors`, one per pull, of the
tensors pulled so far. `Shard.load(cache_dir, ...)` reads it like any model directory. A pull asks
the controller (Controller.PullWeights) only for the tensors no part file holds yet.

Consistency without locks: a part file is written under a temporary name (`.part-….tmp`, which
neither the safetensors glob nor a later pull reads) and renamed into place only once every tensor
in it passed its sha256 check, so the cache holds complete, verified files or nothing new; a crash
leaves only temporary files, removed by the next pull. config.json is written last of the config
files, so its presence means they all were. One pull of a digest at a time (the stage serializes
its assignments).
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import os
import re
import secrets
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import grpc

from logicpipe.common.modeldir import ModelConfig, ModelError, safetensors_files, safetensors_layout
from logicpipe.common.transport import Transport
from logicpipe.errors import FailedPrecondition, InvalidArgument, Unavailable, from_code
from logicpipe.policy import STREAM_KEY_HEADER
from logicpipe.stage_node.model.weights import shard_tensor_names
from logicpipe.v1 import controller_pb2, controller_pb2_grpc

log = logging.getLogger(__name__)

# pulled together, written in this order (config.json last: its presence means they all are); the
# tokenizer's files serve structured output on a last stage (stage_node.grammar)
CONFIG_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                "config.json")
MAX_TENSORS_PER_PULL = 1024  # tensor names per PullWeights request (the controller takes up to 4096)
MAX_FILE_BYTES = 64 * 2**20  # a config or tokenizer file larger than this is refused (Gemma's tokenizer.json: 33 MB)
STALL_TIMEOUT_S = 60.0       # no chunk for this long: the pull fails as UNAVAILABLE (s)
PROGRESS_EVERY_S = 2.0       # progress is logged at least this often during a pull (s) ...
PROGRESS_STEP = 0.1          # ... and every time this fraction of the tensors more has arrived,
PROGRESS_MIN_GAP_S = 0.5     # but not more often than this (s)
MAX_DIMS = 8                 # dims of one tensor; with MAX_DTYPE_CHARS, bounds its header entry
MAX_DTYPE_CHARS = 16
DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16,
              "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64}
_DIGEST = re.compile(r"[0-9a-f]{8,64}")
_SHA256 = re.compile(r"[0-9a-f]{64}")

Progress = Callable[..., None]  # called like log.info(msg, *args)


@dataclass(frozen=True)
class PullResult:
    path: Path         # cache_root/<digest>: load the shard from here
    pulled_bytes: int  # tensor bytes received by this call (config files not counted)
    tensors: int       # tensors received by this call
    cached: int        # requested tensors that were in the cache already


def needed_tensors(config: ModelConfig, start: int, end: int, *, first: bool, last: bool) -> list[str]:
    """The tensors `Shard.load(dir, start, end, first=, last=)` reads from a pulled cache (an
    untied model there has its LM head: the controller refuses a name it lacks)."""
    if not 0 <= start < end <= config.num_layers:
        raise InvalidArgument(f"layers [{start}, {end}) are not a range of the model's {config.num_layers}")
    return shard_tensor_names(config, start, end, first=first, last=last, tied=config.tie_word_embeddings)


async def pull_assignment(transport: Transport, controller_address: str, digest: str, start: int, end: int, num_layers: int,
                          cache_root: Path, *, progress: Progress = log.info, key: str = "") -> PullResult:
    """Pull what layers [start, end) of a `num_layers` model need (config first, on a fresh cache)."""
    cache_dir = cache_dir_for(cache_root, digest)
    if not (cache_dir / "config.json").is_file():
        await pull_shard(transport, controller_address, digest, True, [], cache_root, progress=progress, key=key)
    try:
        layout = await asyncio.to_thread(ModelConfig.from_dir, cache_dir, False)  # weights may be to come
    except ModelError as e:
        raise FailedPrecondition(f"the pulled config is unusable: {e}") from e
    if layout.num_layers != num_layers:
        raise FailedPrecondition(f"the controller's model (digest {digest}) has {layout.num_layers} layers, "
                                 f"the assignment says {num_layers}")
    names = needed_tensors(layout, start, end, first=start == 0, last=end == num_layers)
    return await pull_shard(transport, controller_address, digest, True, names, cache_root, progress=progress,
                            key=key)


async def pull_shard(transport: Transport, controller_address: str, digest: str, config_needed: bool, names: list[str],
                     cache_root: Path, *, progress: Progress = log.info, key: str = "") -> PullResult:
    """Make `cache_root/<digest>/` hold `names` (and the config files when `config_needed`),
    pulling from the controller only what it lacks (showing it `key`, the plan's stream key). Raises a MeshError: the controller's status
    (FailedPrecondition for another digest, NotFound for an unknown tensor, ...), or Unavailable
    for a broken, stalled or corrupted stream; then nothing new was added to the cache."""
    cache_dir = cache_dir_for(cache_root, digest)
    await asyncio.to_thread(_prepare, cache_dir)
    have = await asyncio.to_thread(cached_tensors, cache_dir)
    missing = [n for n in dict.fromkeys(names) if n not in have]
    files = list(CONFIG_FILES) if config_needed and not (cache_dir / "config.json").is_file() else []
    cached = len(set(names)) - len(missing)
    if not missing and not files:
        return PullResult(cache_dir, 0, 0, cached)

    t0 = time.perf_counter()
    meter = _Meter(progress, len(missing))
    batches = [missing[i: i + MAX_TENSORS_PER_PULL] for i in range(0, len(missing), MAX_TENSORS_PER_PULL)] or [[]]
    async with transport.channel(controller_address, "controller") as channel:
        stub = controller_pb2_grpc.ControllerStub(channel)
        for i, batch in enumerate(batches):
            request = controller_pb2.PullWeightsRequest(model_digest=digest, tensors=batch,
                                                        files=files if i == 0 else [])
            await _pull_one(stub, request, controller_address, cache_dir, meter, key)
    took = time.perf_counter() - t0
    if missing:
        log.info("pulled %d tensor(s), %.1f MiB from the controller at %s in %.2f s (%.0f MiB/s) into %s; "
                 "%d were cached", len(missing), meter.bytes / 2**20, controller_address, took,
                 meter.bytes / 2**20 / max(took, 1e-9), cache_dir, cached)
    return PullResult(cache_dir, meter.bytes, len(missing), cached)


def cache_dir_for(cache_root: Path, digest: str) -> Path:
    if not _DIGEST.fullmatch(digest or ""):
        raise InvalidArgument(f"model digest {digest[:80]!r} is not 8 to 64 lowercase hex digits")
    return Path(cache_root) / digest


def cached_tensors(cache_dir: Path) -> set[str]:
    """Tensor names held by the cache's safetensors files; a file that is not a complete
    safetensors file (it cannot be one of ours) is removed, so its tensors are pulled again."""
    names: set[str] = set()
    for file in safetensors_files(cache_dir):
        try:
            header, data_start = safetensors_layout(file)
            end = max((m["data_offsets"][1] for n, m in header.items() if n != "__metadata__"), default=0)
            complete = file.stat().st_size == data_start + end
        except (ModelError, OSError, AttributeError, KeyError, TypeError, IndexError, struct.error):
            complete = False
        if not complete:
            log.warning("removing %s from the weight cache: not a complete safetensors file", file)
            file.unlink(missing_ok=True)
            continue
        names.update(n for n in header if n != "__metadata__")
    return names


def _prepare(cache_dir: Path) -> None:
    """Create the cache directory; remove what an interrupted pull left."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    for tmp in cache_dir.glob(".*.tmp"):
        log.info("removing %s, left by an interrupted pull", tmp)
        tmp.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- one request

async def _pull_one(stub: controller_pb2_grpc.ControllerStub, request: controller_pb2.PullWeightsRequest,
                    address: str, cache_dir: Path, meter: "_Meter", key: str = "") -> None:
    receiver = _Receiver(request, address, cache_dir, meter)
    try:
        call = stub.PullWeights(request, metadata=((STREAM_KEY_HEADER, key),) if key else None)
        try:
            while True:
                try:
                    chunk = await asyncio.wait_for(call.read(), STALL_TIMEOUT_S)
                except asyncio.TimeoutError:
                    raise Unavailable(f"the controller at {address} sent no weights for "
                                      f"{STALL_TIMEOUT_S:.0f} s") from None
                if chunk is grpc.aio.EOF:
                    break
                await receiver.take(chunk)
        finally:
            call.cancel()
        await receiver.commit()
    except grpc.aio.AioRpcError as err:
        receiver.discard()
        raise from_code(err.code(), f"pulling weights from the controller at {address}: {err.details()}") from err
    except BaseException:
        receiver.discard()
        raise


@dataclass
class _Item:
    """The tensor or file being received."""

    name: str
    is_file: bool
    total: int        # bytes
    sha256: str       # expected, hex
    base: int = 0     # tensor: offset of its data in the part file's data section
    received: int = 0
    data: bytearray | None = None  # file: its bytes
    hasher: object = field(default_factory=hashlib.sha256, repr=False)  # of the bytes received so far


class _Receiver:
    """Checks a PullWeights stream chunk by chunk: only what was asked for, each once, in order,
    sizes that fit dtype and shape, and each item's sha256 once it is complete."""

    def __init__(self, request: controller_pb2.PullWeightsRequest, address: str, cache_dir: Path, meter: "_Meter"):
        self.address, self.cache_dir, self.meter = address, cache_dir, meter
        self.tensors = list(request.tensors)
        self.files = list(request.files)
        self.part = _PartFile(cache_dir, self.tensors) if self.tensors else None
        self.current: _Item | None = None
        self.done: set[tuple[bool, str]] = set()
        self.file_data: dict[str, bytes] = {}

    def _broken(self, what: str) -> Unavailable:
        return Unavailable(f"the weights stream from the controller at {self.address} is broken: {what}; "
                           "nothing of it was cached, assign again to retry")

    async def take(self, chunk: controller_pb2.WeightChunk) -> None:
        cur = self.current
        if cur is None:
            cur = self.current = self._start(chunk)
        elif (chunk.is_file, chunk.name) != (cur.is_file, cur.name):  # a complete one was finished at once
            raise self._broken(f"{cur.name} ended after {cur.received} of its {cur.total} bytes")
        elif chunk.offset != cur.received:
            raise self._broken(f"{cur.name}: a chunk at offset {chunk.offset}, expected {cur.received}")
        data = chunk.data
        if cur.received + len(data) > cur.total:
            raise self._broken(f"{cur.name}: more than its {cur.total} bytes")
        if cur.is_file:
            cur.data.extend(data)
            cur.hasher.update(data)
        else:
            await asyncio.to_thread(self.part.write, cur.base + cur.received, data, cur.hasher)
            self.meter.add_bytes(len(data))
        cur.received += len(data)
        if cur.received == cur.total:
            self._finish(cur)

    def _start(self, chunk: controller_pb2.WeightChunk) -> _Item:
        key = (chunk.is_file, chunk.name)
        wanted = self.files if chunk.is_file else self.tensors
        if chunk.name not in wanted or key in self.done:
            raise self._broken(f"{'file' if chunk.is_file else 'tensor'} {chunk.name[:200]!r} was not asked for "
                               "(or came twice)")
        if chunk.offset != 0 or not _SHA256.fullmatch(chunk.sha256):
            raise self._broken(f"{chunk.name}: its first chunk has offset {chunk.offset} or no sha256")
        item = _Item(chunk.name, chunk.is_file, chunk.total_bytes, chunk.sha256)
        if chunk.is_file:
            if chunk.total_bytes > MAX_FILE_BYTES:
                raise self._broken(f"{chunk.name} has {chunk.total_bytes} bytes (at most {MAX_FILE_BYTES})")
            item.data = bytearray()
            return item
        bits = DTYPE_BITS.get(chunk.dtype)
        if bits is None or len(chunk.shape) > MAX_DIMS:
            raise self._broken(f"{chunk.name}: dtype {chunk.dtype[:20]!r} or its {len(chunk.shape)} dims are not "
                               "supported")
        if math.prod(chunk.shape) * bits // 8 != chunk.total_bytes:
            raise self._broken(f"{chunk.name}: {chunk.total_bytes} bytes do not fit {chunk.dtype} {list(chunk.shape)}")
        item.base = self.part.add(chunk.name, chunk.dtype, list(chunk.shape), chunk.total_bytes)
        return item

    def _finish(self, item: _Item) -> None:
        if item.hasher.hexdigest() != item.sha256:
            raise self._broken(f"{item.name} failed its sha256 check (corrupted in transit?)")
        self.done.add((item.is_file, item.name))
        if item.is_file:
            self.file_data[item.name] = bytes(item.data)
        else:
            self.meter.add_tensor()
        self.current = None

    async def commit(self) -> None:
        """The stream ended: everything asked for must have come, verified; then store it."""
        if (cur := self.current) is not None:
            raise self._broken(f"{cur.name} ended after {cur.received} of its {cur.total} bytes")
        lacking = [n for n in self.tensors if (False, n) not in self.done]
        if lacking:
            raise self._broken(f"it ended without {len(lacking)} tensor(s), e.g. {lacking[:3]}")
        if "config.json" in self.files and "config.json" not in self.file_data:
            raise self._broken("it ended without config.json")
        if self.part is not None:
            await asyncio.to_thread(self.part.commit)
        for name in sorted(self.file_data, key=lambda n: n == "config.json"):  # config.json last
            await asyncio.to_thread(_write_atomic, self.cache_dir / name, self.file_data[name])

    def discard(self) -> None:
        if self.part is not None:
            self.part.discard()


# ----------------------------------------------------------------------------- the files

class _PartFile:
    """A new `part-<8 hex>.safetensors`, written under a temporary name. The header's room is
    reserved up front from the tensor names (entries of up to MAX_DIMS dims and MAX_DTYPE_CHARS),
    so the data streams straight to its place; the header, padded with spaces, is written last."""

    def __init__(self, cache_dir: Path, names: list[str]):
        while True:
            self.path = cache_dir / f"part-{secrets.token_hex(4)}.safetensors"
            if not self.path.exists():
                break
        self.cache_dir = cache_dir
        self.tmp = cache_dir / f".{self.path.name}.tmp"
        widest = {"dtype": "X" * MAX_DTYPE_CHARS, "shape": [2**64 - 1] * MAX_DIMS, "data_offsets": [2**64 - 1] * 2}
        self.room = -(-len(_header_json({n: widest for n in names})) // 8) * 8  # bytes, a multiple of 8
        self.entries: dict[str, dict] = {}
        self.size = 0  # bytes of the data section so far
        self.fd: int | None = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)

    def add(self, name: str, dtype: str, shape: list[int], nbytes: int) -> int:
        """Place a tensor after the previous ones; its offset in the data section."""
        base = self.size
        self.entries[name] = {"dtype": dtype, "shape": shape, "data_offsets": [base, base + nbytes]}
        self.size += nbytes
        return base

    def write(self, offset: int, data: bytes, hasher) -> None:
        """Worker thread: data at `offset` of the data section, and into its tensor's hash."""
        os.pwrite(self.fd, data, 8 + self.room + offset)
        hasher.update(data)

    def commit(self) -> None:
        header = _header_json(self.entries)
        assert len(header) <= self.room, "the reserved header room is too small"
        os.pwrite(self.fd, struct.pack("<Q", self.room) + header + b" " * (self.room - len(header)), 0)
        os.ftruncate(self.fd, 8 + self.room + self.size)
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = None
        os.replace(self.tmp, self.path)
        _fsync_dir(self.cache_dir)

    def discard(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.tmp.unlink(missing_ok=True)


def _header_json(entries: dict[str, dict]) -> bytes:
    return json.dumps({"__metadata__": {"format": "pt"}, **entries}, separators=(",", ":")).encode()


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Meter:
    """Progress of one pull (tensors and MiB received, MiB/s), logged as the constants above say."""

    def __init__(self, progress: Progress, total_tensors: int):
        self.progress, self.total = progress, total_tensors
        self.tensors = self.bytes = 0
        self.t0 = self.last_t = time.perf_counter()
        self.last_frac = 0.0

    def add_bytes(self, n: int) -> None:
        self.bytes += n
        self._maybe_log()

    def add_tensor(self) -> None:
        self.tensors += 1
        self._maybe_log()

    def _maybe_log(self) -> None:
        now = time.perf_counter()
        frac = self.tensors / self.total if self.total else 1.0
        if ((frac - self.last_frac >= PROGRESS_STEP and now - self.last_t >= PROGRESS_MIN_GAP_S)
                or now - self.last_t >= PROGRESS_EVERY_S):
            self.last_frac, self.last_t = frac, now
            self.progress("pulling weights: %d/%d tensors, %.1f MiB, %.1f MiB/s", self.tensors, self.total,
                          self.bytes / 2**20, self.bytes / 2**20 / max(now - self.t0, 1e-9))
