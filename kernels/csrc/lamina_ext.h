// The extension's functions that one source file defines and another calls or binds:
// the kernel (slot_attention.cpp) and the data plane's fast paths (dataplane.cpp).
#pragma once
#include <torch/extension.h>

#include <string>
#include <tuple>
#include <vector>

// Attention over a token-slot KV pool (slot_attention.cpp): -> {o, lse}.
std::vector<at::Tensor> slot_attention(at::Tensor q, at::Tensor k_pool, at::Tensor v_pool,
                                       at::Tensor cu_q, at::Tensor q_pos, at::Tensor slots,
                                       at::Tensor cu_k, at::Tensor k_pos0, double scale,
                                       int64_t window, double softcap,
                                       c10::optional<at::Tensor> sinks, bool q_bf16);

// dataplane.cpp: a memory worker's layers of one step.
std::tuple<int64_t, std::string, int64_t, int64_t> serve_step(
    int64_t fd, std::string pending, int64_t timeout_ms, int64_t step,
    std::vector<at::Tensor> k_pools, std::vector<at::Tensor> v_pools, at::Tensor new_slots,
    at::Tensor cu_q, at::Tensor q_pos, at::Tensor slots, at::Tensor cu_k, at::Tensor k_pos0,
    std::vector<double> scales, std::vector<int64_t> windows, std::vector<double> softcaps,
    std::vector<c10::optional<at::Tensor>> sinks,
    c10::optional<at::Tensor> ring_in, c10::optional<at::Tensor> ring_in_ctrl, int64_t in_pos,
    c10::optional<at::Tensor> ring_out, c10::optional<at::Tensor> ring_out_ctrl,
    int64_t out_pos, int64_t ring_min_bytes);

// dataplane.cpp: the compute end's send of one layer's q|k|v slices.
std::tuple<int64_t, std::string, std::vector<int64_t>> submit_qkv(
    std::vector<int64_t> fds, std::vector<int64_t> timeouts,
    std::vector<c10::optional<at::Tensor>> ring_data,
    std::vector<c10::optional<at::Tensor>> ring_ctrl, std::vector<int64_t> ring_pos,
    int64_t ring_min_bytes, at::Tensor q, at::Tensor k, at::Tensor v,
    std::vector<int64_t> starts, std::vector<int64_t> ends, int64_t layer, int64_t step);

// dataplane.cpp: the compute end's read of one layer's outputs into o.
std::tuple<int64_t, std::string, std::vector<int64_t>> collect_o(
    std::vector<int64_t> fds, std::vector<int64_t> timeouts,
    std::vector<c10::optional<at::Tensor>> ring_data,
    std::vector<c10::optional<at::Tensor>> ring_ctrl, std::vector<int64_t> ring_pos,
    std::vector<int64_t> starts, std::vector<int64_t> ends, int64_t layer, int64_t step,
    at::Tensor o);

// dataplane.cpp: submit_qkv then collect_o in one call (no return to Python between).
std::tuple<int64_t, std::string, std::vector<int64_t>, double> exchange_qkv(
    std::vector<int64_t> fds, std::vector<int64_t> timeouts,
    std::vector<c10::optional<at::Tensor>> out_data,
    std::vector<c10::optional<at::Tensor>> out_ctrl,
    std::vector<c10::optional<at::Tensor>> in_data,
    std::vector<c10::optional<at::Tensor>> in_ctrl, std::vector<int64_t> ring_pos,
    int64_t ring_min_bytes, at::Tensor q, at::Tensor k, at::Tensor v,
    std::vector<int64_t> starts, std::vector<int64_t> ends, int64_t layer, int64_t step,
    at::Tensor o);

// pointwise.cpp: fused pointwise ops for the dense slices (lamina.splitter.fuse).
at::Tensor fused_rms_norm(at::Tensor x, at::Tensor w, double eps);
at::Tensor fused_rope(at::Tensor x, at::Tensor cos, at::Tensor sin);
at::Tensor fused_silu_mul(at::Tensor gate, at::Tensor up);
// pointwise.cpp: greedy sampling's row argmax (torch.argmax's first-max and NaN rules).
at::Tensor argmax_rows(at::Tensor x);
