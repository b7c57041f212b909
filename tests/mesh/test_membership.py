"""Mesh tier, membership: nodes found by mDNS, a node joining mid-generation (one without the
model pulls its layers), a middle stage killed mid-generation and restarted, a node drained and a
node stopped under load, a restarted controller re-adopting running nodes. Every request must
end with exactly the tokens of a run without the change. The model is a small random one of the
default model's tokenizer (chat_model), its stages paced as a slower device (PACE), where what
is tested is membership, not the model."""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import grpc
import pytest

from logicpipe.stage_node.net.spare import ServingLock, lock_path
from logicpipe.v1 import controller_pb2, controller_pb2_grpc, stage_pb2, stage_pb2_grpc
from tests.localmesh import LocalMesh, client_transport, free_port, mesh_bundle, wait_serving

pytestmark = pytest.mark.mesh

PACE = ("--min-step-ms", "25")  # a step of the small model takes as long as one of a slow device: faults land mid-request
UNIFORM = ("--strategy", "uniform")  # every node a stage (the planner would give a model this small fewer)
# a repair after a fault (the survivors, 2 stages) is kept over the planner's 3-stage plan when it is predicted
# better by --replan-gain; on the loaded 2-core VM the two predictions (fewer hops, one survivor's measured
# speed) came 86 against 67 tok/s once and 78 against 67 before, so a node back was taken in or not by noise.
# With this gain it always is, as the restart test expects
BACK_IN = (*UNIFORM, "--replan-gain", "1.0")
PROMPT = "Write a long story about a lighthouse keeper and a storm."
# the generation a node joins: the join (its start, mDNS, the pull, the re-plan) lands by its ~22nd token of the
# default model on this 2-core VM under load (~5 tokens/s); 160 tokens cost ~30 s a generation, twice
LONG = 96
PROMPTS = [f"Tell me about {topic}." for topic in
           ("bread", "maps", "bridges", "owls", "tides", "clocks", "glass", "salt")]


class Generation(threading.Thread):
    """One Submit in a thread: its tokens as they come, and how it ended."""

    def __init__(self, address: str, prompt: str = PROMPT, max_tokens: int = 48, **sampling):
        super().__init__(daemon=True)
        self.address, self.error, self.tokens = address, None, []
        self.request = controller_pb2.SubmitRequest(prompt=prompt, max_tokens=max_tokens, ignore_eos=True,
                                                    sampling=stage_pb2.SamplingParams(**sampling))
        self.first_stages: list = []
        self.start()

    def run(self) -> None:
        try:
            with client_transport().sync_channel(self.address, "controller") as ch:
                for reply in controller_pb2_grpc.ControllerStub(ch).Submit(self.request, timeout=300):
                    self.tokens += reply.token_ids
                    self.first_stages = self.first_stages or list(reply.stages)
        except grpc.RpcError as exc:
            self.error = exc

    def wait_tokens(self, n: int, within: float = 120) -> None:
        deadline = time.monotonic() + within
        while len(self.tokens) < n:
            assert self.is_alive() and time.monotonic() < deadline, f"no {n} tokens ({self.error})"
            time.sleep(0.05)

    def result(self, within: float = 300) -> list[int]:
        self.join(within)
        assert not self.is_alive(), "the request did not finish"
        assert self.error is None, f"{self.error.code().name}: {self.error.details()}"
        return self.tokens


def until(check, what: str, within: float = 120) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, f"no {what} within {within:.0f} s"
        time.sleep(0.05)


def run(address: str, prompt: str = PROMPT, max_tokens: int = 48, **sampling) -> list[int]:
    return Generation(address, prompt, max_tokens, **sampling).result()


def stage_status(address: str) -> stage_pb2.StatusReply:
    with client_transport().sync_channel(address, "stage") as ch:
        return stage_pb2_grpc.StageNodeStub(ch).Status(stage_pb2.StatusRequest(), timeout=10)


def lpctl(mesh: LocalMesh, *args: str) -> str:
    out = subprocess.run([*mesh.lpctl(), *args],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_nodes_found_by_mdns_and_a_node_without_the_model_joins_mid_generation(model_dir, tmp_path):
    # the default model: for the small one a 4th stage is not worth a re-plan (the planner keeps the plan)
    with LocalMesh(3, model_dir, tmp_path, threads=1, mdns=True) as mesh:
        st = mesh.wait_plan(stages=3)
        assert {n.source for n in st.nodes} == {"mdns"}, st
        # twice LONG: the plan in force is replaced for a better one only once it has served HOLD_S (10 s), and
        # on a quiet machine LONG tokens twice over came within that, so the join's plan served after the end
        alone = run(mesh.controller_address, max_tokens=2 * LONG)
        # a 4th node with no model directory joins while a long greedy generation runs
        gen = Generation(mesh.controller_address, max_tokens=2 * LONG)
        gen.wait_tokens(5)
        mesh.start_stage(3, None, "--model-dir", str(tmp_path / "no-model-here"))
        st = mesh.wait_plan(stages=4, generation_above=st.plan_generation, timeout=120)
        assert gen.is_alive() and len(gen.tokens) < 2 * LONG, "the join came after the generation had finished"
        assert gen.result() == alone  # moved to the new plan by replaying its tokens: the same output
        assert "stage3 joined" in st.last_replan and 0 < st.last_replan_s < 60
        joined = next(s for s in st.stages if s.node_id == "stage3")
        assert stage_status(joined.address).weights_pulled_bytes > 0  # it had no model: it pulled its layers
        after = Generation(mesh.controller_address, max_tokens=8)
        after.result()
        assert [s.node_id for s in after.first_stages] == [s.node_id for s in st.stages]  # the new plan serves


def test_a_killed_middle_stage_is_replanned_around_and_comes_back(chat_model, tmp_path):
    with LocalMesh(3, chat_model, tmp_path, threads=1, controller_args=BACK_IN, stage_args=PACE,
                   stage_extra={0: ("--keep-spare",)}) as mesh:
        greedy = run(mesh.controller_address)
        sampled = run(mesh.controller_address, temperature=0.8, top_p=0.95, seed=11)
        assert greedy != sampled
        for expect, sampling in ((greedy, {}), (sampled, dict(temperature=0.8, top_p=0.95, seed=11))):
            before = mesh.controller_status()
            assert len(before.stages) == 3
            gen = Generation(mesh.controller_address, **sampling)
            gen.wait_tokens(12)
            t0 = time.monotonic()
            mesh.kill("stage1")
            n = len(gen.tokens)
            while len(gen.tokens) == n and gen.is_alive():
                time.sleep(0.01)
            resumed = time.monotonic() - t0
            assert gen.result() == expect  # a pause, not an error, and the same tokens
            st = mesh.controller_status()
            assert [s.node_id for s in st.stages] == ["stage0", "stage2"] and "lost" in st.last_replan
            assert resumed < 30, f"generation resumed {resumed:.1f} s after the kill"
            # restarted on its address, it is re-admitted without anyone doing anything
            mesh.start_stage(1, mesh.stage_addresses[1])
            mesh.wait_plan(stages=3, generation_above=st.plan_generation, timeout=60)
        # a spare process of the node (--spare: started up, waiting) serves the moment the killed one ends
        waiting = mesh.start_spare(1)
        spare_log = tmp_path / "stage1-spare.log"
        # (its log is opened by the forked process: not there at once)
        until(lambda: spare_log.exists() and "waiting to take over" in spare_log.read_text(), "the spare's start")
        # imported at idle priority (SCHED_IDLE), it waits on the normal policy, every thread of it
        assert {os.sched_getscheduler(int(t)) for t in os.listdir(f"/proc/{waiting.pid}/task")} == {os.SCHED_OTHER}
        # a second process for the node without --spare is refused at once (its own port: the lock refuses it)
        _, dup, dup_log = mesh.spawn_stage(1, None, name="stage1-dup")
        assert dup.wait(120) == 2 and "is served by another process" in dup_log.read_text()
        del mesh.procs["stage1-dup"]
        st = mesh.controller_status()
        gen = Generation(mesh.controller_address)
        gen.wait_tokens(12)
        killed = mesh.procs["stage1"].pid
        mesh.kill("stage1")
        spare = mesh.promote_spare(1)
        assert gen.result() == greedy
        assert f"pid {killed}) ended; taking over" in spare_log.read_text()
        assert (tmp_path / "state1" / "serving-stage1.lock").read_text().strip() == str(spare.pid)
        mesh.wait_plan(stages=3, generation_above=st.plan_generation, timeout=60)
        # stage0 runs --keep-spare: its keeper forked the serving process and a spare; the serving one
        # SIGKILLed mid-generation, the spare serves and the keeper forks the next spare
        keeper, lock0 = mesh.procs["stage0"].pid, ServingLock(lock_path(tmp_path / "state0", "stage0"))
        kids = {int(x) for x in open(f"/proc/{keeper}/task/{keeper}/children").read().split()}
        serving0 = lock0.holder()
        assert len(kids) == 2 and serving0 in kids, (kids, serving0)
        st = mesh.controller_status()
        gen = Generation(mesh.controller_address)
        gen.wait_tokens(12)
        os.kill(serving0, signal.SIGKILL)
        assert gen.result() == greedy
        (spare0,) = kids - {serving0}
        until(lambda: f"process {serving0} ended (SIGKILL)" in (tmp_path / "stage0.log").read_text(), "the keeper's fork")
        assert f"its spare {spare0} took over" in (tmp_path / "stage0.log").read_text() and lock0.holder() == spare0
        mesh.wait_plan(stages=3, generation_above=st.plan_generation, timeout=60)
        # a restarted controller re-adopts the running nodes, which keep their weights
        pids = {name: p.pid for name, p in mesh.procs.items() if name.startswith("stage")}
        mesh.signal("controller", signal.SIGTERM)
        mesh.procs["controller"].wait(30)
        mesh.start_controller()
        assert run(mesh.controller_address) == greedy
        assert {name: p.pid for name, p in mesh.procs.items() if name.startswith("stage")} == pids
        assert all(p.poll() is None for name, p in mesh.procs.items() if name.startswith("stage"))
        assert "keeping layers" in (tmp_path / "stage0.log").read_text()


def test_drain_and_sigterm_under_eight_concurrent_requests_lose_nothing(chat_model, tmp_path):
    with LocalMesh(3, chat_model, tmp_path, threads=1, controller_args=UNIFORM, stage_args=PACE) as mesh:
        address = mesh.controller_address
        alone = [g.result() for g in [Generation(address, p, 40) for p in PROMPTS]]
        # drain the middle stage while eight requests run
        gens = [Generation(address, p, 40) for p in PROMPTS]
        for g in gens:
            g.wait_tokens(2)
        out = lpctl(mesh, "drain", "stage1")
        assert "stage1 drained" in out
        assert [g.result() for g in gens] == alone
        st = mesh.controller_status()
        assert [s.node_id for s in st.stages] == ["stage0", "stage2"]
        assert {n.node_id: n.drained for n in st.nodes}["stage1"] and "drained" in lpctl(mesh, "nodes")
        lpctl(mesh, "undrain", "stage1")
        st = mesh.wait_plan(stages=3, timeout=60)
        # SIGTERM on a stage while eight requests run: it hands its work over, then exits
        gens = [Generation(address, p, 40) for p in PROMPTS]
        for g in gens:
            g.wait_tokens(2)
        mesh.signal("stage2", signal.SIGTERM)
        assert [g.result() for g in gens] == alone
        assert mesh.procs["stage2"].wait(40) == 0
        assert "left the mesh" in (tmp_path / "stage2.log").read_text()
        st = mesh.controller_status()
        assert [s.node_id for s in st.stages] == ["stage0", "stage1"]
        # planned around when it said it was stopping (its exit, noticed after, may make the last re-plan)
        assert "because node stage2 is stopping" in (tmp_path / "controller.log").read_text()


def test_a_node_registers_itself_and_a_duplicate_id_is_refused(model_dir, tmp_path):
    with LocalMesh(1, model_dir, tmp_path, threads=1) as mesh:
        mesh.start_stage(1, None, "--controller", mesh.controller_address)
        st = mesh.wait_plan(stages=2, timeout=90)
        assert {n.node_id: n.source for n in st.nodes}["stage1"] == "registered"
        # another process calling itself stage1 is refused, and says so
        dup = f"127.0.0.1:{free_port()}"
        proc, log = mesh._spawn("dup", ["-m", "logicpipe.stage_node.main", "--listen", dup, "--node-id", "stage1",
                                        "--threads", "1", "--no-mdns", "--controller", mesh.controller_address,
                                        "--state-dir", str(tmp_path / "dup-state"),
                                        *(["--tls-dir", str(mesh_bundle("stage1", "stage"))] if mesh.tls else [])])
        wait_serving(dup, proc, log, transport=mesh.transport)
        deadline = time.monotonic() + 30
        while "refused this node" not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        assert "already taken" in log.read_text()
        assert len(mesh.controller_status().stages) == 2
