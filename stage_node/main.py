"""`logicpipe-stage`: run one stage node."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys
from pathlib import Path

# OpenMP workers (torch's CPU thread team) spin this many iterations waiting for the next parallel
# region before they sleep. GNU OpenMP's default (300000, a few ms) keeps a stage's idle team
# spinning into the next stage's compute when stages share a machine's cores; a short spin still
# bridges the microsecond gaps inside one forward. Measured (3-stage CPU mesh on 2 cores, ms per
# decoded token): default 71-78, 30000: 56-59, 10000: 57-60; a 1-stage mesh is unchanged. Set the
# variable yourself to override. It must be set before torch (and its OpenMP) loads: before the
# imports below.
GOMP_SPINCOUNT = "20000"
os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)
# A spare (--spare) imports on the CPU time nothing else wants (SCHED_IDLE, from before torch's import):
# it stands behind a node that may be replaying a fault's requests on the same cores. serve() puts it
# back on the normal policy before anything it measures (net/spare.py: serving_priority).
if "--spare" in sys.argv[1:] and hasattr(os, "SCHED_IDLE"):
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except OSError:
        pass

import torch  # noqa: E402

from logicpipe.common import statedir  # noqa: E402
from logicpipe.common.discovery import discovery_interface  # noqa: E402
from logicpipe.common.health import add_health  # noqa: E402
from logicpipe.common.paths import cache_root  # noqa: E402
from logicpipe.common.process import (  # noqa: E402
    CONTROLLER_PORT,
    STAGE_PORT,
    address_flag,
    bind,
    check_free,
    configure_logging,
    exit_after,
    run_main,
    serve_until_signalled,
)
from logicpipe.common.security.bundle import CA_CERT, TlsError  # noqa: E402
from logicpipe.common.security.tokens import join_mesh  # noqa: E402
from logicpipe.common.transport import add_flags, from_flags  # noqa: E402
from logicpipe.formats import FLOAT_DTYPES  # noqa: E402
from logicpipe.policy import STAGE_POLICY  # noqa: E402
from logicpipe.stage_node.config import StageOptions  # noqa: E402
from logicpipe.stage_node.net.identity import default_state_dir, file_label, node_identity  # noqa: E402
from logicpipe.stage_node.kernels.invariant import SETTINGS as INVARIANT_SETTINGS  # noqa: E402
from logicpipe.stage_node.kernels.invariant import InvariantError, resolve  # noqa: E402
from logicpipe.stage_node.net.membership import StageMembership  # noqa: E402
from logicpipe.stage_node.profile import (  # noqa: E402
    compute_id, cpu_kernels, host_profile, offered_formats, offering, tensor_parallel)
from logicpipe.stage_node.kernels.quant import FORMATS as QUANT_CHOICES  # noqa: E402
from logicpipe.stage_node.kernels.quant import QuantError, check_format  # noqa: E402
from logicpipe.stage_node.engine.kv_quant import KV_DTYPES  # noqa: E402
from logicpipe.stage_node.engine.runner import Runner  # noqa: E402
from logicpipe.stage_node.engine.tp_group import Leader, free_port, serve_store  # noqa: E402
from logicpipe.stage_node.runtime import StageRuntime  # noqa: E402
from logicpipe.stage_node.engine.scheduler import Budget  # noqa: E402
from logicpipe.stage_node.net.service import StageNodeServicer  # noqa: E402
from logicpipe.stage_node.net.spare import ServingLock, keep, lock_path, serving_priority, take_node  # noqa: E402
from logicpipe.v1 import stage_pb2_grpc  # noqa: E402

log = logging.getLogger("logicpipe.stage")

SERVICE_NAME = "logicpipe.v1.StageNode"
PROG = "logicpipe-stage"
KV_DISK_DEFAULT_MIB = 1024  # --kv-disk-mib's default at most (the KV pool's size below that)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=PROG, description="Run a LogicPipe stage node.")
    ap.add_argument("--listen", default=f"127.0.0.1:{STAGE_PORT}", type=address_flag(STAGE_PORT),
                    help=f"HOST:PORT to serve on (default %(default)s; a HOST alone means port {STAGE_PORT})")
    ap.add_argument("--node-id", default=None,
                    help="stable id of this node (default: made once per host, device and port, and kept in the "
                         "state directory)")
    ap.add_argument("--state-dir", default=None,
                    help="where the node keeps its identity, its fence (the controller that holds it and its epoch, "
                         "kept across restarts), pulled weights and its prefix cache (--kv-disk-mib) (default $STATE_DIRECTORY, else "
                         "$XDG_STATE_HOME/logicpipe, else ~/.local/state/logicpipe)")
    ap.add_argument("--controller", default=None, metavar="HOST:PORT", type=address_flag(CONTROLLER_PORT),
                    help="register with this controller (networks without multicast; mDNS needs no flag; a HOST "
                         f"alone means port {CONTROLLER_PORT})")
    ap.add_argument("--model-dir", default=None,
                    help="this node's copy of the model (default: the directory the controller names); a node "
                         "without it, or with another model there, pulls its layers from the controller")
    ap.add_argument("--mdns-interface", default=None, metavar="ADDR",
                    help="advertise by mDNS on the interface with this address only (e.g. 127.0.0.1)")
    ap.add_argument("--mesh", default="default",
                    help="the mesh to advertise in (nodes and controllers of one mesh share its name; default %(default)s)")
    ap.add_argument("--no-mdns", action="store_true", help="do not advertise by mDNS")
    ap.add_argument("--device", default=None, choices=["cpu", "cuda"],
                    help="compute device (default cuda when available, else cpu)")
    ap.add_argument("--dtype", default="auto", choices=["auto", *FLOAT_DTYPES],
                    help="compute dtype: auto (default) offers float32 on a CPU, bfloat16/float16/float32 on a GPU, "
                         "and runs the one the mesh asks for (the controller's --dtype; a 16-bit mesh format is "
                         "upcast to float32 where it is not offered); a named dtype is the only one this node runs")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--tp", type=int, default=1, metavar="N",
                    help="tensor-parallel over N ranks: the layers split over N processes of this node (CUDA: GPUs "
                         "0..N-1 over NCCL; CPU: N processes of --threads each, over gloo); one stage to the "
                         "controller (default 1)")
    ap.add_argument("--tp-max", type=int, default=0, metavar="N",
                    help="offer up to N devices (CUDA: GPUs 0..N-1; CPU: processes) and let the plan choose the "
                         "tensor-parallel width of each assignment among the widths that divide the model (the "
                         "follower group re-formed when it changes; width 1 where the measured all-reduce makes TP "
                         "a loss); not with --tp N > 1 (default 0: the width is --tp)")
    ap.add_argument("--tp-port", type=int, default=0, metavar="PORT",
                    help="a tensor-parallel stage over several nodes (the controller's --tp-group; CPU, gloo over "
                         "TCP): the TCP port its members meet at when this node is its rank 0, served from start on "
                         "every interface (open it between the hosts only; gloo then connects the ranks on ports of "
                         "its own). Default 0: a port free at start, which Status reports, opened only when a group "
                         "forms here")
    ap.add_argument("--max-kv-mib", type=int, default=2048,
                    help="KV pool of this stage, MiB (sessions take blocks of it as they grow; default %(default)s)")
    ap.add_argument("--block-size", type=int, default=16, help="KV positions per block (default %(default)s)")
    ap.add_argument("--window-kv", choices=["on", "off"], default="on",
                    help="sliding-window layers keep only the KV of their window (every path but --tp, whose "
                         "ranks keep every position; off, or with --tp, the profile tells the planner to count "
                         "them as full layers; default %(default)s)")
    ap.add_argument("--kv-context", type=int, default=8192, metavar="POSITIONS",
                    help="a stage with full and sliding-window layers splits --max-kv-mib between their pools so "
                         "both hold as many sequences of this many positions (default %(default)s)")
    ap.add_argument("--kv-dtype", default="auto", choices=list(KV_DTYPES),
                    help="KV cache values: auto (default: the compute dtype), or 8-bit with a float32 scale per "
                         "(token, KV head): int8 (any device, the one that agrees with float KV on >= 0.95 of greedy "
                         "tokens; keys and values stored rotated; a CPU's attention reads it directly) or fp8 (float8 "
                         "e4m3: 3 mantissa bits, agrees less: docs/engine.md); not with --tp, nor --batch-invariant "
                         "on (auto turns it off)")
    ap.add_argument("--swap-mib", type=int, default=None, metavar="MIB",
                    help="swap space, MiB: a sequence preempted for KV blocks keeps its KV there and its replay "
                         "copies it back instead of computing it again (0: none). Default: on a GPU half of "
                         "--max-kv-mib in pinned host memory (at most a quarter of the host's memory); on a CPU 0, "
                         "whose pool already is host memory, or --max-kv-mib with --swap-dir; not with --tp")
    ap.add_argument("--swap-dir", default="", metavar="DIR",
                    help="keep the swap space in files in DIR (a disk) instead of host memory (meant for CPU stages)")
    ap.add_argument("--kv-disk-mib", type=int, default=None, metavar="MIB",
                    help="keep this stage's prefix cache (the full KV blocks it computes and those KV mirrors give "
                         "it) on disk under --state-dir, at most MIB (the oldest dropped first), and read it back "
                         "when the node starts again with the same layers, so a restarted stage's replays attach "
                         "their history instead of computing it (float KV only; 0: off; default: --max-kv-mib, at "
                         f"most {KV_DISK_DEFAULT_MIB})")
    ap.add_argument("--max-step-tokens", type=int, default=512,
                    help="token rows in one step: decode rows plus prefill chunks (default %(default)s)")
    ap.add_argument("--max-step-seqs", type=int, default=None,
                    help="sequences in one step (default 256 on a GPU, whose graphs take steps of up to 256 rows; "
                         "64 on a CPU)")
    ap.add_argument("--session-ttl-s", type=float, default=30.0,
                    help="seconds a session outlives its gone controller (default %(default)s)")
    ap.add_argument("--min-step-ms", type=float, default=0.0, metavar="MS",
                    help="every step takes at least this long, the stage waiting out the rest: a slower device "
                         "emulated, for fault drills and tests on a small model (default 0: as long as it takes)")
    ap.add_argument("--max-step-ms", type=float, default=100.0, metavar="MS",
                    help="the step-time bar: a prompt's chunks shrink as its context grows so that a step (decode "
                         "rows of the running requests and a prefill chunk) stays under this, by the stage's cost "
                         "model per row and per attended key position, corrected by its measured steps "
                         "(default %(default)s; 0: chunks by --max-step-tokens and the controller alone)")
    ap.add_argument("--step-log", default="", metavar="FILE",
                    help="append a JSON line per computed step to FILE: its rows, attended key positions, held "
                         "positions, seconds and what the cost model predicted (to see which steps go over "
                         "--max-step-ms; default: none)")
    ap.add_argument("--no-profile", action="store_true", help="skip the start-up micro-benchmark")
    ap.add_argument("--spare", action="store_true",
                    help="start as this node's spare: when another process serves it (the same --state-dir and "
                         "node id), do the start-up's slow part now (imports, kernel timing, profile), wait, and "
                         "serve the moment that process ends, however it ends, instead of after a restart's start-up "
                         "(run it beside the node with the same flags; whoever restarts the ended one makes it the "
                         "next spare: docs/deploy.md#a-spare-process). Not with --tp / --tp-max / --tp-port")
    ap.add_argument("--keep-spare", action="store_true",
                    help="this process imports, then forks the node's processes and keeps a spare among them: one "
                         "serves, one waits to serve the moment that one ends, and each time one ends the next "
                         "spare is forked (milliseconds, where a spare's own start-up is seconds). One unit, one "
                         "process tree: NotifyAccess=all in its unit (docs/deploy.md#a-spare-process). Not with "
                         "--spare, --tp / --tp-max / --tp-port")
    ap.add_argument("--quantize", default="none", choices=list(QUANT_CHOICES),
                    help="hold this stage's layers quantized: int4 or int8 (CPU: the native kernels or torch's "
                         "packed ones, whichever is faster here, timed at start; LOGICPIPE_CPU_KERNEL=native|torch "
                         "forces one; CUDA: Triton kernels, batch-invariant; the LM head then in int8 too), nf4 or fp4 (bitsandbytes); embeddings and norms stay in the compute "
                         "dtype (default none)")
    ap.add_argument("--replay-rows", default="on", choices=["on", "off"],
                    help="keep the hidden rows this stage sends on (one row per KV position: about one layer's KV "
                         "more per boundary), so that after a re-plan that moves layers a replay recomputes only "
                         "the layers a stage lacks, not the whole pipeline (default on)")
    ap.add_argument("--cuda-graphs", default="on", choices=["on", "off"],
                    help="CUDA stages: replay steps of up to 32 rows as CUDA graphs, captured per size bucket "
                         "on first use (default %(default)s; off: every step eagerly)")
    ap.add_argument("--batch-invariant", default="auto", choices=list(INVARIANT_SETTINGS),
                    help="CUDA stages: compute products and attention by kernels whose result for a row never "
                         "depends on the other rows of its step, so a request gives the same tokens alone or among "
                         "others, and a replay recomputes them exactly (auto, the default: on where triton is "
                         "installed, as it is with torch's CUDA wheels; a CPU stage is batch-invariant always and "
                         "ignores this; int4 / int8 layers are batch-invariant always, nf4 / fp4 never)")
    ap.add_argument("--draft-model", default="", metavar="DIR",
                    help="as the last stage, draft candidate tokens with this small model (same tokenizer; "
                         "default: prompt lookup, no model)")
    ap.add_argument("--draft-layers", type=int, default=0, metavar="N",
                    help="with --draft-model: keep only its first N decoder layers (the model itself can then "
                         "be its own drafter; default 0: all)")
    ap.add_argument("--model-root", default=None, metavar="DIR",
                    help="load an assigned model directory only from under DIR (default: the LogicPipe cache); "
                         "one elsewhere is pulled from the controller instead, never opened")
    add_flags(ap, "stage")
    ap.add_argument("--join-token", default="", metavar="TOKEN",
                    help="join a mesh with a one-time token (`lpctl token create`): the controller at --join-address "
                         "signs this node's certificate into --tls-dir (once; later starts use it)")
    ap.add_argument("--join-address", default=None, metavar="HOST:PORT", type=address_flag(None),
                    help="the controller's --join-listen address")
    ap.add_argument("--log-level", default="INFO", help="INFO (default), DEBUG (also the traceback of an error that "
                                                        "stops the start), WARNING, ...")
    args = ap.parse_args(argv)
    clash = [f for f, on in (("--spare", args.spare), ("--tp", args.tp > 1), ("--tp-max", args.tp_max),
                             ("--tp-port", args.tp_port)) if on]
    if args.keep_spare and clash:  # (before the keeper forks: one line, exit 2)
        ap.error(f"--keep-spare with {', '.join(clash)}: a node kept with a spare is one process that serves and one "
                 "that waits (a tensor-parallel node has no spare yet)")
    return args


async def join_once(args, state_dir: Path, device: str, port: int) -> None:
    """--join-token: unless --tls-dir already holds this node's certificate, trade the token at
    --join-address for one (the node's key is made here and never leaves)."""
    if not args.tls_dir or not args.join_address:
        raise TlsError("--join-token needs --join-address HOST:PORT (the controller's --join-listen) and "
                           "--tls-dir DIR (where the node keeps the certificate it gets)")
    if any(p.name != CA_CERT for p in Path(args.tls_dir).glob("*.crt")):
        log.info("--tls-dir %s holds a certificate already: not joining again", args.tls_dir)
        return
    node_id = args.node_id or node_identity(state_dir, device, port)
    await asyncio.to_thread(join_mesh, args.join_address, args.join_token, node_id, args.tls_dir)
    log.info("joined the mesh at %s as %s: certificate kept in %s", args.join_address, node_id, args.tls_dir)


def fence_file(state_dir: Path, node_id: str) -> Path:
    """Where the node keeps its fence (the controller that holds it, at which epoch; the revoked
    names): in its state directory, so that a restarted node still refuses an older controller."""
    return state_dir / f"fence-{node_id}.json"


def host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def swap_mib(args: argparse.Namespace, device: str, host_bytes: int) -> int:
    """The swap space of a stage, MiB (engine.swap): --swap-mib, or by default half the KV pool in a
    GPU stage's host memory (at most a quarter of the host's); on a CPU stage none, since its pool
    already is host memory (more of it is better spent on --max-kv-mib), or the pool's size with
    --swap-dir (a disk); none on a tensor-parallel stage."""
    if args.swap_mib is not None:
        return args.swap_mib
    if args.tp > 1 or args.tp_max > 1:
        return 0
    if device == "cuda":
        return min(args.max_kv_mib // 2, host_bytes // 4 // 2**20) if host_bytes else args.max_kv_mib // 2
    return args.max_kv_mib if args.swap_dir else 0


def kv_disk_mib(args: argparse.Namespace) -> int:
    """The prefix cache kept on disk, MiB (net.kv_disk): --kv-disk-mib, else the KV pool's size up to
    KV_DISK_DEFAULT_MIB."""
    return args.kv_disk_mib if args.kv_disk_mib is not None else min(args.max_kv_mib, KV_DISK_DEFAULT_MIB)


def kv_disk_dir(state_dir: Path, node_id: str) -> Path:
    """Where a node keeps its prefix cache: one store per node id in its state directory."""
    return state_dir / ("kv-" + file_label(node_id))


def torch_cuda_count() -> int:
    return torch.cuda.device_count()


def cuda_available() -> bool:
    return torch.cuda.is_available()


async def serve(args: argparse.Namespace) -> None:
    if args.spare:  # imported (at idle priority): the rest, timings included, at the normal one
        serving_priority()
    else:  # (a spare's port is its node's serving process's until that one ends)
        check_free(args.listen, "--listen", PROG)  # before the device is probed and measured
    for flag in ("max_kv_mib", "block_size", "max_step_tokens", "max_step_seqs"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:  # (None: --max-step-seqs by device)
            raise SystemExit(f"--{flag.replace('_', '-')} must be at least 1")
    if args.draft_model and not (Path(args.draft_model) / "config.json").is_file():
        raise SystemExit(f"--draft-model {args.draft_model}: no config.json there (a Hugging Face model directory)")
    if args.draft_layers < 0:
        raise SystemExit("--draft-layers must be 0 (all) or more")
    if args.tp < 1:
        raise SystemExit("--tp must be at least 1")
    if not 0 <= args.tp_port <= 65535:
        raise SystemExit(f"--tp-port {args.tp_port}: give a TCP port (0: one free at start)")
    if args.tp_max < 0:
        raise SystemExit(f"--tp-max {args.tp_max}: give the most devices the plan may use, 1 or more")
    if args.tp_max and args.tp > 1:
        raise SystemExit(f"--tp-max {args.tp_max} with --tp {args.tp}: give one of them (--tp fixes the width, "
                         "--tp-max lets the plan choose it)")
    ranks = args.tp_max or args.tp  # the most ranks the stage may run
    if args.spare and (ranks > 1 or args.tp_port):
        raise SystemExit("--spare with --tp, --tp-max or --tp-port: a tensor-parallel node has no spare process yet")
    if args.kv_dtype != "auto" and ranks > 1:
        raise SystemExit(f"--kv-dtype {args.kv_dtype}: tensor-parallel stages (--tp, --tp-max) keep float KV only")
    if args.kv_disk_mib is not None and args.kv_disk_mib < 0:
        raise SystemExit("--kv-disk-mib must be 0 (off) or more")
    if args.swap_mib is not None and args.swap_mib < 0:
        raise SystemExit("--swap-mib must be 0 (none) or more")
    if args.swap_mib and ranks > 1:
        raise SystemExit(f"--swap-mib {args.swap_mib}: tensor-parallel stages (--tp, --tp-max) do not swap KV yet")
    state_dir = Path(args.state_dir) if args.state_dir else default_state_dir()
    try:  # its identity and its fence live there: a directory that cannot keep them says so now
        await asyncio.to_thread(statedir.prepare, state_dir)
    except statedir.StateDirError as exc:
        raise SystemExit(f"--state-dir: {exc}") from None

    runner = Runner(args.threads)  # every torch operation of this process runs on its thread
    has_cuda = await runner.call(cuda_available)
    device = args.device or ("cuda" if has_cuda else "cpu")
    if device == "cuda" and not has_cuda:
        raise SystemExit("--device cuda but torch sees no CUDA device")
    leader = None
    flag = f"--tp-max {args.tp_max}" if args.tp_max else f"--tp {args.tp}"
    if ranks > 1:
        gpus = await runner.call(torch_cuda_count) if device == "cuda" else 0
        if device == "cuda" and gpus < ranks:
            raise SystemExit(f"{flag}: this node has {gpus} CUDA devices")
        if args.draft_model:
            raise SystemExit(f"{flag} with --draft-model is not supported yet")
        leader = Leader(ranks, device, args.threads)  # (--tp-max: formed at start only to measure its all-reduce)
        await runner.call(leader.start)
    if args.quantize != "none":
        try:
            await runner.call(check_format, args.quantize, device)
            # int4 / int8 on a CPU: the faster kernel for this CPU, timed now on the runner's threads (logged)
            await runner.call(cpu_kernels, device, (args.quantize,))
        except QuantError as exc:
            raise SystemExit(f"--quantize {args.quantize}: {exc}") from None
    if args.kv_dtype != "auto" and device == "cuda":  # the batch-invariant Triton attention reads float KV only
        if args.batch_invariant == "on":
            raise SystemExit(f"--kv-dtype {args.kv_dtype} with --batch-invariant on: the batch-invariant CUDA kernels "
                             "read float KV only; use --batch-invariant off (or auto, which then turns them off)")
        if args.batch_invariant == "auto":
            log.info("--kv-dtype %s: batch-invariant kernels off (they read float KV only)", args.kv_dtype)
            args.batch_invariant = "off"
    try:
        invariant = await runner.call(resolve, args.batch_invariant, device)
    except InvariantError as exc:
        raise SystemExit(str(exc)) from None
    if device == "cuda":
        log.info("batch-invariant kernels %s (--batch-invariant %s)", "on" if invariant else "off",
                 args.batch_invariant)
    host, _, port = args.listen.rpartition(":")
    try:
        if args.join_token:
            await join_once(args, state_dir, device, int(port))
        transport = from_flags(args.tls_dir, args.insecure, args.listen, "stage", log)
    except TlsError as exc:
        raise SystemExit(str(exc)) from None
    bundle = transport.bundle
    if bundle is not None and args.node_id and args.node_id != bundle.name:
        raise SystemExit(f"--node-id {args.node_id}: over TLS a node's id is its certificate's name ({bundle.name})")
    node_id = (bundle.name if bundle else args.node_id) or node_identity(state_dir, device, int(port))
    try:
        formats, compute = await runner.call(offered_formats, device, args.dtype, args.quantize)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    log.info("offers weight formats %s (compute %s)", ", ".join(formats), compute)
    allreduce = await runner.call(leader.measure) if leader is not None else (0.0, 0.0)
    if leader is not None:
        log.info("all-reduce over the %d ranks: %.0f us, %.2f GB/s", ranks, allreduce[0] * 1e6, allreduce[1] / 1e9)
    if args.tp_max and leader is not None and device != "cuda":
        # each assignment forms the group at the plan's width (tp_group.reform). A CUDA node keeps its
        # group of N: forming a group again in a process whose NCCL group was destroyed hung on 2 H200s
        # (2026-11-28), so it is formed once, at start; a plan may narrow it, never widen it again
        await runner.call(leader.stop)
        leader = None
    try:  # (a port given is served from start, so it stays this node's; the store listens on every interface
        # and takes anyone, so a node not told to opens none until it is rank 0 of a group: docs/security.md)
        tp_port = serve_store(args.tp_port) if args.tp_port else free_port()
    except RuntimeError as exc:
        raise SystemExit(f"--tp-port {args.tp_port}: {exc}") from None
    measured = None if args.no_profile else await runner.call(host_profile, device, dtype=args.dtype,
                                                              quantize=args.quantize)
    profile = None if measured is None else offering(measured, args.tp_max, allreduce) if args.tp_max else \
        tensor_parallel(measured, args.tp, allreduce)
    if profile is not None and args.kv_dtype != "auto":  # the planner counts its KV at 8-bit's bytes
        profile = dataclasses.replace(profile, kv_format=args.kv_dtype)
    if profile is not None and (args.window_kv == "off" or leader is not None):
        # its sliding-window layers keep every position (a tensor-parallel stage's ranks hold no windows
        # yet: Shard.hold_windows): the planner counts them as full layers, never a window's bytes
        profile = dataclasses.replace(profile, full_sliding_kv=True)
    # one process serves the node; the fence and the KV disk store below are read as the one before left them
    serving = ServingLock(lock_path(state_dir, node_id))
    try:
        await take_node(serving, node_id, args.listen, spare=args.spare, prog=PROG)
    except OSError as exc:  # (a file system without flock)
        raise SystemExit(f"--state-dir: cannot lock {serving.path}: {exc}") from None
    options = StageOptions(max_kv_bytes=args.max_kv_mib * 2**20, block_size=args.block_size,
                           budget=Budget(args.max_step_tokens, args.max_step_seqs or (256 if device == "cuda" else 64)), session_ttl_s=args.session_ttl_s,
                           min_step_s=max(0.0, args.min_step_ms) / 1000, step_bar_s=max(0.0, args.max_step_ms) / 1000,
                           step_log=args.step_log,
                           draft_model=args.draft_model, draft_layers=args.draft_layers, quantize=args.quantize,
                           cuda_graphs=args.cuda_graphs == "on", batch_invariant=args.batch_invariant, dtype=args.dtype,
                           model_root=str(args.model_root or cache_root()), tp=leader, tp_max=args.tp_max,
                           tp_threads=args.threads, tp_port=tp_port,
                           replay_rows=args.replay_rows == "on", window_kv=args.window_kv == "on",
                           kv_context=max(1, args.kv_context), kv_dtype=args.kv_dtype,
                           swap_bytes=swap_mib(args, device, host_memory_bytes()) * 2**20, swap_dir=args.swap_dir,
                           kv_disk_bytes=kv_disk_mib(args) * 2**20, kv_disk_dir=str(kv_disk_dir(state_dir, node_id)))
    runtime = StageRuntime(node_id, device, transport=transport, options=options, runner=runner, pull_root=state_dir / "models",
                           local_model_dir=args.model_dir, fence_path=fence_file(state_dir, node_id))
    servicer = StageNodeServicer(runtime, transport, profile, await runner.call(compute_id, device))
    server = transport.server(STAGE_POLICY, revocations=runtime.fence)  # the controller's list, kept here
    stage_pb2_grpc.add_StageNodeServicer_to_server(servicer, server)
    health = await add_health(server, SERVICE_NAME)
    bound = bind(transport, server, args.listen, "--listen", PROG)
    runtime.start()
    await server.start()
    log.info("stage node %s listening on %s:%d (device %s, pid %d)", node_id, host, bound, device, os.getpid())
    members = StageMembership(runtime, f"{host}:{bound}", transport, controller=args.controller,
                              mdns=not args.no_mdns, mesh=args.mesh,
                              mdns_interface=discovery_interface(args.mdns_interface, args.listen, transport.tls),
                              profile_digest=servicer.profile_digest())
    try:
        await serve_until_signalled(server, health, SERVICE_NAME, grace_s=2.0, ready=members.start,
                                    on_stop=members.leave, alive=runtime.alive)
    finally:
        await members.close()
        await runtime.stop()
        if leader is not None:
            leader.close()


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.keep_spare:
        configure_logging(args.log_level)
        raise SystemExit(keep(lambda: kept(args), args.node_id or args.listen))
    run_main(PROG, lambda: serve(args), args.log_level)


def kept(args: argparse.Namespace) -> int:
    """A process the keeper forked (--keep-spare): a spare of the node (serving at once when none serves)."""
    args.spare = True
    run_main(PROG, lambda: serve(args), args.log_level)
    return 0



def cli() -> None:
    """The command (console script and `python -m`): main, then the process ends at once with its
    status (common.process.exit_after: the interpreter's teardown costs seconds, nothing needs it)."""
    exit_after(main)


if __name__ == "__main__":
    cli()
