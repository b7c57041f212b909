"""`logicpipe-stage`: run one stage node."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket

from logicpipe import grpc_options
from logicpipe.health import add_health
from logicpipe.process import configure_logging, serve_until_signalled
from logicpipe.v1 import stage_pb2_grpc

log = logging.getLogger("logicpipe.stage")

SERVICE_NAME = "logicpipe.v1.StageNode"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="logicpipe-stage", description="Run a LogicPipe stage node.")
    ap.add_argument("--listen", default="127.0.0.1:50061", help="HOST:PORT to serve on (default %(default)s)")
    ap.add_argument("--node-id", default=None, help="stable id of this node (default HOSTNAME-PORT)")
    ap.add_argument("--device", default=None, choices=["cpu", "cuda"],
                    help="compute device (default cuda when available, else cpu)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--max-kv-mib", type=int, default=2048, help="KV memory all sessions may reserve, MiB")
    ap.add_argument("--no-profile", action="store_true", help="skip the start-up micro-benchmark")
    ap.add_argument("--log-level", default="INFO")
    return ap.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    import torch

    from stage_node.runtime import StageRuntime
    from stage_node.service import StageNodeServicer

    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch sees no CUDA device")
    host, _, port = args.listen.rpartition(":")
    node_id = args.node_id or f"{socket.gethostname()}-{port}"
    profile = None
    if not args.no_profile:
        from stage_node.profile import host_profile

        profile = await asyncio.to_thread(host_profile, device)
    runtime = StageRuntime(node_id, device, max_kv_bytes=args.max_kv_mib * 2**20)
    server = grpc_options.new_server()
    stage_pb2_grpc.add_StageNodeServicer_to_server(StageNodeServicer(runtime, profile), server)
    health = await add_health(server, SERVICE_NAME)
    bound = server.add_insecure_port(args.listen)
    if bound == 0:
        raise SystemExit(f"cannot listen on {args.listen}")
    runtime.start()
    await server.start()
    log.info("stage node %s listening on %s:%d (device %s, pid %d)", node_id, host, bound, device, os.getpid())
    await serve_until_signalled(server, health, SERVICE_NAME, grace_s=2.0)
    await runtime.stop()


def main(argv=None) -> None:
    args = parse_args(argv)
    configure_logging(args.log_level)
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
