"""`logicpipe-controller`: plan the mesh, assign the stages, serve requests."""
from __future__ import annotations

import argparse
import asyncio
import logging

from logicpipe import grpc_options
from logicpipe.errors import MeshError
from logicpipe.health import add_health
from logicpipe.process import configure_logging, serve_until_signalled
from logicpipe.v1 import controller_pb2_grpc

log = logging.getLogger("logicpipe.controller")

SERVICE_NAME = "logicpipe.v1.Controller"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="logicpipe-controller", description="Run the LogicPipe controller.")
    ap.add_argument("--listen", default="127.0.0.1:50051", help="HOST:PORT to serve on (default %(default)s)")
    ap.add_argument("--nodes", default="", help="stage nodes in pipeline order, HOST:PORT,HOST:PORT,...")
    ap.add_argument("--model", default=None,
                    help="Llama-family safetensors model directory (default: the embedded SmolLM2-135M-Instruct, "
                         "converted on first use)")
    ap.add_argument("--plan", default=None, help="plan artifact (JSON) to reuse when it still matches, and to "
                                                 "write the plan in force to")
    ap.add_argument("--strategy", default="dp", help="partition strategy: dp | uniform | memory | compute | mixed")
    ap.add_argument("--objective", default="throughput", choices=["throughput", "latency"])
    ap.add_argument("--context", type=int, default=2048,
                    help="tokens of context per sequence the plan reserves KV for (default %(default)s)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                    help="compute dtype on the stages")
    ap.add_argument("--micro-batches", type=int, default=0,
                    help="micro-batches in flight through the pipeline (default 0: one per distinct compute "
                         "device, so stages sharing one machine's cores batch together)")
    ap.add_argument("--log-level", default="INFO")
    return ap.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    from controller.app import ControllerApp
    from controller.model_prep import prepare_default_model
    from controller.service import ControllerServicer

    model_dir = args.model or await asyncio.to_thread(prepare_default_model, progress=log.info)
    nodes = [n.strip() for n in args.nodes.split(",") if n.strip()]
    app = ControllerApp(model_dir, nodes, dtype=args.dtype, plan_path=args.plan, strategy=args.strategy,
                        objective=args.objective, context=args.context, micro_batches=args.micro_batches)
    server = grpc_options.new_server()
    controller_pb2_grpc.add_ControllerServicer_to_server(ControllerServicer(app), server)
    health = await add_health(server, SERVICE_NAME)
    bound = server.add_insecure_port(args.listen)
    if bound == 0:
        raise SystemExit(f"cannot listen on {args.listen}")
    await server.start()
    host = args.listen.rpartition(":")[0]
    log.info("controller listening on %s:%d; model %s", host, bound, app.model_dir)
    try:
        await app.start()
    except (MeshError, ValueError) as err:
        await server.stop(None)
        await app.close()
        raise SystemExit(f"logicpipe-controller: {err}") from None
    log.info("ready: %d stages, plan %s", len(app.pipeline.stages), app.pipeline.plan_id)
    await serve_until_signalled(server, health, SERVICE_NAME, grace_s=5.0)
    await app.close()


def main(argv=None) -> None:
    args = parse_args(argv)
    configure_logging(args.log_level)
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
