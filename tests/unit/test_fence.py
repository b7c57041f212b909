"""Who may steer a stage (stage_node.fence): the holder, a takeover by a newer epoch (TLS) or of a
holder no longer connected (plaintext), revoked certificates, and the fence kept across a restart."""
from __future__ import annotations

import pytest

from logicpipe.errors import Fenced, PermissionDenied
from logicpipe.policy import KEY_HEADER
from logicpipe.stage_node.net.fence import Caller, Fence

A, B = Caller("ctl-a", "ka"), Caller("ctl-b", "kb")


def never(_: str) -> bool:
    return False


def always(_: str) -> bool:
    return True


def test_caller_is_known_by_certificate_name_and_key_digest():
    c = Caller.of("ctl", [("user-agent", "x"), (KEY_HEADER, "secret")])
    assert c.name == "ctl" and c.key and "secret" not in c.key
    assert Caller.of("ctl", [(KEY_HEADER, "secret")]) == c != Caller.of("ctl", [(KEY_HEADER, "other")])
    assert Caller.of("", None) == Caller()


def test_over_tls_a_newer_epoch_takes_over_and_an_older_controller_is_fenced():
    f = Fence("n1", tls=True)
    f.take(A, "a", 0, always)                 # unheld: the first controller holds it
    f.take(A, "a", 3, always)                 # the holder, newer epoch
    with pytest.raises(Fenced, match="FENCED"):
        f.take(B, "b", 3, never)              # the same epoch from another controller
    f.take(B, "b", 4, always)                 # a takeover, even while the holder is connected
    for caller, cid, epoch in ((A, "a", 3), (A, "a", 4), (A, "a", 0)):
        with pytest.raises(Fenced):
            f.take(caller, cid, epoch, never)
    assert (f.epoch, f.controller_id, f.holder.caller) == (4, "b", B)


def test_in_plaintext_a_connected_holder_is_never_displaced_whatever_epoch_is_claimed():
    a, rogue = Caller("", "ka"), Caller("", "rogue")
    f = Fence("n1", tls=False)
    f.take(a, "a", 1, never)
    with pytest.raises(Fenced, match="connected"):
        f.take(rogue, "a", 2**63, lambda cid: cid == "a")   # the holder's owner id is no secret
    assert f.holder.caller == a
    f.take(rogue, "r", 2, never)              # the holder is gone (its Events ended): someone must serve
    assert f.holder.caller == rogue


def test_only_the_holder_subscribes_opens_and_streams_prompts():
    f = Fence("n1", tls=True)
    f.check(B, "Events subscriptions")        # nobody holds it: tests and tools drive it by hand
    f.take(A, "a", 1, never)
    f.check(A, "Events subscriptions")
    with pytest.raises(PermissionDenied, match="only from the controller that holds it"):
        f.check(B, "Events subscriptions")
    with pytest.raises(PermissionDenied):
        f.check(Caller("ctl-a", "another process"), "sessions")


def test_a_revoked_certificate_is_refused_and_a_revoked_holder_replaced_at_once():
    f = Fence("n1", tls=True)
    f.take(A, "a", 2**63, never)              # a controller that claimed a huge epoch ...
    f.set_revoked(["ctl-a"])                  # ... and was revoked
    assert "ctl-a" in f and "" not in f
    for call in (lambda: f.take(A, "a", 2**64 - 1, never), lambda: f.check(A, "Events subscriptions")):
        with pytest.raises(PermissionDenied, match="revoked"):
            call()
    f.take(B, "b", 5, always)                 # the real controller is not fenced by the revoked one's epoch
    assert f.holder.caller == B and f.epoch == 5
    assert not f.set_revoked(["ctl-a"]) and f.set_revoked([])


def test_the_fence_and_the_revocations_outlive_a_restart(tmp_path):
    path = tmp_path / "fence-n1.json"
    f = Fence("n1", path, tls=True)
    f.take(A, "a", 7, never)
    f.set_revoked(["mallory"])
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    again = Fence("n1", path, tls=True)
    assert (again.epoch, again.controller_id, again.holder.caller, "mallory" in again) == (7, "a", A, True)
    with pytest.raises(Fenced):
        again.take(B, "b", 6, never)          # an older controller does not get a restarted node
    path.write_text("{not json")
    assert Fence("n1", path, tls=True).holder is None  # unreadable: logged, trusts the next controller


def test_a_stage_started_with_no_state_dir_flag_keeps_its_fence_across_a_restart(tmp_path, monkeypatch):
    """Where `logicpipe-stage` keeps the fence by default ($STATE_DIRECTORY, else the XDG state
    dir): a node restarted with the same flags still follows the controller of the highest epoch."""
    from logicpipe.stage_node import main as stage_main  # (torch: only here)
    from logicpipe.stage_node.net.identity import default_state_dir
    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path / "state"))
    assert stage_main.parse_args([]).state_dir is None
    path = stage_main.fence_file(default_state_dir(), "n1")
    assert path.parent == tmp_path / "state"
    Fence("n1", path, tls=True).take(A, "a", 3, never)
    restarted = Fence("n1", stage_main.fence_file(default_state_dir(), "n1"), tls=True)
    assert (restarted.epoch, restarted.controller_id) == (3, "a")
    with pytest.raises(Fenced):
        restarted.take(B, "b", 2, never)
