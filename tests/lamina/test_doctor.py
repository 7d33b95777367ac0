"""`lamina doctor`: each transport reported with why it is or is not available."""
import json

from lamina.entrypoints import doctor
from lamina.entrypoints.cli import main


def by_name(checks):
    return {c.name: c for c in checks}


def test_shared_memory_transport_follows_lamina_shm(monkeypatch, tmp_path):
    monkeypatch.setenv("LAMINA_SHM", "0")
    t = by_name(doctor.transports(tmp_path / "none"))
    assert not t["transport unix+shm"].ok and "LAMINA_SHM=0" in t["transport unix+shm"].why
    assert t["transport unix"].ok and t["transport tcp"].ok
    monkeypatch.setenv("LAMINA_SHM", "1")
    assert by_name(doctor.transports(tmp_path))["transport unix+shm"].ok


def test_collective_paths_follow_lamina_collective_and_the_torch_build(monkeypatch):
    import torch

    nccl = torch.distributed.is_nccl_available()
    monkeypatch.delenv("LAMINA_COLLECTIVE", raising=False)
    t = by_name(doctor.collective())
    assert t["transport +nccl"].ok == nccl
    assert ("tensors GPU to GPU" if nccl else "has no NCCL") in t["transport +nccl"].why
    assert not t["transport +gloo"].ok and "LAMINA_COLLECTIVE=gloo" in t["transport +gloo"].why
    monkeypatch.setenv("LAMINA_COLLECTIVE", "gloo")
    t = by_name(doctor.collective())
    assert t["transport +gloo"].ok and not t["transport +nccl"].ok
    monkeypatch.setenv("LAMINA_COLLECTIVE", "maybe")
    assert "must be one of" in by_name(doctor.collective())["transport +nccl"].why


def test_rdma_names_its_devices_or_their_absence(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "pyverbs" else real(name, *a))
    gone = doctor.rdma(tmp_path / "infiniband")
    assert not gone.ok and "no RDMA device" in gone.why and "absent" in gone.why
    assert gone.why.endswith(": tcp is used between hosts")
    (tmp_path / "infiniband").mkdir()
    assert "is empty" in doctor.rdma(tmp_path / "infiniband").why
    (tmp_path / "infiniband" / "mlx5_0").mkdir()
    # a device alone is not a transport: pyverbs drives it
    found = doctor.rdma(tmp_path / "infiniband")
    assert not found.ok and found.why.startswith("pyverbs not installed")
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "pyverbs" else real(name, *a))
    ok = doctor.rdma(tmp_path / "infiniband")
    assert ok.ok and ok.why == "workers on different hosts: devices mlx5_0, pyverbs installed"


def test_doctor_command_prints_every_check(capsys):
    assert main(["doctor", "--json"]) == 0
    got = {c["name"]: c for c in json.loads(capsys.readouterr().out)}
    assert {"cpu", "cpu attention kernel", "cuda", "transport unix+shm", "transport tcp",
            "transport rdma", "ray", "weights-only start"} <= set(got)
    assert got["weights-only start"]["why"].startswith("default model, float32: ")
    assert got["transport tcp"]["ok"] and not got["transport rdma"]["ok"]
    assert main(["doctor"]) == 0
    assert "transport rdma" in capsys.readouterr().out


def test_kv_pages_say_whether_pools_get_huge_pages_and_what_they_cost(tmp_path, monkeypatch):
    thp = tmp_path / "enabled"
    thp.write_text("always [madvise] never\n")
    monkeypatch.setenv("LAMINA_KV_HUGE_PAGES", "1")
    c = doctor.kv_pages(thp, mib=4)
    assert c.ok and c.why.startswith("THP madvise: faulting 4 MiB in took "), c.why
    assert " ms on huge pages, " in c.why and c.why.count(" ms on 4 KiB ones") == 1
    monkeypatch.setenv("LAMINA_KV_HUGE_PAGES", "0")
    assert doctor.kv_pages(thp) == doctor.Check(
        "kv huge pages", False, "LAMINA_KV_HUGE_PAGES=0: host pools on 4 KiB pages")
    monkeypatch.setenv("LAMINA_KV_HUGE_PAGES", "1")
    thp.write_text("always madvise [never]\n")
    assert doctor.kv_pages(thp).why == ("the kernel's THP mode is never: host pools on "
                                        "4 KiB pages")
    assert doctor.kv_pages(tmp_path / "absent").why.startswith("the kernel's THP mode is never")
    monkeypatch.setenv("LAMINA_KV_HUGE_PAGES", "on")
    assert doctor.kv_pages(thp) == doctor.Check(
        "kv huge pages", False, "$LAMINA_KV_HUGE_PAGES must be 0 or 1, got 'on'")
