"""Domain errors and the one mapping from exceptions to gRPC status codes.

Cores raise these; the gRPC shell (rolefleet.rpc.server.rpc) turns them into statuses, so a bad
request never kills a server. Anything else becomes INTERNAL with the exception's message.
"""

from __future__ import annotations

import grpc


class RoleFleetError(Exception):
    code = grpc.StatusCode.INTERNAL


class InvalidArgument(RoleFleetError):
    """A request field is malformed; `field` names it (dotted path, e.g. `batch.response_ids`)."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, message: str):
        self.field, self.message = field, message
        super().__init__(f"{field}: {message}")

    def __reduce__(self):  # travels between worker processes whole
        return type(self), (self.field, self.message)


class LimitExceeded(RoleFleetError):
    """A request is larger than a configured per-request limit; `field` names what is too large and
    the message names the limit's config key, so the caller knows to split the request."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, field: str, message: str):
        self.field, self.message = field, message
        super().__init__(f"{field}: {message}")

    def __reduce__(self):  # travels between worker processes whole
        return type(self), (self.field, self.message)


class FailedPrecondition(RoleFleetError):
    """The request is well formed but the role is in the wrong state (e.g. policy-version mismatch)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Unavailable(RoleFleetError):
    """A transient fault: the caller may retry."""

    code = grpc.StatusCode.UNAVAILABLE


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a servicer answers with for `exc`."""
    if isinstance(exc, RoleFleetError):
        return exc.code, str(exc)
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


def error_from_rpc(exc: grpc.aio.AioRpcError | grpc.RpcError) -> RoleFleetError:
    """The domain error for a failed call, so that clients raise the same types as cores do."""
    code, details = exc.code(), exc.details() or ""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        field, _, message = details.partition(": ")
        return InvalidArgument(field, message)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        field, _, message = details.partition(": ")
        return LimitExceeded(field, message)
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return FailedPrecondition(details)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return Unavailable(details)
    return RoleFleetError(f"{code.name}: {details}")
