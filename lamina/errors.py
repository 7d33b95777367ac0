"""The errors a request or a step can end with, shared by the engine, the executors and
the entry points (so each layer catches them by type, not by message).

- `SequenceFault`: raised inside a step by the compute side, a memory side or an
  executor when the failure is caused by particular sequences (their data), naming
  them. `clean` says whether the step broke off before any worker changed state in a way
  that matters (then the engine re-runs it without those sequences) or not (then the
  executor must `recover` first).
- `RequestFailed`: what the caller of one failed request gets; the engine keeps running.
- `EngineOverloaded`: the bounded waiting queue is full; retry later (HTTP 429).
- `EngineDead`: the engine stopped (a failure it could not recover from); new requests
  are refused.

Each pickles with its fields (`__reduce__`): the Lamina service raises them at its
clients in other processes (Ray pickles an exception with its `args` alone, which
these constructors do not take).
"""
from __future__ import annotations


class SequenceFault(RuntimeError):
    """A step failed because of these sequences' data."""

    def __init__(self, seq_ids, message: str, clean: bool = True):
        self.seq_ids = tuple(int(s) for s in seq_ids)
        self.clean = clean
        super().__init__(message)

    def __reduce__(self):
        return type(self), (self.seq_ids, str(self), self.clean)


class RequestFailed(RuntimeError):
    """One request failed inside the engine; other requests were not affected."""

    def __init__(self, request_id: int, message: str):
        self.request_id = request_id
        super().__init__(message)

    def __reduce__(self):
        return type(self), (self.request_id, str(self))


class EngineOverloaded(RuntimeError):
    """The waiting queue is at its bound (`max_waiting`); nothing was queued."""

    def __init__(self, waiting: int, limit: int, retry_after_s: float = 1.0):
        self.waiting, self.limit, self.retry_after_s = waiting, limit, retry_after_s
        super().__init__(f"server busy: {waiting} requests waiting (limit {limit}); "
                         f"retry in {retry_after_s:g} s")

    def __reduce__(self):
        return type(self), (self.waiting, self.limit, self.retry_after_s)


class EngineDead(RuntimeError):
    """The engine loop stopped after a failed step; new requests are refused."""
