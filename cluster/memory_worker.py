"""Memory worker: a Ray actor holding one KV pool and computing attention for the
requests placed on it.

Data in: over the data plane (frames, `lamina.wire`), per step a metadata group (layer
-1: the micro-batch count, then per micro-batch new-token slots, cu_q, q_pos, slots,
cu_k, k_pos0 as int32 tensors), then per layer and micro-batch q [n, Hq, D],
k [m, Hkv, D], v [m, Hkv, Dv] (m = new slots: the rows whose KV this worker stores).
Data out: per layer and micro-batch [n, Hq, Dv + 1]: the attention output with each
row's log-sum-exp as the last column (so a sequence split over workers merges exactly).
Ray only creates, configures and supervises it (setup / listen / health calls).
"""
from __future__ import annotations

import os
import queue
import socket
import tempfile
import threading
import traceback

import ray
import torch

from lamina.executor import MemorySide
from lamina.kernels import SlotBatch
from lamina.kv_pool import KVPool
from lamina.wire import FrameError, ShmRing, SocketChannel

META = -1  # layer tag of the per-step metadata frames
RING_BYTES = 64 << 20  # per direction; larger payloads go inline on the socket


def shm_enabled() -> bool:
    return os.environ.get("LAMINA_SHM", "1") != "0" and os.path.isdir("/dev/shm")


@ray.remote
class MemoryWorker:
    def __init__(self, index: int, threads: int = 1):
        torch.set_num_threads(threads)
        self.index, self.error, self.steps = index, None, 0
        self.memory = self.params = self._srv = None

    def setup(self, pool_config, params) -> dict:
        self.memory = MemorySide(KVPool(pool_config))
        self.params = list(params)
        return {"backend": self.memory.backend.name, "reason": self.memory.backend.reason,
                "pool_bytes": pool_config.nbytes, "pid": os.getpid()}

    def listen(self, unix: bool) -> tuple:
        """Open the data-plane endpoint; serve one compute worker on a thread. Co-located
        (unix): payloads go through two shared-memory rings, the socket is the doorbell."""
        self._rings = None
        if unix:
            path = os.path.join(tempfile.mkdtemp(prefix="lamina-"), f"mem{self.index}.sock")
            self._srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._srv.bind(path)
            addr = ("unix", path)
            if shm_enabled():
                base = f"/dev/shm/lamina-{os.getpid()}-{self.index}"
                self._rings = (ShmRing(base + "-c2m", RING_BYTES, create=True),
                               ShmRing(base + "-m2c", RING_BYTES, create=True))
                addr = ("unix", path, base + "-c2m", base + "-m2c", RING_BYTES)
        else:
            self._srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self._srv.bind((ray.util.get_node_ip_address(), 0))
            addr = ("tcp", *self._srv.getsockname())
        self._srv.listen(1)
        threading.Thread(target=self._serve, daemon=True).start()
        return addr

    def health(self) -> dict:
        return {"error": self.error, "steps": self.steps}

    def _serve(self):
        conn, _ = self._srv.accept()
        if conn.family == socket.AF_INET:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._rings:  # the compute worker mapped them before connecting
            c2m, m2c = self._rings
            for r in self._rings:
                r.unlink()
            ch = SocketChannel(conn, ring_out=m2c, ring_in=c2m)
        else:
            ch = SocketChannel(conn)
        # With micro-batches, outputs go out on their own thread so this one keeps reading:
        # the compute side sends the next one's q/k/v before it reads this one's output.
        # With one, the output goes out at once (no hand-off between threads).
        self._out = queue.SimpleQueue()
        self._send_lock = threading.Lock()
        threading.Thread(target=self._send_loop, args=(ch,), daemon=True).start()
        try:
            while True:
                self._step(ch)
                self.steps += 1
        except FrameError as e:
            if "header truncated: peer closed after 0" not in str(e):  # not a clean close
                self.error = f"memory worker {self.index}: {e}"
        except Exception:  # noqa: BLE001 - reported through health(), then the socket closes
            self.error = f"memory worker {self.index}: {traceback.format_exc()}"
        finally:
            self._out.put(None)

    def _send_loop(self, ch: SocketChannel):
        try:
            while (item := self._out.get()) is not None:
                with self._send_lock:
                    ch.send(*item)
        except OSError as e:
            self.error = self.error or f"memory worker {self.index}: send failed: {e}"
        finally:
            ch.close()

    def _step(self, ch: SocketChannel):
        count, _, step = ch.recv(expect_layer=META, expect_dtype=torch.int32,
                                 expect_shape=(1,))
        if not 1 <= int(count[0]) <= 64:
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
                n, m = batch.num_queries, new_slots.numel()
                q = ch.recv(expect_layer=layer, expect_step=step)[0]
                k = ch.recv(expect_layer=layer, expect_step=step)[0]
                v = ch.recv(expect_layer=layer, expect_step=step)[0]
                if q.shape[0] != n or k.shape[0] != m or v.shape[0] != m:
                    raise FrameError(f"step {step} layer {layer}: q/k/v rows {q.shape[0]}/"
                                     f"{k.shape[0]}/{v.shape[0]}, expected {n}/{m}/{m}")
                o, lse = self.memory.attend(layer, params, q, k, v, new_slots, batch,
                                            checked=True)
                frame = (torch.cat([o, lse[..., None].to(o.dtype)], -1), layer, step)
                if len(mbs) == 1:  # the peer reads it before it sends more: no deadlock
                    with self._send_lock:
                        ch.send(*frame)
                else:
                    self._out.put(frame)
