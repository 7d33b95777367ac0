"""The data-plane protocol between a compute side and its memory workers, both ends.

Compute end (`SocketLink`, a `MemoryLink`): data in is each layer's packed q/k/v from
`ComputeSide.run` and the step's `WorkerPart`s; data out is frames (`lamina.wire`) on
one channel per memory worker, and the attention outputs read back, put in row order.
Memory end (`MemoryServer`): data in is those frames; it writes k/v into its
`MemorySide`'s pool, attends, and sends the outputs back. Ray never carries any of it.

Per step, each worker with rows gets: META frames (layer -1): the micro-batch count,
then per micro-batch new_slots, cu_q, q_pos, slots, cu_k, k_pos0 (int32). Then per layer
and micro-batch, in the same order on both ends:
- one frame qkv [n, Hq*D + Hkv*D + Hkv*Dv] (each row: q | k | v) when the worker stores
  the k/v of exactly its query rows (n == m: every request placed on one worker), else
  three frames q [n, Hq, D], k [m, Hkv, D], v [m, Hkv, Dv] (m < n: some request's KV is
  split over workers, and its later rows' k/v live elsewhere);
- back: [n, Hq, Dv + 1], the output with each row's log-sum-exp as the last column.
One frame instead of three halves the memory worker's per-layer framing work, and
with each worker's rows contiguous in the packed order (`pack`) the compute side sends
a slice of one q|k|v buffer instead of gathering rows per worker.
"""
from __future__ import annotations

import queue
import threading
import traceback

import torch

from lamina.kernels import SlotBatch

from .executor import MemoryLink, MemorySide, combine
from .wire import FrameError, SocketChannel

META = -1  # layer tag of the per-step metadata frames
MAX_MICRO_BATCHES = 64


def fuse_qkv(q, k, v) -> torch.Tensor:
    """q [N, Hq, D], k [N, Hkv, D], v [N, Hkv, Dv] (any strides) -> [N, F] rows q|k|v."""
    n, hq, d = q.shape
    hkv, dv = k.shape[1], v.shape[2]
    out = torch.empty(n, hq * d + hkv * (d + dv), dtype=q.dtype)
    a, b = hq * d, hq * d + hkv * d
    out[:, :a].unflatten(1, (hq, d)).copy_(q)
    out[:, a:b].unflatten(1, (hkv, d)).copy_(k)
    out[:, b:].unflatten(1, (hkv, dv)).copy_(v)
    return out


def split_qkv(x: torch.Tensor, hkv: int, d: int, dv: int, what: str = "q|k|v frame"):
    """[n, F] -> views q [n, Hq, D], k [n, Hkv, D], v [n, Hkv, Dv]; Hq from F."""
    f = x.shape[1]
    hq_d = f - hkv * (d + dv)
    if hq_d <= 0 or hq_d % d or (hq_d // d) % hkv:
        raise FrameError(f"{what}: row width {f} is not Hq*D + Hkv*(D+Dv) with D={d}, "
                         f"Hkv={hkv}, Dv={dv} and Hq a multiple of Hkv")
    a, b = hq_d, hq_d + hkv * d
    return (x[:, :a].unflatten(1, (hq_d // d, d)), x[:, a:b].unflatten(1, (hkv, d)),
            x[:, b:].unflatten(1, (hkv, dv)))


class SocketLink(MemoryLink):
    """The compute end: frames to and from one channel per memory worker. `fused=False`
    sends q/k/v as three frames even where one would do (both are valid protocol)."""

    def __init__(self, channels: list[SocketChannel], fused: bool = True):
        self.channels, self.fused = channels, fused

    def begin(self, step, parts):
        self.step = step
        for w, ch in enumerate(self.channels):
            live = [p[w] for p in parts if p[w].rows.numel()]
            if not live:
                continue
            frames = [(torch.tensor([len(live)], dtype=torch.int32), META, step)]
            for p in live:
                b = p.batch
                frames += [(t, META, step) for t in (p.new_slots, b.cu_q, b.q_pos, b.slots,
                                                     b.cu_k, b.k_pos0)]
            ch.send_many(frames)

    def submit(self, layer, mb, q, k, v, parts):
        # Every worker's frames are staged before any is woken, then the wake-ups go out
        # back to back: a woken worker can take this process's core (measured: the next
        # worker's gather then waited ~1 ms), so nothing else may sit between them.
        staged, qkv = [], None
        for ch, p in zip(self.channels, parts):  # every worker first: they run in parallel
            if not p.rows.numel():
                continue
            if (self.fused and p.kv_rows.numel() == p.rows.numel()
                    and q.dtype == k.dtype == v.dtype):
                if qkv is None:
                    qkv = fuse_qkv(q, k, v)  # [N, F]
                ts = (p.take_rows(qkv),)
            else:
                ts = p.take(q, k, v)
            staged.append((ch, ch.stage([(t, layer, self.step) for t in ts])))
        for ch, views in staged:
            ch.flush(views)

    def collect(self, layer, mb, parts, out_shape, dtype, merge=False):
        n, hq, dv = out_shape
        outs = []
        for ch, p in zip(self.channels, parts):
            if not p.rows.numel():
                outs.append(None)
                continue
            ol = ch.recv(expect_layer=layer, expect_step=self.step,
                         expect_shape=(p.rows.numel(), hq, dv + 1))[0]  # o | lse
            outs.append((ol[..., :dv], ol[..., dv].float()))
        return combine(parts, outs, out_shape, dtype, merge)


class MemoryServer:
    """The memory end of one compute worker's channel: `serve` runs steps until the peer
    closes. A malformed frame or a failed step ends it with `error` set (the peer then
    sees the channel close and fails its step); `steps` counts completed steps."""

    def __init__(self, memory: MemorySide, params: list, ch: SocketChannel,
                 name: str = "memory worker"):
        self.memory, self.params, self.ch, self.name = memory, list(params), ch, name
        cfg = memory.pool.config
        self.kv_shape = (cfg.num_kv_heads, cfg.head_dim, cfg.v_head_dim)
        self.steps, self.error = 0, None
        # With micro-batches, outputs go out on their own thread so this one keeps
        # reading: the compute side sends the next one's q/k/v before it reads this
        # one's output. With one, the output goes out at once (no hand-off).
        self._out, self._lock = queue.SimpleQueue(), threading.Lock()

    def serve(self) -> None:
        threading.Thread(target=self._send_loop, daemon=True).start()
        try:
            while True:
                self.step()
                self.steps += 1
        except FrameError as e:
            if "header truncated: peer closed after 0" not in str(e):  # not a clean close
                self.error = f"{self.name}: {e}"
        except Exception:  # noqa: BLE001 - reported through `error`; the channel closes
            self.error = f"{self.name}: {traceback.format_exc()}"
        finally:
            self._out.put(None)

    def _send_loop(self):
        try:
            while (item := self._out.get()) is not None:
                with self._lock:
                    self.ch.send(*item)
        except OSError as e:
            self.error = self.error or f"{self.name}: send failed: {e}"
        finally:
            self.ch.close()

    def step(self) -> None:
        ch = self.ch
        count, _, step = ch.recv(expect_layer=META, expect_dtype=torch.int32,
                                 expect_shape=(1,))
        if not 1 <= int(count[0]) <= MAX_MICRO_BATCHES:
            raise FrameError(f"step {step}: {int(count[0])} micro-batches")
        mbs = []
        for _ in range(int(count[0])):
            new_slots, *fields = [ch.recv(expect_layer=META, expect_step=step,
                                          expect_dtype=torch.int32)[0] for _ in range(6)]
            batch = SlotBatch(*fields)
            try:  # index scans once per step; per layer only shapes are checked
                self.memory.check(new_slots, batch)
            except ValueError as e:
                raise FrameError(f"step {step}: bad slot metadata: {e}") from None
            mbs.append((new_slots, batch))
        for layer, params in enumerate(self.params):
            for new_slots, batch in mbs:
                q, k, v = self._recv_qkv(layer, step, batch.num_queries, new_slots.numel())
                o, lse = self.memory.attend(layer, params, q, k, v, new_slots, batch,
                                            checked=True)
                frame = (torch.cat([o, lse[..., None].to(o.dtype)], -1), layer, step)
                if len(mbs) == 1:  # the peer reads it before it sends more: no deadlock
                    with self._lock:
                        ch.send(*frame)
                else:
                    self._out.put(frame)

    def _recv_qkv(self, layer: int, step: int, n: int, m: int):
        """One layer's q [n, Hq, D], k/v [m, Hkv, D|Dv] for one micro-batch."""
        ch, where = self.ch, f"step {step} layer {layer}"
        x = ch.recv(expect_layer=layer, expect_step=step)[0]
        if x.dim() == 2:  # one q|k|v frame
            if n != m or x.shape[0] != n:
                raise FrameError(f"{where}: a q|k|v frame of {x.shape[0]} rows, expected "
                                 f"{n} query and {m} KV rows (one frame needs them equal)")
            return split_qkv(x, *self.kv_shape, what=f"{where} q|k|v frame")
        k = ch.recv(expect_layer=layer, expect_step=step)[0]
        v = ch.recv(expect_layer=layer, expect_step=step)[0]
        if x.shape[0] != n or k.shape[0] != m or v.shape[0] != m:
            raise FrameError(f"{where}: q/k/v rows {x.shape[0]}/{k.shape[0]}/{v.shape[0]}, "
                             f"expected {n}/{m}/{m}")
        return x, k, v
