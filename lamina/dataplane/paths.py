"""Which data-plane path carries a layer's frames: decided here and nowhere else.

Both ends speak one protocol (`protocol.py`); the choices are who does the per-layer
work and how many frames a worker's q/k/v take:

- **native** (C++) or Python end. The C++ ends (`kernels/csrc/dataplane.cpp`, GIL
  released) run where the compiled CPU extension loads and the caller allows them
  (`native=True`, the default). The compute end's native path needs every active
  worker's rows to be one slice of the packed rows (`WorkerPart.span`: no KV split) and
  q, k, v of one dtype; its receive also needs no LSE merge and no bytes already read
  into a channel's buffer. The memory end's native path serves one-micro-batch steps on
  a host pool with the compiled kernel, streamed or not, but for a step with prompts
  on bf16 pools where our bf16 prompt kernel runs (`prompts_in_python`). Anything else
  takes the Python end, which speaks the same bytes.
- **one frame or three**. A worker whose query rows are exactly the rows whose k/v it
  stores gets one q|k|v frame a layer; a worker holding only part of a sequence's KV
  (KV split) gets q, k and v as three frames. `one_frame=False` always sends three
  (both are valid protocol; the tests cover both).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lamina.dataplane.transport import SocketChannel
from lamina.kernels import KernelBuildError, load_cpu_kernel, prompt_sdpa


def native_ext():
    """The compiled module with the data plane's C++ ends, or None (Python ends)."""
    try:
        return load_cpu_kernel()
    except KernelBuildError:
        return None


def bytes_channels(*channels) -> bool:
    """Whether the C++ ends can read these channels: sockets (with rings) whose every
    payload is bytes; RDMA channels and collective paths take the Python ends, which
    speak the same frames."""
    return all(isinstance(ch, SocketChannel) and ch.bytes_only for ch in channels)


Spans = tuple[list[int], list[int]]  # each worker's rows as [starts], [ends]


def worker_spans(parts) -> Spans | None:
    """(starts, ends) of each worker's rows when every active one is a slice, else None
    (then the native compute end cannot send them)."""
    if any(p.span is None and p.active for p in parts):
        return None
    return ([p.span[0] if p.span else 0 for p in parts],
            [p.span[1] if p.span else 0 for p in parts])


@dataclass(frozen=True)
class ComputePaths:
    """The compute end's choices for one channel set (`SocketLink`)."""

    ext: object | None  # the native module, or None: the Python end only
    one_frame: bool = True  # q|k|v as one frame where a worker's rows allow it

    @classmethod
    def choose(cls, native: bool = True, one_frame: bool = True) -> ComputePaths:
        # the native send builds one q|k|v frame per worker: three-frame runs stay in Python
        return cls(native_ext() if native and one_frame else None, one_frame)

    def send_native(self, spans: Spans | None, q, k, v) -> bool:
        return bool(self.ext and spans and q.dtype == k.dtype == v.dtype)

    def recv_native(self, spans: Spans | None, merge: bool, buffered: bool) -> bool:
        return bool(self.ext and spans and not merge and not buffered)

    def send_one_frame(self, part, q, k, v) -> bool:
        """The Python end's frame count for one worker: True for one q|k|v frame."""
        return (self.one_frame and part.kv_rows.numel() == part.rows.numel()
                and q.dtype == k.dtype == v.dtype)


def prompts_in_python(memory, batch) -> bool:
    """Whether a one-micro-batch step that the C++ loop could serve goes to the Python
    loop for its prompts: `serve_step` attends with the slot kernel alone, while on bf16
    pools, where the CPU runs our bf16 prompt kernel (`prompt_sdpa.bf16_kernel`), the
    Python loop's backend sends requests of `MIN_QUERIES`+ queries (a chunk after its
    earlier keys, a prompt after a prefix-cache hit) through it: one 1024-token chunk
    after 2048 keys 21 against 45 ms a layer (benchmarks/prompt_attention_probe.py).
    The Python loop's own cost, ~0.1 ms a layer, is small beside that."""
    return (batch.most_queries >= prompt_sdpa.MIN_QUERIES
            and memory.pool.k.dtype == torch.bfloat16 and prompt_sdpa.bf16_kernel() is not None)


def memory_native(memory, native: bool = True):
    """The memory end's native `serve_step`, or None (the Python loop serves): only the
    compiled CPU kernel on a host pool runs it (float rows stored as they come, int8
    rows quantized as `lamina.kernels.quant.quantize_rows` does, the same bytes), and
    no sparsity policy (it selects each layer's keys in `MemorySide.attend`)."""
    ext = getattr(memory.backend, "_ext", None)
    if (native and memory.backend.name == "cpu" and hasattr(ext, "serve_step")
            and getattr(memory, "sparsity", None) is None):
        return ext
    return None
