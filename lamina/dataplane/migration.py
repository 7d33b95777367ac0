"""Context migration between compute replicas over the data plane (rotational
pipelining over processes, `lamina.compute.ring`).

Data in: a `Context` (a micro-batch's splitter context after a slice, the shape and
dtype of the attention output that follows it, and its local prompts' output).
Data out: the same `Context` on the next replica. Frames (`lamina.dataplane.transport`,
tagged with the step): a header, int32 at layer `CONTEXT`,

    [layer, micro-batch, N, Hq, Dv, output dtype code, tensor count, present mask, own]

then each present context tensor and, if `own`, the local prompts' output, each
tagged with the layer. A header for another layer or micro-batch than the receiver
expects is a `FrameError`: the two replicas left the ring rule.

Sends go out on a thread of the link's own: with R = 2 the two replicas send to each
other, and a prefill's context (megabytes) fills the socket buffers, so two blocking
sends would wait on each other for good; the compute thread only queues them.
"""
from __future__ import annotations

import queue
import threading

import torch

from lamina.compute.ring import Context, ContextLink
from lamina.dataplane.transport import CODES, DTYPES, Channel, FrameError

CONTEXT = -3  # layer tag of a context header frame
MAX_TENSORS = 30  # context tensors per cut (the present mask is an int32)


class ChannelContextLink(ContextLink):
    """Contexts out on `to_next`, in on `from_prev` (one SocketChannel each way)."""

    def __init__(self, to_next: Channel, from_prev: Channel):
        self.to_next, self.from_prev = to_next, from_prev
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._sender: threading.Thread | None = None
        self.error: BaseException | None = None  # the send thread's failure

    def _send_loop(self) -> None:
        while (frames := self._out.get()) is not None:
            try:
                self.to_next.send_many(frames)
            except BaseException as e:  # noqa: BLE001 - raised by the next send or recv
                self.error = self.error or e

    def _check(self) -> None:
        if self.error is not None:
            raise ConnectionError(f"sending a context to the next replica failed: "
                                  f"{type(self.error).__name__}: {self.error}")

    def close(self) -> None:
        """Stop the send thread (after what it holds)."""
        if self._sender is not None:
            self._out.put(None)
            self._sender = None

    def send(self, step: int, ctx: Context) -> None:
        self._check()
        n = len(ctx.tensors)
        if n > MAX_TENSORS:
            raise FrameError(f"a context of {n} tensors (max {MAX_TENSORS})")
        if ctx.dtype not in CODES:
            raise FrameError(f"cannot send an attention output dtype {ctx.dtype}")
        mask = sum(1 << i for i, t in enumerate(ctx.tensors) if t is not None)
        head = torch.tensor([ctx.layer, ctx.mb, *ctx.attn_shape, CODES[ctx.dtype], n, mask,
                             int(ctx.own is not None)], dtype=torch.int32)
        frames = [(head, CONTEXT, step)]
        frames += [(t.contiguous(), ctx.layer, step) for t in ctx.tensors if t is not None]
        if ctx.own is not None:
            frames.append((ctx.own.contiguous(), ctx.layer, step))
        if self._sender is None:
            self._sender = threading.Thread(target=self._send_loop, daemon=True,
                                            name="lamina-context-send")
            self._sender.start()
        self._out.put(frames)

    def recv(self, step: int, layer: int, mb: int) -> Context:
        self._check()
        head = self.from_prev.recv(expect_layer=CONTEXT, expect_step=step,
                                   expect_dtype=torch.int32)[0].tolist()
        if len(head) != 9:
            raise FrameError(f"step {step}: a context header of {len(head)} fields, not 9")
        got_layer, got_mb, n_rows, hq, dv, code, n, mask, own = head
        if (got_layer, got_mb) != (layer, mb):
            raise FrameError(f"step {step}: the context of slice {got_layer}, micro-batch "
                             f"{got_mb} came where slice {layer}, micro-batch {mb} was due")
        if code not in DTYPES or not 0 <= n <= MAX_TENSORS or min(n_rows, hq, dv) < 0:
            raise FrameError(f"step {step}: bad context header {head}")
        tensors = tuple(self.from_prev.recv(expect_layer=layer, expect_step=step)[0]
                        if mask >> i & 1 else None for i in range(n))
        own_o = (self.from_prev.recv(expect_layer=layer, expect_step=step)[0] if own
                 else None)
        return Context(layer, mb, (n_rows, hq, dv), DTYPES[code], tensors, own_o)
