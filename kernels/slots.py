"""Per-step attention metadata: which pool slots each request's queries attend to.

Data in: slot tables (lists of pool slot ids, in position order) from the KV allocator,
and how many of each request's last positions are queries this step. Data out: a
`SlotBatch` of flat int32 tensors (CSR form) that every attention backend reads.
Request b owns queries `cu_q[b]:cu_q[b+1]` and keys `slots[cu_k[b]:cu_k[b+1]]`; key j
sits at absolute position `k_pos0[b] + j`, query n at `q_pos[n]`.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import numpy as np
import torch


@dataclass(frozen=True)
class AttentionParams:
    """What the splitter's AttentionSpec says about one layer's softmax."""

    scale: float
    sliding_window: int = -1  # >0 keeps keys with q_pos - window < k_pos <= q_pos
    softcap: float = 0.0  # >0 maps s -> softcap * tanh(s / softcap)
    sinks: tuple[float, ...] | None = None  # [Hq] logits joining the denominator only

    def __post_init__(self):
        if not (isinstance(self.scale, (int, float)) and np.isfinite(self.scale)
                and self.scale > 0):
            raise ValueError(f"scale must be a positive finite number, got {self.scale!r}")
        if not isinstance(self.sliding_window, int) or self.sliding_window == 0 \
                or self.sliding_window < -1:
            raise ValueError(f"sliding_window must be -1 (none) or a positive int, "
                             f"got {self.sliding_window!r}")
        if not (np.isfinite(self.softcap) and self.softcap >= 0):
            raise ValueError(f"softcap must be >= 0 (0 = none), got {self.softcap!r}")
        if self.sinks is not None:
            object.__setattr__(self, "sinks", tuple(float(s) for s in self.sinks))
            if not all(np.isfinite(self.sinks)):
                raise ValueError("sinks must be finite")

    def sinks_tensor(self, device) -> torch.Tensor | None:
        if self.sinks is None:
            return None
        return torch.tensor(self.sinks, dtype=torch.float32, device=device)


class GrowingSlots:
    """One slot table (a sequence's, or its KV range's) in an int32 buffer that doubles,
    so a decode step's one new slot is O(1) and the table is read as a view."""

    __slots__ = ("buf", "n")

    def __init__(self) -> None:
        self.buf, self.n = np.empty(16, np.int32), 0

    def view(self) -> np.ndarray:
        return self.buf[:self.n]

    def cut_and_extend(self, keep: int, new: np.ndarray) -> None:
        """The first `keep` slots, then `new`."""
        end = keep + len(new)
        if end > len(self.buf):
            grown = np.empty(max(end, 2 * len(self.buf)), np.int32)
            grown[:keep] = self.buf[:keep]
            self.buf = grown
        self.buf[keep:end] = new
        self.n = end


def _i32(x) -> torch.Tensor:
    return torch.as_tensor(np.ascontiguousarray(x, dtype=np.int32))


@dataclass(frozen=True)
class SlotBatch:
    cu_q: torch.Tensor  # [B+1] int32
    q_pos: torch.Tensor  # [Nq] int32
    slots: torch.Tensor  # [Nk] int32
    cu_k: torch.Tensor  # [B+1] int32
    k_pos0: torch.Tensor  # [B] int32

    @property
    def num_requests(self) -> int:
        return int(self.cu_q.numel()) - 1

    @property
    def num_queries(self) -> int:
        return int(self.q_pos.numel())

    @property
    def num_keys(self) -> int:
        return int(self.slots.numel())

    @cached_property
    def most_queries(self) -> int:
        """The most queries one request has (once per batch: its layers share it)."""
        return int(torch.diff(self.cu_q).max()) if self.num_requests > 0 else 0

    def to(self, device) -> "SlotBatch":
        return SlotBatch(*(t.to(device) for t in (self.cu_q, self.q_pos, self.slots,
                                                  self.cu_k, self.k_pos0)))

    def only(self, requests: Sequence[int]) -> tuple["SlotBatch", torch.Tensor]:
        """The batch of just these requests (in this order) -> (it, the rows of the
        queries it keeps [n] int64)."""
        cu_q, cu_k = self.cu_q.tolist(), self.cu_k.tolist()
        rows = torch.cat([torch.arange(cu_q[b], cu_q[b + 1]) for b in requests])
        keys = torch.cat([torch.arange(cu_k[b], cu_k[b + 1]) for b in requests])
        nq = [cu_q[b + 1] - cu_q[b] for b in requests]
        nk = [cu_k[b + 1] - cu_k[b] for b in requests]
        sub = SlotBatch(_i32(np.concatenate([[0], np.cumsum(nq)])), self.q_pos[rows],
                        self.slots[keys], _i32(np.concatenate([[0], np.cumsum(nk)])),
                        self.k_pos0[torch.tensor(requests, dtype=torch.int64)])
        return sub, rows

    @staticmethod
    def build(tables: Sequence[Sequence[int]], num_queries: Sequence[int],
              start: Sequence[int] | None = None,
              q_pos: Sequence[Sequence[int]] | None = None) -> "SlotBatch":
        """Queries are the last `num_queries[b]` positions of request b's table, or the
        positions `q_pos[b]` when given (a KV range whose queries lie past its end)."""
        if len(num_queries) != len(tables):
            raise ValueError(f"{len(tables)} slot tables but {len(num_queries)} query counts")
        lens = np.array([len(t) for t in tables], dtype=np.int64)
        nq = np.asarray(num_queries, dtype=np.int64)
        if q_pos is not None:
            if len(q_pos) != len(tables) or any(len(x) != n for x, n in zip(q_pos, nq)):
                raise ValueError("q_pos must give num_queries[b] positions per request")
        elif np.any(nq < 0) or np.any(nq > lens):
            bad = int(np.argmax((nq < 0) | (nq > lens)))
            raise ValueError(f"request {bad}: {int(nq[bad])} queries but only "
                             f"{int(lens[bad])} slots")
        pos0 = np.zeros(len(tables), np.int64) if start is None else np.asarray(start, np.int64)
        if pos0.shape != lens.shape or np.any(pos0 < 0):
            raise ValueError("start positions must be one non-negative int per request")
        # int32 tables (views of kept ones) concatenate without a conversion
        flat = np.concatenate([np.asarray(t, np.int32) for t in tables]) if len(tables) \
            else np.zeros(0, np.int32)
        cu_k = np.concatenate([[0], np.cumsum(lens)])
        cu_q = np.concatenate([[0], np.cumsum(nq)])
        if q_pos is not None:
            qp = np.fromiter((p for x in q_pos for p in x), np.int64, int(cu_q[-1]))
        else:  # last nq[b] positions of request b
            req = np.repeat(np.arange(len(tables)), nq)
            qp = (pos0 + lens - nq)[req] + (np.arange(cu_q[-1]) - cu_q[:-1][req])
        return SlotBatch(_i32(cu_q), _i32(qp), _i32(flat), _i32(cu_k), _i32(pos0))

    @staticmethod
    def decode(tables: Sequence[Sequence[int]], start: Sequence[int] | None = None):
        """One query per request: the last position of its table."""
        return SlotBatch.build(tables, [1] * len(tables), start)
