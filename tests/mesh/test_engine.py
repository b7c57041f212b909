"""Mesh tier, the stage engine with real processes (a small random model of the default model's
tokenizer: what is tested is the engine): many requests on a small KV pool (queued, none
lost, each identical to itself alone), a full pipeline, micro-batches, and a controller killed
mid-request whose sessions the stages free within their TTL."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from logicpipe.v1 import controller_pb2, controller_pb2_grpc, stage_pb2, stage_pb2_grpc
from tests.localmesh import LocalMesh, client_transport

pytestmark = pytest.mark.mesh

TOPICS = ["the sea", "a lighthouse", "autumn leaves", "a lost key", "mountains", "a train at night", "bread",
          "a violin", "snow", "the moon", "an old map", "a garden"]


def prompts(n: int) -> list[tuple[str, int]]:
    """n (prompt, max_tokens) pairs of mixed lengths."""
    out = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        detail = " Mention colours, sounds and smells, and say why it matters to you." * (i % 4)
        out.append((f"Write a few lines about {topic}.{detail}", 6 + (i * 5) % 19))
    return out


def submit(address: str, prompt: str, max_tokens: int, **kw) -> list[int]:
    with client_transport().sync_channel(address, "controller") as ch:
        replies = controller_pb2_grpc.ControllerStub(ch).Submit(
            controller_pb2.SubmitRequest(prompt=prompt, max_tokens=max_tokens, **kw), timeout=600)
        return [t for r in replies for t in r.token_ids]


def stage_status(address: str) -> stage_pb2.StatusReply:
    with client_transport().sync_channel(address, "stage") as ch:
        return stage_pb2_grpc.StageNodeStub(ch).Status(stage_pb2.StatusRequest(), timeout=10)


def controller_status(address: str) -> controller_pb2.ControllerStatusReply:
    with client_transport().sync_channel(address, "controller") as ch:
        return controller_pb2_grpc.ControllerStub(ch).Status(controller_pb2.ControllerStatusRequest(), timeout=10)


def run_concurrently(address: str, work: list[tuple[str, int]], **kw) -> list[list[int]]:
    with ThreadPoolExecutor(len(work)) as pool:
        return list(pool.map(lambda pm: submit(address, pm[0], pm[1], **kw), work))


def test_16_requests_on_a_kv_pool_for_about_4_all_complete_identical_to_alone(chat_model, tmp_path):
    work = prompts(16)
    # 1 MiB per stage: 21 blocks of 16 positions of the 3 layers each stage holds, about 4 requests
    with LocalMesh(2, chat_model, tmp_path, threads=1, stage_args=("--max-kv-mib", "1")) as mesh:
        addr = mesh.controller_address
        alone = [submit(addr, p, n) for p, n in work]
        queued_seen = 0
        stop = threading.Event()

        def watch():
            nonlocal queued_seen
            while not stop.is_set():
                queued_seen = max(queued_seen, controller_status(addr).queued_requests)
                time.sleep(0.05)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            together = run_concurrently(addr, work)
        finally:
            stop.set()
            watcher.join()
        for (p, n), a, b in zip(work, alone, together):
            assert b == a, f"{p!r} (max {n}) differs when run among 15 others\n{mesh.logs()}"
        assert queued_seen > 0, "the pool never filled: the test does not test admission"
        for s in mesh.stage_addresses:
            st = stage_status(s)
            assert st.open_sessions == 0 and st.kv_blocks_used == 0
        assert controller_status(addr).completed_requests == 32


def test_8_concurrent_requests_fill_every_stage_of_3(chat_model, tmp_path):
    work = [(p, 24) for p, _ in prompts(8)]
    # (uniform: the planner would give a model this small fewer stages)
    with LocalMesh(3, chat_model, tmp_path, threads=1, controller_args=("--strategy", "uniform")) as mesh:
        before = [stage_status(s) for s in mesh.stage_addresses]
        out = run_concurrently(mesh.controller_address, work, ignore_eos=True)
        after = [stage_status(s) for s in mesh.stage_addresses]
        total = sum(len(o) for o in out)
        assert total == 8 * 24
        for b, a in zip(before, after):
            steps, seqs = a.steps - b.steps, a.seq_rows - b.seq_rows
            assert a.max_step_seqs > 1, f"{a.node_id} never stepped more than one sequence"
            assert steps < total / 2, f"{a.node_id}: {steps} steps for {total} tokens"
            assert seqs / steps > 2, f"{a.node_id}: {seqs / steps:.1f} sequences per step"
        assert controller_status(mesh.controller_address).micro_batches == 1  # three stages, one machine's cores


def test_micro_batches_split_the_active_sequences(chat_model, tmp_path):
    """With three micro-batches in flight, stage 0 steps about a third of the sequences at a time,
    and every request still gives exactly what it gives alone."""
    work = [(p, 20) for p, _ in prompts(9)]
    with LocalMesh(3, chat_model, tmp_path, threads=1, controller_args=("--micro-batches", "3", "--strategy", "uniform")) as mesh:
        addr = mesh.controller_address
        assert controller_status(addr).micro_batches == 3
        alone = [submit(addr, p, n, ignore_eos=True) for p, n in work]
        first = mesh.stage_addresses[[stage_status(s).stage_index for s in mesh.stage_addresses].index(0)]
        before = stage_status(first)
        together = run_concurrently(addr, work, ignore_eos=True)
        after = stage_status(first)
        assert together == alone
        per_step = (after.seq_rows - before.seq_rows) / (after.steps - before.steps)
        assert 1.5 <= per_step <= 4.0, f"stage 0 stepped {per_step:.1f} sequences at a time with 9 in 3 micro-batches"


def test_a_killed_controller_leaves_no_session_after_the_ttl(chat_model, tmp_path):
    ttl = 2.0
    with LocalMesh(2, chat_model, tmp_path, threads=1, stage_args=("--session-ttl-s", str(ttl))) as mesh:
        got = threading.Event()

        def long_request():
            try:
                with client_transport().sync_channel(mesh.controller_address, "controller") as ch:
                    for reply in controller_pb2_grpc.ControllerStub(ch).Submit(
                            controller_pb2.SubmitRequest(prompt="Tell me a long story.", max_tokens=2000,
                                                         ignore_eos=True), timeout=120):
                        if reply.token_ids:
                            got.set()
            except grpc.RpcError:
                pass  # the controller dies under it

        client = threading.Thread(target=long_request)
        client.start()
        assert got.wait(60), mesh.logs()
        mesh.kill("controller")
        client.join(30)
        killed = time.monotonic()
        steps_at_kill = [stage_status(s).steps for s in mesh.stage_addresses]
        while time.monotonic() - killed < ttl + 10:
            statuses = [stage_status(s) for s in mesh.stage_addresses]
            if all(st.open_sessions == 0 for st in statuses):
                break
            time.sleep(0.2)
        assert all(st.open_sessions == 0 and st.kv_blocks_used == 0 for st in statuses), mesh.logs()
        assert all(st.sessions_expired >= 1 for st in statuses)
        # nobody listened: generation stopped at once instead of running to 2000 tokens
        assert all(st.steps - s0 < 20 for st, s0 in zip(statuses, steps_at_kill))
