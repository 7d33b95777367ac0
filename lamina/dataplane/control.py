"""Step control channel: the engine's `StepPlan` to the compute worker and its
`StepResult` back over a socket, not a Ray call (a Ray actor call cost ~3 ms a step
here; this round trip ~0.5 ms, most of it validating the plan).

Data in: a `StepPlan` from the engine's executor (`ControlClient.call`). Data out, on
the compute worker (`serve_control`): the plan for its `execute`, then the
`StepResult` (or the error the step raised, by name) back to the client.

Each message is one `lamina.dataplane.transport` frame (magic, version, checked header):
dtype uint8,
"layer" the message kind (`PLAN`, `RESULT`, `ERROR`), step the plan's step, payload the
message as msgpack through msgspec with the message's type, so decoding builds the
frozen dataclasses and runs their `__post_init__` checks (a malformed plan is rejected
by name before anything runs). No pickle. An ERROR payload is the exception's text; a
`SequenceFault` (a step failed by particular sequences) is sent as
"SequenceFault(seqs=[3, 5], clean=True): why", so the client raises it again.
"""
from __future__ import annotations

import logging
import re
from collections.abc import Callable

import msgspec
import torch

from lamina.dataplane.transport import FrameError, PeerTimeout, SocketChannel
from lamina.engine.messages import StepPlan, StepResult
from lamina.errors import SequenceFault

log = logging.getLogger(__name__)

PLAN, RESULT, ERROR = -1, -2, -3  # the frame's "layer" field: what the payload is
KINDS = {PLAN: "plan", RESULT: "result", ERROR: "error"}

_ENC = msgspec.msgpack.Encoder()
_DEC = {PLAN: msgspec.msgpack.Decoder(StepPlan), RESULT: msgspec.msgpack.Decoder(StepResult)}


_FAULT = re.compile(r"SequenceFault\(seqs=\[([0-9, ]*)\], clean=(True|False)\): (.*)", re.S)


class StepError(RuntimeError):
    """The compute worker's step raised; the message names its exception."""


def error_text(e: BaseException) -> str:
    """The ERROR payload for a step's exception (a SequenceFault keeps its fields)."""
    if isinstance(e, SequenceFault):
        return f"SequenceFault(seqs={list(e.seq_ids)}, clean={e.clean}): {e}"
    return f"{type(e).__name__}: {e}"


def step_error(text: str) -> Exception:
    """An ERROR payload -> the exception the client raises."""
    m = _FAULT.fullmatch(text)
    if m is None:
        return StepError(text)
    ids = [int(x) for x in m.group(1).split(",") if x.strip()]
    return SequenceFault(ids, m.group(3), clean=m.group(2) == "True")


def encode(msg) -> torch.Tensor:
    """A StepPlan / StepResult / error text -> its payload as a uint8 tensor."""
    raw = msg.encode() if isinstance(msg, str) else _ENC.encode(msg)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else \
        torch.empty(0, dtype=torch.uint8)


def decode(kind: int, payload: torch.Tensor):
    """-> the StepPlan / StepResult, or the error text; FrameError naming what is bad."""
    raw = payload.numpy().tobytes()
    if kind == ERROR:
        return raw.decode("utf-8", "replace")
    try:
        return _DEC[kind].decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as e:
        raise FrameError(f"bad step {KINDS[kind]} message: {type(e).__name__}: {e}") from None


def _recv(ch: SocketChannel, step: int | None = None):
    """One whole frame (FrameError here leaves the stream unusable) -> (kind, step,
    payload)."""
    t, kind, got = ch.recv(expect_step=step, expect_dtype=torch.uint8)
    if t.dim() != 1:
        raise FrameError(f"control frame payload of shape {tuple(t.shape)}, expected 1-D")
    return kind, got, t


def _expect(kind: int, kinds: tuple[int, ...]) -> None:
    if kind not in kinds:
        raise FrameError(f"control frame of kind {KINDS.get(kind, kind)!r}, expected "
                         f"{' or '.join(KINDS[k] for k in kinds)}")


class ControlClient:
    """The engine's end: one step at a time, in order."""

    def __init__(self, channel: SocketChannel):
        self.channel = channel

    def call(self, plan: StepPlan) -> StepResult:
        try:
            self.channel.send(encode(plan), PLAN, plan.step)
            kind, _, t = _recv(self.channel, plan.step)
        except PeerTimeout:
            raise  # alive but silent
        except (OSError, FrameError) as e:  # closed or reset: the worker is gone
            if isinstance(e, FrameError) and "peer closed" not in str(e):
                raise
            raise ConnectionError(f"the compute worker hung up during step {plan.step} "
                                  f"({type(e).__name__}: {e})") from None
        _expect(kind, (RESULT, ERROR))
        msg = decode(kind, t)
        if kind == ERROR:
            raise step_error(msg)
        return msg

    def close(self) -> None:
        self.channel.close()


def serve_control(channel: SocketChannel, execute: Callable[[StepPlan], StepResult],
                  name: str = "compute worker") -> None:
    """The compute worker's end: plans in, results (or errors) out, until the client
    closes. A step that raises answers ERROR and the loop goes on; a frame that cannot
    be read (bad header, truncated) answers ERROR and ends it (the stream is lost)."""
    try:
        while True:
            try:
                kind, step, t = _recv(channel)
            except FrameError as e:
                if "peer closed after 0 of" in str(e):
                    return  # the client hung up between steps
                channel.send(encode(f"FrameError: {e}"), ERROR, 0)
                log.error("%s: control stream lost: %s", name, e)
                return
            try:
                _expect(kind, (PLAN,))  # the frame was whole: the stream goes on
                result = execute(decode(kind, t))
            except Exception as e:  # noqa: BLE001 - the client gets it by name
                channel.send(encode(error_text(e)), ERROR, step)
                continue
            channel.send(encode(result), RESULT, step)
    except OSError as e:  # the client went away mid-answer
        log.warning("%s: control channel closed: %s", name, e)
    finally:
        channel.close()
