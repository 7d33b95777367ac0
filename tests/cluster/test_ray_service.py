"""The deploy-once path on a 2-raylet cluster (head: `lamina_compute` and the dashboard;
one memory node: `lamina_memory: 2`): `lamina up` starts the service, two drivers
submit to it at once, `lamina.connect()` streams / aborts, Ray Jobs run
examples/submit_job.py and `lamina batch` through it, `lamina serve --service` fronts it
(its fronts sharing the service's stored responses, a full queue their 429),
`lamina down` leaves nothing behind (asserted through Ray's state API), a service that
dies restarts by itself. Tests run in file order: each needs the service the earlier
ones left running."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import ray
import torch
from ray.experimental import internal_kv

import lamina
from lamina import SamplingParams
from tests.conftest import HF_NEW, SHORT_NEW, http_post

pytestmark = pytest.mark.multinode
ROOT = Path(__file__).resolve().parents[2]
LAMINA = [sys.executable, "-m", "lamina.entrypoints.cli"]
PICK = [0, 1, 3, 5, 7, 9, 12, 14]  # 8 prompts of 5-600 tokens
CONFIG = """
engine: {num_memory_workers: 2, num_kv_slots: 4096, max_step_tokens: 1024,
         scheduling_policy: priority}
cluster: {executor: ray, client_lease_s: 6}
"""
LEASE_S = 6.0  # a dead client's requests are aborted within this and a second
FRONT_KEY = "sk-front-test"  # the API key of the deployment's own HTTP front


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    dirs = [tempfile.mkdtemp(prefix="ls", dir="/tmp") for _ in range(3)]
    # cluster_utils writes the cluster's address into Ray's default temp folder without
    # making it: on a machine where no Ray has run yet, that folder does not exist
    os.makedirs(ray._common.utils.get_default_ray_temp_dir(), exist_ok=True)
    port = free_port()  # a busy dashboard port fails silently: choose it
    # logical CPUs: the workers' threads are their share of them (2 each here)
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"lamina_compute": 1}, "temp_dir": dirs[0],
        "include_dashboard": True, "dashboard_port": port})
    c.add_node(num_cpus=4, resources={"lamina_memory": 2}, temp_dir=dirs[1])
    c.wait_for_nodes()
    env = {**os.environ, "RAY_ADDRESS": c.address, "RAY_AUTH_MODE": "disabled"}
    ray.init(address=c.address, log_to_driver=False)
    try:
        yield {"cluster": c, "env": env, "dashboard": f"http://127.0.0.1:{port}",
               "tmp": Path(dirs[2])}
    finally:
        ray.shutdown()
        c.shutdown()
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


def post_json(port: int, path: str, body: dict) -> tuple[int, dict]:
    return http_post(f"http://127.0.0.1:{port}{path}", body)


def lamina_cmd(cluster, *args, timeout=300, env=None):
    return subprocess.run([*LAMINA, *args], env={**cluster["env"], **(env or {})},
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def alive_actors() -> list[str]:
    from ray.util.state import list_actors

    return sorted(a.class_name for a in list_actors(filters=[("state", "=", "ALIVE")]))


def lamina_actors() -> list[str]:
    """The service and its workers alive, and placement groups not removed."""
    from ray.util.state import list_placement_groups

    return alive_actors() + ["group"] * len([g for g in list_placement_groups()
                                             if g.state != "REMOVED"])


def test_up_refuses_a_bad_config_before_any_actor_starts(cluster):
    bad = cluster["tmp"] / "bad.yaml"
    bad.write_text("engine: {num_memory_workers: -1}\n")
    r = lamina_cmd(cluster, "up", "--config", str(bad))
    assert r.returncode == 2 and "num_memory_workers" in r.stderr, r.stderr[-2000:]
    with socket.socket() as held:  # another server on the port its front asks for
        held.bind(("0.0.0.0", 0))
        held.listen()
        port = held.getsockname()[1]
        r = lamina_cmd(cluster, "up", "--http-port", str(port))
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"HTTP front: cannot serve on 0.0.0.0:{port}: Address already in use" in r.stderr
    assert "answers anyone who reaches it (no API key" in r.stderr  # a note, said first
    assert alive_actors() == []


def test_up_places_the_workers_and_status_shows_them(cluster):
    cfg = cluster["tmp"] / "lamina.yaml"
    cfg.write_text(CONFIG)
    cluster["http"] = free_port()  # the deployment's own HTTP front (cluster.http_port)
    r = lamina_cmd(cluster, "up", "--config", str(cfg), "--http-port", str(cluster["http"]),
                   timeout=600, env={"LAMINA_API_KEY": FRONT_KEY})  # kept out of the file
    assert r.returncode == 0, r.stderr[-3000:]
    assert "no API key" not in r.stderr
    assert "Lamina service 'lamina' is up" in r.stdout and "memory 1" in r.stdout
    ip = cluster["cluster"].head_node.node_ip_address
    assert f"HTTP: http://{ip}:{cluster['http']} (its front's pid " in r.stdout, r.stdout
    again = lamina_cmd(cluster, "up", "--config", str(cfg))
    assert again.returncode != 0 and "already runs" in again.stderr, again.stderr[-2000:]
    s = json.loads(lamina_cmd(cluster, "status", "--json").stdout)
    nodes = {n.node_id for n in cluster["cluster"].list_all_nodes()}
    head = cluster["cluster"].head_node.node_id
    assert s["alive"] and s["workers"][0]["node"] == head
    mem = [w["node"] for w in s["workers"][1:]]
    assert len(mem) == 2 and set(mem) == nodes - {head}  # both on the memory node
    assert all(w["transport"].startswith("tcp ") for w in s["workers"][1:])
    # each worker's share of its node's cores: 2 / 1 compute slot, 4 / 2 memory slots
    assert [w["threads"] for w in s["workers"]] == [2, 2, 2]
    assert [k["free"] for k in s["kv"]] == [4096, 4096]
    assert s["http"]["state"] == "serving" and s["http"]["node"] == head


DRIVER = """
import asyncio, json, sys
import lamina
from lamina import SamplingParams
client = lamina.connect()
prompts, new = json.loads(sys.argv[1]), int(sys.argv[2])
handles = [client.submit(p, SamplingParams(max_tokens=new, temperature=0), priority=i % 3)
           for i, p in enumerate(prompts)]

async def collect(h):
    return [out async for out in h]
streamed = []
for i, h in enumerate(handles):
    # cumulative snapshots, the last one final: `async for` on the first, `for` on the rest
    snaps = asyncio.run(collect(h)) if i == 0 else list(h)
    assert all(len(a.token_ids) <= len(b.token_ids) for a, b in zip(snaps, snaps[1:]))
    assert len(snaps) > 1 and snaps[-1].finished
    streamed.append(snaps[-1].token_ids)
results = [h.result().token_ids for h in handles]
assert streamed == results, "streamed tokens differ from result()"
print("TOKENS", json.dumps(results))
"""


def test_two_drivers_at_once_get_hf_greedy(cluster, prompts, hf_greedy):
    halves = [PICK[0::2], PICK[1::2]]
    procs = [subprocess.Popen([sys.executable, "-c", DRIVER,
                               json.dumps([prompts[i] for i in half]), str(SHORT_NEW)],
                              env=cluster["env"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for half in halves]
    for half, p in zip(halves, procs):
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        line = next(x for x in out.splitlines() if x.startswith("TOKENS"))
        assert json.loads(line[len("TOKENS "):]) == [hf_greedy[i][:SHORT_NEW] for i in half]


def test_chat_through_the_service_gives_hf_greedy(cluster, smol):
    """`Client.chat` as `LLM.chat`: the served model's template (a developer turn as its
    system turn), then HF's greedy tokens for that text."""
    client = lamina.connect(cluster["cluster"].address)
    msgs = [{"role": "developer", "content": "Answer in one word."},
            {"role": "user", "content": "Name a colour."}]
    out = client.chat(msgs, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    tok = smol.tokenizer
    ids = tok.apply_chat_template([{**msgs[0], "role": "system"}, msgs[1]],
                                  add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    want = smol.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=8, pad_token_id=tok.eos_token_id)
    assert len(out) == 1 and out[0].token_ids == want[0, ids.shape[1]:].tolist()
    assert out[0].prompt_token_ids == ids[0].tolist()


def test_beam_search_through_the_client_and_an_http_front(cluster, smol):
    """`Client.beam_search` as `LLM.beam_search`, and `use_beam_search` on a front of the
    service (its engine's EOS ids and prompt ids come from the service): HF's beams."""
    from starlette.testclient import TestClient

    from lamina import BeamSearchParams
    from lamina.cluster.client import ServiceLoop
    from lamina.entrypoints.api_server import build_app
    from tests.lamina.test_beam_search import hf_beams

    client = lamina.connect(cluster["cluster"].address)
    text = "The capital of France is"
    want, scores = hf_beams(smol.model, smol.tokenizer(text)["input_ids"], 2, 6)
    out = client.beam_search([text], BeamSearchParams(beam_width=2, max_tokens=6))
    assert [c.token_ids for c in out[0].outputs] == want
    assert [c.score for c in out[0].outputs] == pytest.approx(scores, rel=1e-4)
    loop = ServiceLoop(client)
    try:
        r = TestClient(build_app(loop, "smollm2", client.tokenizer())).post(
            "/v1/completions", json={"prompt": text, "max_tokens": 6, "n": 2,
                                     "use_beam_search": True})
        assert r.status_code == 200, r.text
        assert [c["token_ids"] for c in r.json()["choices"]] == want
    finally:
        loop.shutdown()


def test_errors_arrive_as_the_local_api_raises_them(cluster, prompts):
    client = lamina.connect(cluster["cluster"].address)
    with pytest.raises(ValueError, match="context is 8192") as e:
        client.submit(prompts[-1] * 30, SamplingParams(max_tokens=8))
    assert type(e.value) is ValueError  # not Ray's wrapper
    bad = SamplingParams(max_tokens=8, structured_outputs={"regex": "a(b"})
    with pytest.raises(ValueError, match="StructuredOutputs.regex: .*unclosed group"):
        client.submit("hi", bad)  # the service's engine checks the grammar
    held = SamplingParams(max_tokens=8, temperature=0, structured_outputs={"choice": ["yes", "no"]})
    (out,) = client.generate(["Is the sky blue?"], held, use_tqdm=False)
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    with pytest.raises(ValueError, match="prompt 1"):
        client.generate(["fine", prompts[-1] * 30], SamplingParams(max_tokens=8),
                        use_tqdm=False)
    with pytest.raises(TypeError, match="priority must be an int"):
        client.submit("hi", SamplingParams(max_tokens=8), priority=0.5)


def test_abort_frees_the_requests_kv(cluster, prompts):
    client = lamina.connect(cluster["cluster"].address)
    start = [k["free"] for k in client.status()["kv"]]
    h = client.submit(prompts[8], SamplingParams(max_tokens=400, ignore_eos=True))
    seen = 0
    for out in h:
        seen += 1
        if len(out.token_ids) >= 4:
            assert client.abort(h)
            break
    final = h.result()
    assert final.finish_reason == "abort" and len(final.token_ids) < 400
    deadline = time.monotonic() + 10
    while [k["free"] for k in client.status()["kv"]] != start:
        assert time.monotonic() < deadline, client.status()["kv"]
        time.sleep(0.1)
    assert client.status()["aborted"] >= 1


def test_ctrl_c_in_generate_aborts_its_requests_at_the_service(cluster, prompts,
                                                               monkeypatch):
    """A client's `generate` interrupted (Ctrl-C while it waits for the first answer)
    aborts its requests at the service: none runs on unread, their KV is freed."""
    from lamina.cluster.client import RequestHandle

    client = lamina.connect(cluster["cluster"].address)
    before = client.status()

    def interrupted(self, timeout=None):
        next(iter(self))  # running at the service
        raise KeyboardInterrupt

    monkeypatch.setattr(RequestHandle, "result", interrupted)
    with pytest.raises(KeyboardInterrupt):
        client.generate([prompts[8], prompts[3]], SamplingParams(max_tokens=400,
                                                                 ignore_eos=True),
                        use_tqdm=False)
    monkeypatch.undo()
    deadline = time.monotonic() + 10
    free = [k["free"] for k in before["kv"]]
    while (s := client.status())["running"] or [k["free"] for k in s["kv"]] != free:
        assert time.monotonic() < deadline, (s["running"], s["kv"], free)
        time.sleep(0.1)
    assert s["aborted"] == before["aborted"] + 2


def test_killed_memory_workers_are_replaced_under_the_service(cluster, prompts, hf_greedy):
    """Deployed once, the service recovers by itself: both memory workers killed (kill
    -9) mid-generation are replaced, the request still ends with HF's greedy tokens, and
    `status` counts the recovery and the replacements."""
    from ray.util.state import list_actors

    client = lamina.connect(cluster["cluster"].address)
    before = client.status()
    pids = [a.pid for a in list_actors(filters=[("state", "=", "ALIVE"),
                                                ("class_name", "=", "MemoryWorker")])]
    assert len(pids) == 2
    h = client.submit(prompts[8], SamplingParams(max_tokens=HF_NEW, temperature=0))
    next(iter(h))  # running: its prompt's KV is on the workers
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    assert h.result().token_ids == hf_greedy[8]
    s = client.status()
    assert s["alive"] and s["recoveries"] == before["recoveries"] + 1
    assert s["kv_kept_tokens"] == before["kv_kept_tokens"]  # both pools were new
    assert s["workers_replaced"] == {"compute": before["workers_replaced"]["compute"],
                                     "memory": before["workers_replaced"]["memory"] + 2}
    n = s["workers_replaced"]
    assert (f"workers replaced: {n['compute']} compute, {n['memory']} memory"
            in lamina_cmd(cluster, "status").stdout)


def test_lamina_scale_puts_a_memory_worker_on_a_node_that_joined_and_takes_it_off(
        cluster, prompts, hf_greedy):
    """A memory node joins the cluster (as `ray up`'s autoscaler adds one): `lamina
    scale --memory-workers 3` starts a third memory worker on it while a request
    generates, in a placement group of its own, and `status` shows it there; the
    request and later ones get HF's greedy tokens; `--memory-workers 2` takes it off
    (its group removed) and the node can go. A count of 0 is refused by name, the
    service serving on."""
    c = cluster["cluster"]
    client = lamina.connect(c.address)
    before = sorted(lamina_actors())
    node = c.add_node(num_cpus=2, resources={"lamina_memory": 1},
                      temp_dir=tempfile.mkdtemp(prefix="ls", dir="/tmp"))
    c.wait_for_nodes()
    greedy = SamplingParams(max_tokens=HF_NEW, temperature=0)
    h = client.submit(prompts[8], greedy)
    next(iter(h))  # running
    r = lamina_cmd(cluster, "scale", "--memory-workers", "3")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "memory workers 2 -> 3 in " in r.stdout and "0 running sequences moved with " \
        "their KV (0 positions), 0 preempted, 0 positions to compute again" in r.stdout, r.stdout
    s = client.status()
    mem = [w for w in s["workers"] if w["role"].startswith("memory")]
    assert [w["role"] for w in mem] == ["memory 0", "memory 1", "memory 2"]
    assert mem[2]["node"] == node.node_id and mem[2]["threads"] == 2
    assert [k["free"] for k in s["kv"]][2] == 4096
    assert sorted(lamina_actors()) == sorted([*before, "MemoryWorker", "group"])
    assert h.result().token_ids == hf_greedy[8]
    outs = client.generate([prompts[i] for i in PICK], greedy, use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy[i] for i in PICK]
    bad = lamina_cmd(cluster, "scale", "--memory-workers", "0")
    assert bad.returncode == 2 and "memory workers must be >= 1, not 0" in bad.stderr
    r = lamina_cmd(cluster, "scale", "--memory-workers", "2")
    assert r.returncode == 0 and "memory workers 3 -> 2" in r.stdout, r.stderr[-3000:]
    assert sorted(lamina_actors()) == before
    assert len(client.status()["kv"]) == 2
    c.remove_node(node)
    assert client.generate([prompts[3]], greedy, use_tqdm=False)[0].token_ids == hf_greedy[3]


@pytest.fixture(scope="module")
def local_greedy():
    """`LLM.generate` in this process (local executor): the reference for job outputs."""
    from lamina import LLM

    llm = LLM(num_kv_slots=4096)

    def run(prompts, max_tokens):
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0),
                            use_tqdm=False)
        return [o.token_ids for o in outs]
    yield run
    llm.shutdown()


def wait_job(client, job_id: str, timeout: float = 300) -> str:
    from ray.job_submission import JobStatus

    deadline = time.monotonic() + timeout
    while (status := client.get_job_status(job_id)) not in (
            JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
        assert time.monotonic() < deadline, f"job {job_id} still {status}"
        time.sleep(1)
    return status


def test_ray_job_runs_submit_job_through_the_service(cluster, local_greedy):
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(cluster["dashboard"])
    out = cluster["tmp"] / "answers.jsonl"
    job = client.submit_job(entrypoint=f"{sys.executable} {ROOT}/examples/submit_job.py "
                                       f"--out {out} --max-tokens 24",
                            runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled"}})
    assert wait_job(client, job) == "SUCCEEDED", client.get_job_logs(job)[-3000:]
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["token_ids"] for r in rows] == local_greedy([r["prompt"] for r in rows], 24)
    assert "answers written" in client.get_job_logs(job)


def batch_input(path: Path, n: int) -> list[str]:
    texts = [f"Item {i}: a short note about the number {i * 7}." for i in range(n)]
    with open(path, "w") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"custom_id": f"req-{i}", "method": "POST",
                                "url": "/v1/completions",
                                "body": {"prompt": t, "max_tokens": 8 + 4 * (i % 5),
                                         "temperature": 0}}) + "\n")
    return texts


def test_ray_job_runs_lamina_batch_through_the_service(cluster, local_greedy):
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(cluster["dashboard"])
    src, out = cluster["tmp"] / "batch.jsonl", cluster["tmp"] / "batch.out.jsonl"
    texts = batch_input(src, 10)
    job = client.submit_job(entrypoint=f"{sys.executable} -m lamina.entrypoints.cli batch "
                                       f"{src} {out} --no-progress",
                            runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled"}})
    assert wait_job(client, job) == "SUCCEEDED", client.get_job_logs(job)[-3000:]
    assert "through the Lamina service 'lamina'" in client.get_job_logs(job)
    rows = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(rows) == sorted(f"req-{i}" for i in range(10))  # each once
    for i, t in enumerate(texts):
        body = rows[f"req-{i}"]["response"]["body"]
        assert rows[f"req-{i}"]["response"]["status_code"] == 200
        assert body["choices"][0]["token_ids"] == local_greedy([t], 8 + 4 * (i % 5))[0]


def test_serve_service_fronts_the_running_service(cluster, prompts, hf_greedy):
    from openai import OpenAI

    port = free_port()
    srv = subprocess.Popen([*LAMINA, "serve", "--service", "lamina", "--port", str(port)],
                           env=cluster["env"], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        oai = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        deadline = time.monotonic() + 120
        while True:
            try:
                model = oai.models.list().data[0].id
                break
            except Exception:  # noqa: BLE001 - not up yet
                assert srv.poll() is None and time.monotonic() < deadline, srv.stdout.read()
                time.sleep(0.5)
        r = oai.completions.create(model=model, prompt=prompts[3], max_tokens=HF_NEW,
                                   temperature=0, extra_body={"priority": -1})
        assert r.choices[0].model_extra["token_ids"] == hf_greedy[3]
        # vLLM's /detokenize and /tokenize answer with the service's model's limits
        text = post_json(port, "/detokenize", {"tokens": prompts[3]})[1]["prompt"]
        status, counted = post_json(port, "/tokenize", {"prompt": text})
        assert status == 200 and counted["max_model_len"] == 8192
        assert counted["count"] == len(counted["tokens"]) > len(prompts[3]) // 2
        status, bad = post_json(port, "/detokenize", {"tokens": [10 ** 6]})
        assert status == 400 and "49152" in bad["error"]["message"]
    finally:
        srv.terminate()
        srv.wait(30)


def test_http_fronts_of_one_service_share_its_stored_responses(cluster, smol):
    """Two HTTP fronts of the service (the app `lamina serve --service` builds, twice, each
    over its own `ServiceLoop`, as two front processes behind a load balancer would
    be): a response stored through one is retrieved through the other and continued
    there with HF's greedy text for the whole conversation; deleted through the
    second, the first answers 404 for it. A background response started on one is
    polled to HF's text through the other, and one cancelled through the other is
    stopped by the front that runs it (it reads the record every second); a streamed
    one's events are resumed on its front (the same events) and refused by the other."""
    from starlette.testclient import TestClient

    from lamina.cluster.client import ServiceLoop
    from lamina.entrypoints.api_server import build_app

    client = lamina.connect(cluster["cluster"].address)
    loops = [ServiceLoop(client) for _ in range(2)]
    # each front's event loop kept for the test (its background responses run there)
    with TestClient(build_app(loops[0], "smollm2", client.tokenizer())) as a, \
            TestClient(build_app(loops[1], "smollm2", client.tokenizer())) as b:
        _share_and_background(client, smol, a, b)
    for loop in loops:
        loop.shutdown()


def _settled(front, rid: str, until=("completed", "incomplete", "failed", "cancelled")):
    deadline = time.monotonic() + 120
    while (got := front.get(f"/v1/responses/{rid}").json())["status"] not in until:
        assert time.monotonic() < deadline, got
        time.sleep(0.1)
    return got


def _share_and_background(client, smol, a, b) -> None:
    """The fronts `a` and `b` over one service (the test above)."""
    from tests.lamina.test_responses import _hf

    first = [{"role": "user", "content": "Name a colour."}]
    r = a.post("/v1/responses", json={"input": first[0]["content"],
                                      "max_output_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    rid, answer = r.json()["id"], r.json()["output"][0]["content"][0]["text"]
    assert b.get(f"/v1/responses/{rid}").json() == r.json()
    r2 = b.post("/v1/responses", json={"input": "And another one?", "max_output_tokens": 8,
                                       "previous_response_id": rid, "temperature": 0})
    assert r2.status_code == 200, r2.text
    history = [*first, {"role": "assistant", "content": answer},
               {"role": "user", "content": "And another one?"}]
    ids, text = _hf(smol, history, 8)
    assert r2.json()["output"][0]["content"][0]["text"] == text
    assert r2.json()["usage"]["input_tokens"] == len(ids)
    assert b.delete(f"/v1/responses/{rid}").status_code == 200
    gone = a.get(f"/v1/responses/{rid}")
    assert gone.status_code == 404 and "keeps the last 1024" in gone.text, gone.text

    bg = a.post("/v1/responses", json={"input": first[0]["content"], "temperature": 0,
                                       "max_output_tokens": 8, "background": True})
    assert bg.status_code == 200 and bg.json()["status"] == "queued", bg.text
    done = _settled(b, bg.json()["id"])
    assert done["output"][0]["content"][0]["text"] == _hf(smol, first, 8)[1]
    # streamed in the background: its events from a, resumed on a; b keeps none of them
    with a.stream("POST", "/v1/responses", json={
            "input": first[0]["content"], "temperature": 0, "max_output_tokens": 8,
            "background": True, "stream": True}) as st:
        events = [json.loads(x[6:]) for x in st.iter_lines() if x.startswith("data: {")]
    sid = events[0]["response"]["id"]
    assert events[0]["response"]["status"] == "queued", events[0]
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    assert "".join(e.get("delta", "") for e in events if e["type"] ==
                   "response.output_text.delta") == _hf(smol, first, 8)[1]
    again = a.get(f"/v1/responses/{sid}", params={"stream": "true", "starting_after": 2})
    assert [json.loads(x[6:]) for x in again.text.splitlines()
            if x.startswith("data: {")] == events[3:]
    other = b.get(f"/v1/responses/{sid}", params={"stream": "true"})
    assert other.status_code == 400 and other.json()["error"]["param"] == "stream"
    assert b.get(f"/v1/responses/{sid}").json()["output"] == events[-1]["response"]["output"]
    before = client.status()["aborted"]
    long = a.post("/v1/responses", json={
        "input": "Sing.", "max_output_tokens": 900, "background": True,
        "structured_outputs": {"regex": "(la ){400}"}}).json()
    _settled(b, long["id"], ("in_progress",))
    cancelled = b.post(f"/v1/responses/{long['id']}/cancel")
    assert cancelled.json()["status"] == "cancelled", cancelled.text
    deadline = time.monotonic() + 10  # a's next read of the record, then a step
    while client.status()["aborted"] == before:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    time.sleep(1.5)  # a has stopped it: it leaves the record as b marked it
    assert a.get(f"/v1/responses/{long['id']}").json()["status"] == "cancelled"


def test_the_deployments_own_front_serves_and_comes_back(cluster, prompts, hf_greedy):
    """`lamina up --http-port P` (the test above): the OpenAI API on P behind the API key
    `up` took from $LAMINA_API_KEY, answering with HF's greedy tokens, its URL in
    `status`; its process killed mid-stream, the stream's request is aborted within the
    front's client lease (not run to its 4000th token) and a background response it
    ran is marked failed, Ray starts the front again on the same port (RESTARTING in
    `status` meanwhile), the record names the new process, and it answers as before;
    its actor removed by hand, `status` says GONE."""
    import openai
    from openai import OpenAI

    from lamina.cluster.front import front_state

    port = cluster["http"]
    client = lamina.connect(cluster["cluster"].address)
    front = client.status()["http"]
    assert front["url"].endswith(f":{port}")
    with pytest.raises(openai.AuthenticationError):  # `up` took $LAMINA_API_KEY for it
        OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none").models.list()
    oai = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=FRONT_KEY, max_retries=0)

    def complete(i: int) -> list[int]:
        r = oai.completions.create(model=oai.models.list().data[0].id, prompt=prompts[i],
                                   max_tokens=SHORT_NEW, temperature=0)
        return r.choices[0].model_extra["token_ids"]

    assert complete(5) == hf_greedy[5][:SHORT_NEW]
    # a stream in flight when the front's process dies: nobody reads it any more, so
    # the service aborts it once the front's lease runs out, not at its last token
    before = client.status()
    long = oai.completions.create(model=oai.models.list().data[0].id, prompt=prompts[5],
                                  max_tokens=4000, temperature=0, stream=True,
                                  extra_body={"ignore_eos": True})
    next(iter(long))
    bg = oai.responses.create(model=oai.models.list().data[0].id, input="Sing.",
                              max_output_tokens=900, background=True,
                              extra_body={"structured_outputs": {"regex": "(la ){400}"}})
    started = time.monotonic()
    while (s := client.status())["running"] < 2:  # both at their tokens when it dies
        assert time.monotonic() - started < 60, s
        time.sleep(0.1)
    os.kill(front["pid"], signal.SIGKILL)
    killed = time.monotonic()
    assert front_state("lamina")["state"] == "restarting"  # its process starts again
    while (s := client.status())["running"]:
        assert time.monotonic() - killed < LEASE_S + 5, s  # 4000 tokens take minutes here
        time.sleep(0.5)
    assert s["orphans_aborted"] == before["orphans_aborted"] + 2
    assert s["aborted"] == before["aborted"] + 2
    failed = client.ask("response_get", bg.id).response  # not left "in_progress"
    assert failed["status"] == "failed", failed
    assert "went silent past its lease" in failed["error"]["message"], failed
    while (again := client.status()["http"])["pid"] == front["pid"]:
        assert time.monotonic() - killed < 120, again
        time.sleep(0.5)
    assert again["url"] == front["url"] and again["since"] > front["since"]
    assert complete(7) == hf_greedy[7][:SHORT_NEW]
    assert front_state("lamina") == {**again, "state": "serving"}
    # its actor removed by hand (not by `lamina down`): status says so, not the old pid
    ray.kill(ray.get_actor("lamina:http", namespace="lamina"), no_restart=True)
    while (gone := front_state("lamina"))["state"] != "gone":
        assert time.monotonic() - killed < 150, gone
        time.sleep(0.2)
    shown = lamina_cmd(cluster, "status").stdout
    assert f"HTTP: {front['url']} (GONE: its front's actor was removed" in shown, shown


def test_a_front_over_a_full_service_answers_429(cluster):
    """The service's queue bound (its server.max_waiting, 1024) reaches an HTTP front
    over it as OpenAI's 429 `server_busy` with Retry-After: the service raised
    `EngineOverloaded` for a completions request of 1025 prompts (the front's own
    bound, max_prompts, raised to let them through), and nothing of it was queued."""
    from starlette.testclient import TestClient

    from lamina.cluster.client import ServiceLoop
    from lamina.entrypoints.api_server import ServerConfig, build_app

    client = lamina.connect(cluster["cluster"].address)
    loop = ServiceLoop(client)
    web = TestClient(build_app(loop, "smollm2", client.tokenizer(),
                               ServerConfig(max_prompts=1025)))
    before = client.status()
    try:
        r = web.post("/v1/completions", json={"prompt": ["Hi"] * 1025, "max_tokens": 1})
    finally:
        loop.shutdown()
    assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
    err = r.json()["error"]
    assert err["code"] == "server_busy" and "(limit 1024)" in err["message"], err
    after = client.status()
    assert (after["waiting"], after["running"]) == (0, 0)
    assert after["finished"] + after["aborted"] == before["finished"] + before["aborted"]


def test_down_leaves_no_actor_or_placement_group(cluster):
    r = lamina_cmd(cluster, "down")
    assert r.returncode == 0, r.stderr[-2000:]
    deadline = time.monotonic() + 30
    while lamina_actors():
        assert time.monotonic() < deadline, lamina_actors()
        time.sleep(0.5)
    with pytest.raises(ConnectionRefusedError):  # its front went with it
        socket.create_connection(("127.0.0.1", cluster["http"]), timeout=5).close()
    gone = lamina_cmd(cluster, "status")
    assert gone.returncode == 2 and "lamina up" in gone.stderr
    assert "it is gone" not in gone.stderr  # stopped on purpose: no record of its starts
    # nor its stored responses (the fronts' test above left one)
    assert internal_kv._internal_kv_list("service:lamina:", namespace="lamina") == []


AUTOSCALED = """
engine: {num_memory_workers: 1, num_kv_slots: 300, max_step_tokens: 1024}
cluster: {executor: ray}
autoscale: {max_memory_workers: 2, min_memory_workers: 1, interval_s: 0.2,
            up_utilization: 0.6, up_after_s: 0.4, down_utilization: 0.3,
            down_after_s: 1.0, cooldown_s: 0.5}
"""


def test_an_autoscaled_service_grows_its_pool_under_a_burst_and_shrinks_it_idle(
        cluster, prompts, hf_greedy):
    """A service deployed with one memory worker of 300 slots and `autoscale` up to 2:
    a burst of 8 prompts (5-600 tokens, 32 new each) fills the pool, sequences wait, so
    it adds a second worker (started beside the steps, in a placement group of its own,
    on the memory node's other `lamina_memory` unit) while they run; idle again, it
    takes it away. HF's greedy tokens; `lamina status` says what it did; `down` leaves
    nothing."""
    cfg = cluster["tmp"] / "autoscaled.yaml"
    cfg.write_text(AUTOSCALED)
    r = lamina_cmd(cluster, "up", "--config", str(cfg), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    client = lamina.connect(cluster["cluster"].address)
    outs = client.generate([prompts[i] for i in PICK if len(prompts[i]) < 300],
                           SamplingParams(max_tokens=HF_NEW, temperature=0), use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy[i] for i in PICK if len(prompts[i]) < 300]
    deadline = time.monotonic() + 60
    while True:
        s = client.status()
        a, mem = s["autoscale"], [w for w in s["workers"] if w["role"].startswith("memory")]
        if a["changes"] >= 2 and len(mem) == 1:
            break
        assert time.monotonic() < deadline, s
        time.sleep(0.2)
    assert (a["min"], a["max"], a["error"]) == (1, 2, None)
    assert (a["last"]["before"], a["last"]["after"]) == (2, 1), a
    out = lamina_cmd(cluster, "status").stdout
    assert f"autoscale: 1-2 memory workers, {a['changes']} changes; the last 2 -> 1" in out, out
    assert lamina_cmd(cluster, "down").returncode == 0
    deadline = time.monotonic() + 30
    while lamina_actors():
        assert time.monotonic() < deadline, lamina_actors()
        time.sleep(0.5)


@pytest.mark.parametrize(("record", "why"), [
    ({}, None),  # never started, or stopped by `lamina down`
    ({"restarts": 0, "failed": "ModelLoadError: no model"},
     "its start failed: ModelLoadError: no model"),
    ({"restarts": 2, "pid": 7, "max_restarts": 2},
     "its process (pid 7) died after 2 restarts, with no restart left (cluster.max_restarts 2)"),
    ({"restarts": 1, "pid": 7, "max_restarts": -1},
     "its process (pid 7) died after 1 restart, and Ray did not start it again (`ray logs` "
     "of the service)"),
])
def test_a_gone_service_is_said_why_from_its_record(record, why):
    from lamina.cluster.service import gone_why

    assert gone_why(record) == why


DIED = "its process (pid 7) died: killed, or crashed (`ray logs` of the service's worker)"


@pytest.mark.parametrize(("record", "said"), [
    ({}, (None, None, None, "is restarting (a restart, its new process not started yet)")),
    # the new process wrote its start, 40 s ago: it loads
    ({"restarts": 2, "cause": DIED, "pid": 9, "max_restarts": 3, "serving": False,
      "since": 60.0}, (2, DIED, 40.0, "is restarting (restart 2 of at most 3, loading for "
                                      f"40 s): {DIED}")),
    # still the record of the process that died (`serving`): the next restart is due
    ({"restarts": 1, "pid": 7, "max_restarts": -1, "serving": True, "since": 0.0},
     (2, DIED, None, f"is restarting (restart 2, its new process not started yet): {DIED}")),
    ({"restarts": 0, "pid": 7, "exiting": "its engine stopped: x", "max_restarts": 5,
      "serving": True}, (1, "its engine stopped: x", None,
                         "is restarting (restart 1 of at most 5, its new process not "
                         "started yet): its engine stopped: x")),
    # the new process waits for the cluster to hold its workers
    ({"restarts": 1, "cause": DIED, "pid": 9, "max_restarts": -1, "serving": False,
      "since": 90.0, "waiting": "lamina_compute: needs 1, the cluster has 0"},
     (1, DIED, 10.0, "is restarting (restart 1, loading for 10 s, waiting for room: "
                     f"lamina_compute: needs 1, the cluster has 0): {DIED}")),
    # a waiting start's record once it served, then its process died: not waiting
    ({"restarts": 1, "pid": 9, "max_restarts": -1, "serving": True, "since": 0.0,
      "waiting": None}, (2, DIED.replace("7", "9"), None,
                         "is restarting (restart 2, its new process not started yet): "
                         f"{DIED.replace('7', '9')}")),
])
def test_a_restarting_service_is_said_so_from_its_record(record, said, capsys):
    from lamina.cluster.cli import _print_status
    from lamina.cluster.service import restarting_status

    s = restarting_status("lamina", record, now=100.0)
    assert (s["state"], s["alive"], s["name"]) == ("restarting", False, "lamina")
    assert (s["restarts"], s["restart_cause"], s["loading_s"]) == said[:3]
    assert s["error"] == f"the Lamina service 'lamina' {said[3]}"
    assert _print_status(s, as_json=False) == 0  # what `lamina status` prints meanwhile
    assert capsys.readouterr().out == (f"service 'lamina': RESTARTING: {s['error']}; "
                                       "`lamina status --wait` waits for it\n")


@pytest.mark.parametrize(("record", "under_way"), [
    ({}, False),
    ({"restarts": 0, "serving": False}, False),  # the first start: `up` waits for it
    ({"restarts": 2, "serving": False}, True),  # a restart's process starts (or waits)
    ({"restarts": 2, "serving": True}, False),
    ({"restarts": 2, "serving": False, "failed": "NoRoom: x"}, False),  # gone: said so
])
def test_calls_that_do_not_wait_see_a_restart_under_way_from_the_record(record, under_way):
    """`wait=False` calls (`lamina status`, `/health`, scrapes) answer at once while a
    restart's process starts, since Ray holds calls until its constructor returns."""
    from lamina.cluster.client import _restart_under_way

    assert _restart_under_way(record) is under_way


RESTARTING = """
engine: {num_memory_workers: 2, num_kv_slots: 4096, max_step_tokens: 1024,
         max_recoveries: 0}
cluster: {executor: ray, max_restarts: 3}
"""


def test_a_dead_service_restarts_until_a_restart_fails(cluster, smol, prompts, hf_greedy,
                                                      capsys):
    """The service starts again by itself, new workers and all: once when its engine
    stops (its memory workers killed, max_recoveries 0), once when its process is killed
    (kill -9). Each time the request it held fails at the client, the next call waits
    for the restart and gets HF's greedy tokens, and `status` says why it restarted
    (at once while it restarts); a stored response is kept through the restart and its
    conversation continued with HF's text; a batch job's lines in flight at the kill
    are sent again and get HF's tokens. A third restart that cannot start (its model
    folder gone) leaves nothing behind, and the waiting client and `lamina status` say
    why."""
    from ray.util.state import list_actors
    from starlette.testclient import TestClient

    from lamina.cluster.cli import _print_status
    from lamina.cluster.client import ServiceLoop
    from lamina.cluster.service import up
    from lamina.entrypoints.api_server import build_app
    from lamina.entrypoints.batch import run_batch
    from lamina.entrypoints.deploy_config import LaminaConfig
    from lamina.errors import EngineDead
    from lamina.model.loader import default_model_path
    from tests.lamina.test_responses import _hf

    model = cluster["tmp"] / "restart_model"  # the SmolLM2 GGUF, in a folder of its own
    model.mkdir()
    (model / default_model_path().name).symlink_to(default_model_path())
    cfg = cluster["tmp"] / "restarting.yaml"
    cfg.write_text(RESTARTING + f"model: {{path: {model}}}\n")
    up(LaminaConfig.from_yaml(cfg), timeout_s=600)
    # a placement group for the compute worker and one for each memory worker
    deployed = ["LaminaService", "ComputeWorker", "MemoryWorker", "MemoryWorker", "group",
                "group", "group"]
    assert sorted(lamina_actors()) == sorted(deployed)
    client = lamina.connect(cluster["cluster"].address)
    greedy = SamplingParams(max_tokens=HF_NEW, temperature=0)

    def held_when(kill) -> BaseException:
        h = client.submit(prompts[8], SamplingParams(max_tokens=400, ignore_eos=True))
        next(iter(h))  # running
        kill()
        with pytest.raises(Exception) as e:
            h.result()
        return e.value

    web = TestClient(build_app(ServiceLoop(client), client.model(), client.tokenizer()))
    first = [{"role": "user", "content": "Name a colour."}]
    stored = web.post("/v1/responses", json={"input": first[0]["content"],
                                             "max_output_tokens": 8, "temperature": 0})
    assert stored.status_code == 200, stored.text
    before = client.status()
    mem = [a.pid for a in list_actors(filters=[("state", "=", "ALIVE"),
                                               ("class_name", "=", "MemoryWorker")])]
    e = held_when(lambda: [os.kill(pid, signal.SIGKILL) for pid in mem])  # its KV's holder
    assert "memory worker" in str(e), e  # the step's error, as the engine raised it
    assert client.generate([prompts[3]], greedy, use_tqdm=False)[0].token_ids == hf_greedy[3]
    s = client.status()
    assert (s["restarts"], s["max_restarts"]) == (1, 3) and s["pid"] != before["pid"]
    assert s["restart_cause"].startswith("its engine stopped: "), s["restart_cause"]
    assert s["alive"] and sorted(lamina_actors()) == sorted(deployed)  # the old ones gone
    rid = stored.json()["id"]  # the stored response, kept through the restart
    assert web.get(f"/v1/responses/{rid}").json() == stored.json()
    r = web.post("/v1/responses", json={"input": "And another one?", "max_output_tokens": 8,
                                        "previous_response_id": rid, "temperature": 0})
    assert r.status_code == 200, r.text
    answer = stored.json()["output"][0]["content"][0]["text"]
    _, text = _hf(smol, [*first, {"role": "assistant", "content": answer},
                         {"role": "user", "content": "And another one?"}], 8)
    assert r.json()["output"][0]["content"][0]["text"] == text

    # a batch job's lines in flight when the process dies are sent again (503: no answer)
    src, out = cluster["tmp"] / "restart_in.jsonl", cluster["tmp"] / "restart_out.jsonl"
    src.write_text("".join(json.dumps({
        "custom_id": f"p{i}", "method": "POST", "url": "/v1/completions",
        "body": {"prompt": prompts[i], "max_tokens": 100, "temperature": 0,
                 "ignore_eos": True}}) + "\n" for i in (2, 5)))
    front = ServiceLoop(client)
    app, report = build_app(front, client.model(), client.tokenizer()), []
    job = threading.Thread(target=lambda: report.append(run_batch(app, src, out, False)))
    job.start()
    deadline = time.monotonic() + 60
    while client.status()["running"] < 2:
        assert time.monotonic() < deadline and job.is_alive(), report
        time.sleep(0.05)
    e = held_when(lambda: os.kill(s["pid"], signal.SIGKILL))
    assert isinstance(e, EngineDead) and "died or became unreachable while this call ran" in str(e)
    # one call while Ray starts the process again (the restart takes seconds; each call
    # seconds too): the front's health check, `status(wait=False)` as `lamina status` asks
    assert not front.alive  # its /health: 503, saying why from the record of starts
    assert front.error.startswith("the Lamina service 'lamina' is restarting (restart 2 of "
                                  "at most 3, "), front.error
    assert f"): its process (pid {s['pid']}) died: killed, or crashed" in front.error
    assert client.generate([prompts[3]], greedy, use_tqdm=False)[0].token_ids == hf_greedy[3]
    job.join(300)
    assert report and (report[0].done, report[0].failed, report[0].left) == (2, 0, 0)
    assert report[0].retried == 2  # both were in flight: answered 503, sent again
    for row in map(json.loads, out.read_text().splitlines()):
        i = int(row["custom_id"][1:])
        assert row["response"]["body"]["choices"][0]["token_ids"][:len(hf_greedy[i])] == \
            hf_greedy[i]  # HF's greedy tokens up to its EOS, which ignore_eos goes past
    s2 = client.status()
    assert s2["restarts"] == 2 and s2["pid"] != s["pid"]
    assert s2["restart_cause"].startswith(f"its process (pid {s['pid']}) died")
    capsys.readouterr()
    _print_status(s2, as_json=False)  # what `lamina status` prints
    printed = capsys.readouterr().out
    assert f"restarts: 2 (at most 3); the latest because its process (pid {s['pid']})" in \
        printed
    # the response stored before the first restart and the one that continued it, their
    # bytes the JSON of what the service holds (reloaded from its copy twice since)
    held = [client.ask("response_get", x) for x in (rid, r.json()["id"])]
    nbytes = sum(len(json.dumps({"response": h.response, "messages": h.messages,
                                 "session": h.session, "inputs": h.inputs,
                                 "owner": h.owner}).encode())
                 for h in held)
    assert s2["stored_response_bytes"] == nbytes
    assert (f"stored responses: 2, {nbytes / 1024:.1f} KiB (at most 1024 and 256.0 MiB, "
            f"kept through restarts)") in printed
    scraped = client.ask("metrics_text").decode()  # what its HTTP fronts' /metrics give
    assert "\nlamina_service_restarts 2.0\n" in scraped, scraped[-3000:]
    assert "\nlamina_stored_responses 2.0\n" in scraped
    assert f"\nlamina_stored_response_bytes {float(nbytes)}\n" in scraped

    shutil.rmtree(model)  # the next start cannot load the model
    e = held_when(lambda: os.kill(s2["pid"], signal.SIGKILL))
    assert isinstance(e, EngineDead), e
    gone = "is gone: its restart 3 failed: ModelLoadError: model path does not exist"
    with pytest.raises(EngineDead, match=f"the Lamina service 'lamina' {gone}"):
        client.submit("hello")  # waits for the restart, which fails
    deadline = time.monotonic() + 60
    while lamina_actors():  # the failed start's placement and workers too, if any
        assert time.monotonic() < deadline, lamina_actors()
        time.sleep(0.5)
    r = lamina_cmd(cluster, "status")
    assert r.returncode == 2 and f"it {gone}" in r.stderr and "lamina up" in r.stderr, \
        r.stderr[-2000:]


SHORT = """
engine: {num_memory_workers: 3, num_kv_slots: 4096, max_step_tokens: 1024,
         placement_timeout_s: 4}
cluster: {executor: ray, max_restarts: 3, regrow_interval_s: 1}
"""


def test_a_restart_short_of_room_deploys_fewer_memory_workers_and_grows_back(
        cluster, prompts, hf_greedy, capsys):
    """A service of 3 memory workers, one on a node of its own, restarts (its process
    killed) where the cluster has room for 2: the restart deploys 2 rather than fail,
    `status` and `lamina status` say why, the metric counts the missing one, and
    requests get HF's greedy tokens. Room held by another placement group: the restart
    places 3 only after a placement timeout, then 2; the regrow's tries time out too
    and say so; the room freed, the service grows back to 3 by itself. A memory
    worker's node lost while serving: the recovery drops it; restarted then, the
    service sees the cluster's resources short and deploys 2 at once; a node that
    joins takes the third again. No room for even one: the restart waits for it,
    `status` saying so, and comes up once the room is freed."""
    from ray.util.placement_group import placement_group, remove_placement_group

    from lamina.cluster.cli import _print_status
    from lamina.cluster.service import down, up
    from lamina.entrypoints.deploy_config import LaminaConfig

    c = cluster["cluster"]
    extra = c.add_node(num_cpus=2, resources={"lamina_memory": 1},
                       temp_dir=tempfile.mkdtemp(prefix="ls", dir="/tmp"))
    c.wait_for_nodes()
    cfg = cluster["tmp"] / "short.yaml"
    cfg.write_text(SHORT)
    up(LaminaConfig.from_yaml(cfg), timeout_s=600)
    client = lamina.connect(c.address)
    greedy = SamplingParams(max_tokens=HF_NEW, temperature=0)
    s = client.status()
    regrow = "it grows back when the cluster has room (tried every 1 s)"

    def service_node() -> str:  # on the head node: no worker node's loss takes it
        from ray.util.state import list_actors

        return list_actors(filters=[("state", "=", "ALIVE"),
                                    ("class_name", "=", "LaminaService")])[0].node_id

    assert service_node() == c.head_node.node_id
    assert s["size"] == {"memory_workers": 3, "live": 3, "short_why": None, "regrow": regrow,
                         "regrow_failed": None}

    rooms: list = []  # placement groups holding the room of the workers killed

    def restarted(before: dict, hold_room=False) -> dict:
        """Kill the service's process; the next call waits for its restart.
        `hold_room`: the old workers' room taken before it places."""
        os.kill(before["pid"], signal.SIGKILL)
        if hold_room:
            rooms.append(placement_group([{"lamina_memory": 1}]))
            assert rooms[-1].wait(30)
        assert client.generate([prompts[3]], greedy, use_tqdm=False)[0].token_ids == \
            hf_greedy[3]
        after = client.status()
        assert after["pid"] != before["pid"] and after["restarts"] == before["restarts"] + 1
        assert service_node() == c.head_node.node_id
        return after

    # the room held elsewhere: 3 fit the cluster's resources, 2 are placed
    s = restarted(s, hold_room=True)
    assert (s["size"]["live"], len(s["kv"])) == (2, 2)
    assert s["size"]["short_why"].startswith(
        "its restart found room for 2: could not place 1 compute worker and 3 memory "
        "workers within 4 s: lamina_memory: needs 3, 2 free"), s["size"]
    capsys.readouterr()
    _print_status(s, as_json=False)
    assert (f"  memory workers: 2 of its 3 (short: {s['size']['short_why']}); {regrow}"
            in capsys.readouterr().out)
    assert "\nlamina_memory_workers_missing 1.0\n" in client.ask("metrics_text").decode()
    deadline = time.monotonic() + 60  # the keeper's tries time out (the room is held)
    while not ((s := client.status())["size"]["regrow_failed"] or "").startswith(
            "PlacementTimeout: could not place 1 memory worker within 4 s: lamina_memory: "
            "needs 1, 0 free"):
        assert time.monotonic() < deadline, s["size"]
        time.sleep(0.5)
    assert s["size"]["short_why"].startswith("its restart found room for 2: ")
    _print_status(s, as_json=False)
    assert (f"{regrow} (its last try failed: PlacementTimeout: could not place 1 memory "
            f"worker within 4 s" in capsys.readouterr().out)
    remove_placement_group(rooms.pop())
    deadline = time.monotonic() + 90
    while client.status()["size"]["live"] < 3:
        assert time.monotonic() < deadline, client.status()["size"]
        time.sleep(0.5)
    s = client.status()
    assert s["size"]["short_why"] is None and len(s["kv"]) == 3
    assert s["size"]["regrow_failed"] is None
    assert "\nlamina_memory_workers_missing 0.0\n" in client.ask("metrics_text").decode()
    assert client.generate([prompts[5]], greedy, use_tqdm=False)[0].token_ids == hf_greedy[5]

    # a memory worker's node gone while serving: the recovery drops it (no room left)
    # and removes its group (kept, Ray's GCS would retry its bundle without pause,
    # taking the head's cores: `lamina.cluster.placement`). Its steps may not touch the
    # lost worker (its prompt's prefix cached on another): then the idle check finds it
    # (`idle_check_s`)
    assert extra.node_id in [w["node"] for w in s["workers"]]
    c.remove_node(extra)
    few = SamplingParams(max_tokens=4, temperature=0)
    assert client.generate([prompts[7]], few, use_tqdm=False)[0].token_ids == hf_greedy[7][:4]
    deadline = time.monotonic() + 120
    while (s := client.status())["memory_workers_lost"] < 1:
        assert time.monotonic() < deadline, s["size"]
        time.sleep(0.5)
    assert s["size"]["live"] == 2 and s["memory_workers_lost"] == 1
    assert s["size"]["short_why"] == ("memory workers lost for good at a recovery (no "
                                      "replacement could start)")
    # no placement group is left for Ray to place again: the lost worker's went with it
    assert [g["state"] for g in ray.util.placement_group_table().values()
            if g["state"] not in ("REMOVED", "CREATED")] == []
    # restarted so: the cluster's resources hold 2, deployed at once
    s = restarted(s)
    assert (s["size"]["live"], len(s["kv"])) == (2, 2)
    assert s["size"]["short_why"] == (
        "its restart found room for 2: the Ray cluster cannot hold 1 compute worker, 3 "
        "memory workers: lamina_memory: needs 3, the cluster has 2 (its total resources; "
        "see `ray status`)"), s["size"]
    extra = c.add_node(num_cpus=2, resources={"lamina_memory": 1},
                       temp_dir=tempfile.mkdtemp(prefix="ls", dir="/tmp"))
    c.wait_for_nodes()  # a node joins: the service grows back onto it
    deadline = time.monotonic() + 90
    while client.status()["size"]["live"] < 3:
        assert time.monotonic() < deadline, client.status()["size"]
        time.sleep(0.5)
    s = client.status()
    assert s["size"]["short_why"] is None and s["workers"][-1]["node"] == extra.node_id
    assert client.generate([prompts[9]], greedy, use_tqdm=False)[0].token_ids == hf_greedy[9]

    # no room for even one memory worker: the restart waits for it, saying so
    held = placement_group([{"lamina_memory": 1}] * 3, strategy="SPREAD")
    os.kill(s["pid"], signal.SIGKILL)
    assert held.wait(30)
    deadline = time.monotonic() + 90
    while not (w := client.status(wait=False).get("waiting_for_room")):
        assert time.monotonic() < deadline, client.status(wait=False)
        time.sleep(0.5)
    assert re.match(r"(could not place 1 compute worker and \d memory workers? within 4 s|the "
                    r"Ray cluster has no room now for 1 compute worker, \d memory workers?): "
                    r"lamina_memory: needs \d, 0 free", w), w  # the try it is at
    r = lamina_cmd(cluster, "status")
    assert r.returncode == 0 and f", waiting for room: {w}): " in r.stdout, r.stdout
    remove_placement_group(held)
    assert client.generate([prompts[3]], greedy, use_tqdm=False)[0].token_ids == hf_greedy[3]
    s = client.status()
    assert s["size"]["live"] == 3 and s["restarts"] == 3
    down()
