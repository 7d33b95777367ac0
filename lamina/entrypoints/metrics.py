"""Prometheus metrics of a serving engine (`GET /metrics` on `lamina serve`).

Data in: from the `EngineLoop` thread, each step's outputs, its entry in
`engine.step_timings` (wall time, tokens fed, where the time went) and the engine's
scheduler and allocators; each finished or aborted `RequestOutput`. Data out: counters,
gauges and histograms in their own `CollectorRegistry` (no process-global state),
rendered in the Prometheus text format by `render`.
"""
from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5,
                1, 2.5, 5, 10)  # also a request's time per output token
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, *LATENCY_BUCKETS)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# where a step's time went (`StepTimers.report`'s keys); "other" is the rest of the step:
# scheduling, the step plan and reading its tokens
STEP_PARTS = (("dense", "dense_s"), ("attention", "attention_s"),
              ("transfer", "transfer_s"), ("sample", "sample_s"))


class EngineMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("lamina_requests", "Requests that left the engine",
                                ["finish"], registry=r)
        self.prompt_tokens = Counter("lamina_prompt_tokens", "Prompt tokens of finished "
                                     "requests", registry=r)
        self.generation_tokens = Counter("lamina_generation_tokens",
                                         "Tokens drawn, all samples", registry=r)
        self.steps = Counter("lamina_engine_steps", "Engine steps run", registry=r)
        self.preemptions = Counter("lamina_preemptions", "Sequences preempted (back "
                                   "to the queue; their cached KV taken back at "
                                   "readmission, the rest recomputed)", registry=r)
        self.recomputed = Counter("lamina_preemption_recomputed_tokens", "Positions whose "
                                  "KV readmissions after preemptions computed again (what "
                                  "neither the pool's cache nor the host tier kept)",
                                  registry=r)
        self.recoveries = Counter("lamina_recoveries", "Failed steps recovered (live "
                                  "workers reset, dead or stuck ones replaced; running "
                                  "sequences requeued)", registry=r)
        self._recovered = 0
        self.kv_kept = Counter("lamina_recovery_kv_kept_tokens", "Positions whose KV "
                               "recoveries kept in the pools they kept (the rest of the "
                               "requeued sequences' KV is recomputed)", registry=r)
        self._kv_kept = 0
        self.recovery_s = Gauge("lamina_last_recovery_seconds", "How long the latest "
                                "recovery of the workers took", registry=r)
        self.replaced = Counter("lamina_workers_replaced", "Workers recoveries replaced "
                                "(dead, hung, or stuck in a failed step)", ["role"],
                                registry=r)
        self._replaced: dict[str, int] = {}
        for role in ("compute", "memory"):  # both series from the start, at 0
            self.replaced.labels(role)
        self.lost = Counter("lamina_memory_workers_lost", "Memory workers recoveries "
                            "dropped (dead, and no replacement could start; the engine "
                            "went on with the others: `min_live_memory_workers`)",
                            registry=r)
        self._lost = 0
        self.culprits = Counter("lamina_culprits", "Requests found behind steps that kept "
                                "failing with no request named (each failed alone)",
                                registry=r)
        self._culprits = 0
        self.drafted = Counter("lamina_spec_draft_tokens", "Speculative decoding: tokens "
                               "guessed (n-gram drafts fed)", registry=r)
        self.accepted = Counter("lamina_spec_accepted_tokens", "Speculative decoding: "
                                "guessed tokens kept (each a step saved)", registry=r)
        self._drafted = self._accepted = 0
        self.searching = Gauge("lamina_culprit_search", "1 while the engine looks for the "
                               "request behind failing steps (admission restricted)",
                               registry=r)
        self.running = Gauge("lamina_sequences_running", "Sequences holding KV",
                             registry=r)
        self.waiting = Gauge("lamina_sequences_waiting", "Sequences queued", registry=r)
        self.rejected = Counter("lamina_requests_rejected", "Requests refused before "
                                "queueing", ["reason"], registry=r)
        self.memory_workers = Gauge("lamina_memory_workers", "Memory workers holding the "
                                    "KV pool (`scale_memory_workers` changes it)", registry=r)
        self._workers = 0  # memory workers at the last refresh
        self.kv_used = Gauge("lamina_kv_slots_used", "Token slots in use (by requests "
                             "and the prefix cache)", ["memory_worker"], registry=r)
        self.kv_cached = Gauge("lamina_kv_slots_cached", "Token slots the prefix cache "
                               "holds (some may be shared by running requests)",
                               ["memory_worker"], registry=r)
        self.cache_hits = Counter("lamina_prefix_cache_hit_tokens", "Prompt tokens of "
                                  "finished requests reused from the prefix cache (not "
                                  "computed)", registry=r)
        self.cache_evicted = Counter("lamina_prefix_cache_evicted_tokens", "Cached token "
                                     "slots evicted to make room", registry=r)
        self._evicted = 0
        self.tier_bytes = Gauge("lamina_kv_tier_bytes", "Sessions' KV held beyond the pools",
                                ["tier"], registry=r)
        self.tier_traffic = Counter("lamina_kv_tier_traffic_bytes", "Session KV moved: "
                                    "saved (pool to host), loaded (host to pool), written "
                                    "and read (disk)", ["kind"], registry=r)
        self.tier_events = Counter("lamina_kv_tier_events", "Tier hit tokens (loaded, not "
                                   "computed), prefetches ordered, misses (recomputed), "
                                   "positions of preempted sequences saved (parked_tokens)",
                                   ["event"], registry=r)
        self._tier_seen: dict[str, int] = {}
        self.ttft = Histogram("lamina_time_to_first_token_seconds", "Arrival to first "
                              "token", buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("lamina_request_latency_seconds", "Arrival to finish",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("lamina_request_queue_time_seconds", "Arrival to the "
                               "first step that feeds it", buckets=QUEUE_BUCKETS, registry=r)
        self.tpot = Histogram("lamina_request_time_per_output_token_seconds", "After the "
                              "first token, seconds per output token (requests of two or "
                              "more)", buckets=STEP_BUCKETS, registry=r)
        self.step_s = Histogram("lamina_step_seconds", "An engine step: scheduling, the "
                                "executor's step, its tokens", buckets=STEP_BUCKETS,
                                registry=r)
        self.step_tokens = Histogram("lamina_step_tokens", "Tokens a step fed (prompt "
                                     "chunks, decodes, drafts)", buckets=TOKEN_BUCKETS,
                                     registry=r)
        self.step_parts = Counter(
            "lamina_step_part_seconds", "Steps' time by part: dense (the slices), attention "
            "(q/k/v to the memory workers, their attention, its output back; prompts "
            "attended on the compute side), transfer (GPU <-> host copies), sample, other",
            ["part"], registry=r)
        self._timed = None  # the step_timings entry counted last

    def step(self, engine, drawn: int) -> None:
        """After each engine step: `drawn` tokens were sampled in it."""
        self.steps.inc()
        self.generation_tokens.inc(drawn)
        self._time(engine.step_timings[-1] if engine.step_timings else None)
        self.refresh(engine)

    def refresh(self, engine) -> None:
        """The engine's state now (its gauges; the recoveries and replaced workers it
        counts): after each step, and after what changes it between steps (an abort
        frees KV; an idle check replaces workers), so an idle engine's /metrics is not
        left at its last step's."""
        if engine.num_recoveries > self._recovered:
            self.recoveries.inc(engine.num_recoveries - self._recovered)
            self._recovered = engine.num_recoveries
            self.recovery_s.set(engine.last_recovery_s or 0.0)
            self.kv_kept.inc(engine.kv_kept_tokens - self._kv_kept)
            self._kv_kept = engine.kv_kept_tokens
            for role, n in engine.executor.workers_replaced().items():
                if n > self._replaced.get(role, 0):
                    self.replaced.labels(role).inc(n - self._replaced.get(role, 0))
                    self._replaced[role] = n
            self.lost.inc(engine.memory_workers_lost - self._lost)
            self._lost = engine.memory_workers_lost
        if engine.num_culprits > self._culprits:
            self.culprits.inc(engine.num_culprits - self._culprits)
            self._culprits = engine.num_culprits
        self.searching.set(1 if engine.searching else 0)
        if engine.num_draft_tokens > self._drafted:
            self.drafted.inc(engine.num_draft_tokens - self._drafted)
            self.accepted.inc(engine.num_accepted_tokens - self._accepted)
            self._drafted, self._accepted = engine.num_draft_tokens, engine.num_accepted_tokens
        sched = engine.scheduler
        self.running.set(len(sched.running))
        self.waiting.set(len(sched.waiting))
        caches = sched.caches or [None] * len(engine.allocs)
        evicted = sum(c.evicted for c in sched.caches or [])
        if evicted > self._evicted:
            self.cache_evicted.inc(evicted - self._evicted)
        self._evicted = evicted
        self._tiers(engine)
        for w, (alloc, cache) in enumerate(zip(engine.allocs, caches)):
            self.kv_used.labels(str(w)).set(alloc.config.num_slots - alloc.num_free())
            self.kv_cached.labels(str(w)).set(cache.size if cache is not None else 0)
        for w in range(len(engine.allocs), self._workers):  # scaled down: their series go
            self.kv_used.remove(str(w))
            self.kv_cached.remove(str(w))
        self._workers = len(engine.allocs)
        self.memory_workers.set(self._workers)

    def _time(self, t: dict | None) -> None:
        """The step's wall time, tokens and parts (once per `step_timings` entry)."""
        if t is None or t is self._timed:
            return
        self._timed = t
        self.step_s.observe(t["step_s"])
        self.step_tokens.observe(t["tokens"])
        known = 0.0
        for part, key in STEP_PARTS:
            if key in t:  # a failed step has its wall time only
                self.step_parts.labels(part).inc(t[key])
                known += t[key]
        self.step_parts.labels("other").inc(max(0.0, t["step_s"] - known))

    def _tiers(self, engine) -> None:
        st = engine.tier_stats()  # {} without tiers
        if not st:
            return
        self.tier_bytes.labels("host").set(st["host_bytes"])
        self.tier_bytes.labels("disk").set(st["disk_bytes"])
        for key, counter, label in (
                ("saved_bytes", self.tier_traffic, "saved"),
                ("loaded_bytes", self.tier_traffic, "loaded"),
                ("written_bytes", self.tier_traffic, "written"),
                ("read_bytes", self.tier_traffic, "read"),
                ("tier_hit_tokens", self.tier_events, "hit_tokens"),
                ("prefetches", self.tier_events, "prefetches"),
                ("tier_misses", self.tier_events, "misses"),
                ("parked_tokens", self.tier_events, "parked_tokens")):
            grew = st.get(key, 0) - self._tier_seen.get(key, 0)
            if grew > 0:
                counter.labels(label).inc(grew)
                self._tier_seen[key] = st[key]

    def request(self, out, aborted: bool = False) -> None:
        """A request left the engine (finished, or aborted)."""
        reasons = {c.finish_reason for c in out.outputs}
        self.requests.labels("abort" if aborted else "error" if out.error else
                             "stop" if reasons == {"stop"} else "length").inc()
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.cache_hits.inc(out.metrics.get("cached_tokens", 0))
        self.preemptions.inc(out.metrics.get("preemptions", 0))
        self.recomputed.inc(out.metrics.get("recomputed_tokens", 0))
        for hist, key in ((self.ttft, "ttft_s"), (self.queue, "queue_s"),
                          (self.tpot, "tpot_s")):
            if out.metrics.get(key) is not None:
                hist.observe(out.metrics[key])
        self.e2e.observe(out.metrics.get("e2e_s", 0.0))

    def keep_size(self, keeper) -> None:
        """The memory workers a `KeepSize` waits to grow back, as a gauge."""
        Gauge("lamina_memory_workers_missing", "Memory workers the deployment has fewer "
              "than its size (a restart short of room, workers lost for good); it grows "
              "back when the cluster has room", registry=self.registry).set_function(
            keeper.missing)

    def render(self) -> bytes:
        return generate_latest(self.registry)
