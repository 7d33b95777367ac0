// The extension's Python bindings, and nothing else: the functions live in
// slot_attention.cpp (the kernel, bandwidth probes), page_select.cpp (topk's pages),
// dataplane.cpp (the data plane's C++ ends), pointwise.cpp (fused pointwise ops, row
// argmax), prompt_flash.cpp (bf16 prompt attention) and linear_bf16.cpp (bf16 linears);
// lamina_ext.h declares them.
#include <torch/extension.h>

#include "lamina_ext.h"

namespace py = pybind11;

namespace {

void bind_attention(py::module& m) {
  m.def("slot_attention", &slot_attention, "attention over a token-slot KV pool (CPU)");
  m.def("read_sum", &read_sum, "streaming read of a float tensor");
  m.def("simd_paths", &simd_paths, "the SIMD paths compiled in");
  m.def("slot_scores", &slot_scores, "one query's logits against the keys at a slot list");
  m.def("page_pick", &page_pick, "topk's pages for a step's decode rows (Quest bounds)",
        py::arg("q"), py::arg("bounds"), py::arg("params"), py::arg("table") = py::none(),
        py::arg("page_slots") = std::vector<at::Tensor>());
  m.def("prompt_flash_bf16", &prompt_flash_bf16,
        "bf16 prompt attention over contiguous k / v (AVX512-BF16)");
  m.def("prompt_flash_compiled", &prompt_flash_compiled,
        "whether this build has prompt_flash_bf16 (the CPU has AVX512-BF16)");
  m.def("read_rows", &read_rows, "read the K/V rows of a slot list (bandwidth ceiling)");
  m.def("quantize_rows", &quantize_rows, "int8 KV rows, as lamina.kernels.quant's",
        py::arg("x"), py::arg("channel") = py::none());
}

// A struct's field as a read-write attribute of the same name.
#define LAMINA_FIELD(T, f) .def_readwrite(#f, &T::f)

void bind_dataplane(py::module& m) {
  py::class_<RingArgs>(m, "RingArgs", "one direction of a channel's shared-memory ring")
      .def(py::init<>()) LAMINA_FIELD(RingArgs, data) LAMINA_FIELD(RingArgs, ctrl)
      LAMINA_FIELD(RingArgs, pos);
  py::class_<MemoryLayers>(m, "MemoryLayers", "a memory worker's pools and layer parameters")
      .def(py::init<>()) LAMINA_FIELD(MemoryLayers, k_pools) LAMINA_FIELD(MemoryLayers, v_pools)
      LAMINA_FIELD(MemoryLayers, scales) LAMINA_FIELD(MemoryLayers, windows)
      LAMINA_FIELD(MemoryLayers, softcaps) LAMINA_FIELD(MemoryLayers, sinks)
      LAMINA_FIELD(MemoryLayers, key_scales);
  py::class_<ServeStep>(m, "ServeStep", "one micro-batch step's inputs on a memory worker")
      .def(py::init<>()) LAMINA_FIELD(ServeStep, fd) LAMINA_FIELD(ServeStep, pending)
      LAMINA_FIELD(ServeStep, timeout_ms) LAMINA_FIELD(ServeStep, step)
      LAMINA_FIELD(ServeStep, new_slots) LAMINA_FIELD(ServeStep, cu_q)
      LAMINA_FIELD(ServeStep, q_pos) LAMINA_FIELD(ServeStep, slots)
      LAMINA_FIELD(ServeStep, cu_k) LAMINA_FIELD(ServeStep, k_pos0)
      LAMINA_FIELD(ServeStep, ring_in) LAMINA_FIELD(ServeStep, ring_out)
      LAMINA_FIELD(ServeStep, ring_min_bytes) LAMINA_FIELD(ServeStep, group_ends)
      LAMINA_FIELD(ServeStep, times);
  py::class_<CallStatus>(m, "CallStatus", "what a data-plane call reports")
      .def_readonly("status", &CallStatus::status)
      .def_readonly("message", &CallStatus::message)
      .def_readonly("sent_s", &CallStatus::sent_s);
  py::class_<Peers>(m, "Peers", "the compute end's channels, one entry per memory worker")
      .def(py::init<>()) LAMINA_FIELD(Peers, fds) LAMINA_FIELD(Peers, timeouts_ms)
      LAMINA_FIELD(Peers, ring_out) LAMINA_FIELD(Peers, ring_in)
      LAMINA_FIELD(Peers, ring_min_bytes);
  py::class_<LayerRows>(m, "LayerRows", "one layer's frames: packed rows, worker, round")
      .def(py::init<>()) LAMINA_FIELD(LayerRows, starts) LAMINA_FIELD(LayerRows, ends)
      LAMINA_FIELD(LayerRows, workers) LAMINA_FIELD(LayerRows, rounds)
      LAMINA_FIELD(LayerRows, layer) LAMINA_FIELD(LayerRows, step);
  m.def("serve_step", &serve_step, "a memory worker's layers of one step (GIL released)",
        py::arg("layers"), py::arg("step"));
  m.def("submit_qkv", &submit_qkv, "one layer's q|k|v rows to each memory worker",
        py::arg("peers"), py::arg("rows"), py::arg("q"), py::arg("k"), py::arg("v"));
  m.def("collect_o", &collect_o, "one layer's attention outputs from each memory worker",
        py::arg("peers"), py::arg("rows"), py::arg("o"));
  m.def("exchange_qkv", &exchange_qkv, "submit_qkv then collect_o, GIL released throughout",
        py::arg("peers"), py::arg("rows"), py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("o"));
}

void bind_pointwise(py::module& m) {
  m.def("rms_norm", &fused_rms_norm, "weight * to(x32 * rsqrt(mean(x32^2) + eps), x.dtype)");
  m.def("rope", &fused_rope, "x * cos + rotate_half(x) * sin, rounded as eager");
  m.def("silu_mul", &fused_silu_mul, "silu(gate) * up, rounded as eager");
  m.def("pack_linear_bf16", &pack_linear_bf16, "a bf16 weight [out, in] packed for linear_bf16");
  m.def("linear_bf16", &linear_bf16, "x . w^T + bias on a packed bf16 weight (AVX512-BF16)",
        py::arg("x"), py::arg("packed"), py::arg("out_features"), py::arg("bias") = py::none());
  m.def("linear_bf16_compiled", &linear_bf16_compiled,
        "whether this build has linear_bf16 (the CPU has AVX512-BF16)");
  m.def("argmax_rows", &argmax_rows, "first index of each row's maximum (NaN counts as max)");
  m.def("masked_argmax_rows", &masked_argmax_rows,
        "argmax_rows over the tokens each row's bitmask allows (-1: none)");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  bind_attention(m);
  bind_dataplane(m);
  bind_pointwise(m);
}
