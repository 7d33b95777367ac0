"""Discrete-event simulator of a Lamina cluster, at iteration granularity.

Data in: a `SimConfig` (replicas = compute groups, memory devices per replica, pipelining,
batching limits), per-op costs (`AnalyticCosts` from the catalog, or `MeasuredCosts`
from `lamina bench ops` on this machine) and requests (arrival time, prompt and output
lengths; `poisson_workload` draws ShareGPT-like ones). Data out: a `SimResult` with
throughput, TTFT/TPOT percentiles and per-device utilization.

Each replica runs continuous batching like `lamina.engine.scheduler`: running requests
decode first, then prompts fed in chunks take their next chunk, then waiting ones are
admitted FIFO while the batch, the step's token budget and the KV capacity allow (a
request reserves prompt + output slots on admission, so the simulator never preempts; a
prompt longer than the budget left is fed in chunks, drawing after its last one). A
step's time comes from the per-op costs: per layer the dense part, the network round
trip and the attention on each memory device (the slowest one counts), in series
("none"), as rotational staggered pipelining ("rotational", paper 5.1: `batches` = n
sub-batches over n - 1 model replicas of the group), or as fixed staggered pipelining
("fixed": `batches` = n replicas, each with its own sub-batch on its own compute device,
all sharing the memory devices, which serve one at a time); then the head (final norm +
lm_head) and the host's per-step overhead.
"""
from __future__ import annotations

import bisect
import heapq
import math
import random
import statistics
from collections import deque
from dataclasses import dataclass, field, replace

from lamina.costmodel.analytic import Cell, Efficiency, attention_time, dense_time, network_time
from lamina.costmodel.catalog import Device, ModelShape
from lamina.costmodel.workload import sharegpt_like


@dataclass(frozen=True)
class SimConfig:
    replicas: int = 1  # compute groups, each holding the weights
    memory_per_replica: int = 2  # memory devices serving each replica's requests
    pipeline: str = "none"  # "none" | "rotational" | "fixed"
    # rotational: n sub-batches over n - 1 model replicas per group; fixed: n replicas,
    # a sub-batch each
    batches: int = 2
    max_batch: int = 256
    max_step_tokens: int = 4096
    kv_tokens_per_device: int = 1 << 30

    def __post_init__(self):
        if self.pipeline not in ("none", "rotational", "fixed"):
            raise ValueError(f"SimConfig.pipeline must be 'none', 'rotational' or 'fixed', "
                             f"got {self.pipeline!r}")
        if not isinstance(self.batches, int) or self.batches < 2:
            raise ValueError(f"SimConfig.batches must be an int >= 2, got {self.batches!r}")
        for f in ("replicas", "memory_per_replica", "max_batch", "max_step_tokens",
                  "kv_tokens_per_device"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) < 1:
                raise ValueError(f"SimConfig.{f} must be an int >= 1, got "
                                 f"{getattr(self, f)!r}")


@dataclass(frozen=True)
class Request:
    arrival_s: float
    prompt: int
    output: int


def poisson_workload(n: int, rate_per_s: float, seed: int = 0) -> list[Request]:
    """n requests, Poisson arrivals at `rate_per_s`, ShareGPT-like lengths
    (`lamina.costmodel.workload.sharegpt_like`)."""
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for p, o in sharegpt_like(n, seed):
        t += rng.expovariate(rate_per_s)
        out.append(Request(t, p, o))
    return out


class AnalyticCosts:
    """Per-op costs from the catalog and an `Efficiency`: the analytic model's terms
    (`lamina.costmodel.analytic`), per layer, with one memory device per worker."""

    def __init__(self, model: ModelShape, compute: Device, tp: int, memory: Device,
                 eff: Efficiency = Efficiency()):
        self.model, self.eff, self.layers = model, eff, model.layers
        self.cell = Cell(compute, tp, memory, 1)
        self._by_workers = {}  # workers -> Cell with that many memory devices

    def dense_layer(self, tokens: int) -> float:
        # MFU(B) covers the weight-bound regime at small batches; one layer's share
        return dense_time(self.model, self.cell, tokens, self.eff) / self.layers

    def head(self, rows: int) -> float:
        return 0.0  # counted in `params` (the dense part) by the analytic model

    def attention(self, queries: int, keys_read: int) -> float:
        return attention_time(self.model, self.cell, keys_read, 1, self.eff) / self.layers

    def network(self, tokens: int, workers: int) -> float:
        cell = self._by_workers.get(workers)
        if cell is None:
            cell = self._by_workers[workers] = replace(self.cell, m=workers)
        return network_time(self.model, cell, tokens, self.eff) / self.layers \
            + self.eff.net_latency_s

    def step_overhead(self, rows: int) -> float:
        return 0.0  # host-side scheduling and sampling: not in the analytic model

    def exchange_host(self, tokens: int) -> float:
        return 0.0  # RDMA: the compute device does not spend time moving the bytes


class MeasuredCosts:
    """Per-op costs interpolated from `lamina bench ops` measurements (JSON):
    dense_layer_s / head_s per token count (piecewise linear, linear extrapolation past the
    largest), attention = a0 + a_key * keys read, a layer's exchange with the memory
    workers (the measured `exchange_s` table, else n0 + n_byte * bytes per worker), and a
    per-step overhead (the step call and sampling, `call_s` + `sample_s`)."""

    def __init__(self, calib: dict):
        try:
            self.layers = int(calib["layers"])
            self._dense = sorted((int(k), float(v)) for k, v in calib["dense_layer_s"].items())
            self._head = sorted((int(k), float(v)) for k, v in calib["head_s"].items())
            self._a0, self._ak = float(calib["attention_s0"]), float(calib["attention_s_per_key"])
            self._n0, self._nb = float(calib["net_s0"]), float(calib["net_s_per_byte"])
            self._net_tok = float(calib["net_bytes_per_token_layer"])
            self._exchange = sorted((int(k), float(v)) for k, v in
                                    calib.get("exchange_s", {}).items())
            self._submit = sorted((int(k), float(v)) for k, v in
                                  calib.get("submit_s", {}).items())
            over = {}
            for key in ("call_s", "sample_s"):
                for k, v in calib.get(key, {}).items():
                    over[int(k)] = over.get(int(k), 0.0) + float(v)
            self._over = sorted(over.items())
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"bad calibration: missing or malformed {e}") from e

    @staticmethod
    def _interp(table, x):
        xs = [a for a, _ in table]
        i = bisect.bisect_left(xs, x)
        if i < len(xs) and xs[i] == x:
            return table[i][1]
        if i == 0:
            return table[0][1] * x / xs[0] if xs[0] else table[0][1]
        if i == len(xs):
            (x0, y0), (x1, y1) = table[-2], table[-1]
        else:
            (x0, y0), (x1, y1) = table[i - 1], table[i]
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)

    def dense_layer(self, tokens):
        return self._interp(self._dense, tokens)

    def head(self, rows):
        return self._interp(self._head, rows)

    def attention(self, queries, keys_read):
        return self._a0 + self._ak * keys_read

    def network(self, tokens, workers):
        if self._exchange:  # measured through the real link and memory workers
            return self._interp(self._exchange, tokens)
        return self._n0 + self._nb * tokens * self._net_tok / workers

    def step_overhead(self, rows):
        return self._interp(self._over, rows) if self._over else 0.0

    def exchange_host(self, tokens):
        """Compute-thread share of a layer's exchange (packing, sending, unpacking: about
        twice the measured submit), which staggering cannot hide."""
        return 2 * self._interp(self._submit, tokens) if self._submit else 0.0


@dataclass(frozen=True)
class Chunk:
    """A prompt's tokens fed in one step: `tokens` of them after `start` already fed;
    `draws`: it is the prompt's last chunk (the step draws its first token)."""
    tokens: int
    start: int = 0
    draws: bool = True


@dataclass
class _Run:
    req: int
    prompt: int
    output: int
    device: int
    done: int = 0  # tokens generated
    fed: int = 0  # prompt tokens fed so far
    first_s: float = math.nan
    in_step: bool = False  # part of the step now in flight


@dataclass
class _Replica:
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    kv_used: list = field(default_factory=list)  # reserved tokens per memory device
    busy_until: float = 0.0
    compute_busy: float = 0.0
    memory_busy: list = field(default_factory=list)


@dataclass(frozen=True)
class SimResult:
    requests: int
    makespan_s: float
    output_tokens: int
    throughput_tok_s: float
    decode_tok_s: float  # generated tokens / time spent in pure-decode steps, per replica
    ttft_s: dict
    tpot_s: dict
    compute_util: float  # mean over compute groups
    memory_util: float  # mean over memory devices
    steps: int
    compute_util_by_replica: tuple = ()
    memory_util_by_device: tuple = ()  # replica-major

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _pct(xs):
    if not xs:
        return {"p50": math.nan, "p90": math.nan, "p99": math.nan, "mean": math.nan}
    s = sorted(xs)
    q = lambda p: s[min(len(s) - 1, int(round(p * (len(s) - 1))))]  # noqa: E731
    return {"p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "mean": statistics.fmean(s)}


def step_time(costs, cfg: SimConfig, prefill: list[Chunk], decode_keys: list[list[int]],
              prefill_dev: list[int], rows: int) -> tuple[float, float, list[float]]:
    """(step seconds, dense seconds, attention seconds per memory device).
    decode_keys[w]: context lengths of the decoding requests on device w;
    prefill[i]: a prompt's chunk fed on memory device prefill_dev[i]."""
    w_n = cfg.memory_per_replica
    groups = [(decode_keys, prefill, prefill_dev)]
    if cfg.pipeline != "none":  # n sub-batches, split by request order
        groups = _parts(decode_keys, prefill, prefill_dev, cfg.batches)
    per = []  # per group: dense, compute-side exchange, remote side, attention per device
    for dk, pf, pd in groups:
        tokens = sum(len(k) for k in dk) + sum(c.tokens for c in pf)
        if tokens == 0:
            continue
        attn = [costs.attention(len(dk[w]), sum(dk[w])) if dk[w] else 0.0 for w in range(w_n)]
        for c, w in zip(pf, pd):  # causal: query i reads the start + i + 1 keys up to it
            n = c.tokens
            attn[w] += costs.attention(n, n * c.start + n * (n + 1) // 2)
        busy_w = sum(1 for w in range(w_n) if dk[w] or w in pd)
        ex = costs.network(tokens, max(1, busy_w))
        host = min(ex, costs.exchange_host(tokens))
        sampled = sum(len(k) for k in dk) + sum(c.draws for c in pf)
        per.append((costs.dense_layer(tokens), host, max(attn) + ex - host, attn, sampled))
    L = costs.layers
    over = costs.step_overhead(rows)
    # the head (final norm + lm_head) runs on the sampled rows only, as the engine's last
    # slice does: one per decoding request and one per prompt's last chunk
    head = sum(costs.head(p[4]) for p in per if p[4])  # a step of prompt chunks only: none
    head_s = head  # of the step's time: fixed replicas run their heads at once
    if len(per) == 1:
        d, h, r, _, _ = per[0]
        period = d + h + r
    elif cfg.pipeline == "fixed":  # each replica on its own device: the memory side
        # serial, or one replica's chain (its dense, exchange, then its queued attention)
        period = max(sum(p[2] for p in per), *(p[0] + p[1] + p[2] for p in per))
        head_s = max(costs.head(p[4]) if p[4] else 0.0 for p in per)
    else:  # cyclic schedule: the busier side (the compute spread over n - 1
        # replicas, the memory side serial), or one group's chain
        period = max(sum(p[0] + p[1] for p in per) / (cfg.batches - 1),
                     sum(p[2] for p in per), *(p[0] + p[1] + p[2] for p in per))
    dense = L * sum(p[0] for p in per) + head
    attn_dev = [L * sum(p[3][w] for p in per) for w in range(w_n)]
    return L * period + head_s + over, dense, attn_dev


def decode_step_time(costs, batch: int, context: int, workers: int, pipeline: str = "none",
                     batches: int = 2) -> float:
    """Seconds of a steady decode step: `batch` requests of `context` keys spread over
    `workers` memory devices (request-level partitioning), pipeline none, rotational
    over `batches` sub-batches (n - 1 replicas) or fixed (`batches` replicas)."""
    keys = [[context] * (batch // workers + (w < batch % workers)) for w in range(workers)]
    cfg = SimConfig(memory_per_replica=workers, pipeline=pipeline, batches=batches,
                    max_batch=batch)
    return step_time(costs, cfg, [], keys, [], batch)[0]


def balance_memory_devices(costs, batch: int, context: int, batches: int = 2,
                           most: int = 256) -> int:
    """The paper's balance rule (5.1): the fewest memory devices m whose attention of
    one sub-batch (batch / n requests of `context` keys, split over m devices) and
    its exchange take no longer than t_m / (n - 1), t_m being the sub-batch's dense
    layer on one replica. Per-layer times from `costs` (measured or analytic); `most`
    if even that many are too slow."""
    sub = max(1, batch // batches)
    budget = costs.dense_layer(sub) / (batches - 1)
    for m in range(1, most + 1):
        per = -(-sub // m)  # the busiest device's requests
        if costs.attention(per, per * context) + costs.network(sub, m) <= budget:
            return m
    return most


def _parts(decode_keys, prefill, prefill_dev, n: int):
    """The step's requests as n sub-batches."""
    flat = [(w, k) for w, ks in enumerate(decode_keys) for k in ks]
    flat.sort(key=lambda x: x[1])  # interleave sizes so the parts balance
    w_n = len(decode_keys)
    out = []
    for h in range(n):
        dk = [[] for _ in range(w_n)]
        for w, k in flat[h::n]:
            dk[w].append(k)
        out.append((dk, prefill[h::n], prefill_dev[h::n]))
    return out


def simulate(costs, cfg: SimConfig, requests: list[Request]) -> SimResult:
    """Run the requests through `cfg.replicas` replicas, step by step (discrete events:
    arrivals and step ends)."""
    return _Sim(costs, cfg, requests).run()


class _Sim:
    """The simulation's state: replicas, the event heap and what is measured."""

    def __init__(self, costs, cfg: SimConfig, requests: list[Request]):
        self.costs, self.cfg, self.requests = costs, cfg, requests
        self.reps = [_Replica(kv_used=[0] * cfg.memory_per_replica,
                              memory_busy=[0.0] * cfg.memory_per_replica)
                     for _ in range(cfg.replicas)]
        self.events = [(r.arrival_s, 0, i) for i, r in enumerate(requests)]  # (t, kind, i)
        heapq.heapify(self.events)
        self.ttft: list[float] = []
        self.tpot: list[float] = []
        self.out_tokens = self.steps = 0
        self.decode_tok = self.decode_time = 0.0
        self.load = [0] * cfg.replicas  # outstanding requests per replica

    def run(self) -> SimResult:
        now = 0.0
        while self.events:
            now, kind, idx = heapq.heappop(self.events)
            if kind == 0:  # arrival: join the least-loaded replica
                r = min(range(self.cfg.replicas), key=lambda i: self.load[i])
                self.load[r] += 1
                self.reps[r].waiting.append(idx)
                if self.reps[r].busy_until <= now:
                    heapq.heappush(self.events, (now, 1, r))
            elif self.reps[idx].busy_until <= now:  # else a step is in flight
                self._end_step(idx, now)
                self._next_step(idx, now)
        return self._result(now)

    def _end_step(self, idx: int, now: float) -> None:
        """The previous step of replica `idx` ended: advance its requests."""
        rep, finished = self.reps[idx], []
        for run in rep.running:
            if run.in_step:
                run.in_step = False
                run.done += 1
                self.out_tokens += 1
                if run.done == 1:
                    run.first_s = now
                    self.ttft.append(now - self.requests[run.req].arrival_s)
                if run.done >= run.output:
                    finished.append(run)
        for run in finished:
            rep.running.remove(run)
            rep.kv_used[run.device] -= run.prompt + run.output
            self.load[idx] -= 1
            if run.output > 1:
                self.tpot.append((now - run.first_s) / (run.output - 1))

    def _admit(self, rep: _Replica, budget: int) -> tuple[list[Chunk], list[int]]:
        """Prompts fed in chunks take their next chunk, then waiting requests are admitted
        while batch, token budget and KV allow: -> the chunks fed and their devices."""
        cfg = self.cfg
        prefill: list[Chunk] = []
        pdev: list[int] = []
        for run in rep.running:
            if run.fed < run.prompt and budget > 0:
                budget -= self._feed(run, budget, prefill, pdev)
        while rep.waiting and len(rep.running) < cfg.max_batch and budget > 0:
            q = self.requests[rep.waiting[0]]
            need = q.prompt + q.output
            w = min(range(cfg.memory_per_replica), key=lambda i: rep.kv_used[i])
            if rep.kv_used[w] + need > cfg.kv_tokens_per_device:
                if need > cfg.kv_tokens_per_device:
                    raise ValueError(f"request {rep.waiting[0]} needs {need} KV tokens; a "
                                     f"memory device holds {cfg.kv_tokens_per_device}")
                break
            rid = rep.waiting.popleft()
            rep.kv_used[w] += need
            run = _Run(rid, q.prompt, q.output, w)
            rep.running.append(run)
            budget -= self._feed(run, budget, prefill, pdev)
        return prefill, pdev

    @staticmethod
    def _feed(run: _Run, budget: int, prefill: list[Chunk], pdev: list[int]) -> int:
        """run's next chunk, at most `budget` tokens; -> how many."""
        n = min(run.prompt - run.fed, budget)
        prefill.append(Chunk(n, run.fed, run.fed + n == run.prompt))
        pdev.append(run.device)
        run.fed += n
        run.in_step = run.fed == run.prompt  # its last chunk draws the first token
        return n

    def _next_step(self, idx: int, now: float) -> None:
        """Plan and time replica `idx`'s next step (decode of the running requests plus
        the prefill of those admitted now)."""
        rep = self.reps[idx]
        decode: list[list[int]] = [[] for _ in range(self.cfg.memory_per_replica)]
        for run in rep.running:
            if run.fed == run.prompt:
                decode[run.device].append(run.prompt + run.done)
                run.in_step = True
        prefill, pdev = self._admit(rep, self.cfg.max_step_tokens - sum(map(len, decode)))
        if not rep.running:
            return
        t, dense, attn = step_time(self.costs, self.cfg, prefill, decode, pdev,
                                   len(rep.running))
        self.steps += 1
        rep.compute_busy += dense
        for w, a in enumerate(attn):
            rep.memory_busy[w] += a
        if not prefill:
            self.decode_tok += len(rep.running)
            self.decode_time += t
        rep.busy_until = now + t
        heapq.heappush(self.events, (now + t, 1, idx))

    def _result(self, now: float) -> SimResult:
        cfg, reps = self.cfg, self.reps
        span = max(now, 1e-12)
        n_mem = cfg.replicas * cfg.memory_per_replica
        return SimResult(
            requests=len(self.requests), makespan_s=span, output_tokens=self.out_tokens,
            throughput_tok_s=self.out_tokens / span,
            decode_tok_s=(self.decode_tok / self.decode_time * cfg.replicas
                          if self.decode_time else math.nan),
            ttft_s=_pct(self.ttft), tpot_s=_pct(self.tpot),
            compute_util=sum(r.compute_busy for r in reps) / (span * cfg.replicas),
            memory_util=sum(sum(r.memory_busy) for r in reps) / (span * n_mem),
            steps=self.steps,
            compute_util_by_replica=tuple(r.compute_busy / span for r in reps),
            memory_util_by_device=tuple(b / span for r in reps for b in r.memory_busy))
