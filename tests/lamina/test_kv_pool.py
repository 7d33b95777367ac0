"""KV pool tensors: layout, batched writes at slots, copy-on-write orders, config errors."""
import pytest
import torch

from lamina.memory.allocator import CopySlot, KVAllocator, KVAllocatorConfig
from lamina.memory.pool import KVPool, KVPoolConfig, thp_mode
from tests.tiny_models import tiny_model


def test_layout_and_sizes():
    c = KVPoolConfig(num_layers=30, num_slots=100, num_kv_heads=3, head_dim=64)
    pool = KVPool(c)
    assert pool.k.shape == (30, 100, 3, 64) and pool.v.shape == (30, 100, 3, 64)
    assert c.bytes_per_slot == 30 * 3 * 128 * 4 == 46080  # SmolLM2, fp32
    assert KVPoolConfig(30, 100, 3, 64, dtype="bfloat16").bytes_per_slot == 23040
    k3, v3 = pool.layer(3)
    assert k3.shape == (100, 3, 64) and k3.is_contiguous()
    assert k3.data_ptr() == pool.k.data_ptr() + 3 * 100 * 3 * 64 * 4  # a view, no copy


def test_write_puts_rows_at_slots_only():
    pool = KVPool(KVPoolConfig(2, 8, 2, 4))
    slots = torch.tensor([6, 1, 3], dtype=torch.int32)
    k = torch.arange(3 * 2 * 4, dtype=torch.float32).reshape(3, 2, 4)
    pool.write(1, slots, k, -k)
    assert torch.equal(pool.k[1, [6, 1, 3]], k) and torch.equal(pool.v[1, [6, 1, 3]], -k)
    assert not pool.k[0].any() and not pool.k[1, [0, 2, 4, 5, 7]].any()


def test_copy_on_write_orders_copy_every_layer():
    alloc = KVAllocator(KVAllocatorConfig(8))
    pool = KVPool(KVPoolConfig(3, 8, 1, 2))
    parent = alloc.allocate("a", 2)  # slots [0, 1]
    for layer in range(3):
        pool.write(layer, torch.tensor(parent), torch.full((2, 1, 2), layer + 1.0),
                   torch.full((2, 1, 2), -(layer + 1.0)))
    alloc.fork("a", "b")
    order = alloc.write("b", 1)  # b writes into shared position 1 -> copy to a new slot
    assert order == CopySlot(1, 2)
    pool.copy([order])
    assert torch.equal(pool.k[:, 2], pool.k[:, 1]) and torch.equal(pool.v[:, 2], pool.v[:, 1])
    with pytest.raises(IndexError, match="out of range"):
        pool.copy([CopySlot(0, 8)])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_read_and_put_carry_every_layers_rows_to_another_pool(dtype):
    """A scale-down's move (`read` on one pool, `put` on another of its layout): the
    rows of the read slots land at the put slots, every layer, byte for byte (int8:
    codes and scales); other slots untouched; a wrong layout or slot refused."""
    cfg = KVPoolConfig(3, 8, 2, 4, dtype=dtype)
    src, dst = KVPool(cfg), KVPool(cfg)
    g = torch.Generator().manual_seed(0)
    for layer in range(3):
        for pool in (src, dst):
            pool.write(layer, torch.arange(8), torch.randn(8, 2, 4, generator=g),
                       torch.randn(8, 2, 4, generator=g))
    k0, v0 = dst.k.clone(), dst.v.clone()
    k, v = src.read([5, 1, 6])
    assert k.shape[:2] == (3, 3) and k.dtype == src.k.dtype
    dst.put([0, 7, 3], k, v)
    for s, d in ((5, 0), (1, 7), (6, 3)):
        assert torch.equal(dst.k[:, d], src.k[:, s]) and torch.equal(dst.v[:, d], src.v[:, s])
    rest = [1, 2, 4, 5, 6]
    assert torch.equal(dst.k[:, rest], k0[:, rest]) and torch.equal(dst.v[:, rest], v0[:, rest])
    with pytest.raises(ValueError, match="for 2 slots of a pool whose rows"):
        dst.put([0, 1], k, v)
    other = KVPool(KVPoolConfig(3, 8, 1, 4, dtype=dtype))
    with pytest.raises(ValueError, match="of a pool whose rows"):
        other.put([0, 1, 2], k, v)
    with pytest.raises(IndexError, match=r"out of range \[0, 8\)"):
        src.read([8])


@pytest.mark.parametrize("kw,msg", [
    ({"num_slots": 0}, "num_slots"), ({"num_kv_heads": 2.0}, "num_kv_heads"),
    ({"dtype": "float16"}, "dtype"), ({"device": "gpu0"}, "device"),
    ({"v_head_dim": -1}, "v_head_dim"), ({"huge_pages": "yes"}, "huge_pages"),
    ({"prefault": 0}, "prefault"),
])
def test_config_errors(kw, msg):
    base = dict(num_layers=1, num_slots=4, num_kv_heads=1, head_dim=8)
    base.update(kw)
    with pytest.raises(ValueError, match=msg):
        KVPoolConfig(**base)


def test_for_specs_from_the_splitter(smol_split):
    c = KVPoolConfig.for_specs(smol_split.attention_specs, num_slots=16)
    assert (c.num_layers, c.num_kv_heads, c.head_dim, c.v_head_dim) == (30, 3, 64, 64)


def _smaps_at(addr: int, key: str) -> str:
    """The `key:` line's value of the mapping holding `addr`, from /proc/self/smaps."""
    inside = False
    for line in open("/proc/self/smaps"):
        head, _, rest = line.partition(" ")
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == key + ":":
            return rest.strip()
    return ""


def _huge_kib_at(addr: int) -> int:
    """AnonHugePages of the mapping holding `addr`."""
    return int(_smaps_at(addr, "AnonHugePages").split()[0] or 0)


def test_host_pool_on_huge_pages_and_zeroed():
    c = KVPoolConfig(num_layers=2, num_slots=8192, num_kv_heads=3, head_dim=64,
                     huge_pages=True, prefault=True)  # the tests' environment: both off
    pool = KVPool(c)
    assert pool.k.data_ptr() % (2 << 20) == 0 and pool.v.data_ptr() % (2 << 20) == 0
    assert pool.k.shape == (2, 8192, 3, 64) and not pool.k.any() and not pool.v.any()
    pool.write(1, torch.tensor([5, 8000], dtype=torch.int32), torch.ones(2, 3, 64),
               torch.ones(2, 3, 64))
    assert pool.k[1].sum().item() == 2 * 3 * 64
    if thp_mode() in ("always", "madvise"):  # the kernel grants THP to this mapping
        assert _huge_kib_at(pool.k.data_ptr()) >= 2048
    plain = KVPool(KVPoolConfig(2, 8192, 3, 64, huge_pages=False, prefault=True))
    assert not plain.k.any() and plain.k.shape == pool.k.shape
    assert "nh" in _smaps_at(plain.k.data_ptr(), "VmFlags").split()
    assert _huge_kib_at(plain.k.data_ptr()) == 0  # 4 KiB pages, whatever the THP mode


def _rss_kib_at(addr: int) -> int:
    """Resident KiB of the mapping holding `addr`."""
    return int(_smaps_at(addr, "Rss").split()[0])


def test_a_pool_not_prefaulted_takes_pages_only_where_slots_are_written():
    """prefault=False: the pool's mappings hold no page until a slot is written, read as
    zeros, and a write faults in only the pages it lands on; prefault=True: every page
    resident at once."""
    mib = 1 << 20
    for huge in (False, True):
        lazy = KVPool(KVPoolConfig(2, 8192, 3, 64, huge_pages=huge, prefault=False))
        k = lazy.k.data_ptr()
        assert lazy.k.nbytes == 12 * mib and _rss_kib_at(k) == 0
        lazy.write(1, torch.tensor([5], dtype=torch.int32), torch.ones(1, 3, 64),
                   torch.ones(1, 3, 64))  # one slot of layer 1: 768 bytes of K
        # a page or a few (the kernel may fault in a small folio; huge pages: one or
        # two), far from the 12 MiB
        assert 0 < _rss_kib_at(k) <= (4096 if huge else 64)
        assert lazy.k[1, 5].eq(1).all() and lazy.k.sum().item() == 3 * 64
        assert not lazy.v[0].any()
    full = KVPool(KVPoolConfig(2, 8192, 3, 64, huge_pages=False, prefault=True))
    assert _rss_kib_at(full.k.data_ptr()) * 1024 >= full.k.nbytes


@pytest.mark.parametrize(("env", "on"), [("1", True), ("0", False), (None, True)])
@pytest.mark.parametrize(("var", "field"), [("LAMINA_KV_HUGE_PAGES", "huge_pages"),
                                            ("LAMINA_KV_PREFAULT", "prefault")])
def test_kv_pages_default_from_the_environment(monkeypatch, env, on, var, field):
    """$LAMINA_KV_HUGE_PAGES and $LAMINA_KV_PREFAULT: EngineConfig's and KVPoolConfig's
    defaults alike; a value given is kept; anything but 0 or 1 refused by name."""
    from lamina.engine.config import EngineConfig

    if env is None:
        monkeypatch.delenv(var, raising=False)
    else:
        monkeypatch.setenv(var, env)
    assert getattr(EngineConfig(), f"kv_{field}") is on
    assert getattr(KVPoolConfig(2, 8, 3, 64), field) is on
    given = EngineConfig(**{f"kv_{field}": not on})
    assert getattr(given, f"kv_{field}") is not on  # given: kept
    monkeypatch.setenv(var, "yes")
    with pytest.raises(ValueError, match=rf"\${var} must be 0 or 1, got 'yes'"):
        EngineConfig()
    with pytest.raises(ValueError, match=rf"\${var} must be 0 or 1, got 'yes'"):
        KVPoolConfig(2, 8, 3, 64)


def test_an_engines_pools_are_on_the_pages_its_config_asks_for(tmp_path, smol):
    """`LLM(kv_huge_pages=...)` reaches each memory worker's pool: on huge pages its
    mapping is advised so (VmFlags `hg`) and backed by them (where the kernel grants
    them on `madvise`); off, its mapping is advised against them (`nh`) and holds none,
    whatever the kernel's mode. (An ordinary allocation would share its mapping with
    other memory, which a CI run found advised and on 256 MiB of huge pages.)"""
    from lamina import LLM, SamplingParams

    model = tmp_path / "tiny"
    tiny_model("llama").save_pretrained(model, safe_serialization=True)
    smol.tokenizer.save_pretrained(model)
    answers = []
    for huge in (True, False):  # prefault with huge pages; not without
        llm = LLM(str(model), num_memory_workers=2, num_kv_slots=65536, kv_huge_pages=huge,
                  kv_prefault=huge)
        try:
            for side in llm.executor.memory:
                assert side.pool.config.huge_pages is huge and side.pool.k.nbytes > 2 << 20
                assert side.pool.config.prefault is huge
                addr = side.pool.k.data_ptr()
                flags = _smaps_at(addr, "VmFlags").split()
                why = (flags, _smaps_at(addr, "Size"), _huge_kib_at(addr))
                assert ("hg" in flags, "nh" in flags) == (huge, not huge), why
                if huge and thp_mode() == "madvise":
                    assert _huge_kib_at(addr) >= 2048, why
                if not huge:
                    assert _huge_kib_at(addr) == 0 == _rss_kib_at(addr), why  # untouched
            greedy = SamplingParams(max_tokens=4, temperature=0)
            answers.append(llm.generate([[5, 9, 12, 40]], greedy, use_tqdm=False)[0].token_ids)
            if not huge:  # the pages its slots were written to, faulted in as it went
                assert sum(_rss_kib_at(side.pool.k.data_ptr())
                           for side in llm.executor.memory) > 0
        finally:
            llm.shutdown()
    assert answers[0] == answers[1]


def test_host_zeros_small_and_bf16():
    from lamina.memory.pool import host_zeros
    t = host_zeros((4, 3), torch.bfloat16)  # under 2 MiB: an ordinary tensor
    assert t.dtype == torch.bfloat16 and t.shape == (4, 3) and not t.any()
    big = host_zeros((1 << 20, 2), torch.bfloat16)
    assert big.data_ptr() % (2 << 20) == 0 and big.dtype == torch.bfloat16 and not big.any()
