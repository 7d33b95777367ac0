"""Ctrl-C during `LLM.generate`: the step in flight ends before the call stops.

Data in: SIGINT while a synchronous call drives the engine in the main thread.
Data out: `StepBoundary.asked`, read by the call between steps (it then aborts its
requests and raises KeyboardInterrupt, leaving the engine as it was before the call).

Why not Python's own KeyboardInterrupt: raised wherever the main thread is, it cuts a
step part-way (a slot table half sent, the KV of a prompt half written, a worker
mid-layer), and the engine must then reset its workers and drop its prefix cache
(`LLMEngine.step`) to trust nothing the step half did. Held to the step's end, a Ctrl-C
costs at most one step (which ends in bounded time: the workers' timeouts). A second
Ctrl-C is the way out of a step the user will not wait for: Python's KeyboardInterrupt
at once, and that reset.
"""
from __future__ import annotations

import logging
import signal
import threading

log = logging.getLogger(__name__)


class StepBoundary:
    """`with StepBoundary() as stop:` ... `if stop.asked: raise KeyboardInterrupt` after
    each step. Only in the main thread, and only over Python's own SIGINT handler (one
    a program installed is left alone, and so is SIGINT in other threads, which never
    receive it)."""

    def __init__(self):
        self.asked = False
        self._before = None

    def __enter__(self) -> StepBoundary:
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            self._before = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc) -> None:
        if self._before is not None:
            signal.signal(signal.SIGINT, self._before)
            self._before = None

    def _on_sigint(self, signum, frame) -> None:
        if self.asked:
            raise KeyboardInterrupt
        self.asked = True
        log.warning("Ctrl-C: stopping once the step in flight ends (Ctrl-C again stops "
                    "it now; the engine then resets its workers)")
