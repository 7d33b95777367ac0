"""A deployment's attention sparsity settings (`SparsityConfig`), validated on creation,
and how its budget is spread over layers. Plain Python and NumPy: the engine's config
reads it; `lamina.memory.sparsity` does the selecting.

Data in: the policy, budget and layer rule (from `EngineConfig`, the CLI or a deploy
file), and a request's own policy or budget (`KVOverride`, from its `SamplingParams`).
Data out: a frozen `SparsityConfig`; a bad value raises `ValueError` naming it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

POLICIES = ("dense", "streaming", "h2o", "snapkv", "topk", "swa")
LAYER_BUDGETS = ("uniform", "pyramid", "entropy", "concentration")
# the layer rules whose weights are measured on the model (`layer_weights`: each layer's
# attention entropy, `lamina.model.prepare.attention_entropy`)
MEASURED = ("entropy", "concentration")
# "concentration": each layer's share goes as (1 / entropy) ** this. On SmolLM2 (reduced
# kv-sparsity runs, benchmarks/RESULTS.md) the square root beat the plain inverse for
# topk, with and without rescoring, and the plain inverse lost to uniform budgets for
# rescored topk: the late layers need more keys, but not in full proportion.
CONCENTRATION_POWER = 0.5
SCORED = ("h2o", "snapkv", "swa")  # the policies that keep attention scores
# the policies whose left-out keys never come back: a key every layer left out gives
# its slot back (`Sparsifier.take_dropped`)
FOR_GOOD = ("h2o", "snapkv")
# each policy's recent window, as a fraction of its budget: H2O and ALISA split the
# budget evenly between recent and selected keys; topk's selection is query-aware, so
# most of its budget goes to it (streaming's recent window is its whole budget)
WINDOWS = {"h2o": 0.5, "swa": 0.5, "snapkv": 0.5, "topk": 0.25, "streaming": 1.0,
           "dense": 1.0}


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


@dataclass(frozen=True)
class SparsityConfig:
    """One deployment's attention sparsity; a bad value raises `ValueError` naming it."""

    policy: str = "dense"
    budget: float | int = 1.0  # fraction of the context in (0, 1], or a token count
    layer_budgets: str = "uniform"  # "uniform" | "pyramid" | "entropy" | "concentration"
    # each layer's measured attention entropy, for "entropy" and "concentration" (set at
    # start-up, `MEASURED`)
    layer_weights: tuple[float, ...] | None = None
    sinks: int = 4  # first keys always kept (streaming, topk, h2o, snapkv, swa)
    # recent keys always kept: a fraction of the budget, or a token count; None: the
    # policy's own (`WINDOWS`)
    window: float | int | None = None
    page_size: int = 16  # topk's pages
    # topk: 0 picks pages by their bounds alone; r >= 1 takes pages covering r times the
    # budget as candidates, scores their keys exactly against the query and keeps the
    # best keys (reads the candidates' keys too: better ranking for more bytes)
    rescore: float = 0.0
    observe: int = 32  # prompt queries that score the prompt (snapkv, h2o, swa)
    pool_kernel: int = 7  # snapkv's max-pool width over positions

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"unknown KV sparsity policy {self.policy!r}: one of {POLICIES}")
        b = self.budget
        if _is_int(b):
            if b <= 0:
                raise ValueError(f"KV sparsity budget must be > 0 tokens, got {b}")
        elif isinstance(b, float) and math.isfinite(b):
            if not 0 < b <= 1:
                raise ValueError(f"KV sparsity budget as a fraction must be in (0, 1], "
                                 f"got {b}")
        else:
            raise ValueError(f"KV sparsity budget must be a fraction in (0, 1] or a token "
                             f"count, got {b!r}")
        if _is_int(b) and _is_int(self.sinks) and b <= self.sinks:
            raise ValueError(f"KV sparsity budget of {b} tokens does not cover the "
                             f"{self.sinks} sinks and one recent key (a fraction is a "
                             f"float: 1.0, not 1)")
        if self.layer_budgets not in LAYER_BUDGETS:
            raise ValueError(f"unknown KV sparsity layer_budgets {self.layer_budgets!r}: "
                             f"one of {LAYER_BUDGETS}")
        for name in ("sinks", "page_size", "observe", "pool_kernel"):
            v, least = getattr(self, name), 0 if name == "sinks" else 1
            if not _is_int(v) or v < least:
                raise ValueError(f"KV sparsity {name} must be an int >= {least}, got {v!r}")
        r = self.rescore
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not (
                r == 0 or 1 <= r < math.inf):
            raise ValueError(f"KV sparsity rescore must be 0 (off) or a multiple >= 1 of "
                             f"the budget, got {r!r}")
        if self.window is None:
            object.__setattr__(self, "window", WINDOWS[self.policy])
        w = self.window
        if _is_int(w):
            if w < 1:
                raise ValueError(f"KV sparsity window must be >= 1 token, got {w}")
            if _is_int(b) and w + self.sinks > b:
                raise ValueError(f"KV sparsity window ({w}) + sinks ({self.sinks}) is larger "
                                 f"than the budget ({b} tokens)")
        elif not (isinstance(w, float) and 0 < w <= 1):
            raise ValueError(f"KV sparsity window must be a fraction of the budget in "
                             f"(0, 1] or a token count, got {w!r}")
        if self.layer_weights is not None:
            lw = tuple(float(x) for x in self.layer_weights)
            if not lw or not all(math.isfinite(x) and x > 0 for x in lw):
                raise ValueError("KV sparsity layer_weights must be positive and finite")
            object.__setattr__(self, "layer_weights", lw)

    @property
    def recent(self) -> float | int:
        """The recent window: a fraction of the budget or a token count."""
        return WINDOWS[self.policy] if self.window is None else self.window

    @property
    def enabled(self) -> bool:
        return self.policy != "dense" and not (isinstance(self.budget, float)
                                               and self.budget >= 1.0)

    def weights(self, num_layers: int) -> np.ndarray:
        """Each layer's share of the budget [L], mean 1: `entropy` in proportion to the
        layer's attention entropy (a layer that spreads its attention gets more keys),
        `concentration` to its inverse's `CONCENTRATION_POWER` (a layer that attends to
        few keys gets more)."""
        if self.layer_budgets == "uniform":
            return np.ones(num_layers)
        if self.layer_budgets == "pyramid":
            return np.linspace(1.5, 0.5, num_layers) if num_layers > 1 else np.ones(1)
        if self.layer_weights is None:
            raise ValueError(f"layer_budgets={self.layer_budgets!r} needs the measured "
                             f"layer_weights (lamina.model.prepare.attention_entropy)")
        if len(self.layer_weights) != num_layers:
            raise ValueError(f"{len(self.layer_weights)} layer_weights for {num_layers} "
                             f"layers")
        w = np.asarray(self.layer_weights)
        if self.layer_budgets == "concentration":
            w = w ** -CONCENTRATION_POWER
        return w / w.mean()


def layer_fractions(budget: float, weights: np.ndarray) -> np.ndarray:
    """Per-layer fractions with mean `budget`, proportional to `weights` but none above 1
    (what a capped layer cannot take goes to the others: water-filling)."""
    w = np.asarray(weights, float)
    f = np.minimum(1.0, budget * w / w.mean())
    for _ in range(len(w)):
        short = budget * len(w) - f.sum()
        free = f < 1.0
        if short <= 1e-12 or not free.any():
            break
        f[free] = np.minimum(1.0, f[free] + short * w[free] / w[free].sum())
    return f


def layer_shares(config: SparsityConfig, num_layers: int) -> np.ndarray:
    """Each layer's budget share [L] under `config`: the per-layer fractions of a
    fraction budget (`layer_fractions`), or the weights a token budget is scaled by."""
    w = config.weights(num_layers)
    return layer_fractions(config.budget, w) if isinstance(config.budget, float) else w


def row_budget(budget: float | int, share: float, n: int) -> int:
    """Keys a row with `n` keys of context may attend at a layer with `share`: a fraction
    budget is already per layer (`layer_fractions`), a token budget is scaled by the
    layer's weight; at least 1, at most n."""
    t = math.ceil(share * n - 1e-9) if isinstance(budget, float) else round(budget * share)
    return max(1, min(n, int(t)))


def split_budget(t: int, sinks: int, window: float | int) -> tuple[int, int]:
    """(sinks, recent) within t keys: at least the newest key is recent."""
    s = min(sinks, t - 1)
    r = window if _is_int(window) else math.ceil(window * t)
    return s, max(1, min(int(r), t - s))


def evictable(config: SparsityConfig, shares, n: int) -> tuple[int, int] | None:
    """Positions [lo, hi) of a row with n keys of context that `streaming` will never
    select again at any layer (`shares`: each layer's budget share, `layer_shares`):
    past the sinks and before the widest layer's recent window. None: nothing (another
    policy, or nothing to drop).
    The window only moves forward as the context grows, so what is dropped stays out."""
    if config.policy != "streaming" or not config.enabled:
        return None
    t = max(row_budget(config.budget, float(s), n) for s in shares)
    sinks = min(config.sinks, t - 1)
    lo, hi = sinks, n - (t - sinks)
    return (lo, hi) if hi > lo else None


FRACTION_UNIT = 1_000_000  # a fraction budget on the wire: millionths (0.2 -> 200000)


@dataclass(frozen=True)
class KVOverride:
    """One request's own KV sparsity (`SamplingParams.kv_sparsity` / `kv_budget`): None
    fields take the deployment's. Resolved on the memory workers against their config,
    so the layer rule, sinks and window stay the deployment's (the window is the new
    policy's own default)."""

    policy: str | None = None
    budget: float | int | None = None

    def __post_init__(self):
        if self.policy is not None and self.policy not in POLICIES:
            raise ValueError(f"unknown KV sparsity policy {self.policy!r}: one of {POLICIES}")
        if self.budget is not None:  # its form; against the sinks when resolved
            SparsityConfig("dense", self.budget, sinks=0)

    def resolve(self, base: SparsityConfig) -> SparsityConfig:
        return replace(base, policy=self.policy or base.policy, window=None,
                       budget=base.budget if self.budget is None else self.budget)

    def encode(self, seq_id: int) -> tuple[int, int, int, int]:
        """(seq id, policy index or -1, budget kind: 0 fraction, 1 tokens, -1 none,
        budget value): one row of the data plane's int32 override frame."""
        b = self.budget
        kind = -1 if b is None else 1 if _is_int(b) else 0
        value = 0 if b is None else int(b) if kind else round(float(b) * FRACTION_UNIT)
        return (seq_id, -1 if self.policy is None else POLICIES.index(self.policy), kind,
                value)

    @staticmethod
    def decode(row) -> tuple[int, "KVOverride"]:
        sid, pol, kind, value = (int(x) for x in row)
        if not -1 <= pol < len(POLICIES) or kind not in (-1, 0, 1):
            raise ValueError(f"bad KV sparsity override row {list(row)}")
        budget = None if kind < 0 else value if kind else value / FRACTION_UNIT
        return sid, KVOverride(None if pol < 0 else POLICIES[pol], budget)
