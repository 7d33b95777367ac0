// The extension's functions and argument structs, defined in one source file and called
// from another or bound in bindings.cpp: the kernel (slot_attention.cpp), the data
// plane's C++ ends (dataplane.cpp) and the pointwise ops (pointwise.cpp).
#pragma once
#include <ATen/ATen.h>

#include <string>
#include <tuple>
#include <vector>

// Attention over a token-slot KV pool (slot_attention.cpp): -> {o, lse}.
std::vector<at::Tensor> slot_attention(at::Tensor q, at::Tensor k_pool, at::Tensor v_pool,
                                       at::Tensor cu_q, at::Tensor q_pos, at::Tensor slots,
                                       at::Tensor cu_k, at::Tensor k_pos0, double scale,
                                       int64_t window, double softcap,
                                       c10::optional<at::Tensor> sinks, bool q_bf16);

// Prompt attention over contiguous bf16 k / v [m, Hkv, D] (prompt_flash.cpp): q
// [n, Hq, D] bf16 -> {o [n, Hq, D] fp32, lse [n, Hq] fp32}; causal: q are the last n of
// the m key positions. Compiled in only with AVX512-BF16 (prompt_flash_compiled()).
std::vector<at::Tensor> prompt_flash_bf16(at::Tensor q, at::Tensor k, at::Tensor v,
                                          bool causal, double scale);
bool prompt_flash_compiled();

// bf16 linears (linear_bf16.cpp): a weight [O, I] packed once, then y [..., O] bf16 =
// x [..., I] . w^T + bias. Compiled in only with AVX512-BF16 (linear_bf16_compiled()).
at::Tensor pack_linear_bf16(const at::Tensor& w);
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                       const c10::optional<at::Tensor>& bias);
bool linear_bf16_compiled();

// One direction of a channel's shared-memory ring; absent (no data) when the channel
// has none. `pos` is the cursor, moved by the call and handed back.
struct RingArgs {
  c10::optional<at::Tensor> data;  // uint8 [capacity]: the mapped ring
  c10::optional<at::Tensor> ctrl;  // int64 [n]: its control words
  int64_t pos = 0;
};

// What a memory worker's steps share, set once when it starts serving: per layer, its
// pool and attention parameters.
struct MemoryLayers {
  std::vector<at::Tensor> k_pools, v_pools;  // [slots, Hkv, D] / [slots, Hkv, Dv]
  std::vector<double> scales;
  std::vector<int64_t> windows;  // -1: none
  std::vector<double> softcaps;  // 0: none
  std::vector<c10::optional<at::Tensor>> sinks;  // fp32 [Hq] or none
  // int8 pools ([slots, Hkv, D + 4] rows): the keys' channel scales, fp32 [Hkv, D], or
  // none (lamina.kernels.quant); empty: no layer has any
  std::vector<c10::optional<at::Tensor>> key_scales;
};

// One step of one micro-batch on a memory worker: its connection, the step's slot
// metadata (the `SlotBatch` and the new k/v slots) and the rings.
struct ServeStep {
  int64_t fd = -1;
  std::string pending;  // bytes the Python channel already read past the metadata
  int64_t timeout_ms = -1;  // -1: wait forever
  int64_t step = 0;
  at::Tensor new_slots, cu_q, q_pos, slots, cu_k, k_pos0;  // int32, checked per step
  RingArgs ring_in, ring_out;
  int64_t ring_min_bytes = 0;  // payloads this big or more go through a ring
  // streamed (paper 5.2): the request index where each group ends, rising to the batch
  // size (`lamina.dataplane.protocol.stream_cuts`); empty: the step is one group
  std::vector<int64_t> group_ends;
  // tracing: fp64 [layers, groups, 3], each group's attention (k/v writes and the kernel)
  // start and end and its output's send end, in CLOCK_MONOTONIC seconds (Python's
  // perf_counter); none: not kept
  c10::optional<at::Tensor> times;
};

// What a data-plane call reports: status 0 done, 1 bad frame (FrameError), 2 timeout
// (PeerTimeout), 3 other error; the message says which; sent_s: exchange_qkv's time
// spent sending. Ring cursors are written back into the arguments' RingArgs.
struct CallStatus {
  int64_t status = 0;
  std::string message;
  double sent_s = 0;
};

// dataplane.cpp: float rows [N, H, D] -> int8 rows [N, H, D + 4], the same bytes as
// lamina.kernels.quant.quantize_rows (channel: the keys' scales [H, D], or none).
at::Tensor quantize_rows(const at::Tensor& x, const c10::optional<at::Tensor>& channel);

// dataplane.cpp: a memory worker's layers of one step (s.ring_in/ring_out.pos moved).
CallStatus serve_step(const MemoryLayers& layers, ServeStep& s);

// The compute end's channels, one entry per memory worker, set once a step.
struct Peers {
  std::vector<int64_t> fds;
  std::vector<int64_t> timeouts_ms;  // -1: wait forever
  std::vector<RingArgs> ring_out, ring_in;  // to / from each worker (no data: none)
  int64_t ring_min_bytes = 0;
};

// One layer's frames of one step, in send order: frame i carries packed rows
// starts[i]..ends[i] to worker workers[i]; rounds[i] (rising) groups them, a round's
// frames built and then written back to back before the next round is built (a
// streamed worker's g-th group is in round g; paper 5.2).
struct LayerRows {
  std::vector<int64_t> starts, ends, workers, rounds;
  int64_t layer = 0, step = 0;
};

// dataplane.cpp: the compute end's send of one layer's q|k|v slices, its read of the
// outputs into o [N, Hq, Dv], and both in one call (no return to Python between).
CallStatus submit_qkv(Peers& peers, const LayerRows& rows, at::Tensor q, at::Tensor k,
                      at::Tensor v);
CallStatus collect_o(Peers& peers, const LayerRows& rows, at::Tensor o);
CallStatus exchange_qkv(Peers& peers, const LayerRows& rows, at::Tensor q, at::Tensor k,
                        at::Tensor v, at::Tensor o);

// pointwise.cpp: fused pointwise ops for the dense slices (lamina.splitter.fuse).
at::Tensor fused_rms_norm(at::Tensor x, at::Tensor w, double eps);
at::Tensor fused_rope(at::Tensor x, at::Tensor cos, at::Tensor sin);
at::Tensor fused_silu_mul(at::Tensor gate, at::Tensor up);
// pointwise.cpp: greedy sampling's row argmax (torch.argmax's first-max and NaN rules).
at::Tensor argmax_rows(at::Tensor x);
// the same over the tokens each row's bitmask allows (uint8 [rows, >= vocab / 8]); -1: none
at::Tensor masked_argmax_rows(at::Tensor x, at::Tensor bits);

// slot_attention.cpp: one query's logits against the keys at a slot list [Hq, c].
at::Tensor slot_scores(at::Tensor q, at::Tensor k, at::Tensor slots, double scale,
                       double softcap);

// slot_attention.cpp: bandwidth probes and the SIMD paths compiled in.
double read_sum(at::Tensor x);
double read_rows(at::Tensor k, at::Tensor v, at::Tensor slots);
// topk's pages for a step's decode rows (page_select.cpp): {key indices, row offsets,
// slots, stale pages}.
std::vector<at::Tensor> page_pick(at::Tensor q, std::vector<at::Tensor> bounds,
                                  at::Tensor params, c10::optional<at::Tensor> table,
                                  std::vector<at::Tensor> page_slots);
std::vector<std::string> simd_paths();
