"""Sessions: where each conversation's saved KV lives beyond the pools, and the orders
that move it (the engine's index of the memory workers' `lamina.memory.tiers`).

Data in: a request's `session_id` when it is queued (`queued`), its finished sequence's
tokens and slots (`saved`), the scheduler's admissions (`match`, `load`), and a step's
`TierMiss` (`forget`). Data out: `TierOrder`s for the next step's plan (`take_orders`),
and the tier metrics.

Policy, with the queue in view (why the index lives in the engine, as the prefix cache
does): when a session's turn finishes, its KV is saved write-through to its worker's host
tier (only the positions not saved yet), ordered before any later step can reuse the
slots. The host tier is kept under its bound by demoting least recently used sessions to
disk (in the background), the disk tier by dropping them. A session with a queued turn is
never demoted or dropped, and queuing a turn whose KV is on disk orders a prefetch at
once, so the read runs while the turn waits; admission then loads the KV into fresh pool
slots layer by layer, in place of prefilling those positions. The scheduler also keeps
preempted sequences' KV here, each under a name of its own (`Scheduler._park`).
"""
from __future__ import annotations

import itertools
import logging
import re
from dataclasses import dataclass

from lamina.engine.prefix_cache import common_len
from lamina.memory.tier_orders import TierConfig, TierOrder

log = logging.getLogger(__name__)

SESSION_ID = re.compile(r"[A-Za-z0-9._:@-]{1,128}")


def check_session_id(session_id) -> str | None:
    """A session id as given, checked: None, or 1-128 characters of letters, digits and
    . _ : @ - (it names files and log lines). Raises ValueError naming the problem."""
    if session_id is None:
        return None
    if not isinstance(session_id, str) or not SESSION_ID.fullmatch(session_id):
        raise ValueError(f"session_id must be 1-128 characters of letters, digits and "
                         f". _ : @ -, got {session_id!r:.80}")
    return session_id


# the shortest run of tokens reused at shifted positions (shorter ones may be chance)
MIN_SHIFTED_RUN = 16


@dataclass(frozen=True)
class TierMatch:
    session: str  # the entry it matched (a session, or a preempted sequence's)
    worker: int
    prefix: int  # positions 0..prefix-1 match the saved ones where they are
    upto: int  # positions prefix..upto-1 match saved positions + shift
    shift: int  # 0: no run after dropped turns


@dataclass
class _Entry:
    id: int
    worker: int
    tokens: list[int]  # positions saved: KV of tokens[i] at position i
    host: bool  # in the host tier (or ordered there)
    disk: bool  # in a current disk file (or ordered there)
    tick: int


class SessionIndex:
    def __init__(self, config: TierConfig, bytes_per_token: int, truncation: bool = False):
        self.config, self.bytes_per_token = config, bytes_per_token
        self.truncation = truncation  # reuse KV after dropped turns at shifted positions
        self.sessions: dict[str, _Entry] = {}
        self._ids = itertools.count()
        self._clock = itertools.count(1)
        self._orders: list[TierOrder] = []
        # turns of each session waiting or running: such sessions are not demoted/dropped
        self.pins: dict[str, int] = {}
        self.metrics = {"tier_hit_tokens": 0, "tier_misses": 0, "prefetches": 0,
                        "saved_tokens": 0, "demoted": 0, "dropped": 0, "shifted_tokens": 0}

    # -- occupancy --
    def _bytes(self, e: _Entry) -> int:
        return len(e.tokens) * self.bytes_per_token

    def host_bytes(self) -> int:
        return sum(self._bytes(e) for e in self.sessions.values() if e.host)

    def disk_bytes(self) -> int:
        return sum(self._bytes(e) for e in self.sessions.values() if e.disk)

    # -- events --
    def queued(self, session: str) -> None:
        """A turn of `session` was queued: pin it; bring disk-only KV back at once."""
        self.pins[session] = self.pins.get(session, 0) + 1
        e = self.sessions.get(session)
        if e is None:
            return
        e.tick = next(self._clock)
        if not e.host and e.disk:
            e.host = True
            self._orders.append(TierOrder("prefetch", e.worker, e.id))
            self.metrics["prefetches"] += 1
            self._balance()

    def done(self, session: str) -> None:
        left = self.pins.pop(session, 0) - 1
        if left > 0:
            self.pins[session] = left
        else:
            self._balance()  # unpinned: it may now move down a tier

    def saved(self, session: str, worker: int, tokens: list[int], slots: list[int]) -> int:
        """A turn finished (or a sequence was preempted, `Scheduler._park`) with
        `tokens`' KV at `slots` on `worker`: save what the tier lacks (from the first
        position that differs from what it holds). -> the positions ordered saved."""
        e = self.sessions.get(session)
        if e is not None and (e.worker != worker or not e.host):
            self._drop(e)  # elsewhere, or only on disk: save the whole history anew
            e = None
        if e is None:
            e = self.sessions[session] = _Entry(next(self._ids), worker, [], True, False, 0)
        same = common_len(e.tokens, tokens, 0, len(tokens))
        if same < len(tokens):
            self._orders.append(TierOrder("save", worker, e.id, same, tuple(slots[same:])))
            self.metrics["saved_tokens"] += len(tokens) - same
        e.tokens, e.disk, e.tick = list(tokens), False, next(self._clock)
        self._balance()
        return len(tokens) - same

    def match(self, session: str | None, tokens: list[int], limit: int) -> TierMatch | None:
        """What of `tokens` (its first `limit` at most) the session's saved KV holds:
        a common prefix, then (with truncation reuse) the longest run found later in
        the saved history (the turns between were dropped). None if nothing."""
        e = self.sessions.get(session) if session is not None else None
        if session is None or e is None or not (e.host or e.disk):
            return None
        k0 = common_len(e.tokens, tokens, 0, limit)
        upto, shift = k0, 0
        if self.truncation and k0 < limit:
            j, m = _later_run(e.tokens, tokens, k0, limit)
            if m >= MIN_SHIFTED_RUN:
                upto, shift = k0 + m, j - k0
        return TierMatch(session, e.worker, k0, upto, shift) if upto else None

    def load(self, session: str, seq_id: int, start: int, slots: list[int],
             shift: int = 0) -> None:
        """Admission took positions start..start+len(slots)-1 from the tiers (from
        saved positions start+shift.., keys re-rotated)."""
        e = self.sessions[session]
        e.host, e.tick = True, next(self._clock)
        self._orders.append(TierOrder("load", e.worker, e.id, start, tuple(slots), seq_id,
                                      shift))
        self.metrics["tier_hit_tokens"] += len(slots)
        self.metrics["shifted_tokens"] += len(slots) if shift else 0

    def forget(self, entries, loads=()) -> list[str]:
        """Entries a `TierMiss` found gone (`loads`: the orders that missed, not hits
        after all): drop them; -> their sessions."""
        self.metrics["tier_hit_tokens"] -= sum(len(o.slots) for o in loads)
        gone = [s for s, e in self.sessions.items() if e.id in set(entries)]
        for s in gone:
            self._drop(self.sessions[s])
            del self.sessions[s]
        self.metrics["tier_misses"] += len(gone)
        return gone

    def discard(self, session: str) -> None:
        """Drop an entry no longer wanted (a preempted sequence's, once it ended)."""
        e = self.sessions.pop(session, None)
        if e is not None and (e.host or e.disk):
            self._orders.append(TierOrder("drop", e.worker, e.id))  # not a bound's drop

    def relocated(self, moved: dict[str, int]) -> None:
        """Entries now in another worker's host tier ({key: worker}; moved off a leaving
        worker, `Executor.move_tiers`)."""
        for key, w in moved.items():
            e = self.sessions[key]
            e.worker, e.host, e.disk = w, True, False
        self._balance()

    def lost_worker(self, worker: int) -> None:
        """A memory worker was replaced: its tiers are gone, and the orders not sent yet
        to it with them (a save from slots of a pool that is gone would keep an entry
        no index names)."""
        for s in [s for s, e in self.sessions.items() if e.worker == worker]:
            del self.sessions[s]
        self._orders = [o for o in self._orders if o.worker != worker]

    def has_orders(self) -> bool:
        return bool(self._orders)

    def take_orders(self) -> tuple[TierOrder, ...]:
        out, self._orders = tuple(self._orders), []
        return out

    # -- bounds --
    def _balance(self) -> None:
        """Demote (host -> disk) and drop least recently used unpinned sessions until
        both tiers are under their bounds."""
        lru = sorted((e for s, e in self.sessions.items() if s not in self.pins),
                     key=lambda e: e.tick)
        over = self.host_bytes() - self.config.host_bytes
        for e in (x for x in lru if x.host):
            if over <= 0:
                break
            over -= self._bytes(e)
            e.host = False
            if self.config.disk_dir is not None and self._bytes(e) <= self.config.disk_bytes:
                e.disk = True
                self._orders.append(TierOrder("demote", e.worker, e.id))
                self.metrics["demoted"] += 1
            else:
                if self.config.disk_dir is not None:
                    log.warning("a session's KV (%d bytes) exceeds the disk tier's %d bytes: "
                                "dropped (its next turn is computed)", self._bytes(e),
                                self.config.disk_bytes)
                self._drop(e)
        over = self.disk_bytes() - self.config.disk_bytes
        for e in (x for x in lru if x.disk):
            if over <= 0:
                break
            over -= self._bytes(e)
            self._drop(e)
        for s in [s for s, e in self.sessions.items() if not (e.host or e.disk)]:
            del self.sessions[s]

    def _drop(self, e: _Entry) -> None:
        e.host = e.disk = False
        self._orders.append(TierOrder("drop", e.worker, e.id))
        self.metrics["dropped"] += 1


def _later_run(saved: list[int], tokens: list[int], at: int, limit: int) -> tuple[int, int]:
    """(j, m): the longest run saved[j:j+m] == tokens[at:at+m] with j > at, m <= limit -
    at; (0, 0) if none. Candidates are where tokens[at] occurs (the first 64)."""
    best, j, tried = (0, 0), at, 0
    while tried < 64 and at < limit:
        try:
            j = saved.index(tokens[at], j + 1)
        except ValueError:
            break
        tried += 1
        m = common_len(saved[j:], tokens, at, limit)
        if m > best[1]:
            best = (j, m)
    return best

