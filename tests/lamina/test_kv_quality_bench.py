"""`lamina bench kv-quality` on a small document: its float32 perplexity equals HF's
(exp of the mean NLL of the same windows), pass-key prompts hide their key at the
stated length, and every mode writes its row, the table and the PNG."""
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
    res = bench_kv_quality(modes=("float32", "int8"), lengths=(128,), trials=2,
                           ppl_context=256, docs=[str(doc)], out_dir=tmp_path)
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
    f32, i8 = res["rows"]
    assert f32["tokens"] == n
    assert math.isclose(f32["ppl"], math.exp(nll / n), rel_tol=1e-4)
    assert abs(i8["ppl_vs_first"]) < 0.01 and set(i8["passkey"]) == {128}
    saved = json.loads((tmp_path / "kv_quality.json").read_text())
    assert [r["kv_dtype"] for r in saved["rows"]] == ["float32", "int8"]
    assert (tmp_path / "kv_quality.md").read_text().count("\n| ") == 3
    assert (tmp_path / "kv_quality.png").stat().st_size > 0
