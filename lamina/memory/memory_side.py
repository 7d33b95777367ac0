"""A memory worker's step: its KV pool and attention backend (`MemorySide`).

Data in: per step, the new slots and the `SlotBatch` of this worker's sequences
(checked once, `check`); per layer, q [n, Hq, D] and k/v [m, Hkv, D].
Data out: (o [n, Hq, Dv], lse [n, Hq] fp32) per layer; k/v written at the new slots.
A bad batch entry raises `SequenceFault` naming its sequence, so it fails alone.
Used in-process by `LocalExecutor` and by the memory worker's `MemoryServer`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lamina.errors import SequenceFault
from lamina.kernels import (
    AttentionInputError,
    AttentionParams,
    SlotBatch,
    prefill_attention,
    select_backend,
    validate_batch,
)
from lamina.memory.pool import KVPool
from lamina.memory.sparsity import Sparsifier, SparsityConfig
from lamina.memory.tier_orders import TierConfig
from lamina.memory.tiers import TierStore


def attention_params(spec) -> AttentionParams:
    return AttentionParams(spec.scale, spec.sliding_window or -1, spec.softcap or 0.0,
                           spec.sinks)


@dataclass(frozen=True)
class _CheckedStep:
    """A step's metadata as `MemorySide.check` passed it, and its forms on the pool's
    device that every layer's `attend` then uses."""

    new_slots: torch.Tensor  # [m] int32, as given
    batch: SlotBatch  # as given
    write_index: torch.Tensor  # [m] int64 on the pool's device
    on_device: SlotBatch  # the batch on the pool's device


class MemorySide:
    """One memory worker's state: a KV pool and an attention backend. The pool may sit on
    a GPU while q/k/v arrive in host memory (the data plane carries host tensors): they
    go to the pool's device and the outputs come back."""

    def __init__(self, pool: KVPool, backend=None, faults=None, tiers: TierConfig | None = None,
                 worker: int = 0, rope_inv_freq: tuple[float, ...] | None = None,
                 sparsity: SparsityConfig | None = None):
        self.pool = pool
        # decode rows attend to a selection of their keys (memory/sparsity.py); None: all
        self.set_sparsity(sparsity)
        # session KV beyond the pool (host DRAM, disk): orders arrive with a step's
        # metadata (`apply_tiers`), loads are copied layer by layer in `attend`;
        # `rope_inv_freq`: the model's rotary frequencies, for loads at shifted positions
        self.tiers = (TierStore(tiers, pool, worker, rope_inv_freq)
                      if tiers is not None and tiers.enabled else None)
        self.device = pool.k.device
        self.backend = backend or select_backend(device=self.device)
        self.faults = faults  # a lamina.faults.FaultPlan (tests) or None
        self._step: _CheckedStep | None = None  # this step's metadata, checked
        self._tier_config, self._rope = tiers, rope_inv_freq  # (`sibling`)

    def sibling(self, worker: int) -> MemorySide:
        """A new memory side set up as this one (pool layout, tiers, KV policy, faults),
        with an empty pool of its own: memory worker `worker`."""
        return MemorySide(KVPool(self.pool.config), faults=self.faults,
                          tiers=self._tier_config, worker=worker, rope_inv_freq=self._rope,
                          sparsity=self._config)

    def check(self, new_slots, batch, seq_ids: tuple[int, ...] = ()) -> None:
        """Once per step: the batch's index scans and the new slots' range (per layer,
        `attend(..., checked=True)` then runs only the cheap shape checks). The write
        index (int64) and the batch are put on the pool's device once here. `seq_ids`:
        each batch entry's sequence; a bad entry raises `SequenceFault` naming it."""
        n = self.pool.config.num_slots
        try:
            validate_batch(batch, n)
        except AttentionInputError as e:
            _blame(bad_entries(batch, n), batch, seq_ids, f"bad KV metadata: {e}")
            raise
        if new_slots.numel() and (int(new_slots.min()) < 0 or int(new_slots.max()) >= n):
            raise AttentionInputError(f"new slot ids out of range [0, {n}): min "
                                      f"{int(new_slots.min())}, max {int(new_slots.max())}")
        if self.faults is not None and self.faults.memory_pos is not None:
            cu = batch.cu_q.tolist()
            bad = [b for b in range(batch.num_requests)
                   if self.faults.check_memory(batch.q_pos[cu[b]:cu[b + 1]].tolist())]
            what = f"injected memory fault at position {self.faults.memory_pos}"
            _blame(bad, batch, seq_ids, what)
            if bad:
                raise AttentionInputError(f"{what} (batch entries {bad})")
        self._step = _CheckedStep(new_slots, batch, new_slots.long().to(self.device),
                                  batch if batch.slots.device == self.device
                                  else batch.to(self.device))

    def reset(self) -> None:
        """Drop every sequence's state (the engine recovered the workers and recomputes
        what they held): the policy's selections and requests' own policies, the tiers'
        saved sessions (the engine forgot them), this step's checked metadata."""
        self._step = None
        self.set_sparsity(self._config)
        if self.tiers is not None:
            self.tiers = self.tiers.renewed()

    def set_sparsity(self, config: SparsityConfig | None) -> None:
        """Decode rows attend to what `config` selects from now on (None or dense: all);
        any earlier policy's state is dropped."""
        self._config = config
        self.sparsity = (Sparsifier(config, self.pool.config.num_layers)
                         if config is not None and config.enabled else None)

    def override(self, overrides) -> None:
        """Requests' own KV sparsity ({seq id: `KVOverride`}), resolved against this
        worker's config; a worker without a policy makes a dense one to hold them."""
        if not overrides:
            return
        if self.sparsity is None:
            self.sparsity = Sparsifier(self._config or SparsityConfig(),
                                       self.pool.config.num_layers)
        for sid, ov in overrides.items():
            self.sparsity.override(sid, ov)

    def release(self, seq_ids) -> None:
        """Sequences the engine dropped: their selection state goes too."""
        if self.sparsity is not None:
            self.sparsity.release(seq_ids)

    def take_dropped(self, seq_ids=None) -> dict:
        """After a step: seq id -> slots (NumPy int32) of keys its h2o / snapkv policy
        left out at every layer for good, each reported once (`Sparsifier.take_dropped`);
        of sequences `seq_ids` only where given (one compute replica's)."""
        return self.sparsity.take_dropped(seq_ids) if self.sparsity is not None else {}

    def apply_tiers(self, orders) -> None:
        """A step's tier orders (`lamina.memory.tiers`), before its layers; raises
        `TierMiss` for loads whose saved KV is gone."""
        if self.tiers is None:
            if any(o.op == "load" for o in orders):
                raise RuntimeError("tier orders for a memory worker without KV tiers")
            return
        self.tiers.apply(orders)

    def attend(self, layer: int, params: AttentionParams, q, k, v, new_slots, batch,
               checked: bool = False, seq_ids: tuple[int, ...] = ()):
        """q [n, Hq, D], k/v [m, Hkv, D] -> (o [n, Hq, Dv], lse [n, Hq] fp32) on q's device;
        writes k/v at new_slots [m] first (and a step's tier loads of this layer).
        `seq_ids`: each batch entry's sequence (the sparsity policies keep state by it)."""
        if self.tiers is not None:
            self.tiers.load_layer(layer)
        kp, vp = self.pool.layer(layer)
        st = self._step
        if checked and st is not None and st.new_slots is new_slots and st.batch is batch:
            new_slots, batch = st.write_index, st.on_device  # the same objects every layer
        elif batch.slots.device != self.device:
            new_slots, batch = new_slots.to(self.device), batch.to(self.device)
        home = q.device
        if home != self.device:
            q, k, v = (t.to(self.device, non_blocking=True) for t in (q, k, v))
        scales = self.pool.key_scales[layer]
        sp = self.sparsity if params.sliding_window < 0 and self.sparsity is not None \
            and self.sparsity.active else None
        # decode rows may attend to a selection of their slots (a subset of the checked
        # batch's: still in range); it reads keys written before this step
        sel = (sp.select(layer, q, batch, seq_ids, kp, scales, params.scale, params.softcap)
               if sp else None) or batch
        o, lse = prefill_attention(q, k, v, kp, vp, new_slots, sel, params, self.backend,
                                   checked, scales)
        if sp is not None:
            sp.observe(layer, q, lse, sel, seq_ids, kp, scales, params.scale, params.softcap)
        return (o, lse) if home == self.device else (o.to(home), lse.to(home))


def _blame(bad: list[int], batch: SlotBatch, seq_ids: tuple[int, ...], what: str) -> None:
    """Raise `SequenceFault` for batch entries `bad` when every entry's sequence is known
    (`seq_ids`, one per entry); else return and let the caller raise its own error."""
    if bad and len(seq_ids) == batch.num_requests:
        raise SequenceFault([seq_ids[b] for b in bad], what)


def bad_entries(batch: SlotBatch, num_slots: int) -> list[int]:
    """The batch entries whose own slots or query positions are out of range (the
    per-entry scan behind a failed `validate_batch`); [] when the fault is not any one
    entry's (offsets, dtypes)."""
    cu_q, cu_k = batch.cu_q.tolist(), batch.cu_k.tolist()
    if (len(cu_q) != len(cu_k) or cu_q[-1] != batch.num_queries
            or cu_k[-1] != batch.num_keys):
        return []
    bad = []
    for b in range(len(cu_q) - 1):
        sl, qp = batch.slots[cu_k[b]:cu_k[b + 1]], batch.q_pos[cu_q[b]:cu_q[b + 1]]
        if ((sl.numel() and (int(sl.min()) < 0 or int(sl.max()) >= num_slots))
                or (qp.numel() and int(qp.min()) < 0)):
            bad.append(b)
    return bad
