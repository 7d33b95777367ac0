"""The bf16 linear kernel (`kernels/csrc/linear_bf16.cpp`) against float64 math on the
same bf16 values and against an eager bf16 linear; its packing; which CPUs get it."""
import pytest
import torch

from lamina.kernels.cpu_build import load_cpu_kernel
from lamina.kernels.linear import linear_ops


@pytest.fixture(scope="module")
def ext(cpu):  # `cpu` builds the extension (a build failure fails the suite there)
    ext = load_cpu_kernel()
    if not ext.linear_bf16_compiled():
        pytest.skip("this CPU has no AVX512-BF16: the bf16 linear kernel is not built in")
    return ext


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(1e-30))) - 7)


@pytest.mark.parametrize("rows,out,inp,bias", [
    (1, 960, 576, None),          # decode, one row: q|k|v
    (8, 3072, 576, None),         # gate|up at B=8
    (77, 576, 1536, "bf16"),      # down, ragged rows
    (300, 100, 128, "fp32"),      # rows over one 256-row chunk; outputs not a multiple of 32
    (5, 40, 64, "bf16"),          # a whole 32-output tile and 8 outputs of the next
    (0, 64, 64, None),            # no rows
], ids=["decode1", "decode8", "ragged", "chunks", "narrow", "empty"])
def test_linear_matches_float64_and_eager(ext, rows, out, inp, bias):
    """Within half a bf16 ulp of the float64 result plus fp32 accumulation's bound, and
    equal to the eager bf16 linear almost everywhere (summation order aside)."""
    g = torch.Generator().manual_seed(rows + out)
    w = (torch.randn(out, inp, generator=g) * 0.05).bfloat16()
    x = torch.randn(2, rows, inp, generator=g).bfloat16()  # [..., in]: two leading dims
    b = None if bias is None else torch.randn(out, generator=g).to(
        torch.bfloat16 if bias == "bf16" else torch.float32)
    y = ext.linear_bf16(x, ext.pack_linear_bf16(w), out, b)
    assert y.shape == (2, rows, out) and y.dtype == torch.bfloat16
    if rows == 0:
        return
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    terms = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    bound = 0.5 * _bf16_ulp(exact.float()).double() + (inp + 1) * 2.0 ** -24 * terms
    assert ((y.double() - exact).abs() <= bound).all()
    if bias != "fp32":  # eager adds a bf16 bias the same way
        eager = torch.nn.functional.linear(x, w, b)
        assert (y == eager).float().mean().item() > 0.999


def test_non_contiguous_input_and_packed_layout(ext):
    w = torch.arange(64 * 4, dtype=torch.float32).reshape(64, 4).bfloat16()
    p = ext.pack_linear_bf16(w)
    # [64 outputs / 16 blocks][2 channel pairs][16 outputs x 2 channels]
    assert p.shape == (4, 2, 32)
    assert torch.equal(p[1, 1, 2:4], w[17, 2:4])  # block 1, pair 1, output 17's 2 channels
    x = torch.randn(4, 6).bfloat16().T  # [6, 4], rows not contiguous
    y = ext.linear_bf16(x, p, 64)
    assert torch.equal(y, ext.linear_bf16(x.contiguous(), p, 64))


def test_bad_inputs_are_named(ext):
    w = torch.randn(64, 64).bfloat16()
    p = ext.pack_linear_bf16(w)
    with pytest.raises(RuntimeError, match="must be even"):
        ext.pack_linear_bf16(torch.randn(64, 63).bfloat16())
    with pytest.raises(RuntimeError, match="2-D bf16 CPU weight"):
        ext.pack_linear_bf16(torch.randn(64, 64))
    with pytest.raises(RuntimeError, match="bf16 CPU input"):
        ext.linear_bf16(torch.randn(3, 64), p, 64)
    with pytest.raises(RuntimeError, match="does not fit the packed weight"):
        ext.linear_bf16(torch.randn(3, 32).bfloat16(), p, 64)
    with pytest.raises(RuntimeError, match="bias of 10"):
        ext.linear_bf16(torch.randn(3, 64).bfloat16(), p, 64, torch.randn(10))


def test_given_only_without_amx(cpu, monkeypatch):
    from lamina.kernels import cpu_build, linear

    built = load_cpu_kernel().linear_bf16_compiled()
    assert built == ("avx512_bf16" in cpu_build.cpu_flags())
    monkeypatch.setattr(linear, "cpu_flags", lambda: frozenset({"avx512_bf16", "amx_bf16"}))
    ops, why = linear_ops()
    assert ops is None and ("AMX" in why if built else "AVX512-BF16" in why)
    monkeypatch.setattr(linear, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    ops, why = linear_ops()
    assert (ops is not None) == built


def test_build_key_follows_the_cpu_flags(monkeypatch):
    """Builds are -march=native: a CPU with other features (same model name) gets a
    build of its own, not one whose instructions it may lack."""
    from lamina.kernels import cpu_build

    key = cpu_build.build_key()
    assert cpu_build.build_key() == key
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert cpu_build.build_key() != key


def test_build_key_follows_the_compiler(monkeypatch):
    """Another compiler (a new gcc, $CXX) builds anew instead of loading the old build."""
    from lamina.kernels import cpu_build

    key = cpu_build.build_key()
    assert "(" in cpu_build.compiler_version() or "version" in cpu_build.compiler_version()
    monkeypatch.setattr(cpu_build, "compiler_version", lambda: "g++ (Other) 99.1.0")
    assert cpu_build.build_key() != key
