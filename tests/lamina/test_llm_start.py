"""How `LLM` starts a worker executor (`executor="ray"`, here a stand-in that runs the
local executor in-process): the workers start while this process reads the model's
tokenizer and config; a GGUF not yet converted is converted here first, once; a bad
path fails before any worker starts; either side's failure is the one raised, and
workers already started are shut down."""
import threading
import time

import pytest
import torch

import lamina.entrypoints.llm as llm_mod
import lamina.model.loader as loader
from lamina import LLM, SamplingParams
from lamina.executor.local import LocalExecutor
from lamina.memory.memory_side import MemorySide
from lamina.memory.pool import KVPool, KVPoolConfig
from lamina.model.loader import ModelLoadError

GREEDY = SamplingParams(max_tokens=4, temperature=0)


@pytest.fixture
def workers(smol, smol_split, monkeypatch):
    """A stand-in for the Ray executor: `events` records what happened in which order;
    `info_read` is set when this process's `load_info` returns, `Workers.started` when
    the workers' start begins; `Workers.hold`, when a test sets it, is what the start
    then waits on, and `Workers.fail` what it raises."""
    events: list[str] = []
    info_read = threading.Event()
    real_info = loader.load_info

    def load_info(model=None, dtype="float32"):
        events.append("info begins")
        try:
            return real_info(model, dtype=dtype)
        finally:
            events.append("info ends")
            info_read.set()

    class Workers(LocalExecutor):
        started = threading.Event()
        hold: threading.Event | None = None
        fail: Exception | None = None

        @classmethod
        def check(cls, config) -> None:
            pass

        def __init__(self, model, dtype, config, address=None):
            events.append("workers start")
            Workers.started.set()
            if Workers.hold is not None:
                assert Workers.hold.wait(30), "the workers' start waited in vain"
            if Workers.fail is not None:
                raise Workers.fail
            pool = KVPool(KVPoolConfig.for_specs(smol_split.attention_specs,
                                                 config.num_kv_slots))
            super().__init__(smol_split, [MemorySide(pool)],
                             vocab_size=smol.config.vocab_size)
            events.append("workers ready")

        def shutdown(self) -> None:
            events.append("workers shut down")
            super().shutdown()

    monkeypatch.setattr(loader, "load_info", load_info)
    monkeypatch.setattr(llm_mod, "plugin_executor", lambda name: Workers)
    return Workers, events, info_read


def test_the_workers_start_while_the_model_info_is_read(workers, smol, prompts,
                                                        monkeypatch):
    """The info is read only once the workers' start began, and the start ends only
    once the info was read: both at once, or neither (a wait runs out) and it fails."""
    Workers, events, info_read = workers
    Workers.hold = info_read
    read = loader.load_info

    def after_the_start(model=None, dtype="float32"):
        assert Workers.started.wait(30), "the info was read before any worker started"
        return read(model, dtype)

    monkeypatch.setattr(loader, "load_info", after_the_start)
    llm = LLM(executor="ray", num_kv_slots=512)
    try:
        assert events.index("workers start") < events.index("info ends")
        assert events.index("info ends") < events.index("workers ready")
        assert llm.loaded.tokenizer is not None and llm.split is None
        out = llm.generate([prompts[0]], GREEDY, use_tqdm=False)
        ids = torch.tensor([prompts[0]])
        want = smol.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=4, pad_token_id=0)[0, ids.shape[1]:]
        assert out[0].token_ids == want.tolist()
    finally:
        llm.shutdown()


def test_a_gguf_not_yet_converted_is_converted_before_the_workers_start(workers,
                                                                         monkeypatch):
    Workers, events, _ = workers
    monkeypatch.setattr(loader, "converted", lambda model=None, dtype=None: False)
    llm = LLM(executor="ray", num_kv_slots=512)
    llm.shutdown()
    assert events[:3] == ["info begins", "info ends", "workers start"]


def test_a_path_without_a_model_fails_before_any_worker_starts(workers, tmp_path):
    _, events, _ = workers
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "nope"), executor="ray")
    assert "workers start" not in events


def test_the_info_failing_shuts_the_started_workers_down(workers, monkeypatch):
    _, events, _ = workers

    def broken(model=None, dtype="float32"):
        events.append("info fails")
        raise ModelLoadError("could not load model from here: no tokenizer")

    monkeypatch.setattr(loader, "load_info", broken)
    with pytest.raises(ModelLoadError, match="no tokenizer"):
        LLM(executor="ray", num_kv_slots=512)
    assert "workers ready" in events and events[-1] == "workers shut down"


def test_the_workers_failing_raise_their_own_error_after_the_info_is_read(workers):
    Workers, events, _ = workers
    Workers.fail = RuntimeError("the compute worker could not start: out of memory")
    with pytest.raises(RuntimeError, match="could not start: out of memory"):
        LLM(executor="ray", num_kv_slots=512)
    assert "info ends" in events  # the reading thread ended, not left behind


def test_an_llm_over_workers_grows_back_to_its_size_beside_its_calls(workers, prompts,
                                                                     hf_greedy):
    """`LLM(executor="ray")` keeps its memory workers' count (`keeper`): scaled to 2
    (its size now), then one taken from its engine alone, as a recovery drops one (the
    LLM's size stays 2). Once a `generate` call in another thread has run a few steps,
    the cluster (the stand-in's `memory_workers_room`) holds 2 again, and within
    `regrow_interval_s` the keeper adds the worker back between two of its steps; the
    call gives HF's greedy tokens. Shutdown stops the keeper. A bad interval is refused
    by name before any worker starts."""
    Workers, events, _ = workers
    with pytest.raises(ValueError, match=r"regrow_interval_s must be a number of seconds "
                                         r">= 0 \(0: never\), got -1"):
        LLM(executor="ray", regrow_interval_s=-1)
    assert events == []
    room = [1]
    Workers.memory_workers_room = lambda self, size: room[0]
    llm = LLM(executor="ray", num_kv_slots=512, regrow_interval_s=0.05)
    try:
        assert llm.keeper.running and llm.scale_memory_workers(2).after == 2
        with llm._scaling:  # (the keeper's lock: it waits)
            llm._shared.call(lambda e: e.scale_memory_workers(1))
        assert llm.keeper.missing() == 1 and llm.config.num_memory_workers == 2
        pick, got = [1, 3, 4], []
        params = SamplingParams(max_tokens=32, temperature=0)
        call = threading.Thread(target=lambda: got.extend(
            llm.generate([prompts[i] for i in pick], params, use_tqdm=False)))
        steps = len(llm.engine.step_timings)
        call.start()
        while len(llm.engine.step_timings) < steps + 3 and call.is_alive():
            time.sleep(0.005)
        assert len(llm.engine.allocs) == 1
        room[0] = 2
        call.join(300)
        assert [o.token_ids for o in got] == [hf_greedy[i] for i in pick]
        deadline = time.monotonic() + 60
        while len(llm.engine.allocs) < 2:
            assert time.monotonic() < deadline, llm.keeper.failed
            time.sleep(0.02)
        assert len(llm.executor.memory) == 2 and llm.keeper.failed is None
    finally:
        llm.shutdown()
    assert not llm.keeper.running
