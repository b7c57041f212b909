"""Caps every process applies to what crosses the wire: one message's size, one id's length."""
from __future__ import annotations

from logicpipe.errors import InvalidArgument

MAX_MESSAGE_BYTES = 64 * 2**20  # one gRPC message either way, bytes (every channel and server is set to it)
MAX_ID_CHARS = 256              # session ids, owners, node ids, token ids


def check_id(what: str, value: str, *, empty_ok: bool = False) -> str:
    """`value`, or InvalidArgument naming `what` when it is empty (unless `empty_ok`) or too long."""
    if not value and not empty_ok:
        raise InvalidArgument(f"{what} is empty")
    if len(value) > MAX_ID_CHARS:
        raise InvalidArgument(f"{what} is {len(value)} characters, over the {MAX_ID_CHARS}-character cap")
    return value
