"""The server interceptor every LogicPipe server installs (through grpc_options.new_server): it
turns what a handler raises or receives into the right gRPC status, so servicers only translate.

- a MeshError raised by a handler (unary or streaming) ends the call with its status and message;
- a request whose bytes are not its message gets INVALID_ARGUMENT with a one-line reason (gRPC
  itself answers UNKNOWN "Unexpected DecodeError").
"""
from __future__ import annotations

import grpc
from google.protobuf.message import DecodeError

from logicpipe.errors import MeshError


class _Malformed:
    """Stands in for a request whose bytes did not parse as its message."""

    def __init__(self, error: Exception):
        self.error = error


def _message(m: _Malformed) -> str:
    return f"the request does not parse as its protobuf message ({m.error}); is the client speaking logicpipe.v1?"


class ServiceErrors(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer

        def tolerant(data: bytes):
            try:
                return parse(data)
            except (DecodeError, ValueError, TypeError) as exc:
                return _Malformed(exc)

        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary_unary(request, context):
                if isinstance(request, _Malformed):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _message(request))
                try:
                    return await inner(request, context)
                except MeshError as err:
                    await context.abort(err.code, str(err))
            return handler._replace(request_deserializer=tolerant, unary_unary=unary_unary)
        if handler.unary_stream is not None:
            inner_us = handler.unary_stream

            async def unary_stream(request, context):
                if isinstance(request, _Malformed):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _message(request))
                try:
                    async for reply in inner_us(request, context):
                        yield reply
                except MeshError as err:
                    await context.abort(err.code, str(err))
            return handler._replace(request_deserializer=tolerant, unary_stream=unary_stream)

        async def checked(requests, context):
            async for request in requests:
                if isinstance(request, _Malformed):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _message(request))
                yield request

        if handler.stream_unary is not None:
            inner_su = handler.stream_unary

            async def stream_unary(requests, context):
                try:
                    return await inner_su(checked(requests, context), context)
                except MeshError as err:
                    await context.abort(err.code, str(err))
            return handler._replace(request_deserializer=tolerant, stream_unary=stream_unary)
        inner_ss = handler.stream_stream

        async def stream_stream(requests, context):
            try:
                async for reply in inner_ss(checked(requests, context), context):
                    yield reply
            except MeshError as err:
                await context.abort(err.code, str(err))
        return handler._replace(request_deserializer=tolerant, stream_stream=stream_stream)
