"""What the planner is given: devices with their links, the workload, the memory reserve, the
objective. (The model is described in `model.py`, the answer in `plan.py`.)

Every value is a frozen dataclass: hashable, comparable, safe to share. Units are in the field
comments: bytes, seconds, FLOP/s, bytes/s.
"""
from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NewType

NodeId = NewType("NodeId", str)
"""Stable id of a stage node (persists across restarts of the node)."""


class InfeasibleError(ValueError):
    """No placement satisfies the memory (or weight-format) constraints; the message says how much
    memory is missing, or which stage overflows by how much, in human units."""


class Objective(enum.Enum):
    """What a plan minimizes (see `cost.py`)."""

    THROUGHPUT = "throughput"  # the bottleneck: max over stages of compute + transfer
    LATENCY = "latency"        # one token's trip: the sum over stages of compute + transfer

    @classmethod
    def parse(cls, value: "Objective | str") -> "Objective":
        """Accept an Objective or its value ("throughput", "latency"), case-insensitively."""
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            known = ", ".join(o.value for o in cls)
            raise ValueError(f"unknown objective {value!r}; expected one of: {known}") from None


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class Link:
    """One direction of a network path between two nodes."""

    bandwidth: float  # bytes/s of payload the sender can push to the receiver (inf only for LOOPBACK)
    latency: float    # s, one-way latency of one message (half the measured small round trip)

    def __post_init__(self) -> None:
        _require(_is_real(self.bandwidth) and self.bandwidth > 0 and not math.isnan(self.bandwidth),
                 f"link bandwidth must be > 0 bytes/s, got {self.bandwidth!r}")
        _require(_is_real(self.latency) and math.isfinite(self.latency) and self.latency >= 0,
                 f"link latency must be a finite number of seconds >= 0, got {self.latency!r}")


LOOPBACK = Link(bandwidth=math.inf, latency=0.0)
"""A node's link to itself: a single-stage pipeline hands the token back without a network hop."""

DEFAULT_LINK = Link(bandwidth=125_000_000.0, latency=1e-3)
"""Assumed for a pair of nodes whose link was never measured: 1 Gbit/s Ethernet, 1 ms one way."""


def _normalize_links(links: object) -> tuple[tuple[NodeId, Link], ...]:
    pairs = list(links.items()) if isinstance(links, Mapping) else list(links)  # type: ignore[arg-type]
    out: dict[str, Link] = {}
    for pair in pairs:
        _require(isinstance(pair, tuple) and len(pair) == 2, f"links entry must be (node_id, Link), got {pair!r}")
        other, link = pair
        _require(isinstance(other, str) and other != "", f"links key must be a non-empty node id, got {other!r}")
        _require(isinstance(link, Link), f"links[{other!r}] must be a Link, got {link!r}")
        _require(other not in out, f"links name node {other!r} twice")
        out[other] = link
    return tuple((NodeId(k), out[k]) for k in sorted(out))


@dataclass(frozen=True)
class DeviceProfile:
    """What one stage node offers, as measured by the node itself (petals-style: every unit stated).

    `links` may be given as a mapping {other_node_id: Link}; it is stored as a tuple of pairs
    sorted by node id so the profile stays hashable and its digest is canonical.
    """

    node_id: NodeId                 # stable node id
    device_kind: str                # what the layers run on: "cuda", "cpu", ...
    memory_bytes: int               # bytes available for this model's weights and KV (before the reserve)
    flops: float                    # FLOP/s, effective (a measured matmul in the compute dtype)
    mem_bandwidth: float            # bytes/s, effective memory read bandwidth
    links: tuple[tuple[NodeId, Link], ...] = ()  # measured outgoing links: (other node id, Link), sorted
    default_link: Link = DEFAULT_LINK             # assumed for any other node missing from `links`
    weight_formats: tuple[str, ...] = ("fp32", "fp16", "bf16")  # weight formats this node runs, preferred first
    # A node started quantized offers that one format ("int4", "int8", "nf4", "fp4"): its layers' matrices
    # are held in it, while embeddings, head, activations and KV stay in `compute_format` ("": fp32).
    compute_format: str = ""
    # bytes/s at which a one-token product reads weights in the node's format (a quantized kernel
    # may dequantize slower than memory streams); 0: mem_bandwidth
    weight_bandwidth: float = 0.0
    weight_bytes_per_param: float = 0.0  # measured bytes per parameter of a quantized format (scales included); 0: nominal
    # s of host time every step costs the node beyond its roofline compute and transfer (scheduling,
    # packing the batch, kernel launches); 0: DEFAULT_STEP_OVERHEAD_S of `cost.py` (assumed, 1 ms)
    step_overhead_s: float = 0.0
    devices: int = 1  # devices one stage of this node spans (a tensor-parallel stage, issue 36): it lists them
    # devices the node may give one stage, the planner choosing how many (`width.py`; --tp-max N): its
    # figures above are then one device's and `devices` is 1; 0: the width is `devices`, fixed (--tp N)
    max_devices: int = 0
    allreduce_latency_s: float = 0.0  # ... their all-reduce, measured: seconds of a small one (added twice a layer)
    allreduce_bandwidth: float = 0.0  # ... bytes/s of a large one (0: not measured)
    # its KV cache's format: "" the compute format; "int8" / "fp8" (--kv-dtype): a byte an element and a
    # float32 scale per (token, KV head) vector (model.kv_scale)
    kv_format: str = ""
    # its sliding-window layers keep every position's KV, as full layers do (a stage started with
    # --window-kv off, or a tensor-parallel one): the planner counts them so (False: they hold only their window)
    full_sliding_kv: bool = False

    def __post_init__(self) -> None:
        _require(isinstance(self.node_id, str) and self.node_id != "", f"node_id must be a non-empty string, got {self.node_id!r}")
        where = f"profile of node {self.node_id!r}"
        _require(isinstance(self.device_kind, str) and self.device_kind != "", f"{where}: device_kind must be a non-empty string")
        _require(_is_int(self.memory_bytes) and self.memory_bytes >= 0,
                 f"{where}: memory_bytes must be an integer >= 0, got {self.memory_bytes!r}")
        for name in ("flops", "mem_bandwidth"):
            value = getattr(self, name)
            _require(_is_real(value) and math.isfinite(value) and value > 0, f"{where}: {name} must be a finite number > 0, got {value!r}")
        links = _normalize_links(self.links)
        _require(all(other != self.node_id for other, _ in links), f"{where}: links must not name the node itself")
        object.__setattr__(self, "links", links)
        _require(isinstance(self.default_link, Link) and math.isfinite(self.default_link.bandwidth),
                 f"{where}: default_link must be a Link with a finite bandwidth")
        formats = tuple(self.weight_formats) if not isinstance(self.weight_formats, str) else (self.weight_formats,)
        _require(all(isinstance(f, str) and f for f in formats), f"{where}: weight_formats must be non-empty strings")
        object.__setattr__(self, "weight_formats", formats)
        _require(all(math.isfinite(link.bandwidth) for _, link in links), f"{where}: link bandwidths must be finite")
        _require(isinstance(self.compute_format, str), f"{where}: compute_format must be a string")
        _require(self.kv_format in ("", "int8", "fp8"), f"{where}: kv_format must be '', 'int8' or 'fp8', "
                                                         f"got {self.kv_format!r}")
        for name in ("weight_bandwidth", "weight_bytes_per_param", "step_overhead_s", "allreduce_latency_s",
                     "allreduce_bandwidth"):
            value = getattr(self, name)
            _require(_is_real(value) and math.isfinite(value) and value >= 0,
                     f"{where}: {name} must be a finite number >= 0, got {value!r}")
        _require(isinstance(self.full_sliding_kv, bool), f"{where}: full_sliding_kv must be a bool")
        _require(isinstance(self.devices, int) and not isinstance(self.devices, bool) and self.devices >= 1,
                 f"{where}: devices must be an integer >= 1, got {self.devices!r}")
        _require(_is_int(self.max_devices) and self.max_devices >= 0 and (self.max_devices <= 1 or self.devices == 1),
                 f"{where}: max_devices must be 0 (the width is `devices`) or an integer >= 1 on a profile of one "
                 f"device's figures (devices 1), got {self.max_devices!r} with devices {self.devices!r}")

    def link_to(self, other: str) -> Link:
        """The link from this node to `other`: LOOPBACK for itself, the measured one if present,
        else `default_link`."""
        if other == self.node_id:
            return LOOPBACK
        for node, link in self.links:
            if node == other:
                return link
        return self.default_link


@dataclass(frozen=True)
class Workload:
    """How the pipeline will be used; the cost model and the KV reservation depend on it."""

    tokens_per_step: int = 1     # tokens in one forward pass over all sequences of the batch (decode: = batch)
    context_tokens: int = 2048   # tokens of context per sequence the plan must hold KV for (and attend over)
    batch: int = 1               # sequences resident at once (each holds context_tokens of KV)

    def __post_init__(self) -> None:
        for name in ("tokens_per_step", "context_tokens", "batch"):
            value = getattr(self, name)
            _require(_is_int(value) and value >= 1, f"workload {name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class Reserve:
    """Memory every device keeps free of weights and KV (activations, allocator slack, runtime).

    usable bytes = floor(memory_bytes x (1 - fraction)) - fixed_bytes.
    """

    fraction: float = 0.10  # share of each device's memory_bytes kept free, in [0, 1)
    fixed_bytes: int = 0    # bytes kept free on each device in addition to the fraction

    def __post_init__(self) -> None:
        _require(_is_real(self.fraction) and 0 <= self.fraction < 1, f"reserve fraction must be in [0, 1), got {self.fraction!r}")
        _require(_is_int(self.fixed_bytes) and self.fixed_bytes >= 0, f"reserve fixed_bytes must be an integer >= 0, got {self.fixed_bytes!r}")

    def usable_bytes(self, memory_bytes: int) -> int:
        """Bytes left for weights and KV on a device offering `memory_bytes` (never below 0)."""
        return max(0, math.floor(memory_bytes * (1.0 - self.fraction)) - self.fixed_bytes)


DEFAULT_RESERVE = Reserve()


def unique_profiles(profiles: Iterable[DeviceProfile]) -> tuple[DeviceProfile, ...]:
    """The profiles as a tuple; ValueError if empty, not DeviceProfiles, or a node id repeats."""
    out = tuple(profiles)
    _require(len(out) > 0, "no device profiles given")
    seen: set[str] = set()
    for p in out:
        _require(isinstance(p, DeviceProfile), f"expected DeviceProfile, got {type(p).__name__}")
        _require(p.node_id not in seen, f"node id {p.node_id!r} appears twice in the profiles")
        seen.add(p.node_id)
    return out
