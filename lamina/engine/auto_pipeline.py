"""`pipeline="auto"`: staggered pipelining only where it pays, decided from measured steps.

Data in: each step's plan (its size class) and the seconds its execution took under the
schedule it ran. Data out: the micro-batches the next step of that class runs with (1:
no pipeline; n: rotational), and a log line whenever a class settles on a schedule or
changes it, with the medians that decided.

A class is a step's kind (decode only, or with prompt tokens) and its token count's
power of two. A new class tries both schedules, alternating, `trials` steps each, then
keeps the one with the lower median seconds per token; after `recheck` more steps it
tries both again (the workload or the machine may have changed).

Why measured rather than predicted: the paper's finding (6.1: rotational pays 1.13x-
1.63x above batch 128 and costs nearly 2x latency at small batches) holds where compute
and memory devices are separate; where they share cores, as on a small CPU host, it
may never pay. Trying both on the live workload answers for the hardware at hand. One
step's time is both its latency and (per token) its throughput, so the faster schedule
is better on both counts.
"""
from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass, field

from lamina.engine.messages import StepPlan

log = logging.getLogger("lamina.engine")

SCHEDULES = ("none", "rotational")


@dataclass
class _Class:
    """One size class's trials and choice."""

    times: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in SCHEDULES})
    choice: str | None = None  # None: still trying
    since: int = 0  # steps run since the choice was made


@dataclass(frozen=True)
class Decision:
    """A size class's settled schedule and the medians (seconds per token) behind it."""

    schedule: str
    medians: dict[str, float]


class AutoPipeline:
    def __init__(self, batches: int, trials: int = 3, recheck: int = 512):
        if batches < 2 or trials < 1 or recheck < 1:
            raise ValueError("AutoPipeline needs batches >= 2, trials >= 1, recheck >= 1")
        self.batches, self.trials, self.recheck = batches, trials, recheck
        self._classes: dict[tuple[bool, int], _Class] = {}
        self.decisions: dict[tuple[bool, int], Decision] = {}  # the latest per class

    @staticmethod
    def size_class(plan: StepPlan) -> tuple[bool, int]:
        """(decode only, log2 of the step's tokens rounded down)."""
        decode = all(len(s.token_ids) == 1 for s in plan.seqs)
        return decode, int(math.log2(max(1, plan.num_tokens)))

    def schedule(self, plan: StepPlan) -> str:
        """The schedule the step runs: its class's choice, or the one with fewer trials."""
        if len(plan.seqs) < 2:
            return "none"  # one sequence cannot be cut into sub-batches
        c = self._classes.setdefault(self.size_class(plan), _Class())
        if c.choice is not None and c.since < self.recheck:
            return c.choice
        return min(SCHEDULES, key=lambda s: len(c.times[s]))

    def micro_batches(self, plan: StepPlan) -> int:
        return 1 if self.schedule(plan) == "none" else min(self.batches, len(plan.seqs))

    def observe(self, plan: StepPlan, schedule: str, seconds: float) -> None:
        """A step of `plan` ran under `schedule` in `seconds`."""
        if len(plan.seqs) < 2:
            return
        key = self.size_class(plan)
        c = self._classes.setdefault(key, _Class())
        if c.choice is not None and c.since < self.recheck:
            c.since += 1
            return
        c.times[schedule].append(seconds / max(1, plan.num_tokens))
        if min(len(t) for t in c.times.values()) < self.trials:
            return
        medians = {s: statistics.median(t) for s, t in c.times.items()}
        best = min(SCHEDULES, key=lambda s: (medians[s], s != "none"))
        if best != c.choice:
            kind = "decode" if key[0] else "mixed"
            log.info("pipeline auto: %s steps of %d-%d tokens run %s (median %s)", kind,
                     2 ** key[1], 2 ** (key[1] + 1) - 1, best,
                     ", ".join(f"{s} {m * 1e3:.3f} ms/token" for s, m in medians.items()))
        c.choice, c.since = best, 0
        c.times = {s: [] for s in SCHEDULES}
        self.decisions[key] = Decision(best, medians)
