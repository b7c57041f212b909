"""Stable digests of what a plan is made from: sha256 over canonical JSON (sorted keys, no
whitespace, floats as Python's shortest repr), so the same inputs give the same hex string on
every machine and run.

The profiles digest does not depend on the order the profiles are given in (the DP does not
either); it covers every profile given to the planner, so a node joining changes it too. A
re-measured profile whose numbers moved changes its digest: round measurements before building
profiles if small drifts should not force a re-plan.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import asdict

from logicpipe.planner.model import ModelSpec
from logicpipe.planner.plan import FORMAT_VERSION, PlanMetadata
from logicpipe.planner.types import DeviceProfile, Link, NodeId, Reserve, Workload


def canonical_json(value: object) -> str:
    """JSON with sorted keys and no whitespace; NaN and infinity are refused."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False, ensure_ascii=True)


def _sha256(value: object) -> str:
    return hashlib.sha256(canonical_json(value).encode("ascii")).hexdigest()


def _link_dict(link: Link) -> dict:
    return {"bandwidth": link.bandwidth, "latency": link.latency}


def profile_dict(profile: DeviceProfile) -> dict:
    """A profile as plain JSON types (`step_overhead_s` only when set, so the digest of a profile
    that leaves it at 0 is what it was before the field existed)."""
    out = {
        "node_id": profile.node_id,
        "device_kind": profile.device_kind,
        "memory_bytes": profile.memory_bytes,
        "flops": profile.flops,
        "mem_bandwidth": profile.mem_bandwidth,
        "links": [[node, _link_dict(link)] for node, link in profile.links],
        "default_link": _link_dict(profile.default_link),
        "weight_formats": list(profile.weight_formats),
    }
    if profile.step_overhead_s:
        out["step_overhead_s"] = profile.step_overhead_s
    if profile.kv_format:
        out["kv_format"] = profile.kv_format
    if profile.full_sliding_kv:
        out["full_sliding_kv"] = True
    if profile.devices > 1:
        out["devices"] = profile.devices
    if profile.devices > 1 or profile.max_devices > 1:
        out["allreduce"] = [profile.allreduce_latency_s, profile.allreduce_bandwidth]
    if profile.max_devices > 1:
        out["max_devices"] = profile.max_devices
    return out


def profile_digest(profile: DeviceProfile) -> str:
    """sha256 (hex) of one profile's canonical JSON."""
    return _sha256(profile_dict(profile))


def node_digests(profiles: Iterable[DeviceProfile]) -> tuple[tuple[NodeId, str], ...]:
    """(node id, profile digest) for each profile, sorted by node id."""
    return tuple(sorted((p.node_id, profile_digest(p)) for p in profiles))


def profiles_digest(profiles: Iterable[DeviceProfile]) -> str:
    """sha256 (hex) over all node digests, independent of the order of `profiles`."""
    return digest_of_nodes(node_digests(profiles))


def digest_of_nodes(nodes: Iterable[tuple[str, str]]) -> str:
    """The profiles digest from (node id, profile digest) pairs."""
    return _sha256(sorted([node, digest] for node, digest in nodes))


def model_digest(model: ModelSpec) -> str:
    """sha256 (hex) of the ModelSpec's canonical JSON (its weights_digest included; a dense model's
    empty mixture-of-experts and layer-kind fields left out, so its digest is what it was before they existed)."""
    fields = asdict(model)
    for name in ("kv_elements_per_token_per_layer", "kv_vectors_per_token_per_layer", "tp_sizes"):
        fields.pop(name)  # (the shape the other fields record, counted for 8-bit KV and the tensor-parallel
        # widths: digests as before issue 39)
    if not model.num_experts:
        for name in ("num_experts", "experts_per_token", "expert_bytes"):
            fields.pop(name)
    for name, empty in (("layer_kinds", ()), ("sliding_window", 0), ("state_bytes_per_layer", 0)):
        if fields[name] == empty:  # (a model with every layer full: its digest as before issue 37)
            fields.pop(name)
        elif name == "layer_kinds":
            fields[name] = list(fields[name])
    return _sha256(fields)


def make_metadata(profiles: Iterable[DeviceProfile], model: ModelSpec, workload: Workload,
                  reserve: Reserve) -> PlanMetadata:
    """The metadata recorded in a plan made from these inputs."""
    nodes = node_digests(profiles)
    return PlanMetadata(
        format_version=FORMAT_VERSION,
        model_name=model.name,
        model_digest=model_digest(model),
        profiles_digest=digest_of_nodes(nodes),
        node_digests=nodes,
        num_layers=model.num_layers,
        workload=workload,
        reserve=reserve,
    )
