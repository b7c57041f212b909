"""A node kept with a spare by its keeper (`logicpipe-stage --keep-spare`) on this machine's device
(CUDA when there is one): a 1-stage mesh of a small random model streams one greedy request; its
serving process is SIGKILLed mid-request; the spare serves and the keeper forks the next. Prints one
JSON object:

  equal            the faulted request's tokens are those of the same request unfaulted
  takeover_s       from the SIGKILL until the spare holds the node's serving lock
  next_spare_s     from the SIGKILL until the keeper's next spare waits (its log line)
  resumed_s        from the SIGKILL until the request's next token (one already sent may come first)
  longest_gap_s    the request's longest wait between two tokens (the fault's pause)
  memory_mib       per process while the spare waits (keeper, serving, spare): GPU memory (nvidia-smi)
                   and proportional host memory (/proc/PID/smaps_rollup)

    python -m bench.keep_spare --work /tmp/keep --out $OUT
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import torch

from bench.gpu_engine import SMALL, make_model, stream
from logicpipe.stage_node.net.spare import ServingLock, lock_path
from tests.localmesh import LocalMesh


def gpu_mib() -> dict[int, int]:
    """GPU memory (MiB) of each process that holds some (empty without nvidia-smi)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return {int(p): int(m) for p, m in (line.split(",") for line in out.splitlines() if "," in line)}


def pss_mib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) // 1024
    return 0


def children(pid: int) -> list[int]:
    return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/keep-spare"))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--tokens", type=int, default=900)
    ap.add_argument("--kill-after", type=float, default=2.0, help="seconds into the request")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    import bench.gpu_engine as engine

    engine.DEVICE = device
    model = make_model(args.work / "small", SMALL, torch.float32)
    prompt = [(7 * j + 3) % 500 for j in range(24)]
    out: dict = {"device": device}
    with LocalMesh(1, model, args.work / "mesh", threads=2, device=device, stage_args=("--keep-spare", "--min-step-ms", "5")) as mesh:
        address = mesh.controller_address
        alone = stream(address, prompt, args.tokens)["ids"]
        keeper = mesh.procs["stage0"].pid
        lock = ServingLock(lock_path(args.work / "mesh" / "state0", "stage0"))
        log = args.work / "mesh" / "stage0.log"
        serving = lock.holder()
        (spare,) = [p for p in children(keeper) if p != serving]
        gpu = gpu_mib()
        out["memory_mib"] = {name: {"gpu": gpu.get(pid, 0), "host_pss": pss_mib(pid)}
                             for name, pid in (("keeper", keeper), ("serving", serving), ("spare", spare))}
        got: dict = {}
        run = threading.Thread(target=lambda: got.update(stream(address, prompt, args.tokens)))
        run.start()
        time.sleep(args.kill_after)  # mid-request (the stage paced at --min-step-ms)
        t0 = time.perf_counter()  # (stream's clock)
        os.kill(serving, signal.SIGKILL)
        while lock.holder() == serving:
            time.sleep(0.005)
        out["takeover_s"] = round(time.perf_counter() - t0, 3)
        waits = log.read_text().count("waiting to take over")
        while log.read_text().count("waiting to take over") == waits and time.perf_counter() - t0 < 60:
            time.sleep(0.005)
        out["next_spare_s"] = round(time.perf_counter() - t0, 3)
        run.join(600)
        out["equal"] = got.get("ids") == alone and len(alone) == args.tokens
        out["error"] = got.get("error", "")
        after = [got["t0"] + t for t in got.get("times", []) if got["t0"] + t > t0]
        out["tokens_before_kill"] = len(got.get("times", [])) - len(after)
        out["resumed_s"] = round(after[0] - t0, 3) if after else None
        times = got.get("times", [])
        out["longest_gap_s"] = round(max((b - a for a, b in zip(times, times[1:])), default=0.0), 3)
        out["keeper_log"] = [line[24:] for line in log.read_text().splitlines() if "keeper of node" in line]
    text = json.dumps(out, indent=2)
    print(text, flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "keep_spare.json").write_text(text)


if __name__ == "__main__":
    main()
