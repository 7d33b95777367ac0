"""The cluster-launcher configs validate with Ray's own validator (offline) and describe
the node types and resources the Ray executor places workers by."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent.parent


def prepared(path: Path) -> dict:
    from ray.autoscaler._private.util import prepare_config, validate_config
    cfg = prepare_config(yaml.safe_load(path.read_text()))
    validate_config(cfg)  # raises on a schema violation
    return cfg


def test_aws_config_has_compute_and_memory_node_types():
    cfg = prepared(ROOT / "ray_config.yaml")
    types = cfg["available_node_types"]
    assert cfg["head_node_type"] == "head" and set(types) == {"head", "compute", "memory"}
    assert types["head"]["resources"] == {}  # no workers on the head
    assert types["compute"]["resources"] == {"lamina_compute": 1}
    assert types["memory"]["resources"]["lamina_memory"] >= 1
    assert 1 <= types["memory"]["min_workers"] <= types["memory"]["max_workers"]
    # one pinned Ray on every node: the head's and the workers' must match
    pins = set(re.findall(r"ray\[default\]==([0-9.]+)", "\n".join(cfg["setup_commands"])))
    assert len(pins) == 1


def test_on_prem_example_advertises_each_role():
    cfg = prepared(ROOT / "examples" / "ray_config.local.yaml")
    assert cfg["provider"]["type"] == "local"
    head = " ".join(cfg["head_start_ray_commands"])
    m = re.search(r"--resources='(\{.*?\})'", head)
    assert m and json.loads(m.group(1)) == {"lamina_compute": 1}
    workers = " ".join(cfg["worker_start_ray_commands"])
    assert "--resources=" in workers and "/etc/lamina/resources.json" in workers


def test_a_broken_config_is_refused():
    from ray.autoscaler._private.util import prepare_config, validate_config
    cfg = yaml.safe_load((ROOT / "ray_config.yaml").read_text())
    cfg["available_node_types"]["memory"]["min_workers"] = "two"
    with pytest.raises(Exception, match="min_workers|two"):
        validate_config(prepare_config(cfg))
