"""Soak test of a step cut anywhere: `LLM.generate` calls of random prompts (chunked, some
with n=2 and sampling), each cut by a KeyboardInterrupt at a random line of the engine's
Python (what Python's own handler of a second Ctrl-C does, wherever it lands), or run
whole when the line comes after its end. After each call: no request is left, every KV
slot is free once the prefix cache is cleared, and a greedy request gives the tokens it
gave before the first call. Prints each call that breaks one of these, then a summary.

    python benchmarks/cut_soak.py --seed 1 --runs 200

tests/lamina/test_interrupt.py runs 24 fixed cuts of one call in the suite; this is the
long run behind the RESULTS entry of 2026-12-06 (twenty-seventh session).
"""
from __future__ import annotations

import argparse
import logging
import os
import random
import sys

from lamina import LLM, SamplingParams

FILES = tuple(os.path.join("lamina", *p) for p in [
    ("engine", "engine.py"), ("engine", "scheduler.py"), ("engine", "prefix_cache.py"),
    ("memory", "allocator.py")])
TEXT = "The history of the printing press begins in the fifteenth century. " * 12


class CutAt:
    """A trace function raising KeyboardInterrupt at the n-th line run in FILES."""

    def __init__(self, n: int):
        self.seen, self.n = 0, n

    def __call__(self, frame, event, arg):
        if not frame.f_code.co_filename.endswith(FILES):
            return None
        if event == "line":
            self.seen += 1
            if self.seen == self.n:
                sys.settrace(None)
                raise KeyboardInterrupt
        return self


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--max-line", type=int, default=20000, help="cut at a line in 1..this")
    args = ap.parse_args()
    llm = LLM(max_step_tokens=64, num_kv_slots=512)
    logging.getLogger("lamina").setLevel(logging.ERROR)  # one warning per reset
    eng, check = llm.engine, SamplingParams(max_tokens=8, temperature=0)
    probe = ["Name a colour.", "Count to five:"]
    ref = [o.token_ids for o in llm.generate(probe, check, use_tqdm=False)]
    rng, bad, cuts = random.Random(args.seed), 0, 0
    for run in range(args.runs):
        prompts = [TEXT[:rng.randrange(10, len(TEXT))] for _ in range(rng.randrange(1, 6))]
        params = [SamplingParams(max_tokens=rng.randrange(1, 30), n=rng.choice([1, 1, 2]),
                                 temperature=rng.choice([0, 1.0]), seed=1) for _ in prompts]
        cut = CutAt(rng.randrange(1, args.max_line))
        sys.settrace(cut)
        try:
            llm.generate(prompts, params, use_tqdm=False)
            what = "whole"
        except KeyboardInterrupt:
            what, cuts = "cut", cuts + 1
        except BaseException as e:  # noqa: BLE001 - the soak reports anything else
            what = f"raised {type(e).__name__}: {e}"
        finally:
            sys.settrace(None)
        left = sorted(eng.request_ids()) or eng.has_unfinished()
        eng.clear_prefix_cache()
        leaked = [a.config.num_slots - a.num_free() for a in eng.allocs]
        same = [o.token_ids for o in llm.generate(probe, check, use_tqdm=False)] == ref
        if left or any(leaked) or not same or what.startswith("raised"):
            bad += 1
            print(f"run {run}: line {cut.n}: {what}; requests left {left}, slots held "
                  f"{leaked}, probe as before: {same}", flush=True)
    print(f"seed {args.seed}: {args.runs} calls, {cuts} cut, {bad} bad; engine resets "
          f"{eng.num_recoveries}")
    llm.shutdown()
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
