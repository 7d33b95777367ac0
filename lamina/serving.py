"""`EngineLoop`: runs an `LLMEngine` in one background thread for concurrent callers
(the HTTP server, or any multi-threaded client).

Data in: `submit(prompt, params)` from any thread; the request is validated at once in
the caller's thread (bad input raises there, nothing is queued). Data out: a
`concurrent.futures.Future` resolved with the `RequestOutput` when the request finishes.
Only the loop thread touches the engine. If a step fails (a dead worker), every request
in flight fails with that error, loudly, and the loop stops taking new work.
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future

from .engine import LLMEngine, RequestOutput
from .sampling import SamplingParams


class EngineDead(RuntimeError):
    """The engine loop stopped after a failed step; new requests are refused."""


class EngineLoop:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # (prompt, params, future)
        self._futures: dict[int, Future] = {}
        self._wake = threading.Event()
        self._stop = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="lamina-engine", daemon=True)
        self._thread.start()

    def submit(self, prompt, params: SamplingParams, validated: bool = False) -> Future:
        """`validated`: the caller already ran `engine.validate` on this prompt."""
        if self.error is not None:
            raise EngineDead(f"engine stopped after a failed step: {self.error}")
        if not validated:
            self.engine.validate(prompt, params)  # raises ValueError / TypeError here
        fut: Future = Future()
        self._inbox.put((prompt, params, fut))
        self._wake.set()
        if self.error is not None or not self._thread.is_alive():
            self._drain(EngineDead(f"engine stopped: {self.error}"))  # lost the race
        return fut

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
                prompt, params, fut = self._inbox.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue  # the caller gave up before it was scheduled
            try:
                self._futures[self.engine.add_request(prompt, params)] = fut
            except Exception as e:  # noqa: BLE001 - validated already; report, keep going
                fut.set_exception(e)

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
                self._drain(e)
                return
            for out in outs:
                self._futures.pop(out.request_id).set_result(out)
        gone = EngineDead("engine loop shut down")
        for fut in self._futures.values():
            fut.set_exception(gone)
        self._futures.clear()
        self._drain(gone)

    def _drain(self, e: BaseException) -> None:
        while True:
            try:
                _, _, fut = self._inbox.get_nowait()
            except queue.Empty:
                return
            if fut.set_running_or_notify_cancel():
                fut.set_exception(e)
