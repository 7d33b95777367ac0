"""Job submission API: `lamina.connect()` from any driver on the cluster.

Data in: prompts (text, token ids) and `SamplingParams`, sent to the running Lamina
service (cluster/service.py). Data out: a `RequestHandle` per request: `.result()` the
final `RequestOutput`; iterating it (`for` or `async for`) yields the request's
snapshots as the engine makes progress (cumulative token ids and text, the last one
final). `Client.generate` runs a batch with a progress bar, like `LLM.generate`.
Errors arrive as the local API raises them: `ValueError` / `TypeError` for bad input
(at `submit`, before anything runs), `RequestFailed` for a request the engine failed
alone, `EngineDead` once the engine stopped.
"""
from __future__ import annotations

import threading
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

from .executor import connect_ray
from .service import SERVICE, find


def connect(address: str | None = None, service: str = SERVICE) -> Client:
    """A client of the service `service` on the Ray cluster at `address` ($RAY_ADDRESS,
    else the cluster this node belongs to)."""
    if not ray.is_initialized():
        connect_ray(address or "auto")
    return Client(find(service), service)


def _unwrapped(e: BaseException) -> BaseException:
    """The service's own exception inside Ray's wrapper (RayTaskError); the service gone
    (RayActorError) is the local API's `EngineDead`."""
    if isinstance(e, ray.exceptions.RayActorError):
        return EngineDead(f"the Lamina service is gone: {type(e).__name__}: {e}")
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, BaseException) else e


RAY_ERRORS = (ray.exceptions.RayTaskError, ray.exceptions.RayActorError)


def _call(ref):
    """`ray.get(ref)`, raising the service's own exception (see `_unwrapped`)."""
    try:
        return ray.get(ref)
    except RAY_ERRORS as e:
        raise _unwrapped(e) from None


class RequestHandle:
    def __init__(self, service, key: str, prompt, params: SamplingParams,
                 session_id: str | None = None, priority: int = 0):
        self.key, self._service = key, service
        self._gen = service.stream.remote(key, prompt, params, session_id, priority)
        self._last: RequestOutput | None = None

    @property
    def done(self) -> bool:
        return self._last is not None and self._last.finished

    def _take(self, ref) -> RequestOutput:
        self._last = _call(ref)
        return self._last

    def __iter__(self):
        while not self.done:
            try:
                ref = next(self._gen)
            except StopIteration:
                return
            yield self._take(ref)

    async def __aiter__(self):
        while not self.done:
            try:
                ref = await self._gen.__anext__()
            except StopAsyncIteration:
                return
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
                break
            if ref.is_nil():
                raise TimeoutError(f"request {self.key}: no output within {timeout} s")
            self._take(ref)
        assert self._last is not None
        return self._last


class Client:
    def __init__(self, service, name: str):
        self.service, self.name = service, name
        self._tokenizer = None

    def submit(self, prompt, params: SamplingParams | None = None,
               session_id: str | None = None, priority: int = 0) -> RequestHandle:
        """Queue one request; bad input raises here, as in `LLM.generate`. `session_id`:
        the conversation it continues, `priority` its place under the service's
        scheduling_policy "priority" (see `LLM.generate`)."""
        params = params or SamplingParams()
        check_session_id(session_id)
        _call(self.service.validate.remote(prompt, params, priority))
        return RequestHandle(self.service, uuid.uuid4().hex, prompt, params, session_id,
                             priority)

    def abort(self, handle: RequestHandle) -> bool:
        """Stop the request and free its KV; False if it had finished."""
        return ray.get(self.service.abort.remote(handle.key))

    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 priority: int | Sequence[int] = 0) -> list[RequestOutput]:
        """Outputs in prompt order; every prompt validated before any is queued.
        `priority`: one, or one per prompt (see `LLM.generate`)."""
        prompts, plist = batch_of(prompts, params)
        prios = per_prompt(priority, len(prompts), "priorities")
        for i, (p, sp, pr) in enumerate(zip(prompts, plist, prios)):
            try:
                ray.get(self.service.validate.remote(p, sp, pr))
            except RAY_ERRORS as e:
                cause = _unwrapped(e)
                raise type(cause)(f"prompt {i}: {cause}") from None
        handles = [RequestHandle(self.service, uuid.uuid4().hex, p, sp, priority=pr)
                   for p, sp, pr in zip(prompts, plist, prios)]
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(handles), desc="generate", unit="req")
        outs = []
        for h in handles:
            outs.append(h.result())
            if bar:
                bar.update(1)
        if bar:
            bar.close()
        return outs

    def beam_search(self, prompts, params: BeamSearchParams) -> list[RequestOutput]:
        """As `LLM.beam_search`: one output a prompt, its beams best first; a round that
        fails raises its `RequestFailed`, as `generate` does."""
        tok, eos = self.tokenizer(), ray.get(self.service.limits.remote())["eos_ids"]

        def validate(p, sp):
            return _call(self.service.validate.remote(p, sp, 0))

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

    def status(self) -> dict:
        return ray.get(self.service.status.remote())

    def tokenizer(self):
        """The served model's tokenizer (fetched once)."""
        if self._tokenizer is None:
            self._tokenizer = ray.get(self.service.tokenizer.remote())
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
    def alive(self) -> bool:
        try:
            s = self.client.status()
        except Exception as e:  # noqa: BLE001 - the service is gone
            self.error = f"{type(e).__name__}: {e}"
            return False
        self.error = s["error"]
        return s["alive"]

    def check_capacity(self, extra: int = 1) -> None:
        _call(self.client.service.check_capacity.remote(extra))

    def submit(self, prompt, params: SamplingParams, validated: bool = False,
               on_update: Callable[[RequestOutput], None] | None = None,
               session_id: str | None = None, priority: int = 0) -> Future:
        check_session_id(session_id)
        if not validated:
            self.engine.validate(prompt, params, priority=priority)
        handle = RequestHandle(self.client.service, uuid.uuid4().hex, prompt, params,
                               session_id, priority)
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
        return _call(self.client.service.limits.remote())

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
        return _call(self.client.service.validate.remote(prompt, params, priority))


class RemoteResponseStore:
    """`ResponseStore`'s interface over the service's own store: the HTTP fronts of one
    deployment (`lamina serve --service`, any number, on any node) share its stored
    responses, so a conversation continues on whichever front a load balancer picks."""

    def __init__(self, client: Client):
        self.client = client

    @cached_property
    def capacity(self) -> int:
        return _call(self.client.service.response_capacity.remote())

    def get(self, rid: str):
        return _call(self.client.service.response_get.remote(rid))

    def put(self, rid: str, item) -> None:
        _call(self.client.service.response_put.remote(rid, item))

    def delete(self, rid: str) -> bool:
        return _call(self.client.service.response_delete.remote(rid))


class _RemoteMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, client: Client):
        self.client = client

    def render(self) -> bytes:
        return ray.get(self.client.service.metrics_text.remote())
