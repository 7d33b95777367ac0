"""LaminaConfig from YAML: a good file drives `LLM` (HF's greedy tokens); every kind of
bad file is refused naming the key, before any model or worker starts."""
from __future__ import annotations

import pytest

from lamina.engine.config import EngineConfig
from lamina.entrypoints.cli import main
from lamina.entrypoints.deploy_config import LaminaConfig
from lamina.sampling.params import SamplingParams

GOOD = """
model: {dtype: float32}
engine:
  num_memory_workers: 2
  num_kv_slots: 2000
  max_batch: 8
  worker_timeout_s: null
cluster: {executor: local}
server: {max_waiting: 16}
"""


def write(tmp_path, text: str):
    f = tmp_path / "lamina.yaml"
    f.write_text(text)
    return f


def test_good_file_fills_every_section(tmp_path):
    cfg = LaminaConfig.from_yaml(write(tmp_path, GOOD))
    assert cfg.engine == EngineConfig(num_memory_workers=2, num_kv_slots=2000, max_batch=8,
                                      worker_timeout_s=None)
    assert cfg.model.path is None and cfg.model.dtype == "float32"
    assert cfg.cluster.executor == "local" and cfg.server.max_waiting == 16
    assert LaminaConfig.from_dict({}) == LaminaConfig()  # every section optional


def test_llm_from_config_gives_hf_greedy_tokens(tmp_path, prompts, hf_greedy):
    from lamina import LLM
    llm = LLM.from_config(LaminaConfig.from_yaml(write(tmp_path, GOOD)))
    assert llm.config.num_memory_workers == 2 and llm.config.num_kv_slots == 2000
    outs = llm.generate(prompts[:3], SamplingParams(max_tokens=8, temperature=0),
                        use_tqdm=False)
    assert [o.token_ids for o in outs] == [r[:8] for r in hf_greedy[:3]]


@pytest.mark.parametrize("text, msg", [
    ("engine: {num_memory_worker: 2}", "unknown key 'engine.num_memory_worker'"),
    ("engin: {}", "unknown section 'engin'"),
    ("engine: {num_memory_workers: two}", "'engine.num_memory_workers' must be int, got 'two'"),
    ("engine: {num_memory_workers: -1}", "num_memory_workers must be an int >= 1, got -1"),
    ("engine: {split_kv: 1}", "'engine.split_kv' must be bool"),
    ("engine: {faults: null}", "unknown key 'engine.faults'"),  # a test hook, not a setting
    ("model: {path: /no/such/model}", "model.path '/no/such/model' does not exist"),
    ("model: {dtype: int8}", "model.dtype must be one of"),  # int8 is the pools' only
    ("engine: {kv_dtype: int4}", "EngineConfig.kv_dtype must be one of"),
    ("cluster: {executor: local, address: auto}", "cluster.address is for executor 'ray'"),
    ("cluster: {executor: ray, max_restarts: -2}", "cluster.max_restarts must be an int >= -1"),
    ("cluster: {max_restarts: 1.5}", "'cluster.max_restarts' must be int"),
    ("cluster: {http_port: 70000}", "cluster.http_port must be a port (0-65535"),
    ("cluster: {http_port: '8000'}", "'cluster.http_port' must be int or null"),
    ("cluster: {regrow_interval_s: -1}", "cluster.regrow_interval_s must be a number of "
                                         "seconds >= 0 (0: never), got -1"),
    ("cluster: {room_wait_s: .inf}", "cluster.room_wait_s must be a number of seconds >= 0, "
                                     "got inf"),
    ("server: {max_waiting: 0}", "max_waiting must be an int >= 1"),
    ("server: {max_stored_response_bytes: 0}", "max_stored_response_bytes must be an int >= 1"),
    ("engine: [1, 2]", "section 'engine' must be a mapping"),
    ("engine: {max_batch: 8", "lamina.yaml"),  # not YAML
])
def test_bad_file_is_refused_naming_the_key(tmp_path, text, msg):
    with pytest.raises(ValueError, match="lamina.yaml") as e:
        LaminaConfig.from_yaml(write(tmp_path, text))
    assert msg in str(e.value)


def test_cli_refuses_a_config_and_an_engine_flag_together(tmp_path, capsys):
    f = write(tmp_path, GOOD)
    assert main(["generate", "--config", str(f), "--memory-workers", "3", "hi"]) == 2
    err = capsys.readouterr().err
    assert f"--config {f} sets the engine: drop --memory-workers" in err
    assert main(["generate", "--config", str(write(tmp_path, "engine: {max_batch: -4}")),
                 "hi"]) == 2
    assert "max_batch" in capsys.readouterr().err
