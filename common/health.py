"""The standard grpc.health.v1 service, wired the same way on every LogicPipe server.

A server reports NOT_SERVING until its owner says it is ready (grpc's servicer starts at SERVING)."""
from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def add_health(server: grpc.aio.Server, *service_names: str) -> health.aio.HealthServicer:
    """Register grpc.health.v1 on `server`; the overall ("") and each named service start NOT_SERVING."""
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    await set_serving(servicer, False, *service_names)
    return servicer


async def set_serving(servicer: health.aio.HealthServicer, serving: bool, *service_names: str) -> None:
    status = SERVING if serving else NOT_SERVING
    for name in ("", *service_names):
        await servicer.set(name, status)
