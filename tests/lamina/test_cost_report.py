"""`lamina cost-report`: files written, HTML references existing PNGs, JSON schema,
Markdown, and clear errors for bad catalogs and device names."""
import json
import re

import jsonschema
import pytest

from lamina.costmodel.report import REPORT_SCHEMA, build_report
from lamina.entrypoints.cli import main

ARGS = ["cost-report", "--model", "llama-13b", "--compute", "a100-80g", "--memory", "rtx3090",
        "--context", "512", "4096", "--max-ratio", "8", "--sim-requests", "60"]


def test_html_report(tmp_path, capsys):
    out = tmp_path / "report"
    assert main(ARGS + ["--out", str(out)]) == 0
    page = (out / "report.html").read_text()
    imgs = re.findall(r'<img src="([^"]+)"', page)
    assert len(imgs) == 3
    for name in imgs:  # every image the page shows exists and is a PNG
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rep = json.loads((out / "report.json").read_text())
    jsonschema.validate(rep, REPORT_SCHEMA)
    assert [c["context"] for c in rep["contexts"]] == [512, 4096]
    for c in rep["contexts"]:
        h, o = c["homogeneous"], c["offloaded"]
        assert c["gain"] == pytest.approx(o["tokens_per_s_per_kusd"] / h["tokens_per_s_per_kusd"])
        assert o["tpot_ms"] <= 250 and h["tpot_ms"] <= 250
        assert len(c["sweep"]) == 8 and c["simulation"]["requests"] == 60
    assert rep["contexts"][1]["gain"] > rep["contexts"][0]["gain"] > 1
    assert "Recommended:" in page and "rtx3090" in page
    assert "offloaded" in capsys.readouterr().out


def test_markdown_report(tmp_path):
    out = tmp_path / "md"
    assert main(ARGS[:-4] + ["--context", "2048", "--format", "md", "--sim-requests", "30",
                             "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert md.startswith("# Lamina cost report: llama-13b")
    for name in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md):
        assert (out / name).is_file()
    assert "| context | setup |" in md


def test_schema_rejects_broken_report():
    rep = build_report("llama-7b", "a100-80g", "rx7900xtx", (512,), max_memory_per_compute=2,
                       simulate_requests=20)
    jsonschema.validate(dict(rep, plots={}), REPORT_SCHEMA)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(dict(rep, contexts=[]), REPORT_SCHEMA)


def test_bad_inputs_are_clear_errors(tmp_path, capsys):
    assert main(["cost-report", "--model", "llama-13b", "--compute", "tpu9", "--memory",
                 "rtx3090", "--out", str(tmp_path)]) == 2
    assert "unknown device 'tpu9'" in capsys.readouterr().err
    bad = tmp_path / "hw.yaml"
    bad.write_text("devices:\n  cheap: {price_usd: -1, memory_gb: 1, memory_bw_gbps: 1, "
                   "peak_tflops: 1, nic_gbps: 1}\n")
    assert main(["cost-report", "--model", "llama-13b", "--compute", "cheap", "--memory",
                 "cheap", "--catalog", str(bad), "--out", str(tmp_path)]) == 2
    assert "device 'cheap': field 'price_usd' must be positive" in capsys.readouterr().err
    assert main(["cost-report", "--model", "gpt-9", "--compute", "a100-80g", "--memory",
                 "rtx3090", "--out", str(tmp_path)]) == 2
    assert "unknown model 'gpt-9'" in capsys.readouterr().err


def test_sim_scale_bench_writes_results(tmp_path):
    assert main(["bench", "sim-scale", "--quick", "--repeat", "1", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "sim_scale.json").read_text())
    assert res["requests"] == 100 and {r["pipeline"] for r in res["rows"]} == {"none",
                                                                               "rotational"}
    assert all(r["wall_s"] > 0 and r["throughput_tok_s"] > 0 for r in res["rows"])
    assert "| pipeline |" in (tmp_path / "sim_scale.md").read_text()


def test_report_calibrated_by_bench_ops_file(tmp_path, capsys):
    # MFU 0.125 at B=1 (20 ms) and 0.5 at B=8 (40 ms) on a 0.08 TFLOP/s device
    calib = {"params": 1.0e8, "layers": 2, "dense_layer_s": {"1": 8e-3, "8": 16e-3},
             "head_s": {"1": 4e-3, "8": 8e-3}}
    f = tmp_path / "ops.json"
    f.write_text(json.dumps(calib))
    args = ARGS[:-4] + ["--context", "512", "--sim-requests", "20", "--calibration", str(f)]
    assert main(args + ["--out", str(tmp_path / "r")]) == 2
    assert "--calibration-peak-tflops" in capsys.readouterr().err
    assert main(args + ["--calibration-peak-tflops", "0.08", "--out", str(tmp_path / "r")]) == 0
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    # 1/MFU = 1/mfu_max + (b_half/mfu_max)/B through (1, 8) and (1/8, 2)
    assert rep["efficiency"]["mfu_max"] == pytest.approx(0.875)
    assert rep["efficiency"]["b_half"] == pytest.approx(6.0)


def test_int8_kv_holds_more_tokens_per_memory_device():
    """--kv-dtype int8: a token's KV is lamina's int8 rows (head_dim codes + a 4-byte
    scale per kv head), so each memory device holds ~1.9x bf16's tokens; the offloaded
    cell's batch and throughput per dollar are then at least bf16's."""
    from lamina.costmodel.catalog import model_shape

    s = model_shape("llama-13b")
    kw = dict(contexts=(4096,), max_memory_per_compute=4, simulate_requests=20)
    bf = build_report("llama-13b", "a100-80g", "rtx3090", **kw)
    i8 = build_report("llama-13b", "a100-80g", "rtx3090", kv_dtype="int8", **kw)
    assert bf["model"]["kv_bytes_per_token"] == 2 * s.layers * s.kv_heads * s.head_dim * 2
    assert i8["model"]["kv_bytes_per_token"] == 2 * s.layers * s.kv_heads * (s.head_dim + 4)
    assert i8["model"]["kv_dtype"] == "int8"
    (cb,), (ci,) = bf["contexts"], i8["contexts"]
    assert ci["offloaded"]["batch"] >= cb["offloaded"]["batch"]
    assert ci["offloaded"]["tokens_per_s_per_kusd"] >= cb["offloaded"]["tokens_per_s_per_kusd"]
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        build_report("llama-13b", "a100-80g", "rtx3090", kv_dtype="int4", **kw)
