"""End-to-end generation on SmolLM2 (real weights) with the local executor: greedy
tokens identical to HF `generate`, preemption, seeded sampling, bad input."""
import time

import pytest
import torch

from lamina.engine.config import EngineConfig
from lamina.engine.engine import LLMEngine
from lamina.executor.local import LocalExecutor
from lamina.memory.memory_side import MemorySide
from lamina.memory.pool import KVPool, KVPoolConfig
from lamina.sampling.params import SamplingParams
from tests.conftest import HF_NEW, TEXT

GREEDY = SamplingParams(max_tokens=HF_NEW, temperature=0)


# KV slots of a test engine unless it asks for others: the 16 prompts and their new
# tokens take ~4.2k. EngineConfig's 16384 would zero 755 MB for each engine, up to 2.7 s
# on the test VMs (fresh memory the hypervisor backs page by page).
SLOTS = 8192


def engine(smol, split, **kw):
    cfg = EngineConfig(**{"num_kv_slots": SLOTS, **kw})
    pool = KVPool(KVPoolConfig.for_specs(split.attention_specs, cfg.num_kv_slots,
                                         cfg.kv_dtype))
    return LLMEngine(cfg, LocalExecutor(split, MemorySide(pool)), smol.tokenizer,
                     smol.config)


def run(eng, prompts, params):
    ids = [eng.add_request(p, params) for p in prompts]
    out = {}
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id] = o
    return [out[i] for i in ids]


@pytest.mark.parametrize("linears", ["packed", "eager"])
def test_greedy_batch_identical_to_hf(smol, smol_split, smol_packed, prompts, hf_greedy,
                                      linears):
    """16 prompts of 5-600 tokens sent together; short ones finish prefill first and the
    batch mixes prefill and decode, HF_NEW new tokens each. On oneDNN-packed weights, as
    `LLM` runs on CPU (the engine tests here and in the other files run them: they are
    1.6-1.9x faster than eager linears with one thread), and on the split's eager linears
    (`dense_backend="eager"`)."""
    split = smol_packed if linears == "packed" else smol_split
    outs = run(engine(smol, split, max_step_tokens=1024), prompts, GREEDY)
    assert [o.token_ids for o in outs] == hf_greedy
    assert all(o.finish_reason in ("length", "stop") for o in outs)
    assert outs[0].text == smol.tokenizer.decode(hf_greedy[0], skip_special_tokens=True)


def test_unknown_dense_backend_is_rejected():
    with pytest.raises(ValueError, match="dense_backend must be one of"):
        EngineConfig(dense_backend="mkl")


def test_preemption_completes_with_same_tokens(smol, smol_packed, prompts, hf_greedy):
    pick = [1, 3, 4, 10, 11, 12]  # 12..128-token prompts: 392 prompt + 192 new tokens
    eng = engine(smol, smol_packed, num_kv_slots=400)
    plans, execute = [], eng.executor.execute
    eng.executor.execute = lambda plan: (plans.append(plan), execute(plan))[1]
    outs = run(eng, [prompts[i] for i in pick], GREEDY)
    assert [o.token_ids for o in outs] == [hf_greedy[i] for i in pick]
    assert sum(o.metrics["preemptions"] for o in outs) > 0
    assert eng.free_slots()[0] == 400  # everything returned
    # a readmitted sequence takes back the KV it left cached (prefix caching, on by
    # default): in this schedule none of it was evicted meanwhile, so each comes back
    # exactly where it stopped and computes one position
    written, back = {}, []
    for w in (w for plan in plans for w in plan.seqs):
        if w.slots_from == 0 and w.seq_id in written:
            back.append((w.start_pos, written[w.seq_id]))
        written[w.seq_id] = w.start_pos + len(w.token_ids)
    assert back and all(start == had for start, had in back)


def test_request_metrics_time_its_queue_and_output_tokens(smol, smol_packed, prompts):
    """One sequence a step: the second request waits until the first has finished, so its
    queue time covers the first's whole life; each request's seconds per output token
    span the steps that drew its tokens after the first (timed apart, by the engine's
    step timings)."""
    eng = engine(smol, smol_packed, max_batch=1)
    t = time.perf_counter()
    ids = [eng.add_request(prompts[i], SamplingParams(max_tokens=n, ignore_eos=True))
           for i, n in ((1, 4), (3, 6))]
    gap = time.perf_counter() - t  # bounds how far apart the two arrived
    out, step_s = {}, []
    while eng.has_unfinished():
        done = eng.step()
        step_s.append(eng.step_timings[-1]["step_s"])
        out.update({o.request_id: o for o in done})
    first, second = (out[i].metrics for i in ids)
    assert len(step_s) == 4 + 6  # a prompt's step draws its first token
    assert 0 <= first["queue_s"] < first["ttft_s"] < first["e2e_s"]
    assert second["queue_s"] >= first["e2e_s"] - gap
    assert second["ttft_s"] > second["queue_s"]
    # the first's tokens 2..4 came from steps 2..4, the second's 2..6 from steps 6..10
    for m, steps in ((first, step_s[1:4]), (second, step_s[5:10])):
        assert m["tpot_s"] * len(steps) == pytest.approx(sum(steps), rel=0.2, abs=0.005)


def test_seeded_sampling_reproducible_and_n(smol, smol_packed, prompts):
    p = SamplingParams(max_tokens=12, temperature=0.9, top_k=50, top_p=0.9, seed=123, n=3)
    eng = engine(smol, smol_packed)
    a = run(eng, prompts[:3], p)
    b = run(engine(smol, smol_packed), prompts[:3], p)
    assert [[c.token_ids for c in o.outputs] for o in a] == \
        [[c.token_ids for c in o.outputs] for o in b]
    assert all(len(o.outputs) == 3 for o in a)
    assert any(o.outputs[0].token_ids != o.outputs[1].token_ids for o in a)
    # n > 1 forks the KV: each prompt is prefilled once (first step feeds 5 + 12 + 40 tokens)
    assert eng.step_timings[0]["tokens"] == sum(len(q) for q in prompts[:3])
    assert eng.step_timings[0]["seqs"] == 3 and eng.step_timings[1]["seqs"] == 9
    assert eng.free_slots()[0] == eng.config.num_kv_slots and eng.alloc.stats().shared == 0


def test_sampled_tokens_survive_preemption(smol, smol_packed, prompts):
    """Draws are keyed by (seed, position): a recomputed sequence draws the same tokens."""
    pick = [1, 3, 4, 10, 11, 12]
    p = SamplingParams(max_tokens=32, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True)
    big = run(engine(smol, smol_packed), [prompts[i] for i in pick], p)
    small = run(engine(smol, smol_packed, num_kv_slots=400), [prompts[i] for i in pick], p)
    assert sum(o.metrics["preemptions"] for o in small) > 0
    assert [o.token_ids for o in small] == [o.token_ids for o in big]


def test_stop_strings_and_stop_tokens(smol, smol_packed, prompts, hf_greedy):
    eng = engine(smol, smol_packed)
    first = hf_greedy[4]
    text = smol.tokenizer.decode(first, skip_special_tokens=True)
    stop = text[len(text) // 2: len(text) // 2 + 6]
    (o,) = run(eng, [prompts[4]], SamplingParams(max_tokens=64, temperature=0, stop=(stop,)))
    assert o.finish_reason == "stop" and stop not in o.text and text.startswith(o.text)
    (o,) = run(eng, [prompts[4]], SamplingParams(max_tokens=64, temperature=0,
                                                 stop_token_ids=(first[3],)))
    assert o.token_ids == first[:first.index(first[3]) + 1] and o.finish_reason == "stop"


def test_bad_input_rejected_and_engine_keeps_serving(smol, smol_packed, prompts, hf_greedy):
    eng = engine(smol, smol_packed)
    good = eng.add_request(prompts[0], GREEDY)
    with pytest.raises(ValueError, match="empty prompt"):
        eng.add_request("", GREEDY)
    with pytest.raises(ValueError, match="empty prompt"):
        eng.add_request([], GREEDY)
    with pytest.raises(ValueError, match="context is 8192"):
        eng.add_request([1] * 9000, GREEDY)
    with pytest.raises(TypeError, match="SamplingParams"):
        eng.add_request(prompts[0], {"max_tokens": 3})
    done = []
    while eng.has_unfinished():
        done += eng.step()
    assert [o.request_id for o in done] == [good] and done[0].token_ids == hf_greedy[0]


@pytest.mark.parametrize("pipeline", ["none", "rotational"])
def test_two_memory_workers_partition_requests_and_match(smol, smol_packed, prompts, hf_greedy,
                                                         pipeline):
    cfg = EngineConfig(num_kv_slots=3000, num_memory_workers=2, pipeline=pipeline)
    pools = [KVPool(KVPoolConfig.for_specs(smol_packed.attention_specs, 3000)) for _ in range(2)]
    eng = LLMEngine(cfg, LocalExecutor(smol_packed, [MemorySide(p) for p in pools]),
                    smol.tokenizer, smol.config)
    pick = list(range(8))
    ids = [eng.add_request(prompts[i], GREEDY) for i in pick]
    eng.step()  # admission step: placement balanced by free slots
    used = [3000 - a.num_free() for a in eng.allocs]
    assert min(used) > 0 and max(used) - min(used) <= 600  # both workers hold KV
    out = {}
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id] = o
    assert [out[i].token_ids for i in ids] == [hf_greedy[i] for i in pick]
    want = 2 if pipeline == "rotational" else 1
    assert {t["micro_batches"] for t in eng.step_timings} == {want}


@pytest.mark.parametrize("slots,pick,pipeline,budget", [
    (400, [8, 0], "none", 4096),  # 600-token prompt: prefill split over both workers' pools
    (256, [14, 0], "rotational", 4096),  # 250 tokens + 64 new: decode spills onto worker 1
    # the same fed 96 / 64 tokens a step: chunks, the later ones reaching worker 1
    (400, [8, 0], "none", 96),
    (256, [14, 0], "rotational", 64),
])
def test_kv_split_over_workers_merges_exactly(smol, smol_packed, prompts, hf_greedy, slots,
                                              pick, pipeline, budget):
    cfg = EngineConfig(num_kv_slots=slots, num_memory_workers=2, pipeline=pipeline,
                       max_step_tokens=budget)
    pools = [KVPool(KVPoolConfig.for_specs(smol_packed.attention_specs, slots))
             for _ in range(2)]
    eng = LLMEngine(cfg, LocalExecutor(smol_packed, [MemorySide(p) for p in pools]),
                    smol.tokenizer, smol.config)
    ids = [eng.add_request(prompts[i], GREEDY) for i in pick]
    seq = eng.scheduler.waiting[0]
    out, spans = {}, set()
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id] = o
        spans.add(tuple(w for w, _ in seq.segments))
    assert (0, 1) in spans  # the long sequence did span both workers
    assert sum(o.metrics["preemptions"] for o in out.values()) == 0
    assert [out[i].token_ids for i in ids] == [hf_greedy[i] for i in pick]
    assert eng.free_slots() == [slots, slots]


def test_a_prompt_longer_than_a_step_is_fed_in_chunks(smol, smol_packed):
    """A prompt longer than the step budget (1300 tokens, 1024 a step; by default 4096
    of the model's 8192): fed over two steps, its greedy tokens equal HF's; a request
    that needs its prompt in one step (prompt logprobs) is refused by name, and nothing
    else changes."""
    assert EngineConfig().max_step_tokens == 4096 < smol.config.max_position_embeddings
    ids = (smol.tokenizer(TEXT)["input_ids"] * 2)[:1300]
    with torch.no_grad():
        t = torch.tensor([ids])
        want = smol.model.generate(t, attention_mask=torch.ones_like(t), do_sample=False,
                                   max_new_tokens=8)[0, 1300:].tolist()
    eng = engine(smol, smol_packed, max_step_tokens=1024)
    with pytest.raises(ValueError, match="prompt_logprobs needs the prompt in one step: it "
                                         "has 1300 tokens, a step takes 1024"):
        eng.add_request(ids, SamplingParams(max_tokens=2, prompt_logprobs=1))
    rid = eng.add_request(ids, SamplingParams(max_tokens=8, temperature=0))
    fed = []
    while eng.has_unfinished():
        outs = eng.step()
        fed.append(eng.step_timings[-1]["tokens"])
    assert fed[:2] == [1024, 276] and outs[0].request_id == rid
    assert outs[0].token_ids == want
    assert eng.free_slots() == [eng.config.num_kv_slots]


def test_split_micro_contiguous_and_balanced():
    from lamina.compute.packing import split_micro
    from lamina.engine.messages import SeqWork

    def seq(i, n):
        return SeqWork(i, (1,) * n, 0, tuple(range(n)))

    seqs = tuple(seq(i, n) for i, n in enumerate([1, 1, 1, 1, 10, 1, 1, 1, 1]))
    groups = split_micro(seqs, 2)
    assert [[s.seq_id for s in g] for g in groups] == [[0, 1, 2, 3, 4], [5, 6, 7, 8]]
    assert [[s.seq_id for s in g] for g in split_micro(seqs[:1], 2)] == [[0]]
    assert sum(map(len, split_micro(seqs, 3))) == 9
    with pytest.raises(ValueError, match="pipeline must be one of"):
        EngineConfig(pipeline="zigzag")


def test_memory_side_checks_slot_metadata_once_per_step(smol, smol_packed, prompts,
                                                        monkeypatch):
    import torch

    import lamina.memory.memory_side as ex
    from lamina.kernels import AttentionInputError, AttentionParams, SlotBatch
    calls = []
    real = ex.validate_batch
    monkeypatch.setattr(ex, "validate_batch", lambda b, n: calls.append(n) or real(b, n))
    eng = engine(smol, smol_packed, num_kv_slots=1000)
    eng.add_request(prompts[2], SamplingParams(max_tokens=3, temperature=0))
    for _ in range(3):
        eng.step()
    assert calls == [1000] * 3  # one scan a step, not one a layer (30 layers)

    mem = MemorySide(KVPool(KVPoolConfig(1, 8, 1, 4)))
    batch = SlotBatch.build([[0, 1, 2]], [1])
    mem.check(torch.tensor([2], dtype=torch.int32), batch)  # fine
    with pytest.raises(AttentionInputError, match="new slot ids out of range"):
        mem.check(torch.tensor([8], dtype=torch.int32), batch)
    with pytest.raises(AttentionInputError, match="slot ids out of range"):
        mem.check(torch.tensor([2], dtype=torch.int32), SlotBatch.build([[0, 9, 2]], [1]))
    # per layer, after the check: shapes are still verified
    q, k = torch.randn(1, 1, 4), torch.randn(1, 1, 4)
    o, lse = mem.attend(0, AttentionParams(0.5), q, k, k,
                        torch.tensor([2], dtype=torch.int32), batch, checked=True)
    assert o.shape == (1, 1, 4) and lse.shape == (1, 1)
    with pytest.raises(AttentionInputError, match="q has 2 rows"):
        mem.attend(0, AttentionParams(0.5), torch.randn(2, 1, 4), k, k,
                   torch.tensor([2], dtype=torch.int32), batch, checked=True)
    with pytest.raises(AttentionInputError, match="k must be \\[2, 1, 4\\] for 2 slots"):
        mem.attend(0, AttentionParams(0.5), q, k, k, torch.tensor([1, 2], dtype=torch.int32),
                   batch, checked=True)


def test_repetition_penalty_equals_hf_generate(smol, smol_packed, prompts):
    """HF's own RepetitionPenaltyLogitsProcessor (prompt and output tokens) as the
    reference, greedy, prompts batched together."""
    pick, new = [0, 2, 10], 24
    p = SamplingParams(max_tokens=new, temperature=0, repetition_penalty=1.3)
    outs = run(engine(smol, smol_packed), [prompts[i] for i in pick], p)
    for o, i in zip(outs, pick):
        ids = torch.tensor([prompts[i]])
        with torch.no_grad():
            ref = smol.model.generate(ids, attention_mask=torch.ones_like(ids),
                                      max_new_tokens=new, do_sample=False,
                                      repetition_penalty=1.3, pad_token_id=0)
        want = ref[0, len(prompts[i]):].tolist()
        assert o.token_ids == want[:len(o.token_ids)] and len(o.token_ids) in (len(want), new)


def test_presence_and_frequency_penalties_equal_a_reference_loop(smol, smol_packed, prompts,
                                                                  hf_greedy):
    """Reference: HF's full-model logits at each step, OpenAI's penalty formula in NumPy,
    argmax; a penalty-free request in the same batch keeps HF's plain greedy tokens."""
    import numpy as np

    new, pen = 16, SamplingParams(max_tokens=16, temperature=0, presence_penalty=1.5,
                                  frequency_penalty=0.8)
    eng = engine(smol, smol_packed)
    rid = eng.add_request(prompts[1], pen)
    plain = eng.add_request(prompts[3], SamplingParams(max_tokens=new, temperature=0))
    out = {}
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id] = o
    seq, drawn = list(prompts[1]), []
    for _ in range(len(out[rid].token_ids)):
        with torch.no_grad():
            x = smol.model(torch.tensor([seq])).logits[0, -1].double().numpy()
        for t in set(drawn):
            x[t] -= 0.8 * drawn.count(t) + 1.5
        drawn.append(int(np.argmax(x)))
        seq.append(drawn[-1])
    assert out[rid].token_ids == drawn and len(drawn) >= 8
    assert drawn != hf_greedy[1][:len(drawn)]  # the penalties changed the greedy path
    ids = torch.tensor([prompts[3]])
    with torch.no_grad():
        ref = smol.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                  do_sample=False, pad_token_id=0)[0, len(prompts[3]):].tolist()
    assert out[plain].token_ids == ref[:len(out[plain].token_ids)]


def test_logit_bias_forces_a_token_and_bad_ids_are_rejected(smol, smol_packed, prompts):
    eng = engine(smol, smol_packed)
    out = run(eng, [prompts[0]], SamplingParams(max_tokens=3, temperature=0,
                                                logit_bias={42: 100}))
    assert out[0].token_ids == [42, 42, 42]
    with pytest.raises(ValueError, match="logit_bias names token 49152"):
        eng.add_request(prompts[0], SamplingParams(logit_bias={49152: 1.0}))
    assert not eng.has_unfinished()


@pytest.mark.parametrize("backend", ["onednn", "avx512bf16"])
def test_bf16_greedy_tracks_hf_bf16(smol, smol_bf16, prompts, backend):
    """SmolLM2 in bf16 with a bf16 KV pool, on oneDNN-packed linears (fp32 copies where
    this CPU has no bf16 GEMM) or on our bf16 linear kernel, as `LLM(dtype="bfloat16")`
    runs them. bf16 rounds
    differently in every engine (here even the eager split drifts from HF), so as vLLM
    checks its bf16 runs: tokens equal HF bf16 greedy's until the first difference, and
    there ours is one of HF's own top-2 choices (a near tie), never an unrelated token."""
    from lamina.kernels.linear import linear_ops
    from lamina.splitter.dense import pack_dense

    ops, why = linear_ops()
    if backend == "avx512bf16" and ops is None:
        pytest.skip(f"no bf16 linear kernel here: {why}")
    hf, unpacked = smol_bf16
    split, choice = pack_dense(unpacked, backend, linear_ops=ops)
    assert choice.backend == backend
    eng = engine(smol, split, num_kv_slots=2048, kv_dtype="bfloat16")
    pick = [prompts[i] for i in (0, 2, 4, 6)]  # 5, 40, 128, 300 tokens
    outs = run(eng, pick, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    eos, same = smol.tokenizer.eos_token_id, 0
    with torch.no_grad():
        for p, o in zip(pick, outs):
            ids = torch.tensor([p])
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=24, pad_token_id=eos)[0, len(p):].tolist()
            i = next((i for i, (a, b) in enumerate(zip(o.token_ids, ref)) if a != b), None)
            if i is None:
                same += 1
                continue
            logits = hf(torch.tensor([p + ref[:i]])).logits[0, -1]
            assert o.token_ids[i] in logits.topk(2).indices.tolist(), (i, o.token_ids[i])
    assert same >= 2  # measured: 3 of the 4 identical for all 24 tokens
