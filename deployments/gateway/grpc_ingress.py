"""gRPC ingress: ``deltaserve.v1.Inference`` on Ray Serve's gRPC proxy.

* :mod:`deployments.gateway.grpc_proxy` registers the services in Serve's gRPC proxy.
* :class:`GrpcInferenceMixin` gives the ingress deployment class those four methods (Generate,
  GenerateStream, ListModels, ReportTaskOutcome).
  They read the API key from the ``authorization`` metadata (``Bearer <key>`` or the bare
  key), turn the request into a :class:`~deployments.gateway.protocol.CompletionInput`, call
  ``self.frontend`` and turn its events (or its errors) into protobuf replies, gRPC
  status codes and trailing metadata.

How Serve 2.60 carries status and metadata back (``ray/serve/_private/proxy.py``,
``replica.py``): the method receives a picklable ``RayServegRPCContext`` as the
``grpc_context`` keyword; its state (code, details, trailing metadata) is pickled
together with *each returned/yielded message* and applied to the real call in the proxy.
A raised exception only carries code + details (``gRPCStatusError``), never trailing
metadata. Hence errors are reported by setting code/details/trailing metadata and
*returning* an empty reply (unary), and the success trailers of a stream are set before
its last message is yielded. See :data:`GrpcInferenceMixin.stream_error_carrier`.
"""

from __future__ import annotations

import inspect
import math
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator

import grpc

from deployments.gateway.affinity import AFFINITY_HEADER, parse_affinity_header
from deployments.gateway.errors import BadRequest, grpc_error
from deployments.gateway.grpc_proxy import SERVICE_NAME
from deployments.gateway.protocol import ChatMessage, CompletionInput, Finished, TextDelta, TokenLogprobs, total_usage
from deployments.observability import tracing
from deployments.proto.deltaserve.v1 import inference_pb2 as pb
from deployments.tenancy.ledger import report_task_outcome
from deployments.tenancy.pricing import usd

if TYPE_CHECKING:  # pragma: no cover
    from deployments.gateway.protocol import Usage

__all__ = [
    "GrpcInferenceMixin",
    "api_key_from_metadata",
    "completion_input_from_request",
]

# Trailing metadata keys (gRPC metadata keys are lower case).
MD_POOL = "x-deltaserve-pool"
MD_REPLICA = "x-deltaserve-replica"
MD_REQUEST_ID = "x-deltaserve-request-id"
MD_MODEL = "x-deltaserve-model"
MD_FINISH_REASON = "x-deltaserve-finish-reason"
MD_PROMPT_TOKENS = "x-deltaserve-prompt-tokens"
MD_COMPLETION_TOKENS = "x-deltaserve-completion-tokens"
MD_CACHED_TOKENS = "x-deltaserve-cached-tokens"
MD_TTFT_S = "x-deltaserve-ttft-s"
MD_OUTPUT_TOKENS_PER_S = "x-deltaserve-output-tokens-per-s"
MD_E2E_S = "x-deltaserve-e2e-s"
MD_ERROR_CODE = "x-deltaserve-error-code"  # the OpenAI-style ``code`` of an ApiError
MD_RETRY_AFTER = "retry-after"  # whole seconds, like HTTP Retry-After
# Request metadata keys.
MD_AUTHORIZATION = "authorization"
MD_SESSION_ID = "x-session-id"
MD_TASK_ID = "x-task-id"



# --------------------------------------------------------------------------------------
# Request conversion
# --------------------------------------------------------------------------------------


def _metadata_value(grpc_context: Any, key: str) -> str | None:
    if grpc_context is None:
        return None
    for k, v in grpc_context.invocation_metadata() or ():
        if k.lower() == key:
            return v.decode("utf-8", "replace") if isinstance(v, bytes) else v
    return None


def trace_parent_from_metadata(grpc_context: Any) -> dict[str, str] | None:
    """The client's W3C trace context from ``traceparent``/``tracestate`` metadata (None without one)."""
    if grpc_context is None:
        return None
    return tracing.client_carrier((k, v.decode("utf-8", "replace") if isinstance(v, bytes) else v)
                                  for k, v in grpc_context.invocation_metadata() or ())


def api_key_from_metadata(grpc_context: Any) -> str | None:
    """The API key from ``authorization`` metadata: ``Bearer <key>`` or the bare key."""
    value = _metadata_value(grpc_context, MD_AUTHORIZATION)
    if value is None:
        return None
    value = value.strip()
    scheme, _, rest = value.partition(" ")
    if rest and scheme.lower() == "bearer":
        value = rest.strip()
    elif value.lower() == "bearer":
        value = ""
    return value or None


def _float32_value(value: float, param: str) -> float:
    """A proto ``float`` as the decimal the client most likely wrote (0.7, not 0.699999988).

    Keeps gRPC and HTTP requests with the same nominal temperature/top_p bit-identical.
    """
    if not math.isfinite(value):
        raise BadRequest(f"{param} must be a finite number", param=param)
    return float(f"{value:.7g}")


def completion_input_from_request(request: pb.GenerateRequest, grpc_context: Any = None) -> CompletionInput:
    """Map a ``GenerateRequest`` onto :class:`CompletionInput`; raises :class:`BadRequest`.

    Unset ``optional`` fields keep the CompletionInput defaults (``max_tokens``: the rest of
    the tenant's context). One of ``prompt``, ``prompt_token_ids`` or ``messages`` is the input; value
    ranges and limits are the frontend's to validate (the same code as HTTP's).
    """
    kwargs: dict[str, Any] = {"model": request.model}
    if sum(map(bool, (request.prompt, len(request.prompt_token_ids), len(request.messages)))) > 1:
        raise BadRequest("set one of prompt, prompt_token_ids or messages", param="messages" if len(request.messages)
                         else "prompt_token_ids")
    if len(request.messages):
        kwargs["messages"] = tuple(ChatMessage(role=m.role, content=m.content) for m in request.messages)
    elif len(request.prompt_token_ids):
        kwargs["prompt_ids"] = tuple(request.prompt_token_ids)
    else:
        kwargs["prompt"] = request.prompt
    if request.HasField("max_tokens"):
        kwargs["max_tokens"] = int(request.max_tokens)
    if request.HasField("temperature"):
        kwargs["temperature"] = _float32_value(request.temperature, "temperature")
    if request.HasField("top_p"):
        kwargs["top_p"] = _float32_value(request.top_p, "top_p")
    for name in ("presence_penalty", "frequency_penalty"):
        if request.HasField(name):
            kwargs[name] = _float32_value(getattr(request, name), name)
    if request.HasField("logprobs"):
        kwargs["logprobs"] = int(request.logprobs)
    if request.user:
        kwargs["user"] = request.user
    if request.allow_special_tokens:
        kwargs["allow_special_tokens"] = True
    if request.HasField("seed"):
        kwargs["seed"] = int(request.seed)
    if request.HasField("n"):
        kwargs["n"] = int(request.n)  # its range is the frontend's to check (HTTP's limit and message)
    if len(request.stop):
        kwargs["stop"] = tuple(request.stop)
    session_id = request.session_id or _metadata_value(grpc_context, MD_SESSION_ID)
    if session_id:
        kwargs["session_id"] = session_id
    task_id = request.task_id or _metadata_value(grpc_context, MD_TASK_ID)
    if task_id is not None:
        kwargs["task_id"] = task_id
    if request.cache_salt:
        kwargs["cache_salt"] = request.cache_salt
    if request.ignore_eos:
        kwargs["ignore_eos"] = True
    try:
        kwargs["affinity"] = parse_affinity_header(_metadata_value(grpc_context, AFFINITY_HEADER))
        return CompletionInput(**kwargs)
    except (TypeError, ValueError) as e:  # a CompletionInput that validates its fields
        raise BadRequest(str(e)) from e


# --------------------------------------------------------------------------------------
# Replies, statuses, trailing metadata
# --------------------------------------------------------------------------------------


def _usage_pb(usage: Usage) -> pb.Usage:
    """The reply's usage; ``cost`` and ``cost_details`` in USD when the pool is priced (as HTTP's ``usage.cost``)."""
    cost = usage.cost
    priced = {} if cost is None else {"cost": cost.usd(), "cost_details": pb.CostDetails(**cost.details_usd())}
    return pb.Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        cached_tokens=usage.cached_tokens,
        time_to_first_token_s=usage.time_to_first_token_s,
        output_tokens_per_s=usage.output_tokens_per_s,
        end_to_end_s=usage.end_to_end_s,
        **priced,
    )


def _serve_request_id(grpc_context: Any) -> str:
    """Serve's request id (client ``request_id`` metadata or generated by the proxy)."""
    if grpc_context is not None and hasattr(grpc_context, "trailing_metadata"):
        for k, v in grpc_context.trailing_metadata() or ():
            if k == "request_id":  # set by the proxy (RayServegRPCContext)
                return v
    try:
        from ray.serve.context import _get_serve_request_context

        return _get_serve_request_context().request_id or ""
    except Exception:  # not inside a replica
        return ""


def _fmt(x: float) -> str:
    return f"{x:.6g}"


def success_trailers(fin: Finished, request_id: str, usage: Usage | None = None) -> list[tuple[str, str]]:
    """The trailers of a served call: ``fin``'s pool, replica and finish reason; ``usage``: the
    request's over all its choices (default: ``fin``'s own)."""
    u = fin.usage if usage is None else usage
    return [
        (MD_POOL, fin.pool),
        (MD_REPLICA, fin.replica),
        (MD_REQUEST_ID, request_id),
        (MD_MODEL, fin.model),
        (MD_FINISH_REASON, fin.finish_reason),
        (MD_PROMPT_TOKENS, str(u.prompt_tokens)),
        (MD_COMPLETION_TOKENS, str(u.completion_tokens)),
        (MD_CACHED_TOKENS, str(u.cached_tokens)),
        (MD_TTFT_S, _fmt(u.time_to_first_token_s)),
        (MD_OUTPUT_TOKENS_PER_S, _fmt(u.output_tokens_per_s)),
        (MD_E2E_S, _fmt(u.end_to_end_s)),
    ]


def _request_usage(fins: list[Finished]) -> Usage:
    """The request's usage: one choice's own, or the sum over ``n`` (the prompt once, as HTTP's)."""
    return fins[0].usage if len(fins) == 1 else total_usage(fins)


def _logprobs_pb(entries: tuple[TokenLogprobs, ...]) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token=e.token, token_bytes=bytes(e.bytes), logprob=e.logprob,
                            top=[pb.TokenAlternative(token=a.token, token_bytes=bytes(a.bytes), logprob=a.logprob)
                                 for a in e.top]) for e in entries]


def _new_request_id(request: pb.GenerateRequest) -> str:
    """The request's id, made when the call arrives: replies, trailers and log lines carry it."""
    return f"{'chatcmpl' if len(request.messages) else 'cmpl'}-{uuid.uuid4().hex[:24]}"


def _set_error(grpc_context: Any, exc: BaseException, rpc: str, request_id: str = "") -> None:
    """Report ``exc`` on the call (the one mapping: :func:`deployments.gateway.errors.grpc_error`,
    which logs a 5xx with its request id); re-raises it when there is no gRPC context (handle calls)."""
    if grpc_context is None:
        raise exc
    request_id = request_id or _serve_request_id(grpc_context) or f"{SERVICE_NAME}/{rpc}"
    code, details, trailers = grpc_error(exc, request_id)
    grpc_context.set_code(getattr(grpc.StatusCode, code))
    grpc_context.set_details(details)
    grpc_context.set_trailing_metadata([*trailers, (MD_REQUEST_ID, request_id)])


# --------------------------------------------------------------------------------------
# The ingress methods
# --------------------------------------------------------------------------------------


class GrpcInferenceMixin:
    """``deltaserve.v1.Inference`` methods for the Serve ingress deployment class.

    The class sets ``self.frontend`` (see ``deployments/gateway/protocol.py`` for the interface).
    Serve calls ``<Method>(request_proto, grpc_context=RayServegRPCContext)``; the
    methods return/yield protobuf messages, which Serve serializes.
    """

    frontend: Any
    ledger: Any = None  # the usage ledger (deployments.tenancy.ledger.UsageLedger); None: no task is known

    #: How a GenerateStream error is reported (before or after the first event).
    #: Serve only forwards trailing metadata alongside a yielded message, so
    #: True (default): yield one empty ``GenerateStreamResponse`` (``finished`` false)
    #:   carrying the status code, details and trailing metadata (``retry-after``...): the
    #:   client reads that empty message, then gets the error status with its trailers.
    #: False: raise; the client gets the status code and details and *no* message, but
    #:   no trailing metadata either (``retry-after`` is lost).
    stream_error_carrier: bool = True

    async def Generate(self, request: pb.GenerateRequest, grpc_context: Any = None) -> pb.GenerateResponse:
        rid = _new_request_id(request)
        try:
            inp = completion_input_from_request(request, grpc_context)
            api_key = api_key_from_metadata(grpc_context)
            text: list[list[str]] = [[] for _ in range(inp.n)]
            token_ids: list[list[int]] = [[] for _ in range(inp.n)]
            logprobs: list[list[TokenLogprobs]] = [[] for _ in range(inp.n)]
            fins: list[Finished] = []
            async for event in self.frontend.complete(api_key, inp, request_id=rid,
                                                      trace_parent=trace_parent_from_metadata(grpc_context)):
                if isinstance(event, TextDelta):
                    text[event.index].append(event.text)
                    token_ids[event.index].extend(event.token_ids)
                    logprobs[event.index].extend(event.logprobs)
                elif isinstance(event, Finished):
                    fins.append(event)
            if len(fins) != inp.n:
                raise RuntimeError(f"the frontend ended the stream with {len(fins)} Finished events for n={inp.n}")
        except Exception as e:
            _set_error(grpc_context, e, "Generate", rid)
            return pb.GenerateResponse()
        fins.sort(key=lambda f: f.index)
        fin = fins[0]  # the top-level fields are choice 0's
        usage = _request_usage(fins)
        request_id = fin.request_id or _serve_request_id(grpc_context)
        if grpc_context is not None:
            grpc_context.set_trailing_metadata(success_trailers(fins[0], request_id, usage))
        choices = [pb.Choice(index=f.index, text="".join(text[f.index]), token_ids=token_ids[f.index],
                             finish_reason=f.finish_reason, logprobs=_logprobs_pb(tuple(logprobs[f.index])))
                   for f in fins]
        first = choices[0]
        return pb.GenerateResponse(
            text=first.text,
            token_ids=first.token_ids,
            finish_reason=first.finish_reason,
            usage=_usage_pb(usage),
            model=fin.model,
            pool=fin.pool,
            replica=fin.replica,
            request_id=request_id,
            logprobs=first.logprobs,
            choices=choices,
        )

    async def GenerateStream(
        self, request: pb.GenerateRequest, grpc_context: Any = None
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        rid = _new_request_id(request)
        events = None
        fins: list[Finished] = []
        try:
            inp = completion_input_from_request(request, grpc_context)
            api_key = api_key_from_metadata(grpc_context)
            events = self.frontend.complete(api_key, inp, request_id=rid,
                                            trace_parent=trace_parent_from_metadata(grpc_context))
            async for event in events:
                if isinstance(event, TextDelta):
                    yield pb.GenerateStreamResponse(text=event.text, token_ids=event.token_ids,
                                                    logprobs=_logprobs_pb(event.logprobs), index=event.index)
                elif isinstance(event, Finished):
                    fins.append(event)
                    if len(fins) == inp.n:
                        break
                    # a choice that ends before the last one: its own message (finished stays false)
                    yield pb.GenerateStreamResponse(finish_reason=event.finish_reason, index=event.index)
            if len(fins) != inp.n:
                raise RuntimeError(f"the frontend ended the stream with {len(fins)} Finished events for n={inp.n}")
        except Exception as e:
            _set_error(grpc_context, e, "GenerateStream", rid)
            if self.stream_error_carrier:  # before or after the first message: the status travels with it
                yield pb.GenerateStreamResponse()
                return
            raise
        finally:
            if events is not None and hasattr(events, "aclose"):
                await events.aclose()
        # Serve sends the context's trailing metadata along with a yielded message: set
        # the success trailers before the last one.
        fin = fins[-1]
        usage = _request_usage(fins)
        request_id = fin.request_id or _serve_request_id(grpc_context)
        if grpc_context is not None:
            grpc_context.set_trailing_metadata(success_trailers(fin, request_id, usage))
        yield pb.GenerateStreamResponse(
            finished=True,
            finish_reason=fin.finish_reason,
            usage=_usage_pb(usage),
            model=fin.model,
            pool=fin.pool,
            replica=fin.replica,
            request_id=request_id,
            index=fin.index,
        )

    async def ListModels(self, request: pb.ListModelsRequest, grpc_context: Any = None) -> pb.ListModelsResponse:
        try:
            cards = self.frontend.list_models(api_key_from_metadata(grpc_context))
            if inspect.isawaitable(cards):
                cards = await cards
            cards = list(cards)
        except Exception as e:
            _set_error(grpc_context, e, "ListModels")
            return pb.ListModelsResponse()
        return pb.ListModelsResponse(models=[pb.Model(id=c.id, pool=c.pool, owned_by=c.owned_by, created=c.created,
                                                          max_model_len=c.max_model_len) for c in cards])

    async def ReportTaskOutcome(self, request: pb.ReportTaskOutcomeRequest,
                                grpc_context: Any = None) -> pb.TaskOutcome:
        """HTTP's ``POST /v1/tasks/{task_id}``: the same checks and errors (NOT_FOUND, FAILED_PRECONDITION,
        INVALID_ARGUMENT naming ``task_id`` or ``outcome``)."""
        try:
            report = await report_task_outcome(self.frontend, self.ledger, api_key_from_metadata(grpc_context),
                                               request.task_id, request.outcome)
        except Exception as e:
            _set_error(grpc_context, e, "ReportTaskOutcome")
            return pb.TaskOutcome()
        return pb.TaskOutcome(task_id=report.task_id, outcome=report.outcome, requests=report.requests,
                              cost=usd(report.cost_pico),
                              pools={p: pb.TaskPoolSpend(requests=v["requests"], cost=usd(v["cost_pico"]))
                                     for p, v in report.pools.items()})
