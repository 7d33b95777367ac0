"""Attention sparsity on a memory worker: which of a sequence's stored keys each decode
row attends to, per layer, under a token budget (`SparsityConfig`, `Sparsifier`).

Data in: per layer, the step's `SlotBatch` (on the pool's device), q [n, Hq, D], the
layer's pool rows, and each batch entry's sequence id; after attention, the rows'
lse [n, Hq] (the attention mass the score-keeping policies accumulate).
Data out: the `SlotBatch` the kernel attends with: decode rows (one query) whose
context exceeds their layer's budget list only their selected slots; every other row
keeps its table. None when no row is cut: the step is then exactly the dense one.

Policies (a row reads only what it selects; `h2o` and `snapkv` drop keys for good from
what its rows may select, the others may select any stored key again):
- `dense`: no selection.
- `streaming` (StreamingLLM): the first `sinks` keys and the most recent ones.
- `h2o` (heavy hitters): the recent window, then the keys with the most attention mass
  accumulated over this sequence's steps; a key left out once is evicted for good.
- `snapkv`: at prefill, the prompt's last `observe` queries score the prompt's keys
  (attention summed over those queries and heads, max-pooled over `pool_kernel`
  positions); decode rows take the best-scored prompt keys and the recent window; a
  key left out once is evicted for good (the prompt is compressed once, as in SnapKV).
- `topk` (Quest / HiSparse): pages of `page_size` keys summarized by their channel-wise
  min and max (int8 rows over int8 pools); each decode row takes the pages whose bound
  on q.k is highest, plus the sinks and the unfinished last page (the step's rows in one
  C++ call, `page_picks`). With `rescore` r, the pages covering r x the budget are
  candidates whose keys are scored exactly (`rescored`), the best kept.
- `swa` (ALISA's sparse window attention): the recent window, then the keys with the
  largest recent attention mass (a moving sum over about a window's steps).
A row's selection is shared by its heads (the kernels take one key list per request).

Freeing slots: one slot holds a token's KV at every layer, so a key's slot can go back
only when every layer has evicted it. `take_dropped` reports those keys of `h2o` /
`snapkv` sequences (once each); the engine gives their slots back and the next steps'
key lists lack them: the per-key state is then carried over to the shorter list
(`_rebase`). `streaming`'s dropped range is known to the engine without a report
(`evictable`).
Prompt scores (`snapkv`, and the initial mass of `h2o` / `swa`) come from the last
`observe` queries of the prompt's last chunk, not from every prompt query.

Budgets: `budget` in (0, 1] is a fraction of each row's context, an int a token count;
`layer_budgets` spreads it over layers with weights of mean 1: `uniform`, `pyramid`
(1.5x at the first layer down to 0.5x at the last), `entropy` (proportional to each
layer's attention entropy on a calibration text, measured at start-up by
`lamina.model.prepare.attention_entropy`) or `concentration` (proportional to its
inverse's square root, `CONCENTRATION_POWER`: a layer whose attention sits on few keys
loses most when one is left out; on SmolLM2 better than uniform in 17 of 18 measured
policy/budget cells, docs/sparsity.md). A budget at or above
a row's context selects everything: the row is attended exactly as dense. Layers with a
sliding window stay dense (they are sparse already).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from lamina.kernels import KernelBuildError, SlotBatch, load_cpu_kernel
from lamina.kernels.quant import dequantize_rows, fold_channels, head_dim, is_quantized
from lamina.memory.sparsity_config import (  # noqa: F401 - the names callers import here
    FOR_GOOD,
    LAYER_BUDGETS,
    MEASURED,
    POLICIES,
    SCORED,
    WINDOWS,
    KVOverride,
    SparsityConfig,
    _is_int,
    layer_fractions,
    layer_shares,
    row_budget,
    split_budget,
)

# topk's page bounds over float pools: fp32 (int8 pools keep int8 rows, `quantize_bounds`,
# which the C++ `page_pick` reads; bf16 would halve what scoring reads, but torch's bf16
# matrix-vector product made the selection slower than the bytes it saved)
BOUNDS_DTYPE = torch.float32


def pick(n: int, t: int, sinks: int, recent: int,
         score: torch.Tensor | None = None) -> torch.Tensor:
    """Key indices (sorted, int64) of a row with n keys and budget t: the first `sinks`,
    the last `recent`, then the best `score`d of the rest (-inf: never); without scores
    the recent ones take the whole budget (streaming)."""
    if t >= n:
        return torch.arange(n)
    if score is None:
        recent = t - sinks
    keep = torch.zeros(n, dtype=torch.bool)
    keep[:sinks] = True
    keep[n - recent:] = True
    left = t - int(keep.sum())
    if score is not None and left > 0:
        s = score[:n].float().clone()
        s[keep] = -math.inf
        v = torch.topk(s, min(left, n), sorted=False).values.min()  # the left-th best
        if not math.isfinite(float(v)):  # fewer selectable keys than the budget: all
            keep |= torch.isfinite(s)
        else:  # ties at the threshold go to the earliest keys, so the choice does not
            # depend on keys that could never be chosen (given back or not)
            above = s > v
            keep |= above
            tied = (s == v).nonzero().flatten()
            keep[tied[:left - int(above.sum())]] = True
    return keep.nonzero().flatten()


def page_bounds(keys: torch.Tensor, page: int) -> torch.Tensor:
    """keys [P * pages, Hkv, D] -> their pages' channel-wise bounds [pages, 2, Hkv, D]:
    [:, 0] the min, [:, 1] the max."""
    kp = keys.float().unflatten(0, (-1, page))
    return torch.stack([kp.amin(dim=1), kp.amax(dim=1)], dim=1)


def quantize_bounds(b: torch.Tensor) -> torch.Tensor:
    """fp32 bounds [pages, 2, Hkv, D] -> int8 rows [pages, 2 Hkv D + 4 Hkv] (int8 pools
    keep them so, a quarter of the bytes): the codes in the same layout, rounded outward
    (the min down, the max up, so q- . min + q+ . max still bounds q.k from above), then
    each kv head's fp32 scale, its largest |bound| / 126 (room for the outward step)."""
    pages, _, hkv, _ = b.shape
    s = (b.abs().amax(dim=(1, 3)) / 126).clamp(min=torch.finfo(torch.float32).tiny)
    sb = s[:, None, :, None]
    x = b / sb  # [pages, 2, Hkv, D]
    codes = torch.stack([x[:, 0].floor(), x[:, 1].ceil()], 1)
    # the division rounds: one more step out wherever the code lands inside its bound
    codes[:, 0] -= (codes[:, 0] * sb[:, 0] > b[:, 0]).float()
    codes[:, 1] += (codes[:, 1] * sb[:, 0] < b[:, 1]).float()
    return torch.cat([codes.to(torch.int8).flatten(1),
                      s.float().contiguous().view(torch.int8).reshape(pages, 4 * hkv)], 1)


def dequantize_bounds(rows: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Bounds rows as a layer state keeps them ([pages, 2 Hkv D] fp32, or
    `quantize_bounds`' int8 rows) -> fp32 bounds [pages, 2, Hkv, D]."""
    if rows.dtype != torch.int8:
        return rows.unflatten(1, (2, num_kv_heads, -1))
    w = rows.shape[1] - 4 * num_kv_heads
    s = rows[:, w:].contiguous().view(torch.float32)  # [pages, Hkv]
    codes = rows[:, :w].float().unflatten(1, (2, num_kv_heads, -1))
    return codes * s[:, None, :, None]


def signed_queries(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """q [N, Hq, D] -> [N, 2 * Hkv * D]: per kv head, the sums over its query heads of
    q- = min(q, 0) and of q+ = max(q, 0) (what `page_scores` multiplies the bounds by;
    for all of a step's rows at once)."""
    g = q.float().unflatten(1, (num_kv_heads, -1))  # [N, Hkv, G, D]
    return torch.stack([g.clamp(max=0).sum(2), g.clamp(min=0).sum(2)], 1).flatten(1)


def page_scores(q: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """Quest's bound on a page's largest q.k, summed over the query heads (the row's
    selection is shared by its heads): sum_d max(q_d mn_d, q_d mx_d) = q- . mn + q+ . mx,
    linear in (q-, q+), so summed over a kv head's query heads it is one product with
    their summed q- and q+. q [Hq, D] (or its `signed_queries` row [2 Hkv D]),
    bounds [pages, 2, Hkv, D] -> [pages].
    (A softmax of each head's bounds over the pages before summing, so that heads with
    larger logits do not outvote the others, ranked no better on SmolLM2 and took 3x
    longer.)"""
    qq = q if q.dim() == 1 else signed_queries(q[None], bounds.shape[2])[0]
    return bounds.flatten(1) @ qq.to(bounds.dtype)


def pick_pages(n: int, t: int, sinks: int, page: int, scores: torch.Tensor,
               recent: int = 0) -> torch.Tensor:
    """topk: key indices (int64, sorted) of the first page (when there are sinks), the
    last pages covering at least `recent` keys and the keys past the last summarized
    page, then the best-scored other pages while all fit in t. `scores` [pages] cover
    keys [0, pages * P). NumPy: a few small ops per row."""
    if t >= n:
        return torch.arange(n)
    sc = scores.float().cpu().numpy()
    first = 1 if sinks and len(sc) else 0
    # the recent pages join the tail (the scores no longer cover them)
    npages = max(first, len(sc) - max(0, -(-(recent - (n - len(sc) * page)) // page)))
    sc = sc[:npages]
    done = npages * page
    left = min((t - first * page - (n - done)) // page, npages - first)
    parts = [np.arange(first * page)]
    if left > 0:
        top = np.sort(np.argpartition(-sc[first:], left - 1)[:left]) + first
        parts.append((top[:, None] * page + np.arange(page)).ravel())
    parts.append(np.arange(done, n))
    return torch.from_numpy(np.concatenate(parts))


@dataclass(frozen=True)
class PagePicks:
    """A step's topk rows' picks (`page_picks`): row i's key indices (sorted) are
    idx[cu[i]:cu[i + 1]], their slots the same span of `slots` (None: not gathered)."""

    idx: torch.Tensor  # int64 [sum of picks]
    cu: np.ndarray  # int64 [R + 1]
    slots: np.ndarray | None  # int32 [sum of picks]
    stale: list[int]  # rows whose summarized pages no longer hold their table's slots

    def rows(self) -> list[torch.Tensor]:
        return list(self.idx.split(np.diff(self.cu).tolist()))

    def row_slots(self, i: int) -> np.ndarray | None:
        return None if self.slots is None else self.slots[self.cu[i]:self.cu[i + 1]]


def page_picks(rows: _TopkRows, q: torch.Tensor, table: np.ndarray) -> PagePicks:
    """The topk rows' key indices by `pick_pages`' rule, and their slots. q [R, Hq, D]:
    the rows' queries; `table`: the step's slot tables (int32, row i's at its plan's
    offset); a row whose `checks` differ from its table is listed `stale`. All
    rows in one C++ call where their bounds are on the CPU (ties to the earlier page),
    else row by row in torch and NumPy."""
    ext = _cpu_ext() if all(b.device.type == "cpu" for b in rows.bounds) else None
    if ext is None or not rows.bounds:
        signed = signed_queries(q, rows.num_kv_heads)
        got, stale = [], []
        for i, ((n, c, sinks, recent, page, off), b, check) in enumerate(
                zip(rows.plan, rows.bounds, rows.checks)):
            if check is not None and not np.array_equal(check, table[off:off + len(check)]):
                stale.append(i)
            got.append(pick_pages(n, c, sinks, page, page_scores(
                signed[i], dequantize_bounds(b, rows.num_kv_heads)), recent))
        cu = np.zeros(len(got) + 1, np.int64)
        np.cumsum([len(g) for g in got], out=cu[1:])
        return PagePicks(torch.cat(got) if got else torch.zeros(0, dtype=torch.int64), cu,
                         None, stale)
    empty = torch.zeros(0, dtype=torch.int32)
    checks = [empty if c is None else torch.from_numpy(c) for c in rows.checks]
    idx, cu, slots, stale = ext.page_pick(
        q.float().contiguous(), rows.bounds, torch.from_numpy(rows.params),
        torch.from_numpy(table), checks if any(c is not None for c in rows.checks) else [])
    return PagePicks(idx, cu.numpy(), slots.numpy(), np.flatnonzero(stale.numpy() >= 0)
                     .tolist())


def rescored(query: RowQuery, slots, n: int, t: int, sinks: int, recent: int,
             cand: torch.Tensor, kp, key_scales) -> torch.Tensor:
    """topk with `rescore`: the candidate keys `cand` (int64 indices into the row's
    table `slots`) are scored exactly (each head's softmax over the candidates, summed
    over heads); the best t with the sinks and the recent window are the row's keys
    (int64, sorted)."""
    ci = cand.numpy()
    logits = candidate_logits(query, kp, torch.from_numpy(slots[ci]), key_scales)
    score = torch.softmax(logits, dim=-1).sum(0).numpy()  # [c]
    # what `pick` does, over the candidates only (NumPy: a few us, not a torch op each)
    free = (ci >= sinks) & (ci < n - recent)
    left = min(t - sinks - recent, int(free.sum()))
    parts = [np.arange(sinks), np.arange(n - recent, n)]
    if left > 0:
        idx = np.flatnonzero(free)
        parts.append(idx[np.argpartition(-score[idx], left - 1)[:left]] if left < len(idx)
                     else idx)
        parts[-1] = ci[parts[-1]]
    return torch.from_numpy(np.sort(np.concatenate(parts)))


def candidate_logits(query: RowQuery, kp: torch.Tensor, slots: torch.Tensor,
                     key_scales) -> torch.Tensor:
    """A row's logits [Hq, c] against the keys at `slots` (int32 [c]): read in place by
    the C++ kernel (fp32 and int8 CPU pools), else gathered and multiplied in torch."""
    ext = _cpu_ext() if kp.device.type == "cpu" else None
    if (ext is not None and kp.dtype in (torch.float32, torch.int8) and kp.stride(2) == 1
            and kp.stride(1) == kp.shape[2]):
        q = query.q.float()
        if is_quantized(kp) and key_scales is not None:  # codes x a: q takes the c
            q = fold_channels(q[None], key_scales)[0]
        return ext.slot_scores(q.cpu(), kp, slots.to(torch.int32), query.scale,
                               query.softcap)
    keys = _keys(kp, slots, key_scales)  # [c, Hkv, D]
    return _logits(query.q[None].to(keys.device), keys, query.scale, query.softcap)[0].cpu()


def _cpu_ext():
    """The C++ extension, or None where it cannot be built (the torch path then)."""
    try:
        return load_cpu_kernel()
    except KernelBuildError:
        return None


def snap_scores(probs: torch.Tensor, kernel: int) -> torch.Tensor:
    """SnapKV's prompt scores: probs [w, H, n] of the observation queries -> [n], summed
    over queries and heads and max-pooled over `kernel` neighbouring positions."""
    s = probs.float().sum((0, 1))[None, None]
    return torch.nn.functional.max_pool1d(s, kernel, 1, kernel // 2)[0, 0, :probs.shape[-1]]


@dataclass(frozen=True)
class RowQuery:
    """A decode row's query as the policies read it."""

    q: torch.Tensor  # [Hq, D]
    scale: float  # the layer's logit scale and soft cap (topk's `rescore`)
    softcap: float = 0.0


@dataclass(frozen=True)
class _TopkOut:
    """`Sparsifier._topk`'s selections: per topk row its batch entry, key indices and
    slots (None: not gathered)."""

    entries: list[int]
    picks: list[torch.Tensor]
    slots: list[np.ndarray | None]
    gathered: PagePicks | None  # all of them as one table (none rescored or rebuilt)


@dataclass
class _TopkRows:
    """A step's topk decode rows at one layer, gathered by `Sparsifier.select` (`add`)
    and picked in one call (`page_picks`)."""

    num_kv_heads: int
    entries: list[int] = field(default_factory=list)  # each row's batch entry
    at: list[int] = field(default_factory=list)  # its decode row among the step's
    states: list[_LayerState] = field(default_factory=list)  # takes the selection
    budgets: list[int] = field(default_factory=list)  # t
    bounds: list[torch.Tensor] = field(default_factory=list)  # [pages, 2 Hkv D] (`_pages`)
    # the slots each row's bounds summarize, still to be compared with its table (None:
    # compared, or built, this step)
    checks: list[np.ndarray | None] = field(default_factory=list)
    plan: list[tuple] = field(default_factory=list)  # params' rows, before `params`

    def add(self, entry: int, at: int, st: _LayerState, t: int, bounds: torch.Tensor,
            check: np.ndarray | None, n: int, c: int, sinks: int, recent: int, page: int,
            offset: int) -> None:
        self.entries.append(entry)
        self.at.append(at)
        self.states.append(st)
        self.budgets.append(t)
        self.bounds.append(bounds)
        self.checks.append(check)
        self.plan.append((n, c, sinks, recent, page, offset))

    @property
    def params(self) -> np.ndarray:
        """[R, 6] int64: n, c (keys the pages may cover: > t where rescored), sinks,
        recent, page size, where the row's n slots start in the step's table."""
        return np.array(self.plan, np.int64).reshape(-1, 6)

    def subset(self, keep: list[int]) -> "_TopkRows":
        out = _TopkRows(self.num_kv_heads)
        for i in keep:
            out.add(self.entries[i], self.at[i], self.states[i], self.budgets[i],
                    self.bounds[i], self.checks[i], *self.plan[i])
        return out


@dataclass
class _LayerState:
    """One sequence's state at one layer (indices are key positions within the row)."""

    score: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # [n] fp32
    evicted: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))
    prompt: int = 0  # snapkv: keys the prompt scores cover
    rows: int = 0  # this step's keys in the row (decode rows)
    budget: int = 0  # this step's budget t
    picked: torch.Tensor | None = None  # this step's selection (None: all keys)
    page_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    bounds: torch.Tensor | None = None  # topk: [pages, 2 Hkv D] (int8 pools: int8 rows)

    def rebase(self, keep: torch.Tensor) -> None:
        """Keys given back: `keep` [old n] bool marks the survivors (their order kept)."""
        self.score = self.score[keep[:self.score.numel()]]
        self.evicted = self.evicted[keep[:self.evicted.numel()]]
        self.prompt = int(keep[:self.prompt].sum())
        self.picked, self.rows = None, 0
        self.page_slots, self.bounds = np.zeros(0, np.int32), None


@dataclass
class _KeyList:
    """The key list a sequence's layer states index (see `Sparsifier._rebase`)."""

    slots: np.ndarray  # [n] int32
    qpos: int  # the position of the query that saw it
    told: torch.Tensor | None  # [<= n] bool: reported dropped (`take_dropped`)
    src: torch.Tensor | None = None  # the step's table it came from (one rebase a step)
    gone: int = 0  # the sequence's keys given back before it


@dataclass(frozen=True)
class _Policy:
    """A resolved config and its per-layer budget shares [L]."""

    config: SparsityConfig
    shares: np.ndarray

    @staticmethod
    def of(config: SparsityConfig, num_layers: int) -> "_Policy":
        return _Policy(config, layer_shares(config, num_layers))


class Sparsifier:
    """A memory worker's selection state: per sequence and layer, what its policy keeps
    (scores, evictions, page bounds). Plain Python over the batch's CPU tables. A
    sequence may have its own policy (`override`: a request's `KVOverride`); the others
    follow the deployment's `config`."""

    def __init__(self, config: SparsityConfig, num_layers: int):
        self.config = config
        self.num_layers = num_layers
        self._base = _Policy.of(config, num_layers)
        self.shares = self._base.shares
        self.state: dict[int, list[_LayerState | None]] = {}
        self._own: dict[int, _Policy] = {}  # sequences with their own policy
        # per sequence: the key list (slots) its layer states index, with the position
        # of the query that last saw it (new keys since come at the end), and which of
        # those keys were reported dropped (`take_dropped`)
        self._keys: dict[int, _KeyList] = {}

    def override(self, seq_id: int, override: KVOverride) -> None:
        """seq_id follows `override` resolved against the deployment's config from its
        next layer on (the same override again changes nothing; raises ValueError)."""
        cfg = override.resolve(self.config)
        sid = int(seq_id)
        if cfg == self.policy(sid).config:
            return
        self._forget(sid)  # another policy's state means nothing to this one
        if cfg == self.config:
            self._own.pop(sid, None)
        else:
            self._own[sid] = _Policy.of(cfg, self.num_layers)

    def policy(self, seq_id: int) -> _Policy:
        return self._own.get(seq_id, self._base)

    @property
    def active(self) -> bool:
        """Whether any sequence (or the deployment) has a policy that cuts rows."""
        return self.config.enabled or any(p.config.enabled for p in self._own.values())

    def release(self, seq_ids) -> None:
        for s in seq_ids:
            self._forget(int(s))
            self._own.pop(int(s), None)

    def _forget(self, sid: int) -> None:
        self.state.pop(sid, None)
        self._keys.pop(sid, None)

    def _rebase(self, sid: int, slots: np.ndarray, qpos: int, src: torch.Tensor) -> int:
        """The key list `slots` (NumPy int32, from the step's table `src`) its query at
        `qpos` sees: where keys were given back since the state was built, each layer's
        per-key state keeps the survivors' entries (in order); a list changed any other
        way (recomputed) starts the state afresh. -> how many of the sequence's keys
        were given back so far."""
        old = self._keys.get(sid)
        if old is not None and old.src is src:
            return old.gone  # another layer of the same step
        new = self._keys[sid] = _KeyList(slots, qpos, None, src)
        if old is None:
            return 0
        new.told, new.gone = old.told, old.gone
        m = len(old.slots)
        if len(slots) >= m and np.array_equal(slots[:m], old.slots):
            return new.gone  # only grown
        kept = len(slots) - max(0, qpos - old.qpos)  # keys that were in the old list
        keep = np.isin(old.slots, slots[:max(0, kept)])
        if int(keep.sum()) != kept or not np.array_equal(old.slots[keep], slots[:kept]):
            self._forget(sid)
            self._keys[sid] = _KeyList(slots, qpos, None, src)
            return 0
        mask = torch.from_numpy(keep)
        for st in self.state.get(sid, []):
            if st is not None:
                st.rebase(mask)
        if old.told is not None:
            new.told = old.told[mask[:len(old.told)]]
        new.gone += m - kept
        return new.gone

    def take_dropped(self, seq_ids=None) -> dict[int, np.ndarray]:
        """seq id -> slots (int32) of the keys that every layer of an `h2o` / `snapkv`
        sequence has evicted for good, not reported before (each is reported once); of
        sequences `seq_ids` only where given."""
        out = {}
        mine = None if seq_ids is None else set(seq_ids)
        for sid, layers in self.state.items():
            if mine is not None and sid not in mine:
                continue
            kl = self._keys.get(sid)
            ev = [st.evicted for st in layers if st is not None and st.evicted.numel()]
            if (kl is None or self.policy(sid).config.policy not in FOR_GOOD
                    or len(ev) < len(layers)):
                continue  # a layer that evicted nothing yet keeps every key
            m = min(min(e.numel() for e in ev), len(kl.slots))
            dead = torch.ones(m, dtype=torch.bool)
            for e in ev:
                dead &= e[:m]
            told = _grown(kl.told, m, False) if kl.told is not None else torch.zeros(
                m, dtype=torch.bool)
            new = dead & ~told
            kl.told = told | dead
            if bool(new.any()):
                out[sid] = kl.slots[:m][new.numpy()]
        return out

    def _layer(self, sid: int, layer: int) -> _LayerState:
        layers = self.state.setdefault(sid, [None] * self.num_layers)
        st = layers[layer]
        if st is None:
            st = layers[layer] = _LayerState()
        return st

    def select(self, layer: int, q: torch.Tensor, batch: SlotBatch, seq_ids,
               kp: torch.Tensor, key_scales, scale: float | None = None,
               softcap: float = 0.0) -> SlotBatch | None:
        """The batch this layer attends with (None: `batch` as it is). q [Nq, Hq, D];
        scale / softcap: the layer's logits (topk's `rescore`; None: D^-0.5)."""
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        cu_q, cu_k = batch.cu_q.tolist(), batch.cu_k.tolist()
        pos0 = batch.k_pos0.tolist()
        table = batch.slots.cpu().numpy()  # per-row work in NumPy: a few us a call
        qpos = batch.q_pos.cpu().numpy()
        # the decode rows (one query) whose policy may cut them
        nb = len(cu_q) - 1
        pols = [self.policy(int(seq_ids[b])) if b < len(seq_ids) else self._base
                for b in range(nb)]
        rows = [b for b in range(min(nb, len(seq_ids)))
                if cu_q[b + 1] - cu_q[b] == 1 and pols[b].config.enabled]
        if not rows:
            return None
        at = [cu_q[b] for b in rows]
        qd = q if len(at) == q.shape[0] else q[at]  # [R, Hq, D] (at: ascending)
        picks: dict[int, torch.Tensor] = {}  # batch entry -> its selected key indices
        tk = _TopkRows(kp.shape[1])  # topk rows: their pages are picked all at once
        for i, b in enumerate(rows):
            slots = table[cu_k[b]:cu_k[b + 1]]
            n = len(slots)
            cfg = pols[b].config
            # the budget is of the row's context: the engine may have freed slots the
            # policy will never select again, and the row then lists fewer keys than its
            # context (streaming: its query's position + 1; h2o / snapkv: its keys and
            # those given back)
            ctx = n
            if cfg.policy == "streaming":
                ctx = int(qpos[cu_q[b]]) - pos0[b] + 1
            elif cfg.policy in SCORED:
                ctx = n + self._rebase(int(seq_ids[b]), slots, int(qpos[cu_q[b]]),
                                       batch.slots)
            t = row_budget(cfg.budget, float(pols[b].shares[layer]), max(n, ctx))
            if cfg.policy == "topk":
                self._topk_row(tk, layer, int(seq_ids[b]), slots, t, kp, key_scales, cfg,
                               b, i, cu_k[b])
                continue
            sel = self._decode_row(layer, int(seq_ids[b]), RowQuery(qd[i], scale, softcap),
                                   slots, n, t, cfg)
            if sel is not None:
                picks[b] = sel
        got = self._topk(tk, qd, table, kp, key_scales, scale, softcap)
        return _cut(batch, table, qpos, pos0, picks, got)

    def _decode_row(self, layer: int, sid: int, query: RowQuery, slots, n: int, t: int,
                    cfg: SparsityConfig) -> torch.Tensor | None:
        """A decode row's selected key indices (None: all of them) into its table `slots`
        (NumPy int32 [n]) under `cfg` (a policy other than topk)."""
        pol = cfg.policy
        sinks, recent = split_budget(t, cfg.sinks, cfg.recent)
        if pol == "streaming":
            return None if t >= n else pick(n, t, sinks, recent)
        st = self._layer(sid, layer)
        st.rows, st.budget, st.picked = n, t, None
        if t >= n:
            return None
        score = _grown(st.score, n)
        if pol == "snapkv":
            score[st.prompt:] = -math.inf  # after the prompt: only the recent window
        if pol in FOR_GOOD:
            score[_grown(st.evicted, n, False)] = -math.inf
        st.picked = pick(n, t, sinks, recent, score)
        if pol in FOR_GOOD:  # what was left out is gone for good
            ev = torch.ones(n, dtype=torch.bool)
            ev[st.picked] = False
            st.evicted = ev
        return st.picked

    def _topk_row(self, tk: _TopkRows, layer: int, sid: int, slots, t: int, kp, key_scales,
                  cfg: SparsityConfig, entry: int, at: int, offset: int) -> None:
        """A topk decode row joins the step's `tk` (its pages are picked with the others'
        in `_topk`); `at`: its index among the step's decode rows, `offset`: where its
        table `slots` (NumPy int32 [n]) starts in the step's."""
        n = len(slots)
        st = self._layer(sid, layer)
        st.rows, st.budget, st.picked = n, t, None
        if t >= n:
            return
        P = cfg.page_size or self.config.page_size
        full = (n - 1) // P
        if st.bounds is not None and st.bounds.shape[0] == full and len(st.page_slots) == full * P:
            bounds, check = st.bounds, st.page_slots  # as last step: compared in the call
        else:
            bounds, check = self._pages(st, slots, n, kp, key_scales, P), None
        sinks, recent = split_budget(t, cfg.sinks, cfg.recent)
        # with `rescore`, pages covering that multiple of t are the candidates
        c = min(n, math.ceil(cfg.rescore * t)) if cfg.rescore >= 1 else t
        tk.add(entry, at, st, t, bounds, check, n, c, sinks, recent, P, offset)

    def _topk(self, tk: _TopkRows, qd: torch.Tensor, table: np.ndarray, kp, key_scales,
              scale: float, softcap: float) -> _TopkOut:
        """The topk rows' selections (`page_picks`; rows whose summarized pages changed
        slots are rebuilt and picked again), each rescored row's best keys among its
        candidates (`rescored`). qd [R, Hq, D]: the step's decode rows' queries."""
        if not tk.entries:
            return _TopkOut([], [], [], None)
        got = page_picks(tk, qd if len(tk.at) == len(qd) else qd[tk.at], table)
        picks = got.rows()
        slots = [got.row_slots(i) for i in range(len(picks))]
        for i in got.stale:  # a fork, a recomputation: the bounds are rebuilt
            n, _, _, _, page, off = tk.plan[i]
            tk.checks[i] = None
            tk.bounds[i] = self._pages(tk.states[i], table[off:off + n], n, kp, key_scales, page)
        if got.stale:
            again = page_picks(tk.subset(got.stale), qd[[tk.at[i] for i in got.stale]], table)
            for j, (i, sel) in enumerate(zip(got.stale, again.rows())):
                picks[i], slots[i] = sel, again.row_slots(j)
        for i, st in enumerate(tk.states):
            n, c, sinks, recent, _, off = tk.plan[i]
            if c > tk.budgets[i]:
                picks[i] = rescored(RowQuery(qd[tk.at[i]], scale, softcap),
                                    table[off:off + n], n, tk.budgets[i], sinks, recent,
                                    picks[i], kp, key_scales)
                slots[i] = None
            st.picked = picks[i]
        whole = not got.stale and all(x is not None for x in slots)
        return _TopkOut(tk.entries, picks, slots, got if whole else None)

    def _pages(self, st: _LayerState, slots, n: int, kp, key_scales, P: int | None = None):
        """topk's page bounds (pages of P keys; None: the deployment's page size) over
        the keys written before this step ([0, n - 1)), rebuilt from the first page whose
        slots changed (a fork, a recomputation)."""
        P = P or self.config.page_size
        full = (n - 1) // P
        want = slots[:full * P]  # NumPy int32
        m = min(len(st.page_slots), len(want)) // P
        same = m
        if not np.array_equal(st.page_slots[:m * P], want[:m * P]):
            diff = np.nonzero((st.page_slots[:m * P] != want[:m * P]).reshape(m, P).any(1))
            same = int(diff[0][0])
        if st.bounds is None or same < full or st.bounds.shape[0] != full:
            new = (page_bounds(_keys(kp, torch.from_numpy(slots[same * P:full * P]),
                                     key_scales), P)
                   if same < full else torch.zeros(0, 2, kp.shape[1], head_dim(kp)))
            new = quantize_bounds(new) if is_quantized(kp) else new.to(BOUNDS_DTYPE).flatten(1)
            st.bounds = (torch.cat([st.bounds[:same], new]) if same and st.bounds is not None
                         else new)
            st.page_slots = want.copy()
        return st.bounds

    def observe(self, layer: int, q, lse, batch: SlotBatch, seq_ids, kp, key_scales,
                scale: float, softcap: float) -> None:
        """After attention with `batch` (the one `select` returned): the scored policies
        add each decode row's attention mass to its keys' scores; a prefill chunk's last
        `observe` queries score its keys afresh (the prompt's last chunk's stay)."""
        if self.config.policy not in SCORED and not any(
                p.config.policy in SCORED for p in self._own.values()):
            return
        cu_q, cu_k, pos0 = batch.cu_q.tolist(), batch.cu_k.tolist(), batch.k_pos0.tolist()
        for b in range(min(len(cu_q) - 1, len(seq_ids))):
            nq, n = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
            cfg = self.policy(int(seq_ids[b])).config
            if n == 0 or cfg.policy not in SCORED:
                continue
            if nq == 1 and cfg.policy == "snapkv":
                continue  # its choice was made at prefill
            keys = _keys(kp, batch.slots[cu_k[b]:cu_k[b + 1]], key_scales)  # [n, Hkv, D]
            st = self._layer(int(seq_ids[b]), layer)
            if nq > 1:  # a prompt chunk: its last queries score its keys
                w = min(nq, cfg.observe)
                rows = slice(cu_q[b + 1] - w, cu_q[b + 1])
                probs = _probs(q[rows], keys, batch.q_pos[rows] - pos0[b], scale, softcap)
                if cfg.policy == "snapkv":
                    st.score, st.prompt = snap_scores(probs, cfg.pool_kernel).cpu(), n
                else:
                    st.score = probs.sum((0, 1)).cpu()
                st.evicted = torch.zeros(n, dtype=torch.bool)
                sid = int(seq_ids[b])
                self._keys[sid] = _KeyList(batch.slots[cu_k[b]:cu_k[b + 1]].cpu().numpy(),
                                           int(batch.q_pos[cu_q[b + 1] - 1]), None, None)
            else:  # a decode row: its attention mass accumulates
                s = _logits(q[cu_q[b]][None], keys, scale, softcap)  # [1, Hq, m]
                p = torch.exp(s - lse[cu_q[b]].float()[None, :, None]).sum((0, 1))  # [m]
                full = st.rows or n
                score = _grown(st.score, full)
                if cfg.policy == "swa":  # a moving sum over about a window's steps
                    _, recent = split_budget(max(st.budget, 1), cfg.sinks, cfg.recent)
                    score *= 1.0 - 1.0 / recent
                idx = st.picked if st.picked is not None else torch.arange(n)
                score[idx] += p.cpu()
                st.score = score


def _cut(batch: SlotBatch, table: np.ndarray, qpos: np.ndarray, pos0: list[int],
         picks: dict[int, torch.Tensor], got: _TopkOut) -> SlotBatch | None:
    """`batch` with each cut row's table replaced by its selection (None: no row cut).
    `picks`: batch entry -> key indices (the policies other than topk); `got`: the topk
    rows'. table / qpos: the batch's slots and query positions in NumPy."""
    cu_q, cu_k, nb = batch.cu_q.tolist(), batch.cu_k.tolist(), batch.num_requests
    dev = batch.slots.device
    g = got.gathered
    if g is not None and g.slots is not None and len(got.entries) == nb:
        # every entry a topk row, their slots gathered: the step's table as it is
        starts = qpos[cu_q[:-1]].astype(np.int64) - np.diff(g.cu) + 1
        return SlotBatch(batch.cu_q, batch.q_pos, torch.from_numpy(g.slots).to(dev),
                         torch.from_numpy(g.cu.astype(np.int32)).to(dev),
                         torch.from_numpy(starts.astype(np.int32)).to(dev))
    kept = {b: (sel, own) for b, sel, own in zip(got.entries, got.picks, got.slots)}
    if not picks and not kept:
        return None
    tables, starts = [], []
    for b in range(nb):
        slots = table[cu_k[b]:cu_k[b + 1]]
        sel, own = kept.get(b, (picks.get(b), None))
        tables.append(slots if sel is None else own if own is not None
                      else slots[sel.numpy()])
        # the kernels read positions only for causality: the row's query sees them all
        starts.append(pos0[b] if sel is None else int(qpos[cu_q[b]]) - len(sel) + 1)
    cu = np.zeros(len(tables) + 1, np.int32)
    np.cumsum([len(t) for t in tables], out=cu[1:])
    return SlotBatch(batch.cu_q, batch.q_pos, torch.from_numpy(np.concatenate(tables))
                     .to(dev), torch.from_numpy(cu).to(dev),
                     torch.tensor(starts, dtype=torch.int32, device=dev))


def _grown(x: torch.Tensor, n: int, fill=0.0) -> torch.Tensor:
    """x extended (or cut) to n entries, new ones `fill`; a copy."""
    out = torch.full((n,), fill, dtype=x.dtype)
    m = min(n, x.numel())
    out[:m] = x[:m]
    return out


def _keys(kp: torch.Tensor, slots: torch.Tensor, key_scales) -> torch.Tensor:
    """The true keys at `slots` [m] -> [m, Hkv, D] fp32 (int8 rows dequantized)."""
    # index_select: ~4x faster than advanced indexing over scattered rows on the CPU
    rows = kp.index_select(0, slots.long().to(kp.device))
    if is_quantized(kp):
        return dequantize_rows(rows, key_scales)
    return rows.float()


def _logits(q: torch.Tensor, keys: torch.Tensor, scale: float, softcap: float):
    """q [w, Hq, D], keys [n, Hkv, D] -> scaled (soft-capped) logits [w, Hq, n]. A kv
    head's query heads meet its keys in one product (the keys are not repeated)."""
    g = q.float().unflatten(1, (keys.shape[1], -1)) * scale  # [w, Hkv, G, D]
    s = torch.einsum("wkgd,nkd->wkgn", g, keys).flatten(1, 2)
    return softcap * torch.tanh(s / softcap) if softcap > 0 else s


def _probs(q, keys, qpos, scale: float, softcap: float) -> torch.Tensor:
    """Causal softmax of queries at row-relative positions qpos [w] over keys [n]."""
    s = _logits(q, keys, scale, softcap)
    mask = torch.arange(keys.shape[0])[None, :] > qpos.long()[:, None].cpu()  # [w, n]
    s = s.masked_fill(mask[:, None, :].to(s.device), -math.inf)
    return torch.softmax(s, dim=-1)
