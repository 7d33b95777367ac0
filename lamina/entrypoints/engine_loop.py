"""`EngineLoop`: runs an `LLMEngine` in one background thread for concurrent callers
(the HTTP server, or any multi-threaded client).

Data in: `submit(prompt, params)` from any thread; the request is validated at once in
the caller's thread (bad input raises there, nothing is queued). Data out: a
`concurrent.futures.Future` resolved with the `RequestOutput` when the request finishes;
with `on_update`, also each step's partial output (streaming), called from the loop
thread. `abort(future)` stops a request (its client went away) and frees its KV; the
future then resolves with finish reason "abort". Only the loop thread touches the
engine. A request the engine failed alone (`RequestOutput.error`) resolves its future
with `RequestFailed`; the others go on. A failed step the engine recovers from (workers
replaced, KV kept or recomputed) is invisible here; one it cannot recover from fails every
request in flight with that error, loudly, and the loop stops taking new work
(`EngineDead`). While it holds no request it checks the workers every
`EngineConfig.idle_check_s` (`LLMEngine.check_workers`: a dead or hung one replaced
before a request needs it), and each time it goes idle it sends the workers what the
last steps left them (`LLMEngine.flush`: tables to drop, tier orders) and hands the
memory freed since back to the system (`release_freed_memory`; under load that never
lets it go idle, every `TRIM_BUSY_S` between steps). With `max_waiting`, `submit`
refuses a request (`EngineOverloaded`) while that many are queued and not yet running.
`drain(timeout_s)` (a server's SIGTERM) finishes the requests already taken, refuses new
ones (`EngineDead`) and stops when none is left or at the timeout. `call(fn)` runs work on
the engine itself between two steps (`scale_memory_workers`), on the loop thread.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from lamina.engine.engine import LLMEngine
from lamina.engine.outputs import RequestOutput
from lamina.entrypoints.autoscale import on_loop
from lamina.errors import EngineDead, EngineOverloaded, RequestFailed
from lamina.sampling.params import SamplingParams

log = logging.getLogger(__name__)

__all__ = ["EngineDead", "EngineLoop", "EngineOverloaded", "RequestFailed", "beside"]
T = TypeVar("T")
TRIM_BUSY_S = 30.0  # under load, at most this long between two `release_freed_memory`


@dataclass(frozen=True)
class _Add:
    """A request handed to the loop thread by `submit`."""
    prompt: Any  # str or token ids, validated already
    params: SamplingParams
    future: Future
    on_update: Callable[[RequestOutput], None] | None
    session_id: str | None
    priority: int


@dataclass(frozen=True)
class _Abort:
    future: Future  # of the request to stop


@dataclass(frozen=True)
class _Call:
    """Work on the engine itself, run by the loop thread between two steps (`call`)."""
    fn: Callable[[LLMEngine], Any]
    future: Future


class EngineLoop:
    def __init__(self, engine: LLMEngine, metrics=None, max_waiting: int | None = None,
                 thread: bool = True):
        """`metrics`: an `EngineMetrics` this loop keeps up to date (or None).
        `max_waiting`: requests queued (submitted, not yet running) before `submit`
        refuses more; None: no bound. `thread`: run in a thread of its own; False: the
        caller runs it (`run`), e.g. on the thread that built the model, where a local
        executor's steps are fastest (see `run`)."""
        if max_waiting is not None and (not isinstance(max_waiting, int)
                                        or isinstance(max_waiting, bool) or max_waiting < 1):
            raise ValueError(f"max_waiting must be an int >= 1 or None, got {max_waiting!r}")
        self.engine, self.metrics, self.max_waiting = engine, metrics, max_waiting
        self._inbox: queue.SimpleQueue[_Add | _Abort | _Call] = queue.SimpleQueue()
        self._futures: dict[int, Future] = {}
        self._rids: dict[Future, int] = {}
        self._updates: dict[int, Callable] = {}
        self.stats = {"finished": 0, "aborted": 0, "failed": 0, "rejected": 0}
        self._wake = threading.Event()
        self._stop = False
        self._busy_at = time.monotonic()  # the latest step, or idle check of the workers
        self._stepped = False  # a step ran since the loop was last idle
        self._trimmed_at = time.monotonic()  # the latest `release_freed_memory`
        self.error: BaseException | None = None
        self._keep_going: Callable[[], bool] = lambda: True  # `run`'s condition
        self._drain_until: float | None = None  # `drain`'s deadline (time.monotonic)
        self._drain_s = 0.0
        self._thread: threading.Thread | None = None
        if engine.keeper is not None:  # its grows now go in between this loop's steps
            engine.keeper = engine.keeper.through(on_loop(self))
        if thread:
            self._thread = threading.Thread(target=self._run, name="lamina-engine",
                                            daemon=True)
            self._thread.start()

    def submit(self, prompt, params: SamplingParams, validated: bool = False,
               on_update: Callable[[RequestOutput], None] | None = None,
               session_id: str | None = None, priority: int = 0) -> Future:
        """`validated`: the caller already ran `engine.validate` on this prompt and
        `check_capacity` for it. `on_update`: called (in the loop thread) with each
        step's partial output. `session_id`: the conversation it continues (checked
        here); `priority`: its place under scheduling_policy "priority"."""
        if self.error is not None:
            raise EngineDead(f"engine stopped after a failed step: {self.error}")
        if self._drain_until is not None:
            raise EngineDead("the server is shutting down: it finishes the requests it "
                             "has and takes no new ones")
        if not validated:  # raises ValueError / TypeError here
            self.engine.validate(prompt, params, session_id, priority)
            self.check_capacity()
        fut: Future = Future()
        self._inbox.put(_Add(prompt, params, fut, on_update, session_id, priority))
        self._wake.set()
        if not self.alive:  # lost the race
            self._drain(EngineDead(f"engine stopped: {self.error or 'its loop was shut down'}"))
        return fut

    def waiting(self) -> int:
        """Requests submitted and not yet running (read from any thread: approximate)."""
        return self._inbox.qsize() + len(self.engine.scheduler.waiting)

    def check_capacity(self, extra: int = 1) -> None:
        """Raise `EngineOverloaded` if `extra` more requests would pass `max_waiting`."""
        if self.max_waiting is None:
            return
        n = self.waiting()
        if n + extra > self.max_waiting:
            self.stats["rejected"] += 1
            if self.metrics is not None:
                self.metrics.rejected.labels("overloaded").inc()
            raise EngineOverloaded(n, self.max_waiting)

    def abort(self, fut: Future) -> None:
        """Stop the request behind `fut` if it still runs; safe from any thread."""
        if not fut.done():
            self._inbox.put(_Abort(fut))
            self._wake.set()

    def call(self, fn: Callable[[LLMEngine], T]) -> Future:
        """Run `fn(engine)` on the loop thread between two steps (the engine is not
        thread-safe; e.g. `LLMEngine.scale_memory_workers`) -> a future of its result
        or its exception. The requests in flight go on after it."""
        if not self.alive:
            raise EngineDead(f"engine stopped: {self.error or 'its loop was shut down'}")
        fut: Future = Future()
        self._inbox.put(_Call(fn, fut))
        self._wake.set()
        if not self.alive:  # lost the race
            self._drain(EngineDead(f"engine stopped: {self.error or 'its loop was shut down'}"))
        return fut

    def generate(self, prompt, params: SamplingParams, timeout: float | None = None
                 ) -> RequestOutput:
        return self.submit(prompt, params).result(timeout)

    @property
    def threaded(self) -> bool:
        """Whether this loop runs in a thread of its own (else the caller runs it)."""
        return self._thread is not None

    @property
    def alive(self) -> bool:
        return self.error is None and (self._thread.is_alive() if self._thread is not None
                                       else not self._stop)

    @property
    def draining(self) -> bool:
        return self._drain_until is not None

    def drain(self, timeout_s: float) -> None:
        """Finish the requests already taken and refuse new ones; the loop stops when
        none is left, or after `timeout_s` (those still running then fail with
        `EngineDead` naming the timeout). Safe from any thread and from a signal
        handler: it only sets a deadline, which the loop reads between steps and at
        least every 50 ms when idle. No `_wake.set()`: a handler that ran while this
        thread held the event's (non-reentrant) lock would wait on it forever."""
        self._drain_s = timeout_s
        self._drain_until = time.monotonic() + timeout_s

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the loop thread to end (`shutdown`, a drain, or a step it could not
        recover from: then `error` says why) -> whether it has ended."""
        if self._thread is None:
            raise RuntimeError("this EngineLoop runs on its caller's thread (`run`)")
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def shutdown(self, timeout: float = 10.0) -> None:
        if self.engine.keeper is not None:  # nobody steps the engine now
            self.engine.keeper.stop()
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def run(self, keep_going: Callable[[], bool] = lambda: True) -> None:
        """Serve in the calling thread (a loop made with thread=False) until `shutdown`
        or until `keep_going()` turns false (checked between steps). Why: with libgomp,
        torch's intra-op threads spin between parallel regions only while the process
        has no more OpenMP threads than cores; a second thread running torch (the
        engine beside the thread that built the model) makes them sleep instead, and a
        B=16 bf16 decode step on 2 cores took 1.4-1.5x longer there
        (benchmarks/engine_thread_probe.py)."""
        if self._thread is not None:
            raise RuntimeError("this EngineLoop runs in its own thread already")
        self._keep_going = keep_going
        try:
            self._run()
        finally:  # also after an interrupt mid-step: nobody is left waiting
            self._fail_all(EngineDead("engine loop interrupted"))

    # -- the loop thread --
    def _admit(self) -> None:
        aborted = False
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                if aborted:  # its KV is free now, whether or not a step follows
                    self._refresh_metrics()
                return
            if isinstance(msg, _Call):
                self._run_call(msg)
                continue
            if isinstance(msg, _Abort):
                rid = self._rids.get(msg.future)
                out = self.engine.abort(rid) if rid is not None else None
                if out is not None:
                    self.stats["aborted"] += 1
                    aborted = True
                    if self.metrics is not None:
                        self.metrics.request(out, aborted=True)
                    self._resolve(out)
                continue
            fut = msg.future
            if not fut.set_running_or_notify_cancel():
                continue  # the caller gave up before it was scheduled
            try:
                rid = self.engine.add_request(msg.prompt, msg.params,
                                              stream=msg.on_update is not None,
                                              session_id=msg.session_id,
                                              priority=msg.priority)
            except Exception as e:  # noqa: BLE001 - validated already; report, keep going
                fut.set_exception(e)
                continue
            self._futures[rid], self._rids[fut] = fut, rid
            if msg.on_update is not None:
                self._updates[rid] = msg.on_update

    def _run_call(self, msg: _Call) -> None:
        if not msg.future.set_running_or_notify_cancel():
            return
        try:
            result = msg.fn(self.engine)
        except Exception as e:  # noqa: BLE001 - the caller's to handle; the loop goes on
            self._refresh_metrics()
            msg.future.set_exception(e)
        else:
            self._refresh_metrics()  # (before the caller hears of it)
            msg.future.set_result(result)

    def _resolve(self, out: RequestOutput) -> None:
        fut = self._futures.pop(out.request_id)
        self._rids.pop(fut, None)
        self._updates.pop(out.request_id, None)
        if out.error is not None:
            self.stats["failed"] += 1
            fut.set_exception(RequestFailed(out.request_id, out.error))
        else:
            fut.set_result(out)

    def _drained(self) -> bool:
        """Draining, and nothing is left to finish or the deadline has passed."""
        if self._drain_until is None:
            return False
        return time.monotonic() >= self._drain_until or (not self._futures
                                                         and self._inbox.empty())

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as e:  # a bug here must not leave the waiters hanging
            log.exception("the engine loop failed; failing every request it holds")
            self.error = e
            self._fail_all(e)

    def _loop(self) -> None:
        while not self._stop and self._keep_going() and not self._drained():
            self._admit()
            try:
                if not self.engine.has_unfinished():
                    if self._stepped:  # idle after work: once, before waiting
                        self._stepped = False
                        self.engine.flush()
                        self._release_freed_memory()
                    self._check_idle()
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                outs = self.engine.step()
            except Exception as e:  # noqa: BLE001 - fail every waiter loudly, then stop
                self.error = e
                self._fail_all(e)
                return
            self._busy_at, self._stepped = time.monotonic(), True
            self._measure(outs)
            self._deliver(outs)
            if self._busy_at - self._trimmed_at >= TRIM_BUSY_S and \
                    self.engine.has_unfinished():  # (else the idle one comes next)
                self._release_freed_memory()  # after the step's tokens are out
        self._fail_all(EngineDead(
            f"the server shut down: its drain ({self._drain_s:g} s) ended before this "
            "request finished" if self._drain_until is not None else "engine loop shut down"))

    def _check_idle(self) -> None:
        """Idle for `idle_check_s` since the latest step or check: check the workers
        (raises when they cannot be brought back: the loop stops, loudly)."""
        every = getattr(getattr(self.engine, "config", None), "idle_check_s", None)
        if every is None or time.monotonic() - self._busy_at < every:
            return
        try:
            found = self.engine.check_workers()
        except Exception:  # the workers could not be brought back: the loop stops
            self._refresh_metrics()
            raise
        if found:  # workers replaced: /metrics shows it now, not after the next step
            self._refresh_metrics()
        self._busy_at = time.monotonic()

    def _measure(self, outs: list[RequestOutput]) -> None:
        """The step and its finished requests into the metrics; a failure there is
        logged, not allowed to stop serving."""
        if self.metrics is None:
            return
        try:
            self.metrics.step(self.engine, self.engine.step_timings[-1]["drawn"])
            for out in outs:
                if out.finished:
                    self.metrics.request(out)
        except Exception:  # a metrics bug must not stop serving
            log.exception("updating the metrics after a step failed")

    def _deliver(self, outs: list[RequestOutput]) -> None:
        for out in outs:
            if out.finished:
                self.stats["finished"] += 1
                self._resolve(out)
                continue
            try:
                self._updates[out.request_id](out)
            except Exception:  # a broken listener must not stop serving
                log.exception("on_update for request %d failed", out.request_id)

    def _release_freed_memory(self) -> None:
        release_freed_memory()
        self._trimmed_at = time.monotonic()

    def _refresh_metrics(self) -> None:
        if self.metrics is None:
            return
        try:
            self.metrics.refresh(self.engine)
        except Exception:  # a metrics bug must not stop serving
            log.exception("updating the metrics failed")

    def _fail_all(self, e: BaseException) -> None:
        """Stop taking work and fail every request still waiting or running with `e`."""
        self._stop = True  # first: a submit from now on fails at once
        for fut in self._futures.values():
            if not fut.done():
                fut.set_exception(e)
        self._futures.clear()
        self._rids.clear()
        self._updates.clear()
        self._drain(e)

    def _drain(self, e: BaseException) -> None:
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(msg, (_Add, _Call)) and msg.future.set_running_or_notify_cancel():
                msg.future.set_exception(e)


def beside(loop: EngineLoop, fn: Callable[[], T], stop: Callable[[], None] | None = None,
           join_s: float = 30.0) -> T:
    """Run `fn` on a new thread while this thread runs `loop` (made with thread=False;
    `EngineLoop.run` says why) until `fn` returns -> its result, or its exception. On
    the way out (`fn` done, the loop stopped, Ctrl-C), `stop()` asks `fn` to finish and
    the loop fails whatever still waits on it."""
    box: dict = {}

    def target():
        try:
            box["out"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["err"] = e

    worker = threading.Thread(target=target, name="lamina-client", daemon=True)
    worker.start()
    try:
        loop.run(keep_going=worker.is_alive)
    finally:
        if stop is not None:
            stop()
        worker.join(join_s)
    if "err" in box:
        raise box["err"]
    return box.get("out")  # type: ignore[return-value]


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    if os.environ.get("LAMINA_MALLOC_TRIM", "1") == "0":  # off (the probe's baseline)
        return None
    try:  # glibc's; musl and other libcs have none
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def release_freed_memory() -> None:
    """Hand the memory this process has freed back to the system. glibc keeps what a
    long-running server frees (every batch shape's tensors, requests' buffers) in its
    heaps and arenas, and its RSS creeps up: under a steady load `lamina serve` grew 58 MB
    from 250 to 3000 requests, 16 MB when trimmed (`benchmarks/server_rss_probe.py`,
    benchmarks/RESULTS.md). About 1-2 ms a call (a 2.3 GB process): the loop makes it
    when it goes idle, and under load once every `TRIM_BUSY_S` (the next step starts
    that much later). `LAMINA_MALLOC_TRIM=0`: off."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
