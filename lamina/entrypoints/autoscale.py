"""Autoscaling the KV pool: memory workers added under KV pressure, removed when idle.

Data in: every `interval_s`, a `KVSample` of the engine (taken on its loop's thread:
slots held by requests, sequences waiting, preemptions so far). Data out: a change of
memory workers (`scale_beside`: the new ones started beside the steps, added between
two; `LLMEngine.scale_memory_workers`), one worker at a time, within
[min_memory_workers, max_memory_workers].

The rule (`Autoscaler`, plain Python over samples, like the scheduler): one more worker
when for `up_after_s` every sample had its pools at least `up_utilization` held by
requests (not the prefix cache, which yields) and demand went unmet in that time
(sequences waiting, or one preempted for room); one fewer when for `down_after_s` what
requests held would have fit one worker fewer at most `down_utilization` full, nobody
waited and nobody was preempted. After a change it waits `cooldown_s` and a whole window
of new samples. Requests are admitted that fit `max_memory_workers`' pools (with
`split_kv`; `LLMEngine.allow_growth`): a sequence that needs more workers than there are
waits for them, and the next sample grows the pool to its size at once (no window, no
cooldown); one that has waited `grow_wait_s` fails alone, by name. On a Ray cluster
whose autoscaler launches nodes for pending placement groups (`ray up` with
`available_node_types`), a worker that has no room waits for its node
(`placement_timeout_s`) beside the steps: the pool and the machines grow together.

Without an autoscaler, `KeepSize` holds a Ray deployment at its size: memory workers
lost for good at a recovery (their node gone, no room for a replacement) come back
once the cluster holds them again (a node joins).
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Callable

from lamina.engine.outputs import MemoryScale
from lamina.errors import EngineDead

log = logging.getLogger(__name__)


def check_seconds(name: str, value, note: str = "") -> None:
    """`value` is a finite number of seconds >= 0; else ValueError naming `name` (and
    `note`, what 0 means)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            0 <= value < math.inf):
        raise ValueError(f"{name} must be a number of seconds >= 0{note}, got {value!r}")


@dataclass(frozen=True)
class AutoscaleConfig:
    """The `autoscale` section of a deployment; off unless `max_memory_workers` is set."""
    max_memory_workers: int | None = None  # None: no autoscaling
    min_memory_workers: int = 1
    interval_s: float = 5.0  # between two samples
    up_utilization: float = 0.9  # of every pool's slots held by requests
    up_after_s: float = 15.0  # that long, with demand unmet, before one more worker
    down_utilization: float = 0.5  # of one worker fewer's slots, were they all gone
    down_after_s: float = 300.0  # that long idle enough before one fewer
    cooldown_s: float = 60.0  # after a change, before the next
    grow_wait_s: float = 120.0  # a sequence waits that long for the workers it needs

    def __post_init__(self):
        if self.max_memory_workers is not None and (
                not isinstance(self.max_memory_workers, int)
                or not 1 <= self.min_memory_workers <= self.max_memory_workers):
            raise ValueError(f"autoscale: need 1 <= min_memory_workers <= max_memory_workers, "
                             f"got {self.min_memory_workers} and {self.max_memory_workers}")
        for name in ("interval_s", "up_after_s", "down_after_s", "cooldown_s", "grow_wait_s"):
            check_seconds(f"autoscale.{name}", getattr(self, name))
        if self.interval_s <= 0:
            raise ValueError(f"autoscale.interval_s must be > 0, got {self.interval_s!r}")
        for name in ("up_utilization", "down_utilization"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
                raise ValueError(f"autoscale.{name} must be in (0, 1], got {v!r}")
        if self.down_utilization >= self.up_utilization:
            raise ValueError("autoscale.down_utilization must be below up_utilization "
                             f"({self.down_utilization} >= {self.up_utilization}): a pool "
                             "would grow and shrink in turn")

    @property
    def enabled(self) -> bool:
        return self.max_memory_workers is not None


@dataclass(frozen=True)
class KVSample:
    """The engine's KV state at one moment (`sample`)."""
    at: float  # time.monotonic()
    workers: int
    slots: int  # each worker's
    used: int  # slots requests hold, every worker (the prefix cache's are free to take)
    waiting: int  # sequences waiting to run
    preemptions: int  # sequences preempted so far (a counter)
    needed: int = 0  # memory workers a waiting sequence needs (`Scheduler.short`; 0: none)

    @property
    def utilization(self) -> float:
        return self.used / (self.workers * self.slots)


def sample(engine) -> KVSample:
    """`engine`'s `KVSample` now (call it on the engine's thread: `EngineLoop.call`)."""
    slots, short = engine.config.num_kv_slots, engine.scheduler.short
    return KVSample(time.monotonic(), len(engine.allocs), slots,
                    slots * len(engine.allocs) - sum(engine.free_slots()),
                    len(engine.scheduler.waiting), engine.scheduler.num_preemptions,
                    short.workers if short is not None else 0)


class Autoscaler:
    """The rule above over the samples it is given; `observe` -> the memory workers
    wanted, or None to stay."""

    def __init__(self, config: AutoscaleConfig):
        self.config = config
        self.samples: deque[KVSample] = deque()
        self.changed_at = -math.inf  # time.monotonic() of the last change
        self.why = ""  # why the last change was wanted

    def observe(self, s: KVSample) -> int | None:
        c = self.config
        if self.samples and self.samples[-1].workers != s.workers:
            self.samples.clear()  # changed (by anyone): a new window
        self.samples.append(s)
        keep = max(c.up_after_s, c.down_after_s)
        while len(self.samples) > 1 and s.at - self.samples[1].at >= keep:
            self.samples.popleft()  # the first kept is at least `keep` old
        assert c.max_memory_workers is not None
        if s.workers < s.needed <= c.max_memory_workers:  # a sequence waits for them
            return self._change(s, s.needed, f"a waiting sequence needs {s.needed} "
                                "memory workers' pools")
        if s.at - self.changed_at < c.cooldown_s:
            return None
        if s.workers < c.max_memory_workers and self._up(s):
            return self._change(s, s.workers + 1, f"pools >= {c.up_utilization:.0%} held "
                                f"for {c.up_after_s:g} s with sequences waiting or preempted")
        if s.workers > c.min_memory_workers and self._down(s):
            return self._change(s, s.workers - 1, f"for {c.down_after_s:g} s what requests "
                                f"held fit {s.workers - 1} workers at "
                                f"<= {c.down_utilization:.0%}")
        if not c.min_memory_workers <= s.workers <= c.max_memory_workers:
            n = min(max(s.workers, c.min_memory_workers), c.max_memory_workers)
            return self._change(s, n, "outside the bounds")
        return None

    def _window(self, s: KVSample, seconds: float) -> list[KVSample] | None:
        """The samples of the last `seconds` (None: they do not cover that long yet)."""
        if s.at - self.samples[0].at < seconds:
            return None
        return [x for x in self.samples if s.at - x.at <= seconds]

    def _up(self, s: KVSample) -> bool:
        w = self._window(s, self.config.up_after_s)
        if not w:
            return False
        unmet = any(x.waiting for x in w) or w[-1].preemptions > w[0].preemptions
        return unmet and all(x.utilization >= self.config.up_utilization for x in w)

    def _down(self, s: KVSample) -> bool:
        w = self._window(s, self.config.down_after_s)
        if not w:
            return False
        room = self.config.down_utilization * (s.workers - 1) * s.slots
        return (not any(x.waiting for x in w) and w[-1].preemptions == w[0].preemptions
                and all(x.used <= room for x in w))

    def _change(self, s: KVSample, n: int, why: str) -> int:
        self.changed_at, self.why = s.at, why
        self.samples.clear()
        return n


@dataclass(frozen=True)
class ScaleChange:
    """One change an `AutoscaleRunner` made."""
    at: float  # time.monotonic()
    done: MemoryScale
    why: str


def scale_beside(engine, n: int, between: Callable[[Callable], MemoryScale]) -> MemoryScale:
    """`engine` to `n` memory workers, the new ones started on this thread beside its
    steps (`Executor.start_memory_workers`) and added by `between(fn)`, which runs
    `fn(engine)` between two steps and returns its result (`SharedEngine.call`; for an
    `EngineLoop`: `on_loop(loop)`). Started workers the engine never got (the loop or
    engine stopped first) are stopped again."""
    have = len(engine.allocs)
    started = engine.executor.start_memory_workers(have, n - have) if n > have else None
    handed = False

    def change(e) -> MemoryScale:
        nonlocal handed
        handed = True  # from here on the engine stops them itself if it must
        return e.scale_memory_workers(n, started)
    try:
        return between(change)
    except BaseException:
        if started is not None and not handed:
            engine.executor.discard_memory_workers(started)
        raise


def on_loop(loop) -> Callable[[Callable], MemoryScale]:
    """`scale_beside`'s `between` for an `EngineLoop`: `fn` run by its thread."""
    return lambda fn: loop.call(fn).result()


class AutoscaleRunner:
    """An `Autoscaler` beside an `EngineLoop`, on a thread of its own: a sample every
    `interval_s`, and the change it wants through `scale` (default `scale_beside`).
    `changes`: what it did. While it runs, the engine admits requests that fit
    `max_memory_workers` (`LLMEngine.allow_growth`)."""

    def __init__(self, loop, config: AutoscaleConfig, scale=None):
        self.loop, self.config = loop, config
        # (from this thread: two fields the engine reads each step; a loop run by the
        # caller's thread, `serve`'s, has not started yet)
        loop.engine.allow_growth(config.max_memory_workers, config.grow_wait_s)
        self.policy = Autoscaler(config)
        self._scale = scale or (lambda n: scale_beside(loop.engine, n, on_loop(loop)))
        self.changes: list[ScaleChange] = []
        self.error: str | None = None  # the last change's failure
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lamina-autoscale",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """No more changes; the engine no longer waits for workers (a sequence that
        does wait fails alone at its next step)."""
        self._stop.set()
        self._thread.join(timeout)
        self.loop.engine.allow_growth(None)

    def _run(self) -> None:
        while not self._stop.wait(self.config.interval_s):
            if not self.loop.alive:
                return
            try:
                s = self.loop.call(sample).result(60)
            except (FutureTimeout, Exception) as e:  # noqa: BLE001 - the loop stopped: done
                log.warning("autoscale: no sample of the engine (%s: %s)", type(e).__name__, e)
                continue
            n = self.policy.observe(s)
            if n is not None:
                self._apply(n, s)

    def _apply(self, n: int, s: KVSample) -> None:
        log.info("autoscale: memory workers %d -> %d (%s)", s.workers, n, self.policy.why)
        try:
            done = self._scale(n)
        except Exception as e:  # noqa: BLE001 - logged; tried again after the cooldown
            self.error = f"{s.workers} -> {n}: {type(e).__name__}: {e}"
            log.warning("autoscale: %s", self.error)
            return
        self.error = None
        self.changes.append(ScaleChange(time.monotonic(), done, self.policy.why))


REGROW_MAX_S = 300.0  # the longest wait between two tries to grow back


class KeepSize:
    """Grows an engine back to its size in memory workers, on a thread of its own.

    A Ray deployment can have fewer memory workers than its size: a recovery dropped
    one whose replacement could not start (its node lost, no room elsewhere), or a
    service restarted short of room. Every `every` s (0: never) while it has fewer than
    `size()` and the engine is open, this asks the executor how many the cluster holds
    now (`Executor.memory_workers_room`; None: this executor never drops one, and the
    thread ends) and, where more than it has, grows to that many (`scale_beside`:
    started on this thread beside the steps, added by `between`), holding `lock` (the
    owner's: a `scale` is not run beside it). The size is unchanged. A failed grow (the
    room held by another deployment: a placement timeout) waits twice as long before
    the next, up to REGROW_MAX_S. For status: `why` it has fewer, and what the last
    try `failed` with (None once one does not)."""

    def __init__(self, engine: Callable, size: Callable[[], int],
                 between: Callable[[Callable], MemoryScale], lock, every: float, who: str,
                 why: str | None = None):
        self.engine, self.size, self.between, self.lock = engine, size, between, lock
        self.every, self.who = every, who
        # why it has fewer memory workers than its size: the owner's reason (a restart
        # short of room) or the last grow's; None: all there, or not known
        self.why = why
        self.failed: str | None = None  # the last try's failure, until one does not fail
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lamina-regrow", daemon=True)
        if every:
            self._thread.start()

    @property
    def running(self) -> bool:
        """It still tries (not stopped; its executor can drop workers)."""
        return self._thread.is_alive()

    def through(self, between: Callable[[Callable], MemoryScale] | None = None,
                every: float | None = None) -> KeepSize:
        """This one stopped, and one like it whose changes go through `between` (None:
        this one's; an `EngineLoop` that now steps the engine: `on_loop`) every `every`
        s (None: as this one; 0: never)."""
        self.stop()
        return KeepSize(self.engine, self.size, between or self.between, self.lock,
                        self.every if every is None else every, self.who, self.why)

    def stop(self, timeout: float = 10.0) -> None:
        """No more tries (a grow under way ends first, at most `timeout` s waited)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def missing(self) -> int:
        """Memory workers it has fewer than its size."""
        return max(0, self.size() - len(self.engine().allocs))

    def _run(self) -> None:
        wait = self.every
        while not self._stop.wait(wait):
            try:
                if not self.grow_back():
                    return  # an executor that never drops a worker
                wait, self.failed = self.every, None
            except EngineDead:
                return
            except Exception as e:  # noqa: BLE001 - said in status; tried again later
                wait = min(2 * wait, max(self.every, REGROW_MAX_S))
                self.failed = f"{type(e).__name__}: {e}; next try in {wait:g} s"
                log.warning("%s: growing back failed: %s", self.who, self.failed)

    def grow_back(self) -> bool:
        """One try: memory workers -> as many as the cluster holds, at most the size
        (the size unchanged). False when the executor cannot tell (never drops one)."""
        with self.lock:
            if self._stop.is_set():
                return True
            engine, size = self.engine(), self.size()
            engine.check_open()
            live = len(engine.allocs)
            if live >= size:
                self.why = None
                return True
            room = engine.executor.memory_workers_room(size)
            if room is None:
                return False
            if room <= live:
                return True  # no room yet
            done = scale_beside(engine, room, self.between)
            log.info("%s grew back to %d of its %d memory workers", self.who, done.after,
                     size)
            self.why = None if done.after >= size else (
                f"grew back to {done.after}: the cluster's resources hold no more now")
            return True
