"""The step control channel (lamina.dataplane.control): plans and results round-trip exactly as the
typed dataclasses, a step's error comes back by name and the loop keeps serving, and
malformed messages are rejected by name before anything executes."""
import socket
import threading

import pytest
import torch

from lamina.dataplane.control import (
    ERROR,
    PLAN,
    RESULT,
    ControlClient,
    StepError,
    decode,
    encode,
    serve_control,
)
from lamina.dataplane.transport import FrameError, SocketChannel
from lamina.dataplane.transport import encode as encode_frame
from lamina.engine.messages import SeqWork, StepPlan, StepResult
from lamina.sampling.params import SamplingParams


def _plan(step=3):
    sp = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, seed=11, n=2,
                        stop=("\n\n",), include_stop_str_in_output=True,
                        stop_token_ids=(2,), logprobs=2, logit_bias=((7, -1.5),))
    return StepPlan(step, (
        SeqWork(4, (10, 11, 12), 0, (5, 6, 7), params=sp, seeds=(11, 12),
                allowed=b"\x05\x00\xff\x80"),  # structured output's bitmask
        SeqWork(9, (13,), 2, (1, 0, 8), sample=False, worker=1,
                segments=((1, 0), (0, 2)), history=(1, 2, 13), prompt_len=2)),
        micro_batches=2)


def _result(step=3):
    return StepResult(step, (4,), ((21, 22),),
                      {"dense_s": 0.01, "threads": 2, "micro_batches": 1},
                      (((-0.25, (21, 5), (-0.25, -2.0)), (-1.0, (22, 5), (-1.0, -1.5))),),
                      (((-3.0, -0.5), ((1,), (2,)), ((-3.0,), (-0.5,))),))


def test_messages_round_trip_as_typed_dataclasses():
    p, r = _plan(), _result()
    q = decode(PLAN, encode(p))
    assert q == p and isinstance(q.seqs[0].params, SamplingParams)
    assert isinstance(q.seqs[1].segments[1], tuple)
    back = decode(RESULT, encode(r))
    assert back == r  # tuples all the way down, ints stay ints
    assert isinstance(back.timings["threads"], int)
    assert decode(ERROR, encode("ValueError: bad")) == "ValueError: bad"


@pytest.mark.parametrize("mutate, msg", [
    (lambda d: d.update(step="x"), "Expected `int`, got `str`"),
    (lambda d: d["seqs"][0].update(slots=[1]), "seq 4: 1 slots from position 0 for positions 0..2"),
    (lambda d: d["seqs"][0]["params"].update(top_p=0.0), "top_p"),
    (lambda d: d.update(micro_batches=0), "micro_batches must be an int >= 1"),
])
def test_bad_plans_rejected_by_name(mutate, msg):
    import msgspec
    d = msgspec.to_builtins(_plan(), builtin_types=(bytes,))  # the bitmask stays bytes
    mutate(d)
    raw = torch.frombuffer(bytearray(msgspec.msgpack.encode(d)), dtype=torch.uint8)
    with pytest.raises(FrameError, match="bad step plan message") as e:
        decode(PLAN, raw)
    assert msg in str(e.value)
    with pytest.raises(FrameError, match="bad step result message"):
        decode(RESULT, torch.tensor([0xc1], dtype=torch.uint8))  # msgpack's unused byte


@pytest.fixture
def served():
    """A client wired to `serve_control` on a thread; the executed plans are recorded."""
    a, b = socket.socketpair()
    seen = []

    def execute(plan):
        seen.append(plan)
        if plan.step == 13:
            raise ValueError("unlucky step")
        return _result(plan.step)

    t = threading.Thread(target=serve_control, args=(SocketChannel(b), execute), daemon=True)
    t.start()
    yield ControlClient(SocketChannel(a)), a, seen, t
    a.close()
    t.join(5)


def test_steps_served_in_order_and_errors_come_back_by_name(served):
    client, _, seen, t = served
    assert client.call(_plan(1)) == _result(1)
    with pytest.raises(StepError, match="ValueError: unlucky step"):
        client.call(_plan(13))
    assert client.call(_plan(14)) == _result(14)  # and it keeps serving
    assert [p.step for p in seen] == [1, 13, 14] and seen[0] == _plan(1)
    client.close()
    t.join(5)
    assert not t.is_alive()  # the client hung up: the loop ends


def test_malformed_plan_frames_never_execute(served):
    client, sock, seen, t = served
    ch = client.channel
    ch.send(torch.frombuffer(bytearray(b"\x93\x01"), dtype=torch.uint8), PLAN, 5)
    _, _, _ = ch.recv(expect_step=5)  # an ERROR frame naming the bad plan
    ch.send(torch.zeros(3, dtype=torch.uint8), RESULT, 6)  # the wrong kind
    err, kind, _ = ch.recv()
    assert kind == ERROR and b"expected plan" in err.numpy().tobytes()
    assert client.call(_plan(7)) == _result(7)  # a bad message costs nothing else
    head, _ = encode_frame(torch.zeros(2, dtype=torch.uint8), PLAN, 8)
    sock.sendall(b"XXXX" + bytes(head)[4:] + b"\0\0")  # bad magic: the stream is lost
    err, kind, _ = ch.recv()
    assert kind == ERROR and b"bad magic" in err.numpy().tobytes()
    t.join(5)
    assert not t.is_alive() and [p.step for p in seen] == [7]


def test_client_rejects_a_result_for_another_step():
    a, b = socket.socketpair()
    client, peer = ControlClient(SocketChannel(a)), SocketChannel(b)
    peer.send(encode(_result(2)), RESULT, 2)
    with pytest.raises(FrameError, match="step 2, expected 3"):
        client.call(_plan(3))
    peer.close()
    a, b = socket.socketpair()
    client = ControlClient(SocketChannel(a))
    b.shutdown(socket.SHUT_WR)  # the worker's end goes away before answering
    with pytest.raises(ConnectionError, match="compute worker hung up during step 4 .*"
                       "truncated: peer closed after 0 of"):
        client.call(_plan(4))
    client.close()
    b.close()
    a, b = socket.socketpair()
    b.close()  # gone before the plan is sent: the send itself fails
    with pytest.raises(ConnectionError, match="hung up during step 5 .BrokenPipeError"):
        ControlClient(SocketChannel(a)).call(_plan(5))
    a.close()
