"""Who may steer a stage (stage_node.fence): the holder and its lease (a fake clock), a takeover
only after the lease expired with the holder's epoch + 1 (over TLS by the holder's certificate or
its standby's), revoked certificates, and the fence kept across a restart."""
from __future__ import annotations

import pytest

from logicpipe.errors import Fenced, PermissionDenied
from logicpipe.policy import KEY_HEADER
from logicpipe.stage_node.net.fence import Caller, Fence

A, B = Caller("ctl-a", "ka"), Caller("ctl-b", "kb")


class Clock:
    """A fake monotonic clock: the lease logic without waiting."""

    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def fence(tls: bool = True, **kw) -> tuple[Fence, Clock]:
    clock = Clock()
    return Fence("n1", tls=tls, lease_s=3.0, clock=clock, **kw), clock


def test_caller_is_known_by_certificate_name_and_key_digest():
    c = Caller.of("ctl", [("user-agent", "x"), (KEY_HEADER, "secret")])
    assert c.name == "ctl" and c.key and "secret" not in c.key
    assert Caller.of("ctl", [(KEY_HEADER, "secret")]) == c != Caller.of("ctl", [(KEY_HEADER, "other")])
    assert Caller.of("", None) == Caller()


def test_a_takeover_needs_the_lease_expired_and_exactly_the_next_epoch():
    f, clock = fence()
    f.take(A, "a", 3, standby="ctl-b")        # unheld: the first controller holds it
    for epoch in (3, 4, 2**62):               # the holder alive: no epoch takes it, however large
        with pytest.raises(Fenced, match="lease runs 3.0 s more" if epoch > 3 else "was replaced"):
            f.take(B, "b", epoch)
    clock.t += 2.5
    f.renew(A)                                # the holder's Status probe renews its lease
    clock.t += 2.5
    with pytest.raises(Fenced, match="lease"):
        f.take(B, "b", 4)
    assert not f.renew(B) and f.lease_left() == pytest.approx(0.5)  # anyone else's probe renews nothing
    clock.t += 1.0                            # the holder silent for 3.5 s: its lease expired
    for epoch in (5, 2**62):                  # ... still only the journal's next epoch
        with pytest.raises(Fenced, match="only with epoch 4"):
            f.take(B, "b", epoch)
    with pytest.raises(Fenced, match="was replaced"):
        f.take(B, "b", 3)
    f.take(B, "b", 4)                         # the standby takes over
    assert (f.epoch, f.controller_id, f.holder.caller, f.lease_left()) == (4, "b", B, 3.0)
    with pytest.raises(Fenced):               # the old active, resumed, is refused (and steps down)
        f.take(A, "a", 3)


def test_a_checked_call_of_the_holder_renews_its_lease_and_an_invalid_check_takes_nothing():
    f, clock = fence()
    f.take(A, "a", 1, standby="ctl-b")
    for _ in range(5):
        clock.t += 2.0
        f.check(A, "sessions")                # OpenSession, prompts, Events renew it
    f.may_take(A, "a", 1)                     # may_take holds nothing
    with pytest.raises(Fenced):
        f.may_take(B, "b", 2)
    assert f.holder.caller == A and f.lease_left() == 3.0


def test_over_tls_only_the_holders_certificate_or_its_standbys_takes_over():
    f, clock = fence()
    f.take(A, "a", 1, standby="ctl-b")
    clock.t += 10
    rogue = Caller("ctl-rogue", "kr")         # a valid controller certificate, not named
    with pytest.raises(PermissionDenied, match="only its own certificate 'ctl-a' or its standby's 'ctl-b'"):
        f.take(rogue, "r", 2)
    restarted = Caller("ctl-a", "a new process key")
    f.take(restarted, "a2", 2)                # the holder started again on its journal
    clock.t += 10
    with pytest.raises(PermissionDenied, match="names no standby"):  # the restarted one named none
        f.take(B, "b", 3)


def test_in_plaintext_a_live_holder_is_never_displaced_whatever_epoch_is_claimed():
    a, rogue = Caller("", "ka"), Caller("", "rogue")
    f, clock = fence(tls=False)
    f.take(a, "a", 1)
    with pytest.raises(Fenced, match="lease"):
        f.take(rogue, "a", 2)                 # the holder's owner id is no secret
    clock.t += 2.9
    f.check(a, "prompts")
    clock.t += 2.9
    with pytest.raises(Fenced, match="lease"):
        f.take(rogue, "r", 2)
    clock.t += 0.2
    with pytest.raises(Fenced, match="only with epoch 2"):
        f.take(rogue, "r", 2**63)
    f.take(rogue, "r", 2)                     # the holder gone: the next epoch serves
    assert f.holder.caller == rogue


def test_only_the_holder_subscribes_opens_and_streams_prompts():
    f, _ = fence()
    f.check(B, "Events subscriptions")        # nobody holds it: tests and tools drive it by hand
    f.take(A, "a", 1)
    f.check(A, "Events subscriptions")
    with pytest.raises(PermissionDenied, match="only from the controller that holds it"):
        f.check(B, "Events subscriptions")
    with pytest.raises(PermissionDenied):
        f.check(Caller("ctl-a", "another process"), "sessions")
    with pytest.raises(PermissionDenied, match="none does yet"):
        fence()[0].check_holder(A, "MeasureLink")


def test_revoking_the_holder_frees_the_node():
    f, _ = fence()
    f.take(A, "a", 1)
    f.set_revoked(["ctl-a"])                  # the holder was revoked: it holds nothing from now on
    assert f.holder is None and "ctl-a" in f and "" not in f
    for call in (lambda: f.take(A, "a", 2**64 - 1), lambda: f.check(A, "Events subscriptions")):
        with pytest.raises(PermissionDenied, match="revoked"):
            call()
    f.take(B, "b", 1)                         # the real controller takes it at once, lease or not
    assert f.holder.caller == B and f.epoch == 1
    assert not f.set_revoked(["ctl-a"]) and f.set_revoked([])


def test_the_fence_and_the_revocations_outlive_a_restart(tmp_path):
    path = tmp_path / "fence-n1.json"
    f = Fence("n1", path, tls=True)
    f.take(A, "a", 7, standby="ctl-b")
    f.set_revoked(["mallory"])
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    again = Fence("n1", path, tls=True)
    assert (again.epoch, again.controller_id, again.holder.caller, "mallory" in again) == (7, "a", A, True)
    assert again.holder.standby == "ctl-b" and again.lease_left() > 0  # a restarted node gives the holder a lease
    with pytest.raises(Fenced):
        again.take(B, "b", 6)                 # an older controller does not get a restarted node
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
    Fence("n1", path, tls=True).take(A, "a", 3)
    restarted = Fence("n1", stage_main.fence_file(default_state_dir(), "n1"), tls=True)
    assert (restarted.epoch, restarted.controller_id) == (3, "a")
    with pytest.raises(Fenced):
        restarted.take(B, "b", 2)


def test_a_holder_that_releases_ends_its_lease_now_and_only_the_holder_may():
    """Release (a controller that stops): the next epoch takes over at once, by the same rules as
    after an expired lease; nobody else can end the holder's lease; its own later calls do not
    renew it; its next Assign holds the node again."""
    f, clock = fence()
    f.take(A, "a", 3, standby="ctl-b")
    assert not f.release(B, "b") and not f.release(A, "other-id")  # not the holder: nothing changes
    with pytest.raises(Fenced, match="lease"):
        f.may_take(B, "b", 4)
    assert f.release(A, "a") and f.lease_left() == 0
    f.check(A, "sessions")                    # its calls while it stops renew nothing
    assert not f.renew(A) and f.lease_left() == 0
    with pytest.raises(Fenced, match="epoch 4"):
        f.may_take(B, "b", 7)                 # the epoch rule stands
    with pytest.raises(PermissionDenied):
        f.may_take(Caller("ctl-x", "kx"), "x", 4)  # so does the certificate rule
    f.take(A, "a", 3, standby="ctl-b")        # the holder again (its restart on the same key): a live lease
    assert f.lease_left() == 3.0
    f.release(A, "a")
    f.take(B, "b", 4)                         # its standby, at once
    assert f.holder.controller_id == "b" and f.lease_left() == 3.0
