"""Bad inputs are rejected before any backend runs; backend choice is explicit and logged."""
import logging

import pytest
import torch

import lamina.kernels.backends as backends
from lamina.kernels import (
    AttentionBackend,
    AttentionInputError,
    AttentionParams,
    BackendUnavailable,
    KernelBuildError,
    ReferenceBackend,
    SlotBatch,
    attend,
    decode_attention,
    select_backend,
    write_kv,
)


class Spy(AttentionBackend):
    name = "spy"

    def __init__(self):
        self.calls = 0

    def attend(self, *a):
        self.calls += 1
        raise AssertionError("backend must not run on bad input")


def good():
    k = torch.randn(10, 2, 8)
    v = torch.randn(10, 2, 8)
    q = torch.randn(2, 4, 8)
    return q, k, v, SlotBatch.decode([[0, 1, 2], [9]]), AttentionParams(0.3)


def with_batch(**kw):
    b = good()[3]
    fields = dict(cu_q=b.cu_q, q_pos=b.q_pos, slots=b.slots, cu_k=b.cu_k, k_pos0=b.k_pos0)
    fields.update(kw)
    return SlotBatch(**fields)


BAD = {
    "q int dtype": (lambda q, k, v, b, p: (q.long(), k, v, b, p), "q dtype"),
    "fp16 pool": (lambda q, k, v, b, p: (q, k.half(), v.half(), b, p), "k_pool/v_pool dtypes"),
    "mixed pool dtypes": (lambda q, k, v, b, p: (q, k, v.bfloat16(), b, p), "k_pool/v_pool dtypes"),
    "q 2-D": (lambda q, k, v, b, p: (q[0], k, v, b, p), "q must be 3-D"),
    "head_dim": (lambda q, k, v, b, p: (q[..., :4], k, v, b, p), "head_dim"),
    "heads": (lambda q, k, v, b, p: (q[:, :3], k, v, b, p), "not a multiple"),
    "pool shapes": (lambda q, k, v, b, p: (q, k, v[:5], b, p), "disagree"),
    "device": (lambda q, k, v, b, p: (q, k.to("meta"), v.to("meta"), b, p), "different devices"),
    "slot too big": (lambda q, k, v, b, p: (q, k, v, SlotBatch.decode([[0, 1, 10], [9]]), p),
                     "slot ids out of range"),
    "negative slot": (lambda q, k, v, b, p: (q, k, v, SlotBatch.decode([[0, -1], [9]]), p),
                      "slot ids out of range"),
    "int64 slots": (lambda q, k, v, b, p: (q, k, v, with_batch(slots=b.slots.long()), p),
                    "batch.slots must be a 1-D int32"),
    "query count": (lambda q, k, v, b, p: (q[:1], k, v, b, p), "q has 1 rows"),
    "cu_k": (lambda q, k, v, b, p: (q, k, v, with_batch(cu_k=torch.tensor([0, 5, 4],
                                                                         dtype=torch.int32)), p),
             "cu_k must rise"),
    "sinks": (lambda q, k, v, b, p: (q, k, v, b, AttentionParams(0.3, sinks=(1.0,))), "sinks for"),
    "params type": (lambda q, k, v, b, p: (q, k, v, b, {"scale": 1}), "params must be"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_raises_before_backend(case):
    make, msg = BAD[case]
    spy = Spy()
    with pytest.raises(AttentionInputError, match=msg):
        attend(*make(*good()), backend=spy)
    assert spy.calls == 0


def test_decode_needs_one_query_per_request():
    q, k, v, _, p = good()
    with pytest.raises(AttentionInputError, match="one query per request"):
        decode_attention(q, k, v, SlotBatch.build([[0, 1], [2, 3]], [2, 1]), p, Spy())


@pytest.mark.parametrize("kw,msg", [({"scale": 0.0}, "scale"), ({"scale": float("nan")}, "scale"),
                                    ({"scale": 1.0, "sliding_window": 0}, "sliding_window"),
                                    ({"scale": 1.0, "softcap": -1.0}, "softcap"),
                                    ({"scale": 1.0, "sinks": (float("inf"),)}, "sinks")])
def test_bad_params(kw, msg):
    with pytest.raises(ValueError, match=msg):
        AttentionParams(**kw)


def test_slot_batch_builder_errors():
    with pytest.raises(ValueError, match="only 1 slots"):
        SlotBatch.build([[3]], [2])
    with pytest.raises(ValueError, match="2 slot tables but 1"):
        SlotBatch.build([[1], [2]], [1])
    with pytest.raises(ValueError, match="start positions"):
        SlotBatch.decode([[1]], start=[-1])


def test_write_kv_errors_leave_pool_untouched():
    k, v = torch.zeros(4, 2, 3), torch.zeros(4, 2, 3)
    with pytest.raises(AttentionInputError, match="out of range"):
        write_kv(k, v, torch.tensor([1, 4]), torch.ones(2, 2, 3), torch.ones(2, 2, 3))
    with pytest.raises(AttentionInputError, match=r"k must be \[2, 2, 3\]"):
        write_kv(k, v, torch.tensor([1, 2]), torch.ones(2, 3, 3), torch.ones(2, 2, 3))
    assert not k.any() and not v.any()
    write_kv(k, v, torch.tensor([3, 0]), torch.ones(2, 2, 3), 2 * torch.ones(2, 2, 3))
    assert k[[0, 3]].eq(1).all() and not k[[1, 2]].any() and v[[0, 3]].eq(2).all()


def test_select_backend_auto_prefers_compiled_kernel(cpu, caplog):
    with caplog.at_level(logging.INFO, logger="lamina.kernels"):
        b = select_backend("auto")
    assert b.name == "cpu" and "attention backend: cpu" in caplog.text


def test_select_backend_falls_back_with_reason(monkeypatch, caplog):
    def broken():
        raise KernelBuildError("no C++ compiler (c++/g++) on PATH")

    monkeypatch.setattr(backends, "load_cpu_kernel", broken)
    with caplog.at_level(logging.WARNING, logger="lamina.kernels"):
        b = select_backend("auto")
    assert isinstance(b, ReferenceBackend) and "no C++ compiler" in b.reason
    assert "attention backend: reference" in caplog.text and "no C++ compiler" in caplog.text
    with pytest.raises(BackendUnavailable, match="no C\\+\\+ compiler"):
        select_backend("cpu")


def test_select_backend_env_and_errors(monkeypatch):
    monkeypatch.setenv("LAMINA_ATTENTION_BACKEND", "reference")
    assert select_backend().name == "reference"
    with pytest.raises(BackendUnavailable, match="unknown attention backend 'cuda-fast'"):
        select_backend("cuda-fast")
    b = select_backend("auto", device="meta")  # no GPU kernel here: reference, with reason
    assert b.name == "reference" and "no attention kernel for meta" in b.reason
    with pytest.raises(BackendUnavailable, match="cannot serve a pool on meta"):
        select_backend("cpu", device="meta")


@pytest.mark.parametrize("triton_v, numpy_v, refused", [
    ("3.6.0", "2.4.6", True), ("3.6.0", "2.3.5", False), ("3.7.0", "2.4.6", False),
    ("3.9.0+git1a2b", "2.10.0", False), ("3.4.0", "1.26.4", False),
])
def test_an_interpreter_that_cannot_run_is_refused_by_name(monkeypatch, triton_v, numpy_v,
                                                             refused):
    """Triton < 3.7's interpreter converts 1-element arrays to ints, which NumPy 2.4
    refuses: that pair is a BackendUnavailable naming both versions and the way out."""
    import numpy

    monkeypatch.setattr(numpy, "__version__", numpy_v)
    if refused:
        with pytest.raises(BackendUnavailable, match=f"Triton {triton_v}'s interpreter cannot "
                                                     f"run on NumPy {numpy_v}.*triton>=3.7"):
            backends._check_interpreter(triton_v)
    else:
        backends._check_interpreter(triton_v)
