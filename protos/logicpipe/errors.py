"""Errors that carry their gRPC status, shared by the stage node and the controller.

Domain code raises these; servicers translate them to `context.abort(code, message)`. The message is
for a person: it says what was wrong and, where it can, what to do.
"""
from __future__ import annotations

import grpc


class MeshError(Exception):
    code = grpc.StatusCode.INTERNAL


class InvalidArgument(MeshError):
    """The request can never work as sent."""
    code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPrecondition(MeshError):
    """The request is fine but the server is in the wrong state for it."""
    code = grpc.StatusCode.FAILED_PRECONDITION


class NotFound(MeshError):
    code = grpc.StatusCode.NOT_FOUND


class ResourceExhausted(MeshError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(MeshError):
    code = grpc.StatusCode.UNAVAILABLE


class PermissionDenied(MeshError):
    code = grpc.StatusCode.PERMISSION_DENIED


class AlreadyExists(MeshError):
    code = grpc.StatusCode.ALREADY_EXISTS


class Fenced(FailedPrecondition):
    """A stage refuses a controller whose fencing epoch is older than one it has seen (another
    controller took over). The message starts with FENCED, which is how the controller knows."""

    PREFIX = "FENCED:"

    @classmethod
    def seen_in(cls, message: str) -> bool:
        return cls.PREFIX in message


_BY_CODE = {cls.code: cls for cls in (InvalidArgument, FailedPrecondition, NotFound, ResourceExhausted, Unavailable,
                                       PermissionDenied, AlreadyExists)}


def from_code(code: int | grpc.StatusCode, message: str) -> MeshError:
    """The MeshError for a status code as carried in a message (int) or by grpc (StatusCode)."""
    if isinstance(code, int):
        code = next((c for c in grpc.StatusCode if code_number(c) == code), grpc.StatusCode.UNKNOWN)
    err = _BY_CODE.get(code, MeshError)(message)
    if type(err) is MeshError:
        err.code = code
    return err


def code_number(code: grpc.StatusCode) -> int:
    return code.value[0]
