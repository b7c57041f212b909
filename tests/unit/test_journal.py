"""Durable requests without a mesh: the journal on disk (batches, restart, bound, another model,
one controller per journal), the scheduler journaling and restoring requests and resuming their
readers, the replay cap that counts a request's own failures and not the mesh's re-plans, an
OpenSession whose plan is replaced under it, and the stages' fencing of replaced controllers."""
from __future__ import annotations

import asyncio
import errno
import json
import os
import shutil
import sqlite3
import subprocess

import grpc
import pytest

from logicpipe.controller.jobs import journal_files as files
from logicpipe.controller.jobs.journal import FLUSH_S, Journal, JournalError
from logicpipe.controller.mesh.pipeline import Pipeline, StageHandle
from logicpipe.controller.mesh.pipelines import PipelineSet
from logicpipe.controller.jobs.job import Job
from logicpipe.controller.jobs.scheduler import MAX_REPLAYS, Scheduler, SchedulerConfig
from logicpipe.controller.mesh.state import MeshState, Phase
from logicpipe.errors import InvalidArgument, ResourceExhausted, Unavailable, code_number
from logicpipe.v1 import stage_pb2

from .fake_pipeline import FakePipeline, until


def test_the_journal_keeps_requests_and_their_token_batches_across_a_restart(tmp_path):
    async def main():
        j = Journal(tmp_path, "digest-a").open()
        j.start()
        j.admit("r1", {"prompt": [1, 2]}, 1)
        j.admit("r2", {"prompt": [3]}, 2)
        j.tokens("r1", 0, [5, 6])
        j.tokens("r1", 2, [7])
        j.tokens("r1", 9, [8])  # not the continuation: not kept
        j.drop("r2")
        await asyncio.sleep(0.2)  # the writer commits in the background
        assert j.rows() == 1
        j.close_now()  # as a SIGKILL leaves it: no final flush
        again = Journal(tmp_path, "digest-a").open()
        assert list(again.entries) == ["r1"] and again.entries["r1"].tokens == [5, 6, 7]
        assert again.entries["r1"].job == {"prompt": [1, 2]}
        again.close_now()

    asyncio.run(main())


def test_a_journal_of_another_model_is_not_resumed_and_one_controller_holds_it(tmp_path):
    j = Journal(tmp_path, "digest-a").open()
    j.admit("r1", {}, 1)
    j.flush()
    with pytest.raises(JournalError, match="another controller"):
        Journal(tmp_path, "digest-a").open()
    j.close_now()
    other = Journal(tmp_path, "digest-b").open()
    assert other.entries == {} and other.dropped_on_open == ["r1"]
    other.close_now()


def scheduler(journal: Journal) -> tuple[Scheduler, FakePipeline]:
    pipe = FakePipeline()
    pipelines = PipelineSet(None, lambda ev: None, lambda a, r: None)
    pipelines.all = [pipe]
    sched = Scheduler(pipelines, MeshState(Phase.READY), SchedulerConfig(1024, frozenset({0}), 100), journal=journal)
    return sched, pipe


def tokens(sched: Scheduler, req, ids, finished=False):
    sched.on_event(stage_pb2.Event(session_id=req.session_id, token=stage_pb2.TokenEvent(
        token_ids=ids, index=len(req.received), finished=finished, finish_reason="length" if finished else "")))


def test_a_request_is_journaled_restored_and_resumed_from_the_tokens_its_client_holds():
    async def main():
        journal = Journal(None, "d")
        sched, pipe = scheduler(journal)
        handle = sched.submit(Job((1, 2, 3), 6, request_id="abc"))
        req = handle.request
        await until(lambda: req.session_id, "opened")
        assert journal.entries["abc"].job["prompt"] == [1, 2, 3]
        tokens(sched, req, [4, 5])
        tokens(sched, req, [6])
        assert journal.entries["abc"].tokens == [4, 5, 6]
        # the controller dies: a new one restores the journal's requests
        sched2, pipe2 = scheduler(journal)
        assert sched2.restore(list(journal.entries.values())) == 1
        r2 = sched2.find("abc")
        await until(lambda: r2.session_id, "re-opened")
        assert list(pipe2.opened[0].prompt_token_ids) == [1, 2, 3, 4, 5, 6] and pipe2.opened[0].generated == 3
        got = []

        async def read():
            async for u in sched2.attach("abc").updates(start=2):  # the client holds 2 tokens
                got.append(u.token_id)

        reader = asyncio.create_task(read())
        await asyncio.sleep(0.05)
        tokens(sched2, r2, [7, 8, 9], finished=True)
        await asyncio.wait_for(reader, 5)
        assert got == [6, 7, 8, 9]
        assert "abc" not in journal.entries  # delivered to the end: out of the journal
        assert sched2.find("abc") is None

    asyncio.run(main())


def test_the_replay_cap_counts_a_requests_own_failures_not_the_meshs_re_plans():
    async def main():
        sched, pipe = scheduler(Journal(None, "d"))
        req = sched.submit(Job((1, 2), 50)).request
        unavailable = stage_pb2.SessionError(code=code_number(grpc.StatusCode.UNAVAILABLE), message="stage gone")
        for _ in range(3 * MAX_REPLAYS):  # a storm of re-plans: each moves it; none is its failure
            await until(lambda: req.session_id, "opened")
            tokens(sched, req, [1])
            sched.detach_all()
        assert req.error is None and req.replays == 3 * MAX_REPLAYS
        for n in range(MAX_REPLAYS + 1):  # its own sequence fails again and again with no token between
            await until(lambda: req.session_id or req.error, "opened")
            if req.error:
                break
            sched.on_event(stage_pb2.Event(session_id=req.session_id, error=unavailable))
            if n == MAX_REPLAYS // 2:  # ... a token between starts the count again
                await until(lambda: req.session_id, "opened")
                tokens(sched, req, [2])
        assert req.error is None
        for _ in range(MAX_REPLAYS + 1):
            await until(lambda: req.session_id or req.error, "opened")
            if req.error:
                break
            sched.on_event(stage_pb2.Event(session_id=req.session_id, error=unavailable))
        assert isinstance(req.error, Unavailable) and "in a row" in str(req.error)

    asyncio.run(main())


def test_an_open_whose_plan_is_replaced_meanwhile_is_unavailable_not_a_crash():
    """The CancelledError race: the old plan's channels close while OpenSession waits on them."""
    async def main():
        pipe = Pipeline(transport=None, on_event=lambda ev: None, on_stage_lost=lambda a, r: None)

        class Stub:
            async def OpenSession(self, request, timeout):
                pipe.stages = [StageHandle("new:1", None, Stub2())]  # a re-plan replaces the stages ...
                pipe.generation += 1
                raise asyncio.CancelledError()                        # ... and closes this channel

            async def CloseSession(self, request, timeout):
                return stage_pb2.CloseSessionReply()

        class Stub2(Stub):
            pass

        pipe.stages = [StageHandle("old:1", None, Stub()), StageHandle("old:2", None, Stub())]
        with pytest.raises(Unavailable, match="left the plan"):
            await pipe.open_session(stage_pb2.OpenSessionRequest(session_id="s"))

    asyncio.run(main())


def test_a_job_is_journaled_by_its_named_fields_and_older_journals_still_read():
    from logicpipe.sampling import SamplingParams

    job = Job((5, 6, 7), 9, SamplingParams(0.7, 40, 0.9, 123, 0.5, -0.25, ((3, 1.5),)), stop_ids=frozenset({2, 0}),
              speculate=3, prefill_chunk=64, request_id="x", top_logprobs=2, sequence=1, stop=("END",), api="chat",
              client="alice", grammar='{"type": "object"}', prompt_only=True)
    doc = job.to_json()
    assert doc["sampling"]["seed"] == 123 and doc["client"] == "alice" and "meta" not in doc
    assert Job.from_json(json.loads(json.dumps(doc))) == job
    older = {"prompt": [5, 6, 7], "max_tokens": 9, "sampling": [0.7, 40, 0.9, 123], "stop_ids": [0, 2],
             "speculate": 3, "chunk": 64, "meta": {"stop": ["END"], "api": "chat", "client": "alice"},
             "top_logprobs": 2, "prompt_logprobs": None}
    old = Job.from_json(older)
    assert (old.sampling.seed, old.sampling.presence_penalty, old.stop, old.api, old.client, old.prefill_chunk) == \
        (123, 0.0, ("END",), "chat", "alice", 64)


def test_the_traffic_is_learned_in_powers_of_two_and_a_change_is_reported():
    async def main():
        sched, _ = scheduler(Journal(None, "d"))
        said = []
        sched.on_traffic = said.append
        handles = [sched.submit(Job((1, 2, 3), 4)) for _ in range(3)]
        wl = sched.traffic.workload(2048, 4096)
        assert (wl.batch, wl.context_tokens) == (4, 8)  # 3 at once -> 4; 3 + 4 tokens -> 8
        assert said == ["the traffic changed: up to 2 requests at once", "the traffic changed: up to 4 requests at once"]
        for h in handles:
            h.release()

    asyncio.run(main())


# ---- no silent loss: damage found at start, a full state directory, every --state-dir mistake ------
def killed_copy(src, dst) -> None:
    """What a SIGKILL leaves: the journal's files as they are while it is open (WAL not checkpointed)."""
    dst.mkdir()
    for name in (files.MAIN, files.WAL, files.EPOCH_FILE):
        if (src / name).exists():
            shutil.copy(src / name, dst / name)


def written(tmp_path, n: int = 3):
    """A journal with n requests and their tokens at epoch 3, its files as a SIGKILL leaves them in `dead`."""
    live = tmp_path / "live"
    j = Journal(live, "d").open()
    j.set_epoch(3)
    for i in range(n):
        j.admit(f"r{i}", {"prompt": list(range(200))}, i + 1)
        j.tokens(f"r{i}", 0, [7, 8, 9])
    j.flush()
    dead = tmp_path / "dead"
    killed_copy(live, dead)
    j.close_now()
    return dead


def test_a_journal_killed_whole_resumes_everything_and_raises_no_alarm(tmp_path):
    dead = written(tmp_path)
    assert (dead / files.WAL).stat().st_size > 32 and files.find_damage(dead) == []
    j = Journal(dead, "d").open()
    assert sorted(j.entries) == ["r0", "r1", "r2"] and j.epoch == 3 and j.damage == "" and not j.epoch_lost
    j.close_now()


def damage_wal(d):
    with open(d / files.WAL, "r+b") as f:  # a byte of the first frame's page
        f.seek(32 + 24 + 100)
        b = f.read(1)
        f.seek(32 + 24 + 100)
        f.write(bytes([b[0] ^ 0xFF]))


def truncate_main(d):
    j = Journal(d, "d").open()  # checkpointed at close: everything in the main file, no WAL
    j.close_now()
    size = (d / files.MAIN).stat().st_size
    assert size >= 2 * 4096
    os.truncate(d / files.MAIN, size // 2 // 4096 * 4096)


def bad_header(d):
    with open(d / files.MAIN, "r+b") as f:
        f.write(b"not a journal at all")


def schema_mismatch(d):
    db = sqlite3.connect(d / files.MAIN)
    db.execute("ALTER TABLE requests RENAME TO requests_v0")
    db.commit()
    db.close()


def emptied(d):
    os.truncate(d / files.MAIN, 0)
    (d / files.WAL).unlink()


@pytest.mark.parametrize("damage,found", [(damage_wal, "damaged WAL"), (truncate_main, "truncated"),
                                          (bad_header, "bad header"), (schema_mismatch, "schema mismatch"),
                                          (emptied, "missing or empty")])
def test_a_damaged_journal_is_moved_aside_and_reported_and_its_epoch_is_kept(tmp_path, caplog, damage, found):
    dead = written(tmp_path)
    damage(dead)
    j = Journal(dead, "d").open()
    assert j.entries == {} and j.epoch == 3 and not j.epoch_lost  # empty, said so, and not back at epoch 1
    assert found in j.damage and "moved aside" in j.damage and "epoch (3) is kept" in j.damage
    aside = files.damaged_copies(dead)
    assert len(aside) == 1 and (aside[0] / files.MAIN).exists() and found in (aside[0] / "why.txt").read_text()
    assert any(r.levelname == "ERROR" and found in r.getMessage() for r in caplog.records)
    j.close_now()
    again = Journal(dead, "d").open()  # reported on every start until the operator deals with the copy
    assert again.epoch == 3 and "1 damaged journal(s) kept aside" in again.damage
    again.close_now()


def test_a_damaged_journal_whose_epoch_file_is_gone_says_the_epoch_was_lost(tmp_path):
    dead = written(tmp_path)
    (dead / files.EPOCH_FILE).unlink()
    damage_wal(dead)
    j = Journal(dead, "d").open()
    assert j.entries == {} and j.epoch_lost and "fencing epoch was lost" in j.damage
    j.close_now()


def test_every_state_dir_mistake_is_one_line_naming_the_fix(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    for d, says in ((afile, "is a file, not a directory"), (afile / "sub", "not a directory")):
        with pytest.raises(JournalError, match=says) as e:
            Journal(d, "d").open()
        assert "--state-dir" in str(e.value) and "\n" not in str(e.value)
    ro, full = tmp_path / "ro", tmp_path / "full"
    ro.mkdir()
    full.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(ro)], check=True)
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(full)], check=True)
        try:
            with pytest.raises(JournalError, match="read-only file system: give --state-dir a writable directory"):
                Journal(ro, "d").open()
            fill(full / "filler")
            with pytest.raises(JournalError, match=f"^{full} is full .*: free space there, or give --state-dir"):
                Journal(full, "d").open()
        finally:
            subprocess.run(["umount", str(full)], check=True)
    finally:
        subprocess.run(["umount", str(ro)], check=True)


journal_log = "logicpipe.controller.jobs.journal"


def fill(path) -> None:
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(bytes(4096))
        except OSError as exc:
            assert exc.errno == errno.ENOSPC


def test_a_full_state_dir_refuses_requests_fails_those_not_durable_and_recovers(tmp_path, caplog):
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=768k", "tmpfs", str(mnt)], check=True)

    opened: list[Journal] = []

    async def main():
        journal = Journal(mnt, "d").open()
        opened.append(journal)
        journal.start()
        sched, pipe = scheduler(journal)
        first = sched.submit(Job(tuple(range(1, 50)), 4, request_id="durable"))
        await until(lambda: journal.rows() == 1, "committed")  # (rows() waits for a commit under way)
        fill(mnt / "filler")
        caught = []
        journal.on_lost.append(lambda ids, err: caught.append(ids))
        late = sched.submit(Job(tuple(i % 100 for i in range(900)), 4, request_id="late"))  # admitted before the disk said full
        with pytest.raises(ResourceExhausted, match=f"journal in {mnt} cannot be written.*free space"):
            async for _ in late:
                pass
        assert caught == [["late"]] and sched.find("late") is None
        with pytest.raises(ResourceExhausted, match="new requests are refused"):
            sched.submit(Job((1, 2), 4, request_id="refused"))
        assert journal.state().startswith("failing: ") and "durable" in journal.entries
        await asyncio.sleep(4 * FLUSH_S * 2 ** 3)  # several retries, backing off
        errors = [r for r in caplog.records if r.name == journal_log and r.levelname == "ERROR"]
        assert len(errors) == 1, [r.getMessage() for r in errors]  # once per state change, not each retry
        (mnt / "filler").unlink()
        await until(lambda: journal.failure is None, "written again", tries=1000)
        sched.submit(Job((1, 2), 4, request_id="after")).release()
        assert journal.state().startswith("ok")
        await journal.close()
        again = Journal(mnt, "d").open()
        opened.append(again)
        assert "durable" in again.entries and "late" not in again.entries
        first.release()

    try:
        asyncio.run(main())
    finally:
        for j in opened:
            j.close_now()
        subprocess.run(["umount", str(mnt)], check=True)


def test_the_controllers_status_and_lpctl_status_report_a_damaged_journal(tmp_path):  # (imports: the app is heavy)
    from logicpipe.common.transport import PLAINTEXT
    from logicpipe.controller.api.service import status_reply
    from logicpipe.controller.app import ControllerApp
    from logicpipe.controller.cli.lpctl import status_lines
    from tests.unit.test_newcomer_errors import tiny_model

    dead = written(tmp_path)
    damage_wal(dead)
    journal = Journal(dead, "d")
    app = ControllerApp(tiny_model(tmp_path / "m"), [], transport=PLAINTEXT, journal=journal)
    journal.open(app.digest)
    try:
        reply = status_reply(app.snapshot())
        assert reply.journal == f"ok ({dead})" and "damaged WAL" in reply.journal_damage
        lines = status_lines(reply)
        assert f"journal: ok ({dead}); 0 requests, fencing epoch 3" in lines
        assert any(line.startswith("JOURNAL DAMAGED: ") and "moved aside" in line for line in lines), lines
    finally:
        journal.close_now()


def test_an_outline_request_is_journaled_as_what_runs_it_again_and_resumed_by_its_client_only():
    from logicpipe.controller.jobs.outline_door import held_points
    from logicpipe.controller.jobs.outline import outline_record, run_of_record
    from logicpipe.sampling import SamplingParams

    def tokenizer(text, add_special_tokens=False):
        return {"input_ids": [5]}

    journal = Journal(None, "d")
    sched, pipe = scheduler(journal)
    doc = outline_record("why is the sky blue?", outline_text="", max_points=3, point_tokens=9,
                         sampling=SamplingParams(0.8, 0, 1.0, 42), sequential=False, speculate=None, client="c1",
                         prompt_tokens=7)
    journal.admit("o1", json.loads(json.dumps(doc)), 0)  # as the journal stores it: JSON
    run = run_of_record(sched, tokenizer, journal.entries["o1"].job)
    assert (run.question, run.max_points, run.point_tokens, run.sampling.seed, run.sampling.temperature) == \
        ("why is the sky blue?", 3, 9, 42, 0.8)
    assert sched.restore(list(journal.entries.values())) == 0 and sched.find("o1") is None  # not a plain Job
    assert held_points(5, (2, 0, 3)) == {0: 2, 2: 3} and held_points(0, ()) == {}
    for have, points in ((4, ()), (5, (1, 1)), (1, (1,) * 40)):
        with pytest.raises(InvalidArgument):
            held_points(have, points)
