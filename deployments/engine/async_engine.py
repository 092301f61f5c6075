"""asyncio front of an :class:`Engine` for Serve replicas.

While there is work, one thread steps the engine back to back (``engine.step()`` after
``engine.step()``) and hands each step's outputs to the event loop
(``loop.call_soon_threadsafe``), which routes them to per-request queues; with no work left the
thread returns and a background task sleeps on an :class:`asyncio.Event` until a request
arrives. The steps never wait for the event loop: a loop busy with other work (arriving
handoffs, Serve's messages, the streams' chunks) delays only the delivery of outputs, not the
next step, and there is no loop → thread → loop wake-up per step (on a CPU shared with other
processes each wake-up can wait for a time slice). Every engine call (add, abort, step,
has_unfinished) holds one lock, so the event loop and the step thread never touch the engine at
once. New requests and aborts are queued on the loop and taken by the step thread right before
its next step: every request that arrived during a step joins the next one (adding each in a
worker thread of its own would park one thread per arrival on the lock, and asyncio's small
default pool admitted only a few per step), and the loop is never blocked behind a step.
The engine follows the event loop it is used from (tests run one ``asyncio.run`` after another):
a step run started for a loop that has since been replaced takes no queued work.

    async with contextlib.aclosing(async_engine.generate(req)) as outputs:
        async for out in outputs:
            ...

``stream_interval_s``: a request's outputs are routed through a :class:`StreamBatcher`, so
its consumer takes one merged output per interval instead of one per step.

``gather_wait_s`` / ``gather_gap_s`` (a prefill replica's burst window): requests that reach an
idle engine are held before its first step while more keep arriving, until none has arrived
for ``gather_gap_s`` or ``gather_wait_s`` has passed since the wait began, or as soon as the requests
held fill a step (their tokens still to compute reach ``max_num_batched_tokens``, or they number
``max_num_seqs``): later arrivals could only join the next step. Concurrent requests
reach a replica spread over tens of milliseconds (the ingress takes them one after another);
without the window the first runs a step alone and the rest wait for it, then reach decode
one step apart. The window never applies while the engine has work: arrivals during a step
join the next one anyway. A lone request pays ``gather_gap_s``, unless its caller says no other is on its way
(``generate(hold=False)``).

A consumer that stops early (``aclose()``, task cancellation on client disconnect) aborts
its request: one still queued for the next step is taken off the queue and never added; one
in the engine is aborted right after the step under way (its slot is free before the next).

``step_nice`` (a prefill replica's prefill share, :func:`nice_for_share`): how many nice levels the
thread that runs the steps sits below its process (at most 19; Linux schedules threads, and the event
loop keeps the process's priority, so replies go out at once). Relative, because Ray starts every
worker process at nice 15. Where the wanted level is past 19 (under Ray, 15 + 5 for the default share
0.25), nice 19 alone would still take about 29% of a core shared with a thread at 15 (CFS weights 15
vs 36), more than the share allows, so the step thread also goes under ``SCHED_IDLE`` (weight 3, about
8%; a task waking on a core that runs only idle-policy threads takes it at once). When another process
wants the same core (a decode replica beside it) the kernel gives that one the larger part; an idle
core still gives the steps all of it.

A failed step fails only its requests: their generators raise
:class:`~deployments.engine.errors.EngineStepError`, and the engine steps on. Once the engine
is broken (:attr:`Engine.broken`, or anything unexpected in the step loop), every waiting
generator and every later call raises :class:`~deployments.engine.errors.EngineBroken`;
:attr:`healthy` is False and :meth:`check_health` raises it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from .engine import Engine
from .errors import EngineBroken, EngineStepError
from .sequence import GenerationRequest, RequestOutput, merge_outputs
from .stream_batcher import StreamBatcher

_T = TypeVar("_T")

log = logging.getLogger(__name__)


def _to_compute(req: GenerationRequest, kwargs: dict[str, Any]) -> int:
    """Tokens an added request still has to run through the model: its prompt and replayed output, less what a
    cached prefix or a handed-off state (``Engine.add_request``'s keywords) already covers."""
    n = len(req.prompt_ids) + len(kwargs.get("replay_ids", ()))
    for key in ("cached_prefix", "resume_state"):
        state = kwargs.get(key)
        if state is not None:
            n -= state.position
    return max(n, 0)


_NICE_STEP = 1.25  # Linux CFS: each nice level weighs about 1.25x less than the one below it
MAX_NICE = 19


def nice_for_share(share: float) -> int:
    """The nice value at which a thread competing for one core with a nice-0 thread gets about ``share``
    of it (CFS weights ``1024 / 1.25**nice``): 0 for a share of 0.5 or more, 5 for 0.25, at most 19."""
    if not 0 < share <= 1:
        raise ValueError(f"share must be in (0, 1], got {share!r}")
    if share >= 0.5:
        return 0
    return min(MAX_NICE, round(math.log((1 - share) / share, _NICE_STEP)))


class AsyncEngine:
    def __init__(self, engine: Engine, *, gather_wait_s: float = 0.0, gather_gap_s: float = 0.0,
                 step_nice: int = 0) -> None:
        if not 0 <= gather_gap_s <= gather_wait_s:
            raise ValueError(f"need 0 <= gather_gap_s <= gather_wait_s, got gather_gap_s={gather_gap_s!r}, "
                             f"gather_wait_s={gather_wait_s!r}")
        if not (isinstance(step_nice, int) and 0 <= step_nice <= MAX_NICE):
            raise ValueError(f"step_nice must be an integer in 0..{MAX_NICE}, got {step_nice!r}")
        self.engine = engine
        self.step_nice = step_nice
        self._niced: set[int] = set()  # native ids of the step threads already lowered
        # the one thread that runs the steps (only it takes step_nice; aborts and others use the loop's pool)
        self._step_thread = ThreadPoolExecutor(1, thread_name_prefix="engine-step")
        self.gather_wait_s, self.gather_gap_s = gather_wait_s, gather_gap_s
        self._lock = threading.Lock()  # held for every engine call
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}  # per live generator
        self._batchers: dict[str, StreamBatcher] = {}  # per live generator with a stream interval
        self._adds: list[tuple[GenerationRequest, dict[str, Any], asyncio.Future[None]]] = []  # for the next step
        self._no_hold: set[str] = set()  # request ids added with hold=False: an idle engine steps for them at once
        self._aborts: list[tuple[str, asyncio.Future[None]]] = []  # request ids to abort before the next step
        self._pending = threading.Lock()  # guards _adds, _aborts and _owner_loop (the loop appends, the step thread takes)
        self._owner_loop: asyncio.AbstractEventLoop | None = None  # the loop whose step runs may take queued work
        self._wake: asyncio.Event | None = None  # set when work may have arrived; made on the running loop
        self._loop_task: asyncio.Task[None] | None = None
        self._error: EngineBroken | None = None  # why the engine stopped for good
        self._closed = False

    async def generate(self, req: GenerationRequest, *, coalesce: bool = False, stream_interval_s: float = 0.0,
                       hold: bool = True, **add_kwargs: Any) -> AsyncIterator[RequestOutput]:
        """Add ``req`` (``add_kwargs`` go to :meth:`Engine.add_request`) and yield its outputs
        until the finished one. Stopping early aborts the request. Raises EngineStepError when
        a step with the request failed, EngineBroken when the engine is (or becomes) broken.

        ``coalesce``: when the consumer has fallen behind the engine, yield everything already
        queued for the request as one merged output (no added latency: nothing waits for more
        tokens; a stream crossing processes pays its per-item cost once per merged output).

        ``stream_interval_s``: hold outputs back and yield them merged, at most one per interval
        after the first (see :class:`StreamBatcher`); 0 yields each step's output.

        ``hold``: False when the caller knows no other request is on its way (an idle engine's burst window
        then ends with this request's arrival instead of waiting out its gap)."""
        self._check_alive()
        rid = req.request_id
        if rid in self._queues:
            raise ValueError(f"request_id {rid!r} is already being generated")
        batcher = StreamBatcher(stream_interval_s) if stream_interval_s else None  # raises for a bad interval
        self._start()
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[rid] = queue
        if batcher is not None:
            self._batchers[rid] = batcher
        added: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        with self._pending:
            self._adds.append((req, add_kwargs, added))
            if not hold:
                self._no_hold.add(rid)
        self._wake.set()  # type: ignore[union-attr]  # made by _start
        finished = False
        try:
            await asyncio.shield(added)
            while not finished:
                item = await queue.get()
                while coalesce and not isinstance(item, BaseException) and not item.finished and not queue.empty():
                    nxt = queue.get_nowait()
                    item = nxt if isinstance(nxt, BaseException) else merge_outputs(item, nxt)
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            del self._queues[rid]
            self._batchers.pop(rid, None)
            with self._pending:
                self._no_hold.discard(rid)
            if not finished and not self._unqueue(added):
                await self._abort_once_added(added, rid)

    async def shutdown(self) -> None:
        """Stop the step loop after the current step; waiting generators raise RuntimeError
        (and abort their requests)."""
        self._closed = True
        if self._loop_task is not None:
            self._wake.set()  # type: ignore[union-attr]
            await self._loop_task
        self._fail_adds(RuntimeError("AsyncEngine was shut down"))
        self._end_aborts()
        for queue in self._queues.values():
            queue.put_nowait(RuntimeError("AsyncEngine was shut down"))
        self._step_thread.shutdown(wait=False)

    @property
    def healthy(self) -> bool:
        """False once the engine is broken (a replica then reports itself unhealthy)."""
        return self._error is None and self.engine.broken is None

    def check_health(self) -> None:
        """Raise EngineBroken when the engine is broken."""
        if self._error is not None:
            raise self._error
        if self.engine.broken is not None:
            raise self.engine.broken

    # -- internals ----------------------------------------------------------------
    def _call(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        with self._lock:
            return fn(*args, **kwargs)

    def _check_alive(self) -> None:
        self.check_health()
        if self._closed:
            raise RuntimeError("AsyncEngine was shut down")

    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop_task is None or (self._loop_task.done() and self._error is None) or self._loop_task.get_loop() is not loop:
            # first use, or a new event loop (a finished loop's task can never step again)
            with self._pending:  # from here on only a step run for this loop takes queued work
                self._owner_loop = loop
            self._wake = asyncio.Event()
            self._loop_task = loop.create_task(self._run(self._wake))

    async def _run(self, wake: asyncio.Event) -> None:
        try:
            await self._steps(wake)
        except Exception as e:  # a bug in the loop itself: nobody would be served again
            broken = EngineBroken(f"engine step loop failed: {e!r}")
            broken.__cause__ = e
            self._stop(broken)

    async def _steps(self, wake: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        while not self._closed:
            wake.clear()
            if self.gather_wait_s and self._adds and not self._call(self.engine.has_unfinished):
                await self._gather(wake)
            if not self._adds and not self._aborts and not self._call(self.engine.has_unfinished):
                await wake.wait()
                continue
            broken = await loop.run_in_executor(self._step_thread, self._step_until_idle, loop)
            if broken is not None:
                self._stop(broken)
                return

    def _step_until_idle(self, loop: asyncio.AbstractEventLoop) -> EngineBroken | None:
        """In the step thread: take the queued aborts and adds, step, hand the outputs to the loop, and again,
        until there is nothing left to do (None) or the engine broke (the EngineBroken to stop with)."""
        self._lower_priority()
        while not self._closed:
            with self._pending:
                if self._owner_loop is not loop:
                    # a run for a finished loop (asyncio.run returned while it stepped): the queued work is the
                    # new loop's, and outputs handed to this loop would never be delivered
                    return None
                adds, self._adds = self._adds, []
                aborts, self._aborts = self._aborts, []
            errors, outputs, failure, stepped = self._add_and_step([(r, kw) for r, kw, _ in adds], [r for r, _ in aborts])
            if adds or aborts or stepped:
                loop.call_soon_threadsafe(self._deliver, adds, errors, aborts, outputs, failure)
            if failure is not None and self.engine.broken is not None:
                return self.engine.broken
            if failure is not None and not isinstance(failure, EngineStepError):  # Engine.step has no other failure: a bug
                broken = EngineBroken(f"engine step raised {failure!r}")
                broken.__cause__ = failure
                return broken
            if not stepped:
                return None
        return None

    def _deliver(self, adds: list[tuple[GenerationRequest, dict[str, Any], asyncio.Future[None]]],
                 errors: list[Exception | None], aborts: list[tuple[str, asyncio.Future[None]]],
                 outputs: list[RequestOutput], failure: Exception | None) -> None:
        """On the loop: one step's results to the callers (the adds' and aborts' futures, the outputs' queues)."""
        for (_, _, added), err in zip(adds, errors):
            if not added.done():  # done: its caller was cancelled
                added.set_result(None) if err is None else added.set_exception(err)
        for _, done in aborts:
            if not done.done():
                done.set_result(None)
        if isinstance(failure, EngineStepError):
            for rid in failure.request_ids:
                if (queue := self._queues.get(rid)) is not None:
                    queue.put_nowait(failure)
        now = time.monotonic()
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is None:  # its consumer is gone (aborted)
                continue
            batcher = self._batchers.get(out.request_id)
            if batcher is None or (out := batcher.push(out, now)) is not None:
                queue.put_nowait(out)

    async def _gather(self, wake: asyncio.Event) -> None:
        """Wait while requests keep arriving at an idle engine (see the module docstring)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.gather_wait_s
        while not self._closed and (left := deadline - loop.time()) > 0 and not self._first_step_full():
            wake.clear()
            try:
                await asyncio.wait_for(wake.wait(), min(self.gather_gap_s, left))
            except TimeoutError:
                return  # nothing arrived for a gap

    def _first_step_full(self) -> bool:
        """Whether the requests held for an idle engine's first step already fill it, or one of them came with
        ``hold=False`` (see the module docstring)."""
        config = self.engine.config
        with self._pending:
            if len(self._adds) >= config.max_num_seqs or any(req.request_id in self._no_hold for req, _, _ in self._adds):
                return True
            tokens = sum(_to_compute(req, kwargs) for req, kwargs, _ in self._adds)
        return tokens >= config.max_num_batched_tokens

    def _add_and_step(self, adds: list[tuple[GenerationRequest, dict[str, Any]]], aborts: list[str]) -> tuple[
            list[Exception | None], list[RequestOutput], Exception | None, bool]:
        """In the step thread: abort ``aborts``, add ``adds``, then step once if there is work; each add's error
        (None when added), the step's outputs, the step's exception, and whether there was a step to run."""
        with self._lock:
            for rid in aborts:
                self.engine.abort(rid)
            errors: list[Exception | None] = []
            for req, kwargs in adds:
                try:
                    self.engine.add_request(req, **kwargs)
                    errors.append(None)
                except Exception as e:  # bad input: raised to that request's caller
                    errors.append(e)
            if not self.engine.has_unfinished():
                return errors, [], None, False
            try:
                return errors, self.engine.step(), None, True
            except Exception as e:
                return errors, [], e, True

    def _lower_priority(self) -> None:
        """Lower the calling (step) thread ``step_nice`` levels below the priority it started at (which
        it inherits from the process), once, at most to 19; where that would go past 19 (a Ray worker starts at
        15), also put it under ``SCHED_IDLE`` (see the module docstring). Never raises it back (that needs
        privileges)."""
        tid = threading.get_native_id()
        if not self.step_nice or tid in self._niced:
            return
        self._niced.add(tid)
        try:
            start = os.getpriority(os.PRIO_PROCESS, tid)
            target = min(MAX_NICE, start + self.step_nice)
            if target > start:
                os.setpriority(os.PRIO_PROCESS, tid, target)
            if start + self.step_nice > MAX_NICE:  # the share is below what nice 19 gives: the idle policy
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except OSError as e:  # not Linux, or a sandbox that forbids it: the steps run at the process's priority
            log.warning("could not lower the engine step thread's priority by %d nice levels: %s", self.step_nice, e)

    def _stop(self, error: EngineBroken) -> None:
        """The engine is broken: fail every waiting caller with ``error``, step no more."""
        self._error = error
        self._fail_adds(error)
        self._end_aborts()
        for queue in self._queues.values():
            queue.put_nowait(error)

    def _unqueue(self, added: asyncio.Future[None]) -> bool:
        """Take a request whose add is still queued off the queue (True), so it never reaches the engine."""
        with self._pending:
            for i, (_, _, fut) in enumerate(self._adds):
                if fut is added:
                    del self._adds[i]
                    return True
        return False

    def _fail_adds(self, error: BaseException) -> None:
        """Requests queued for a step that will never come: their callers raise ``error``."""
        with self._pending:
            adds, self._adds = self._adds, []
        for _, _, added in adds:
            if not added.done():
                added.set_exception(error)

    def _end_aborts(self) -> None:
        """Aborts queued for a step that will never come: their callers stop waiting (nothing runs any more)."""
        with self._pending:
            aborts, self._aborts = self._aborts, []
        for _, done in aborts:
            if not done.done():
                done.set_result(None)

    async def _abort_once_added(self, added: asyncio.Future[None], rid: str) -> None:
        """Abort ``rid`` after its add has landed; nothing when the add failed or the engine is dead."""
        try:
            await asyncio.shield(added)
        except Exception:
            return  # the add raised: that error is already on its way to the caller
        if self._error is None and not self._closed:
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            with self._pending:
                self._aborts.append((rid, done))  # taken by the step thread before its next step
            self._wake.set()  # type: ignore[union-attr]  # made by _start (generate ran)
            await asyncio.shield(done)
