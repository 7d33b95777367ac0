"""Job submission API: `lamina.connect()` from any driver on the cluster.

Data in: prompts (text, token ids) and `SamplingParams`, sent to the running Lamina
service (cluster/service.py). Data out: a `RequestHandle` per request: `.result()` the
final `RequestOutput`; iterating it (`for` or `async for`) yields the request's
snapshots as the engine makes progress (cumulative token ids and text, the last one
final). `Client.generate` runs a batch with a progress bar, like `LLM.generate`.
Errors arrive as the local API raises them: `ValueError` / `TypeError` for bad input
(at `submit`, before anything runs), `RequestFailed` for a request the engine failed
alone, `EngineDead` once the engine stopped or the service's process died while the
request ran. A service that restarts (cluster/service.py) is waited for: a call made
while it does (`Client.ask`) waits until it answers again, at most `restart_wait_s`.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from concurrent.futures import Future
from functools import cached_property
from typing import Callable, Sequence

import ray
from prometheus_client import CONTENT_TYPE_LATEST

from lamina.engine.beam_search import BeamSearchParams, beam_search
from lamina.engine.outputs import RequestOutput
from lamina.engine.sessions import check_session_id
from lamina.entrypoints.llm import batch_of, chat_prompt, chat_tokens, per_prompt
from lamina.errors import EngineDead
from lamina.sampling.params import SamplingParams

from .connect import connect_ray
from .service import (
    SERVICE,
    START_TIMEOUT_S,
    ServiceRestarting,
    find,
    restarting_status,
    starts_of,
    why_gone,
)

log = logging.getLogger(__name__)


def connect(address: str | None = None, service: str = SERVICE) -> Client:
    """A client of the service `service` on the Ray cluster at `address` ($RAY_ADDRESS,
    else the cluster this node belongs to)."""
    if not ray.is_initialized():
        connect_ray(address or "auto")
    return Client(find(service), service)


def _unwrapped(e: BaseException, name: str | None = None) -> BaseException:
    """The service's own exception inside Ray's wrapper (RayTaskError); the service's
    process dead (RayActorError) is the local API's `EngineDead`: gone for good (`name`:
    the service's, to say why from its record), or restarting (ActorUnavailableError:
    what it held is lost, later calls wait for it)."""
    if isinstance(e, ray.exceptions.ActorUnavailableError):
        return EngineDead("the Lamina service's process died or became unreachable while "
                          "this call ran; it restarts if its cluster.max_restarts allows "
                          "(`lamina status`), and what it held is lost: resubmit "
                          f"({type(e).__name__}: {e})")
    if isinstance(e, ray.exceptions.RayActorError):
        why = why_gone(name) if name else None
        return EngineDead(f"the Lamina service{f' {name!r}' if name else ''} is gone"
                          + (f": {why}" if why else "") + f" ({type(e).__name__}: {e})")
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, BaseException) else e


RAY_ERRORS = (ray.exceptions.RayTaskError, ray.exceptions.RayActorError)


def _restart_under_way(record: dict) -> bool:
    """The service's record of starts says a restart's process is starting (it wrote
    its start, not yet that it serves, nor that the start failed)."""
    return (bool(record.get("restarts")) and not record.get("serving", True)
            and not record.get("failed"))


def _call(ref):
    """`ray.get(ref)`, raising the service's own exception (see `_unwrapped`)."""
    try:
        return ray.get(ref)
    except RAY_ERRORS as e:
        raise _unwrapped(e) from None


class RequestHandle:
    def __init__(self, service, key: str, prompt, params: SamplingParams,
                 session_id: str | None = None, priority: int = 0, owner: str | None = None):
        self.key, self._service = key, service
        self._gen = service.stream.remote(key, prompt, params, session_id, priority, owner)
        self._last: RequestOutput | None = None

    @property
    def done(self) -> bool:
        return self._last is not None and self._last.finished

    def _take(self, ref) -> RequestOutput:
        self._last = _call(ref)
        return self._last

    def _cut(self) -> EngineDead:
        """The stream ended before its final output: the service went away mid-way."""
        return EngineDead(f"request {self.key}: the Lamina service's stream ended before "
                          "the final output (its process died; it restarts if its "
                          "cluster.max_restarts allows): resubmit")

    def __iter__(self):
        while not self.done:
            try:
                ref = next(self._gen)
            except StopIteration:
                raise self._cut() from None
            yield self._take(ref)

    async def __aiter__(self):
        while not self.done:
            try:
                ref = await self._gen.__anext__()
            except StopAsyncIteration:
                raise self._cut() from None
            try:
                self._last = await ref
            except RAY_ERRORS as e:
                raise _unwrapped(e) from None
            yield self._last

    def result(self, timeout: float | None = None) -> RequestOutput:
        """The final output (waits for it; what iteration has not consumed is skipped)."""
        while not self.done:
            try:
                ref = self._gen._next_sync(timeout) if timeout is not None else next(self._gen)
            except StopIteration:
                raise self._cut() from None
            if ref.is_nil():
                raise TimeoutError(f"request {self.key}: no output within {timeout} s")
            self._take(ref)
        assert self._last is not None
        return self._last


# This process's lease with each service it sends requests to (by name): one id and one
# thread renewing it while the process lives, however many Clients it makes, so the
# service aborts its requests once it goes silent (its process died: nobody reads them)
_leases: dict[str, str] = {}
_leases_lock = threading.Lock()


def _lease_of(client: Client) -> str:
    """The process's lease id with `client`'s service; the first one starts renewing
    it."""
    with _leases_lock:
        lease = _leases.get(client.name)
        if lease is None:
            lease = _leases[client.name] = uuid.uuid4().hex
            threading.Thread(target=_renew, args=(client.name, lease), daemon=True,
                             name=f"lamina-lease-{client.name}").start()
        return lease


def _renew(name: str, lease: str) -> None:
    """Renew `lease` with the service `name` as it is now (found by name each time: a
    service that `lamina down` and `up` replaced is a new actor), every third of the
    lease it answers with (its `cluster.client_lease_s`); a service that does not
    answer (restarting, gone) is tried again a second later."""
    every = 1.0
    while True:
        time.sleep(every)
        if not ray.is_initialized():  # shut down here (else `find` would start a Ray)
            every = 1.0
            continue
        try:
            every = ray.get(find(name).renew.remote(lease), timeout=every) / 3
        except Exception:  # noqa: BLE001 - none now, or Ray shutting down: try again
            every = 1.0


class Client:
    restart_wait_s = START_TIMEOUT_S  # how long a call waits for a restarting service

    def __init__(self, service, name: str):
        self.service, self.name = service, name
        self._tokenizer = None

    def ask(self, method: str, *args, wait: bool = True):
        """`service.method(*args)`, raising the service's own exceptions (`_unwrapped`).
        While the service restarts (its process gone, or its engine stopped and the
        process about to exit), wait until it answers (`wait_back`), then ask again
        once; `wait=False`: raise `ServiceRestarting` (an `EngineDead`) at once, also
        while the restarted process is still starting (its record says so: Ray would
        hold the call until its start ends, which may wait for room for minutes)."""
        if not wait and _restart_under_way(starts_of(self.name)):
            raise ServiceRestarting(f"the Lamina service {self.name!r} is restarting "
                                    "(`lamina status`)")
        try:
            return ray.get(getattr(self.service, method).remote(*args))
        except ray.exceptions.ActorUnavailableError as e:
            why: BaseException = e
        except RAY_ERRORS as e:
            why = _unwrapped(e, self.name)
            if not isinstance(why, ServiceRestarting):
                raise why from None
        if not wait:
            raise ServiceRestarting(f"the Lamina service {self.name!r} is restarting "
                                    f"(`lamina status`): {why}") from None
        self.wait_back()
        return _call(getattr(self.service, method).remote(*args))

    def wait_back(self) -> None:
        """Wait for a restarting service to answer again; `EngineDead` if it is gone
        for good (no restart left) or still silent after `restart_wait_s`."""
        log.warning("the Lamina service %r is restarting; waiting for it (at most %g s)",
                    self.name, self.restart_wait_s)
        deadline = time.monotonic() + self.restart_wait_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                ray.get(self.service.ready.remote(), timeout=min(left, 10.0))
                return
            except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
                pass
            except ray.exceptions.RayActorError as e:
                raise _unwrapped(e, self.name) from None
            except ray.exceptions.RayTaskError as e:
                if not isinstance(_unwrapped(e), ServiceRestarting):
                    raise _unwrapped(e) from None
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        raise EngineDead(f"the Lamina service {self.name!r} did not answer within "
                         f"{self.restart_wait_s:g} s of its restart (`lamina status`, "
                         "`ray logs`)")

    def submit(self, prompt, params: SamplingParams | None = None,
               session_id: str | None = None, priority: int = 0) -> RequestHandle:
        """Queue one request; bad input raises here, as in `LLM.generate`. `session_id`:
        the conversation it continues, `priority` its place under the service's
        scheduling_policy "priority" (see `LLM.generate`)."""
        params = params or SamplingParams()
        check_session_id(session_id)
        self.ask("validate", prompt, params, priority)
        return self.handle(prompt, params, session_id, priority)

    def handle(self, prompt, params: SamplingParams, session_id: str | None = None,
               priority: int = 0) -> RequestHandle:
        """A validated request sent to the service under this process's lease."""
        return RequestHandle(self.service, uuid.uuid4().hex, prompt, params, session_id,
                             priority, _lease_of(self))

    def abort(self, handle: RequestHandle) -> bool:
        """Stop the request and free its KV; False if it had finished, or went with a
        service that is restarting (not waited for: a front aborts on its event loop)."""
        try:
            return self.ask("abort", handle.key, wait=False)
        except EngineDead:
            return False

    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 priority: int | Sequence[int] = 0) -> list[RequestOutput]:
        """Outputs in prompt order; every prompt validated before any is queued.
        `priority`: one, or one per prompt (see `LLM.generate`). When it raises (Ctrl-C,
        a request failed), its requests still queued or running are aborted at the
        service first: no one would read them."""
        prompts, plist = batch_of(prompts, params)
        prios = per_prompt(priority, len(prompts), "priorities")
        for i, (p, sp, pr) in enumerate(zip(prompts, plist, prios)):
            try:
                self.ask("validate", p, sp, pr)
            except (ValueError, TypeError) as e:
                raise type(e)(f"prompt {i}: {e}") from None
        handles: list[RequestHandle] = []
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(prompts), desc="generate", unit="req")
        try:
            for p, sp, pr in zip(prompts, plist, prios):
                handles.append(self.handle(p, sp, priority=pr))
            outs = []
            for h in handles:
                outs.append(h.result())
                if bar:
                    bar.update(1)
        except BaseException:  # Ctrl-C, or a request failed: the rest would run unread
            for h in handles:
                if not h.done:
                    self.abort(h)
            raise
        finally:
            if bar:
                bar.close()
        return outs

    def beam_search(self, prompts, params: BeamSearchParams) -> list[RequestOutput]:
        """As `LLM.beam_search`: one output a prompt, its beams best first; a round that
        fails raises its `RequestFailed`, as `generate` does."""
        tok, eos = self.tokenizer(), self.ask("limits")["eos_ids"]

        def validate(p, sp):
            return self.ask("validate", p, sp, 0)

        return beam_search(batch_of(prompts, None)[0], params, eos, validate,
                           lambda ids, plist: self.generate(ids, plist, use_tqdm=False),
                           lambda ids, skip: tok.decode(ids, skip_special_tokens=skip))

    def chat(self, messages, params: SamplingParams | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """As `LLM.chat`: one conversation (a list of {role, content}) or a list of them,
        written with the served model's chat template (`chat_prompt`), then generated."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.tokenizer()
        prompts = [chat_tokens(tok, chat_prompt(
            tok, c, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            template_kwargs=chat_template_kwargs)) for c in convs]
        return self.generate(prompts, params, use_tqdm)

    def status(self, wait: bool = True) -> dict:
        """The service's status (`LaminaService.status`; its "state": running,
        restarting or stopped). While Ray starts its process again: wait for it, or
        (`wait=False`) say so at once, from its record of starts (`restarting_status`)."""
        try:
            return self.ask("status", wait=wait)
        except ServiceRestarting:
            if wait:
                raise
            return restarting_status(self.name, starts_of(self.name), time.time())

    def scale_memory_workers(self, n: int) -> dict:
        """Grow or shrink the service's KV pool to `n` memory workers while it serves
        (`LaminaService.scale`) -> what was done (`MemoryScale`'s fields): before,
        after, the running sequences whose KV moved off the leaving workers, those
        preempted (no kept pool had room) and their positions to compute again,
        seconds."""
        return self.ask("scale", n)

    def tokenizer(self):
        """The served model's tokenizer (fetched once)."""
        if self._tokenizer is None:
            self._tokenizer = self.ask("tokenizer")
        return self._tokenizer

    def model(self) -> str:
        """The model the service serves (its path or source name)."""
        return self.status()["model"]


class ServiceLoop:
    """The `EngineLoop` interface the HTTP server and `lamina batch` run on, over a
    service: `lamina serve --service` and batch jobs share the cluster's deployment.
    Each request's stream is read on a thread of its own, which resolves its future.
    `remote`: its calls (validate, submit, status, stored responses) are round trips to
    the service, which the HTTP front makes off its event loop."""

    remote = True

    def __init__(self, client: Client):
        self.client, self.max_waiting, self.error = client, None, None
        self.engine = _RemoteEngine(client)
        self.metrics = _RemoteMetrics(client)
        self.response_store = RemoteResponseStore(client)
        self._handles: dict[Future, RequestHandle] = {}

    @property
    def owner(self) -> str:
        """This process's lease id with the service (what its background responses are
        stored under: the service fails them if this process dies)."""
        return _lease_of(self.client)

    @property
    def alive(self) -> bool:
        try:
            s = self.client.status(wait=False)  # a health check says so, not waits
        except Exception as e:  # noqa: BLE001 - the service is gone or restarting
            self.error = f"{type(e).__name__}: {e}"
            return False
        self.error = s["error"]
        return s["alive"]

    def check_capacity(self, extra: int = 1) -> None:
        self.client.ask("check_capacity", extra)

    def submit(self, prompt, params: SamplingParams, validated: bool = False,
               on_update: Callable[[RequestOutput], None] | None = None,
               session_id: str | None = None, priority: int = 0) -> Future:
        check_session_id(session_id)
        if not validated:
            self.engine.validate(prompt, params, priority=priority)
        handle = self.client.handle(prompt, params, session_id, priority)
        fut: Future = Future()
        fut.set_running_or_notify_cancel()
        self._handles[fut] = handle
        threading.Thread(target=self._follow, args=(handle, fut, on_update), daemon=True,
                         name=f"lamina-request-{handle.key[:8]}").start()
        return fut

    def _follow(self, handle: RequestHandle, fut: Future, on_update) -> None:
        try:
            for out in handle:
                if not out.finished and on_update is not None:
                    on_update(out)
            fut.set_result(handle.result())
        except BaseException as e:  # noqa: BLE001 - the request's error, to its waiter
            fut.set_exception(e)
        finally:
            self._handles.pop(fut, None)

    def abort(self, fut: Future) -> None:
        handle = self._handles.get(fut)
        if handle is not None and not fut.done():
            self.client.abort(handle)

    def shutdown(self, timeout: float = 10.0) -> None:
        for fut in list(self._handles):
            self.abort(fut)


class _RemoteEngine:
    def __init__(self, client: Client):
        self.client = client

    @cached_property
    def _limits(self) -> dict:
        return self.client.ask("limits")

    @property
    def max_len(self) -> int:
        return self._limits["max_len"]

    @property
    def vocab_size(self) -> int:
        return self._limits["vocab_size"]

    @property
    def eos_ids(self) -> frozenset[int]:
        return frozenset(self._limits["eos_ids"])

    def validate(self, prompt, params, session_id: str | None = None,
                 priority: int = 0) -> list[int]:
        return self.client.ask("validate", prompt, params, priority)


class RemoteResponseStore:
    """`ResponseStore`'s interface over the service's own store: the HTTP fronts of one
    deployment (`lamina serve --service`, any number, on any node) share its stored
    responses, so a conversation continues on whichever front a load balancer picks."""

    def __init__(self, client: Client):
        self.client = client

    def bound(self) -> str:
        return self.client.ask("response_bound")

    def get(self, rid: str):
        return self.client.ask("response_get", rid)

    def put(self, rid: str, item) -> bool:
        return self.client.ask("response_put", rid, item)

    def delete(self, rid: str) -> bool:
        return self.client.ask("response_delete", rid)

    def statuses(self, rids: list[str]) -> dict[str, str | None]:
        return self.client.ask("response_statuses", rids)


class _RemoteMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, client: Client):
        self.client = client

    def render(self) -> bytes:
        return self.client.ask("metrics_text", wait=False)  # a scrape is not held
