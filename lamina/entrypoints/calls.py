"""`LLM.generate` called from several threads at once, over one engine.

Data in: each call's validated requests (prompt, `SamplingParams`, session id,
priority). Data out: each call's `RequestOutput`s, by prompt index, once all its own
have finished.

The engine is plain Python and not thread-safe: two threads stepping it at once broke
a step (`ValueError: seq 2: 0 slots from position 2 ...`, one call's request lost).
Here one thread at a time is inside the engine (adding requests, stepping, aborting);
a step runs for every call's requests, so calls from several threads batch together
as a server's requests do, and each call returns as soon as its own outputs are in,
whichever thread's step drew them. A request added to the engine directly (not through
`generate`) would be stepped to its end with its output lost: a call refuses to start
beside one.

Why not the server's `EngineLoop` (one thread of its own steps, callers wait on
futures): here the steps run on the callers' own threads. A script's single call then
steps on the main thread, the one that built the model, where libgomp's threads keep
spinning between regions (a step on another thread took 1.4-1.5x as long:
docs/engine.md), and its Ctrl-C stays its own (`interrupts.py`).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from lamina.engine.outputs import RequestOutput
from lamina.errors import EngineDead


@dataclass(frozen=True)
class CallRequest:
    """One prompt of a call, validated."""
    prompt: Any
    params: Any  # SamplingParams
    session_id: str | None = None
    priority: int = 0


class Call:
    """One `generate` call: its outputs by prompt index, how many are still running."""

    def __init__(self, n: int, on_output=None):
        self.results: list[RequestOutput | None] = [None] * n
        self.left = n
        self.error: Exception | None = None  # a step's error it ends with
        self._on_output = on_output  # e.g. a progress bar's update

    @property
    def over(self) -> bool:
        return not self.left or self.error is not None

    def done(self, index: int, out: RequestOutput) -> None:
        self.results[index] = out
        self.left -= 1
        if self._on_output is not None:
            self._on_output(1)


class SharedEngine:
    """The engine, entered by one thread at a time; `add`, `run` and `abort` are a
    call's three uses of it."""

    def __init__(self, engine):
        self.engine = engine
        self._owner: dict[int, tuple[Call, int]] = {}  # request id -> (call, prompt index)
        # turns in arrival order (a ticket each): a thread stepping in a loop would
        # otherwise take the engine again before the others woke, and run its call alone
        self._cv = threading.Condition()
        self._issued = self._serving = 0
        self._gone: set[int] = set()  # tickets given up while waiting
        self._closed: str | None = None  # why calls are refused (`close`)

    def close(self, why: str) -> None:
        """Refuse calls from now on, and the steps of those in flight, saying `why`."""
        self._closed = why

    def check_open(self) -> None:
        if self._closed is not None:
            raise EngineDead(self._closed)

    def _enter(self, call: Call | None = None) -> bool:
        """Wait for the engine, in turn. With `call`: False (not entered) once another
        thread's step has finished the call's requests, or failed."""
        with self._cv:
            ticket, self._issued = self._issued, self._issued + 1
            try:
                while self._serving != ticket:
                    if call is not None and call.over:
                        self._gone.add(ticket)
                        return False
                    self._cv.wait()
            except BaseException:  # a second Ctrl-C while waiting: the turn is given up
                self._gone.add(ticket)
                raise
            if call is not None and call.over:
                self._next()
                return False
            return True

    def _leave(self) -> None:
        with self._cv:
            self._next()

    def _next(self) -> None:
        self._serving += 1
        while self._serving in self._gone:
            self._gone.remove(self._serving)
            self._serving += 1
        self._cv.notify_all()

    def add(self, call: Call, requests: list[CallRequest]) -> None:
        """Queue the call's requests, all or none (one half-added is aborted too)."""
        self._enter()
        try:
            self.check_open()
            held = self.engine.request_ids()
            others = sorted(held - self._owner.keys())
            if others:
                raise RuntimeError(
                    f"the engine holds requests added to it directly (ids {others[:8]}): "
                    "LLM.generate steps every request its engine holds, so it would run "
                    "them to their end and drop their outputs; step or abort them first")
            try:
                for i, r in enumerate(requests):
                    rid = self.engine.add_request(r.prompt, r.params, session_id=r.session_id,
                                                  priority=r.priority)
                    self._owner[rid] = (call, i)
            except BaseException:
                for rid in sorted(self.engine.request_ids() - held):
                    self._owner.pop(rid, None)
                    self.engine.abort(rid)
                raise
        finally:
            self._leave()

    def run(self, call: Call, stop) -> None:
        """Step until the call's requests have finished, or `stop.asked` (a Ctrl-C held
        to the step's end); each step's finished outputs go to their calls. A step's
        error (the engine could not recover from it) ends every call whose requests it
        held, as a step's error stops a server's loop: each raises it, and its requests
        are aborted, the engine left as before those calls."""
        while not call.over and not stop.asked:
            if not self._enter(call):
                break
            try:
                if stop.asked:  # asked while another thread's step ran
                    return
                self.check_open()
                self._step()
            finally:
                self._leave()
        if call.error is not None:
            raise call.error

    def _step(self) -> None:
        try:
            outs = self.engine.step()
        except Exception as e:
            for other, _ in self._owner.values():
                other.error = e
            raise
        for out in outs:
            owner = self._owner.pop(out.request_id, None) if out.finished else None
            if owner is not None:
                owner[0].done(owner[1], out)
        if not self.engine.has_unfinished():  # idle: what its workers are owed, now
            self.engine.flush()

    def call(self, fn):
        """`fn(engine)` in turn with the calls' steps (between two of them) -> its result."""
        self._enter()
        try:
            self.check_open()
            return fn(self.engine)
        finally:
            self._leave()

    def abort(self, call: Call) -> None:
        """Abort the call's unfinished requests (a Ctrl-C, or an error leaving it)."""
        self._enter()
        try:
            for rid in sorted(r for r, (c, _) in self._owner.items() if c is call):
                del self._owner[rid]
                self.engine.abort(rid)
        finally:
            self._leave()
