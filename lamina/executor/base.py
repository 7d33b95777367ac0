"""Executors run a `StepPlan` through the model slices and the memory side.

Data in: `StepPlan` (tokens, positions, per-worker slot tables) from the engine.
Data out: `StepResult` (the tokens drawn for the sampling sequences; the sampler runs
here, on the compute side, so only token ids go back to the engine).

All sequences' new tokens are packed into one [1, N] row: every op outside attention is
per token, so the slices need no padding, and prefill and decode mix freely in one step.
For each attention layer the packed q/k/v rows are split by memory worker (requests are
partitioned across workers; rows are packed grouped by worker, so each worker's share is
one slice), each worker writes its rows' k/v into its pool and attends over its
sequences' slots, and the outputs are put back in row order. With
`plan.micro_batches = 2` the step runs as two sub-batches in a staggered pipeline (paper
5.1, the n = 2 case on one replica): slice i of one overlaps the other's attention.
The last slice (last layer's o_proj and MLP, final norm, lm_head) runs on the sampled
rows only: in a prefill, the other prompt tokens' outputs are never needed. With
`ComputeSide.local_kv_dtype` set (the Ray compute worker; paper 5.6), fresh prompts
attend here over a scratch pool and their workers only store their k/v.
`LocalExecutor` holds its memory sides in this process; `lamina.cluster` runs the same
`ComputeSide` in a Ray actor that talks to memory-worker processes over the data plane.
"""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod

from lamina.engine.messages import StartedMemory, StepPlan, StepResult
from lamina.memory.tier_orders import SlotMove, TierMove


class Executor(ABC):
    @abstractmethod
    def execute(self, plan: StepPlan) -> StepResult: ...

    def probe(self, tokens, repeat: int = 20) -> dict:
        """Per-op costs of this executor's own plumbing, for simulator calibration:
        {"exchange_s": {n: one layer's q/k/v out and o back for n tokens}, "submit_s": {n:
        the sending part alone}, "call_s": {n: the per-step call returning n tokens}}.
        Empty when there is nothing to add (in-process). Only call it while no request is
        running, with the engine's prefix cache cleared (`LLMEngine.clear_prefix_cache`):
        it writes into the first slots of the pools."""
        return {}

    def recover(self, error: BaseException) -> bool:
        """After `execute` raised `error`: bring the workers back (resetting live ones,
        replacing dead ones) so steps can run again. True if it did; the engine then
        recomputes the KV no kept pool holds (`kv_kept`). False (the default): not
        recoverable."""
        return False

    def check_workers(self) -> list[str]:
        """While no step runs: each worker that is dead or does not answer within a
        bound, in words (empty: every one answered). `recover` then replaces those
        without waiting on them again. Default: none to check (the workers live in this
        process, and fail with it)."""
        return []

    def kv_kept(self) -> frozenset[int]:
        """The memory workers whose pools the latest `recover` kept with their bytes
        (reset, not replaced), by index: the KV of every position computed before the
        failed step is still there (a step writes only the slots of the positions it
        computes), so the engine keeps it for the sequences it holds. Default: none
        (every pool is presumed new, everything is recomputed)."""
        return frozenset()

    def memory_lost(self) -> tuple[int, ...]:
        """The memory workers the latest `recover` dropped, by their index before it
        (ascending): dead, and no replacement could start (while at least
        `EngineConfig.min_live_memory_workers` stay). The others keep their order,
        numbered 0.. again; `kv_kept` names them by their new index. Default: none
        (every worker is brought back)."""
        return ()

    def memory_workers_room(self, size: int) -> int | None:
        """How many memory workers, at most `size`, the deployment's cluster holds in
        all (beside its compute workers; those running counted), for growing back to
        `size` after `memory_lost` (`KeepSize`). Default None: this executor never
        drops a worker, so there is nothing to grow back."""
        return None

    def workers_replaced(self) -> dict[str, int]:
        """How many workers recoveries have replaced so far, by role ("compute",
        "memory"): processes that died, hung, or stuck inside a failed step (an
        operator's sign of failing hardware, not of failing requests). Empty when the
        executor has no processes of its own to replace."""
        return {}

    def start_memory_workers(self, first: int, k: int) -> StartedMemory:
        """Start `k` memory workers to be workers first.., each set up with a pool like
        the others', not yet in any step: safe beside running steps, from any thread,
        so the slow part of a scale-up (processes, pools) does not hold the engine.
        Raises, leaving none of them, when they cannot be had."""
        raise NotImplementedError(f"the {type(self).__name__} cannot add memory workers")

    def add_memory_workers(self, started: StartedMemory) -> None:
        """Make the started workers part of the steps (wired to every compute worker),
        between steps (`LLMEngine.scale_memory_workers`); they must be the next indices.
        Raises, having stopped them, when they cannot be wired."""
        raise NotImplementedError(f"the {type(self).__name__} cannot add memory workers")

    def discard_memory_workers(self, started: StartedMemory) -> None:  # noqa: B027
        """Stop started workers that will not be added."""

    def remove_memory_workers(self, n: int) -> None:
        """Keep memory workers 0..n-1; the others are unwired and stopped (the engine
        moved every sequence off them first). Called between steps."""
        raise NotImplementedError(f"the {type(self).__name__} cannot remove memory workers")

    def move_tiers(self, moves: tuple[TierMove, ...]) -> frozenset[int]:
        """Copy each move's saved entry from its source worker's tiers into its dest
        worker's host tier (before the source leaves: `remove_memory_workers`). -> the
        entries moved (one its source did not hold is not). Default: none."""
        return frozenset()

    def move_kv(self, moves: tuple[SlotMove, ...]) -> None:
        """Copy each move's pool slots from its source worker into its dest worker's
        (before the source leaves: `remove_memory_workers`), between steps. Raises when
        a move cannot be done (the engine then preempts those sequences)."""
        raise NotImplementedError(f"the {type(self).__name__} cannot move KV between "
                                  "memory workers")

    def start_trace(self) -> None:
        """Record every device's timeline (`lamina.trace`) from the next step on."""
        raise NotImplementedError(f"the {type(self).__name__} records no trace")

    def stop_trace(self) -> list:
        """The `Span`s of every lane since `start_trace`; tracing off."""
        raise NotImplementedError(f"the {type(self).__name__} records no trace")

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        pass

    @classmethod
    def check(cls, config) -> None:
        """Refuse, by name, an `EngineConfig` this executor cannot run (before anything
        is loaded or started). By default: every one runs."""
        return None


# Executors that live in other packages, found by name at run time (so lamina/ never
# imports them statically; only lamina.cluster imports ray).
PLUGINS = {"ray": "lamina.cluster.executor:RayExecutor"}


def plugin_executor(name: str):
    if name not in PLUGINS:
        raise ValueError(f"unknown executor {name!r}; choose 'local' or one of {sorted(PLUGINS)}")
    mod, cls = PLUGINS[name].split(":")
    try:
        return getattr(importlib.import_module(mod), cls)
    except ImportError as e:
        raise ImportError(f"executor {name!r} needs {e.name}: {e}") from e


