"""A stage node's persistent identity: one id per machine, device and port, kept across restarts.

The id lives in `<state dir>/node-<device>-<port>.json` with the fingerprint of the machine that
made it. A file made elsewhere (a cloned disk image, a copied home directory) is not trusted: the
node makes a new id, so clones never advertise the same one.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import socket
import tempfile
from datetime import datetime, timezone
from pathlib import Path

log = logging.getLogger(__name__)

MACHINE_ID_FILES = (Path("/etc/machine-id"), Path("/var/lib/dbus/machine-id"))
MAX_HOST_CHARS = 40  # hostname part of a made id; the whole id stays well under a 63-byte DNS label


def default_state_dir() -> Path:
    """$STATE_DIRECTORY (systemd's StateDirectory=, first if several), else $XDG_STATE_HOME/logicpipe,
    else ~/.local/state/logicpipe."""
    if first := os.environ.get("STATE_DIRECTORY", "").split(":")[0]:
        return Path(first)
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(Path.home(), ".local", "state")
    return Path(base) / "logicpipe"


def _label(text: str) -> str:
    """`text` with every character outside [A-Za-z0-9-] replaced by '-'."""
    return re.sub(r"[^A-Za-z0-9-]", "-", text)


def file_label(node_id: str) -> str:
    """`node_id` as part of a file name in the state dir: every character outside [A-Za-z0-9._-] as '_'."""
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in node_id)


def machine_fingerprint() -> str:
    """16 hex digits of sha256 over the machine id (when there is one) and the hostname."""
    machine_id = ""
    for path in MACHINE_ID_FILES:
        try:
            machine_id = path.read_text().strip()
        except OSError:
            continue
        if machine_id:
            break
    return hashlib.sha256(f"{machine_id}\n{socket.gethostname()}".encode()).hexdigest()[:16]


def _read(path: Path) -> dict | None:
    """The identity file's content, or None when there is none or it is unreadable as one."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError as e:  # bad JSON or bad UTF-8; other OSErrors (permissions) are raised
        log.warning("identity file %s is corrupt (%s); making a new node id", path, e)
        return None
    if not isinstance(data, dict) or not isinstance(data.get("node_id"), str) or not data["node_id"] \
            or not isinstance(data.get("machine"), str):
        log.warning("identity file %s is corrupt (no node_id or machine); making a new node id", path)
        return None
    return data


def _write_atomically(path: Path, data: dict, replace: bool = True) -> bool:
    """Write via a temp file in the same directory, so readers see old or new, never half: os.replace,
    or (`replace` False) a link that fails when the file exists, so of processes making it at the same
    moment (a node and its spare on a first start) the first wins. Whether this call's data is there."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        if replace:
            os.replace(tmp, path)
            return True
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        finally:
            Path(tmp).unlink(missing_ok=True)
        return True
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def node_identity(state_dir: Path, device: str, port: int) -> str:
    """The node id for this machine, device and port: read from the state dir, or made and kept there."""
    path = Path(state_dir) / f"node-{_label(device)}-{port}.json"
    machine = machine_fingerprint()
    data = _read(path)
    if data is not None and data["machine"] == machine:
        return data["node_id"]
    if data is not None:
        log.warning("identity file %s was made on another machine (%s, this is %s; a cloned disk?): "
                    "node id %s replaced", path, data["machine"], machine, data["node_id"])
    host = _label(socket.gethostname())[:MAX_HOST_CHARS].strip("-") or "node"
    node_id = f"{host}-{_label(device)}-{secrets.token_hex(4)}"
    created = datetime.now(timezone.utc).isoformat(timespec="seconds")
    if not _write_atomically(path, {"node_id": node_id, "machine": machine, "created": created},
                             replace=data is not None):
        made = _read(path)  # another process of this node made it first: its id is the node's
        if made is not None and made["machine"] == machine:
            return made["node_id"]
        _write_atomically(path, {"node_id": node_id, "machine": machine, "created": created})
    log.info("new node id %s (kept in %s)", node_id, path)
    return node_id
