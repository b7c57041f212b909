"""Mesh tier, durability: a controller killed mid-generation comes back (as systemd would start it
again) and every client — lpctl, a gRPC client resuming by request id, an HTTP stream resuming
with Last-Event-ID — gets the rest, the same tokens as without the fault (greedy and seeded
sampling); a standby takes over when the active controller dies, the same; a storm of stage
faults (SIGKILL, SIGSTOP, SIGTERM, killed stages started again at once) loses no request and
changes no output. The model is the small random one of the default model's tokenizer (chat_model),
its stages paced as a slower device (PACE) so that every fault lands mid-request: what is tested is
durability, not the model."""
from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import shutil
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from logicpipe.v1 import controller_pb2, controller_pb2_grpc, stage_pb2, stage_pb2_grpc
from tests.localmesh import STOP_GRACE_S, LocalMesh, client_transport, free_port

pytestmark = pytest.mark.mesh

RESUME_S = 90.0  # how long the clients keep resuming


def submit(address: str, prompt: str, max_tokens: int, temperature: float = 0.0, seed: int | None = None,
           request_id: str = "") -> list[int]:
    """One request without faults: its tokens."""
    sampling = stage_pb2.SamplingParams(temperature=temperature)
    if seed is not None:
        sampling.seed = seed
    out = []
    with client_transport().sync_channel(address, "controller") as ch:
        for reply in controller_pb2_grpc.ControllerStub(ch).Submit(controller_pb2.SubmitRequest(
                prompt=prompt, max_tokens=max_tokens, ignore_eos=True, sampling=sampling, request_id=request_id),
                timeout=300):
            out += reply.token_ids
    return out


class GrpcClient(threading.Thread):
    """A client of the gRPC API that resumes by itself: on a broken stream it asks Resume(id, the
    tokens it holds) at each address in turn until one answers."""

    def __init__(self, addresses: list[str], prompt: str, max_tokens: int, temperature: float = 0.0,
                 seed: int | None = None):
        super().__init__(daemon=True)
        self.addresses, self.prompt, self.max_tokens = addresses, prompt, max_tokens
        self.sampling = stage_pb2.SamplingParams(temperature=temperature)
        if seed is not None:
            self.sampling.seed = seed
        self.id = f"grpc-{random.getrandbits(48):012x}"
        self.tokens: list[int] = []
        self.error: Exception | None = None
        self.resumes = 0
        self.producing = threading.Event()
        self.start()

    def run(self) -> None:
        deadline, resume, i = time.monotonic() + 300, False, 0
        while time.monotonic() < deadline:
            address = self.addresses[i % len(self.addresses)]
            try:
                with client_transport().sync_channel(address, "controller") as ch:
                    stub = controller_pb2_grpc.ControllerStub(ch)
                    if resume:
                        call = stub.Resume(controller_pb2.ResumeRequest(request_id=self.id,
                                                                        have_tokens=len(self.tokens)), timeout=300)
                    else:
                        call = stub.Submit(controller_pb2.SubmitRequest(
                            prompt=self.prompt, max_tokens=self.max_tokens, ignore_eos=True, sampling=self.sampling,
                            request_id=self.id), timeout=300)
                    for reply in call:
                        self.tokens += reply.token_ids
                        if len(self.tokens) >= 3:
                            self.producing.set()
                    self.producing.set()
                    return
            except grpc.RpcError as exc:
                gone = exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED) or (
                    exc.code() == grpc.StatusCode.FAILED_PRECONDITION and "standby" in (exc.details() or ""))
                if not gone:
                    self.error = exc
                    self.producing.set()
                    return
                resume, i = True, i + 1
                self.resumes += 1
                time.sleep(0.2)
        self.error = TimeoutError("never finished")
        self.producing.set()

    def result(self) -> list[int]:
        self.join(RESUME_S + 120)
        assert self.error is None, self.error
        return self.tokens


class HttpStream(threading.Thread):
    """A client of the HTTP API's streams (its own X-Request-Id) that resumes a broken stream with
    GET /v1/requests/{id}/stream and Last-Event-ID."""

    def __init__(self, address: str, prompt: str, max_tokens: int):
        super().__init__(daemon=True)
        self.address, self.prompt, self.max_tokens = address, prompt, max_tokens
        self.id = f"http-{random.getrandbits(48):012x}"
        self.text, self.last_id, self.finish, self.error = "", 0, None, None
        self.producing = threading.Event()
        self.start()

    def _read(self, response) -> None:
        event_id = None
        for raw in response:
            line = raw.decode().rstrip("\n")
            if line.startswith("id: "):
                event_id = int(line[4:])
            elif line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                self.text += choice["text"]
                self.finish = choice["finish_reason"] or self.finish
                self.last_id = event_id if event_id is not None else self.last_id
                if self.last_id >= 3:
                    self.producing.set()
            elif line == "data: [DONE]":
                return
        raise ConnectionError("the stream ended before [DONE]")

    def run(self) -> None:
        host, port = self.address.rsplit(":", 1)
        deadline, first = time.monotonic() + 300, True
        while time.monotonic() < deadline:
            conn = http.client.HTTPConnection(host, int(port), timeout=60)
            try:
                if first:
                    conn.request("POST", "/v1/completions", json.dumps({
                        "prompt": self.prompt, "max_tokens": self.max_tokens, "stream": True, "ignore_eos": True,
                        "temperature": 0}), {"Content-Type": "application/json", "X-Request-Id": self.id})
                else:
                    conn.request("GET", f"/v1/requests/{self.id}/stream", headers={"Last-Event-ID": str(self.last_id)})
                response = conn.getresponse()
                if response.status != 200:
                    body = response.read().decode()
                    if response.status in (502, 503):
                        raise ConnectionError(body)
                    self.error = AssertionError(f"HTTP {response.status}: {body}")
                    break
                first = False
                self._read(response)
                break
            except (OSError, http.client.HTTPException):
                time.sleep(0.2)
            finally:
                conn.close()
        self.producing.set()

    def result(self) -> str:
        self.join(RESUME_S + 120)
        assert self.error is None, self.error
        assert self.finish == "length", (self.finish, self.text)
        return self.text


def together(calls: dict) -> dict:
    """Each call's result, the calls run at once (a request's tokens are the same among others as
    alone: the engine's batch invariance, tests/mesh/test_engine.py)."""
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = {k: pool.submit(f) for k, f in calls.items()}
        return {k: f.result() for k, f in futures.items()}


def http_text(address: str, prompt: str, max_tokens: int) -> str:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                                        "ignore_eos": True}), {"Content-Type": "application/json"})
    body = json.loads(conn.getresponse().read())
    conn.close()
    return body["choices"][0]["text"]


def lpctl_submit(mesh: LocalMesh, controllers: str, prompt: str, max_tokens: int) -> subprocess.Popen:
    cmd = mesh.lpctl()
    cmd[cmd.index("--controller") + 1] = controllers
    return subprocess.Popen([*cmd, "--resume-s", str(RESUME_S), "submit", prompt, "--max-tokens", str(max_tokens),
                             "--ignore-eos", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def lpctl_outline(mesh: LocalMesh, prompt: str) -> subprocess.Popen:
    """An outline request (journaled too) by lpctl, which resumes it by point. Its outline is given
    (the small random model writes none that parses); its points are generated."""
    outline = mesh.workdir / "outline.txt"
    outline.write_text(OUTLINE)
    return subprocess.Popen([*mesh.lpctl(), "--resume-s", str(RESUME_S), "submit", prompt, "--outline-text",
                             str(outline), "--max-points", "2", "--max-tokens", "12", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def lpctl_output(proc: subprocess.Popen) -> tuple[str, str]:
    """What an lpctl process printed (stdout, stderr) once it exited 0 (killed if it hangs)."""
    try:
        out, err = proc.communicate(timeout=RESUME_S + 120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    return out, err


def outline_points(proc: subprocess.Popen) -> tuple[list[tuple[str, str]], str]:
    """An outline request's points as (title, text), and what lpctl said on stderr."""
    out, err = lpctl_output(proc)
    points = [(p["title"], p["text"]) for p in json.loads(out)["dag"]["points"]]
    assert points and all(text for _, text in points), out
    return points, err


def lpctl_tokens(proc: subprocess.Popen) -> tuple[list[int], str]:
    out, err = lpctl_output(proc)
    return json.loads(out)["token_ids"], err


PROMPTS = ["Tell me a very long story about a dragon.", "Describe every planet of the solar system.",
           "Write a poem about the sea.", "List the kings of France."]
N = 96  # tokens per request: long enough to be cut (PACE: about 4 s), short enough for CI
PACE = ("--min-step-ms", "40")  # a step of the small model takes as long as one of a slow device


def wait_producing(clients, mesh, lp=None) -> None:
    for c in clients:
        assert c.producing.wait(90), mesh.logs()
        assert c.error is None, c.error


OUTLINE_PROMPT = "How do I make tea?"
OUTLINE = "1. Boil the water.\n2. Steep the leaves. [1]"


def test_a_controller_killed_mid_generation_comes_back_and_every_client_gets_the_rest(chat_model, tmp_path):
    """... an outline request too; then, killed again, it finds its journal damaged and its state
    dir full: it says so (Status, lpctl status), keeps its epoch, and refuses what it cannot keep."""
    http_address = f"127.0.0.1:{free_port()}"
    try:
        with LocalMesh(2, chat_model, tmp_path, threads=1, controller_args=("--http", http_address),
                       stage_args=PACE) as mesh:
            controller_killed_then_damaged_then_full(mesh, http_address)
    finally:  # the small tmpfs mounted late in the test as the controller's state dir (every process stopped)
        small = tmp_path / "controller-state"
        if os.path.ismount(small) and subprocess.run(["umount", str(small)]).returncode:
            subprocess.run(["umount", "-l", str(small)], check=True)


def controller_killed_then_damaged_then_full(mesh: LocalMesh, http_address: str) -> None:
    addr = mesh.controller_address
    outline_ref = lpctl_outline(mesh, OUTLINE_PROMPT)
    ref = together({"greedy": lambda: submit(addr, PROMPTS[0], N), "sampled": lambda: submit(addr, PROMPTS[1], N, 0.9, seed=7),
                    "lpctl": lambda: submit(addr, PROMPTS[2], N), "http": lambda: http_text(http_address, PROMPTS[3], N)})
    ref["outline"], _ = outline_points(outline_ref)
    # the lpctl processes first: they take seconds to start on a loaded machine, and one that first
    # calls after the kill has nothing to resume (it fails, rightly: nothing listens)
    lp = lpctl_submit(mesh, addr, PROMPTS[2], N)
    outline = lpctl_outline(mesh, OUTLINE_PROMPT)
    greedy, sampled = GrpcClient([addr], PROMPTS[0], N), GrpcClient([addr], PROMPTS[1], N, 0.9, seed=7)
    stream = HttpStream(http_address, PROMPTS[3], N)
    wait_producing([greedy, sampled, stream], mesh)
    deadline = time.monotonic() + 90
    while mesh.controller_status().journaled < 5 and time.monotonic() < deadline:  # lpctl's two admitted too
        time.sleep(0.1)
    time.sleep(0.5)  # lpctl's tokens too
    mesh.kill("controller")  # SIGKILL: nothing runs on the way out
    assert len(greedy.tokens) < N and len(sampled.tokens) < N, "the requests finished before the kill"
    mesh.start_controller()  # what systemd does: the same flags, the same journal
    assert greedy.result() == ref["greedy"]
    assert sampled.result() == ref["sampled"]
    assert greedy.resumes and sampled.resumes
    assert stream.result() == ref["http"]
    tokens, err = lpctl_tokens(lp)
    assert tokens == ref["lpctl"], err
    assert "resum" in err, err
    points, err = outline_points(outline)
    assert "resum" in err, err  # it was cut by the kill, and run again for its client
    assert points == ref["outline"], err
    st = mesh.controller_status()
    assert st.role == "active" and st.journaled == 0, st  # finished requests leave the journal
    assert st.journal.startswith("ok (") and not st.journal_damage, st
    damaged_then_full(mesh, st.epoch)


def damaged_then_full(mesh: LocalMesh, epoch: int) -> None:
    """Killed again: its journal damaged (a bad header) and its state dir a small tmpfs: started
    again it reports the damage and keeps its epoch; filled up, it refuses what it cannot journal."""
    mesh.kill("controller")
    state = mesh.workdir / "controller-state"
    kept = mesh.workdir / "controller-state.kept"
    shutil.copytree(state, kept)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(state)], check=True)
    for f in kept.iterdir():
        shutil.copy(f, state / f.name)
    with open(state / "journal.sqlite3", "r+b") as f:
        f.write(b"this is no journal")
    mesh.start_controller()
    st = mesh.controller_status()
    assert "bad header" in st.journal_damage and "moved aside" in st.journal_damage, st
    assert st.epoch > epoch, st  # not back at 1: the epoch outlived the damaged journal
    lines = subprocess.run([*mesh.lpctl(), "status"], capture_output=True, text=True, timeout=60).stdout
    assert "JOURNAL DAMAGED: " in lines and f"fencing epoch {st.epoch}" in lines, lines
    with open(state / "filler", "wb", buffering=0) as f:  # the state dir full
        with contextlib.suppress(OSError):
            while True:
                f.write(bytes(4096))
    told = []
    for _ in range(2):  # the first is admitted and fails when its admission cannot be written; the next is refused
        with pytest.raises(grpc.RpcError) as e:
            submit(mesh.controller_address, PROMPTS[0], N)
        told.append(e.value)
    assert all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and str(state) in e.details() for e in told), told
    assert "new requests are refused" in told[-1].details(), told[-1].details()
    st = mesh.controller_status()
    assert st.journal.startswith("failing: ") and st.journaled == 0, st  # nothing served as if durable
    mesh.kill("controller")  # (its files open on the tmpfs: gone before it is unmounted)


def test_a_standby_takes_over_when_the_active_controller_dies(chat_model, tmp_path):
    mesh = LocalMesh(2, chat_model, tmp_path, threads=1, stage_args=PACE)
    a, b = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    secret = tmp_path / "peer.secret"  # Replicate serves only the standby that sends it
    secret.write_text("0123456789abcdef" * 2 + "\n")
    # over TLS both controllers hold the mesh's "controller" certificate: each names it as its standby's
    pair = ("--peer-secret-file", str(secret), "--standby-name", "controller")
    try:
        mesh.stage_addresses = mesh.start_stages()
        mesh.start_controller("--peer", b, *pair, address=a)
        mesh.start_controller("--peer", a, *pair, name="controller-b", address=b, ready=False)
        deadline = time.monotonic() + 30
        while mesh.controller_status(address=b).role != "standby" or not mesh.controller_status(address=b).active:
            assert time.monotonic() < deadline, mesh.logs()
            time.sleep(0.2)
        epoch = mesh.controller_status(address=a).epoch
        ref = together({"greedy": lambda: submit(a, PROMPTS[0], N), "sampled": lambda: submit(a, PROMPTS[1], N, 0.9, seed=11),
                        "lpctl": lambda: submit(a, PROMPTS[2], N)})
        greedy, sampled = GrpcClient([a, b], PROMPTS[0], N), GrpcClient([a, b], PROMPTS[1], N, 0.9, seed=11)
        lp = lpctl_submit(mesh, f"{a},{b}", PROMPTS[2], N)
        wait_producing([greedy, sampled], mesh)
        deadline = time.monotonic() + 90  # lpctl's request admitted too (it starts slowly on a loaded machine)
        while mesh.controller_status(address=a).journaled < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        with pytest.raises(grpc.RpcError) as refused:  # a standby takes no requests; it names the active one
            submit(b, PROMPTS[0], 4)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION and a in refused.value.details()
        mesh.kill("controller")
        t0 = time.monotonic()
        assert greedy.result() == ref["greedy"]
        assert sampled.result() == ref["sampled"]
        tokens, err = lpctl_tokens(lp)
        assert tokens == ref["lpctl"], err
        assert time.monotonic() - t0 < 60
        st = mesh.controller_status(address=b)
        assert st.role == "active" and st.epoch > epoch, st
        for s in mesh.stage_addresses:  # the stages follow the new active: the old one's epoch is refused
            with client_transport().sync_channel(s, "stage") as ch:
                assert stage_pb2_grpc.StageNodeStub(ch).Status(stage_pb2.StatusRequest(), timeout=5) \
                    .controller_epoch == st.epoch
        # the old active, started again as systemd would, finds B active and becomes its standby
        mesh.start_controller("--peer", b, *pair, address=a, ready=False)
        deadline = time.monotonic() + 30
        while mesh.controller_status(address=a).role != "standby":
            assert time.monotonic() < deadline, mesh.logs()
            time.sleep(0.2)
        assert mesh.controller_status(address=b).role == "active"
        # issue 34: the active (B) stopped: A takes over once B's lease on the stages expired; B,
        # continued, steps down at its first probe (it exits 75, as under systemd): one active
        def stage_epochs() -> set[int]:
            out = set()
            for s in mesh.stage_addresses:
                with client_transport().sync_channel(s, "stage") as ch:
                    out.add(stage_pb2_grpc.StageNodeStub(ch).Status(stage_pb2.StatusRequest(), timeout=5)
                            .controller_epoch)
            return out

        mesh.signal("controller-b", signal.SIGSTOP)
        try:  # until the stages follow A (A reports active a moment before its Assigns reach them)
            deadline = time.monotonic() + 60
            while mesh.controller_status(address=a).role != "active" or min(stage_epochs()) <= st.epoch:
                assert time.monotonic() < deadline, mesh.logs()
                time.sleep(0.2)
        finally:
            mesh.signal("controller-b", signal.SIGCONT)
        deadline = time.monotonic() + 30
        while True:
            try:
                b_active = mesh.controller_status(address=b).role == "active" and \
                    mesh.procs["controller-b"].poll() is None
            except grpc.RpcError:
                b_active = False
            if not b_active:
                break
            assert time.monotonic() < deadline, mesh.logs()
            time.sleep(0.2)
        assert mesh.procs["controller-b"].wait(30) == 75, mesh.logs()  # it stepped down, fenced
        assert mesh.controller_status(address=a).role == "active"
        assert submit(a, PROMPTS[0], N) == ref["greedy"]
    finally:
        mesh.stop()


def test_a_storm_of_stage_faults_loses_no_request_and_changes_no_output(chat_model, tmp_path):
    """20 faults, 1.5 s apart and every 4th 0.3 s after the one before: SIGKILL (the stage started
    again at once), SIGSTOP for 3 s, SIGTERM (started again once it has left); four clients submit
    requests one after another all along. Every request finishes, with the tokens it gives alone."""
    rng = random.Random(22)
    with LocalMesh(3, chat_model, tmp_path, threads=1, controller_args=("--strategy", "uniform"),
                   stage_args=PACE) as mesh:
        addr = mesh.controller_address
        ref = together({p: (lambda p=p: submit(addr, p, 40)) for p in PROMPTS})
        results: list[tuple[str, list[int] | Exception]] = []
        storming = threading.Event()
        storming.set()

        def client(k: int) -> None:
            i = k
            while storming.is_set():
                p = PROMPTS[i % len(PROMPTS)]
                try:
                    results.append((p, submit(addr, p, 40)))
                except grpc.RpcError as exc:
                    results.append((p, exc))
                i += 1

        clients = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(4)]
        for c in clients:
            c.start()
        restarting: dict[int, threading.Thread] = {}

        def restart(i: int, proc) -> None:
            proc.wait(60)
            mesh.start_stage(i, mesh.stage_addresses[i])

        kinds = [signal.SIGKILL, signal.SIGSTOP, signal.SIGTERM]
        try:
            for n in range(20):
                time.sleep(0.3 if n % 4 == 3 else 1.5)
                live = [i for i in range(3) if not (i in restarting and restarting[i].is_alive())]
                if not live:
                    continue
                i, sig = rng.choice(live), kinds[n % 3]
                name = f"stage{i}"
                mesh.signal(name, sig)
                if sig == signal.SIGSTOP:
                    threading.Timer(3.0, mesh.signal, (name, signal.SIGCONT)).start()
                else:
                    restarting[i] = threading.Thread(target=restart, args=(i, mesh.procs[name]), daemon=True)
                    restarting[i].start()
        finally:
            storming.clear()
            time.sleep(3.5)
            for i in range(3):
                mesh.signal(f"stage{i}", signal.SIGCONT)
        for t in restarting.values():
            t.join(120)
        for c in clients:
            c.join(240)
        assert results, mesh.logs()
        lost = [(p, r) for p, r in results if isinstance(r, Exception)]
        assert not lost, f"{len(lost)} of {len(results)} requests lost: {lost[:3]}\n{mesh.logs(4000)}"
        changed = [p for p, r in results if r != ref[p]]
        assert not changed, f"{len(changed)} of {len(results)} outputs changed"
        assert mesh.controller_status().state == "ready"
        time.sleep(STOP_GRACE_S / 10)
