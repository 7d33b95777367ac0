"""Background Responses (`POST /v1/responses` with `background: true`, OpenAI's and
vLLM's): the request is answered at once with its Response `queued`, runs on a task of
the HTTP front that took it, and its client polls `GET /v1/responses/{id}` (`queued`,
`in_progress`, then `completed`, `incomplete`, `failed` or `cancelled`) or cancels it
(`POST /v1/responses/{id}/cancel`). With `stream`, its events are sent as they come and
kept (`follow`): a client that hangs up leaves it running and resumes with `GET
/v1/responses/{id}?stream=true&starting_after=N` on the same front.

Data in: the stored record the request starts with (`Stored`, its Response `queued`)
and its Responses event stream (`api_responses.response_events` over the chat stream,
the same items a streamed request sends). Data out: the stored record, written at each
change of status (not at each token: over a service every write is a round trip).

The store is the shared state: over a Lamina service (`lamina serve --service`, the
deployment's own front) every front reads it, so a response started on one front is
polled, cancelled or deleted through any. The front that runs it reads the statuses
of all it runs every `poll_s` (one round trip) and stops a request whose record
another front marked cancelled or deleted. A front that dies with responses running
leaves them to the service: its client lease runs out, the service aborts the requests
and marks the responses `failed` (`ResponseStore.fail_owned`, by the front's lease id in
`Stored.owner`).
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

from lamina.entrypoints.api_responses import PENDING, Stored, answer_message

log = logging.getLogger(__name__)

POLL_S = 1.0  # how often a running response's front reads its record (another front's cancel)
KEPT_LOGS = 64  # finished streamed responses whose events a front keeps to resume


class _Log:
    """A streamed background response's events so far (index = `sequence_number`)."""

    def __init__(self):
        self.events: list[str] = []
        self.done = False
        self.changed = asyncio.Event()

    def add(self, event: str | None) -> None:
        """One more event (None: the last was sent)."""
        if event is None:
            self.done = True
        else:
            self.events.append(event)
        self.changed.set()


def status_of(item: Stored, status: str, error: str | None = None, output=None) -> Stored:
    """`item` with its Response's status (and error, output) changed."""
    resp = {**item.response, "status": status}
    if error is not None:
        resp["error"] = {"code": "server_error", "message": error}
    if output is not None:
        resp["output"] = output
    return replace(item, response=resp)


class Background:
    """The background responses one HTTP front runs, by response id.

    `off_loop(fn, *args)`: the front's way to call the store (a thread over a service).
    `watch`: read each running response's record every `poll_s` (another front may
    cancel it); a local server's store has no other front, so it need not."""

    def __init__(self, stored, off_loop: Callable[..., Awaitable[Any]], watch: bool,
                 poll_s: float = POLL_S):
        self.stored, self.off_loop, self.watch, self.poll_s = stored, off_loop, watch, poll_s
        self.tasks: dict[str, asyncio.Task] = {}
        self.logs: OrderedDict[str, _Log] = OrderedDict()  # streamed ones, by id
        self._watcher: asyncio.Task | None = None  # held: the loop keeps weak references

    async def start(self, rid: str, first: Stored, events: AsyncIterator[str],
                    streamed: bool = False) -> dict:
        """Store `first` (its Response `queued`) and run `events` on a task -> that
        Response; ValueError when the store cannot hold it. `streamed`: its events are
        kept (`follow`), the last `KEPT_LOGS` finished ones' too."""
        if not await self.off_loop(self.stored.put, rid, first):
            await events.aclose()  # its request aborted
            raise ValueError("background: the request alone is larger than the store's "
                             "max_stored_response_bytes; send it without background")
        kept = None
        if streamed:
            kept = self.logs[rid] = _Log()
            done = [k for k, v in self.logs.items() if v.done]
            for k in done[:max(0, len(done) - KEPT_LOGS)]:
                del self.logs[k]
        task = asyncio.get_running_loop().create_task(self._run(rid, first, events, kept),
                                                      name=f"lamina-background-{rid}")
        self.tasks[rid] = task
        task.add_done_callback(lambda _: self.tasks.pop(rid, None))
        if self.watch and (self._watcher is None or self._watcher.done()):
            self._watcher = asyncio.get_running_loop().create_task(self._watch())
        return first.response

    async def follow(self, rid: str, after: int = -1) -> AsyncIterator[str]:
        """The streamed response `rid`'s events after the `after`-th, as they come, to
        its last. A reader that goes away leaves the response running."""
        kept, k = self.logs[rid], after + 1
        while True:
            while k < len(kept.events):
                yield kept.events[k]
                k += 1
            if kept.done:
                return
            kept.changed.clear()
            await kept.changed.wait()

    async def _run(self, rid: str, first: Stored, events: AsyncIterator[str],
                   kept: _Log | None) -> None:
        try:
            await self._read(rid, first, events, kept)
        finally:
            if kept is not None:
                kept.add(None)

    async def _read(self, rid: str, first: Stored, events: AsyncIterator[str],
                    kept: _Log | None) -> None:
        item, final = first, None
        try:
            async for raw in events:
                if kept is not None:
                    kept.add(raw)
                kind = raw[len("event: "):raw.index("\n")]  # the frame's first line
                if kind in ("response.completed", "response.incomplete", "response.failed"):
                    final = json.loads(raw.split("data: ", 1)[1])["response"]  # once
                elif item.response["status"] == "queued" and kind not in (
                        "response.created", "response.in_progress"):
                    item = status_of(item, "in_progress")  # its first token is out
                    await self._keep(rid, item)
        except asyncio.CancelledError:  # `cancel` here; the stream's close aborted it
            await self._keep(rid, status_of(item, "cancelled"))
            return
        except Exception as e:  # noqa: BLE001 - this response fails, the front goes on
            log.warning("background response %s failed: %s", rid, e)
            final = {**item.response, "status": "failed",
                     "error": {"code": "server_error", "message": f"{type(e).__name__}: {e}"}}
        finally:  # a cancel between two events: its request aborted here
            await events.aclose()
        if final is None:  # the stream ended without a last event: cancelled meanwhile
            return
        done = replace(first, response={**final, "background": True,
                                        "created_at": first.response["created_at"]})
        if final["status"] != "failed":
            done = replace(done, messages=[*first.messages, answer_message(final["output"])])
        await self._keep(rid, done)

    async def _keep(self, rid: str, item: Stored) -> None:
        """Store `item` unless its record was cancelled or deleted meanwhile (through
        another front); one over the store's bytes alone becomes a failed record."""
        now = await self.off_loop(self.stored.get, rid)
        if now is None or now.response["status"] == "cancelled":
            return
        if not await self.off_loop(self.stored.put, rid, item):
            await self.off_loop(self.stored.put, rid, status_of(
                now, "failed", "the answer is larger than the store's "
                "max_stored_response_bytes alone; it was not kept", output=[]))

    async def _watch(self) -> None:
        """Every `poll_s` while this front runs any, one read of all their statuses
        (one round trip, however many run): those cancelled or deleted (by another
        front) are stopped."""
        while self.tasks:
            await asyncio.sleep(self.poll_s)
            try:
                now = await self.off_loop(self.stored.statuses, list(self.tasks))
            except Exception as e:  # noqa: BLE001 - the service restarting: look again
                log.debug("background responses: their records unread (%s)", e)
                continue
            for rid, status in now.items():
                task = self.tasks.get(rid)
                if task is not None and status in (None, "cancelled"):
                    task.cancel()

    async def cancel(self, rid: str, item: Stored) -> dict:
        """Cancel the running response `rid` (`item`: its record) -> its Response,
        `cancelled`. One this front runs stops at once; one another front runs is
        marked, and that front stops it within its `poll_s`."""
        task = self.tasks.get(rid)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            now = await self.off_loop(self.stored.get, rid)
            return (now or status_of(item, "cancelled")).response
        cancelled = status_of(item, "cancelled")
        await self.off_loop(self.stored.put, rid, cancelled)
        return cancelled.response

    def stop(self, rid: str) -> None:
        """A deleted response's task, if this front runs it: stopped."""
        task = self.tasks.get(rid)
        if task is not None:
            task.cancel()


def pending(item: Stored) -> bool:
    return item.response.get("status") in PENDING
