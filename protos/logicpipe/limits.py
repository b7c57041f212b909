"""Caps every process applies to what crosses the wire: one message's size, one id's length and
characters, the shape of a host:port address."""
from __future__ import annotations

import ipaddress
import re

from logicpipe.errors import InvalidArgument

MAX_MESSAGE_BYTES = 64 * 2**20  # one gRPC message either way, bytes (every channel and server is set to it)
MAX_ID_CHARS = 256              # session ids, owners, node ids, token ids
MAX_HOST_CHARS = 253            # a DNS name at most (an IPv6 address with its zone is shorter)
MAX_ADDRESS_CHARS = MAX_HOST_CHARS + 2 + 6  # host (bracketed) + ":65535"
MAX_REQUEST_ID_CHARS = 64       # a client's request id (it names the request in a URL path and the journal)

# C0 and C1 controls, DEL, and the Unicode line and paragraph separators: none belongs in an id,
# and each can cut or forge a line of a log that quotes the id.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_REQUEST_ID = re.compile(r"[A-Za-z0-9._-]{1,%d}" % MAX_REQUEST_ID_CHARS)
REQUEST_ID_RULE = (f"1 to {MAX_REQUEST_ID_CHARS} of the characters A-Z a-z 0-9 . _ - (not '.' or '..' alone), "
                   "e.g. a UUID's hex")
_DNS_LABEL = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?$")
_ADDRESS_FORM = ("a port 1 to 65535 after an IPv4 address, a bracketed IPv6 address or a DNS name (10.0.0.5:50061, "
                 "[fe80::2]:50061, jetson-1.local:50061)")


def check_printable(what: str, value: str) -> str:
    """`value`, or InvalidArgument naming `what` and the first control character in it (NUL,
    a newline, ...)."""
    bad = _CONTROL.search(value)
    if bad is not None:
        raise InvalidArgument(f"{what} contains the control character {bad.group()!r} at index {bad.start()}; "
                              "use printable characters only")
    return value


def check_id(what: str, value: str, *, empty_ok: bool = False) -> str:
    """`value`, or InvalidArgument naming `what` when it is empty (unless `empty_ok`), too long or
    holds a control character."""
    if not value and not empty_ok:
        raise InvalidArgument(f"{what} is empty")
    if len(value) > MAX_ID_CHARS:
        raise InvalidArgument(f"{what} is {len(value)} characters, over the {MAX_ID_CHARS}-character cap")
    return check_printable(what, value)


def check_request_id(what: str, value: str) -> str:
    """`value`, or InvalidArgument naming `what` and REQUEST_ID_RULE: the one rule for a request
    id a client names, at every door (gRPC Submit and Resume, the HTTP X-Request-Id header and
    resume path), so an id admitted by one can always be resumed by another (it goes in a URL
    path as it is)."""
    if not _REQUEST_ID.fullmatch(value) or value in (".", ".."):
        shown = repr(value[:MAX_REQUEST_ID_CHARS]) + ("..." if len(value) > MAX_REQUEST_ID_CHARS else "")
        raise InvalidArgument(f"{what} {shown} ({len(value)} characters) is not a request id: give "
                              f"{REQUEST_ID_RULE}")
    return value


def _host_problem(host: str) -> str:
    """Why `host` is not an IPv4 address, a bracketed IPv6 address or a DNS name ("" when it is)."""
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return "the bracketed host is not an IPv6 address"
        return ""
    if ":" in host or "[" in host or "]" in host:
        return "an IPv6 host needs brackets, [addr]"
    name = host[:-1] if host.endswith(".") else host  # a fully qualified name may end in a dot
    if not name or len(name) > MAX_HOST_CHARS:
        return f"the host must be 1 to {MAX_HOST_CHARS} characters"
    labels = name.split(".")
    if labels[-1].isdigit():  # all digits at the end: meant as an IPv4 address (no DNS top level is numeric)
        try:
            ipaddress.IPv4Address(name)
        except ValueError:
            return "the host is not a valid IPv4 address"
        return ""
    if not all(_DNS_LABEL.match(label) for label in labels):
        return "the host is not a DNS name (dot-separated labels of letters, digits and '-', 1 to 63 each)"
    return ""


def check_address(what: str, value: str, *, empty_ok: bool = False) -> str:
    """`value`, or InvalidArgument naming `what` when it is not host:port (see _ADDRESS_FORM), is
    longer than MAX_ADDRESS_CHARS or empty (unless `empty_ok`)."""
    if not value:
        if empty_ok:
            return value
        raise InvalidArgument(f"{what} is empty; give host:port, {_ADDRESS_FORM}")
    if len(value) > MAX_ADDRESS_CHARS:
        raise InvalidArgument(f"{what} is {len(value)} characters, over the {MAX_ADDRESS_CHARS}-character cap of "
                              "a host:port address")
    check_printable(what, value)
    host, colon, port = value.rpartition(":")
    if not colon:
        problem = "no :port"
    elif not host:
        problem = "no host before the port"
    elif not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        problem = f"the port {port[:12]!r} is not a number from 1 to 65535"
    else:
        problem = _host_problem(host)
    if problem:
        raise InvalidArgument(f"{what} {value[:80]!r} is not host:port ({problem}); give {_ADDRESS_FORM}")
    return value
