"""The `lamina` CLI: split report, benchmark output files, clear errors."""
import json
import re
import socket

import pytest

from lamina.entrypoints.cli import main
from tests.tiny_models import tiny_model


def _folder(tmp_path, mt="llama"):
    d = tmp_path / mt
    tiny_model(mt).save_pretrained(d, safe_serialization=True)
    return d


def test_split_prints_report_with_timing(tmp_path, capsys):
    assert main(["split", "--model", str(_folder(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert "3 attention operators -> 4 slices" in out
    assert "split time" in out and out.count(" 256 ") >= 3


def test_bench_split_writes_json_and_markdown(tmp_path, capsys):
    res_dir = tmp_path / "res"
    assert main(["bench", "split", "--model", str(_folder(tmp_path, "qwen3")), "--repeat", "1",
                 "--out", str(res_dir)]) == 0
    res = json.loads((res_dir / "split.json").read_text())
    assert res["slices"] == 4 and res["repeat"] == 1
    assert res["split_total_s_median"] > 0 and res["baseline_trace_s_median"] > 0
    assert res["split_total_s_median"] >= res["split_cut_s_median"] > 0  # a part of it
    md = (res_dir / "split.md").read_text()
    assert "ratio split / trace" in md
    assert "wrote" in capsys.readouterr().out


def test_bad_model_path_is_a_clear_error(tmp_path, capsys):
    assert main(["split", "--model", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert "lamina: error: model path does not exist" in err


def test_unsplittable_model_is_a_clear_error(tmp_path, capsys):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("bloom", vocab_size=96, hidden_size=64, n_layer=2, n_head=4)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "bloom")
    assert main(["split", "--model", str(tmp_path / "bloom")]) == 2
    # (torch 2.11's export refuses bloom's shapes before the splitter looks for attention
    # nodes; torch 2.13's traces it: either way one line naming the model and the cause)
    err = capsys.readouterr().err
    assert re.search(r"lamina: error: (.*no attention node to cut|tracing model 'bloom' with "
                     r"torch.export failed)", err), err


def test_generate_runs_the_engine_on_the_default_model(capsys):
    assert main(["generate", "--max-tokens", "5", "--ignore-eos", "The capital of France is",
                 "One, two, three,"]) == 0
    out = capsys.readouterr().out
    assert out.count("[5 tokens, length]") == 2 and "2 prompts batched" in out


def test_generate_beam_width_prints_the_beams_best_first(capsys):
    assert main(["generate", "--max-tokens", "6", "--beam-width", "2",
                 "The capital of France is"]) == 0
    out = capsys.readouterr().out
    scores = [float(s) for s in re.findall(r"\[beam \d, score (-[\d.]+), ", out)]
    assert len(scores) == 2 and scores[0] >= scores[1], out
    assert "[beam 0, score" in out and "1 prompts, 2 beams each" in out
    assert main(["generate", "hi", "--beam-width", "2", "--top-p", "0.5"]) == 2
    assert "leave the sampling flags out" in capsys.readouterr().err
    assert main(["generate", "hi", "--length-penalty", "2"]) == 2
    assert "--length-penalty needs --beam-width" in capsys.readouterr().err


def test_generate_bad_params_exit_2_before_loading(capsys):
    assert main(["generate", "hi", "--top-p", "1.5"]) == 2
    assert "SamplingParams.top_p" in capsys.readouterr().err
    assert main(["generate", "hi", "--repetition-penalty", "0"]) == 2
    assert "SamplingParams.repetition_penalty" in capsys.readouterr().err


def test_generate_stop_and_penalty_flags(monkeypatch, capsys):
    """The sampling flags reach the engine as one SamplingParams, and each answer's finish
    reason is printed (what stop strings and penalties do to the tokens is the engine's,
    tested against HF in test_engine.py)."""
    import lamina

    seen = []

    class FakeLLM:
        dense = type("D", (), {"backend": "onednn", "reason": "fake"})()

        def __init__(self, model, **kw):
            pass

        def generate(self, prompts, params, use_tqdm=True):
            seen.append(params)
            out = type("O", (), {"text": " five,", "token_ids": [1, 2], "finish_reason": "stop"})
            return [out() for _ in prompts]

        def shutdown(self):
            pass

    monkeypatch.setattr(lamina, "LLM", FakeLLM)
    assert main(["generate", "--max-tokens", "24", "One, two,", "--stop", " six", "--stop",
                 "\n", "--repetition-penalty", "1.5", "--presence-penalty", "0.5",
                 "--frequency-penalty", "-0.25", "--seed", "3", "--temperature", "0.7"]) == 0
    (p,) = seen
    assert (p.max_tokens, p.stop, p.repetition_penalty, p.presence_penalty,
            p.frequency_penalty, p.seed, p.temperature) == (24, (" six", "\n"), 1.5, 0.5,
                                                            -0.25, 3, 0.7)
    assert "> One, two,\nfive,\n[2 tokens, stop]" in capsys.readouterr().out


def test_generate_structured_output_flags(tmp_path, capsys):
    """--json-schema (@FILE), --choice: the answers hold on the default model; two
    constraints at once, a bad regex: exit 2 naming the field."""
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},'
                      ' "required": ["city"], "additionalProperties": false}')
    assert main(["generate", "--json-schema", f"@{schema}", "Where is the Louvre?",
                 "--max-tokens", "20"]) == 0
    out = capsys.readouterr().out
    assert '{"city":"Paris"}' in out or '{"city":"Rome"}' in out, out
    assert main(["generate", "--choice", "yes", "--choice", "no", "Is water wet?"]) == 0
    assert re.search(r"\n(yes|no)\n\[1 tokens, stop\]", capsys.readouterr().out)
    assert main(["generate", "--regex", "a", "--json-object", "hi"]) == 2
    assert "exactly one of" in capsys.readouterr().err
    assert main(["generate", "--regex", "a(b", "hi"]) == 2
    assert "StructuredOutputs.regex" in capsys.readouterr().err
    assert main(["generate", "--json-schema", f"@{tmp_path}/nope.json", "hi"]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_dense_backend_choices_follow_the_library():
    from lamina.entrypoints.cli import build_parser
    from lamina.splitter.dense import DENSE_BACKENDS

    sub = next(a for a in build_parser()._actions if a.choices and "generate" in a.choices)
    for cmd in ("generate", "serve", "bench"):
        opt = next(a for a in sub.choices[cmd]._actions if a.dest == "dense_backend")
        assert tuple(opt.choices) == DENSE_BACKENDS and opt.default == "auto"


def test_dtype_flag_reaches_llm(monkeypatch, capsys):
    """--dtype sets the model's and the KV pool's dtype (generate and serve); --kv-dtype
    the pool's alone."""
    import lamina
    import lamina.entrypoints.api_server

    seen = []

    class FakeLLM:
        dense = type("D", (), {"backend": "onednn", "reason": "fake"})()
        loaded = type("L", (), {"source": "fake"})()
        config = type("C", (), {"num_memory_workers": 1})()
        executor = None

        def __init__(self, model, **kw):
            seen.append(kw)

        def generate(self, prompts, params, use_tqdm=True):
            return []

        def shutdown(self):
            pass

    monkeypatch.setattr(lamina, "LLM", FakeLLM)
    monkeypatch.setattr(lamina.entrypoints.api_server, "serve",
                        lambda llm, host, port, *a, **kw: None)
    assert main(["generate", "--dtype", "bfloat16", "hi"]) == 0
    assert main(["serve", "--port", "0", "--dtype", "bfloat16"]) == 0
    assert main(["generate", "hi"]) == 0
    assert main(["generate", "--kv-dtype", "int8", "hi"]) == 0  # the pools' own dtype
    assert main(["serve", "--port", "0", "--dtype", "bfloat16", "--kv-dtype", "int8"]) == 0
    assert [(k["dtype"], k["kv_dtype"]) for k in seen] == [("bfloat16", "bfloat16")] * 2 + \
        [("float32", "float32"), ("float32", "int8"), ("bfloat16", "int8")]
    seen.clear()
    assert main(["generate", "--kv-sparsity", "topk", "--kv-budget", "0.1",
                 "--kv-topk-rescore", "3", "hi"]) == 0
    assert main(["serve", "--port", "0", "--kv-sparsity", "h2o", "--kv-budget", "2048",
                 "--kv-layer-budgets", "pyramid", "--no-kv-evict"]) == 0
    assert [(k["kv_sparsity"], k["kv_budget"], k["kv_layer_budgets"], k["kv_topk_rescore"],
             k["kv_evict"]) for k in seen] == [("topk", 0.1, "uniform", 3.0, True),
                                               ("h2o", 2048, "pyramid", 0.0, False)]
    assert isinstance(seen[1]["kv_budget"], int)  # a token count, not a fraction
    seen.clear()
    assert main(["generate", "--no-kv-huge-pages", "--kv-prefault", "hi"]) == 0
    assert main(["serve", "--port", "0", "--kv-huge-pages", "--no-kv-prefault"]) == 0
    assert main(["generate", "hi"]) == 0  # not given: EngineConfig's own default
    assert [(k.get("kv_huge_pages"), k.get("kv_prefault")) for k in seen] == [
        (False, True), (True, False), (None, None)]
    seen.clear()
    assert main(["generate", "--speculative-tokens", "4", "hi"]) == 0
    assert main(["serve", "--port", "0", "--speculative-tokens", "3",
                 "--speculative-ngram", "1", "4"]) == 0
    assert [(k["speculative_tokens"], k["speculative_ngram_min"], k["speculative_ngram_max"])
            for k in seen] == [(4, 2, 3), (3, 1, 4)]
    seen.clear()
    assert main(["serve", "--port", "0"]) == 0
    assert main(["serve", "--port", "0", "--scheduling-policy", "priority"]) == 0
    assert [k["scheduling_policy"] for k in seen] == ["fcfs", "priority"]
    seen.clear()
    assert main(["serve", "--port", "0", "--kv-host-gib", "0.5", "--kv-disk-dir", "/kv",
                 "--kv-disk-gib", "2", "--preemption-mode", "swap"]) == 0
    assert main(["generate", "hi"]) == 0
    assert [(k["kv_host_bytes"], k["kv_disk_dir"], k["kv_disk_bytes"], k["preemption_mode"])
            for k in seen] == [(1 << 29, "/kv", 2 << 30, "swap"), (0, None, 0, "auto")]
    with pytest.raises(SystemExit):  # argparse: not a choice
        main(["generate", "--dtype", "float16", "hi"])
    assert "invalid choice: 'float16'" in capsys.readouterr().err


def test_every_engine_flag_is_checked_against_config_and_service(capsys):
    """ENGINE_FLAGS names every flag `_engine_args` adds but --config: a flag missing
    there would be dropped in silence beside --config or --service."""
    import argparse

    from lamina.engine.config import PREEMPTION_MODES
    from lamina.entrypoints.cli import ENGINE_FLAGS, _engine_args

    p = argparse.ArgumentParser()
    _engine_args(p, "local", 1)
    assert {a.dest for a in p._actions} - {"help", "config"} == set(ENGINE_FLAGS)
    choices = {a.dest: a.choices for a in p._actions}
    assert tuple(choices["preemption_mode"]) == PREEMPTION_MODES  # the CLI loads no engine
    assert main(["serve", "--service", "lamina", "--kv-dtype", "int8"]) == 2
    assert "--service serves the running service's engine: drop --kv-dtype" in \
        capsys.readouterr().err


def test_serve_takes_its_port_before_the_model_loads(monkeypatch, capsys):
    """A port in use is refused at once, naming it, before any model loads or cluster
    is joined; --port 0 serves on a free port, printed; a port past 65535 is refused."""
    import lamina
    import lamina.cluster.cli
    import lamina.entrypoints.api_server

    def not_now(*a, **kw):
        raise AssertionError("loaded before the port was taken")

    monkeypatch.setattr(lamina, "LLM", not_now)
    monkeypatch.setattr(lamina.cluster.cli, "_client", not_now)
    busy = socket.create_server(("127.0.0.1", 0))
    port = busy.getsockname()[1]
    try:
        for extra in ([], ["--service", "lamina"]):
            assert main(["serve", "--port", str(port), *extra]) == 2
            assert f"lamina: error: cannot serve on 127.0.0.1:{port}: Address already in " \
                   "use (another server there? pick another --port)" in capsys.readouterr().err
    finally:
        busy.close()
    served = []

    class Loaded:
        loaded = type("L", (), {"source": "fake"})()
        config = type("C", (), {"num_memory_workers": 1})()
        executor = None

        def __init__(self, model, **kw):
            pass

        def shutdown(self):
            pass

    def serve(llm, host, port, name, config, sock, autoscale=None):
        with socket.create_connection(sock.getsockname(), timeout=5):  # listening
            served.append(sock.getsockname()[1])

    monkeypatch.setattr(lamina, "LLM", Loaded)
    monkeypatch.setattr(lamina.entrypoints.api_server, "serve", serve)
    assert main(["serve", "--port", "0", "--executor", "local"]) == 0
    assert served[0] > 0 and f"on http://127.0.0.1:{served[0]} (" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["serve", "--port", "99999"])
    assert "a port is 0-65535, got '99999'" in capsys.readouterr().err


def test_sparsity_choices_follow_the_library():
    from lamina.entrypoints.cli import LAYER_BUDGETS, POLICIES
    from lamina.memory import sparsity

    assert POLICIES == sparsity.POLICIES and LAYER_BUDGETS == sparsity.LAYER_BUDGETS


@pytest.mark.parametrize("argv, module, fn, expected", [
    (["kv-sparsity", "--quick", "--budgets", "0.2", "0.1", "--policies", "topk"],
     "lamina.bench.kv_quality", "bench_kv_sparsity",
     dict(lengths=(256,), trials=2, ppl_context=256, windows=2, budgets=(0.2, 0.1),
          policies=("topk",), docs=None, out_dir="res")),
    (["multiturn", "--turns", "3", "--answer-tokens", "7"], "lamina.bench.multiturn",
     "bench_multiturn", dict(turns=3, answer=7, out_dir="res", vllm_python=None)),
    (["multiturn", "--quick", "--sessions", "9"], "lamina.bench.multiturn", "bench_multiturn",
     dict(sessions=9, turns=2, system=32, user=48, answer=4, concurrency=2, out_dir="res",
          vllm_python=None)),
    (["overlap", "--batches", "8", "32", "--contexts", "512"], "lamina.bench.pipeline",
     "bench_overlap", dict(batches=(8, 32), context=512, out_dir="res")),
    (["pipeline", "--quick", "--pipelines", "fixed"], "lamina.bench.pipeline",
     "bench_pipeline", dict(batches=(4,), contexts=(64,), steps=2, modes=("fixed",),
                            executor="local", plot=None, out_dir="res", predict=False)),
    (["kv-capacity", "--pool-mib", "64", "--kv-modes", "int8"], "lamina.bench.kv_capacity",
     "bench_kv_capacity", dict(pool_bytes=64 << 20, modes=("int8",), out_dir="res")),
    (["e2e", "--device", "cuda", "--dtype", "float32"], "lamina.bench.e2e_gpu", "bench_e2e_gpu",
     dict(batches=(1, 32, 256), new_tokens=128, out_dir="res", dtype="float32", repeat=3,
          threads=None, setups=("gpu-kv", "host-kv-1", "host-kv-2"))),
    (["e2e", "--device", "cuda", "--setups", "host-kv-2", "gpu-kv"], "lamina.bench.e2e_gpu",
     "bench_e2e_gpu", dict(batches=(1, 32, 256), new_tokens=128, out_dir="res",
                           dtype="bfloat16", repeat=3, threads=None,
                           setups=("host-kv-2", "gpu-kv"))),
    (["serve", "--streams", "1", "8", "--dtype", "float32"], "lamina.bench.serve",
     "bench_serve", dict(concurrency=(1, 8), dtype="float32", vllm_python=None,
                         out_dir="res")),
    (["serve", "--quick", "--executors", "ray"], "lamina.bench.serve", "bench_serve",
     dict(executors=("ray",), concurrency=(2,), requests=4, prompt_tokens=32,
          output_tokens=8, dtype="bfloat16", vllm_python=None, out_dir="res")),
    (["sim", "--quick"], "lamina.bench.sim", "bench_sim",
     dict(batches=(8,), new_tokens=16, repeat=3, out_dir="res")),
])
def test_bench_flags_reach_the_benchmark(monkeypatch, argv, module, fn, expected):
    """Each `lamina bench NAME` passes its --quick sizes and the flags given (and only
    those) to its benchmark function."""
    import importlib

    calls = []
    monkeypatch.setattr(importlib.import_module(module), fn,
                        lambda *a, **kw: calls.append((a, kw)))
    assert main(["bench", *argv, "--out", "res"]) == 0
    (args, kwargs), = calls
    assert kwargs == expected
    assert args in ((), (None,))  # the model path: the default


def test_bench_records_name_the_cpu_generation():
    """A cloud VM's model name can be just "AMD EPYC"; the record adds family, model
    and the vector instructions that decide the speed here."""
    from lamina.bench.common import cpu_name

    info = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\n"
            "model name\t: AMD EPYC\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n\n"
            "processor\t: 1\nmodel name\t: other\n")
    assert cpu_name(info) == "AMD EPYC (family 26 model 2; avx2 avx512f avx512_bf16)"
    assert cpu_name("processor\t: 0\n")  # no model name: the platform's answer


def test_serve_with_a_config_runs_its_autoscale_section(monkeypatch, tmp_path):
    """`lamina serve --config FILE`: the file's autoscale section reaches `serve`, which
    runs an autoscaler beside the engine loop; none without one."""
    import types

    import lamina
    import lamina.entrypoints.api_server
    from lamina.engine.config import EngineConfig
    from lamina.entrypoints.autoscale import AutoscaleConfig

    got = []

    class Loaded:
        config, executor = EngineConfig(), None
        loaded = types.SimpleNamespace(source="fake")

        @classmethod
        def from_config(cls, cfg):
            return cls()

        def shutdown(self):
            pass

    monkeypatch.setattr(lamina, "LLM", Loaded)
    monkeypatch.setattr(lamina.entrypoints.api_server, "serve",
                        lambda llm, *a, autoscale=None, **kw: got.append(autoscale))
    cfg = tmp_path / "lamina.yaml"
    cfg.write_text("autoscale: {max_memory_workers: 3, cooldown_s: 20}\n")
    assert main(["serve", "--port", "0", "--config", str(cfg)]) == 0
    cfg.write_text("engine: {max_batch: 8}\n")
    assert main(["serve", "--port", "0", "--config", str(cfg)]) == 0
    assert got == [AutoscaleConfig(max_memory_workers=3, cooldown_s=20), None]
