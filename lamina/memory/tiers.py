"""KV tiers beyond a memory worker's pool: host DRAM, then checksummed files on disk.

Data in: `TierOrder`s from the engine's session index (`lamina.engine.sessions`), once a
step before its layers (`TierStore.apply`): save (pool slots -> a host entry), demote
(host -> a disk file, in the background), prefetch (disk -> host, in the background,
verified), drop, load (host entry -> pool slots). A load is staged at `apply` and copied
one layer at a time as the step's attention reaches that layer (`load_layer`), so on a
memory worker the copy of layer i+1 waits only for layer i's attention, not the whole entry.
Data out: KV rows in the pool; files under `<disk_dir>/lamina-kv-<machine>-<pid>-<tag>/`
(`machine`: this kernel boot and pid namespace, so a new store removes the folders of
dead processes of the same machine: a killed memory worker's files do not pile up);
`TierMiss` naming the sequences whose entry is missing, short or fails its checksum (the
engine recomputes them: a bad file is a cache miss, never a wrong answer).

Entries hold K and V of positions 0..n-1 of one conversation: k [L, n, Hkv, D],
v [L, n, Hkv, Dv] in the pool's dtype. The engine decides what goes where (it sees the
queue); this store only carries orders out, and checks what it reads.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import threading
import uuid
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import msgspec
import torch

from lamina.memory.tier_orders import TierConfig, TierMiss, TierOrder

log = logging.getLogger(__name__)

MAGIC = b"LAMINAKV1\n"
PREFETCH_WAIT_S = 60.0  # a load waits this long for its entry's disk read


def _machine() -> str:
    """12 hex digits naming this kernel boot and pid namespace: only a process of the
    same can tell from a store folder's pid whether its owner is gone. Random (matching
    no other process) where the OS does not say."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            key = f"{f.read().strip()} {os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return uuid.uuid4().hex[:12]
    return hashlib.sha1(key.encode()).hexdigest()[:12]


MACHINE = _machine()
_STORE_DIR = re.compile(r"lamina-kv-([0-9a-f]{12})-(\d+)-[0-9a-f]{8}")


def sweep(disk_dir: str) -> list[str]:
    """Remove the store folders under `disk_dir` whose process, of this machine, is gone
    (a memory worker killed or crashed: its saved sessions died with it and nothing
    else reads them); -> their names. Folders of other machines (a shared disk, another
    container) and of live processes stay."""
    gone: list[str] = []
    try:
        names = os.listdir(disk_dir)
    except OSError:
        return gone
    for name in names:
        m = _STORE_DIR.fullmatch(name)
        if m and m.group(1) == MACHINE and not _alive(int(m.group(2))):
            shutil.rmtree(os.path.join(disk_dir, name), ignore_errors=True)
            gone.append(name)
    if gone:
        log.info("KV disk tier %r: removed %d folders of memory workers that are gone",
                 disk_dir, len(gone))
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


@dataclass
class _Host:
    k: torch.Tensor  # [L, cap, Hkv, D]
    v: torch.Tensor  # [L, cap, Hkv, Dv]
    n: int  # positions held


@dataclass(frozen=True)
class _Load:
    entry: int
    index: torch.Tensor  # [m] int64 pool slots
    src: int  # the entry's first position copied
    cos: torch.Tensor | None = None  # [R] fp32: re-rotation by -shift (None: no shift)
    sin: torch.Tensor | None = None


class TierStore:
    """One memory worker's tiers. Orders touching an entry first wait for its queued
    background work (one thread, in order), so a save never races a demote's write."""

    def __init__(self, config: TierConfig, pool, worker: int = 0,
                 rope_inv_freq: tuple[float, ...] | None = None):
        self.config, self.pool, self.worker = config, pool, worker
        self._rope = rope_inv_freq  # as given (`renewed` makes a store like this one)
        # the model's rotary frequencies (rotate-half convention, the first 2 * len
        # dims of each head rotate): what a shifted load re-rotates keys with; None: the
        # model's positions are not rotary, and shifted loads are refused
        self.inv_freq = (torch.tensor(rope_inv_freq, dtype=torch.float64)
                         if rope_inv_freq else None)
        self.host: dict[int, _Host] = {}
        self.files: dict[int, tuple[str, int]] = {}  # entry -> (path, bytes)
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._bg = ThreadPoolExecutor(1, thread_name_prefix=f"kv-tier-{worker}")
        self._loads: list[_Load] = []
        self._copied: set[int] = set()  # layers of this step's loads already copied
        self.dir = self._open_dir(config.disk_dir)
        self.stats = {"saved_bytes": 0, "loaded_bytes": 0, "written_bytes": 0,
                      "read_bytes": 0, "misses": 0, "write_failures": 0}

    def _open_dir(self, disk_dir: str | None) -> str | None:
        """This store's own directory under `disk_dir`; None (with a warning: sessions
        then live in the host tier only) when it cannot be created or written."""
        if disk_dir is None:
            return None
        path = os.path.join(disk_dir, f"lamina-kv-{MACHINE}-{os.getpid()}-{uuid.uuid4().hex[:8]}",
                            f"w{self.worker}")
        try:
            os.makedirs(path, exist_ok=True)
            probe = os.path.join(path, ".probe")
            with open(probe, "wb") as f:
                f.write(b"ok")
            os.remove(probe)
        except OSError as e:
            log.warning("KV disk tier %r is not writable (%s): memory worker %d keeps "
                        "session KV in its host tier only", disk_dir, e, self.worker)
            return None
        sweep(disk_dir)
        return path

    # -- orders, once a step --
    def apply(self, orders) -> None:
        """Carry out a step's orders in order; loads are staged for `load_layer`.
        Raises `TierMiss` (after the others ran) when any load's entry is not valid."""
        self._loads, self._copied = [], set()
        missed: dict[int, int] = {}  # seq_id -> entry
        for o in orders:
            if o.op == "load":
                if not self._stage(o):
                    missed[o.seq_id] = o.entry
                continue
            self._wait(o.entry)
            if o.op == "save":
                self._save(o)
            elif o.op == "demote":
                self._pending[o.entry] = self._bg.submit(self._demote, o.entry)
            elif o.op == "prefetch":
                self._pending[o.entry] = self._bg.submit(self._prefetch, o.entry)
            else:
                self._drop(o.entry)
        if missed:
            self._loads = [x for x in self._loads if x.entry not in missed.values()]
            self.stats["misses"] += len(missed)
            raise TierMiss(missed, set(missed.values()),
                           f"memory worker {self.worker}: no valid saved KV for "
                           f"entries {sorted(set(missed.values()))}")

    def missing(self, loads) -> list[TierOrder]:
        """The load orders whose entry this store cannot serve (waiting for its disk
        work, reading a file not prefetched): asked before a step is sent, so the step
        itself never misses (the Ray executor; `apply` checks again)."""
        return [o for o in loads if self._ready(o) is None]

    def _ready(self, o: TierOrder) -> _Host | None:
        """A load's entry in host memory holding its positions (read from disk now if
        it was not prefetched), or None."""
        self._wait(o.entry, PREFETCH_WAIT_S)
        if o.entry not in self.host:
            self._prefetch(o.entry)  # no-op without a file
        e = self.host.get(o.entry)
        return e if e is not None and e.n >= o.start + o.shift + len(o.slots) else None

    def load_layer(self, layer: int) -> None:
        """Copy layer `layer` of the staged loads into the pool (before its attention;
        once a step: micro-batches attend each layer more than once)."""
        if not self._loads or layer in self._copied:
            return
        self._copied.add(layer)
        if len(self._copied) == self.pool.config.num_layers:
            loads, self._loads = self._loads, []  # done: the next steps' serving is plain
        else:
            loads = self._loads
        kp, vp = self.pool.layer(layer)
        for x in loads:
            e = self.host[x.entry]
            m = x.index.numel()
            k = e.k[layer, x.src:x.src + m]  # [m, Hkv, D]
            if x.cos is not None and x.sin is not None:
                k = _rotate(k, x.cos, x.sin)
            kp.index_copy_(0, x.index, k)
            vp.index_copy_(0, x.index, e.v[layer, x.src:x.src + m])

    @property
    def loading(self) -> bool:
        """This step has loads to copy layer by layer."""
        return bool(self._loads)

    def renewed(self) -> TierStore:
        """This store closed (its saved sessions and files dropped) and an empty one
        with the same settings in its place."""
        self.close()
        return TierStore(self.config, self.pool, self.worker, self._rope)

    def close(self) -> None:
        self._bg.shutdown(wait=True)
        if self.dir is not None:
            shutil.rmtree(os.path.dirname(self.dir), ignore_errors=True)

    # -- moves between workers (a scale-down) --
    def export(self, entries) -> dict[int, _Host]:
        """Copies of `entries`' KV for another worker's store, each read from its file
        where it is not in host memory; one this store cannot serve is left out."""
        out = {}
        for entry in entries:
            self._wait(entry, PREFETCH_WAIT_S)
            self._prefetch(entry)  # (no-op without a file, or in host memory)
            with self._lock:
                e = self.host.get(entry)
                if e is not None:
                    out[entry] = _Host(e.k[:, :e.n].clone(), e.v[:, :e.n].clone(), e.n)
        return out

    def adopt(self, entries: dict[int, _Host]) -> list[int]:
        """Entries another worker's store exported, into this one's host tier (the
        engine's ids are unique over its workers). -> their ids."""
        with self._lock:
            self.host.update(entries)
        return sorted(entries)

    # -- the operations --
    def _wait(self, entry: int, timeout: float | None = None) -> None:
        f = self._pending.pop(entry, None)
        if f is not None:
            try:
                f.result(timeout)
            except FutureTimeout:
                log.warning("memory worker %d: entry %d's disk work still runs after %.0f "
                            "s", self.worker, entry, timeout)
                self._pending[entry] = f

    def _save(self, o: TierOrder) -> None:
        """Positions start.. of entry `o.entry` from pool slots `o.slots`; later positions
        are dropped (the conversation changed there). A stale file is deleted."""
        idx = torch.tensor(o.slots, dtype=torch.int64, device=self.pool.k.device)
        with self._lock:
            e = self.host.get(o.entry)
            if o.start and (e is None or e.n < o.start):
                log.warning("memory worker %d: save of entry %d from position %d, but it "
                            "holds %d: dropped", self.worker, o.entry, o.start,
                            0 if e is None else e.n)
                self._drop(o.entry)
                return
            end = o.start + len(o.slots)
            e = self._room(o.entry, e, end)
            e.k[:, o.start:end] = self.pool.k[:, idx].to("cpu")
            e.v[:, o.start:end] = self.pool.v[:, idx].to("cpu")
            e.n = end
        self._remove_file(o.entry)
        self.stats["saved_bytes"] += len(o.slots) * self.pool.config.bytes_per_slot

    def _room(self, entry: int, e: _Host | None, n: int) -> _Host:
        """The host entry with room for n positions (capacity doubles)."""
        if e is not None and e.k.shape[1] >= n:
            return e
        cap = max(n, 2 * (e.k.shape[1] if e is not None else 0), 64)
        k, v = self.pool.k, self.pool.v
        nk = torch.empty((k.shape[0], cap, *k.shape[2:]), dtype=k.dtype)
        nv = torch.empty((v.shape[0], cap, *v.shape[2:]), dtype=v.dtype)
        if e is not None:
            nk[:, :e.n], nv[:, :e.n] = e.k[:, :e.n], e.v[:, :e.n]
        self.host[entry] = new = _Host(nk, nv, e.n if e is not None else 0)
        return new

    def _stage(self, o: TierOrder) -> bool:
        """A load's entry in host memory, with positions start..start+m: True and staged,
        else False (a miss)."""
        src = o.start + o.shift
        if self._ready(o) is None:
            e = self.host.get(o.entry)
            log.warning("memory worker %d: session KV entry %d %s: recomputing sequence %d",
                        self.worker, o.entry, "is missing" if e is None else
                        f"holds {e.n} positions, not {src + len(o.slots)}", o.seq_id)
            return False
        if o.shift and self.inv_freq is None:
            raise ValueError(f"memory worker {self.worker}: a shifted load of entry "
                             f"{o.entry}, but the model's positions are not rotary")
        idx = torch.tensor(o.slots, dtype=torch.int64, device=self.pool.k.device)
        cos = sin = None
        if o.shift:  # R(p - s) = R(-s) R(p): rotate every key back by the shift
            assert self.inv_freq is not None
            ang = -o.shift * self.inv_freq
            cos, sin = (torch.cat([f(ang), f(ang)]).float() for f in (torch.cos, torch.sin))
        self._loads.append(_Load(o.entry, idx, src, cos, sin))
        self.stats["loaded_bytes"] += len(o.slots) * self.pool.config.bytes_per_slot
        return True

    def _drop(self, entry: int) -> None:
        with self._lock:
            self.host.pop(entry, None)
        self._remove_file(entry)

    def _remove_file(self, entry: int) -> None:
        path = self.files.pop(entry, (None, 0))[0]
        if path is not None:
            try:
                os.remove(path)
            except OSError:
                pass

    # -- background: disk --
    def _demote(self, entry: int) -> None:
        """Host -> disk: write the file (unless it is current), then free the host copy.
        With no disk tier, a full one, or a failed write: the entry is dropped, warned."""
        with self._lock:
            e = self.host.get(entry)
        if e is None:
            return
        if entry not in self.files and not self._write(entry, e):
            self._drop(entry)
            return
        with self._lock:
            self.host.pop(entry, None)

    def _write(self, entry: int, e: _Host) -> bool:
        if self.dir is None:
            log.warning("memory worker %d: no disk tier: session KV entry %d (%d tokens) is "
                        "dropped from the host tier", self.worker, entry, e.n)
            return False
        k, v = e.k[:, :e.n].contiguous(), e.v[:, :e.n].contiguous()
        layers = [(_view(k[i]), _view(v[i])) for i in range(k.shape[0])]  # no copies
        head = msgspec.json.encode({
            "n": e.n, "k": list(k.shape), "v": list(v.shape), "dtype": str(k.dtype),
            "crc": [[zlib.crc32(a), zlib.crc32(b)] for a, b in layers]})
        size = len(MAGIC) + 8 + len(head) + sum(len(a) + len(b) for a, b in layers)
        used = sum(b for _, b in self.files.values())
        if used + size > self.config.disk_bytes:
            self.stats["write_failures"] += 1
            log.warning("memory worker %d: KV disk tier full (%d of %d bytes used, entry %d "
                        "needs %d): its session KV is dropped (recomputed when needed)",
                        self.worker, used, self.config.disk_bytes, entry, size)
            return False
        path = os.path.join(self.dir, f"e{entry}.kv")
        try:
            with open(path + ".tmp", "wb") as f:
                f.write(MAGIC + len(head).to_bytes(8, "little") + head)
                for a, b in layers:
                    f.write(a)
                    f.write(b)
            os.replace(path + ".tmp", path)
        except OSError as err:
            self.stats["write_failures"] += 1
            log.warning("memory worker %d: writing session KV entry %d failed (%s): it is "
                        "dropped", self.worker, entry, err)
            try:
                os.remove(path + ".tmp")
            except OSError:
                pass
            return False
        self.files[entry] = (path, size)
        self.stats["written_bytes"] += size
        return True

    def _prefetch(self, entry: int) -> None:
        """Disk -> host, every layer's checksum verified first; a missing, short or
        corrupt file is deleted and warned about (the load then misses)."""
        if entry in self.host or entry not in self.files:
            return
        path = self.files[entry][0]
        try:
            e = self._read(path)
        except (OSError, ValueError, msgspec.DecodeError) as err:
            log.warning("memory worker %d: session KV file %s unusable (%s): a cache miss, "
                        "the session is recomputed", self.worker, path, err)
            self._remove_file(entry)
            return
        with self._lock:
            self.host.setdefault(entry, e)

    def _read(self, path: str) -> _Host:
        with open(path, "rb") as f:
            data = bytearray(f.read())  # writable, so torch.frombuffer reads it in place
        self.stats["read_bytes"] += len(data)
        if not data.startswith(MAGIC):
            raise ValueError("not a Lamina KV file")
        view = memoryview(data)
        at = len(MAGIC) + 8
        hl = int.from_bytes(data[len(MAGIC):at], "little")
        head = msgspec.json.decode(view[at:at + hl])
        at += hl
        dtype = self.pool.k.dtype
        if head.get("dtype") != str(dtype) or list(head["k"][2:]) != list(self.pool.k.shape[2:]):
            raise ValueError(f"KV shape/dtype {head.get('k')} {head.get('dtype')} is not "
                             f"this pool's")
        k = torch.empty(head["k"], dtype=dtype)
        v = torch.empty(head["v"], dtype=dtype)
        for i, (ck, cv) in enumerate(head["crc"]):
            for t, crc in ((k[i], ck), (v[i], cv)):
                nb = t.numel() * t.element_size()
                if at + nb > len(data):
                    raise ValueError(f"truncated at layer {i}")
                if zlib.crc32(view[at:at + nb]) != crc:  # views: no copy until copy_
                    raise ValueError(f"checksum mismatch at layer {i}")
                if nb:
                    t.copy_(torch.frombuffer(data, dtype=dtype, count=t.numel(), offset=at)
                            .view(t.shape))
                at += nb
        return _Host(k, v, int(head["n"]))


def _rotate(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """k [m, H, D] rotated in its first R = len(cos) dims (HF's rotate-half layout: dim i
    pairs with i + R/2) by the angles behind cos/sin [R]; computed in fp32."""
    r = cos.numel()
    x = k[..., :r].float()
    half = torch.cat([-x[..., r // 2:], x[..., :r // 2]], -1)
    out = k.clone()
    out[..., :r] = (x * cos + half * sin).to(k.dtype)
    return out


def _view(t: torch.Tensor) -> memoryview:
    """A contiguous tensor's bytes, without copying them."""
    return t.view(torch.uint8).numpy().data.cast("B")

