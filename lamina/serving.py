"""`EngineLoop`: runs an `LLMEngine` in one background thread for concurrent callers
(the HTTP server, or any multi-threaded client).

Data in: `submit(prompt, params)` from any thread; the request is validated at once in
the caller's thread (bad input raises there, nothing is queued). Data out: a
`concurrent.futures.Future` resolved with the `RequestOutput` when the request finishes;
with `on_update`, also each step's partial output (streaming), called from the loop
thread. `abort(future)` stops a request (its client went away) and frees its KV; the
future then resolves with finish reason "abort". Only the loop thread touches the
engine. A failed step the engine recovers from (workers replaced, KV recomputed) is
invisible here; one it cannot recover from fails every request in flight with that
error, loudly, and the loop stops taking new work.
"""
from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from typing import Callable

from .engine import LLMEngine, RequestOutput
from .sampling import SamplingParams

log = logging.getLogger(__name__)


class EngineDead(RuntimeError):
    """The engine loop stopped after a failed step; new requests are refused."""


class EngineLoop:
    def __init__(self, engine: LLMEngine, metrics=None):
        """`metrics`: an `EngineMetrics` this loop keeps up to date (or None)."""
        self.engine, self.metrics = engine, metrics
        # ("add", prompt, params, future, on_update) | ("abort", future)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._futures: dict[int, Future] = {}
        self._rids: dict[Future, int] = {}
        self._updates: dict[int, Callable] = {}
        self.stats = {"finished": 0, "aborted": 0}
        self._wake = threading.Event()
        self._stop = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="lamina-engine", daemon=True)
        self._thread.start()

    def submit(self, prompt, params: SamplingParams, validated: bool = False,
               on_update: Callable[[RequestOutput], None] | None = None) -> Future:
        """`validated`: the caller already ran `engine.validate` on this prompt.
        `on_update`: called (in the loop thread) with each step's partial output."""
        if self.error is not None:
            raise EngineDead(f"engine stopped after a failed step: {self.error}")
        if not validated:
            self.engine.validate(prompt, params)  # raises ValueError / TypeError here
        fut: Future = Future()
        self._inbox.put(("add", prompt, params, fut, on_update))
        self._wake.set()
        if self.error is not None or not self._thread.is_alive():
            self._drain(EngineDead(f"engine stopped: {self.error}"))  # lost the race
        return fut

    def abort(self, fut: Future) -> None:
        """Stop the request behind `fut` if it still runs; safe from any thread."""
        if not fut.done():
            self._inbox.put(("abort", fut))
            self._wake.set()

    def generate(self, prompt, params: SamplingParams, timeout: float | None = None
                 ) -> RequestOutput:
        return self.submit(prompt, params).result(timeout)

    @property
    def alive(self) -> bool:
        return self.error is None and self._thread.is_alive()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)

    # -- the loop thread --
    def _admit(self) -> None:
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if msg[0] == "abort":
                rid = self._rids.get(msg[1])
                out = self.engine.abort(rid) if rid is not None else None
                if out is not None:
                    self.stats["aborted"] += 1
                    if self.metrics is not None:
                        self.metrics.request(out, aborted=True)
                    self._resolve(out)
                continue
            _, prompt, params, fut, on_update = msg
            if not fut.set_running_or_notify_cancel():
                continue  # the caller gave up before it was scheduled
            try:
                rid = self.engine.add_request(prompt, params, stream=on_update is not None)
            except Exception as e:  # noqa: BLE001 - validated already; report, keep going
                fut.set_exception(e)
                continue
            self._futures[rid], self._rids[fut] = fut, rid
            if on_update is not None:
                self._updates[rid] = on_update

    def _resolve(self, out: RequestOutput) -> None:
        fut = self._futures.pop(out.request_id)
        self._rids.pop(fut, None)
        self._updates.pop(out.request_id, None)
        fut.set_result(out)

    def _run(self) -> None:
        while not self._stop:
            self._admit()
            if not self.engine.has_unfinished():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                outs = self.engine.step()
            except Exception as e:  # noqa: BLE001 - fail every waiter loudly, then stop
                self.error = e
                for fut in self._futures.values():
                    fut.set_exception(e)
                self._futures.clear()
                self._rids.clear()
                self._updates.clear()
                self._drain(e)
                return
            if self.metrics is not None:
                self.metrics.step(self.engine, self.engine.step_timings[-1]["drawn"])
            for out in outs:
                if out.finished:
                    self.stats["finished"] += 1
                    if self.metrics is not None:
                        self.metrics.request(out)
                    self._resolve(out)
                    continue
                try:
                    self._updates[out.request_id](out)
                except Exception:  # noqa: BLE001 - a broken listener must not stop serving
                    log.exception("on_update for request %d failed", out.request_id)
        gone = EngineDead("engine loop shut down")
        for fut in self._futures.values():
            fut.set_exception(gone)
        self._futures.clear()
        self._rids.clear()
        self._updates.clear()
        self._drain(gone)

    def _drain(self, e: BaseException) -> None:
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if msg[0] == "add" and msg[3].set_running_or_notify_cancel():
                msg[3].set_exception(e)
