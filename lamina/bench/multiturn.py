"""Multi-turn chat with and without KV reuse: `lamina bench multiturn`.

Data in: a generated multi-turn workload (below). Data out: per mode and turn index,
time to first token (p50 / p90), prompt tokens computed (prefill) and cached (from the
pool or the tiers), decode tok/s, tier traffic; JSON, Markdown and a PNG of TTFT by turn.

Workload (seeded, the same token ids in every mode): `sessions` conversations, each of
`turns` turns. A turn's prompt is the whole history so far (a shared system prompt of
`system` tokens, then each earlier user message and answer) plus a new user message of
`user` tokens (uniform in [user/2, 3*user/2]); answers are `answer` tokens, greedy, EOS
ignored, so every mode sees the same histories. Token ids are uniform in [1000, 20000).
Turns are served round by round: in round t every session sends its turn t, `concurrency`
sessions at a time (submitted together; the next group when they finished), so between
two turns of one session every other session has had one (think time: the other
sessions' turns; 0 s of idle time, in one process).

Modes, each a fresh engine in this process (the local executor), greedy, same answers:
- `no reuse`: prefix caching off: every turn recomputes its whole history;
- `pool`: prefix caching in a pool that holds every session;
- `pool 1/4`: prefix caching in a pool of a quarter of the working set (every session's
  final history): LRU eviction drops most sessions between their turns;
- `pool 1/4 + tiers`: that pool plus the session tiers: a host tier of half the working
  set and a disk tier (a temporary directory) for the rest, requests with session ids;
- `vllm 1/4` (with `--vllm-python`): vLLM's CPU build, `enable_prefix_caching=True`,
  its KV cache limited to the same token count as `pool 1/4` (`num_gpu_blocks_override`),
  in its own process (`benchmarks/vllm_multiturn_peer.py`).
"""
from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from lamina.bench.common import _write, cpu_name, pct


def workload(sessions: int, turns: int, system: int, user: int, seed: int = 0):
    """-> (system prompt ids, per session the user message ids of each turn)."""
    rng = random.Random(seed)

    def ids(n):
        return [rng.randrange(1000, 20000) for _ in range(n)]

    sys_ids = ids(system)
    msgs = [[ids(rng.randint(max(1, user // 2), max(1, 3 * user // 2)))
             for _ in range(turns)] for _ in range(sessions)]
    return sys_ids, msgs


def run_mode(llm, sys_ids, msgs, answer: int, concurrency: int | None = None,
             sessions: bool = False) -> list[list[dict]]:
    """Every session's turns through `llm`, round by round, `concurrency` sessions at a
    time (None: all at once); `sessions`: requests carry session ids. -> per turn, one
    record per session."""
    from lamina import SamplingParams

    params = SamplingParams(max_tokens=answer, temperature=0, ignore_eos=True)
    history = [list(sys_ids) for _ in msgs]
    group = concurrency or len(msgs)
    turns = []
    for t in range(len(msgs[0])):
        recs = []
        for g in range(0, len(msgs), group):
            who = range(g, min(g + group, len(msgs)))
            prompts = [history[i] + msgs[i][t] for i in who]
            sids = [f"chat-{i}" for i in who] if sessions else None
            t0 = time.perf_counter()
            kw = {"session_id": sids} if sessions else {}
            outs = llm.generate(prompts, params, use_tqdm=False, **kw)
            wall = time.perf_counter() - t0
            for i, p, o in zip(who, prompts, outs):
                recs.append(_record(i, p, o, wall))
                history[i] = p + list(o.token_ids)
        turns.append(recs)
    return turns


def _record(session: int, prompt: list[int], out, wall: float) -> dict:
    m = out.metrics
    decode_s = max(m["e2e_s"] - m["ttft_s"], 1e-9)
    return {"session": session, "history": len(prompt), "cached": m["cached_tokens"],
            "tier": m.get("tier_cached_tokens", 0),
            "computed": len(prompt) - m["cached_tokens"], "ttft_s": m["ttft_s"],
            "decode_tok_s": (len(out.token_ids) - 1) / decode_s,
            "answer": list(out.token_ids), "group_wall_s": wall}


def summarize(turns: list[list[dict]]) -> list[dict]:
    return [{"turn": t + 1,
             "history_median": statistics.median(r["history"] for r in recs),
             "ttft_p50_s": pct([r["ttft_s"] for r in recs], 0.5),
             "ttft_p90_s": pct([r["ttft_s"] for r in recs], 0.9),
             "computed": sum(r["computed"] for r in recs),
             "cached": sum(r["cached"] for r in recs),
             "from_tiers": sum(r.get("tier", 0) for r in recs),
             "decode_tok_s": statistics.median(r["decode_tok_s"] for r in recs)}
            for t, recs in enumerate(turns)]


def bench_multiturn(model: str | None = None, sessions: int = 16, turns: int = 4,
                    system: int = 256, user: int = 400, answer: int = 32,
                    concurrency: int = 4, out_dir: str | Path = "benchmarks/results",
                    plot: bool = True, vllm_python: str | None = None) -> dict:
    sys_ids, msgs = workload(sessions, turns, system, user)
    longest = [system + sum(len(m[t]) + answer for t in range(turns)) for m in msgs]
    working = sum(longest)  # every session's final history, in tokens
    quarter = max(working // 4, concurrency * (max(longest) + 64))
    res: dict = {"cpu": cpu_name(),
                 "workload": {"sessions": sessions, "turns": turns, "system": system,
                              "user": user, "answer": answer, "think_time_s": 0,
                              "concurrency": concurrency, "working_set_tokens": working,
                              "pool_slots": working + 1024, "small_pool_slots": quarter},
                 "modes": {}, "tiers": {}}
    answers, per_token = {}, None
    for mode, kw in _modes(working + 1024, quarter).items():
        recs, tiers, per_token = _run_lamina(model, kw, sys_ids, msgs, answer, concurrency,
                                             per_token)
        answers[mode] = [[r["answer"] for r in t] for t in recs]
        res["modes"][mode] = summarize(recs)
        if tiers:
            res["tiers"][mode] = tiers
        for row in res["modes"][mode]:
            print(mode, row, flush=True)
    if vllm_python:
        try:
            recs = run_vllm_multiturn(vllm_python, model, sys_ids, msgs, answer, concurrency,
                                      quarter)
            answers["vllm 1/4"] = [[r["answer"] for r in t] for t in recs]
            res["modes"]["vllm 1/4"] = summarize(recs)
        except (RuntimeError, subprocess.TimeoutExpired, OSError) as e:
            res["vllm_error"] = str(e)[-500:]
            print(f"vllm peer: {res['vllm_error']}", flush=True)
    res["same_answers"] = {m: a == answers["no reuse"] for m, a in answers.items()}
    base = res["modes"]["no reuse"]
    later = range(1, turns)
    res["turns_2_plus"] = {
        mode: {"computed_ratio": (sum(rows[t]["computed"] for t in later)
                                  / max(1, sum(base[t]["computed"] for t in later))),
               "ttft_p50_speedup": [base[t]["ttft_p50_s"] / rows[t]["ttft_p50_s"]
                                    for t in later]}
        for mode, rows in res["modes"].items() if mode != "no reuse"}
    _report(res, Path(out_dir), plot)
    return res


def _modes(big: int, quarter: int) -> dict[str, dict]:
    """Each mode's engine options (and whether requests carry session ids)."""
    disk = tempfile.mkdtemp(prefix="lamina-kv-bench-")
    return {"no reuse": {"num_kv_slots": big, "prefix_caching": False},
            "pool": {"num_kv_slots": big},
            "pool 1/4": {"num_kv_slots": quarter},
            "pool 1/4 + tiers": {"num_kv_slots": quarter, "sessions": True,
                                 "tier_tokens": (2 * quarter, disk, 8 * quarter)}}


def _run_lamina(model, kw: dict, sys_ids, msgs, answer: int, concurrency: int,
                per_token: int | None):
    """One mode's records, (with tiers) its tier stats, and the model's KV bytes per
    token. Tiers are sized in tokens: `per_token` (from an earlier mode) gives bytes."""
    from lamina import LLM

    kw = dict(kw)
    sessions = kw.pop("sessions", False)
    tiers = kw.pop("tier_tokens", None)
    if tiers is not None:
        assert per_token, "a tier mode runs after a mode without tiers"
        host, disk, disk_tokens = tiers
        kw.update(kv_host_bytes=host * per_token, kv_disk_dir=disk,
                  kv_disk_bytes=disk_tokens * per_token)
    llm = LLM(model, max_step_tokens=4096, **kw)
    try:
        run_mode(llm, sys_ids, [msgs[0][:1]], 2)  # warm-up: first calls off the clock
        llm.engine.clear_prefix_cache()
        recs = run_mode(llm, sys_ids, msgs, answer, concurrency, sessions)
        return recs, llm.engine.tier_stats(), llm.executor.memory[0].pool.config.bytes_per_slot
    finally:
        llm.shutdown()


def _report(res: dict, out_dir: Path, plot: bool) -> None:
    table = [["mode", "turn", "history (median)", "TTFT p50 ms", "TTFT p90 ms",
              "prefill computed", "cached", "from tiers", "decode tok/s"]]
    table += [[mode, str(r["turn"]), f"{r['history_median']:.0f}",
               f"{1e3 * r['ttft_p50_s']:.1f}", f"{1e3 * r['ttft_p90_s']:.1f}",
               str(r["computed"]), str(r["cached"]), str(r.get("from_tiers", 0)),
               f"{r['decode_tok_s']:.1f}"]
              for mode, rows in res["modes"].items() for r in rows]
    jp, mp = _write(out_dir, "multiturn", res, table)
    with open(mp, "a") as f:  # tier occupancy and traffic under the table
        for mode, st in res["tiers"].items():
            f.write(f"\nTiers ({mode}): " + ", ".join(f"{k} {v}" for k, v in st.items())
                    + "\n")
    print("\n".join(" | ".join(r) for r in table))
    for mode, later in res["turns_2_plus"].items():
        print(f"turns >= 2, {mode}: prefill computed = {100 * later['computed_ratio']:.1f}% "
              f"of no reuse; TTFT p50 speedup by turn: "
              f"{', '.join(f'{x:.1f}x' for x in later['ttft_p50_speedup'])}")
    for mode, st in res["tiers"].items():
        print(f"tiers ({mode}): {st}")
    print(f"same answers as no reuse: {res['same_answers']}")
    if plot:
        _plot(res, out_dir / "multiturn.png")
    print(f"wrote {jp} and {mp}")


def run_vllm_multiturn(python: str, model, sys_ids, msgs, answer: int, concurrency: int,
                       kv_tokens: int) -> list[list[dict]]:
    """The same turns through vLLM (its own venv and process, prefix caching on, a KV
    cache of `kv_tokens`) -> records as `run_mode`'s."""
    from lamina.bench.e2e import peer_folder, run_peer
    from lamina.model.loader import load

    loaded = load(model)
    folder = peer_folder(loaded.model, loaded.tokenizer)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"system": sys_ids, "msgs": msgs, "answer": answer,
                   "concurrency": concurrency, "kv_tokens": kv_tokens}, f)
    try:
        return run_peer(python, "vllm_multiturn_peer.py",
                        ["--model", str(folder), "--workload", f.name], 2,
                        timeout=3600)["turns"]
    finally:
        os.unlink(f.name)


def _plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, rows in res["modes"].items():
        ax.plot([r["turn"] for r in rows], [1e3 * r["ttft_p50_s"] for r in rows], marker="o",
                label=mode)
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT p50 (ms)")
    ax.set_yscale("log")
    w = res["workload"]
    ax.set_title(f"{w['sessions']} sessions, {w['user']}-token turns, {res['cpu']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
