"""Fault injection for tests and fault drills: a `FaultPlan` makes the compute side or
a memory side fail on chosen sequences, as a bug or bad data would, so the isolation of
failed requests can be tested end to end (local and Ray executors, HTTP).

Data in: `EngineConfig.faults` (None in production: no check runs). Data out: an
exception raised at the chosen point. The triggers are keyed on what each side sees: the
compute side sees a sequence's token ids, a memory side only slot tables and positions.
"""
from __future__ import annotations

from dataclasses import dataclass


class InjectedFault(RuntimeError):
    """Raised by a `FaultPlan` trigger."""


@dataclass(frozen=True)
class FaultPlan:
    # The compute side raises while preparing a sequence that feeds this token id.
    compute_token: int | None = None
    # The compute side raises inside the dense slices (layer `compute_layer`) of any step
    # feeding `layer_token`: a failure no sequence is blamed for (a bug one request's
    # data sets off); the engine's culprit search finds the request.
    compute_layer: int | None = None
    layer_token: int | None = None
    # A memory side raises on a sequence with a query at this position.
    memory_pos: int | None = None

    def __post_init__(self):
        for name in ("compute_token", "compute_layer", "layer_token", "memory_pos"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"FaultPlan.{name} must be None or an int >= 0, got {v!r}")
        if (self.compute_layer is None) != (self.layer_token is None):
            raise ValueError("FaultPlan.compute_layer and layer_token go together (which "
                             "layer raises, in steps feeding which token)")

    def check_sequence(self, token_ids) -> None:
        if self.compute_token is not None and self.compute_token in token_ids:
            raise InjectedFault(f"injected compute fault on token {self.compute_token}")

    def check_layer(self, layer: int, token_ids) -> None:
        if layer == self.compute_layer and self.layer_token in token_ids:
            raise InjectedFault(f"injected fault in layer {layer} (no sequence named)")

    def check_memory(self, q_pos) -> bool:
        """True if a memory side must fail a sequence whose queries are at `q_pos`."""
        return self.memory_pos is not None and self.memory_pos in q_pos
