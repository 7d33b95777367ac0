"""What the suite's exactness runs cost per schedule on this CPU, and how fast the machine
is right now (one torch thread, as each xdist worker runs).

    python benchmarks/schedule_step_probe.py [machine] [steps]

- `machine`: the 16 prompts of `tests/conftest.py` to `HF_NEW` tokens on a fresh local
  engine, on oneDNN-packed and on eager linears, and HF's `generate` over 8 of them one
  at a time (the suite's reference): seconds each. Run it before and after a suite run
  to see whether the machine itself changed speed meanwhile.
- `steps`: PICKS[4] of the prompts (8, 5-450 tokens) to `HF_NEW` tokens, each engine
  step timed, on the local executor, on one compute side over socket pairs to two memory
  servers (`tests/lamina/test_link.py`'s wiring) and on a ring of three compute threads
  (`tests/lamina/test_ring.py`'s, 4 micro-batches): the prefill step and the median
  decode step. A decode step of n micro-batches reads every weight n times.
Nothing here is a target; it prints, it writes nothing.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lamina import SamplingParams
from lamina.engine.config import EngineConfig
from lamina.engine.engine import LLMEngine
from lamina.model.loader import load
from lamina.splitter import split_model
from lamina.splitter.dense import pack_dense
from tests.conftest import HF_NEW, LENGTHS, TEXT, hf_greedy_of
from tests.lamina.test_engine import engine as local_engine
from tests.lamina.test_rotational import PICKS

SLOTS = 8192
GREEDY = SamplingParams(max_tokens=HF_NEW, temperature=0.0, ignore_eos=True)


def timed_steps(eng, prompts) -> list[float]:
    for p in prompts:
        eng.add_request(p, GREEDY)
    times = []
    while eng.has_unfinished():
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    return times


def machine(smol, split, prompts) -> None:
    packed, _ = pack_dense(split, "onednn")
    for name, s in (("packed", packed), ("eager", split)):
        eng = local_engine(smol, s, num_kv_slots=SLOTS, max_step_tokens=1024)
        t = sum(timed_steps(eng, prompts))
        print(f"machine: local engine, 16 prompts, {name} linears: {t:.2f} s")
    t = time.perf_counter()
    hf_greedy_of(smol, prompts[:8])  # the suite's reference, one prompt at a time
    print(f"machine: HF generate, 8 prompts one at a time: {time.perf_counter() - t:.2f} s")


def steps(smol, split, prompts) -> None:
    from tests.lamina.test_link import linked_engine
    from tests.lamina.test_ring import RingExecutor

    pick = [prompts[i] for i in PICKS[4]]
    ring = RingExecutor(split, smol.config.vocab_size, 3)
    runs = {
        "local": local_engine(smol, split, num_kv_slots=SLOTS, max_step_tokens=2048),
        "sockets, 2 memory servers": linked_engine(smol, split, SLOTS,
                                                   max_step_tokens=2048)[0],
        "ring of 3, 4 micro-batches": LLMEngine(
            EngineConfig(num_kv_slots=SLOTS, num_memory_workers=2, pipeline="rotational",
                         num_batches=4, num_compute_workers=3, max_step_tokens=2048),
            ring, smol.tokenizer, smol.config)}
    for name, eng in runs.items():
        t = timed_steps(eng, pick)
        print(f"steps: {name}: {len(t)} steps, first (prefill) {t[0]:.2f} s, median "
              f"decode {statistics.median(t[1:]):.3f} s, all {sum(t):.1f} s")
    ring.shutdown()


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    smol = load()
    split = split_model(smol.model)
    ids = smol.tokenizer(TEXT)["input_ids"]
    prompts = [ids[:n] for n in LENGTHS]
    print(f"one torch thread; {HF_NEW} new tokens")
    for mode in argv or ["machine", "steps"]:
        {"machine": machine, "steps": steps}[mode](smol, split, prompts)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
