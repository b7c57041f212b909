"""A fork server for the test meshes' processes: `python -m tests.zygote` imports what the stage and
controller processes import (torch, transformers, gRPC: 3-5 s of CPU each start on this 2-core VM),
then forks a child for every `python -m MODULE ARGS...` it is asked for. The child is what that
command line would be (a session of its own, its environment, its output to its log, the module run
as __main__), minus the imports. The suite starts about a hundred such processes.

Protocol, one JSON line each way on stdin / stdout:
    -> {"module": ..., "args": [...], "env": {...}, "log": PATH, "cwd": DIR, "netns": NAME or null}
    <- {"pid": PID}                      (the child has its own session by then: killpg reaches it)
With "netns" the child joins that network namespace (/var/run/netns/NAME, tests.netns) first, as
`ip netns exec NAME` would run the command line: the split-brain test's controllers.
The zygote reaps its children and writes each one's exit status (Popen's returncode: -N for signal
N) to STATUS_DIR/PID, which `ZygoteProc` reads. It exits when its stdin closes.

Used by tests.localmesh when $LOGICPIPE_TEST_ZYGOTE=1 (tests/conftest.py sets it); the benchmarks
and anyone else using LocalMesh start real processes. A fork is only safe from one thread: should
the imports have started one, the zygote says so and LocalMesh starts processes itself."""
from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import json
import os
import random
import runpy
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path

PRELOAD = ("logicpipe.stage_node.main", "logicpipe.controller.main")  # the stage's first: it sets GOMP_SPINCOUNT
                                                                    # before torch loads
# ... and what their first model load imports lazily (transformers' config machinery and the tests' Llama
# configuration, the tokenizer's): about a second of CPU a process, paid once here instead
WARM = ("transformers.models.auto.configuration_auto", "transformers.modeling_rope_utils", "transformers.activations",
        "transformers.models.llama.configuration_llama", "transformers.tokenization_utils_tokenizers",
        "transformers.models.auto.tokenization_auto")


CLONE_NEWNET = 0x40000000  # setns(2)'s namespace type (os.setns and os.CLONE_NEWNET come with Python 3.12)


def join_netns(name: str) -> None:
    """Move this (single-threaded) process into network namespace `name`, as `ip netns exec` does."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def _child(request: dict, ready_w: int) -> None:
    """In the forked child: become the command line, run it, never return."""
    code = 1
    try:
        os.setsid()
        os.write(ready_w, b"1")
        os.close(ready_w)
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        if request.get("netns"):  # (a failure is in the log, which LocalMesh shows when the process ends)
            join_netns(request["netns"])
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        random.seed()  # not the zygote's sequence, shared by every child
        # (runpy's note that the module was imported before it ran as __main__: the zygote's preload)
        warnings.filterwarnings("ignore", message=".*found in sys.modules after import of package")
        sys.argv = [request["module"], *request["args"]]
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _reap(status_dir: Path) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        tmp = status_dir / f".{pid}"
        tmp.write_text(str(rc))
        tmp.rename(status_dir / str(pid))


def serve(status_dir: Path) -> None:
    for module in (*PRELOAD, *WARM):
        __import__(module)
    if threading.active_count() > 1:
        print(json.dumps({"error": f"{threading.active_count()} threads after the imports: forking is not safe"}),
              flush=True)
        return
    print(json.dumps({"ready": True}), flush=True)
    stdin = sys.stdin.buffer
    while True:
        _reap(status_dir)
        if not select.select([stdin], [], [], 0.05)[0]:
            continue
        line = stdin.readline()
        if not line:
            return
        request = json.loads(line)
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(ready_r)
            _child(request, ready_w)
        os.close(ready_w)
        os.read(ready_r, 1)  # its session is its own (or it died trying: then killpg finds nothing)
        os.close(ready_r)
        print(json.dumps({"pid": pid}), flush=True)


class ZygoteProc:
    """A child of the zygote, as much of subprocess.Popen as LocalMesh and the tests use."""

    def __init__(self, pid: int, args: list[str], status: Path):
        self.pid, self.args, self._status, self.returncode = pid, args, status, None

    def poll(self) -> int | None:
        if self.returncode is None and self._status.is_file():
            self.returncode = int(self._status.read_text())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """This process's fork server (one, started at the first spawn; gone when this process ends)."""

    _one: "Zygote | None" = None
    _failed = False

    def __init__(self):
        self.status_dir = Path(tempfile.mkdtemp(prefix="logicpipe-zygote-"))
        self.lock = threading.Lock()
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.zygote", str(self.status_dir)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     cwd=Path(__file__).resolve().parent.parent, env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
        hello = json.loads(self.proc.stdout.readline() or b'{"error": "the zygote died at start"}')
        if "error" in hello:
            self.close()
            raise RuntimeError(hello["error"])
        atexit.register(self.close)

    @classmethod
    def get(cls) -> "Zygote | None":
        """The fork server, or None where it cannot run (LocalMesh starts processes itself)."""
        if cls._one is None and not cls._failed:
            try:
                cls._one = Zygote()
            except (RuntimeError, OSError, ValueError) as exc:
                print(f"tests.zygote: not used ({exc})", file=sys.stderr)
                cls._failed = True
        return cls._one

    def spawn(self, module: str, args: list[str], env: dict[str, str], log: Path, netns: str | None = None) -> ZygoteProc:
        """`python -m module args...` forked, in network namespace `netns` if given (tests.netns)."""
        with self.lock:
            self.proc.stdin.write((json.dumps({"module": module, "args": list(args), "env": env, "log": str(log),
                                               "cwd": os.getcwd(), "netns": netns}) + "\n").encode())
            self.proc.stdin.flush()
            pid = json.loads(self.proc.stdout.readline())["pid"]
        return ZygoteProc(pid, [sys.executable, "-m", module, *args], self.status_dir / str(pid))

    def close(self) -> None:
        """Stops the zygote and removes its status directory (it left one in /tmp for every test run before)."""
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.status_dir, ignore_errors=True)


if __name__ == "__main__":
    serve(Path(sys.argv[1]))
