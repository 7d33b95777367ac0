"""A compute worker's weights-only load (`lamina.model.quick_load`): the model's tensors
read from its safetensors and bound to its stored trace, without transformers.

References: the model loaded the full way (HF): the same tensors bitwise (tied ones
still one tensor), its split's logits bitwise, and HF's own forward. A record goes
stale when a weight file, transformers' version or the trace's sources change, and a
model whose tensors are not as in its files gets no record (or holds the few small
ones that differ itself)."""
import os

import pytest
import torch

from lamina.model import quick_load
from lamina.model.loader import load
from lamina.model.prepare import prepare_split, rotary_frequencies
from lamina.splitter.weights_only import WeightsOnlyModel
from tests.lamina.test_compute_device import node_devices
from tests.tiny_models import tiny_model


@pytest.fixture
def records(tmp_path, monkeypatch):
    monkeypatch.setattr(quick_load, "record_dir", lambda: tmp_path / "records")
    return tmp_path / "records"


def named(model):
    return dict([*model.named_parameters(remove_duplicate=False),
                 *model.named_buffers(remove_duplicate=False)])


def same_tensors(wom, full):
    a, b = named(wom), named(full)
    assert list(a) == list(b)
    for name, t in b.items():
        assert a[name].dtype == t.dtype and torch.equal(a[name], t), name
    ties = {(x, y) for x in b for y in b if x < y and b[x] is b[y]}
    assert ties == {(x, y) for x in a for y in a if x < y and a[x] is a[y]}
    return ties


def test_smollm2_weights_only_equals_its_full_load(smol, smol_split, records):
    path = quick_load.remember(smol, torch.float32)
    assert path is not None and path.parent == records
    wom = quick_load.load_weights_only(None, "float32")
    assert isinstance(wom.model, WeightsOnlyModel) and wom.source == smol.source
    assert same_tensors(wom.model, smol.model) == {("lm_head.weight",
                                                     "model.embed_tokens.weight")}
    assert wom.config.vocab_size == smol.config.vocab_size
    assert rotary_frequencies(wom.model) == rotary_frequencies(smol.model)
    ids = torch.tensor([smol.tokenizer("Weights without the model's code")["input_ids"]])
    quick = prepare_split(wom.model).split.run_local(ids)
    assert torch.equal(quick, prepare_split(smol.model).split.run_local(ids))
    with torch.no_grad():
        assert torch.allclose(quick, smol.model(ids).logits, atol=1e-4)
    with pytest.raises(NotImplementedError, match="load the model itself"):
        wom.model(ids)


def tiny_folder(tmp_path, model_type):
    folder = tmp_path / model_type
    tiny_model(model_type).save_pretrained(folder, safe_serialization=True)
    full = load(folder, with_tokenizer=False)
    prepare_split(full.model)  # its trace in the store
    return folder, full


@pytest.mark.parametrize("model_type", ["gemma2", "gpt2"])
def test_tiny_models_weights_only_split_as_their_full_load(tmp_path, records, model_type):
    """gemma2: tied embeddings, softcaps; gpt2: Conv1D weights and its own names."""
    folder, full = tiny_folder(tmp_path, model_type)
    assert quick_load.remember(full, torch.float32) is not None
    wom = quick_load.load_weights_only(folder)
    same_tensors(wom.model, full.model)
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    quick = prepare_split(wom.model, fuse=False).split.run_local(ids)
    assert torch.equal(quick, prepare_split(full.model, fuse=False).split.run_local(ids))
    with torch.no_grad():
        assert torch.allclose(quick, full.model(ids).logits, atol=1e-5)


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_weights_only_split_moves_to_a_device_as_its_full_load(tmp_path, records,
                                                               monkeypatch, model_type):
    """`prepare_split`'s GPU branch (eager linears, the model's buffers and the slices
    moved) over a weights-only model, on the meta device (no GPU needed): each slice holds
    the full load's tensors by name, shape and dtype, all moved, ties kept, and no node
    still makes a CPU tensor. What a GPU compute worker would run before it may start
    weights-only (`cluster/compute_worker.py` keeps GPU workers on the full load until a
    GPU run checks it)."""
    from lamina.model import prepare

    folder, full = tiny_folder(tmp_path, model_type)
    assert quick_load.remember(full, torch.float32) is not None
    wom = quick_load.load_weights_only(folder)
    meta = torch.device("meta")
    monkeypatch.setattr(prepare, "check_device", lambda name: meta)
    moved = [prepare_split(m.model, device="meta") for m in (wom, full)]

    def tensors(p):  # per slice: name -> tensor
        return [dict([*s.module.named_parameters(remove_duplicate=False),
                      *s.module.named_buffers(remove_duplicate=False)])
                for s in p.split.slices]

    ours, theirs = map(tensors, moved)
    assert [list(a) for a in ours] == [list(b) for b in theirs] and any(ours)
    for a, b in zip(ours, theirs):
        for name, t in b.items():
            assert a[name].device == meta == t.device, name
            assert (a[name].shape, a[name].dtype) == (t.shape, t.dtype), name

    def ties(slices):  # (slice, name, slice, name) of each pair holding one tensor
        return {(i, x, j, y) for i, a in enumerate(slices) for j, b in enumerate(slices)
                for x in a for y in b if (i, x) < (j, y) and a[x] is b[y]}

    assert ties(ours) == ties(theirs)
    assert all(p.dense.backend == "eager" for p in moved)
    devices = node_devices(moved[0].split)
    assert devices and all(d == meta for d in devices)


@pytest.mark.parametrize("env, cpu, gpu", [(None, True, True), ("1", True, True),
                                           ("gpu", True, True), ("0", False, False),
                                           ("off", False, False)])
def test_which_compute_workers_start_weights_only(monkeypatch, env, cpu, gpu):
    """CPU and GPU slices by default (`gpu`, once the opt-in, still means on); 0 / off:
    none."""
    if env is None:
        monkeypatch.delenv("LAMINA_WEIGHTS_ONLY", raising=False)
    else:
        monkeypatch.setenv("LAMINA_WEIGHTS_ONLY", env)
    assert [quick_load.enabled_for(d) for d in ("cpu", "cuda", "cuda:1")] == [cpu, gpu, gpu]


def test_a_stale_record_is_not_used(tmp_path, records, monkeypatch):
    folder, full = tiny_folder(tmp_path, "llama")
    assert quick_load.status(folder) == (False, "no record yet: the first compute worker "
                                                "here loads the full way and records how")
    path = quick_load.remember(full, torch.float32)
    assert quick_load.load_weights_only(folder) is not None
    assert quick_load.status(folder)[0]
    weights = next(folder.glob("*.safetensors"))
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert quick_load.load_weights_only(folder) is None  # weights changed
    assert quick_load.status(folder) == (False, "record unused (the weight files changed): "
                                                "the next compute worker records it again")
    assert quick_load.remember(full, torch.float32) == path  # written again
    assert quick_load.load_weights_only(folder) is not None
    monkeypatch.setenv("LAMINA_WEIGHTS_ONLY", "0")  # valid, but turned off
    assert quick_load.load_weights_only(folder) is None
    monkeypatch.delenv("LAMINA_WEIGHTS_ONLY")
    monkeypatch.setattr(quick_load, "_transformers_version", lambda: "0.0.1")
    assert quick_load.load_weights_only(folder) is None
    monkeypatch.undo()
    monkeypatch.setattr(quick_load, "record_dir", lambda: records)
    record = torch.load(path, weights_only=True)
    torch.save({**record, "model_file": __file__}, path)  # the model's source "edited"
    assert quick_load.load_weights_only(folder) is None
    path.write_bytes(b"not a record")
    assert quick_load.load_weights_only(folder) is None


def test_tensors_not_as_in_the_files(tmp_path, records, monkeypatch):
    """A small tensor that differs from its file is held by the record (and given back
    as loaded); past `STORED_BYTES` the model gets no record."""
    folder, full = tiny_folder(tmp_path, "llama")
    with torch.no_grad():
        full.model.model.norm.weight.add_(0.5)
    assert quick_load.remember(full, torch.float32) is not None
    wom = quick_load.load_weights_only(folder)
    same_tensors(wom.model, full.model)
    monkeypatch.setattr(quick_load, "STORED_BYTES", 0)
    for p in records.iterdir():
        p.unlink()
    assert quick_load.remember(full, torch.float32) is None
    assert quick_load.load_weights_only(folder) is None
