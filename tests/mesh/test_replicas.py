"""Mesh tier, replicas: nodes that each hold the model serve as pipelines of their own, and each
request runs on one. One mesh for every check (the suite's time): a node of one replica killed
under 8 concurrent requests (its requests replay on the other, which goes on meanwhile and replays
nothing), a node joining under load (it starts a replica and takes its share of the requests still
running, at most half, each replayed there exactly), a replica stopped (SIGSTOP) under load (its
requests move to the other at once instead of waiting for it), a node drained under load
(its replica's requests move). Every request ends with exactly the tokens it gives alone. The model
is the small random one of the default model's tokenizer (chat_model), its stages paced as a slower
device (PACE) so that faults and drains land mid-request: what is tested is routing, not the model."""
from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest

from logicpipe.v1 import controller_pb2, controller_pb2_grpc, stage_pb2, stage_pb2_grpc
from tests.localmesh import LocalMesh, client_transport

pytestmark = pytest.mark.mesh

PROMPTS = [f"Tell me about {topic}." for topic in ("bread", "maps", "bridges", "owls", "tides", "clocks", "glass", "salt")]
TOKENS = 40
PACE = ("--min-step-ms", "25")  # a step of the small model takes as long as one of a slow device


class Arrivals:
    """Every token any request received, in the order they came (a thread-safe log), with markers."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []  # (request name | "#marker", tokens in that reply)
        self._lock = threading.Lock()

    def add(self, name: str, n: int) -> None:
        with self._lock:
            self.log.append((name, n))

    def mark(self, what: str) -> int:
        with self._lock:
            self.log.append((f"#{what}", 0))
            return len(self.log) - 1


class Generation(threading.Thread):
    """One greedy Submit in a thread: its tokens, the nodes of the pipeline it first ran on."""

    def __init__(self, address: str, prompt: str, arrivals: Arrivals | None = None, name: str = ""):
        super().__init__(daemon=True)
        self.address, self.prompt, self.arrivals, self.label = address, prompt, arrivals, name or prompt
        self.tokens: list[int] = []
        self.nodes: list[str] = []
        self.error: grpc.RpcError | None = None
        self.start()

    def run(self) -> None:
        try:
            with client_transport().sync_channel(self.address, "controller") as ch:
                for reply in controller_pb2_grpc.ControllerStub(ch).Submit(controller_pb2.SubmitRequest(
                        prompt=self.prompt, max_tokens=TOKENS, ignore_eos=True), timeout=300):
                    self.nodes = self.nodes or [s.node_id for s in reply.stages]
                    self.tokens += reply.token_ids
                    if self.arrivals is not None and reply.token_ids:
                        self.arrivals.add(self.label, len(reply.token_ids))
        except grpc.RpcError as exc:
            self.error = exc

    def wait_tokens(self, n: int, within: float = 120) -> None:
        deadline = time.monotonic() + within
        while len(self.tokens) < n:
            assert self.is_alive() and time.monotonic() < deadline, f"no {n} tokens ({self.error})"
            time.sleep(0.02)

    def result(self, within: float = 300) -> list[int]:
        self.join(within)
        assert not self.is_alive(), "the request did not finish"
        assert self.error is None, f"{self.error.code().name}: {self.error.details()}"
        return self.tokens


def eventually(check, within: float, what: str):
    deadline = time.monotonic() + within
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} did not happen within {within:.0f} s"
        time.sleep(0.1)


def stage_sessions(address: str) -> int:
    """Sessions open on the stage at `address`."""
    with client_transport().sync_channel(address, "stage") as ch:
        return stage_pb2_grpc.StageNodeStub(ch).Status(stage_pb2.StatusRequest(), timeout=10).open_sessions


def burst(mesh: LocalMesh, arrivals: Arrivals | None = None) -> list[Generation]:
    """The 8 prompts at once, each producing before this returns."""
    gens = [Generation(mesh.controller_address, p, arrivals, f"r{i}") for i, p in enumerate(PROMPTS)]
    for g in gens:
        g.wait_tokens(2)
    return gens


def test_replicas_route_replay_on_a_fault_grow_on_a_join_and_move_on_a_drain(chat_model, tmp_path):
    with LocalMesh(2, chat_model, tmp_path, threads=1, controller_args=("--replicas", "auto"),
                   stage_args=PACE) as mesh:
        st = mesh.wait_plan(stages=2)
        assert len(st.pipelines) == 2, f"two nodes that each hold the model: a pipeline each, not {st}"
        assert {s.pipeline for s in st.stages} == {0, 1}
        alone = {p: Generation(mesh.controller_address, p).result() for p in PROMPTS}

        # -- 8 at once are spread over both pipelines; then a node of one replica is killed
        arrivals = Arrivals()
        replays = mesh.controller_status().replays
        gens = burst(mesh, arrivals)
        assert {tuple(g.nodes) for g in gens} == {("stage0",), ("stage1",)}, [g.nodes for g in gens]
        victims = {g.label for g in gens if g.nodes == ["stage0"]}
        survivors = {g.label for g in gens} - victims
        assert victims and survivors, [g.nodes for g in gens]
        killed = arrivals.mark("kill")
        mesh.kill("stage0")
        assert [g.result() for g in gens] == [alone[p] for p in PROMPTS]
        after = arrivals.log[killed + 1:]
        # the other replica went on while the lost one's requests waited for their replay (until the last
        # victim's first token: a quick replay may share the survivor's step, its token arriving first)
        resumed = max(next(i for i, (name, _) in enumerate(after) if name == v) for v in victims)
        assert sum(n for name, n in after[:resumed] if name in survivors) > 0, after[:resumed + 1]
        st = eventually(lambda: (s := mesh.controller_status()).replays - replays == len(victims) and s, 30,
                        "the victims' replays counted")
        assert st.replays - replays == len(victims), "only the lost replica's requests were replayed"
        assert [[s.node_id for s in st.stages]] == [["stage1"]] and len(st.pipelines) == 1

        # -- a node joining under load starts a replica of its own; nothing moves
        replays, generation = st.replays, st.plan_generation
        gens = burst(mesh)
        joined_at = mesh.start_stage(2, None, "--controller", mesh.controller_address)
        st = mesh.wait_plan(stages=2, generation_above=generation, timeout=120)
        assert [g.result() for g in gens] == [alone[p] for p in PROMPTS]
        assert sorted(s.node_id for s in st.stages) == ["stage1", "stage2"] and len(st.pipelines) == 2, st
        assert "stage2 joined" in st.last_replan
        # the replica that joined took its share of the requests still running then (issue 34: the
        # cheapest replays of the busier one), each replayed there exactly (the results above)
        def joins() -> list[int]:
            log = (mesh.workdir / "controller.log").read_text()
            return [int(line.split("; ")[-1].split()[0]) for line in log.splitlines()
                    if "joined the plan" in line and "running requests move onto it" in line]
        moved = eventually(joins, 30, "the join's moves")  # (KV mirrors: a moment after it joined)
        assert len(moved) == 1 and moved[0] <= len(PROMPTS) // 2, moved
        assert mesh.controller_status().replays == replays + moved[0], "a join moves only the requests it takes"

        # -- a replica stopped (SIGSTOP) for less than the stall grace: its requests do not wait for it, they
        #    move to the other one (issue 34: a silent replica), exactly; it stays in the plan, and after
        #    SIGCONT the moved requests' sessions are freed there
        arrivals = Arrivals()
        gens = burst(mesh, arrivals)
        before = mesh.controller_status()
        victims = {g.label for g in gens if g.nodes == ["stage2"] and len(g.tokens) < TOKENS}
        assert victims and len(victims) < len(gens), [(g.nodes, len(g.tokens)) for g in gens]
        stopped = arrivals.mark("stop")
        mesh.signal("stage2", signal.SIGSTOP)
        t0 = time.monotonic()
        try:  # stopped 3 s: found silent in 1 to 1.5 s, well within the stall grace (STALL_GRACE_S, 5 s)
            time.sleep(2.0)
            silent = [p.silent for p in mesh.controller_status().pipelines]
            time.sleep(max(0.0, 3.0 - (time.monotonic() - t0)))
            went_on = {name for name, n in arrivals.log[stopped + 1:] if n}
        finally:
            mesh.signal("stage2", signal.SIGCONT)
        assert victims <= went_on, f"requests of the stopped replica waited for it: {victims - went_on}"
        assert silent.count("stage2") == 1, silent
        assert [g.result() for g in gens] == [alone[p] for p in PROMPTS]
        st = mesh.controller_status()
        assert st.evacuated_requests - before.evacuated_requests >= len(victims), (st.evacuated_requests, victims)
        assert st.plan_generation == before.plan_generation and len(st.pipelines) == 2, st  # kept in the plan
        eventually(lambda: stage_sessions(joined_at) == 0, 30, "the stopped replica freeing the moved sessions")
        st = eventually(lambda: (s := mesh.controller_status()) and not any(p.silent for p in s.pipelines) and s, 10,
                        "the controller hearing the stopped replica again")  # (until then it takes no request)
        replays = st.replays

        # -- the new replica serves; then it is drained under load: its requests move to the other
        gens = burst(mesh)
        assert {tuple(g.nodes) for g in gens} == {("stage1",), ("stage2",)}, [g.nodes for g in gens]
        moved = [g for g in gens if g.nodes == ["stage2"]]
        with client_transport().sync_channel(mesh.controller_address, "controller") as ch:
            reply = controller_pb2_grpc.ControllerStub(ch).Drain(controller_pb2.DrainRequest(node="stage2"), timeout=120)
        assert "drained" in reply.message
        assert [g.result() for g in gens] == [alone[p] for p in PROMPTS]
        assert moved, [g.nodes for g in gens]
        st = eventually(lambda: (s := mesh.controller_status()).replays > replays and s, 30,
                        "the drained replica's requests replayed")
        assert [s.node_id for s in st.stages] == ["stage1"] and len(st.pipelines) == 1
