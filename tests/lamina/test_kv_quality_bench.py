"""`lamina bench kv-quality` on a small document: it scores exactly the windows' tokens
and its int8 perplexity is within 1% of HF's fp32 one over the same windows (one mode:
an LLM build each is the cost here); pass-key prompts hide their key at the stated
length; the report is written as JSON, Markdown and PNG."""
import json
import math

import torch

from lamina.bench.kv_quality import bench_kv_quality, passkey_prompts
from tests.conftest import TEXT


def test_passkey_prompts_hide_one_key_near_the_length(smol):
    tok = smol.tokenizer
    cases = passkey_prompts(tok, 300, 6, seed=1)
    assert len(cases) == 6 and len({k for _, k in cases}) > 1
    for ids, key in cases:
        assert 290 <= len(ids) <= 300
        text = tok.decode(ids)
        assert text.count(key) == 2 and text.rstrip().endswith("The pass key is")
    assert cases == passkey_prompts(tok, 300, 6, seed=1)  # the same prompts every mode


def test_kv_quality_perplexity_equals_hf_and_reports_every_mode(smol, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text(TEXT[:3000])
    res = bench_kv_quality(modes=("int8",), lengths=(128,), trials=2, ppl_context=256,
                           docs=[str(doc)], out_dir=tmp_path)
    ids = smol.tokenizer(TEXT[:3000])["input_ids"]
    nll, n = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(ids), 255):  # windows of ppl_context - 1 prompt tokens
            w = ids[i:i + 255]
            if len(w) < 2:
                continue
            lp = torch.log_softmax(smol.model(torch.tensor([w])).logits[0, :-1].double(), -1)
            nll -= float(lp[torch.arange(len(w) - 1), w[1:]].sum())
            n += len(w) - 1
    (i8,) = res["rows"]
    assert i8["tokens"] == n and i8["windows"] == math.ceil(len(ids) / 255)
    assert math.isclose(i8["ppl"], math.exp(nll / n), rel_tol=0.01)
    assert set(i8["passkey"]) == {128} and 0 <= i8["passkey"][128] <= 1
    saved = json.loads((tmp_path / "kv_quality.json").read_text())
    assert [r["kv_dtype"] for r in saved["rows"]] == ["int8"]
    assert (tmp_path / "kv_quality.md").read_text().count("\n| ") == 2
    assert (tmp_path / "kv_quality.png").stat().st_size > 0


def test_kv_sparsity_bench_reports_each_policy_budget_and_layer_rule(tmp_path):
    """`lamina bench kv-sparsity` at a tiny size: dense first, then one row per (policy,
    budget, layer rule); every row scores the same decode tokens; a budget of the whole
    context scores exactly as dense; JSON, Markdown and the quality-vs-budget PNG."""
    from lamina.bench.kv_quality import bench_kv_sparsity, policy_modes

    doc = tmp_path / "doc.txt"
    doc.write_text(TEXT[:3000])
    res = bench_kv_sparsity(policies=("topk",), budgets=(1.0, 0.25),
                            layer_budgets=("uniform", "pyramid"), topk_rescore=(0.0,),
                            lengths=(64,), trials=1, ppl_context=64, windows=2,
                            docs=[str(doc)], out_dir=tmp_path)
    rows = res["rows"]
    assert [(r["policy"], r["budget"], r["layer_budgets"]) for r in rows] == [
        ("dense", 1.0, "uniform"), ("topk", 1.0, "uniform"), ("topk", 1.0, "pyramid"),
        ("topk", 0.25, "uniform"), ("topk", 0.25, "pyramid")]
    assert {r["tokens"] for r in rows} == {2 * 32}  # 2 windows, tokens 32..63 scored
    assert all(r["ppl"] == rows[0]["ppl"] for r in rows if r["budget"] == 1.0)
    assert all(r["ppl"] > rows[0]["ppl"] for r in rows if r["budget"] == 0.25)
    saved = json.loads((tmp_path / "kv_sparsity.json").read_text())
    assert len(saved["rows"]) == 5 and saved["ppl_context"] == 64
    assert (tmp_path / "kv_sparsity.md").read_text().count("\n| ") == 6
    assert (tmp_path / "kv_sparsity.png").stat().st_size > 0
    # topk's rows repeat per rescore multiple; the other policies run once
    assert policy_modes(("h2o", "topk"), (0.2,), ("uniform",), (0.0, 3.0)) == [
        ("dense", 1.0, "uniform", 0.0), ("h2o", 0.2, "uniform", 0.0),
        ("topk", 0.2, "uniform", 0.0), ("topk", 0.2, "uniform", 3.0)]
