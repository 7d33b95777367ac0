"""Compute replicas under the fixed schedule (paper 5.1): each replica keeps its own
sequences, and a step is one sub-plan per replica, run at once.

Data in: the engine's `StepPlan` and a `run(replica, sub_plan)` callable (the local
executor's thread per replica, the Ray executor's control channel per compute worker).
Data out: one `StepResult`, the replicas' results merged in plan order.

A sequence goes to the replica with the fewest sequences when first seen and stays
there (its slot table and its sampler state live there); every replica drops the
released ones. When some replicas fail a step cleanly (a `SequenceFault` raised before
their memory workers changed, e.g. a bad request refused at the compute side) and the
others succeed, the engine fails those sequences and runs the rest of the step again:
the replicas that succeeded must not run their part twice (their k/v are written,
their samplers advanced), so their results are kept and handed back for that rerun.
A step's session tier orders concern the memory workers, not the replicas: the
executor carries them out before the split (the sub-plans carry none).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

from lamina.engine.messages import SeqWork, StepPlan, StepResult
from lamina.errors import SequenceFault


class ReplicaSplit:
    """Which replica holds each sequence, and a step run over the replicas."""

    def __init__(self, replicas: int):
        if not isinstance(replicas, int) or replicas < 2:
            raise ValueError(f"ReplicaSplit needs >= 2 replicas, got {replicas!r}")
        self.replicas = replicas
        self.home: dict[int, int] = {}  # sequence -> its replica
        # a step's results of the replicas that succeeded while another failed cleanly:
        # replica -> (its sub-plan, its result), for the rerun of that step
        self._kept: dict[int, tuple[StepPlan, StepResult]] = {}
        self._pool = ThreadPoolExecutor(replicas, "lamina-replica")

    def split(self, plan: StepPlan) -> list[StepPlan]:
        """The plan's sequences by replica (each sequence stays on the first it got);
        every replica drops the released ones."""
        if plan.tier_orders:  # they concern memory workers, not replicas
            raise ValueError("a step's KV tier orders go to the memory workers before "
                             "its split over compute replicas (the executor's)")
        for sid in plan.released:
            self.home.pop(sid, None)
        load = [0] * self.replicas
        for home in self.home.values():
            load[home] += 1
        mine: list[list[SeqWork]] = [[] for _ in range(self.replicas)]
        for s in plan.seqs:
            if s.seq_id not in self.home:
                r = min(range(self.replicas), key=lambda i: (load[i], i))
                self.home[s.seq_id] = r
                load[r] += 1
            mine[self.home[s.seq_id]].append(s)
        return [StepPlan(plan.step, tuple(m), released=plan.released,
                         report_dropped=plan.report_dropped) for m in mine]

    def run(self, plan: StepPlan, run: Callable[[int, StepPlan], StepResult]) -> StepResult:
        """Each replica's sub-plan through `run(replica, sub_plan)` at once; -> the merged
        result. Raises after every replica has answered: the clean `SequenceFault`s of
        several replicas as one (the others' results kept for the rerun), else the first
        other error (the engine then recovers every worker: nothing is kept)."""
        kept, self._kept = self._kept, {}
        subs = self.split(plan)
        futures, results = {}, {}
        for r, sub in enumerate(subs):
            if not (sub.seqs or sub.released):
                continue
            old = kept.get(r)
            if old is not None and old[0] == sub:  # ran already: this is the rerun
                results[r] = old[1]
            else:
                futures[r] = self._pool.submit(run, r, sub)
        errors = {}
        for r, f in futures.items():
            try:
                results[r] = f.result()
            except Exception as e:  # noqa: BLE001 - raised below, once all answered
                errors[r] = e
        if not errors:
            return merged(plan, [results[r] for r in sorted(results)])
        hard = [e for e in errors.values() if is_hard(e)]
        if hard:
            raise hard[0]
        self._kept = {r: (subs[r], res) for r, res in results.items()}
        raise replica_faults(errors)

    def reset(self) -> None:
        """Forget every sequence's replica and any kept results (the workers were
        recovered: every sequence starts afresh)."""
        self.home.clear()
        self._kept = {}

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False)


def is_hard(e: BaseException | None) -> bool:
    """A replica's error that is not a clean `SequenceFault` (nothing of its step ran):
    the engine must then recover the workers, not fail requests alone."""
    return e is not None and not (isinstance(e, SequenceFault) and e.clean)


def replica_faults(errors: Mapping[int, BaseException]) -> SequenceFault:
    """Replicas' clean `SequenceFault`s ({replica: fault}) as one: every sequence any of
    them blamed (once), each replica's message."""
    seqs = [s for _, e in sorted(errors.items()) if isinstance(e, SequenceFault)
            for s in e.seq_ids]
    return SequenceFault(list(dict.fromkeys(seqs)), "; ".join(
        f"compute replica {r}: {e}" for r, e in sorted(errors.items())))


def merged(plan: StepPlan, results: list[StepResult]) -> StepResult:
    """The replicas' results as one, its sequences in plan order; timings: each key's
    largest (the replicas ran at once)."""
    by: dict[int, tuple] = {}
    for r in results:
        none = (None,) * len(r.seq_ids)
        for sid, toks, lp, plp in zip(r.seq_ids, r.token_ids, r.logprobs or none,
                                      r.prompt_logprobs or none):
            by[sid] = (toks, lp, plp)
    order = [s.seq_id for s in plan.seqs if s.sample and s.seq_id in by]
    lps = tuple(by[s][1] for s in order) if any(r.logprobs for r in results) else None
    plps = (tuple(by[s][2] for s in order) if any(r.prompt_logprobs for r in results)
            else None)
    timings: dict = {}
    for r in results:
        for k, v in (r.timings or {}).items():
            timings[k] = max(timings.get(k, v), v)
    return StepResult(plan.step, tuple(order), tuple(by[s][0] for s in order), timings,
                      lps, plps, tuple(d for r in results for d in r.dropped))
