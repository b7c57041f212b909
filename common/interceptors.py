"""The server interceptors every LogicPipe server installs (through Transport.server). ServiceErrors
turns what a handler raises or receives into the right gRPC status, so servicers only translate.

- a MeshError raised by a handler (unary or streaming) ends the call with its status and message;
- a request whose bytes are not its message gets INVALID_ARGUMENT with a one-line reason (gRPC
  itself answers UNKNOWN "Unexpected DecodeError");
- a method this server's servicer does not implement (the generated base class's stub) answers
  UNIMPLEMENTED saying where it is served (gRPC itself: "Unexpected NotImplementedError").
"""
from __future__ import annotations

import grpc
from google.protobuf.message import DecodeError

from logicpipe.common.security.bundle import peer
from logicpipe.errors import MeshError

ELSEWHERE = {  # methods a server may refuse as "not here", and where they are served instead
    "Join": "Join is served on the bootstrap port (--join-listen) only, authenticated by a join token from "
            "`lpctl token create`; this port serves the mesh's other calls",
}


def not_served(method: str) -> str:
    """The message of a call to `method` on a server that does not serve it."""
    return ELSEWHERE.get(method, f"{method} is not served on this port")


class _Malformed:
    """Stands in for a request whose bytes did not parse as its message."""

    def __init__(self, error: Exception):
        self.error = error


async def _refuse_malformed(request, context) -> None:
    if isinstance(request, _Malformed):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request does not parse as its protobuf message "
                                                              f"({request.error}); is the client speaking logicpipe.v1?")


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

        kind = ("stream" if handler.request_streaming else "unary") + "_" + \
               ("stream" if handler.response_streaming else "unary")
        inner = getattr(handler, kind)
        method = handler_call_details.method.rsplit("/", 1)[-1]

        async def unimplemented(exc: NotImplementedError, context) -> None:
            # only the generated stub sets UNIMPLEMENTED before raising: any other NotImplementedError
            # (a torch op, say) is the handler's bug and stays one
            if context.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise exc
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, not_served(method))

        async def checked(requests, context):
            async for request in requests:
                await _refuse_malformed(request, context)
                yield request

        async def parsed(request, context):
            if handler.request_streaming:
                return checked(request, context)
            await _refuse_malformed(request, context)
            return request

        if handler.response_streaming:
            async def behavior(request, context):
                try:
                    async for reply in inner(await parsed(request, context), context):
                        yield reply
                except MeshError as err:
                    await context.abort(err.code, str(err))
                except NotImplementedError as exc:
                    await unimplemented(exc, context)
        else:
            async def behavior(request, context):
                try:
                    return await inner(await parsed(request, context), context)
                except MeshError as err:
                    await context.abort(err.code, str(err))
                except NotImplementedError as exc:
                    await unimplemented(exc, context)
        return handler._replace(request_deserializer=tolerant, **{kind: behavior})


class RoleCheck(grpc.aio.ServerInterceptor):
    """While the process serves over mutual TLS (`tls`): a call whose caller's certificate states
    a role the method does not accept, or a revoked name, ends with PERMISSION_DENIED, saying which
    role it needs. `policy` maps a method name ("Assign") to the roles that may call it
    (logicpipe.policy); a method missing from it (the health service) is open to every party the
    handshake admitted."""

    def __init__(self, tls: bool, policy: dict[str, frozenset[str]], revocations=None):
        self.tls = tls
        self.policy = policy
        self.revocations = revocations if revocations is not None else frozenset()  # names refused outright

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method.rsplit("/", 1)[-1]
        allowed = self.policy.get(method)
        if handler is None or allowed is None or not self.tls:
            return handler
        kind = ("stream" if handler.request_streaming else "unary") + "_" + \
               ("stream" if handler.response_streaming else "unary")
        inner = getattr(handler, kind)

        async def refuse(context) -> bool:
            role, name = peer(context)
            if name in self.revocations:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"the certificate of {name!r} was revoked")
                return True
            if role in allowed:
                return False
            if not allowed:  # no role may call it here (Join: the bootstrap port's)
                await context.abort(grpc.StatusCode.UNIMPLEMENTED, not_served(method))
                return True
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"{method} accepts {' or '.join(sorted(allowed))} certificates; this caller presented "
                                f"{'a ' + role if role else 'no role'} certificate ({name or 'unnamed'}): "
                                f"issue the right one with `lpctl ca issue NAME --role {sorted(allowed)[0]}`")
            return True

        if handler.response_streaming:
            async def behavior(request, context):
                if await refuse(context):
                    return
                async for reply in inner(request, context):
                    yield reply
        else:
            async def behavior(request, context):
                if await refuse(context):
                    return None
                return await inner(request, context)
        return handler._replace(**{kind: behavior})
