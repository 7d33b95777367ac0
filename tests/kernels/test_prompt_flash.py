"""The bf16 prompt kernel (`kernels/csrc/prompt_flash.cpp`) against NumPy float64 math on
the same bf16 values, and against torch's flash kernel's own error; which kernel
`prompt_sdpa` picks on which CPU."""
import numpy as np
import pytest
import torch

from lamina.kernels import AttentionParams, SlotBatch, prompt_sdpa
from lamina.kernels.cpu_build import load_cpu_kernel


@pytest.fixture(scope="module")
def ext(cpu):  # `cpu` builds the extension (a build failure fails the suite there)
    ext = load_cpu_kernel()
    if not ext.prompt_flash_compiled():
        pytest.skip("this CPU has no AVX512-BF16: the bf16 prompt kernel is not built in "
                    "(torch's flash kernel serves bf16 prompts)")
    return ext


def numpy_attention(q, k, v, causal, scale):
    """q [n, Hq, D], k / v [m, Hkv, D] -> o [n, Hq, D], lse [n, Hq] in float64; causal:
    query i is key position m - n + i."""
    q, k, v = (x.double().numpy() for x in (q, k, v))
    n, Hq, _ = q.shape
    m, Hkv, _ = k.shape
    rep = Hq // Hkv
    o, lse = np.zeros(q.shape), np.zeros((n, Hq))
    for h in range(Hq):
        s = q[:, h] @ k[:, h // rep].T * scale  # [n, m]
        if causal:
            s[np.arange(m)[None, :] > np.arange(n)[:, None] + (m - n)] = -np.inf
        top = s.max(-1, keepdims=True)
        e = np.exp(s - top)
        lse[:, h] = np.log(e.sum(-1)) + top[:, 0]
        o[:, h] = (e / e.sum(-1, keepdims=True)) @ v[:, h // rep]
    return o, lse


def _inputs(n, m, Hq, Hkv, D, seed=0, q_mul=1.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(n, Hq, D, generator=g) * q_mul).bfloat16()
    k = torch.randn(m, Hkv, D, generator=g).bfloat16()
    return q, k, torch.randn(m, Hkv, D, generator=g).bfloat16()


@pytest.mark.parametrize("n,m,Hq,Hkv,D,causal", [
    (1, 1, 2, 1, 64, True),          # one query, one key
    (5, 5, 4, 4, 32, True),          # fewer rows than a micro-tile
    (100, 100, 9, 3, 64, True),      # a prompt: ragged query and key blocks
    (96, 1120, 9, 3, 64, True),      # a chunk after 1024 keys
    (77, 50, 16, 2, 128, False),     # past every key (a KV range of a split sequence)
    (130, 200, 8, 8, 256, True),
    (33, 1000, 6, 2, 64, False),
], ids=["1x1", "tiny", "prompt", "chunk", "past-all", "d256", "past-all-gqa3"])
def test_bf16_prompt_kernel_matches_numpy(ext, n, m, Hq, Hkv, D, causal):
    q, k, v = _inputs(n, m, Hq, Hkv, D)
    o, lse = ext.prompt_flash_bf16(q, k, v, causal, D ** -0.5)
    o_ref, lse_ref = numpy_attention(q, k, v, causal, D ** -0.5)
    assert o.dtype == lse.dtype == torch.float32 and o.shape == (n, Hq, D)
    # probabilities are rounded to bf16 before the values' products (2^-9 relative)
    np.testing.assert_allclose(o.numpy(), o_ref, atol=1e-2, rtol=0)
    np.testing.assert_allclose(lse.numpy(), lse_ref, atol=1e-4, rtol=1e-6)


def test_bf16_prompt_kernel_no_worse_than_torch_flash(ext):
    """Peaked scores (q x 8: online-softmax rescaling in every block): our error within
    1.25x of torch's bf16 flash kernel's, both against float64."""
    n, m, D = 640, 2048, 64
    q, k, v = _inputs(n, m, 9, 3, D, seed=3, q_mul=8.0)
    o_ref, lse_ref = numpy_attention(q, k, v, True, D ** -0.5)
    o, lse = ext.prompt_flash_bf16(q, k, v, True, D ** -0.5)
    params = AttentionParams(D ** -0.5)
    batch = SlotBatch.build([list(range(m))], [n])
    o_t, lse_t = prompt_sdpa.attend_taken(q, k, v, batch, params, 0, n, ours=False)
    ours, theirs = np.abs(o.numpy() - o_ref).max(), np.abs(o_t.numpy() - o_ref).max()
    assert ours <= 1.25 * theirs, (ours, theirs)
    assert np.abs(lse.numpy() - lse_ref).max() <= 1e-4 + np.abs(lse_t.numpy() - lse_ref).max()


@pytest.mark.parametrize("ours", [True, False], ids=["ours", "torch"])
def test_attend_taken_either_kernel_on_scattered_slots(cpu, ours):
    """A bf16 pool: a chunk after earlier keys (own = n) and a request past all its keys
    (own = 0), its keys on scattered slots, through either kernel."""
    if ours and not load_cpu_kernel().prompt_flash_compiled():
        pytest.skip("this CPU has no AVX512-BF16: the bf16 prompt kernel is not built in")
    g = torch.Generator().manual_seed(5)
    pool_k = torch.randn(3000, 3, 64, generator=g).bfloat16()
    pool_v = torch.randn(3000, 3, 64, generator=g).bfloat16()
    perm = torch.randperm(3000, generator=g).tolist()
    tables, n = [perm[:700], perm[700:1000]], 200
    batch = SlotBatch.build(tables, [n, n], q_pos=[list(range(500, 700)), list(range(300, 500))])
    assert prompt_sdpa.take(batch) == {0: n, 1: 0}
    q = torch.randn(2 * n, 9, 64, generator=g).bfloat16()
    params = AttentionParams(0.125)
    for b, own in ((0, n), (1, 0)):
        o, lse = prompt_sdpa.attend_taken(q, pool_k, pool_v, batch, params, b, own, ours=ours)
        idx = torch.tensor(tables[b])
        o_ref, lse_ref = numpy_attention(q[b * n:(b + 1) * n], pool_k[idx], pool_v[idx],
                                         own > 0, 0.125)
        np.testing.assert_allclose(o.numpy(), o_ref, atol=1e-2, rtol=0)
        np.testing.assert_allclose(lse.numpy(), lse_ref, atol=1e-4, rtol=1e-6)


def test_kernel_choice_follows_the_cpu(cpu, monkeypatch):
    """Ours only where built in and the CPU has no AMX (torch's runs bf16 on AMX tiles)."""
    from lamina.kernels import cpu_build

    built = load_cpu_kernel().prompt_flash_compiled()
    monkeypatch.setattr(prompt_sdpa, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    assert (prompt_sdpa.bf16_kernel() is not None) == built
    monkeypatch.setattr(prompt_sdpa, "cpu_flags", lambda: frozenset({"avx512_bf16", "amx_bf16"}))
    assert prompt_sdpa.bf16_kernel() is None
    assert built == ("avx512_bf16" in cpu_build.cpu_flags())


def test_bad_inputs_named(ext):
    q, k, v = _inputs(8, 8, 4, 2, 64)
    with pytest.raises(RuntimeError, match="bf16 tensors"):
        ext.prompt_flash_bf16(q.float(), k, v, True, 0.125)
    with pytest.raises(RuntimeError, match="head size 48"):
        ext.prompt_flash_bf16(*_inputs(8, 8, 4, 2, 48), True, 0.125)
    with pytest.raises(RuntimeError, match="shapes"):
        ext.prompt_flash_bf16(q, k[:4], v[:4], True, 0.125)  # causal needs m >= n
