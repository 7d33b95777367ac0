"""Client leases: which of the service's requests each client holds, and when it was last
heard from, so that the requests of a client that went silent (its process died: a
driver killed, an HTTP front's process gone) are aborted instead of running to their
last token for nobody.

Data in: a request's key and its client's id as the request starts (`hold`), the
client's renewals (`heard`, every third of the lease: `client._renew`), the
request's end (`release`). Data out: `silent(now)`, the requests whose client has not
been heard from for longer than the lease, each given once.

Why a lease and not Ray: a streaming call whose caller died goes on to its end (a
3000-token request whose HTTP front was killed mid-stream kept running, 40 s and more,
before leases), and a caller's death is not an event an actor can subscribe to. Plain
Python over ids, called from the service's threads under one lock; time comes in as
arguments.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class Silent:
    key: str  # the request
    owner: str  # its client
    silent_s: float  # since the client was last heard from


class ClientLeases:
    def __init__(self, lease_s: float):
        if not lease_s > 0:
            raise ValueError(f"a lease must be > 0 s, got {lease_s!r}")
        self.lease_s = lease_s
        self._owner: dict[str, str] = {}  # request key -> its client
        self._heard: dict[str, float] = {}  # client -> when it was last heard from
        self._lock = threading.Lock()

    def hold(self, key: str, owner: str, now: float) -> None:
        """Request `key` starts for client `owner` (which is heard from, too)."""
        with self._lock:
            self._owner[key], self._heard[owner] = owner, now

    def heard(self, owner: str, now: float) -> None:
        with self._lock:
            self._heard[owner] = now

    def release(self, key: str) -> None:
        """Request `key` ended (or was never held: nothing)."""
        with self._lock:
            self._owner.pop(key, None)

    def silent(self, now: float) -> list[Silent]:
        """The requests whose client was last heard from more than `lease_s` ago, in
        the order they started; released here (each is given once), and clients with
        no request left and silent that long forgotten."""
        with self._lock:
            out = [Silent(k, o, now - self._heard[o]) for k, o in self._owner.items()
                   if now - self._heard[o] > self.lease_s]
            for s in out:
                del self._owner[s.key]
            held = set(self._owner.values())
            for o in [o for o, t in self._heard.items()
                      if o not in held and now - t > self.lease_s]:
                del self._heard[o]
            return out

    def clients(self) -> int:
        """Clients known: holding a request, or not yet silent past the lease."""
        with self._lock:
            return len(self._heard)
