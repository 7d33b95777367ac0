"""Shared fixtures: the real default model (loaded and split once per session)."""
import json
import os
import urllib.error
import urllib.request

import pytest
import torch

# With no GPU the Triton kernels run in Triton's interpreter (on CPU tensors), which
# must be switched on before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Every Ray cluster the tests start (in this process or in subprocesses, which inherit
# it) runs without token auth: Ray reads the mode once per process, so one test's
# cluster must not switch it for the next, and a stray ~/.ray/auth_token must not turn
# it on for some processes and not others.
os.environ["RAY_AUTH_MODE"] = "disabled"

# Test engines' host pools on ordinary pages (`EngineConfig.kv_huge_pages`' default, here
# and in every process the tests start): on VMs that give freed memory back to their
# host, huge pages take ~5-15x as long to fault in, which was ~230 s of tests/lamina's
# ~1440 test seconds (a pool made by `KVPoolConfig` defaults alike). The pool's own
# test (test_kv_pool.py) still asks for them.
os.environ.setdefault("LAMINA_KV_HUGE_PAGES", "0")
# ... and faulted in as slots are first written rather than all at start
# (`EngineConfig.kv_prefault`): most test engines fill a few percent of their pool, and
# the pages touched up front were ~150 of the non-Ray files' ~2400 test seconds (py-spy,
# benchmarks/RESULTS.md of 2026-12-07). The pool's own tests ask for both ways.
os.environ.setdefault("LAMINA_KV_PREFAULT", "0")

# `make test` runs two pytest-xdist workers. Each keeps torch to one thread, so the two
# share the cores instead of oversubscribing them. Tests that start Ray clusters or make
# network namespaces run one after another on one of them (a second local Ray cluster
# beside them would fight for the same two cores, and their timeouts are about the
# cluster's own workers); every other test file runs whole on one worker, so its module
# fixtures are built once. The scope rule is xdist's own way to group (its LoadFile and
# LoadGroup schedulers override `_split_scope` alike); its "loadgroup" marks do not group
# under pytest 9.2, which keeps node ids where xdist no longer writes them.
# Files are handed out in collection order, which each worker sorts alike: the serial
# group first, then the other files longest first (`tests/durations.py`), so the last to
# start are short ones. xdist's own order (most tests first) left a few long tests for
# last with the other worker done.
_XDIST = "PYTEST_XDIST_WORKER" in os.environ
torch.set_num_threads(1 if _XDIST else max(1, min(2, torch.get_num_threads())))
# ... and so does every process a test starts (`lamina batch`, the real clients, a served
# model, a Ray cluster's workers before they set their own): with two OpenMP threads,
# one of them shares a core with the other worker and the rest wait for it at each
# parallel region (`test_bench_serve_quick` beside a busy core: 57 s, one thread 31 s).
if _XDIST:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
_SERIAL = ("tests/cluster/", "tests/lamina/test_netns.py")


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, absent without it
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class FilesAndOneSerialScope(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = _file(nodeid)
            return "serial" if path.startswith(_SERIAL) else path

    config.option.loadscopereorder = False  # keep the order below
    return FilesAndOneSerialScope(config, log)


def pytest_collection_modifyitems(config, items):
    """Under xdist: the serial group's tests first (in their own order), then every other
    file's, longest file first; a file's tests keep their order."""
    if not _XDIST:
        return
    from tests.durations import DEFAULT_S, load

    seconds = load()

    def key(pair):  # a file's tests stay together: they are adjacent in `items`
        index, item = pair
        path = _file(item.nodeid)
        return (0, 0.0, index) if path.startswith(_SERIAL) else \
            (1, -seconds.get(path, DEFAULT_S), index)

    items[:] = [item for _, item in sorted(enumerate(items), key=key)]


def _file(nodeid: str) -> str:
    return nodeid.split("::")[0]


@pytest.fixture(scope="session")
def smol():
    from lamina.model.loader import load

    return load()


@pytest.fixture(scope="session")
def smol_split(smol):
    """The split on eager linears: what the splitter's tests check; the engine tests run
    `smol_packed` (LLM's CPU default, 1.6-1.9x faster with one thread)."""
    from lamina.splitter import split_model

    return split_model(smol.model)


TEXT = ("The history of the printing press begins in the fifteenth century, when movable "
        "type changed how knowledge spread across Europe. ") * 40
# new tokens in the HF greedy reference (exactness tests generate as many)
HF_NEW = 32
# new tokens the exactness tests of the other schedules check, a prefix of the reference:
# on CPU a pipelined decode step reads the weights once per micro-batch (and a replicated
# one once per replica), and what those paths add (wiring, context moves, routing, hosts)
# shows in the first decode steps; the local and Ray engines, and the local rotational
# schedule, check all HF_NEW
SHORT_NEW = 12
LENGTHS = [5, 12, 40, 77, 128, 200, 300, 450, 600, 9, 25, 60, 90, 150, 250, 350]


@pytest.fixture(scope="session")
def prompts(smol):
    """16 prompts of 5-600 tokens (token ids)."""
    ids = smol.tokenizer(TEXT)["input_ids"]
    return [ids[:n] for n in LENGTHS]


def hf_greedy_of(smol, prompts, new: int = HF_NEW) -> list[list[int]]:
    """HF `generate`'s greedy tokens (up to `new`, ending at EOS) after each prompt."""
    eos = smol.tokenizer.eos_token_id
    refs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            refs.append(smol.model.generate(ids, attention_mask=torch.ones_like(ids),
                                            do_sample=False, max_new_tokens=new,
                                            pad_token_id=eos)[0, len(p):].tolist())
    return refs


# the reference in two parts of about equal cost (prompt lengths alternate by size)
_PARTS = [sorted(range(len(LENGTHS)), key=LENGTHS.__getitem__)[k::2] for k in (0, 1)]


@pytest.fixture(scope="session")
def hf_greedy(smol, prompts, tmp_path_factory):
    """HF generate(do_sample=False), HF_NEW new tokens, one prompt at a time (no padding).
    Under xdist it is computed once a run, in two halves: each worker that needs it
    computes the half no one has claimed yet (its own first, one thread each, so the two
    workers share the work on both cores) and reads the other from the run's shared
    temporary folder, waiting while the other worker writes it."""
    if not _XDIST:
        return hf_greedy_of(smol, prompts)
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp().parent
    first = int(os.environ["PYTEST_XDIST_WORKER"].removeprefix("gw") or 0) % 2
    refs: dict[int, list[int]] = {}
    for k in (first, 1 - first):
        path = base / f"hf_greedy.{k}.json"
        with FileLock(f"{path}.lock"):
            if not path.exists():
                part = [prompts[i] for i in _PARTS[k]]
                path.write_text(json.dumps(dict(zip(_PARTS[k], hf_greedy_of(smol, part)))))
            refs.update({int(i): r for i, r in json.loads(path.read_text()).items()})
    return [refs[i] for i in range(len(prompts))]


@pytest.fixture(scope="session")
def smol_packed(smol_split):
    """The split with its linears on oneDNN-prepacked weights (LLM's default on CPU)."""
    from lamina.splitter.dense import pack_dense

    packed, choice = pack_dense(smol_split, "onednn")
    assert choice.backend == "onednn"
    return packed


@pytest.fixture(scope="session")
def smol_bf16(smol):
    """(SmolLM2 in bf16, a copy; its split with eager linears): the bf16 tests pack it
    for the backend they check (`pack_dense` leaves its input as it was)."""
    import copy

    from lamina.splitter import split_model

    hf = copy.deepcopy(smol.model).to(torch.bfloat16)
    return hf, split_model(hf)


def http_post(url: str, body: dict, timeout: float = 60) -> tuple[int, dict]:
    """POST `body` as JSON -> (HTTP status, the JSON answer), an error status too."""
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
