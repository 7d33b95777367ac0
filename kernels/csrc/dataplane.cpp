// The data plane's per-layer work in C++, both ends, with the GIL released.
//
// Memory end (`serve_step`): data in is the frames of one step's layers on a connected
// socket (fd), read exactly (after any bytes the Python channel had buffered), or their
// payloads from a shared-memory ring; the step's checked slot metadata; the pool's
// per-layer K/V. Data out: per layer one frame [n, Hq, Dv + 1] (attention output |
// log-sum-exp) on the same socket (or its payload in the outgoing ring).
// Compute end (`submit_qkv`, `collect_o`, or both in one call, `exchange_qkv`): one
// layer's q|k|v rows packed straight into each worker's frame, the outputs back into
// one [N, Hq, Dv] tensor. Payloads in a ring are read in place, not copied out first.
// The frame format and protocol are `lamina.wire` / `lamina.link`; this file is their
// fast path (one micro-batch a step on the memory end; workers' rows as slices on the
// compute end) and stays byte-compatible: the tests run Python and C++ ends against
// each other. Every frame is validated as `wire.check` does; errors come back as
// (status, message) and nothing is computed from a bad frame.
#include <ATen/ATen.h>
#include <pybind11/pybind11.h>  // gil_scoped_release

#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "lamina_ext.h"

namespace {

constexpr int HEADER = 28;  // "<4sHBBiqQ": magic, version, ndim, dtype, layer, step, nbytes
constexpr uint16_t VERSION = 1;
constexpr int MAX_NDIM = 8;
constexpr uint8_t IN_RING = 0x80;

struct FrameErr : std::runtime_error { using std::runtime_error::runtime_error; };
struct Timeout : std::runtime_error { using std::runtime_error::runtime_error; };

int code_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return 1; case at::kBFloat16: return 2; case at::kHalf: return 3;
    case at::kInt: return 4; case at::kLong: return 5; case at::kByte: return 6;
    default: throw FrameErr(std::string("cannot send dtype ") + c10::toString(t));
  }
}
bool type_of(int code, at::ScalarType* t) {
  static const at::ScalarType types[] = {at::kFloat, at::kBFloat16, at::kHalf, at::kInt,
                                         at::kLong, at::kByte};
  if (code < 1 || code > 6) return false;
  *t = types[code - 1];
  return true;
}
std::string dtype_name(at::ScalarType t) {  // as Python prints torch dtypes
  switch (t) {
    case at::kFloat: return "torch.float32"; case at::kBFloat16: return "torch.bfloat16";
    case at::kHalf: return "torch.float16"; case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64"; default: return "torch.uint8";
  }
}
std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "(";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + (s.size() == 1 ? ",)" : ")");
}

// One direction of a `lamina.wire.ShmRing`: the same cursor and jump rule.
struct Ring {
  uint8_t* data = nullptr;
  std::atomic<int64_t>* consumed = nullptr;  // the ring's control word
  int64_t cap = 0, pos = 0, min_bytes = 0;
  int64_t place(int64_t n) {
    int64_t off = pos % cap;
    if (off + n > cap) { pos += cap - off; off = 0; }
    return off;
  }
  bool has_room(int64_t n) const {  // a payload of n bytes, placed now, overwrites nothing unread
    Ring r = *this;
    r.place(n);
    return r.pos + n - consumed->load(std::memory_order_acquire) <= cap;
  }
};

// The socket end: exact reads (buffered bytes first), gather writes, poll for timeouts.
// With `drain` set, a write that has to wait reads what arrives meanwhile onto
// `pending`: a streamed memory end sends a group's output while the compute end may be
// blocked sending the next group, and with full socket buffers neither would move.
struct Conn {
  int fd; int timeout_ms; std::string pending; size_t used = 0; bool drain = false;

  void wait(short ev, const char* what) {
    pollfd p{fd, ev, 0};
    for (;;) {
      const int r = ::poll(&p, 1, timeout_ms);
      if (r > 0) return;
      if (r == 0) {
        char sec[32];
        std::snprintf(sec, sizeof sec, "%g", timeout_ms / 1000.0);
        throw Timeout(std::string("no ") + what + " from the peer within " + sec + " s");
      }
      if (errno != EINTR) throw std::runtime_error(std::string("poll: ") + strerror(errno));
    }
  }
  void read(void* dst, int64_t n, const char* what) {
    auto* out = static_cast<char*>(dst);
    int64_t got = std::min<int64_t>(n, int64_t(pending.size() - used));
    std::memcpy(out, pending.data() + used, got);
    used += got;
    while (got < n) {
      const ssize_t r = ::recv(fd, out + got, n - got, MSG_DONTWAIT);
      if (r > 0) { got += r; continue; }
      if (r == 0) throw FrameErr(std::string(what) + " truncated: peer closed after " +
                                 std::to_string(got) + " of " + std::to_string(n) + " bytes");
      if (errno == EAGAIN || errno == EWOULDBLOCK) wait(POLLIN, what);
      else if (errno != EINTR) throw std::runtime_error(std::string("recv: ") + strerror(errno));
    }
  }
  // Reads whatever has arrived onto `pending`; -> false once the peer has closed.
  bool take_arrived() {
    if (used == pending.size()) { pending.clear(); used = 0; }
    char buf[1 << 16];
    for (;;) {
      const ssize_t r = ::recv(fd, buf, sizeof buf, MSG_DONTWAIT);
      if (r > 0) { pending.append(buf, size_t(r)); continue; }
      if (r == 0) return false;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return true;
      if (errno != EINTR) throw std::runtime_error(std::string("recv: ") + strerror(errno));
    }
  }
  void wait_writable() {
    if (!drain) return wait(POLLOUT, "read");
    for (;;) {
      wait(short(POLLOUT | POLLIN), "read");
      pollfd p{fd, POLLOUT, 0};
      if (::poll(&p, 1, 0) > 0 || !take_arrived()) return;  // writable, or closed: send fails
    }
  }
  void write(std::vector<iovec> iov) {
    size_t i = 0;
    while (i < iov.size()) {
      msghdr m{};
      m.msg_iov = iov.data() + i;
      m.msg_iovlen = iov.size() - i;
      ssize_t r = ::sendmsg(fd, &m, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (r < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) { wait_writable(); continue; }
        if (errno == EINTR) continue;
        throw std::runtime_error(std::string("send failed: ") + strerror(errno));
      }
      while (i < iov.size() && size_t(r) >= iov[i].iov_len) r -= iov[i++].iov_len;
      if (i < iov.size()) {
        iov[i].iov_base = static_cast<char*>(iov[i].iov_base) + r;
        iov[i].iov_len -= r;
      }
    }
  }
};

// One frame's checked header (as `SocketChannel.recv` + `wire.check`).
struct Head {
  std::vector<int64_t> shape;
  at::ScalarType dt;
  int64_t nbytes;
  bool in_ring;
};

Head recv_head(Conn& c, int64_t layer, int64_t step,
               const std::vector<int64_t>* expect_shape = nullptr) {
  uint8_t h[HEADER];
  c.read(h, HEADER, "frame header");
  if (std::memcmp(h, "LMNA", 4) != 0)
    throw FrameErr("frame: bad magic b'" + std::string(reinterpret_cast<char*>(h), 4) +
                   "' (expected b'LMNA')");
  uint16_t ver; std::memcpy(&ver, h + 4, 2);
  if (ver != VERSION)
    throw FrameErr("frame: version " + std::to_string(ver) + ", this side speaks 1");
  Head r;
  r.in_ring = h[6] & IN_RING;
  const int ndim = h[6] & ~IN_RING;
  if (!type_of(h[7], &r.dt)) throw FrameErr("frame: unknown dtype code " + std::to_string(h[7]));
  if (ndim > MAX_NDIM)
    throw FrameErr("frame: " + std::to_string(ndim) + " dims (max 8)");
  int32_t lay; int64_t stp; uint64_t nbytes;
  std::memcpy(&lay, h + 8, 4); std::memcpy(&stp, h + 12, 8); std::memcpy(&nbytes, h + 20, 8);
  r.shape.resize(ndim);
  c.read(r.shape.data(), 8 * ndim, "frame shape");
  int64_t n = 1;
  for (int64_t d : r.shape) {
    if (d < 0) throw FrameErr("frame: negative dimension in shape " + shape_str(r.shape));
    n *= d;
  }
  r.nbytes = n * int64_t(c10::elementSize(r.dt));
  if (uint64_t(r.nbytes) != nbytes)
    throw FrameErr("frame: shape " + shape_str(r.shape) + " of " + dtype_name(r.dt) +
                   " needs " + std::to_string(r.nbytes) + " bytes, header says " +
                   std::to_string(nbytes));
  if (lay != layer)
    throw FrameErr("frame: layer " + std::to_string(lay) + ", expected " + std::to_string(layer));
  if (stp != step)
    throw FrameErr("frame: step " + std::to_string(stp) + ", expected " + std::to_string(step));
  if (expect_shape && r.shape != *expect_shape)
    throw FrameErr("frame: shape " + shape_str(r.shape) + ", expected " +
                   shape_str(*expect_shape));
  return r;
}

// The payload of a frame whose header was read: where it sits in the ring (the caller
// reads it, then calls `release`), or nullptr when it is on the socket.
const uint8_t* ring_payload(const Head& h, Ring* ring) {
  if (!h.nbytes || !h.in_ring) return nullptr;
  if (!ring) throw FrameErr("frame says its payload is in a shared-memory ring; this "
                            "channel has none");
  return ring->data + ring->place(h.nbytes);
}
void release(const Head& h, Ring* ring) {  // the ring payload was read: the writer may reuse it
  ring->pos += h.nbytes;
  ring->consumed->store(ring->pos, std::memory_order_release);
}

// The payload of a frame whose header was read, copied to dst (nbytes) from the ring
// (which it then releases) or the socket.
void read_payload(Conn& c, Ring* ring, const Head& h, void* dst) {
  if (const uint8_t* src = ring_payload(h, ring)) {
    std::memcpy(dst, src, h.nbytes);
    release(h, ring);
  } else if (h.nbytes) {
    c.read(dst, h.nbytes, "frame payload");
  }
}

// The same into a new tensor of the frame's shape and dtype.
at::Tensor payload_tensor(Conn& c, Ring* ring, const Head& h) {
  at::Tensor t = at::empty(h.shape, at::TensorOptions().dtype(h.dt));
  read_payload(c, ring, h, t.data_ptr());
  return t;
}

// Reads and checks one frame -> its tensor.
at::Tensor recv_frame(Conn& c, Ring* ring, int64_t layer, int64_t step,
                      const std::vector<int64_t>* expect_shape = nullptr) {
  return payload_tensor(c, ring, recv_head(c, layer, step, expect_shape));
}

// Header into h (HEADER + 8 * ndim bytes) for a payload of `shape` and `dt`, whose size
// goes to nbytes. -> the ring offset the payload must be written at (the caller writes
// it, then adds nbytes to ring->pos), or -1: it goes on the socket after the header.
// A full ring is waited for, or with `wait` false (streamed steps, whose two ends may
// each be a ring ahead of the other) skipped: the payload goes on the socket.
int64_t stage_head(Ring* ring, const std::vector<int64_t>& shape, at::ScalarType dt,
                   int64_t layer, int64_t step, int timeout_ms, uint8_t* h, int64_t& nbytes,
                   bool wait = true) {
  nbytes = int64_t(c10::elementSize(dt));
  for (int64_t d : shape) nbytes *= d;
  std::memcpy(h, "LMNA", 4);
  std::memcpy(h + 4, &VERSION, 2);
  h[6] = uint8_t(shape.size());
  h[7] = uint8_t(code_of(dt));
  const int32_t lay = int32_t(layer);
  const uint64_t nb = uint64_t(nbytes);
  std::memcpy(h + 8, &lay, 4); std::memcpy(h + 12, &step, 8); std::memcpy(h + 20, &nb, 8);
  for (size_t i = 0; i < shape.size(); ++i) std::memcpy(h + HEADER + 8 * i, &shape[i], 8);
  if (!ring || nbytes < ring->min_bytes || nbytes > ring->cap / 2 || !nbytes) return -1;
  if (!wait && !ring->has_room(nbytes)) return -1;
  const int64_t off = ring->place(nbytes);
  const auto t0 = std::chrono::steady_clock::now();
  for (int spins = 0; !ring->has_room(nbytes); ++spins) {  // the reader is a full ring behind
    if (spins < 100) sched_yield(); else std::this_thread::sleep_for(std::chrono::microseconds(100));
    if (timeout_ms >= 0 && std::chrono::steady_clock::now() - t0 >
                               std::chrono::milliseconds(timeout_ms))
      throw Timeout("shared-memory ring: the peer read nothing in time");
  }
  h[6] |= IN_RING;
  return off;
}

// Header into h, payload of the contiguous t into the ring when it goes there;
// -> the iovecs a socket write must send (t must stay alive until then).
std::vector<iovec> stage_frame(Ring* ring, const at::Tensor& t, int64_t layer, int64_t step,
                               int timeout_ms, uint8_t* h, bool wait) {
  int64_t nbytes = 0;
  const int64_t off = stage_head(ring, t.sizes().vec(), t.scalar_type(), layer, step,
                                 timeout_ms, h, nbytes, wait);
  std::vector<iovec> iov{{h, size_t(HEADER + 8 * t.dim())}};
  if (off >= 0) {
    std::memcpy(ring->data + off, t.data_ptr(), nbytes);
    ring->pos += nbytes;
  } else if (nbytes) {
    iov.push_back({t.data_ptr(), size_t(nbytes)});
  }
  return iov;
}

void send_frame(Conn& c, Ring* ring, const at::Tensor& t, int64_t layer, int64_t step,
                int timeout_ms) {
  uint8_t h[HEADER + 8 * MAX_NDIM];
  c.write(stage_frame(ring, t, layer, step, timeout_ms, h, !c.drain));
}

// Runs f; -> (0, "") or the error as (status, message): 1 bad frame (FrameError), 2 timeout
// (PeerTimeout), 3 anything else.
template <typename F>
std::pair<int64_t, std::string> guarded(F&& f) {
  try {
    f();
  } catch (const FrameErr& e) {
    return {1, e.what()};
  } catch (const Timeout& e) {
    return {2, e.what()};
  } catch (const std::exception& e) {
    return {3, e.what()};
  }
  return {0, ""};
}

Ring make_ring(const c10::optional<at::Tensor>& data, const c10::optional<at::Tensor>& ctrl,
               int64_t pos, int64_t min_bytes) {
  Ring r;
  if (!data.has_value()) return r;
  r.data = data->data_ptr<uint8_t>();
  r.consumed = reinterpret_cast<std::atomic<int64_t>*>(ctrl->data_ptr<int64_t>());
  r.cap = data->numel();
  r.pos = pos;
  r.min_bytes = min_bytes;
  return r;
}

// pool[idx[i]] = rows[i]: one memcpy a row where the pool's rows and the new ones share
// a dtype and each row is contiguous (the q|k|v frame's views are); else index_copy_.
// idx was checked against the pool at the step's start.
void store_rows(const at::Tensor& pool, const at::Tensor& idx, const at::Tensor& rows) {
  const int64_t row = pool.stride(0), w = rows.size(1) * rows.size(2);
  if (rows.scalar_type() != pool.scalar_type() || rows.stride(2) != 1 ||
      rows.stride(1) != rows.size(2) || pool.stride(1) != pool.size(2) || w != row) {
    pool.index_copy_(0, idx, rows.to(pool.scalar_type()));
    return;
  }
  const int64_t es = rows.element_size(), n = rows.size(0), rs = rows.stride(0) * es;
  const int64_t* id = idx.data_ptr<int64_t>();
  auto* dst = static_cast<char*>(pool.data_ptr());
  const auto* src = static_cast<const char*>(rows.data_ptr());
  for (int64_t i = 0; i < n; ++i) std::memcpy(dst + id[i] * row * es, src + i * rs, w * es);
}

// o [n, Hq, Dv] and lse [n, Hq] (fp32) -> one [n, Hq, Dv + 1] tensor of `dt` (each row's
// lse as its last column), converted as Tensor.to does (round to nearest even).
at::Tensor o_lse(const at::Tensor& o, const at::Tensor& lse, at::ScalarType dt) {
  const int64_t n = o.size(0), hq = o.size(1), dv = o.size(2);
  at::Tensor out = at::empty({n, hq, dv + 1}, o.options().dtype(dt));
  const float* po = o.data_ptr<float>();
  const float* pl = lse.data_ptr<float>();
  auto fill = [&](auto* dst) {
    using T = std::remove_pointer_t<decltype(dst)>;
    for (int64_t r = 0; r < n * hq; ++r) {
      for (int64_t d = 0; d < dv; ++d) dst[r * (dv + 1) + d] = T(po[r * dv + d]);
      dst[r * (dv + 1) + dv] = T(pl[r]);
    }
  };
  if (dt == at::kFloat) fill(out.data_ptr<float>());
  else if (dt == at::kBFloat16) fill(out.data_ptr<at::BFloat16>());
  else if (dt == at::kHalf) fill(out.data_ptr<at::Half>());
  else throw FrameErr(std::string("cannot send attention output as ") + dtype_name(dt));
  return out;
}

}  // namespace

// x [N, H, D] float32 or bfloat16 -> int8 rows [N, H, D + 4], byte for byte
// lamina.kernels.quant.quantize_rows: per token and head y = x / c (fp32), s = max|y| /
// 127, codes round-half-even(y / s) in [-127, 127], then s's 4 bytes. One loop, not
// those ATen ops: at a decode step's few rows (B=32, context 1) a layer's exchange took
// 198-259 us against 275-280 (benchmarks/bench_dataplane.py --kv-dtype int8).
at::Tensor quantize_rows(const at::Tensor& x, const c10::optional<at::Tensor>& channel) {
  TORCH_CHECK(x.dim() == 3, "quantize_rows wants x [N, H, D]");
  const int64_t n = x.size(0), h = x.size(1), d = x.size(2);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor cf;
  if (channel.has_value()) {
    cf = channel->to(at::kFloat).contiguous();
    TORCH_CHECK(cf.numel() == h * d, "quantize_rows: channel scales must be [H, D]");
  }
  at::Tensor out = at::empty({n, h, d + 4}, xf.options().dtype(at::kChar));
  const float* src = xf.data_ptr<float>();
  const float* cs = channel.has_value() ? cf.data_ptr<float>() : nullptr;
  auto* dst = out.data_ptr<int8_t>();
  std::vector<float> y(d);
  for (int64_t r = 0; r < n * h; ++r) {
    const float* xr = src + r * d;
    const float* cr = cs ? cs + (r % h) * d : nullptr;
    float mx = 0.f;
    for (int64_t i = 0; i < d; ++i) {
      y[i] = cr ? xr[i] / cr[i] : xr[i];
      mx = std::max(mx, std::fabs(y[i]));
    }
    const float sc = mx / 127.0f, div = sc > 0.f ? sc : 1.f;
    int8_t* o = dst + r * (d + 4);
    for (int64_t i = 0; i < d; ++i)
      o[i] = static_cast<int8_t>(std::clamp(std::nearbyint(y[i] / div), -127.f, 127.f));
    std::memcpy(o + d, &sc, 4);
  }
  return out;
}

namespace {
double monotonic_s() {  // the clock Python's perf_counter reads on Linux
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}
}  // namespace

namespace {
// One stream group of a step's requests (all of them when the step is not streamed):
// its n query rows, its m KV rows' slots (idx) and its `SlotBatch`, rebased.
struct Group {
  int64_t n = 0, m = 0;
  at::Tensor idx, cu_q, q_pos, slots, cu_k, k_pos0;
};

// The step's groups from `ServeStep.group_ends` (`lamina.dataplane.protocol.stream_cuts`:
// contiguous whole requests, each answered by its own output frame).
std::vector<Group> step_groups(const ServeStep& s, const at::Tensor& idx, int64_t n, int64_t m) {
  if (s.group_ends.empty())
    return {Group{n, m, idx, s.cu_q, s.q_pos, s.slots, s.cu_k, s.k_pos0}};
  const int64_t b = s.cu_q.numel() - 1;
  TORCH_CHECK(n == m, "ServeStep.group_ends: a streamed step stores the k/v of exactly its "
              "query rows (", n, " query, ", m, " KV rows)");
  const at::Tensor cq = s.cu_q.to(at::kLong).contiguous(), ck = s.cu_k.to(at::kLong).contiguous();
  const int64_t *cqp = cq.data_ptr<int64_t>(), *ckp = ck.data_ptr<int64_t>();
  std::vector<Group> out;
  int64_t a = 0;
  for (int64_t e : s.group_ends) {
    TORCH_CHECK(a < e && e <= b, "ServeStep.group_ends must rise to the batch's ", b,
                " requests, got ", e, " after ", a);
    const int64_t q0 = cqp[a], q1 = cqp[e], k0 = ckp[a], k1 = ckp[e];
    out.push_back(Group{q1 - q0, q1 - q0, idx.narrow(0, q0, q1 - q0),
                        s.cu_q.narrow(0, a, e - a + 1) - q0, s.q_pos.narrow(0, q0, q1 - q0),
                        s.slots.narrow(0, k0, k1 - k0), s.cu_k.narrow(0, a, e - a + 1) - k0,
                        s.k_pos0.narrow(0, a, e - a)});
    a = e;
  }
  TORCH_CHECK(a == b, "ServeStep.group_ends end at request ", a, " of ", b);
  return out;
}

// One layer's q, k, v for a group (n query, m KV rows): one q|k|v frame x [n, F] split
// as views, or x as q and two more frames; every shape checked against the pool's.
void take_qkv(Conn& c, Ring* pin, const at::Tensor& x, int64_t layer, int64_t step,
              int64_t n, int64_t m, int64_t hkv, int64_t d, int64_t dv, const std::string& where,
              at::Tensor& q, at::Tensor& k, at::Tensor& v) {
  if (x.dim() == 2) {  // one q|k|v frame
    if (n != m || x.size(0) != n)
      throw FrameErr(where + ": a q|k|v frame of " + std::to_string(x.size(0)) +
                     " rows, expected " + std::to_string(n) + " query and " +
                     std::to_string(m) + " KV rows (one frame needs them equal)");
    const int64_t f = x.size(1), hq_d = f - hkv * (d + dv);
    if (hq_d <= 0 || hq_d % d || (hq_d / d) % hkv)
      throw FrameErr(where + " q|k|v frame: row width " + std::to_string(f) +
                     " is not Hq*D + Hkv*(D+Dv) with D=" + std::to_string(d) + ", Hkv=" +
                     std::to_string(hkv) + ", Dv=" + std::to_string(dv) +
                     " and Hq a multiple of Hkv");
    q = x.narrow(1, 0, hq_d).unflatten(1, {hq_d / d, d});
    k = x.narrow(1, hq_d, hkv * d).unflatten(1, {hkv, d});
    v = x.narrow(1, hq_d + hkv * d, hkv * dv).unflatten(1, {hkv, dv});
    return;
  }
  q = x;
  k = recv_frame(c, pin, layer, step);
  v = recv_frame(c, pin, layer, step);
  if (q.dim() != 3 || k.dim() != 3 || v.dim() != 3 || q.size(0) != n || k.size(0) != m ||
      v.size(0) != m)
    throw FrameErr(where + ": q/k/v rows " + std::to_string(q.size(0)) + "/" +
                   std::to_string(k.size(0)) + "/" + std::to_string(v.size(0)) +
                   ", expected " + std::to_string(n) + "/" + std::to_string(m) + "/" +
                   std::to_string(m));
  if (k.size(1) != hkv || k.size(2) != d || v.size(1) != hkv || v.size(2) != dv)
    throw FrameErr(where + ": k/v shapes " + shape_str(k.sizes().vec()) + "/" +
                   shape_str(v.sizes().vec()) + " do not fit the pool's [Hkv, D] = [" +
                   std::to_string(hkv) + ", " + std::to_string(d) + "]");
  if (q.size(2) != d || q.size(1) % hkv)
    throw FrameErr(where + ": q shape " + shape_str(q.sizes().vec()) +
                   " does not fit head_dim " + std::to_string(d) + " and " +
                   std::to_string(hkv) + " kv heads");
}

// One layer of one group: read its q/k/v, write k/v at its new slots, attend, send
// o|lse. t (or null): the attention's start and end and when the output was sent.
void serve_group(Conn& c, Ring* pin, Ring* pout, const MemoryLayers& layers, size_t layer,
                 int64_t step, const Group& g, const std::string& where, double* t) {
  const at::Tensor& kp = layers.k_pools[layer];
  const at::Tensor& vp = layers.v_pools[layer];
  const bool i8 = kp.scalar_type() == at::kChar;  // rows of codes and a scale a head
  const int64_t hkv = kp.size(1), d = kp.size(2) - (i8 ? 4 : 0), dv = vp.size(2) - (i8 ? 4 : 0);
  const c10::optional<at::Tensor> no_scales;
  const auto& channel = i8 && layer < layers.key_scales.size() ? layers.key_scales[layer]
                                                               : no_scales;
  const auto& sinks = layers.sinks[layer];
  // a q|k|v frame in the ring is read in place, and released once attended
  const Head hx = recv_head(c, layer, step);
  const uint8_t* in_ring = hx.shape.size() == 2 ? ring_payload(hx, pin) : nullptr;
  at::Tensor x = in_ring ? at::from_blob(const_cast<uint8_t*>(in_ring), hx.shape,
                                         at::TensorOptions().dtype(hx.dt))
                         : payload_tensor(c, pin, hx);
  at::Tensor q, k, v;
  take_qkv(c, pin, x, layer, step, g.n, g.m, hkv, d, dv, where, q, k, v);
  if (sinks.has_value() && sinks->numel() != q.size(1))
    throw FrameErr(where + ": " + std::to_string(q.size(1)) + " query heads, but layer " +
                   std::to_string(layer) + " has " + std::to_string(sinks->numel()) + " sinks");
  if (!at::isFloatingType(q.scalar_type()) || !at::isFloatingType(k.scalar_type()) ||
      !at::isFloatingType(v.scalar_type()))
    throw FrameErr(where + ": q/k/v must be floating point");
  if (t) t[0] = monotonic_s();
  if (g.m) {
    store_rows(kp, g.idx, i8 ? quantize_rows(k, channel) : k);
    store_rows(vp, g.idx, i8 ? quantize_rows(v, no_scales) : v);
  }
  // an int8 pool's keys are codes x a: q takes their channel scales (fold_channels)
  const at::Tensor qf = (channel.has_value()
                             ? q.to(at::kFloat) * channel->repeat_interleave(q.size(1) / hkv, 0)
                             : q.to(at::kFloat)).contiguous();
  auto ol = slot_attention(qf, kp, vp, g.cu_q, g.q_pos, g.slots, g.cu_k, g.k_pos0,
                           layers.scales[layer], layers.windows[layer], layers.softcaps[layer],
                           sinks, q.scalar_type() == at::kBFloat16);
  if (t) t[1] = monotonic_s();
  if (in_ring) release(hx, pin);  // attended: the writer may reuse it
  send_frame(c, pout, o_lse(ol[0], ol[1], q.scalar_type()), int64_t(layer), step,
             c.timeout_ms);
  if (t) t[2] = monotonic_s();
}
}  // namespace

// One step's layers for one micro-batch, group by group when it is streamed (each group
// attended as it arrives and answered at once, the next meanwhile in flight).
// -> (status, message): status 0 done, 1 bad frame (FrameError), 2 timeout
// (PeerTimeout), 3 other error; the ring cursors go back in s.
CallStatus serve_step(const MemoryLayers& layers, ServeStep& s) {
  pybind11::gil_scoped_release nogil;
  const int64_t step = s.step;
  Conn c{int(s.fd), int(s.timeout_ms), std::move(s.pending)};
  c.drain = s.group_ends.size() > 1;
  Ring rin = make_ring(s.ring_in.data, s.ring_in.ctrl, s.ring_in.pos, s.ring_min_bytes);
  Ring rout = make_ring(s.ring_out.data, s.ring_out.ctrl, s.ring_out.pos, s.ring_min_bytes);
  Ring* pin = s.ring_in.data.has_value() ? &rin : nullptr;
  Ring* pout = s.ring_out.data.has_value() ? &rout : nullptr;
  const int64_t n = s.cu_q.size(0) ? s.q_pos.size(0) : 0, m = s.new_slots.size(0);
  const size_t nl = layers.k_pools.size();
  auto [status, msg] = guarded([&] {
    const std::vector<Group> groups = step_groups(s, s.new_slots.to(at::kLong), n, m);
    const int64_t ng = int64_t(groups.size());
    double* times = nullptr;
    if (s.times.has_value()) {
      TORCH_CHECK(s.times->scalar_type() == at::kDouble && s.times->is_contiguous() &&
                      s.times->numel() == int64_t(3 * nl) * ng,
                  "ServeStep.times must be a contiguous fp64 [layers, groups, 3] tensor");
      times = s.times->data_ptr<double>();
    }
    for (size_t layer = 0; layer < nl; ++layer)
      for (int64_t j = 0; j < ng; ++j) {
        const std::string where = "step " + std::to_string(step) + " layer " +
                                  std::to_string(layer) +
                                  (ng > 1 ? " group " + std::to_string(j) : "");
        serve_group(c, pin, pout, layers, layer, step, groups[j], where,
                    times ? times + 3 * (int64_t(layer) * ng + j) : nullptr);
      }
    if (c.used < c.pending.size())  // read while sending, but no frame of this step
      throw FrameErr("step " + std::to_string(step) + ": " +
                     std::to_string(c.pending.size() - c.used) +
                     " bytes came past its last layer before its outputs were read");
  });
  s.ring_in.pos = rin.pos;
  s.ring_out.pos = rout.pos;
  return {status, msg, 0.0};
}

namespace {
struct Ends {  // the compute end's channels, one per memory worker
  std::vector<Conn> conns;
  std::vector<Ring> rings;
  Ends(const Peers& p, const std::vector<RingArgs>& dir, int64_t min_bytes) {
    if (p.timeouts_ms.size() != p.fds.size() || dir.size() != p.fds.size())
      throw std::invalid_argument("Peers: one timeout and one ring entry per worker");
    for (size_t w = 0; w < p.fds.size(); ++w) {
      conns.push_back(Conn{int(p.fds[w]), int(p.timeouts_ms[w]), std::string()});
      rings.push_back(make_ring(dir[w].data, dir[w].ctrl, dir[w].pos, min_bytes));
    }
  }
  void store(std::vector<RingArgs>& dir) const {  // the cursors back to the caller
    for (size_t w = 0; w < rings.size(); ++w) dir[w].pos = rings[w].pos;
  }
  Ring* ring(size_t w) { return rings[w].data ? &rings[w] : nullptr; }
  std::vector<int64_t> positions() const {
    std::vector<int64_t> p;
    for (const auto& r : rings) p.push_back(r.pos);
    return p;
  }
};
void check_rows(const LayerRows& rows, size_t workers) {
  const size_t nf = rows.starts.size();
  if (rows.ends.size() != nf || rows.workers.size() != nf || rows.rounds.size() != nf)
    throw std::invalid_argument("LayerRows: starts, ends, workers and rounds differ in length");
  for (size_t i = 0; i < nf; ++i)
    if (rows.workers[i] < 0 || size_t(rows.workers[i]) >= workers ||
        (i && rows.rounds[i] < rows.rounds[i - 1]))
      throw std::invalid_argument("LayerRows: frame " + std::to_string(i) + " names worker " +
                                  std::to_string(rows.workers[i]) + " of " +
                                  std::to_string(workers) + ", or its round falls");
}

// One layer's q [N, Hq, D], k [N, Hkv, D], v [N, Hkv, Dv] (any strides): frame i, rows
// starts[i]..ends[i], goes to worker workers[i] as one q|k|v frame [n_i, Hq*D +
// Hkv*(D+Dv)]. A round's frames are all built (and ring payloads written) before its
// first socket write, then its writes go out back to back (`SocketLink.submit` says
// why); the next round is built after.
void send_qkv(Ends& e, const std::vector<int64_t>& timeouts, const at::Tensor& q,
              const at::Tensor& k, const at::Tensor& v, const LayerRows& rows) {
  check_rows(rows, e.conns.size());
  const int64_t hq = q.size(1), d = q.size(2), hkv = k.size(1), dv = v.size(2),
                es = q.element_size(), f = hq * d + hkv * (d + dv);
  // Each (row, head) of q, k, v is a contiguous run of D (Dv) elements in the slices'
  // layout ([1, H, N, D] seen as [N, H, D]): rows are packed from those runs straight
  // into the frame's payload, with no [N, F] copy first.
  at::Tensor src[3] = {q, k, v};
  for (at::Tensor& t : src) {
    if (t.scalar_type() != q.scalar_type())
      throw std::invalid_argument("send_qkv: q, k and v must share one dtype");
    if (t.stride(2) != 1) t = t.contiguous();
  }
  const int64_t heads[3] = {hq, hkv, hkv}, width[3] = {d, d, dv};
  auto pack = [&](uint8_t* dst, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      uint8_t* out = dst + (r - r0) * f * es;
      for (int j = 0; j < 3; ++j) {
        const auto* base = static_cast<const uint8_t*>(src[j].data_ptr());
        const int64_t s0 = src[j].stride(0) * es, s1 = src[j].stride(1) * es,
                      run = width[j] * es;
        for (int64_t hh = 0; hh < heads[j]; ++hh, out += run)
          std::memcpy(out, base + r * s0 + hh * s1, run);
      }
    }
  };
  const size_t nf = rows.starts.size();
  const bool streamed = nf && rows.rounds.back() > 0;
  std::vector<std::vector<uint8_t>> head(nf);
  std::vector<std::vector<iovec>> iovs(nf);
  std::vector<at::Tensor> hold(nf);  // socket payloads, alive until written
  for (size_t a = 0, b = 0; a < nf; a = b) {
    for (b = a; b < nf && rows.rounds[b] == rows.rounds[a]; ++b) {  // stage the round
      const int64_t n = rows.ends[b] - rows.starts[b], w = rows.workers[b];
      if (n <= 0) continue;
      head[b].resize(HEADER + 8 * MAX_NDIM);
      Ring* ring = e.ring(w);
      int64_t nbytes = 0;
      const int64_t off = stage_head(ring, {n, f}, q.scalar_type(), rows.layer, rows.step,
                                     int(timeouts[w]), head[b].data(), nbytes, !streamed);
      iovs[b] = {{head[b].data(), size_t(HEADER + 8 * 2)}};  // a 2-d frame
      if (off >= 0) {
        pack(ring->data + off, rows.starts[b], rows.ends[b]);
        ring->pos += nbytes;
      } else if (nbytes) {
        hold[b] = at::empty({n, f}, q.options());
        pack(static_cast<uint8_t*>(hold[b].data_ptr()), rows.starts[b], rows.ends[b]);
        iovs[b].push_back({hold[b].data_ptr(), size_t(nbytes)});
      }
    }
    for (size_t i = a; i < b; ++i)  // then its writes
      if (!iovs[i].empty()) e.conns[rows.workers[i]].write(iovs[i]);
  }
}

// Each frame's output [n_i, Hq, Dv + 1] for rows starts[i]..ends[i] -> into o [N, Hq,
// Dv], read frame by frame in send order; shapes, layer and step checked first.
void recv_o(Ends& e, const LayerRows& rows, at::Tensor& o) {
  check_rows(rows, e.conns.size());
  const int64_t hq = o.size(1), dv = o.size(2);
  std::vector<uint8_t> scratch;
  for (size_t i = 0; i < rows.starts.size(); ++i) {
    const int64_t n = rows.ends[i] - rows.starts[i], w = rows.workers[i];
    if (n <= 0) continue;
    const std::vector<int64_t> want{n, hq, dv + 1};
    const Head h = recv_head(e.conns[w], rows.layer, rows.step, &want);
    if (h.dt != o.scalar_type() || !o.is_contiguous()) {  // converted by copy_
      const at::Tensor f = payload_tensor(e.conns[w], e.ring(w), h);
      o.narrow(0, rows.starts[i], n).copy_(f.narrow(2, 0, dv));
      continue;
    }
    // the payload in place in the ring, or read off the socket into scratch; then each
    // [Dv] run (the lse column left out) into its o row
    const uint8_t* ringed = ring_payload(h, e.ring(w));
    if (!ringed) {
      scratch.resize(h.nbytes);
      read_payload(e.conns[w], nullptr, h, scratch.data());
    }
    const uint8_t* src = ringed ? ringed : scratch.data();
    const int64_t es = o.element_size(), run = dv * es;
    auto* dst = static_cast<uint8_t*>(o.data_ptr()) + rows.starts[i] * hq * run;
    for (int64_t r = 0; r < n * hq; ++r) std::memcpy(dst + r * run, src + r * (run + es), run);
    if (ringed) release(h, e.ring(w));
  }
}
}  // namespace

// `send_qkv` alone.
CallStatus submit_qkv(Peers& peers, const LayerRows& rows, at::Tensor q, at::Tensor k,
                      at::Tensor v) {
  pybind11::gil_scoped_release nogil;
  Ends e(peers, peers.ring_out, peers.ring_min_bytes);
  auto [status, msg] = guarded([&] {
    send_qkv(e, peers.timeouts_ms, q, k, v, rows);
  });
  e.store(peers.ring_out);
  return {status, msg, 0.0};
}

// `recv_o` alone.
CallStatus collect_o(Peers& peers, const LayerRows& rows, at::Tensor o) {
  pybind11::gil_scoped_release nogil;
  Ends e(peers, peers.ring_in, 0);
  auto [status, msg] = guarded([&] {
    recv_o(e, rows, o);
  });
  e.store(peers.ring_in);
  return {status, msg, 0.0};
}

// Both in one call: the q/k/v out, then straight into the wait for the outputs (no
// return to Python between, so this thread leaves the core to the memory workers at
// once).
CallStatus exchange_qkv(Peers& peers, const LayerRows& rows, at::Tensor q, at::Tensor k,
                        at::Tensor v, at::Tensor o) {
  pybind11::gil_scoped_release nogil;
  Ends out(peers, peers.ring_out, peers.ring_min_bytes);
  Ends in(peers, peers.ring_in, 0);
  double sent_s = 0;
  auto [status, msg] = guarded([&] {
    const auto t0 = std::chrono::steady_clock::now();
    send_qkv(out, peers.timeouts_ms, q, k, v, rows);
    sent_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    recv_o(in, rows, o);
  });
  out.store(peers.ring_out);
  in.store(peers.ring_in);
  return {status, msg, sent_s};
}
