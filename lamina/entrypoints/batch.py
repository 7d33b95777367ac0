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
"""
from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from pathlib import Path

URLS = ("/v1/completions", "/v1/chat/completions")
IN_FLIGHT = 256  # requests sent at once (they batch in the engine)


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


def run_batch(app, input_path, output_path, progress: bool = True) -> BatchReport:
    """Answer INPUT's missing lines through the server `app`, appending to OUTPUT."""
    lines = read_input(input_path)
    have = done_ids(output_path)
    todo = [x for x in lines if x.custom_id not in have]
    failed = asyncio.run(_answer(app, todo, output_path, progress))
    return BatchReport(len(lines), len(lines) - len(todo), len(todo), failed)


async def _answer(app, todo: list[BatchLine], output_path, progress: bool) -> int:
    import httpx

    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(todo), desc="batch", unit="req")
    gate, failed = asyncio.Semaphore(IN_FLIGHT), 0
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://lamina",
                                 timeout=None) as client:
        with open(output_path, "a") as out:
            async def one(line: BatchLine):
                nonlocal failed
                async with gate:
                    row = await _request(client, line)
                failed += row["response"]["status_code"] != 200
                out.write(json.dumps(row) + "\n")  # one write: a whole line or none
                out.flush()
                if bar:
                    bar.update(1)

            await asyncio.gather(*(one(x) for x in todo))
    if bar:
        bar.close()
    return failed


async def _request(client, line: BatchLine) -> dict:
    if line.body.get("stream"):
        status, body = 400, {"error": {"message": "stream is not supported in a batch",
                                       "type": "invalid_request_error", "param": "stream",
                                       "code": None}}
    else:
        r = await client.post(line.url, json=line.body)
        status, body = r.status_code, r.json()
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": uuid.uuid4().hex,
                         "body": body}, "error": None}
