"""`memo_positions`: each slice's position-only subgraph (rotary tables) computed once
per position tensor and shared by the slices, checked bitwise against the split without
it on every tiny architecture and on SmolLM2's packed split, cached decode included."""
import pytest
import torch

from lamina.splitter import split_model
from lamina.splitter.dense import pack_dense
from lamina.splitter.memo import PositionTables, memo_positions
from lamina.splitter.split import LocalKVCache
from tests.tiny_models import TINY, tiny_model


def tables(split):
    return [m for s in split.slices for m in s.module.modules() if isinstance(m, PositionTables)]


@pytest.mark.parametrize("mt", sorted(TINY))
def test_memo_split_equals_plain_split(mt):
    model = tiny_model(mt)
    plain = split_model(model)
    memo, n = memo_positions(plain)
    assert n == len(tables(memo))
    ids = torch.randint(3, 90, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
        assert torch.equal(memo.run_local(ids), plain.run_local(ids))
        assert (memo.run_local(ids) - ref).abs().max().item() <= 1e-5


def test_smollm2_tables_computed_once_per_position_tensor(smol):
    plain, _ = pack_dense(split_model(smol.model), "auto", 4)
    memo, n = memo_positions(plain)
    ts = tables(memo)
    assert n == len(ts) == 30  # every layer's slice rebuilds the rotary tables; the last none
    ids = smol.tokenizer("The printing press changed how knowledge spread",
                         return_tensors="pt")["input_ids"]
    caches = (LocalKVCache(30), LocalKVCache(30))
    with torch.no_grad():
        for t in range(ids.shape[1] - 3, ids.shape[1] + 1):  # prefill, then single tokens
            step = ids[:, :t] if t == ids.shape[1] - 3 else ids[:, t - 1:t]
            before = sum(x.computed for x in ts)
            a = memo.forward_cached(step, caches[0])
            b = plain.forward_cached(step, caches[1])
            assert torch.equal(a, b)
            # one computation a forward (one position tensor), the other 29 slices reuse it
            assert sum(x.computed for x in ts) - before == 1


def test_a_new_position_tensor_is_never_served_stale_tables():
    plain = split_model(tiny_model("llama"))
    memo, _ = memo_positions(plain)
    s = memo.slices[1]
    with torch.no_grad():
        out0 = plain.slices[0](torch.tensor([[5, 6]]), torch.tensor([[0, 1]]))
        args = out0[3:]
        attn = torch.randn(1, 2, *out0[0].shape[1:2], out0[2].shape[-1])
        for pos in (torch.tensor([[0, 1]]), torch.tensor([[7, 9]]), torch.tensor([[7, 9]])):
            assert all(torch.equal(x, y) for x, y in
                       zip(s(pos, attn, *args), plain.slices[1](pos, attn, *args)))
