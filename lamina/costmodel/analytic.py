"""Analytic throughput model and configuration optimizer (paper sections 3, 4.1, 4.2, 5.1).

Data in: `Device`s and a `ModelShape` from `lamina.costmodel.catalog`, an `Efficiency` (defaults, or
fitted to `lamina bench ops` measurements). Data out: `Estimate`s (per-iteration time
split into dense / attention / network, throughput, TPOT, throughput per dollar) and the
best homogeneous and offloaded configurations, for `lamina cost-report`.

One "cell" is a compute group (tp compute devices holding the weights) plus m memory
devices holding the KV cache; a cluster is cells side by side, so per-dollar figures of a
cell are the cluster's. A homogeneous cell has m = 0: its compute devices hold the KV too.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from lamina.costmodel.catalog import Device, ModelShape

PIPELINES = ("none", "rotational")


@dataclass(frozen=True)
class Efficiency:
    """How far real kernels get from peak. MFU(B, tp) = mfu_max * tp_efficiency^log2(tp)
    * B / (B + b_half) (the default is `lamina.costmodel.catalog.default_mfu`);
    attention reads KV at
    `mbu` of the memory bandwidth; the network moves bytes at `net_efficiency` of the NIC
    plus `net_latency_s` per layer round trip; `mem_usable` of memory holds weights + KV."""

    mfu_max: float = 0.60
    b_half: float = 180.0
    tp_efficiency: float = 0.80
    mbu: float = 0.80
    net_efficiency: float = 0.90
    net_latency_s: float = 33e-6  # paper Fig. 15: RDMA with device-side polling
    mem_usable: float = 0.90

    def __post_init__(self):
        for f in ("mfu_max", "tp_efficiency", "mbu", "net_efficiency", "mem_usable"):
            v = getattr(self, f)
            if not 0 < v <= 1:
                raise ValueError(f"Efficiency.{f} must be in (0, 1], got {v!r}")
        if self.b_half < 0 or self.net_latency_s < 0:
            raise ValueError("Efficiency.b_half and net_latency_s must be >= 0")

    def mfu(self, batch: float, tp: int = 1) -> float:
        return self.mfu_max * self.tp_efficiency ** math.log2(tp) * batch / (batch + self.b_half)

    @staticmethod
    def fit_mfu(points: list[tuple[float, float]], **kw) -> Efficiency:
        """Fit mfu_max and b_half to measured (batch, MFU) points: 1/MFU is linear in 1/B
        (1/MFU = 1/mfu_max + (b_half/mfu_max) / B), so least squares in that space."""
        if len(points) < 2:
            raise ValueError("fit_mfu needs MFU measured at >= 2 batch sizes")
        slope, icpt = (float(c) for c in np.polyfit([1 / b for b, _ in points],
                                                     [1 / m for _, m in points], 1))
        mfu_max = min(1.0, 1 / icpt) if icpt > 0 else 1.0
        return Efficiency(mfu_max=mfu_max, b_half=max(0.0, slope * mfu_max), **kw)

    @staticmethod
    def from_ops(calib: dict, params: float, peak_tflops: float, **kw) -> Efficiency:
        """Fit the MFU curve to `lamina bench ops` timings of a device whose peak is
        `peak_tflops`: MFU(B) = 2 * params * B / (layers * dense_layer(B) + head(B)) / peak.
        `params` is the measured model's dense parameter count."""
        L = int(calib["layers"])
        pts = []
        for b, t in calib["dense_layer_s"].items():
            total = L * float(t) + float(calib["head_s"][b])
            pts.append((int(b), 2 * params * int(b) / (total * peak_tflops * 1e12)))
        return Efficiency.fit_mfu(pts, **kw)


@dataclass(frozen=True)
class Cell:
    compute: Device
    tp: int
    memory: Device | None = None
    m: float = 0  # memory devices (fractional for alpha-units: a share of a collection)
    pipeline: str = "none"

    def __post_init__(self):
        if self.tp < 1 or self.m < 0 or (self.m > 0) != (self.memory is not None):
            raise ValueError(f"bad cell: tp={self.tp}, m={self.m}, memory={self.memory}")
        if self.pipeline not in PIPELINES:
            raise ValueError(f"pipeline must be one of {PIPELINES}, got {self.pipeline!r}")

    @property
    def offloaded(self) -> bool:
        return self.m > 0

    @property
    def price_usd(self) -> float:
        return self.tp * self.compute.price_usd + (self.m * self.memory.price_usd
                                                   if self.memory else 0.0)


@dataclass(frozen=True)
class Estimate:
    cell: Cell
    batch: int
    context: int
    dense_s: float
    attention_s: float
    network_s: float
    iteration_s: float  # one token for every request in the batch (= TPOT)
    max_batch: int

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.iteration_s

    @property
    def tokens_per_s_per_kusd(self) -> float:
        return self.tokens_per_s / self.cell.price_usd * 1e3

    def as_dict(self) -> dict:
        c = self.cell
        return {"compute": c.compute.name, "tp": c.tp, "memory": c.memory.name if c.memory
                else None, "memory_devices": c.m, "pipeline": c.pipeline, "batch": self.batch,
                "context": self.context, "max_batch": self.max_batch,
                "dense_ms": self.dense_s * 1e3, "attention_ms": self.attention_s * 1e3,
                "network_ms": self.network_s * 1e3, "tpot_ms": self.iteration_s * 1e3,
                "tokens_per_s": self.tokens_per_s, "price_usd": c.price_usd,
                "tokens_per_s_per_kusd": self.tokens_per_s_per_kusd}


def weight_bytes(model: ModelShape) -> float:
    return model.params * model.bytes_per_el


def net_bytes_per_token(model: ModelShape) -> float:
    """q and o ([Hq*hd] each) plus new k and v ([Hkv*hd] each) cross per layer; the
    paper's 4edBL for multi-head attention."""
    kv_dim = model.kv_heads * model.head_dim
    return model.layers * (2 * model.d_model + 2 * kv_dim) * model.bytes_per_el


def max_batch(model: ModelShape, cell: Cell, context: int, eff: Efficiency) -> int:
    """Requests of `context` tokens whose KV fits next to the weights (0 if none)."""
    kv = model.kv_bytes_per_token() * context
    if cell.offloaded:
        if weight_bytes(model) > cell.tp * cell.compute.memory_gb * 1e9 * eff.mem_usable:
            return 0
        room = cell.m * cell.memory.memory_gb * 1e9 * eff.mem_usable
    else:
        room = cell.tp * cell.compute.memory_gb * 1e9 * eff.mem_usable - weight_bytes(model)
    return max(0, int(room // kv))


def dense_time(model: ModelShape, cell: Cell, batch: float, eff: Efficiency) -> float:
    return 2 * model.params * batch / (eff.mfu(batch, cell.tp) * cell.tp
                                       * cell.compute.peak_tflops * 1e12)


def attention_time(model: ModelShape, cell: Cell, batch: float, context: int,
                   eff: Efficiency) -> float:
    kv = model.kv_bytes_per_token() * context * batch
    bw = (cell.m * cell.memory.memory_bw_gbps if cell.offloaded
          else cell.tp * cell.compute.memory_bw_gbps) * 1e9
    return kv / (bw * eff.mbu)


def network_time(model: ModelShape, cell: Cell, batch: float, eff: Efficiency) -> float:
    """Transfer time of a decode iteration's q/k/v/o (latency not included)."""
    if not cell.offloaded:
        return 0.0
    link = min(cell.tp * cell.compute.nic_gbps, cell.m * cell.memory.nic_gbps) * 1e9
    return net_bytes_per_token(model) * batch / (link * eff.net_efficiency)


def _remote(model, a: float, n: float, eff: Efficiency) -> float:
    """Memory-side time of an offloaded iteration: transfers stream under the attention
    (paper 5: communication-attention overlapping), plus one round-trip latency per layer."""
    return max(a, n) + model.layers * eff.net_latency_s


def estimate(model: ModelShape, cell: Cell, batch: int, context: int,
             eff: Efficiency = Efficiency()) -> Estimate | None:
    """Decode iteration of `batch` requests at `context` tokens each; None if the batch
    does not fit in memory. Homogeneous: dense then attention on the same devices.
    Offloaded, pipeline none: dense, then the memory side (attention with the transfers
    streamed under it). Rotational (staggered, 2 sub-batches, paper 5.1): per layer the
    compute side runs one sub-batch while the memory side serves the other; the period is
    the busier side's total (for two equal halves that also covers one half's chain)."""
    mb = max_batch(model, cell, context, eff)
    if batch < 1 or batch > mb:
        return None
    if cell.pipeline == "rotational" and batch >= 2:
        h = batch / 2
        d, a, n = (dense_time(model, cell, h, eff), attention_time(model, cell, h, context, eff),
                   network_time(model, cell, h, eff))
        r = _remote(model, a, n, eff) if cell.offloaded else a
        it = max(2 * d, 2 * r) if cell.offloaded else 2 * (d + a)
        return Estimate(cell, batch, context, 2 * d, 2 * a, 2 * n, it, mb)
    d, a, n = (dense_time(model, cell, batch, eff),
               attention_time(model, cell, batch, context, eff),
               network_time(model, cell, batch, eff))
    r = _remote(model, a, n, eff) if cell.offloaded else a
    return Estimate(cell, batch, context, d, a, n, d + r, mb)


def min_tp(model: ModelShape, dev: Device, eff: Efficiency) -> int:
    tp = 1
    while weight_bytes(model) > tp * dev.memory_gb * 1e9 * eff.mem_usable:
        tp *= 2
    return tp


BATCHES = tuple(sorted({int(round(2 ** (k / 4))) for k in range(0, 57)}))  # 1 .. 16384


def best(model: ModelShape, compute: Device, context: int, memory: Device | None = None,
         ms=(), tps=(1, 2, 4, 8), pipelines=PIPELINES, tpot_slo_s: float | None = None,
         eff: Efficiency = Efficiency(), batches=BATCHES) -> Estimate | None:
    """Maximum throughput per dollar over tp, memory-device count, pipelining and batch,
    with TPOT <= tpot_slo_s. `memory=None` searches homogeneous cells only."""
    top = None
    for tp in tps:
        if tp < min_tp(model, compute, eff):
            continue
        cells = ([Cell(compute, tp)] if memory is None else
                 [Cell(compute, tp, memory, m, p) for m in ms if m > 0 for p in pipelines])
        for cell in cells:
            for b in batches:
                e = estimate(model, cell, b, context, eff)
                if e is None:
                    break  # larger batches do not fit either
                if tpot_slo_s is not None and e.iteration_s > tpot_slo_s:
                    continue
                if top is None or e.tokens_per_s_per_kusd > top.tokens_per_s_per_kusd:
                    top = e
    return top


def alpha_device(base: Device, alpha: float) -> Device:
    """The paper's 4.1 memory unit: costs as much as `base` and gives alpha times its
    memory capacity and bandwidth (a collection of cheap memory-optimized devices)."""
    return replace(base, name=f"{alpha:g}x-{base.name}-memory-unit",
                   memory_gb=base.memory_gb * alpha, memory_bw_gbps=base.memory_bw_gbps * alpha,
                   nic_gbps=base.nic_gbps * alpha, source=f"alpha = {alpha:g} of {base.name}")


def fraction_grid(lo: float = 1 / 16, hi: float = 16, per_octave: int = 8) -> tuple:
    n = int(round(math.log2(hi / lo) * per_octave))
    return tuple(lo * 2 ** (k / per_octave) for k in range(n + 1))


def min_interconnect_curve(model: ModelShape, compute: Device, tp: int, batches,
                           eff: Efficiency = Efficiency()) -> list[tuple[int, float]]:
    """Paper 4.2: GB/s so the network never slows the compute devices, per batch."""
    return [(b, model.min_interconnect_gbps(eff.mfu(b, tp), tp * compute.peak_tflops))
            for b in batches]
