"""The one error hierarchy of the request path, and the one place that maps errors to statuses.

Every failure a client can see is an :class:`ApiError`: its class fixes the HTTP status, the
gRPC status code and OpenAI's ``type``; an instance carries the ``message``, the ``param`` it
names, OpenAI's ``code`` and ``retry_after_s``. Both ingresses render an error only through
:func:`http_error` and :func:`grpc_error`; :func:`as_api_error` turns anything else (Serve's
back-pressure and unavailability errors, timeouts, bugs) into one, so no traceback or internal
text reaches a client.

=========================  ======  ===================  ======================
class                      status  grpc code            default code
=========================  ======  ===================  ======================
BadRequest                 400     INVALID_ARGUMENT     invalid_request_error
BadRequestError            400     INVALID_ARGUMENT     request_too_large
UnsupportedParameter       400     INVALID_ARGUMENT     unsupported_parameter
AuthError                  401     UNAUTHENTICATED      invalid_api_key
PermissionDeniedError      403     PERMISSION_DENIED    model_not_allowed
NotFound / ModelNotFound   404     NOT_FOUND            not_found / model_not_found
MethodNotAllowed           405     UNIMPLEMENTED        method_not_allowed
RequestTimeout             408     DEADLINE_EXCEEDED    request_timeout
PayloadTooLarge            413     INVALID_ARGUMENT     request_too_large
RateLimitedError           429     RESOURCE_EXHAUSTED   rate_limit_exceeded
InternalError              500     INTERNAL             internal_error
Unavailable / Overloaded   503     UNAVAILABLE          service_unavailable / overloaded
DeadlineExceeded           504     DEADLINE_EXCEEDED    timeout
=========================  ======  ===================  ======================
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

log = logging.getLogger("ray.serve").getChild("deltaserve")


class ApiError(Exception):
    """A request that cannot be served, as a client sees it."""

    status = 400  # HTTP status
    grpc_code = "INVALID_ARGUMENT"  # grpc.StatusCode name
    code = "invalid_request_error"  # OpenAI error ``code``
    type = "invalid_request_error"  # OpenAI error ``type``

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.param = param
        self.retry_after_s = retry_after_s

    def error_body(self) -> dict[str, Any]:
        """OpenAI's JSON error body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @property
    def retry_after_header(self) -> str | None:
        """``Retry-After``: whole seconds, rounded up, at least 1 (None when the error has no retry time)."""
        if self.retry_after_s is None:
            return None
        return str(max(1, math.ceil(self.retry_after_s)))

    def headers(self) -> dict[str, str]:
        """HTTP headers that go with this error."""
        retry = self.retry_after_header
        return {"Retry-After": retry} if retry is not None else {}


class BadRequest(ApiError):
    """400: the request is malformed or outside a limit (the message names the field and the limit)."""


TenantError = ApiError  # the tenancy package raises subclasses of ApiError under this name


class BadRequestError(BadRequest):
    """400: a request that can never succeed under the tenant's limits (retrying will not help)."""

    code = "request_too_large"


class UnsupportedParameter(BadRequest):
    """400: an OpenAI parameter this platform does not implement."""

    code = "unsupported_parameter"


class AuthError(ApiError):
    """401: no API key, or one that matches no tenant."""

    status, grpc_code, code, type = 401, "UNAUTHENTICATED", "invalid_api_key", "authentication_error"

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"}


class PermissionDeniedError(ApiError):
    """403: an authenticated tenant asked for something it is not entitled to."""

    status, grpc_code, code, type = 403, "PERMISSION_DENIED", "model_not_allowed", "permission_error"


class NotFound(ApiError):
    """404: an unknown route or object."""

    status, grpc_code, code, type = 404, "NOT_FOUND", "not_found", "invalid_request_error"


class ModelNotFound(NotFound):
    code = "model_not_found"


class MethodNotAllowed(ApiError):
    status, grpc_code, code, type = 405, "UNIMPLEMENTED", "method_not_allowed", "invalid_request_error"


class RequestTimeout(ApiError):
    """408: the client did not send the whole request in time (a slow or stalled body)."""

    status, grpc_code, code, type = 408, "DEADLINE_EXCEEDED", "request_timeout", "invalid_request_error"


class PayloadTooLarge(ApiError):
    status, grpc_code, code, type = 413, "INVALID_ARGUMENT", "request_too_large", "invalid_request_error"


class RateLimitedError(ApiError):
    """429: the tenant is over requests/min or tokens/min; ``retry_after_s`` says when the request would fit."""

    status, grpc_code, code, type = 429, "RESOURCE_EXHAUSTED", "rate_limit_exceeded", "rate_limit_error"

    def __init__(self, message: str, *, retry_after_s: float, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message, code=code, param=param, retry_after_s=retry_after_s)


class InternalError(ApiError):
    status, grpc_code, code, type = 500, "INTERNAL", "internal_error", "server_error"


class Unavailable(ApiError):
    """503: no replica could serve the request (the platform, not the tenant, is out of capacity)."""

    status, grpc_code, code, type = 503, "UNAVAILABLE", "service_unavailable", "server_error"

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None,
                 retry_after_s: float | None = 1.0) -> None:
        super().__init__(message, code=code, param=param, retry_after_s=retry_after_s)


class Overloaded(Unavailable):
    """503: every replica's queue is full; retry after ``retry_after_s``."""

    code = "overloaded"


class DeadlineExceeded(ApiError):
    """504: the request ran past its pool's end-to-end deadline."""

    status, grpc_code, code, type = 504, "DEADLINE_EXCEEDED", "timeout", "server_error"


class ReplicaFailed(Exception):
    """A prefill or decode replica died, became unreachable or reported itself broken during a
    request: the frontend resumes the request elsewhere. Raised by backends; never reaches a client."""


class HandoffLost(Exception):
    """A prefill → decode handoff entry is gone (expired, evicted, Redis down, owner dead): the
    frontend recomputes through prefill and hands off directly."""


def _serve_error(exc: BaseException) -> ApiError | None:
    """Serve's own overload / unavailability errors as 503s (None for anything else)."""
    try:
        from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
    except ImportError:  # pragma: no cover - Ray is a dependency
        return None
    if isinstance(exc, BackPressureError):
        return Overloaded("the platform is over capacity (every replica's queue is full); retry later", retry_after_s=1.0)
    if isinstance(exc, DeploymentUnavailableError):
        return Unavailable("no replica is available to serve this request; retry later", retry_after_s=2.0)
    return None


def status_of(exc: BaseException) -> int:
    """The HTTP status ``exc`` becomes for a client (what :func:`as_api_error` maps it to), without
    logging: what metrics and usage count a failed request under. A cancelled request (the client
    hung up) is 499, nginx's "client closed request"."""
    if isinstance(exc, ApiError):
        return exc.status
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return 499
    err = _serve_error(exc)
    if err is not None:
        return err.status
    return 504 if isinstance(exc, (asyncio.TimeoutError, TimeoutError)) else 500


def public_error(exc: BaseException, request_id: str = "") -> ApiError:
    """``exc`` as a client sees it (what :func:`as_api_error` returns), without logging: the ingress
    span's error event (:mod:`deployments.observability.tracing`) shows exactly this."""
    if isinstance(exc, ApiError):
        return exc
    err = _serve_error(exc)
    if err is None and isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        err = DeadlineExceeded("the request timed out inside the platform")
    if err is not None:
        return err
    return InternalError(f"internal error (request id {request_id})" if request_id else "internal error")


def as_api_error(exc: BaseException, request_id: str = "") -> ApiError:
    """``exc`` as a client may see it (:func:`public_error`). Anything that is not already an
    :class:`ApiError` is logged here, once, with ``request_id`` and its traceback, and becomes a 5xx
    whose message says nothing about the internals."""
    err = public_error(exc, request_id)
    if err is exc:
        if exc.status >= 500:
            log.error("request %s failed: %s %s", request_id or "?", exc.status, exc.message)
    elif isinstance(err, InternalError):
        log.error("request %s failed: internal error", request_id or "?", exc_info=exc)
    else:
        log.error("request %s failed: %s (%s: %s)", request_id or "?", err.status, type(exc).__name__, exc)
    return err


def http_error(exc: BaseException, request_id: str = "") -> tuple[int, dict[str, Any], dict[str, str]]:
    """(HTTP status, OpenAI error body, headers) for ``exc``."""
    err = as_api_error(exc, request_id)
    return err.status, err.error_body(), err.headers()


def grpc_error(exc: BaseException, request_id: str = "") -> tuple[str, str, list[tuple[str, str]]]:
    """(grpc.StatusCode name, details, trailing metadata) for ``exc``: ``x-deltaserve-error-code``
    carries OpenAI's code, ``retry-after`` the whole seconds to wait (always on RESOURCE_EXHAUSTED)."""
    err = as_api_error(exc, request_id)
    trailers = [("x-deltaserve-error-code", str(err.code))]
    retry = err.retry_after_header
    if retry is None and err.grpc_code == "RESOURCE_EXHAUSTED":
        retry = "1"
    if retry is not None:
        trailers.append(("retry-after", retry))
    return err.grpc_code, err.message, trailers
