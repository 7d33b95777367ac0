"""The Lamina service: one named, detached Ray actor that owns an engine and its workers,
so that every driver, Ray job and HTTP server on the cluster shares one deployment.

Data in: a `LaminaConfig` (`lamina up --config FILE`); then requests from clients
(`lamina.connect()`, cluster/client.py): `stream(key, prompt, params)` per request,
`abort(key)`, `status()`; the HTTP fronts' stored responses (`response_get/put/delete`).
Data out: each request's progress as a Ray streaming generator of `RequestOutput`
snapshots (cumulative, the last one final); a request the engine failed raises the local
API's exception (`RequestFailed`, `EngineDead`, `ValueError` for bad input) at the
client; a stored response, as a front put it.

Why a detached actor and not a Ray Serve deployment: the engine batches every request
of the cluster in one loop (`EngineLoop`) and its workers hold KV state, so it is one
stateful process, not a replicated stateless handler; Serve's router, autoscaler and
HTTP proxy would add a hop and a second HTTP stack (ours is `lamina serve --service`).
The workers are the actor's children: they and the deployment's placement group go with
it (`lamina down`, or the actor dying).

Why it restarts itself: a deployment shared by every job must not need an operator when
its process dies (a crash, the OOM killer) or its engine stops (workers that cannot be
brought back): Ray starts the actor again (`cluster.max_restarts`), which builds a new
engine, workers and placement group (the old ones went with the old process). The
requests it held fail at their clients with `EngineDead`, loudly; later ones wait for it
(cluster/client.py). Its restarts and the latest one's cause live in Ray's key-value
store, which outlives the process, so `status` can say why it restarted (at once, while
it restarts: `restarting_status`), and, once it is gone (no restart left, or a restart
that could not start), `find` can say why. Its stored responses are kept there too
(`KVResponses`): a conversation goes on through a restart.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict, replace
from typing import Callable, TypeVar

import ray
from prometheus_client import Gauge
from ray.experimental import internal_kv

from lamina.engine.outputs import MemoryScale
from lamina.entrypoints.api_responses import ResponseStore, Stored
from lamina.entrypoints.autoscale import AutoscaleRunner, KeepSize, on_loop, scale_beside
from lamina.entrypoints.deploy_config import LaminaConfig
from lamina.entrypoints.engine_loop import EngineLoop
from lamina.entrypoints.llm import LLM
from lamina.entrypoints.metrics import EngineMetrics
from lamina.errors import EngineDead

from .connect import connect_ray
from .leases import ClientLeases
from .placement import PlacementTimeout, memory_workers_that_fit

log = logging.getLogger(__name__)
NAMESPACE = "lamina"  # the services' Ray namespace: any driver finds them by name
SERVICE = "lamina"  # the default service name
START_TIMEOUT_S = 600  # model load + placement + workers
RESTART_GRACE_S = 2.0  # a stopped engine's errors reach their clients before the exit
HEAD_NODE = "node:__internal_head__"  # the resource only Ray's head node has
ROOM_POLL_S = 5.0  # how often a restart short of room looks again (`start_when_room`)
T = TypeVar("T")


class ServiceNotFound(LookupError):
    """No Lamina service of that name runs on the cluster."""


class ServiceError(RuntimeError):
    """The service could not be started (one of that name runs, or it failed)."""


class NoRoom(RuntimeError):
    """The cluster's resources cannot hold the fewest workers a restart may start."""


def start_when_room(start: Callable[[dict, bool], T], resources: Callable[[bool], dict],
                    wait_s: float, waiting: Callable[[str], None],
                    poll_s: float = ROOM_POLL_S) -> T:
    """`start(have, free)` until the cluster has room for it: first with its total
    resources (`resources(False)`); after `NoRoom` or a `PlacementTimeout`, every
    `poll_s` with what is free then (`resources(True)`: no placement is waited out
    again where nothing was freed), for at most `wait_s` in all; then `NoRoom` naming
    the last reason and the wait. `waiting(reason)` once for each new reason."""
    began, said, free = time.monotonic(), None, False
    while True:
        try:
            return start(resources(free), free)
        except (PlacementTimeout, NoRoom) as e:
            waited = time.monotonic() - began
            if waited + poll_s > wait_s:
                raise NoRoom(f"{e} (no room after {waited:.0f} s; cluster.room_wait_s "
                             f"{wait_s:g})") from None
            if str(e) != said:
                said = str(e)
                waiting(said)
            time.sleep(poll_s)
            free = True


class ServiceRestarting(EngineDead):
    """The service's engine stopped and the service is about to restart: a client waits
    for it (cluster/client.py) instead of taking the stopped engine's `EngineDead`."""


@ray.remote(num_cpus=0)  # the engine loop is light; the workers hold the cores
class LaminaService:
    def __init__(self, config: LaminaConfig, name: str):
        cluster = replace(config.cluster, executor="ray", address=None)
        self.config, self.name = replace(config, cluster=cluster), name
        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self.restarts, self.restart_cause = _count_start(
            name, restarted, config.cluster.max_restarts)
        if restarted:
            log.warning("the Lamina service %r restarts (restart %d): %s", name,
                        self.restarts, self.restart_cause)
        scaled = scale_of(name)
        if restarted and scaled is not None:  # `scale` changed it: the restart keeps it
            self.config = replace(self.config, engine=replace(
                self.config.engine, num_memory_workers=scaled))
        self.short_why: str | None = None  # why it has fewer memory workers than its size
        try:
            self.llm = self._start(restarted)
        except BaseException as e:  # Ray ends the actor for good: `find` says why
            _note_failed_start(name, e)
            raise
        self.metrics = EngineMetrics()
        self.loop = EngineLoop(self.llm.engine, self.metrics, config.server.max_waiting)
        self.futures: dict[str, Future] = {}
        self.started = time.time()
        # /v1/responses' stored responses, shared by every `lamina serve --service` front
        # and kept through restarts
        self.responses = ResponseStore(config.server.max_stored_responses, KVResponses(name),
                                       config.server.max_stored_response_bytes)
        self.leases, self.orphans = ClientLeases(config.cluster.client_lease_s), 0
        self._scaling = threading.Lock()  # one change of memory workers at a time
        # the KV pool's autoscaler (`autoscale` section; None: off)
        self.autoscale = (AutoscaleRunner(self.loop, self.config.autoscale, self._scale_now)
                          if self.config.autoscale.enabled else None)
        self._gauges()
        self._stopping = False  # `shutdown` ran: the engine stopping is no failure
        threading.Thread(target=self._restart_when_the_engine_stops, daemon=True,
                         name="lamina-service-watch").start()
        threading.Thread(target=self._abort_the_silent_clients_requests, daemon=True,
                         name="lamina-leases").start()
        # its size kept: grown back once the cluster has room (not beside an autoscaler;
        # the LLM was made without a keeper of its own: `_sized`)
        self.keeper = self.llm.engine.keeper = KeepSize(
            lambda: self.llm.engine, lambda: self.config.engine.num_memory_workers,
            on_loop(self.loop), self._scaling,
            0 if self.autoscale is not None else config.cluster.regrow_interval_s,
            f"the Lamina service {name!r}", why=self.short_why)
        self.metrics.keep_size(self.keeper)
        _note_serving(name)

    def _start(self, restarted: bool) -> LLM:
        """The engine and its workers. A first start (`up`) deploys the deployment's
        size, `engine.num_memory_workers`, or fails. A restart deploys what the cluster
        holds now (`_start_smaller`), and where it holds not even the fewest (its
        compute node gone, say, until `ray up`'s autoscaler brings another) waits for
        room, at most `cluster.room_wait_s` (`start_when_room`; then it fails as a
        first start does); the record of starts says what it waits for, so `status`
        answers "restarting ... waiting for room: ..." meanwhile."""
        if not restarted:
            return LLM.from_config(self._sized(self.config.engine.num_memory_workers))

        def waiting(why: str) -> None:
            log.warning("the Lamina service %r waits for room to restart: %s", self.name, why)
            _write_starts(self.name, {**starts_of(self.name), "waiting": why})
        return start_when_room(self._start_smaller, lambda free: ray.available_resources()
                               if free else ray.cluster_resources(),
                               self.config.cluster.room_wait_s, waiting)

    def _start_smaller(self, have: dict, free: bool) -> LLM:
        """A restart's engine: as many memory workers as the cluster's resources
        `have` hold (its total, or `free`: those free now;
        `memory_workers_that_fit`), down to `engine.min_live_memory_workers`, so
        that a node lost with no room left leaves the deployment smaller, not gone;
        `keeper` grows it back once there is room. After a placement that timed
        out (the room held by other deployments; each try bounded by
        placement_timeout_s), as many as are free then, fewer than before. `NoRoom`
        or `PlacementTimeout` when not even the fewest fit."""
        size = self.config.engine.num_memory_workers
        fewest = min(size, self.config.engine.min_live_memory_workers)
        n, why = memory_workers_that_fit(self.config.engine, have, free)
        if n < fewest:
            raise NoRoom(why)
        while True:
            try:
                llm = LLM.from_config(self._sized(n))
                break
            except PlacementTimeout as e:
                now, _ = memory_workers_that_fit(self.config.engine,
                                                 ray.available_resources(), True)
                if min(n - 1, now) < fewest:
                    raise
                why, n = str(e), min(n - 1, now)
                log.warning("the Lamina service %r: %s; trying %d memory worker%s",
                            self.name, e, n, "s" * (n != 1))
        if n < size:
            self.short_why = f"its restart found room for {n}: {why}"
            log.warning("the Lamina service %r restarts with %d of its %d memory workers (%s)"
                        "; it grows back when the cluster has room", self.name, n, size, why)
        return llm

    def _sized(self, n: int) -> LaminaConfig:
        """The deployment's config for its `LLM`: `n` memory workers (its size stays the
        config's) and no keeper of its own (the service's `keeper` keeps its size)."""
        return replace(self.config, engine=replace(self.config.engine, num_memory_workers=n),
                       cluster=replace(self.config.cluster, regrow_interval_s=0))

    def _gauges(self) -> None:
        """The service's own series beside the engine's: its restarts (from its record,
        so they outlive the process, unlike the counters, which start afresh) and its
        stored responses."""
        r = self.metrics.registry
        Gauge("lamina_service_restarts", "Times Ray started the Lamina service again "
              "(kept through restarts)", registry=r).set(self.restarts)
        Gauge("lamina_stored_responses", "Responses the service stores (kept through "
              "restarts)", registry=r).set_function(lambda: len(self.responses))
        Gauge("lamina_stored_response_bytes", "Bytes of the responses the service stores "
              "(their JSON)", registry=r).set_function(lambda: self.responses.nbytes)

    def _restart_when_the_engine_stops(self) -> None:
        """The engine stopped (a step it could not recover from): exit, so that Ray
        starts the service again, unless `lamina down` stopped it or no restart is left
        (then it stays up with its engine stopped, and `status` says why)."""
        self.loop.join()
        err = self.loop.error
        if self._stopping or err is None:
            return
        cause = f"its engine stopped: {type(err).__name__}: {err}"
        if not self._restarting():
            log.error("the Lamina service %r: %s; no restart left (cluster.max_restarts="
                      "%d)", self.name, cause, self.config.cluster.max_restarts)
            return
        log.error("the Lamina service %r: %s; it restarts", self.name, cause)
        _note_exit(self.name, cause)
        time.sleep(RESTART_GRACE_S)  # the failed requests' errors on their way out
        done = threading.Thread(target=self.llm.shutdown, daemon=True)
        done.start()  # its workers stopped if they answer; else they go with this process
        done.join(10)
        os._exit(1)

    def _abort_the_silent_clients_requests(self) -> None:
        """Every second (or third of the lease), abort the requests of clients silent
        past their lease (`ClientLeases`): their process died, nobody reads them."""
        every = min(1.0, self.leases.lease_s / 3)
        while not self._stopping:
            time.sleep(every)
            owners = set()
            for gone in self.leases.silent(time.monotonic()):
                owners.add(gone.owner)
                fut = self.futures.get(gone.key)
                if fut is not None and not fut.done():
                    log.warning("request %s aborted: its client %s was last heard from %.0f "
                                "s ago (cluster.client_lease_s %g; its process died?)",
                                gone.key, gone.owner[:8], gone.silent_s, self.leases.lease_s)
                    self.orphans += 1
                    self.loop.abort(fut)
            for owner in owners:  # the background responses its HTTP front ran
                self.responses.fail_owned(owner, f"the HTTP front running it (client "
                                          f"{owner[:8]}) went silent past its lease "
                                          f"(cluster.client_lease_s {self.leases.lease_s:g}"
                                          "); its request was aborted")

    def renew(self, owner: str) -> float:
        """Client `owner` lives (`client._renew`) -> the lease, in seconds."""
        self.leases.heard(owner, time.monotonic())
        return self.leases.lease_s

    def ready(self) -> str:
        self._check_serving()
        return ray.get_runtime_context().get_node_id()

    def _restarting(self) -> bool:
        """The engine stopped (not by `shutdown`) and a restart is left: the watch
        exits the process (`_restart_when_the_engine_stops`)."""
        limit = self.config.cluster.max_restarts
        return (self.loop.error is not None and not self._stopping
                and (limit == -1 or self.restarts < limit))

    def _check_serving(self) -> None:
        """Raise `ServiceRestarting` while the service is about to restart."""
        if self._restarting():
            err = self.loop.error
            raise ServiceRestarting(f"the Lamina service {self.name!r} restarts: its "
                                    f"engine stopped ({type(err).__name__}: {err})")

    def limits(self) -> dict:
        """The served model's context and vocabulary sizes and its EOS ids."""
        e = self.llm.engine
        return {"max_len": e.max_len, "vocab_size": e.vocab_size, "eos_ids": sorted(e.eos_ids)}

    def validate(self, prompt, params, priority: int = 0) -> list[int]:
        """Raise what `LLM.generate` would for this prompt (ValueError / TypeError);
        -> its token ids."""
        self._check_serving()
        return self.llm.engine.validate(prompt, params, priority=priority)

    async def stream(self, key: str, prompt, params, session_id: str | None = None,
                     priority: int = 0, owner: str | None = None):
        """One request's progress: `RequestOutput` snapshots, the last one final. A
        consumer that goes away (the generator closed) aborts the request, and so does
        its client's silence past the lease (`owner`: the client's id)."""
        aloop = asyncio.get_running_loop()
        updates: asyncio.Queue = asyncio.Queue()

        def put(item):
            aloop.call_soon_threadsafe(updates.put_nowait, item)

        try:
            fut = self.loop.submit(prompt, params, on_update=put,  # bad input raises here
                                   session_id=session_id, priority=priority)
        except EngineDead:
            self._check_serving()  # stopped, and about to restart: say so
            raise
        self.futures[key] = fut
        if owner is not None:
            self.leases.hold(key, owner, time.monotonic())
        fut.add_done_callback(put)
        try:
            while True:
                item = await updates.get()
                if isinstance(item, Future):
                    yield item.result()  # the final output, or the request's error
                    return
                yield item
        finally:
            self.futures.pop(key, None)
            self.leases.release(key)
            self.loop.abort(fut)  # no-op when it finished

    def check_capacity(self, extra: int = 1) -> None:
        """Raise `EngineOverloaded` if `extra` more requests would overfill the queue."""
        self._check_serving()
        self.loop.check_capacity(extra)

    def abort(self, key: str) -> bool:
        """Stop the request `key` and free its KV; False if it is not running."""
        fut = self.futures.get(key)
        if fut is None:
            return False
        self.loop.abort(fut)
        return True

    def status(self) -> dict:
        """Workers and their nodes, KV use per memory worker, queue, counters (failed
        steps recovered, workers replaced by role)."""
        eng, ex = self.llm.engine, self.llm.executor
        caches = eng.scheduler.caches or [None] * len(eng.allocs)
        kv = [{"worker": i, "free": f, "cached": c.size if c is not None else 0,
               "total": self.config.engine.num_kv_slots}
              for i, (f, c) in enumerate(zip(eng.free_slots(), caches))]
        computes = ex.nodes["computes"]
        workers = [{"role": "compute" if len(computes) == 1 else f"compute {r}", "node": n,
                    "transport": "-", "threads": ex.worker_threads[r][1]}
                   for r, n in enumerate(computes)]
        workers += [{"role": f"memory {i}", "node": n, "transport": t,
                     "threads": info["threads"]}  # as the worker reports it
                    for i, (n, t, info) in enumerate(zip(ex.nodes["memory"], ex.transports,
                                                         ex.memory_info))]
        state = ("running" if self.loop.alive else
                 "restarting" if self._restarting() else "stopped")
        return {"name": self.name, "state": state, "model": self.llm.loaded.source,
                "alive": self.loop.alive, "error": None if self.loop.error is None
                else f"{type(self.loop.error).__name__}: {self.loop.error}",
                "uptime_s": round(time.time() - self.started, 1), "pid": os.getpid(),
                "workers": workers, "kv": kv, "waiting": self.loop.waiting(),
                "running": len(eng.scheduler.running), **self.loop.stats,
                "recoveries": eng.num_recoveries, "kv_kept_tokens": eng.kv_kept_tokens,
                "workers_replaced": ex.workers_replaced(),
                "memory_workers_lost": eng.memory_workers_lost,
                "size": self._size(),
                "placement_group": ex.placement.group.id.hex(),
                "restarts": self.restarts, "restart_cause": self.restart_cause,
                "max_restarts": self.config.cluster.max_restarts,
                "http": front_of(self.name), "clients": self.leases.clients(),
                "orphans_aborted": self.orphans, "stored_responses": len(self.responses),
                "max_stored_responses": self.responses.capacity,
                "stored_response_bytes": self.responses.nbytes,
                "max_stored_response_bytes": self.responses.max_bytes,
                "autoscale": self._autoscale_status(),
                "waiting_for_workers": None if (w := eng.waiting_for_workers()) is None
                else asdict(w)}

    def _size(self) -> dict:
        """The deployment's size in memory workers, those it has, why fewer, and what
        the keeper's last try to grow back failed with (None: it did not)."""
        size, live = self.config.engine.num_memory_workers, len(self.llm.engine.allocs)
        why = None if live >= size else self.keeper.why or (
            "memory workers lost for good at a recovery (no replacement could start)")
        every = self.config.cluster.regrow_interval_s
        regrow = ("the autoscaler sets the count" if self.autoscale is not None else
                  f"it grows back when the cluster has room (tried every {every:g} s)"
                  if every else "it does not grow back by itself (cluster."
                  "regrow_interval_s 0; `lamina scale`)")
        failed = None if live >= size else self.keeper.failed
        return {"memory_workers": size, "live": live, "short_why": why, "regrow": regrow,
                "regrow_failed": failed}

    def _autoscale_status(self) -> dict | None:
        """The autoscaler's bounds, its changes so far and the last one, its last
        failure (None: off)."""
        a = self.autoscale
        if a is None:
            return None
        last = a.changes[-1] if a.changes else None
        return {"min": a.config.min_memory_workers, "max": a.config.max_memory_workers,
                "changes": len(a.changes), "error": a.error,
                "last": None if last is None else {
                    "before": last.done.before, "after": last.done.after, "why": last.why,
                    "ago_s": round(time.monotonic() - last.at, 1)}}

    async def scale(self, memory_workers: int) -> dict:
        """Change the deployment's memory workers to `memory_workers` while it serves
        (`_scale_now`, on a thread: the actor's other calls go on) -> what was done
        (`MemoryScale`, as a dict)."""
        self._check_serving()
        return asdict(await asyncio.to_thread(self._scale_now, memory_workers))

    def _scale_now(self, n: int) -> MemoryScale:
        """Memory workers -> n: the new ones started on this thread beside the engine's
        steps, added between two (`scale_beside`); the count kept for the service's
        restarts. `scale` and the autoscaler call it, one at a time."""
        with self._scaling:
            done = scale_beside(self.llm.engine, n, on_loop(self.loop))
            self.llm.config = replace(self.llm.config, num_memory_workers=done.after)
            engine = replace(self.config.engine, num_memory_workers=done.after)
            self.config = replace(self.config, engine=engine)
            internal_kv._internal_kv_put(_scale_key(self.name), json.dumps(done.after),
                                         overwrite=True, namespace=NAMESPACE)
            return done

    def response_bound(self) -> str:
        return self.responses.bound()

    def response_get(self, rid: str) -> Stored | None:
        return self.responses.get(rid)

    def response_put(self, rid: str, item: Stored) -> bool:
        return self.responses.put(rid, item)

    def response_delete(self, rid: str) -> bool:
        return self.responses.delete(rid)

    def response_statuses(self, rids: list[str]) -> dict[str, str | None]:
        return self.responses.statuses(rids)

    def tokenizer(self):
        """The model's tokenizer (clients decode and apply chat templates with it)."""
        return self.llm.loaded.tokenizer

    def metrics_text(self) -> bytes:
        return self.metrics.render()

    def shutdown(self) -> None:
        """Stop the engine loop, the workers and release the placement group."""
        self._stopping = True
        self.keeper.stop()
        if self.autoscale is not None:
            self.autoscale.stop()
        self.loop.shutdown()
        self.llm.shutdown()
        _forget(self.name)


def _starts_key(name: str) -> str:
    return f"service:{name}:starts"


def starts_of(name: str) -> dict:
    """The service's record of its starts in Ray's key-value store ({} if none)."""
    raw = internal_kv._internal_kv_get(_starts_key(name), namespace=NAMESPACE)
    return json.loads(raw) if raw else {}


def _write_starts(name: str, record: dict) -> None:
    internal_kv._internal_kv_put(_starts_key(name), json.dumps(record), overwrite=True,
                                 namespace=NAMESPACE)


def _scale_key(name: str) -> str:
    return f"service:{name}:memory_workers"


def scale_of(name: str) -> int | None:
    """The memory workers `LaminaService.scale` last set (None: never)."""
    raw = internal_kv._internal_kv_get(_scale_key(name), namespace=NAMESPACE)
    return json.loads(raw) if raw else None


def _front_key(name: str) -> str:
    return f"service:{name}:http"


def front_of(name: str) -> dict | None:
    """The record of the service's HTTP front (cluster/front.py: "url", "pid", "node",
    "since"), None if it has none."""
    raw = internal_kv._internal_kv_get(_front_key(name), namespace=NAMESPACE)
    return json.loads(raw) if raw else None


def note_front(name: str, record: dict) -> None:
    internal_kv._internal_kv_put(_front_key(name), json.dumps(record), overwrite=True,
                                 namespace=NAMESPACE)


def forget_front(name: str) -> None:
    internal_kv._internal_kv_del(_front_key(name), namespace=NAMESPACE)


def _forget(name: str) -> None:
    """A service stopped on purpose leaves nothing in Ray's key-value store: no record
    of its starts (it is not gone, it was stopped), no stored responses (the next
    deployment starts with none)."""
    internal_kv._internal_kv_del(_starts_key(name), namespace=NAMESPACE)
    internal_kv._internal_kv_del(_scale_key(name), namespace=NAMESPACE)
    internal_kv._internal_kv_del(KVResponses(name).prefix, del_by_prefix=True,
                                 namespace=NAMESPACE)


class KVResponses:
    """The service's stored responses in Ray's key-value store (`ResponseBacking`), so
    that its restarts keep them: one key a response (a put writes one response, not the
    store), the order they were saved in kept in each value. The store lives in Ray's
    GCS beside the record of starts: it outlives the service's process, not the
    cluster."""

    def __init__(self, name: str):
        self.prefix, self._seq = f"service:{name}:response:", 0

    def load(self) -> list[tuple[str, Stored]]:
        rows = []
        for key in internal_kv._internal_kv_list(self.prefix, namespace=NAMESPACE):
            raw = internal_kv._internal_kv_get(key, namespace=NAMESPACE)
            if raw:  # else dropped since the listing
                row = json.loads(raw)
                rows.append((row["seq"], key.decode()[len(self.prefix):],
                             Stored(**row["item"])))
        rows.sort(key=lambda r: r[0])
        self._seq = rows[-1][0] if rows else 0
        return [(rid, item) for _, rid, item in rows]

    def save(self, rid: str, item: Stored) -> None:
        self._seq += 1
        internal_kv._internal_kv_put(self.prefix + rid, json.dumps(
            {"seq": self._seq, "item": asdict(item)}), overwrite=True, namespace=NAMESPACE)

    def drop(self, rid: str) -> None:
        internal_kv._internal_kv_del(self.prefix + rid, namespace=NAMESPACE)


def _count_start(name: str, restarted: bool, max_restarts: int) -> tuple[int, str | None]:
    """This start in the service's record -> (restarts so far, why the latest one
    happened). A first start (`up`) begins a new record; a restart's cause is what the
    process that exited wrote (`_note_exit`), else its process died. The record says
    the start is under way (`serving` False, since when) until `_note_serving`."""
    record = {"restarts": 0, "cause": None, "exiting": None, "pid": os.getpid(),
              "max_restarts": max_restarts, "failed": None, "serving": False,
              "since": time.time()}
    if restarted:
        old = starts_of(name)
        record["restarts"] = old.get("restarts", 0) + 1
        record["cause"] = _why_it_ended(old)
    _write_starts(name, record)
    return record["restarts"], record["cause"]


def _why_it_ended(record: dict) -> str:
    """Why the process of `record` (a start that was serving) ended."""
    return record.get("exiting") or (
        f"its process (pid {record.get('pid')}) died: killed, or crashed "
        "(`ray logs` of the service's worker)")


def _note_serving(name: str) -> None:
    """This start is done: the service answers (a later restart begins after it)."""
    _write_starts(name, {**starts_of(name), "serving": True, "waiting": None})


def _note_exit(name: str, cause: str) -> None:
    """Why this process exits, for the start that follows (`_count_start`)."""
    _write_starts(name, {**starts_of(name), "exiting": cause})


def _note_failed_start(name: str, e: BaseException) -> None:
    """Why this start failed (the actor then ends: Ray does not restart an actor whose
    constructor raised), for `find` to say once the service is gone."""
    _write_starts(name, {**starts_of(name), "failed": f"{type(e).__name__}: {e}"})


def gone_why(record: dict) -> str | None:
    """Why a service that is no longer on the cluster ended, from its record of starts
    (`starts_of`); None without a record (never started, or stopped by `lamina down`)."""
    if not record:
        return None
    n, limit = record.get("restarts", 0), record.get("max_restarts")
    if record.get("failed"):
        which = f"restart {n}" if n else "start"
        return f"its {which} failed: {record['failed']}"
    died = record.get("exiting") or f"its process (pid {record.get('pid')}) died"
    after = f"after {n} restart{'' if n == 1 else 's'}"
    if limit is not None and 0 <= limit <= n:
        return f"{died} {after}, with no restart left (cluster.max_restarts {limit})"
    return f"{died} {after}, and Ray did not start it again (`ray logs` of the service)"


def restarting_status(name: str, record: dict, now: float) -> dict:
    """What `status` says of a service Ray is starting again (its calls raise
    `ActorUnavailableError` meanwhile), from its record of starts: the restart under
    way (its new process loading since `record["since"]`), or, while the record is
    still the dead process's (`serving`), the restart about to begin."""
    if not record:
        n = cause = since = None
    elif not record.get("serving", True):  # the new process wrote its start: loading
        n, cause, since = record.get("restarts"), record.get("cause"), record.get("since")
    else:
        n, cause, since = record.get("restarts", 0) + 1, _why_it_ended(record), None
    loading = None if since is None else round(now - since, 1)
    which = f"restart {n}" if n is not None else "a restart"
    limit = record.get("max_restarts")
    of = f" of at most {limit}" if limit is not None and limit >= 0 else ""
    doing = (f"loading for {loading:.0f} s" if loading is not None
             else "its new process not started yet")
    room = record.get("waiting") if since is not None else None  # this restart's
    if room:
        doing += f", waiting for room: {room}"
    return {"name": name, "state": "restarting", "alive": False,
            "error": f"the Lamina service {name!r} is restarting ({which}{of}, {doing})"
                     + (f": {cause}" if cause else ""),
            "restarts": n, "max_restarts": limit, "restart_cause": cause,
            "loading_s": loading, "waiting_for_room": room}


def why_gone(name: str) -> str | None:
    """Why the service `name` is no longer on the cluster, from its record (None if it
    has none, or Ray's key-value store does not answer)."""
    try:
        return gone_why(starts_of(name))
    except Exception:  # noqa: BLE001 - the caller's message goes without the reason
        return None


def up(config: LaminaConfig, name: str = SERVICE, address: str | None = "auto",
       timeout_s: float = START_TIMEOUT_S):
    """Start the service `name` on the running cluster at `address`; return its handle
    once its workers are up, and its HTTP front serving where `cluster.http_port` asks
    for one (cluster/front.py). Refuses a second service of the same name."""
    from .front import check_port, start_front, stop_front

    if not ray.is_initialized():
        connect_ray(address)
    try:
        ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        pass
    else:
        raise ServiceError(f"a Lamina service named {name!r} already runs; "
                           f"`lamina down --name {name}` stops it")
    stop_front(name)  # a gone service's front would answer for the gone one
    try:
        check_port(config.cluster)  # in use: said now, not after the model is up
    except ValueError as e:
        raise ServiceError(f"the Lamina service {name!r}'s HTTP front: {e}") from None
    _forget(name)  # a gone service's record and responses: this start is a new one
    # on the head node, as Ray Serve's controller: a worker node lost (a memory node
    # with no room left, a spot instance) takes workers, not the deployment's engine
    actor = LaminaService.options(name=name, namespace=NAMESPACE, lifetime="detached",
                                  max_restarts=config.cluster.max_restarts,
                                  resources={HEAD_NODE: 0.001},
                                  max_concurrency=1000).remote(config, name)
    log.info("starting the Lamina service %r: placement, workers, model (at most %g s; "
             "its workers' logs: `ray logs`)", name, timeout_s)
    try:
        ray.get(actor.ready.remote(), timeout=timeout_s)
    except Exception as e:  # noqa: BLE001 - whatever stopped it: kill it, say why
        ray.kill(actor, no_restart=True)
        cause = getattr(e, "cause", None) or e
        if not starts_of(name).get("failed"):  # else its constructor said why, unwrapped
            _note_failed_start(name, cause)  # for `status` to say later
        raise ServiceError(f"the Lamina service {name!r} failed to start: "
                           f"{type(cause).__name__}: {cause}") from None
    if config.cluster.http_port is not None:
        try:
            start_front(name, config.cluster, config.server, timeout_s)
        except ServiceError:
            down(name)  # all or nothing: a deployment without the front it asked for
            raise
    return actor  # the caller says it is up (`lamina up` prints it)


def find(name: str = SERVICE):
    """The running service's actor handle (Ray must be initialized)."""
    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        why = why_gone(name)
        raise ServiceNotFound(
            f"no Lamina service named {name!r} runs on this Ray cluster"
            + (f" (it is gone: {why})" if why else "")
            + "; start one with `lamina up`") from None


def down(name: str = SERVICE, timeout_s: float = 60) -> None:
    """Stop the service: its HTTP front, its engine, workers and placement group, then
    the actor."""
    from .front import stop_front

    actor = find(name)
    stop_front(name)
    try:
        ray.get(actor.shutdown.remote(), timeout=timeout_s)
    finally:
        ray.kill(actor, no_restart=True)
        _forget(name)  # `shutdown` does too, unless it timed out
