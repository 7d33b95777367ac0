"""Finding the one request behind steps that keep failing (plain Python over request ids).

Data in: the request ids of each step while a search runs, and whether it failed.
Data out: which waiting requests may be admitted (`admits`), and at the end a verdict:
the culprit's id, or None (no one request explains the failures).

Why: a step can fail with no sequence named: a bug in a dense slice or a kernel that
one request's data sets off, a worker that crashes on it. The engine recovers such a
step (workers back, KV recomputed); when the failures keep coming past
`EngineConfig.max_recoveries` in a row, stopping would fail every request in flight and
leave the server dead. Instead the engine bisects: after each recovery only some of the
requests the failed step held (`probe`) are admitted again. A probe that fails narrows
the suspects to its requests in that step; a probe whose requests each draw a token
(past the point where they failed) clears them, and the next probe is half of the
suspects not cleared yet. One request left is tried alone; if that fails twice (a
worker lost to something else, once, while it ran alone must not name it), it is named:
that request fails alone and the others go on. If every suspect is cleared, the
failures did not follow any one request (a transient fault, or several requests
together): the search ends and the engine runs on, counting failures in a row afresh.
The failures need not be in a row: a long prompt whose last chunk trips the fault,
recomputed from its start after each recovery, runs its first chunks between them; so a
request in more than max_recoveries failed steps since it last drew a token starts a
search too.

Requests not among the suspects (arrived since, or waiting then) are held until the
search ends; cleared requests keep running. Each failed probe costs one recovery, so a
search over B requests ends within about log2(B) + 3 failed steps.

A bug that fails every step, whatever it holds, would name each request in turn. So a
culprit named while an earlier one was named with no step run since must first have an
alibi checked (`alibi`): a one-token request of the engine's own (`LLMEngine._probe`)
runs one step alone. If it does, the culprit is named; if it fails too (twice, as
above), the engine gives up and stops, as it did before searches: the failures follow
every request, not one. Why not the other requests as the alibi (they would make
progress meanwhile): one of them may be a culprit too, and their step failing would
stop the engine for everyone (three poisoned requests did).
"""
from __future__ import annotations


class CulpritSearch:
    """One search: the suspects (in arrival order), the probe now admitted, the
    requests cleared, and how many failed steps it has seen."""

    def __init__(self, suspects) -> None:
        self.suspects: list[int] = sorted(set(suspects))
        if not self.suspects:
            raise ValueError("a culprit search needs at least one suspect")
        self.cleared: set[int] = set()
        self.failures = 0  # failed steps seen since it began
        self.error = ""  # the latest failure, as the engine words it
        self.probe: set[int] = set()
        # a culprit found whose naming waits for its alibi to run a step (`alibi`)
        self.accused: int | None = None
        # the requests of a failed step that gives a verdict (a request alone, an alibi),
        # seen failing once: the verdict waits for the same step to fail again
        self.unconfirmed: frozenset[int] | None = None
        self._next_probe()

    def _next_probe(self) -> None:
        """The first half (rounded up) of the suspects not cleared yet; empty: none left."""
        left = [r for r in self.suspects if r not in self.cleared]
        self.probe = set(left[:(len(left) + 1) // 2])

    @property
    def done(self) -> bool:
        """Every suspect is cleared (or gone): no one request explains the failures."""
        return not self.probe

    def admits(self, rid: int) -> bool:
        """Whether a waiting request may be admitted now."""
        return rid in self.probe or rid in self.cleared

    def confirmed(self, step_rids) -> bool:
        """A step that gives a verdict failed: True when the same requests' step failed
        before (the verdict stands), else False (they run the same way again)."""
        step = frozenset(step_rids)
        if self.unconfirmed == step:
            return True
        self.unconfirmed = step
        return False

    def failed(self, step_rids) -> int | None:
        """A step with these requests failed. -> the culprit when it failed holding that
        one request alone, the second time; else None: the suspects narrow to the
        probe's requests in the step (cleared ones ran beside them) and the next probe
        is half of them, or, when one is left, it alone (so two requests failing only
        together name no one); the search is `done` when the step held no probe
        request."""
        self.failures += 1
        step = set(step_rids)
        hit = [r for r in self.suspects if r in self.probe and r in step]
        if not hit:  # it failed without any probe request: not one request's doing
            self.probe = set()
            return None
        if len(hit) == 1 and step == {hit[0]}:
            return hit[0] if self.confirmed(step) else None
        self.suspects = hit
        if len(hit) == 1:  # try it alone: hold the cleared ones back for a step
            self.cleared, self.probe = set(), {hit[0]}
        else:
            self._next_probe()
        return None

    def drew(self, rids) -> None:
        """After a step that ran: these requests drew a token. A probe request that drew
        has passed where it failed (its KV recomputed, one more token), so it is cleared;
        once the whole probe is, the next half of the suspects is tried."""
        passed = self.probe & set(rids)
        self.cleared |= passed
        self.probe -= passed
        if not self.probe:
            self._next_probe()

    def forget(self, rid: int) -> None:
        """A request left (finished, aborted, failed alone): no longer a suspect."""
        if rid in self.suspects:
            self.suspects.remove(rid)
        self.cleared.discard(rid)
        if rid in self.probe:
            self.probe.discard(rid)
            if not self.probe:
                self._next_probe()

    def alibi(self, culprit: int, others) -> bool:
        """Hold `culprit` and admit only `others` (the engine's: its own one-token
        request): once they run a step it may be named. False when there are none."""
        self.accused = culprit
        self.cleared = set()
        self.suspects = sorted(set(others) - {culprit})
        self.probe = set(self.suspects)
        return bool(self.probe)
