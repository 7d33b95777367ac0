"""lamina.model.loader.load: default GGUF model, the converted-folder cache, HF folders, errors."""
import os

import pytest
import torch

from lamina.model.loader import (
    ModelInfo,
    ModelLoadError,
    converted,
    load,
    load_info,
    resolve,
)
from tests.tiny_models import tiny_model


def test_default_model_is_smollm2(smol):
    assert smol.source.endswith(".gguf") and "SmolLM2-135M-Instruct" in smol.source
    assert smol.config.model_type == "llama"
    assert smol.config.num_hidden_layers == 30 and smol.config.hidden_size == 576
    assert not smol.model.training
    ids = smol.tokenizer("Hello there").input_ids
    assert smol.tokenizer.decode(ids) == "Hello there"


def _plain(config) -> dict:
    """A config's fields but where it was read from: the GGUF loader's quantization
    note, the folder's path, and the architectures line `save_pretrained` fills in."""
    where = ("quantization_config", "_name_or_path", "architectures")
    return {k: v for k, v in config.to_dict().items() if k not in where}


def test_converted_and_cached_folder_equal_transformers_own_gguf_load(tmp_path, monkeypatch):
    """A first load (its GGUF parsed once, then written to the cache) and a load from
    that cache give exactly the weights, config and tokenizer transformers' own,
    unpatched GGUF load gives."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("LAMINA_CACHE_DIR", str(tmp_path))
    folder, gguf = resolve(None)
    converted = load()
    cached = load()
    assert (tmp_path / "hf").is_dir() and cached.model is not converted.model
    # the engine sees one config whichever load wrote the cache
    assert converted.config.to_dict() == cached.config.to_dict()
    plain = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, local_files_only=True)
    plain_tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf, local_files_only=True)
    ref = plain.state_dict()
    text = "Lamina offloads attention to memory workers. <|im_start|>user"
    for lm in (converted, cached):
        sd = lm.model.state_dict()
        assert sd.keys() == ref.keys()
        assert all(torch.equal(sd[k], ref[k]) for k in ref)
        assert _plain(lm.model.config) == _plain(plain.config)
        assert lm.tokenizer(text).input_ids == plain_tok(text).input_ids
        assert lm.tokenizer.chat_template == plain_tok.chat_template


def test_load_info_reads_tokenizer_and_config_not_weights(smol, tmp_path, monkeypatch):
    """A Ray driver's view of the model (its workers hold the weights): the converted
    folder's tokenizer and config, no weights read; an HF folder likewise."""
    import transformers

    def no_weights(*a, **k):
        raise AssertionError("load_info read the weights")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_weights)
    info = load_info(None)  # the session's `smol` converted it already
    assert isinstance(info, ModelInfo) and info.source == smol.source
    assert info.config.to_dict() == smol.config.to_dict()
    text = "Lamina offloads attention to memory workers."
    assert info.tokenizer(text).input_ids == smol.tokenizer(text).input_ids
    assert info.tokenizer.chat_template == smol.tokenizer.chat_template
    tiny = tiny_model("qwen2")
    tiny.save_pretrained(tmp_path, safe_serialization=True)
    smol.tokenizer.save_pretrained(tmp_path)
    folder = load_info(tmp_path)
    assert folder.config.model_type == "qwen2" and folder.source == str(tmp_path)
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_info(tmp_path / "nope")


def test_converted_says_whether_a_load_converts_first(smol, tmp_path, monkeypatch):
    """An HF folder loads as it stands; the GGUF once this node converted it at that
    dtype (the session's `smol` did, at fp32), not with an empty cache; a path without
    a model fails as `load` would."""
    tiny_model("qwen2").save_pretrained(tmp_path / "hf", safe_serialization=True)
    assert converted(tmp_path / "hf") and converted(None) and converted(None, "float32")
    monkeypatch.setenv("LAMINA_CACHE_DIR", str(tmp_path / "empty"))
    assert not converted(None) and not converted(None, "float32")
    with pytest.raises(ModelLoadError, match="does not exist"):
        converted(tmp_path / "nope")


def test_hf_safetensors_folder_roundtrip(tmp_path):
    model = tiny_model("qwen2")
    model.save_pretrained(tmp_path, safe_serialization=True)
    loaded = load(tmp_path, with_tokenizer=False)
    assert loaded.source == str(tmp_path) and loaded.tokenizer is None
    sd_a, sd_b = loaded.model.state_dict(), model.state_dict()
    assert sd_a.keys() == sd_b.keys()
    assert all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a)
    assert loaded.config.model_type == "qwen2" and not loaded.model.training


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load(tmp_path / "nope")


def test_unsupported_file(tmp_path):
    f = tmp_path / "weights.txt"
    f.write_text("x")
    with pytest.raises(ModelLoadError, match="unsupported model file"):
        load(f)


def test_folder_without_model(tmp_path):
    with pytest.raises(ModelLoadError, match="neither an HF model folder"):
        resolve(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="no weight files"):
        resolve(tmp_path)


def test_ambiguous_gguf_folder(tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="several .gguf"):
        resolve(tmp_path)


def test_corrupt_gguf_is_a_clear_error(tmp_path):
    f = tmp_path / "broken.gguf"
    f.write_bytes(b"not a gguf file")
    with pytest.raises(ModelLoadError, match="could not load model from .*broken.gguf"):
        load(f, cache=False)


def test_gguf_cache_is_keyed_by_content(tmp_path, monkeypatch):
    """A reinstalled package (same bytes, new file times) finds the folder it converted
    before; changed bytes get a new one; folders of the earlier key (stem, size, mtime)
    are dropped when the file is converted again."""
    from lamina.model import loader

    monkeypatch.setenv("LAMINA_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "a" / "m.gguf"
    src.parent.mkdir()
    src.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    first = loader._gguf_cache_path(src, torch.float32)
    copy = tmp_path / "b" / "m.gguf"
    copy.parent.mkdir()
    copy.write_bytes(src.read_bytes())
    os.utime(copy, ns=(1, 1))
    assert copy.stat().st_mtime_ns != src.stat().st_mtime_ns
    assert loader._gguf_cache_path(copy, torch.float32) == first
    assert loader._gguf_cache_path(src, torch.bfloat16) != first
    src.write_bytes(b"GGUF" + bytes(range(256)) * 63 + bytes(256))  # same size, new bytes
    os.utime(src, ns=(2, 2))
    assert loader._gguf_cache_path(src, torch.float32) != first
    size = src.stat().st_size
    hf = tmp_path / "cache" / "hf"
    old = [hf / f"m-{size}-{t}-float32" for t in (17, 18)]
    keep = [hf / f"m-{size}-17-bfloat16", hf / f"m-{size + 1}-17-float32", first]
    for d in old + keep:
        d.mkdir(parents=True)
    loader._drop_stale(src, torch.float32)
    assert [d.exists() for d in old] == [False, False]
    assert all(d.exists() for d in keep)
