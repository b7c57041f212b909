"""llama.cpp with its layers on ggml RPC servers: the peer bench.rpc_bench measures the mesh against.

llama-cpp-python 0.3.x has no `rpc_servers` argument, so this goes through its low-level API, as
llama.cpp's own `--rpc HOST:PORT,...` does: every server is added (`ggml_backend_rpc_add_server`)
and registered, and the model is loaded with `llama_model_params.devices` naming their devices, in
order, every layer offloaded (`n_gpu_layers` all), split by layer (`tensor_split`, from
`tensor_split()` so that device k gets exactly the decoder layers asked for and the last one the
output layer too). The input layer (the token embeddings) stays in this process, as llama.cpp
always keeps it on the CPU; the logits come back here, where the next token is their argmax.

`RpcServers` starts the servers (bench/ggml_rpc_server.py, one process each, under a command
prefix such as `ip netns exec NS`) and stops them; `RpcLlama` is the client.
"""
from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

from bench.ggml_rpc_server import wheel_lib_dir

SERVER = Path(__file__).with_name("ggml_rpc_server.py")
READY_TIMEOUT_S = 30.0  # a server must accept a connection within this
STOP_GRACE_S = 5.0      # SIGTERM, then SIGKILL after this
PLACEMENT = re.compile(r"layer\s+(\d+) assigned to device (\S+),")  # llama.cpp's load_tensors debug line


def tensor_split(layers: list[int]) -> list[float]:
    """`llama_model_params.tensor_split` weights that give device k exactly `layers[k]` decoder layers,
    and the last device the output layer as well, all layers offloaded.

    llama.cpp (load_tensors) gives slot il (decoder layers 0..n-1, then the output layer n) to the
    first device whose cumulative share of the weights exceeds il / (n + 1); every boundary is put half
    a slot below the first slot of the next device, so float rounding cannot move a layer."""
    n = sum(layers)
    cuts = [c - 0.5 for c in itertools.accumulate(layers[:-1])] + [n + 1]  # cumulative, in slots
    return [b - a for a, b in zip([0.0, *cuts[:-1]], cuts)]


def layer_devices(split: list[float], n_layer: int) -> list[int]:
    """The device llama.cpp gives each slot (decoder layers, then the output layer) for `split`, every
    layer offloaded: its rule in load_tensors, float32 like it (the reference tensor_split is tested on)."""
    total = np.float32(sum(np.float32(w) for w in split))
    bounds = [np.float32(c) / total for c in itertools.accumulate(np.float32(w) for w in split)]
    out = []
    for il in range(n_layer + 1):
        x = np.float32(il) / np.float32(n_layer + 1)
        out.append(next((k for k, b in enumerate(bounds) if b > x), len(bounds)))  # std::upper_bound
    return out


def proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) process `pid` has used so far."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


class RpcServers:
    """One ggml RPC server process per (endpoint, command prefix); stopped on exit, also after a failure."""

    def __init__(self, endpoints: list[str], prefixes: list[list[str]], threads: int, logdir: Path):
        self.endpoints = endpoints
        self.prefixes = prefixes
        self.threads = threads  # CPU threads of each server's compute
        self.logdir = logdir
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> "RpcServers":
        try:
            for i, (endpoint, prefix) in enumerate(zip(self.endpoints, self.prefixes)):
                with open(self.logdir / f"rpc{i}.log", "ab") as log:
                    self.procs.append(subprocess.Popen(
                        [*prefix, sys.executable, str(SERVER), "--endpoint", endpoint, "--threads", str(self.threads)],
                        stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            for i, endpoint in enumerate(self.endpoints):
                self._wait_accepting(i, endpoint)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_accepting(self, i: int, endpoint: str) -> None:
        host, port = endpoint.rsplit(":", 1)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.procs[i].poll() is not None:
                log = (self.logdir / f"rpc{i}.log").read_text()
                raise RuntimeError(f"RPC server {endpoint} exited:\n{log[-2000:]}")
            with contextlib.suppress(OSError), socket.create_connection((host, int(port)), timeout=1):
                return
            time.sleep(0.2)
        raise TimeoutError(f"RPC server {endpoint} not accepting after {READY_TIMEOUT_S:.0f} s")

    def cpu_s(self) -> list[float]:
        """CPU seconds each server has used so far."""
        return [proc_cpu_s(p.pid) for p in self.procs]

    def stop(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(STOP_GRACE_S)


class RpcLlama:
    """A GGUF model split by layer over RPC servers; greedy decoding of one or several sequences."""

    def __init__(self, gguf: Path, endpoints: list[str], layers: list[int], threads: int, seq_tokens: int):
        import llama_cpp  # optional (the `bench` extra)

        self.lc = llama_cpp
        self.threads = threads        # CPU threads of this process's part (the input layer)
        self.seq_tokens = seq_tokens  # the most tokens a sequence holds: prompt and new tokens
        self.log: list[str] = []      # llama.cpp's log lines while the model loaded
        self._loading = True
        self._log_cb = llama_cpp.llama_log_callback(self._on_log)  # kept: C holds only a pointer
        llama_cpp.llama_log_set(self._log_cb, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        devices = [self._add_server(e) for e in endpoints]
        self._devices = (ctypes.c_void_p * (len(devices) + 1))(*devices, None)  # NULL-terminated
        self.split = tensor_split(layers)
        self._split = (ctypes.c_float * llama_cpp.LLAMA_MAX_DEVICES)(*self.split)
        params = llama_cpp.llama_model_default_params()
        params.devices = ctypes.addressof(self._devices)
        params.n_gpu_layers = 1_000_000  # all, the output layer included
        params.split_mode = llama_cpp.LLAMA_SPLIT_MODE_LAYER
        params.tensor_split = self._split
        self.model = llama_cpp.llama_model_load_from_file(str(gguf).encode(), params)
        if not self.model:
            raise RuntimeError("llama.cpp could not load the model over RPC:\n" + "".join(self.log[-20:]))
        self._loading = False
        self.vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self._contexts: dict[int, tuple] = {}

    def _on_log(self, level: int, text: bytes, user_data) -> None:
        line = text.decode(errors="replace")
        if self._loading:
            self.log.append(line)
        if level == 3:  # GGML_LOG_LEVEL_ERROR
            print(line, end="", file=sys.stderr)

    def _add_server(self, endpoint: str) -> int:
        """Add and register RPC server `endpoint`; its (first) device."""
        lib = wheel_lib_dir()
        ggml, base, rpc = (ctypes.CDLL(str(lib / f"{n}.so")) for n in ("libggml", "libggml-base", "libggml-rpc"))
        rpc.ggml_backend_rpc_add_server.argtypes = [ctypes.c_char_p]
        rpc.ggml_backend_rpc_add_server.restype = ctypes.c_void_p
        ggml.ggml_backend_register.argtypes, ggml.ggml_backend_register.restype = [ctypes.c_void_p], None
        base.ggml_backend_reg_dev_get.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        base.ggml_backend_reg_dev_get.restype = ctypes.c_void_p
        reg = rpc.ggml_backend_rpc_add_server(endpoint.encode())
        if not reg:
            raise RuntimeError(f"llama.cpp could not reach RPC server {endpoint}")
        ggml.ggml_backend_register(reg)
        return base.ggml_backend_reg_dev_get(reg, 0)

    def placement(self) -> dict[str, int]:
        """Slots (decoder layers and the output layer) per device, as llama.cpp logged them at load."""
        return dict(Counter(m.group(2) for line in self.log if (m := PLACEMENT.search(line))))

    def _context(self, n_seq: int, prompt_tokens: int):
        """(context, batch) for `n_seq` sequences of up to `seq_tokens` tokens; made once per n_seq."""
        if n_seq not in self._contexts:
            lc = self.lc
            params = lc.llama_context_default_params()
            params.n_ctx = n_seq * self.seq_tokens
            params.n_batch = params.n_ubatch = max(prompt_tokens, n_seq)  # the prompts in one decode
            params.n_seq_max, params.kv_unified = n_seq, True
            params.n_threads = params.n_threads_batch = self.threads
            ctx = lc.llama_init_from_model(self.model, params)
            if not ctx:
                raise RuntimeError(f"llama.cpp could not make a context of {n_seq} sequences")
            self._contexts[n_seq] = (ctx, lc.llama_batch_init(params.n_batch, 0, n_seq))
        return self._contexts[n_seq]

    def generate(self, prompts: list[list[int]], tokens: int) -> tuple[float, float, list[list[int]]]:
        """(seconds, seconds to the first tokens, new tokens of each sequence): the prompts prefilled in
        one batch, then one token of every sequence per decode, greedy, exactly `tokens` new tokens each
        (no EOS stop)."""
        lc = self.lc
        ctx, batch = self._context(len(prompts), sum(map(len, prompts)))

        def put(i: int, token: int, pos: int, seq: int, logits: bool) -> None:
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, logits

        def argmax(i: int) -> int:
            return int(np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(self.vocab,)).argmax())

        def decode(n: int) -> None:
            batch.n_tokens = n
            if lc.llama_decode(ctx, batch):
                raise RuntimeError("llama_decode failed")

        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        t0 = time.perf_counter()
        k, last = 0, []
        for seq, p in enumerate(prompts):
            for pos, t in enumerate(p):
                put(k, t, pos, seq, pos == len(p) - 1)
                k += 1
            last.append(k - 1)
        decode(k)
        out = [[argmax(i)] for i in last]
        first_s = time.perf_counter() - t0
        for step in range(1, tokens):
            for seq, p in enumerate(prompts):
                put(seq, out[seq][-1], len(p) + step - 1, seq, True)
            decode(len(prompts))
            for seq in range(len(prompts)):
                out[seq].append(argmax(seq))
        return time.perf_counter() - t0, first_s, out

    def close(self) -> None:
        lc = self.lc
        for ctx, batch in self._contexts.values():
            lc.llama_batch_free(batch)
            lc.llama_free(ctx)
        self._contexts.clear()
        if self.model:
            lc.llama_model_free(self.model)
            self.model = None
