"""The compute side's device: moving a split model onto it, and the host staging between a
GPU compute side and memory workers that read host memory.

Data in: a `SplitModel` prepared on the CPU (`lamina.model.prepare`), a device name.
Data out: the same slices with every weight, buffer and device-typed constant on that
device (`move_split`); `HostStaging`, which carries one layer's q/k/v from the GPU into
pinned host buffers and the attention output back, on a side stream.

Why pinned buffers of our own: a copy from pageable host memory is staged by the driver
through its own pinned bounce buffer and blocks the thread; one from pinned memory is a
plain DMA that can run on a side stream while the main stream runs the next slice of the
other micro-batch. The buffers are kept per (micro-batch, role) and grow to the largest
step, so steady-state steps allocate nothing. A buffer is reused only after the copy that
last read or wrote it finished (its event), so a memory worker reading the host tensor it
was handed never sees the next layer's data.
"""
from __future__ import annotations

import re

import torch

# = lamina.engine.config.DEVICE_NAME (the compute side does not import the engine's
# config; tests/test_layout.py keeps the two equal)
DEVICE_NAME = r"cpu|cuda(:\d+)?"


def check_device(name: str, what: str = "compute_device") -> torch.device:
    """'cpu' or 'cuda[:i]' -> torch.device, a GPU's with its index (tensors report
    'cuda:0', and torch.device('cuda') != torch.device('cuda:0')); a GPU that torch does
    not see is a clear error."""
    if not isinstance(name, str) or not re.fullmatch(DEVICE_NAME, name):
        raise ValueError(f"{what} must be 'cpu' or 'cuda[:i]', got {name!r}")
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{what}={name!r}, but torch sees no CUDA GPU "
                             f"(torch {torch.__version__}, CUDA build: {torch.version.cuda})")
        if (dev.index or 0) >= torch.cuda.device_count():
            raise ValueError(f"{what}={name!r}, but torch sees {torch.cuda.device_count()} "
                             f"GPU(s)")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _move(t: torch.Tensor, device: torch.device, moved: dict) -> torch.Tensor:
    """`t` on `device`, one copy per source tensor (tied weights stay tied)."""
    if t.device == device:
        return t
    if id(t) not in moved:
        moved[id(t)] = (t, t.to(device))  # keep t alive so its id is not reused
    return moved[id(t)][1]


def move_split(split, device: torch.device):
    """Every slice's parameters, buffers and device-typed constants onto `device`, in
    place. Parameters are moved by swapping their data, so the HF model (which owns the
    same Parameter objects) moves with them; the model's own buffers move with
    `model.to(device)` (the caller). -> the split, for chaining."""
    moved: dict = {}
    for s in split.slices:
        for m in s.module.modules():
            for name, p in list(m._parameters.items()):
                if p is None or p.device == device:
                    continue
                new = _move(p.data, device, moved)
                if torch._has_compatible_shallow_copy_type(p.data, new):
                    p.data = new  # CPU -> CUDA: the same Parameter, new storage
                else:  # (meta, in tests) a new Parameter, one per old one
                    m._parameters[name] = _move(p, device, moved)
            for name, b in list(m._buffers.items()):
                if b is not None:
                    m._buffers[name] = _move(b, device, moved)
            if isinstance(m, torch.fx.GraphModule):
                _retarget_constants(m, device)
    stray = [f"slice {s.index}: {n}" for s in split.slices
             for n, t in [*s.module.named_parameters(), *s.module.named_buffers()]
             if t.device != device]
    if stray:
        raise RuntimeError(f"tensors left off {device} after moving the split: {stray[:5]}")
    return split


def _retarget_constants(gm: torch.fx.GraphModule, device: torch.device) -> None:
    """Ops the trace recorded with a CPU device, as a keyword (aranges, zeros, scalar
    tensors, copies) or an argument (`aten.to.device`), create their tensors on `device`."""
    changed = False
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        d = n.kwargs.get("device")
        if d is not None and torch.device(d) != device:
            n.kwargs = {**n.kwargs, "device": device}
            changed = True
        if any(isinstance(a, torch.device) and a != device for a in n.args):
            n.args = tuple(device if isinstance(a, torch.device) else a for a in n.args)
            changed = True
    if changed:
        gm.recompile()


class HostStaging:
    """Pinned host buffers and a copy stream between a GPU compute side and host memory."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._bufs: dict = {}  # key -> flat pinned tensor
        self._done: dict = {}  # key -> event of the last copy through that buffer

    def _buffer(self, key, numel: int, dtype: torch.dtype) -> torch.Tensor:
        ev = self._done.pop(key, None)
        if ev is not None:
            ev.synchronize()  # the last copy through it is over
        b = self._bufs.get(key)
        if b is None or b.numel() < numel or b.dtype != dtype:
            b = torch.empty(max(numel, 2 * (b.numel() if b is not None else 0)),
                            dtype=dtype, pin_memory=True)
            self._bufs[key] = b
        return b[:numel]

    def to_host(self, key, tensors) -> list[torch.Tensor]:
        """GPU tensors (any strides) -> contiguous host copies in pinned buffers; returns
        once they are there. The copies wait for the main stream's work so far only."""
        outs = [self._buffer((key, j), t.numel(), t.dtype).view(t.shape)
                for j, t in enumerate(tensors)]
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for h, t in zip(outs, tensors):
                h.copy_(t, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(self.stream)
        ev.synchronize()
        return outs

    def to_device(self, key, t: torch.Tensor) -> torch.Tensor:
        """A host tensor -> a GPU copy that the main stream may use at once (it waits for
        the copy on the GPU, not on the host)."""
        h = self._buffer(key, t.numel(), t.dtype).view(t.shape)
        h.copy_(t)
        with torch.cuda.stream(self.stream):
            d = torch.empty(t.shape, dtype=t.dtype, device=self.device)
            d.copy_(h, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        self._done[key] = ev
        torch.cuda.current_stream(self.device).wait_event(ev)
        d.record_stream(torch.cuda.current_stream(self.device))
        return d
