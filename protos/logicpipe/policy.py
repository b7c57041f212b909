"""Who may call what, once the mesh runs over mutual TLS.

Every party holds a certificate of the mesh's CA that states its role (controller, stage or
client) and its name (a stage's node id). A dialer checks that its peer holds the role it expects
by the DNS name "<role>.logicpipe" in the peer's certificate; a server checks the caller's role
against the tables below (logicpipe.common.interceptors.RoleCheck)."""
from __future__ import annotations

CONTROLLER, STAGE, CLIENT = "controller", "stage", "client"
ROLES = (CONTROLLER, STAGE, CLIENT)
DOMAIN = "logicpipe"


def role_host(role: str, name: str = "") -> str:
    """The DNS name a certificate of `role` (and `name`) carries: "<role>.logicpipe", "<name>.<role>.logicpipe"."""
    return f"{name}.{role}.{DOMAIN}" if name else f"{role}.{DOMAIN}"


STAGE_POLICY: dict[str, frozenset[str]] = {
    "Assign": frozenset({CONTROLLER}), "OpenSession": frozenset({CONTROLLER}), "CloseSession": frozenset({CONTROLLER}),
    "Events": frozenset({CONTROLLER}), "MeasureLink": frozenset({CONTROLLER}), "Revoked": frozenset({CONTROLLER}),
    "Release": frozenset({CONTROLLER}),  # a holder that stops ends its lease at once
    "Stream": frozenset({CONTROLLER, STAGE}),  # the controller's prompts (stage 0) and the previous stage's steps
    "Echo": frozenset({CONTROLLER, STAGE}), "Status": frozenset({CONTROLLER, STAGE, CLIENT}),
    "SendKv": frozenset({CONTROLLER}),  # disaggregated prefill: the controller asks the prefill pipeline's stage ...
    "ImportKv": frozenset({STAGE}),     # ... which sends the KV to the decode pipeline's stage
    "SetMirror": frozenset({CONTROLLER}),  # KV mirrors: the controller names a stage's mirror targets ...
    "PutBlocks": frozenset({STAGE}),       # ... to which it copies its sequences' full KV blocks
}
"""Who may call each StageNode method."""

CONTROLLER_POLICY: dict[str, frozenset[str]] = {
    "Submit": frozenset({CLIENT}), "Plan": frozenset({CLIENT}), "Drain": frozenset({CLIENT}),
    "Status": frozenset({CONTROLLER, STAGE, CLIENT}),
    "Register": frozenset({STAGE}), "Leave": frozenset({STAGE}), "PullWeights": frozenset({STAGE}),
    "CreateJoinToken": frozenset({CLIENT}), "Revoke": frozenset({CLIENT}),
    "Resume": frozenset({CLIENT}), "Replicate": frozenset({CONTROLLER}),  # a standby controller follows the active
    "Join": frozenset(),  # served on the bootstrap port only (--join-listen), authenticated by a token
}
"""Who may call each Controller method."""

KEY_HEADER = "lp-controller-key"
"""Call metadata a controller sends on its calls to stages: a secret of its process. A stage
knows its holder by it (with the certificate's name over TLS; alone in plaintext, where the owner
id on sessions is no secret). See stage_node.fence."""

STREAM_KEY_HEADER = "lp-stream-key"
"""Call metadata of a stage's Stream calls: its plan's stream key (AssignRequest.stream_key)."""
