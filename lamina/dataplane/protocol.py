"""The data-plane protocol between a compute side and its memory workers, both ends.

Compute end (`SocketLink`, a `MemoryLink`): data in is each layer's packed q/k/v from
`ComputeSide.run` and the step's `WorkerPart`s; data out is frames (`lamina.dataplane.transport`) on
one channel per memory worker, and the attention outputs read back, put in row order.
Memory end (`MemoryServer`): data in is those frames; it writes k/v into its
`MemorySide`'s pool, attends, and sends the outputs back. Ray never carries any of it.

Per step, each worker with rows gets: META frames (layer -1): the micro-batch count
(followed, optionally, by the sequence id of every batch entry of every micro-batch, so
the memory end can name a bad sequence and hold its slot table: -1 where unknown), the
sequences released since (their held tables dropped; a worker with no rows in a step
gets only these, after a count of 0), then, when the count carries `TIERS_FLAG`, the
step's KV tier orders for this worker (`lamina.memory.tier_orders.encode_orders`; carried
out before the layers), then, when it carries `OVERRIDES_FLAG`, the KV sparsity of
requests that chose their own and that this worker does not hold yet (rows of
`KVOverride.encode`), then per micro-batch new_slots,
cu_q, q_pos, keep, tail, cu_k, k_pos0 (int32): the batch's `SlotBatch` with its slots
as a diff against the tables the memory end holds (`lamina.dataplane.tables`: per entry
`keep` slots it has, then the `tail`), so a decode step's metadata is O(batch), not
O(batch x context). Then per layer and micro-batch, in the same order on both ends:
- one frame qkv [n, Hq*D + Hkv*D + Hkv*Dv] (each row: q | k | v) when the worker stores
  the k/v of exactly its query rows (n == m: every request placed on one worker), else
  three frames q [n, Hq, D], k [m, Hkv, D], v [m, Hkv, Dv] (m < n: some request's KV is
  split over workers, and its later rows' k/v live elsewhere);
- back: [n, Hq, Dv + 1], the output with each row's log-sum-exp as the last column.
When the count carries a stream width c > 1 (`STREAM_SHIFT`; paper 5.2's
communication-attention overlap), every micro-batch whose worker stores the k/v of
exactly its query rows goes as c q|k|v frames a layer instead of one, its requests cut
into c contiguous groups of about equal rows (`stream_cuts`, computed alike on both
ends), each answered by its own output frame: the memory end attends a group as soon
as it has arrived, while the next is in flight, and its output goes back while the
next group is attended. A request is never cut, and each row attends over all its
keys in one call, so the outputs are exactly the unstreamed ones (no merge needed).
When the count carries `RING_FLAG` (rotational pipelining over R compute workers, each
on its own connection; paper 5.1), a frame [R, j_0, j_1, ...] follows the overrides:
the step index of each of the worker's micro-batches. Layer l of micro-batch j then
comes from replica (l + j) mod R, on that replica's connection only, and its output
goes to the next replica, (l + j + 1) mod R, which runs slice l + 1: the memory end
sends it on that replica's connection (`MemoryServer.route`), so each connection still
carries its frames in one fixed order.
After the last layer, when the count carries `DROPPED_FLAG`, one more frame back
(layer `DROPPED`): the keys its h2o / snapkv sequences left out at every layer for good
(`encode_dropped`), whose slots the engine then gives back.
One frame instead of three halves the memory worker's per-layer framing work, and
with each worker's rows contiguous in the packed order (`pack`) the compute side sends
a slice of one q|k|v buffer instead of gathering rows per worker.
"""
from __future__ import annotations

import bisect
import contextlib
import queue
import threading
import time
import traceback
import weakref
from dataclasses import dataclass

import torch

from lamina.compute.memory_link import MemoryLink, combine
from lamina.compute.packing import WorkerPart
from lamina.dataplane.paths import (
    ComputePaths,
    bytes_channels,
    memory_native,
    prompts_in_python,
    worker_spans,
)
from lamina.dataplane.tables import HeldTables, SentTables, TableError
from lamina.dataplane.transport import Channel, FrameError, PeerTimeout, SocketChannel
from lamina.engine.messages import DroppedKeys
from lamina.errors import SequenceFault
from lamina.kernels import SlotBatch
from lamina.memory.memory_side import MemorySide
from lamina.memory.sparsity_config import KVOverride
from lamina.memory.tier_orders import TierMiss, decode_orders, encode_orders
from lamina.trace import Tracer

META = -1  # layer tag of the per-step metadata frames
MAX_MICRO_BATCHES = 64
TIERS_FLAG = 1 << 16  # in the micro-batch count: a frame of KV tier orders follows
# in the micro-batch count: a frame of requests' own KV sparsity follows (after the tier
# orders, if any): int32 rows of `KVOverride.encode`, each sent once a connection
OVERRIDES_FLAG = 1 << 17
# in the micro-batch count: after the step's last layer, send one DROPPED frame: the
# keys h2o / snapkv left out at every layer for good (`encode_dropped`)
DROPPED_FLAG = 1 << 18
# in the micro-batch count: a ring frame follows (rotational over compute workers)
RING_FLAG = 1 << 19
# in the micro-batch count: bits 20..23 hold the stream width minus one (module docstring)
STREAM_SHIFT, MAX_STREAM = 20, 16
FLAGS = (TIERS_FLAG | OVERRIDES_FLAG | DROPPED_FLAG | RING_FLAG
         | ((MAX_STREAM - 1) << STREAM_SHIFT))
DROPPED = -2  # layer tag of that frame
# What each connection's memory end holds, kept with the connection: a `SocketLink`
# lives one step (the Ray compute worker makes one per step); a new channel starts empty.
_SENT: weakref.WeakKeyDictionary[SocketChannel, SentTables] = weakref.WeakKeyDictionary()


def sent_tables(ch: SocketChannel) -> SentTables:
    t = _SENT.get(ch)
    if t is None:
        t = _SENT[ch] = SentTables()
    return t


def fuse_qkv(q, k, v) -> torch.Tensor:
    """q [N, Hq, D], k [N, Hkv, D], v [N, Hkv, Dv] (any strides) -> [N, F] rows q|k|v."""
    n, hq, d = q.shape
    hkv, dv = k.shape[1], v.shape[2]
    out = torch.empty(n, hq * d + hkv * (d + dv), dtype=q.dtype, device=q.device)
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


def _ring_struct(ext, r):
    """A ring (or None) as the native ends' `RingArgs`."""
    a = ext.RingArgs()
    if r:
        a.data, a.ctrl, a.pos = r.data, r.ctrl, r.pos
    return a


def _peers(ext, channels: list[SocketChannel]):
    """The native compute end's `Peers` for these channels (set once a step)."""
    p = ext.Peers()
    p.fds = [ch.sock.fileno() for ch in channels]
    p.timeouts_ms = [ch.timeout_ms() for ch in channels]
    p.ring_out = [_ring_struct(ext, ch.ring_out) for ch in channels]
    p.ring_in = [_ring_struct(ext, ch.ring_in) for ch in channels]
    p.ring_min_bytes = next((ch.ring_out.min_bytes for ch in channels if ch.ring_out), 0)
    return p


def _native_call(fn, peers, channels: list[SocketChannel], *args):
    """A native compute-end call with the rings' cursors handed in and taken back (the
    Python end may have moved them in between); a failure raises as the Python end
    would."""
    outs, ins = peers.ring_out, peers.ring_in  # views of the C++ entries
    for ch, o, i in zip(channels, outs, ins):
        o.pos = ch.ring_out.pos if ch.ring_out else 0
        i.pos = ch.ring_in.pos if ch.ring_in else 0
    r = fn(peers, *args)
    for ch, o, i in zip(channels, outs, ins):
        if ch.ring_out:
            ch.ring_out.pos = o.pos
        if ch.ring_in:
            ch.ring_in.pos = i.pos
    if r.status:
        _raise(r.status, r.message)
    return r


def _raise(status: int, msg: str) -> None:
    raise (FrameError, PeerTimeout, RuntimeError)[status - 1](msg)


def encode_dropped(dropped: dict) -> torch.Tensor:
    """{seq id: slots} -> the DROPPED frame: int32 rows of (seq id, count, slots...)."""
    flat: list[int] = []
    for sid, slots in sorted(dropped.items()):
        flat += [int(sid), len(slots), *(int(x) for x in slots)]
    return torch.tensor(flat, dtype=torch.int32)


def decode_dropped(frame: torch.Tensor, worker: int) -> list[DroppedKeys]:
    """The DROPPED frame of `worker` -> its `DroppedKeys`; FrameError if malformed."""
    flat, out, at = frame.tolist(), [], 0
    while at < len(flat):
        if at + 2 > len(flat) or flat[at + 1] < 0 or at + 2 + flat[at + 1] > len(flat):
            raise FrameError(f"memory worker {worker}: bad dropped-keys frame at {at}")
        sid, n = flat[at], flat[at + 1]
        out.append(DroppedKeys(sid, worker, tuple(flat[at + 2:at + 2 + n])))
        at += 2 + n
    return out


def stream_cuts(cu_q: torch.Tensor, width: int) -> list[tuple[int, int]]:
    """A micro-batch's requests (query offsets `cu_q` [B+1]) as <= `width` contiguous
    groups of about equal query rows -> [(first request, past the last)], none empty;
    both ends of a streamed step compute it from the same `cu_q`."""
    cu = cu_q.tolist()
    b_n, n = len(cu) - 1, cu[-1]
    cuts = [0]
    for c in range(1, width):
        r = bisect.bisect_left(cu, -(-n * c // width))  # first request at or past it
        if cuts[-1] < r < b_n:
            cuts.append(r)
    return list(zip(cuts, cuts[1:] + [b_n])) if b_n else []


def sub_batch(b: SlotBatch, first: int, end: int) -> SlotBatch:
    """Requests first..end-1 of `b` as a batch of their own (offsets rebased)."""
    q0, q1, k0, k1 = (int(x) for x in (b.cu_q[first], b.cu_q[end], b.cu_k[first],
                                       b.cu_k[end]))
    return SlotBatch(b.cu_q[first:end + 1] - q0, b.q_pos[q0:q1], b.slots[k0:k1],
                     b.cu_k[first:end + 1] - k0, b.k_pos0[first:end])


def streamed(batch: SlotBatch, new_rows: int, width: int) -> list[tuple[int, int]] | None:
    """A micro-batch's groups when it is streamed (`stream_cuts`), else None: streamed
    where the width is > 1 and the worker stores the k/v of exactly its query rows
    (one q|k|v frame a group)."""
    if width > 1 and new_rows == batch.num_queries and batch.num_requests:
        return stream_cuts(batch.cu_q, width)
    return None


def step_meta(live: list[WorkerPart], held: SentTables, tiers: bool = False,
              overrides: bool = False, dropped: bool = False,
              stream: int = 1, ring: bool = False) -> list[torch.Tensor]:
    """One memory worker's META frames of a step (see the module docstring): its parts
    in the step's micro-batches, slots as diffs against what `held` says it holds;
    `tiers` / `overrides` / `ring`: a tier-order / an override / a ring frame will
    follow the released one (flagged in the count); `dropped`: it is to send a DROPPED
    frame after the step."""
    ids = [i if 0 <= i < 2 ** 31 else -1 for p in live for i in p.seq_ids]
    if len(ids) != sum(p.batch.num_requests for p in live):
        ids = []  # parts built without sequence ids (probes)
    flags = ((TIERS_FLAG if tiers else 0) | (OVERRIDES_FLAG if overrides else 0)
             | (DROPPED_FLAG if dropped else 0) | (RING_FLAG if ring else 0)
             | ((stream - 1) << STREAM_SHIFT))
    frames = [torch.tensor([len(live) | flags, *ids], dtype=torch.int32),
              torch.tensor(held.take_released(), dtype=torch.int32)]
    at = 0
    for p in live:
        b, n = p.batch, p.batch.num_requests
        keep, tail = held.diff(ids[at:at + n] if ids else (), b.slots, b.cu_k, b.k_pos0,
                               p.unchanged)
        at += n
        frames += [p.new_slots, b.cu_q, b.q_pos, keep, tail, b.cu_k, b.k_pos0]
    return frames


class SocketLink(MemoryLink):
    """The compute end: frames to and from one channel per memory worker. Which path
    each layer takes (C++ or Python, one frame or three) is `lamina.dataplane.paths`'
    choice; `native` and `one_frame` only allow or forbid paths."""

    def __init__(self, channels: list[Channel], one_frame: bool = True,
                 native: bool = True, stream: int = 1, ring: int = 0):
        """`ring` = R > 1: this compute worker is one of R replicas of a rotational
        ring (module docstring); its steps are not streamed and report no dropped keys."""
        self.channels, self.ring = channels, ring
        if ring:
            stream = 1
        if not 1 <= stream <= MAX_STREAM:
            raise ValueError(f"stream width must be 1..{MAX_STREAM}, got {stream}")
        # streamed steps send q|k|v groups, one frame each
        self.stream = stream if one_frame else 1
        native = native and bytes_channels(*channels)
        # where q/k/v go out from: a GPU when every worker's path takes them from there
        # (NCCL), else the host (`MemoryLink.device`)
        devices = {getattr(getattr(ch, "peer", None), "device", None) for ch in channels}
        if len(devices) == 1 and None not in devices:
            self.device = devices.pop()
        self.paths = ComputePaths.choose(native, one_frame)
        self._ext = self.paths.ext
        self.exchanges = 0  # layers sent and collected in one C++ call (`exchange`)

    def begin(self, step, parts, released=(), tier_orders=(), overrides=None,
              report_dropped=False):
        self.step = step
        self._report: list[int] = []  # the workers that send a DROPPED frame
        # per micro-batch and worker: its stream groups, or None (one frame). A step
        # with requests that chose their own KV sparsity is not streamed (their policies
        # select keys per layer over the whole batch).
        width = 1 if overrides else self.stream
        self._cuts = [[streamed(p.batch, p.new_slots.numel(), width) if p.active
                       else None for p in mb] for mb in parts]
        if self._ext:  # what the C++ ends need every layer, once a step
            self._peers = _peers(self._ext, self.channels)
            self._spans = [worker_spans(p) for p in parts]
            self._rows = [self._layer_rows(sp, mb, cuts, step)
                          for sp, mb, cuts in zip(self._spans, parts, self._cuts)]
        if self.ring and report_dropped:
            raise ValueError("a rotational ring's memory workers cannot report dropped keys "
                             "(the executor asks for none)")
        for w, ch in enumerate(self.channels):
            held = sent_tables(ch)
            held.release(released)
            live = [p[w] for p in parts if p[w].active]
            tiers = encode_orders(o for o in tier_orders if o.worker == w)
            own = held.new_overrides(overrides or {}, [i for p in live for i in p.seq_ids])
            if live:
                frames = step_meta(live, held, bool(tiers), bool(own), report_dropped,
                                   width, bool(self.ring))
                if self.ring:  # R and each live part's micro-batch (tier orders and
                    # overrides go in before it, below)
                    js = [j for j, p in enumerate(parts) if p[w].active]
                    frames.insert(2, torch.tensor([self.ring, *js], dtype=torch.int32))
                if report_dropped:
                    self._report.append(w)
            elif held.pending or tiers:  # no rows: what to drop, tier orders (count 0)
                frames = [torch.tensor([TIERS_FLAG if tiers else 0], dtype=torch.int32),
                          torch.tensor(held.take_released(), dtype=torch.int32)]
            else:
                continue
            if tiers:  # after the released frame
                frames.insert(2, torch.tensor(tiers, dtype=torch.int32))
            if own and live:  # after those
                frames.insert(2 + bool(tiers), torch.tensor(own, dtype=torch.int32))
            ch.send_many([(t, META, step) for t in frames])

    def _layer_rows(self, spans, parts, cuts, step: int):
        """The native `LayerRows` of a micro-batch whose workers' rows are slices: a
        frame per worker, or per stream group (group g in round g, as
        `_submit_streamed` sends them)."""
        if spans is None:
            return None
        frames = []  # (round, worker, first row, past the last)
        for w, (a, e, p, cut) in enumerate(zip(*spans, parts, cuts)):
            if cut is None:
                frames.append((0, w, a, e))
                continue
            cu = p.batch.cu_q.tolist()
            frames += [(g, w, a + cu[f], a + cu[t]) for g, (f, t) in enumerate(cut)]
        frames.sort(key=lambda x: x[:2])
        r = self._ext.LayerRows()
        r.rounds, r.workers, r.starts, r.ends = (list(c) for c in zip(*frames))
        r.step = step
        return r

    def _send_spans(self, mb, q, k, v):
        """(starts, ends) when a layer's q/k/v go out through C++, else None."""
        spans = self._spans[mb] if self._ext else None
        return spans if self.paths.send_native(spans, q, k, v) else None

    def _recv_spans(self, mb, merge):
        """(starts, ends) when a layer's outputs come back through C++, else None."""
        spans = self._spans[mb] if self._ext else None
        buffered = spans is not None and any(ch.buffered() for ch in self.channels)
        return spans if self.paths.recv_native(spans, merge, buffered) else None

    def submit(self, layer, mb, q, k, v, parts):
        if self._send_spans(mb, q, k, v):
            rows = self._rows[mb]
            rows.layer = layer
            _native_call(self._ext.submit_qkv, self._peers, self.channels, rows, q, k, v)
            return
        if any(self._cuts[mb]):
            self._submit_streamed(layer, mb, q, k, v, parts)
            return
        # Every worker's frames are staged before any is woken, then the wake-ups go out
        # back to back: a woken worker can take this process's core (measured: the next
        # worker's gather then waited ~1 ms), so nothing else may sit between them.
        staged, qkv = [], None
        for ch, p in zip(self.channels, parts):  # every worker first: they run in parallel
            if not p.active:
                continue
            if self.paths.send_one_frame(p, q, k, v):
                if qkv is None:
                    qkv = fuse_qkv(q, k, v)  # [N, F]
                ts = (p.take_rows(qkv),)
            else:
                ts = p.take(q, k, v)
            staged.append((ch, ch.stage([(t, layer, self.step) for t in ts])))
        for ch, views in staged:
            ch.flush(views)

    def _submit_streamed(self, layer, mb, q, k, v, parts):
        """q|k|v group by group (`stream_cuts`): round g sends every streamed worker's
        g-th group (staged first, woken back to back), so a worker attends group g while
        g + 1 is on its way; unstreamed workers get their frames in round 0."""
        qkv = fuse_qkv(q, k, v)  # [N, F]
        cuts = self._cuts[mb]
        rows = [p.take_rows(qkv) if c else None for p, c in zip(parts, cuts)]  # [n_w, F]
        for g in range(max(len(c) for c in cuts if c)):
            staged = []
            for ch, p, cut, x in zip(self.channels, parts, cuts, rows):
                if not p.active or (cut is None and g) or (cut is not None and g >= len(cut)):
                    continue
                if cut is None:  # unstreamed (KV split): its frames, in round 0
                    ts = ((p.take_rows(qkv),) if self.paths.send_one_frame(p, q, k, v)
                          else p.take(q, k, v))
                else:
                    cu = p.batch.cu_q
                    ts = (x[int(cu[cut[g][0]]):int(cu[cut[g][1]])],)
                # a full ring is not waited for: the memory end may be sending an
                # output before it reads on
                staged.append((ch, ch.stage([(t, layer, self.step) for t in ts], wait=False)))
            for ch, views in staged:
                ch.flush(views)

    def exchange(self, layer, mb, q, k, v, parts, out_shape, dtype, merge=False):
        """`submit` then `collect` as one C++ call where both would take the C++ path;
        -> (o, seconds spent sending), or None (then the caller submits and collects)."""
        if not (self._send_spans(mb, q, k, v) and self._recv_spans(mb, merge)):
            return None
        rows = self._rows[mb]
        rows.layer = layer
        o = torch.empty(*out_shape, dtype=dtype)
        r = _native_call(self._ext.exchange_qkv, self._peers, self.channels, rows, q, k, v, o)
        self.exchanges += 1
        return o, r.sent_s

    def collect(self, layer, mb, parts, out_shape, dtype, merge=False):
        n, hq, dv = out_shape
        if self._recv_spans(mb, merge):
            rows = self._rows[mb]
            rows.layer = layer
            o = torch.empty(n, hq, dv, dtype=dtype)
            _native_call(self._ext.collect_o, self._peers, self.channels, rows, o)
            return o
        outs = []
        for ch, p, cut in zip(self.channels, parts, self._cuts[mb]):
            if not p.active:
                outs.append(None)
                continue
            sizes = ([p.rows.numel()] if cut is None else
                     [int(p.batch.cu_q[e] - p.batch.cu_q[a]) for a, e in cut])
            ol = [ch.recv(expect_layer=layer, expect_step=self.step,
                          expect_shape=(n_g, hq, dv + 1))[0] for n_g in sizes]  # o | lse
            ol = ol[0] if len(ol) == 1 else torch.cat(ol)
            outs.append((ol[..., :dv], ol[..., dv].float()))
        return combine(parts, outs, out_shape, dtype, merge)


    def dropped(self) -> tuple[DroppedKeys, ...]:
        out: list[DroppedKeys] = []
        for w in self._report:
            frame = self.channels[w].recv(expect_layer=DROPPED, expect_step=self.step,
                                          expect_dtype=torch.int32)[0]
            out += decode_dropped(frame, w)
        return tuple(out)


@dataclass(frozen=True)
class _StepHead:
    """What a step's first frames say (`MemoryServer._step_head`)."""
    step: int
    count: int  # micro-batches (0: a release-only step)
    ids: list[int]  # every micro-batch's sequences, in order
    width: int  # stream groups of each micro-batch
    report: bool  # send the sparsity policies' dropped keys after the outputs
    order: tuple[int, list[int]] | None  # a ring step's (R, micro-batch indices)


@dataclass(frozen=True)
class _MicroBatch:
    """One micro-batch of a step on the memory end, its metadata checked."""
    new_slots: torch.Tensor  # [m] int32: where this step's k/v rows go
    batch: SlotBatch
    seqs: tuple[int, ...]  # each batch entry's sequence


ROUTE_WAIT_S = 30.0  # how long a ring step's output waits for its connection to be served


class Routes:
    """A memory worker's connections by compute replica, for a ring step's outputs
    (`MemoryServer.route`: replica r's output goes out on replica r + 1's connection),
    and the one failure that ends them all.

    A connection is here once its serving thread has accepted it, which can be after
    its compute worker connected and sent a step on another connection (a recovery
    reconnects every link, then steps at once; on a busy machine the accepting thread
    may not have run yet). So an output for a replica not here yet waits for it, up to
    `wait_s`, rather than failing the step; `close` (the worker's reset) ends the wait.

    Once a connection's step fails (`fail`), every other connection fails with it, those
    accepted later too (`add` refuses them): in a ring one step spans every connection,
    and a compute worker waiting on a sound connection for an output the failed one was
    to route to it would otherwise wait out its timeout while its peer waits on it (120 s
    seen). A recovery follows any failed step and resets the worker (a new `Routes`)."""

    def __init__(self, worker: int = 0, wait_s: float = ROUTE_WAIT_S):
        self.worker, self.wait_s = worker, wait_s
        self._servers: dict[int, MemoryServer] = {}
        self._changed = threading.Condition()
        self._closed = False
        self.failure: str | None = None  # the first failed step's error

    def add(self, replica: int, server: MemoryServer) -> bool:
        """Register `server`; False when a step of this worker failed already (the
        caller closes its channel unserved)."""
        with self._changed:
            if self.failure is not None:
                return False
            self._servers[replica] = server
            self._changed.notify_all()
            return True

    def servers(self) -> list[MemoryServer]:
        with self._changed:
            return list(self._servers.values())

    def send(self, replica: int, frame) -> None:
        """`frame` out on replica `replica`'s connection (after those queued there)."""
        with self._changed:
            self._changed.wait_for(lambda: replica in self._servers or self._closed,
                                   timeout=self.wait_s)
            server = self._servers.get(replica)
        if server is None:
            why = ("a step on another of its connections failed" if self.failure else
                   "its connections were closed" if self._closed else
                   f"it was not connected within {self.wait_s:g} s")
            raise RuntimeError(f"memory worker {self.worker}: no connection to compute "
                               f"worker {replica} to send a ring step's output on ({why})")
        server.send_queued(frame)

    def fail(self, server: MemoryServer, error: str) -> list[MemoryServer]:
        """`server`'s step failed with `error` -> the other connections, to shut down
        (every later one is refused, every waiting `send` fails)."""
        with self._changed:
            self.failure = self.failure or error
            self._closed = True
            self._changed.notify_all()
            return [s for s in self._servers.values() if s is not server]

    def close(self) -> None:
        """No more connections (a reset): every waiting `send` fails now."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()


class MemoryServer:
    """The memory end of one compute worker's channel: `serve` runs steps until the peer
    closes. A malformed frame or a failed step ends it with `error` set (the peer then
    sees the channel close and fails its step); `steps` counts completed steps."""

    def __init__(self, memory: MemorySide, params: list, ch: Channel,
                 name: str = "memory worker", native: bool = True,
                 tracer: Tracer | None = None, shared: threading.Lock | None = None,
                 index: int = 0, route=None):
        """`shared`: the lock of a `MemorySide` that several servers (one per compute
        replica) share; each of its calls takes it, so the device does one attention at
        a time, and a step's layers run in Python (a C++ step would hold the side for
        the whole step, and two replicas whose sequences span two workers could then
        wait on each other for good). `index`: this connection's replica; `route(r,
        frame)`: sends a frame on replica r's connection (a ring step's outputs go to
        the next replica, module docstring)."""
        self.memory, self.params, self.ch, self.name = memory, list(params), ch, name
        self.index, self.route = index, route
        self.shared = shared is not None
        self._mem = shared if shared is not None else contextlib.nullcontext()
        # this worker's timeline (`lamina.trace`): attention per layer and micro-batch
        # (the C++ step loop returns each layer's times)
        self.tracer = tracer or Tracer("memory0")
        # its output sender's lane ("send0": outputs going back while it attends)
        self.send_tracer = Tracer(self.tracer.lane.replace("memory", "send"))
        cfg = memory.pool.config
        self.kv_shape = (cfg.num_kv_heads, cfg.head_dim, cfg.v_head_dim)
        self.steps, self.native_steps, self.error = 0, 0, None
        self.tables = HeldTables()  # this connection's slot tables, kept across steps
        self.bad_seqs: tuple[int, ...] = ()  # the sequences a failed step was blamed on
        # Steps of one micro-batch run their layers in C++ (`serve_step`, GIL released)
        # where `paths.memory_native` allows; else this file's Python loop does.
        self._native = memory_native(memory, native and shared is None
                                     and bytes_channels(ch))
        if self._native is not None:
            self._layers = self._native.MemoryLayers()
            pools = [memory.pool.layer(i) for i in range(len(self.params))]
            self._layers.k_pools = [k for k, _ in pools]
            self._layers.v_pools = [v for _, v in pools]
            self._layers.scales = [p.scale for p in self.params]
            self._layers.windows = [p.sliding_window for p in self.params]
            self._layers.softcaps = [p.softcap for p in self.params]
            self._layers.sinks = [p.sinks_tensor("cpu") for p in self.params]
            self._layers.key_scales = list(memory.pool.key_scales[:len(self.params)])
        # With micro-batches, outputs go out on their own thread so this one keeps
        # reading: the compute side sends the next one's q/k/v before it reads this
        # one's output. With one, the output goes out at once (no hand-off).
        self._out, self._lock = queue.SimpleQueue(), threading.Lock()
        # ends after `serve` does, once the outputs queued before are sent (or failed)
        self.send_thread = threading.Thread(target=self._send_loop, daemon=True)

    def serve(self) -> None:
        self.send_thread.start()
        try:
            while True:
                if self.step():
                    self.steps += 1
        except FrameError as e:
            if "header truncated: peer closed after 0" not in str(e):  # not a clean close
                self.error = f"{self.name}: {e}"
        except SequenceFault as e:  # the channel closes; the engine fails these alone
            self.bad_seqs, self.error = e.seq_ids, f"{self.name}: {e}"
        except Exception:  # noqa: BLE001 - reported through `error`; the channel closes
            self.error = f"{self.name}: {traceback.format_exc()}"
        finally:
            self._out.put(None)

    def _send_loop(self):
        try:
            while (item := self._out.get()) is not None:
                t = time.perf_counter()
                with self._lock:
                    self.ch.send(*item)
                self.send_tracer.record("send", item[1], t, step=item[2])
        except (OSError, FrameError) as e:  # a gone peer (a collective path's: FrameError)
            self.error = self.error or f"{self.name}: send failed: {e}"
        finally:
            self.ch.close()

    def step(self) -> bool:
        """One step's frames; -> False for a release-only one (a micro-batch count of 0:
        no rows this step, only sequences whose tables to drop)."""
        head = self._step_head()
        step = head.step
        if head.count == 0:
            return False
        mbs = self._micro_batches(step, head.count, head.ids)
        loading = self.memory.tiers is not None and self.memory.tiers.loading
        sparse = self.memory.sparsity is not None and self.memory.sparsity.active
        if (self._native is not None and len(mbs) == 1 and not loading and not sparse
                and not head.report and head.order is None
                and not prompts_in_python(self.memory, mbs[0].batch)):
            self._serve_native(step, mbs[0].new_slots, mbs[0].batch, head.width)
            return True  # (a step with tier loads copies them layer by layer, below)
        queued = len(mbs) + (head.width > 1)  # outputs go out on the send thread
        self._serve_layers(step, mbs, head.width, head.order, queued)
        if head.report:  # after the outputs, in order; a shared side: this connection's only
            mine = [s for m in mbs for s in m.seqs] if self.shared else None
            with self._mem:
                got = self.memory.take_dropped(mine)
            self._send((encode_dropped(got), DROPPED, step), queued)
        return True

    def _step_head(self) -> _StepHead:
        """A step's first frames: its micro-batch count and flags, the sequences it
        releases (dropped at once), its tier orders, KV overrides and ring frame."""
        ch = self.ch
        head, _, step = ch.recv(expect_layer=META, expect_dtype=torch.int32)
        count = int(head[0]) if head.dim() == 1 and head.numel() else -1
        tiers, own, report, ring = (count > 0 and bool(count & f) for f in
                                    (TIERS_FLAG, OVERRIDES_FLAG, DROPPED_FLAG, RING_FLAG))
        width = ((count >> STREAM_SHIFT) & (MAX_STREAM - 1)) + 1 if count > 0 else 1
        count = count & ~FLAGS
        if not 0 <= count <= MAX_MICRO_BATCHES or (count == 0 and head.numel() > 1):
            raise FrameError(f"step {step}: bad micro-batch count frame {head.tolist()[:4]}")
        self.tracer.step = step
        released = ch.recv(expect_layer=META, expect_step=step, expect_dtype=torch.int32)[0]
        self.tables.release(released.tolist())
        with self._mem:
            self.memory.release(released.tolist())
        if tiers:
            self._apply_tiers(step)
        if own:
            rows = ch.recv(expect_layer=META, expect_step=step, expect_dtype=torch.int32)[0]
            try:
                with self._mem:
                    self.memory.override(dict(KVOverride.decode(r) for r in rows.view(-1, 4)))
            except (ValueError, RuntimeError) as e:
                raise FrameError(f"step {step}: bad KV sparsity overrides: {e}") from None
        order = self._ring(step, count) if ring else None
        return _StepHead(step, count, head[1:].tolist(), width, report, order)

    def _micro_batches(self, step: int, count: int, ids: list[int]) -> list[_MicroBatch]:
        """Each micro-batch's seven metadata frames, checked; the slot tables take the
        step's diffs."""
        mbs = []
        for _ in range(count):
            new_slots, cu_q, q_pos, keep, tail, cu_k, k_pos0 = [
                self.ch.recv(expect_layer=META, expect_step=step, expect_dtype=torch.int32)[0]
                for _ in range(7)]
            n = cu_k.numel() - 1
            mine, ids = ids[:n], ids[n:]
            try:
                slots = self.tables.apply(mine, keep, tail, cu_k, k_pos0)
            except TableError as e:
                raise FrameError(f"step {step}: bad slot table diff: {e}") from None
            batch = SlotBatch(cu_q, q_pos, slots, cu_k, k_pos0)
            try:  # index scans once per step; per layer only shapes are checked
                with self._mem:
                    self.memory.check(new_slots, batch, tuple(mine))
            except SequenceFault as e:
                if -1 in e.seq_ids or not mine:
                    raise FrameError(f"step {step}: bad slot metadata: {e}") from None
                raise
            except ValueError as e:
                raise FrameError(f"step {step}: bad slot metadata: {e}") from None
            mbs.append(_MicroBatch(new_slots, batch, tuple(mine)))
        return mbs

    def _serve_layers(self, step: int, mbs: list[_MicroBatch], width: int, order,
                      queued: int) -> None:
        """The Python layer loop: each layer's q/k/v of each micro-batch (of each of its
        stream groups) attended as it arrives; the output sent back (or on along the
        ring to the replica running the micro-batch's next slice)."""
        # per micro-batch: its groups (a streamed one's, else the whole), each as
        # (new_slots, batch, sequences)
        groups = [self._groups(m.new_slots, m.batch, m.seqs, width) for m in mbs]
        for layer, params in enumerate(self.params):
            for j, mine in enumerate(groups):
                to = None if order is None else self._ring_next(layer, *order, j)
                if to is not None and to < 0:
                    continue  # another replica's layer of this micro-batch
                for new_slots, batch, seqs in mine:
                    q, k, v = self._recv_qkv(layer, step, batch.num_queries,
                                             new_slots.numel())
                    with self._mem:
                        t = time.perf_counter()
                        o, lse = self.memory.attend(layer, params, q, k, v, new_slots, batch,
                                                    checked=True, seq_ids=seqs)
                        self.tracer.record("attend", layer, t, mb=j)
                    frame = (torch.cat([o, lse[..., None].to(o.dtype)], -1), layer, step)
                    if to is None:
                        self._send(frame, queued)
                    else:
                        self.route(to, frame)

    def _ring(self, step: int, count: int) -> tuple[int, list[int]]:
        """A ring step's frame: -> (R, each live micro-batch's index in the step)."""
        x = self.ch.recv(expect_layer=META, expect_step=step, expect_dtype=torch.int32)[0]
        ring, js = int(x[0]), x[1:].tolist()
        if (self.route is None or not 1 < ring <= MAX_MICRO_BATCHES or len(js) != count
                or not self.index < ring or any(not 0 <= j < MAX_MICRO_BATCHES for j in js)):
            raise FrameError(f"step {step}: bad ring frame {x.tolist()[:8]} (connection "
                             f"{self.index}, {count} micro-batches"
                             f"{', no routes' if self.route is None else ''})")
        return ring, js

    def _ring_next(self, layer: int, ring: int, js: list[int], j: int) -> int:
        """Where a ring step's output of (layer, live micro-batch j) goes: the next
        replica; -1 when another replica sends this layer."""
        r = (layer + js[j]) % ring
        return (r + 1) % ring if r == self.index else -1

    @staticmethod
    def _groups(new_slots, batch: SlotBatch, seqs: tuple, width: int) -> list[tuple]:
        """A micro-batch's stream groups as (new_slots, batch, sequences) each; one
        group, itself, where it is not streamed (`streamed`)."""
        cuts = streamed(batch, new_slots.numel(), width)
        if cuts is None:
            return [(new_slots, batch, seqs)]
        cu = batch.cu_q.tolist()
        return [(new_slots[cu[a]:cu[e]], sub_batch(batch, a, e), seqs[a:e] if seqs else ())
                for a, e in cuts]

    def send_queued(self, frame) -> None:
        """A frame out through this connection's send thread, after those queued."""
        self._out.put(frame)

    def _send(self, frame, mbs: int) -> None:
        if mbs == 1:  # the peer reads it before it sends more: no deadlock
            with self._lock:
                self.ch.send(*frame)
        else:
            self._out.put(frame)

    def _apply_tiers(self, step: int) -> None:
        """The step's KV tier orders (`lamina.memory.tiers`). The executor checked its
        loads first, so a miss here is the store's own failure: the step fails."""
        flat = self.ch.recv(expect_layer=META, expect_step=step,
                            expect_dtype=torch.int32)[0]
        try:
            orders = decode_orders(flat.tolist(), getattr(self.memory.tiers, "worker", 0))
        except ValueError as e:
            raise FrameError(f"step {step}: {e}") from None
        try:
            with self._mem:
                self.memory.apply_tiers(orders)
        except TierMiss as e:
            raise RuntimeError(f"step {step}: a checked tier load missed: {e}") from None

    def _serve_native(self, step: int, new_slots, batch, width: int) -> None:
        """The layers of a one-micro-batch step in C++: the same frames and checks, and
        the same stream groups (each answered at once; reads go on while it sends)."""
        ch, rin, rout = self.ch, self.ch.ring_in, self.ch.ring_out
        s = self._native.ServeStep()
        s.fd, s.timeout_ms, s.step = ch.sock.fileno(), ch.timeout_ms(), step
        s.new_slots, s.cu_q, s.q_pos = new_slots, batch.cu_q, batch.q_pos
        s.slots, s.cu_k, s.k_pos0 = batch.slots, batch.cu_k, batch.k_pos0
        cuts = streamed(batch, new_slots.numel(), width)
        s.group_ends = [e for _, e in cuts] if cuts else []
        s.ring_in, s.ring_out = _ring_struct(self._native, rin), _ring_struct(self._native, rout)
        s.ring_min_bytes = (rin or rout).min_bytes if (rin or rout) else 0
        if self.tracer.enabled:  # each group's attention start and end, output sent
            s.times = torch.zeros(len(self.params), max(1, len(s.group_ends)), 3,
                                  dtype=torch.float64)
        with self._lock:
            s.pending = ch.take_pending()
            r = self._native.serve_step(self._layers, s)
        if rin:
            rin.pos = s.ring_in.pos
        if rout:
            rout.pos = s.ring_out.pos
        if r.status:
            _raise(r.status, r.message)
        if s.times is not None:  # output sends as the Python end traces them: in a
            # streamed step (its send thread's), not in an unstreamed one (inline)
            for layer, groups in enumerate(s.times.tolist()):
                for t0, t1, t2 in groups:
                    self.tracer.record("attend", layer, t0, t1, mb=0)
                    if width > 1:
                        self.send_tracer.record("send", layer, t1, t2, step=step)
        self.native_steps += 1

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
