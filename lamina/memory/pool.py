"""KV pool tensors of one memory worker: K and V for every layer, indexed by slot id.

Data in: slot ids from `KVAllocator`, the new k/v of a step from the compute side, and
`CopySlot` orders (copy-on-write). Data out: the per-layer pool views that
`lamina.kernels` attention reads in place.

Layout: k [num_layers, num_slots, Hkv, D] and v [num_layers, num_slots, Hkv, Dv], each
allocated once. A slot's row for one layer is contiguous (Hkv*D elements), which is what
the kernels read per key; keeping layers outermost makes each layer's pool one dense
[num_slots, Hkv, D] tensor, so a layer's attention never strides over other layers.

An int8 pool (`dtype="int8"`) holds rows of `lamina.kernels.quant`: each head's D int8
codes then its fp32 scale, so k is [L, S, Hkv, D + 4], a view of one buffer that puts
each slot's V row right after its K row; a slot's rows still stand alone
(copies, forks, prefix sharing and tier saves move rows). Keys are divided by per-layer
channel scales `key_scales` [L, Hkv, D] before they are quantized (calibrated from the
model: `lamina.model.prepare.key_channel_scales`).

Host pools sit on transparent huge pages where the kernel allows them (`huge_pages`):
a decode step reads rows at scattered slots, so with 4 KiB pages nearly every key's K
and V rows take a TLB miss; 2 MiB pages remove most of them. Off, a pool's mapping is
advised against them, so it keeps 4 KiB pages under THP `always` too.

A host pool's pages are touched when it is made (`prefault`): its memory is taken up
front, where a machine short of it fails at start rather than mid-serving, and no step
waits on page faults. Off, a page is faulted in when a slot on it is first written (the
mapping reads as zeros before), so a pool larger than its traffic costs only what is
used: for short-lived engines (tests, tools) that rarely fill theirs.
Both default from the environment ($LAMINA_KV_HUGE_PAGES, $LAMINA_KV_PREFAULT: "0" off).
"""
from __future__ import annotations

import math
import mmap
from dataclasses import dataclass, field
from typing import Sequence

import torch

from lamina.kernels import write_kv
from lamina.kernels.quant import SCALE_BYTES
from lamina.memory.allocator import CopySlot
from lamina.memory.pages import default_huge_pages, default_prefault

POOL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}


@dataclass(frozen=True)
class KVPoolConfig:
    num_layers: int
    num_slots: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int = 0  # 0: head_dim (set so on creation)
    dtype: str = "float32"  # float32 | bfloat16 | int8
    device: str = "cpu"
    # host pools: ask for transparent huge pages (madvise); write every page at creation
    # (else each is faulted in at its first write); both default from the environment
    huge_pages: bool = field(default_factory=default_huge_pages)
    prefault: bool = field(default_factory=default_prefault)
    # int8 pools: keys' channel scales, num_layers * Hkv * head_dim positive floats in
    # [layer, kv head, channel] order; None: all 1 (keys quantized per token and head)
    key_scales: tuple[float, ...] | None = field(default=None, repr=False)

    def __post_init__(self):
        for name in ("num_layers", "num_slots", "num_kv_heads", "head_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"KVPoolConfig.{name} must be a positive int, got {v!r}")
        if self.v_head_dim in (0, None):
            object.__setattr__(self, "v_head_dim", self.head_dim)
        elif not isinstance(self.v_head_dim, int) or self.v_head_dim <= 0:
            raise ValueError(f"KVPoolConfig.v_head_dim must be a positive int, "
                             f"got {self.v_head_dim!r}")
        if self.dtype not in POOL_DTYPES:
            raise ValueError(f"KVPoolConfig.dtype must be one of {sorted(POOL_DTYPES)}, "
                             f"got {self.dtype!r}")
        try:
            torch.device(self.device)
        except RuntimeError as e:
            raise ValueError(f"KVPoolConfig.device {self.device!r} is not a device: "
                             f"{e}") from None
        for name in ("huge_pages", "prefault"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"KVPoolConfig.{name} must be a bool, "
                                 f"got {getattr(self, name)!r}")
        if self.key_scales is not None:
            self._check_key_scales()

    def _check_key_scales(self) -> None:
        want = self.num_layers * self.num_kv_heads * self.head_dim
        if self.dtype != "int8":
            raise ValueError(f"KVPoolConfig.key_scales is for int8 pools, not {self.dtype}")
        ks = tuple(float(x) for x in self.key_scales or ())
        if len(ks) != want or not all(math.isfinite(x) and x > 0 for x in ks):
            raise ValueError(f"KVPoolConfig.key_scales must be {want} positive finite "
                             f"floats (num_layers x num_kv_heads x head_dim), got "
                             f"{len(ks)}" + ("" if len(ks) != want else " with bad values"))
        object.__setattr__(self, "key_scales", ks)

    @property
    def row_dims(self) -> tuple[int, int]:
        """The last dims of a slot's K and V rows per head (head dim + the int8 scale)."""
        extra = SCALE_BYTES if self.dtype == "int8" else 0
        return self.head_dim + extra, self.v_head_dim + extra

    @property
    def bytes_per_slot(self) -> int:
        """K+V bytes one token takes across all layers."""
        el = torch.empty((), dtype=POOL_DTYPES[self.dtype]).element_size()
        return self.num_layers * self.num_kv_heads * sum(self.row_dims) * el

    @property
    def nbytes(self) -> int:
        return self.bytes_per_slot * self.num_slots

    @staticmethod
    def for_specs(specs: Sequence, num_slots: int, dtype: str = "float32",
                  device: str = "cpu", key_scales=None,
                  pool_bytes: int | None = None, huge_pages: bool | None = None,
                  prefault: bool | None = None) -> "KVPoolConfig":
        """From the splitter's `AttentionSpec`s (all layers must share one KV shape);
        `key_scales` (int8 only): a tensor [L, Hkv, D] or flat floats; `pool_bytes`: as
        many slots as fit in that many bytes (instead of `num_slots`); `huge_pages`,
        `prefault`: None takes the environment's default."""
        shapes = {(s.num_kv_heads, s.head_dim, s.v_head_dim) for s in specs}
        if len(shapes) != 1:
            raise ValueError(f"layers disagree on KV shape (Hkv, D, Dv): {sorted(shapes)}; "
                             "one pool per shape is not supported yet")
        hkv, d, dv = shapes.pop()
        if isinstance(key_scales, torch.Tensor):
            key_scales = tuple(key_scales.double().flatten().tolist())
        if pool_bytes is not None:
            per = KVPoolConfig(len(specs), 1, hkv, d, dv, dtype).bytes_per_slot
            if pool_bytes < per:
                raise ValueError(f"kv_pool_bytes {pool_bytes} holds no token: one takes "
                                 f"{per} bytes of {dtype} KV")
            num_slots = pool_bytes // per
        return KVPoolConfig(len(specs), num_slots, hkv, d, dv, dtype, device,
                            default_huge_pages() if huge_pages is None else huge_pages,
                            default_prefault() if prefault is None else prefault,
                            key_scales=key_scales if dtype == "int8" else None)


class KVPool:
    def __init__(self, config: KVPoolConfig):
        self.config = c = config
        dt = POOL_DTYPES[c.dtype]
        if torch.device(c.device).type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"KV pool device {c.device!r}: torch sees no CUDA GPU here "
                             f"(torch {torch.__version__}, cuda {torch.version.cuda})")
        # k: [L, S, Hkv, D], v: [L, S, Hkv, Dv], zeros
        dk, dv = c.row_dims
        kshape = (c.num_layers, c.num_slots, c.num_kv_heads, dk)
        vshape = (c.num_layers, c.num_slots, c.num_kv_heads, dv)
        host = torch.device(c.device).type == "cpu"
        if c.dtype == "int8" and dk == dv:
            # one buffer [L, S, 2, Hkv, D + 4]: a slot's K row then its V row, 408
            # contiguous bytes (SmolLM2) that share a line where K's ends, instead of two
            # rows of 204 B each starting anywhere in a line: ~10% fewer lines a key
            shape = (c.num_layers, c.num_slots, 2, c.num_kv_heads, dk)
            buf = (host_zeros(shape, dt, c.huge_pages, c.prefault) if host
                   else torch.zeros(shape, dtype=dt, device=c.device))
            self.k, self.v = buf[:, :, 0], buf[:, :, 1]  # views, rows contiguous per slot
        elif host:
            self.k = host_zeros(kshape, dt, c.huge_pages, c.prefault)
            self.v = host_zeros(vshape, dt, c.huge_pages, c.prefault)
        else:
            self.k = torch.zeros(kshape, dtype=dt, device=c.device)
            self.v = torch.zeros(vshape, dtype=dt, device=c.device)
        self._layers = list(zip(self.k.unbind(0), self.v.unbind(0)))  # views, made once
        # int8: keys' channel scales [L, Hkv, D] on the pool's device (ones if not given)
        self.key_scales: list[torch.Tensor | None] = [None] * c.num_layers
        if c.dtype == "int8":
            ks = (torch.tensor(c.key_scales, dtype=torch.float32) if c.key_scales
                  else torch.ones(c.num_layers * c.num_kv_heads * c.head_dim))
            self.key_scales = list(ks.view(c.num_layers, c.num_kv_heads, c.head_dim)
                                   .to(c.device).unbind(0))

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views k [S, Hkv, D], v [S, Hkv, Dv] of layer i (no copy)."""
        if not 0 <= i < self.config.num_layers:
            raise IndexError(f"layer {i} out of range [0, {self.config.num_layers})")
        return self._layers[i]

    def write(self, i: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a step's new k [N, Hkv, D] / v [N, Hkv, Dv] of layer i at `slots` [N]."""
        write_kv(*self.layer(i), slots, k, v, key_scales=self.key_scales[i])

    def copy(self, orders: Sequence[CopySlot]) -> None:
        """Apply copy-on-write orders: every layer's KV of src -> dst, one op per tensor."""
        if not orders:
            return
        src, dst = self._index([o.src for o in orders]), self._index([o.dst for o in orders])
        self.k.index_copy_(1, dst, self.k.index_select(1, src))
        self.v.index_copy_(1, dst, self.v.index_select(1, src))

    def read(self, slots: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of every layer's KV at `slots` [n], on the host: k [L, n, Hkv, D], v
        [L, n, Hkv, Dv] in the pool's dtype (int8 rows with their scales), for another
        pool of this layout (`put`)."""
        idx = self._index(slots)
        return self.k.index_select(1, idx).cpu(), self.v.index_select(1, idx).cpu()

    def put(self, slots: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Every layer's KV `read` from another pool of this layout into `slots` [n]."""
        idx = self._index(slots)
        want = (self.k.shape[0], idx.numel(), *self.k.shape[2:])
        if tuple(k.shape) != want or k.dtype != self.k.dtype or \
                tuple(v.shape) != (want[0], want[1], *self.v.shape[2:]):
            raise ValueError(f"KV of shapes {tuple(k.shape)} / {tuple(v.shape)} ({k.dtype}) "
                             f"for {idx.numel()} slots of a pool whose rows are "
                             f"{tuple(self.k.shape[2:])} / {tuple(self.v.shape[2:])} "
                             f"({self.k.dtype})")
        self.k.index_copy_(1, idx, k.to(self.k.device))
        self.v.index_copy_(1, idx, v.to(self.v.device))

    def _index(self, slots: Sequence[int]) -> torch.Tensor:
        idx = torch.tensor(list(slots), dtype=torch.int64, device=self.k.device)
        S = self.config.num_slots
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= S):
            raise IndexError(f"slot ids out of range [0, {S})")
        return idx


HUGE_PAGE = 2 << 20
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode(path: str = THP_ENABLED) -> str:
    """The kernel's transparent-huge-page mode ("always", "madvise" or "never"; "never"
    where it cannot be read): with "madvise" only `host_zeros`' advised mappings get them."""
    try:
        with open(path) as f:
            return f.read().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return "never"


def host_zeros(shape: Sequence[int], dtype: torch.dtype, huge_pages: bool = True,
               prefault: bool = True) -> torch.Tensor:
    """A zeroed host tensor on a private anonymous mapping of its own, aligned to 2 MiB.
    With `huge_pages` it is advised MADV_HUGEPAGE, so Linux backs it with transparent
    huge pages when its THP mode is `always` or `madvise`; without, MADV_NOHUGEPAGE, so
    it stays on 4 KiB pages even under `always` (where huge pages fault in slowly, the
    reason to turn them off). `prefault`: every page written now; else each is faulted
    in at its first write (an anonymous mapping reads as zeros until then). Under 2 MiB,
    or where `mmap` lacks the advice: an ordinary tensor. The tensor keeps the mapping
    alive (torch.frombuffer holds a reference)."""
    n = 1
    for d in shape:
        n *= int(d)
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    advice = getattr(mmap, "MADV_HUGEPAGE" if huge_pages else "MADV_NOHUGEPAGE", None)
    if advice is None or nbytes < HUGE_PAGE:
        return torch.zeros(tuple(shape), dtype=dtype)
    m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(advice)  # before the first touch, so the faults take the pages it asks
    raw = torch.frombuffer(m, dtype=torch.uint8)
    off = -raw.data_ptr() % HUGE_PAGE
    t = raw[off:off + nbytes].view(dtype).view(tuple(shape))
    if prefault:
        t.zero_()
    return t
