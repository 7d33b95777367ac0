"""Cost model, first part: paper Table 1 and Table 3 reproduced; catalog validation."""
import pytest

from lamina.costmodel.catalog import (
    MODELS,
    CatalogError,
    default_mfu,
    device,
    load_catalog,
    model_shape,
    round_half_up,
)

TABLE1 = {  # paper Table 1: $/GB, $/(GB/s)
    "a100-80g": (219, 9.04), "h100": (456, 10.90), "rtx3090": (67, 1.71),
    "rx7900xtx": (42, 1.04), "arc-a770": (22, 0.63),
}
TABLE3 = {  # paper Table 3: minimum interconnect GB/s at B = 128, 256, 512, 1024
    ("llama-13b", 1): (4.90, 8.12, 9.08, 10.06),
    ("llama-33b", 2): (5.94, 9.31, 11.56, 12.53),
    ("llama-65b", 4): (7.55, 11.78, 13.92, 15.90),
}
BATCHES = (128, 256, 512, 1024)


def test_table1_recomputed_from_catalog():
    cat = load_catalog()
    for name, (per_gb, per_gbps) in TABLE1.items():
        d = cat[name]
        assert round_half_up(d.usd_per_gb, 0) == per_gb, name
        assert round_half_up(d.usd_per_gbps, 2) == per_gbps, name
    assert {"h20", "l40s", "ddr5-node"} <= set(cat) and all(d.source for d in cat.values())


def test_table3_min_bandwidth(capsys):
    a100 = load_catalog()["a100-80g"]
    lines = []
    for (m, tp), row in TABLE3.items():
        shape = MODELS[m]
        for B, entry in zip(BATCHES, row):
            per_mfu = shape.min_interconnect_gbps(1.0, tp * a100.peak_tflops)
            implied = round_half_up(entry / per_mfu, 3)  # the MFU the entry implies
            exact = shape.min_interconnect_gbps(implied, tp * a100.peak_tflops)
            model = shape.min_interconnect_gbps(default_mfu(B, tp), tp * a100.peak_tflops)
            assert abs(exact / entry - 1) <= 0.01, (m, B)
            assert abs(model / entry - 1) <= 0.25, (m, B, model, entry)
            lines.append(f"{m} x{tp} B={B}: paper {entry:.2f}, implied MFU {implied:.3f} -> "
                         f"{exact:.2f} ({exact / entry - 1:+.1%}); default MFU "
                         f"{default_mfu(B, tp):.3f} -> {model:.2f} ({model / entry - 1:+.1%})")
    with capsys.disabled():
        print("\n" + "\n".join(lines))


def test_arithmetic_intensity_grows_with_batch():
    s = MODELS["llama-13b"]
    assert s.arithmetic_intensity(1) < 1.01 and s.arithmetic_intensity(1024) > 800


def test_catalog_errors_name_device_and_field(tmp_path):
    def write(text):
        p = tmp_path / "hw.yaml"
        p.write_text(text)
        return p

    good = "price_usd: 1, memory_gb: 1, memory_bw_gbps: 1, peak_tflops: 1, nic_gbps: 1"
    with pytest.raises(CatalogError, match=r"device 'x': missing field\(s\) \['nic_gbps'\]"):
        load_catalog(write("devices:\n  x: {price_usd: 1, memory_gb: 1, memory_bw_gbps: 1, "
                           "peak_tflops: 1}\n"))
    with pytest.raises(CatalogError, match="device 'y': field 'price_usd' must be positive"):
        load_catalog(write("devices:\n  y: {" + good.replace("price_usd: 1", "price_usd: -5")
                           + "}\n"))
    with pytest.raises(CatalogError, match="device 'z': field 'memory_gb' must be a number"):
        load_catalog(write("devices:\n  z: {" + good.replace("memory_gb: 1", "memory_gb: lots")
                           + "}\n"))
    with pytest.raises(CatalogError, match="unknown field"):
        load_catalog(write("devices:\n  w: {" + good + ", colour: red}\n"))
    with pytest.raises(CatalogError, match="unknown device 'tpu9'"):
        device(load_catalog(), "tpu9")
    with pytest.raises(CatalogError, match="cannot read"):
        load_catalog(tmp_path / "nope.yaml")


def test_model_shape_from_hf_folder(tmp_path):
    from tests.tiny_models import tiny_model

    tiny_model("llama").save_pretrained(tmp_path / "m")
    s = model_shape(str(tmp_path / "m"))
    assert s.layers == 3 and s.d_model == 64
    with pytest.raises(ValueError, match="unknown model"):
        model_shape("gpt-9")
