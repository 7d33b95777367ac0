"""`lamina batch INPUT.jsonl OUTPUT.jsonl`: an OpenAI batch file through the engine.

Data in: INPUT, one request per line in OpenAI's batch format
(`{"custom_id", "method": "POST", "url": "/v1/completions" | "/v1/chat/completions",
"body"}`), and an engine loop: the Lamina service's (`lamina.connect`) or a local
engine's. Data out: OUTPUT, one line per request in OpenAI's batch output format
(`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`),
written as each request finishes (so in finishing order, as OpenAI's).

Each body goes through the HTTP server's own app in this process (`build_app` over
`httpx.ASGITransport`, no socket), so a batch line is validated and answered exactly as
the same request sent to `lamina serve`: a bad body is that line's 400, not the batch's
end. Resumable: lines whose `custom_id` OUTPUT already holds are skipped (a line cut off
by a kill is dropped and redone), so a killed job rerun completes only what is missing.
The whole INPUT is checked first (JSON, unique `custom_id`s, method and url) and refused
naming the line before anything runs.

A 429 (the server's queue full: other jobs share it) or a 503 (the engine stopped, or
the Lamina service restarting) is not an answer: the line is sent again (`BatchRetry`),
and one still unanswered when its retries end is left out of OUTPUT, for a rerun to do,
not written as its result (a rerun would have skipped it).
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

URLS = ("/v1/completions", "/v1/chat/completions")
IN_FLIGHT = 256  # requests sent at once (they batch in the engine)
NOT_NOW = (429, 503)  # the server could not answer now: sent again, never written


@dataclass(frozen=True)
class BatchRetry:
    """When a line answered 429 or 503 is sent again."""
    wait_s: float = 600.0  # a line's retries end this long after its first answer
    unavailable: bool = True  # send 503s again (a service restarts); False: a stopped
    # local engine does not come back, so its 503s end the line's tries at once
    first_delay_s: float = 0.5  # a 503's first wait; doubled each time, up to max_delay_s
    max_delay_s: float = 10.0

    def __post_init__(self):
        for name in ("wait_s", "first_delay_s", "max_delay_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"BatchRetry.{name} must be >= 0")


@dataclass(frozen=True)
class BatchLine:
    custom_id: str
    url: str
    body: dict


@dataclass(frozen=True)
class BatchReport:
    total: int  # lines in INPUT
    skipped: int  # already in OUTPUT
    done: int  # answered now (any status)
    failed: int  # of those, answered with an error status
    left: int = 0  # not answered (429 / 503 until the retries ended): a rerun does them
    why_left: str | None = None  # the last such answer's status and message
    retried: int = 0  # lines sent more than once (answered 429 / 503 first)


def read_input(path: str | Path) -> list[BatchLine]:
    """INPUT's requests; a malformed file is refused naming the line."""
    lines, seen = [], set()
    for n, raw in enumerate(Path(path).read_text().splitlines(), 1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path}:{n}: a JSON object expected")
        cid, url, body = obj.get("custom_id"), obj.get("url"), obj.get("body")
        if not isinstance(cid, str) or not cid:
            raise ValueError(f"{path}:{n}: custom_id must be a non-empty string")
        if cid in seen:
            raise ValueError(f"{path}:{n}: duplicate custom_id {cid!r}")
        if obj.get("method", "POST") != "POST":
            raise ValueError(f"{path}:{n}: method must be POST, got {obj.get('method')!r}")
        if url not in URLS:
            raise ValueError(f"{path}:{n}: url must be one of {URLS}, got {url!r}")
        if not isinstance(body, dict):
            raise ValueError(f"{path}:{n}: body must be a JSON object")
        seen.add(cid)
        lines.append(BatchLine(cid, url, body))
    return lines


def done_ids(path: str | Path) -> set[str]:
    """The custom_ids OUTPUT holds; a last line cut off mid-write is removed."""
    p = Path(path)
    if not p.exists():
        return set()
    data = p.read_bytes()
    keep = data[: data.rfind(b"\n") + 1]  # whole lines only
    if len(keep) != len(data):
        p.write_bytes(keep)
    ids = set()
    for raw in keep.decode().splitlines():
        if raw.strip():
            ids.add(json.loads(raw)["custom_id"])
    return ids


def run_batch(app, input_path, output_path, progress: bool = True,
              retry: BatchRetry = BatchRetry()) -> BatchReport:
    """Answer INPUT's missing lines through the server `app`, appending to OUTPUT."""
    lines = read_input(input_path)
    have = done_ids(output_path)
    todo = [x for x in lines if x.custom_id not in have]
    counts, why = asyncio.run(_answer(app, todo, output_path, progress, retry))
    return BatchReport(len(lines), len(lines) - len(todo), counts["done"], counts["failed"],
                       counts["left"], why, counts["retried"])


async def _answer(app, todo: list[BatchLine], output_path, progress: bool,
                  retry: BatchRetry) -> tuple[dict[str, int], str | None]:
    """Post the lines, append their answers to OUTPUT -> (the counts `BatchReport`
    takes, the last unanswered line's status and message)."""
    import httpx

    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(todo), desc="batch", unit="req")
    gate, why = asyncio.Semaphore(IN_FLIGHT), []
    counts = {"done": 0, "failed": 0, "left": 0, "retried": 0}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://lamina",
                                 timeout=None) as client:
        with open(output_path, "a") as out:
            async def one(line: BatchLine):
                async with gate:
                    row, tries = await _request(client, line, retry)
                counts["retried"] += tries > 1
                status = row["response"]["status_code"]
                if status in NOT_NOW:  # no answer: left for a rerun
                    counts["left"] += 1
                    why.append(f"{status}: {_message(row)}")
                else:
                    counts["done"] += 1
                    counts["failed"] += status != 200
                    out.write(json.dumps(row) + "\n")  # one write: a whole line or none
                    out.flush()
                if bar:
                    bar.update(1)

            await asyncio.gather(*(one(x) for x in todo))
    if bar:
        bar.close()
    return counts, why[-1] if why else None


async def _request(client, line: BatchLine, retry: BatchRetry) -> tuple[dict, int]:
    """(The line's row, the times it was sent); a 429 / 503 is sent again until `retry`
    says stop (then the last such row, which the caller leaves out)."""
    if line.body.get("stream"):
        return _row(line, 400, {"error": {
            "message": "stream is not supported in a batch", "type": "invalid_request_error",
            "param": "stream", "code": None}}), 0
    delay, until, tries = retry.first_delay_s, None, 0
    while True:
        # the body as JSON with \u escapes: one that holds text no UTF-8 can carry (a
        # lone surrogate) reaches the server, which answers the line a 400 naming it
        r = await client.post(line.url, content=json.dumps(line.body),
                              headers={"content-type": "application/json"})
        row, tries, now = _row(line, r.status_code, r.json()), tries + 1, time.monotonic()
        until = now + retry.wait_s if until is None else until
        if r.status_code not in NOT_NOW or now >= until or (
                r.status_code == 503 and not retry.unavailable):
            return row, tries
        if r.status_code == 429:  # the server says when
            wait = float(r.headers.get("retry-after", delay))
        else:
            wait, delay = delay, min(2 * delay, retry.max_delay_s)
        await asyncio.sleep(min(wait, until - now))


def _row(line: BatchLine, status: int, body: dict) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": uuid.uuid4().hex,
                         "body": body}, "error": None}


def _message(row: dict) -> str:
    err = row["response"]["body"].get("error") if isinstance(row["response"]["body"],
                                                               dict) else None
    return err.get("message", "") if isinstance(err, dict) else str(row["response"]["body"])
