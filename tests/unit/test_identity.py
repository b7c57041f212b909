"""A node's id survives restarts, differs per device and port, and is remade on a cloned disk."""
from __future__ import annotations

import json
import re

from logicpipe.stage_node.net import identity
from logicpipe.stage_node.net.identity import default_state_dir, machine_fingerprint, node_identity


def test_same_id_across_calls(tmp_path):
    first = node_identity(tmp_path, "cpu", 50061)
    assert node_identity(tmp_path, "cpu", 50061) == first
    assert re.fullmatch(r"[A-Za-z0-9-]+-cpu-[0-9a-f]{8}", first)
    kept = json.loads((tmp_path / "node-cpu-50061.json").read_text())
    assert kept["node_id"] == first and kept["machine"] == machine_fingerprint() and kept["created"]


def test_device_and_port_get_their_own_ids(tmp_path):
    ids = {node_identity(tmp_path, "cpu", 50061), node_identity(tmp_path, "cpu", 50062),
           node_identity(tmp_path, "cuda", 50061)}
    assert len(ids) == 3


def test_state_dir_is_created_private(tmp_path):
    state = tmp_path / "a" / "state"
    node_identity(state, "cpu", 1)
    assert state.stat().st_mode & 0o777 == 0o700
    assert [p.name for p in state.iterdir()] == ["node-cpu-1.json"]  # no temp file left behind


def test_file_from_another_machine_gets_a_new_id(tmp_path, monkeypatch):
    monkeypatch.setattr(identity, "machine_fingerprint", lambda: "aaaaaaaaaaaaaaaa")
    cloned = node_identity(tmp_path, "cpu", 50061)
    monkeypatch.setattr(identity, "machine_fingerprint", lambda: "bbbbbbbbbbbbbbbb")
    fresh = node_identity(tmp_path, "cpu", 50061)
    assert fresh != cloned
    assert node_identity(tmp_path, "cpu", 50061) == fresh  # rewritten: kept from now on
    assert json.loads((tmp_path / "node-cpu-50061.json").read_text())["machine"] == "bbbbbbbbbbbbbbbb"


def test_corrupt_file_gets_a_new_id(tmp_path):
    (tmp_path / "node-cpu-50061.json").write_text("{not json")
    made = node_identity(tmp_path, "cpu", 50061)
    assert node_identity(tmp_path, "cpu", 50061) == made
    (tmp_path / "node-cpu-50061.json").write_text('{"node_id": 3}')
    assert node_identity(tmp_path, "cpu", 50061) != made


def test_machine_fingerprint_is_stable_hex():
    assert re.fullmatch(r"[0-9a-f]{16}", machine_fingerprint())
    assert machine_fingerprint() == machine_fingerprint()


def test_machine_fingerprint_without_machine_id(tmp_path, monkeypatch):
    monkeypatch.setattr(identity, "MACHINE_ID_FILES", (tmp_path / "missing",))
    assert re.fullmatch(r"[0-9a-f]{16}", machine_fingerprint())


def test_default_state_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("STATE_DIRECTORY", f"{tmp_path}/one:{tmp_path}/two")
    assert default_state_dir() == tmp_path / "one"
    monkeypatch.delenv("STATE_DIRECTORY")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert default_state_dir() == tmp_path / "xdg" / "logicpipe"
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_state_dir() == tmp_path / "home" / ".local" / "state" / "logicpipe"


def test_two_first_starts_at_once_agree_on_one_id(tmp_path, monkeypatch):
    """A node and its spare (--spare) started together on a first boot: the one that makes the file second
    (it read no file, as both did) takes the first one's id instead of writing its own over it."""
    real_read = identity._read
    reads = []

    def read_then_lose_the_race(path):
        got = real_read(path)
        if not reads:  # the other process makes the file between this one's read and its write
            reads.append(path)
            identity._write_atomically(path, {"node_id": "made-first", "machine": machine_fingerprint(),
                                              "created": "then"}, replace=False)
        return got

    monkeypatch.setattr(identity, "_read", read_then_lose_the_race)
    assert node_identity(tmp_path, "cpu", 50061) == "made-first"
    assert json.loads((tmp_path / "node-cpu-50061.json").read_text())["node_id"] == "made-first"
    assert [p.name for p in tmp_path.iterdir()] == ["node-cpu-50061.json"]  # no temp file left
