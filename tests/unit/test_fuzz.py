"""Fuzzing (hypothesis, a fixed budget per target in CI): the tensor codec and the decoding and
checking of every RPC's request. Whatever the bytes, a decoder either gives a value or raises its
documented error (DecodeError for bytes, TensorError / MeshError for a message); nothing else
escapes, and what it accepts is within the caps. Each target's count of inputs tried is printed
(`pytest -s`)."""
from __future__ import annotations

import math

import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from logicpipe import tensor_codec
from logicpipe.errors import InvalidArgument, MeshError
from logicpipe.limits import MAX_ADDRESS_CHARS, MAX_ID_CHARS, check_address
from logicpipe.stage_node.net import wire
from logicpipe.v1 import controller_pb2, stage_pb2, tensor_pb2

BUDGET = 400  # inputs per target
FUZZ = settings(max_examples=BUDGET, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TRIED: dict[str, int] = {}


def tried(target: str) -> None:
    TRIED[target] = TRIED.get(target, 0) + 1


DTYPES = st.sampled_from([*tensor_codec.DTYPES, "", "float64", "object", "int8\x00", "x" * 300])
SHAPES = st.lists(st.integers(min_value=-3, max_value=2**40), max_size=10)


@FUZZ
@given(dtype=DTYPES, shape=SHAPES, data=st.binary(max_size=512), rank=st.sampled_from([None, 1, 2]))
def test_tensor_codec(dtype, shape, data, rank):
    tried("tensor codec")
    msg = tensor_pb2.Tensor(dtype=dtype, shape=shape, data=data)
    try:
        raw = tensor_codec.check(msg, rank=rank, max_bytes=4096)
    except tensor_codec.TensorError:
        return
    assert len(raw.data) == math.prod(raw.shape) * tensor_codec.ITEMSIZE[raw.dtype] <= 4096
    t = tensor_codec.to_tensor(raw)
    assert tuple(t.shape) == raw.shape and tensor_codec.from_tensor(t).data == raw.data


REQUESTS = [stage_pb2.AssignRequest, stage_pb2.OpenSessionRequest, stage_pb2.CloseSessionRequest,
            stage_pb2.StepBatch, stage_pb2.EventsRequest, stage_pb2.StatusRequest, stage_pb2.EchoRequest,
            stage_pb2.MeasureLinkRequest, controller_pb2.SubmitRequest, controller_pb2.ControllerStatusRequest,
            controller_pb2.PlanRequest, controller_pb2.RegisterRequest, controller_pb2.LeaveRequest,
            controller_pb2.DrainRequest, controller_pb2.PullWeightsRequest]


@pytest.mark.parametrize("cls", REQUESTS, ids=lambda c: c.__name__)
def test_request_bytes(cls):
    """Random bytes as each RPC's request: parsed or DecodeError (what the server's interceptor turns
    into INVALID_ARGUMENT), and a parsed one re-serializes."""
    @FUZZ
    @given(data=st.binary(max_size=256))
    def one(data):
        tried(f"{cls.__name__} bytes")
        try:
            msg = cls.FromString(data)
        except (DecodeError, ValueError, TypeError):
            return
        cls.FromString(msg.SerializeToString())
    one()


SESSION = st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x2FF), max_size=80)
IDS = st.lists(st.integers(min_value=-2**31, max_value=2**31), max_size=40)


@FUZZ
@given(sid=SESSION, owner=SESSION, capacity=st.integers(0, 2**32 - 1), prompt=IDS, stop=IDS,
       parent=SESSION, parent_length=st.integers(0, 2**32 - 1), speculate=st.integers(0, 2**32 - 1))
def test_open_session_checks(sid, owner, capacity, prompt, stop, parent, parent_length, speculate):
    tried("OpenSession checks")
    prompt = [p % 2**31 for p in prompt]
    req = stage_pb2.OpenSessionRequest(session_id=sid, owner=owner, capacity=capacity, prompt_token_ids=prompt,
                                       stop_token_ids=[s % 2**31 for s in stop], parent_session_id=parent,
                                       parent_length=parent_length, speculate=speculate)
    try:
        spec = wire.spec_from_proto(req, context=2048, vocab_size=1000)
    except MeshError:
        return
    assert 1 <= spec.capacity <= 2048 and all(0 <= t < 1000 for t in spec.prompt) and len(spec.prompt) <= spec.capacity
    assert spec.speculate <= wire.MAX_CANDIDATES and spec.generated <= max(len(spec.prompt), spec.capacity)
    assert not any(c < " " for c in spec.session_id + spec.owner + spec.parent)


# host:port-ish text: the pieces an address is made of, and anything else
ADDRESS = st.one_of(
    st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x7F), max_size=40),
    st.builds(lambda host, port: f"{host}:{port}",
              st.one_of(st.ip_addresses(v=4).map(str), st.ip_addresses(v=6).map(lambda a: f"[{a}]"),
                        st.from_regex(r"[a-z0-9_.-]{0,70}", fullmatch=True),
                        st.text(alphabet="[]:.%ab0-", max_size=20)),
              st.one_of(st.integers(-2, 70000).map(str), st.text(alphabet="0123456789x ", max_size=6))),
)


@FUZZ
@given(address=ADDRESS)
def test_address_checks(address):
    tried("address checks")
    try:
        got = check_address("address", address)
    except InvalidArgument as exc:
        assert "\n" not in str(exc)
        return
    host, _, port = got.rpartition(":")
    assert host and 1 <= int(port) <= 65535 and len(got) <= MAX_ADDRESS_CHARS
    assert host.startswith("[") == host.endswith("]") and (":" not in host or host.startswith("["))


@FUZZ
@given(model_dir=SESSION, addresses=st.lists(ADDRESS, min_size=3, max_size=3),
       ids=st.lists(SESSION, min_size=4, max_size=4),
       numbers=st.lists(st.one_of(st.integers(0, 6), st.integers(0, 2**32 - 1)), min_size=6, max_size=6))
def test_assign_checks(model_dir, addresses, ids, numbers):
    tried("Assign checks")
    start, end, layers, index, stages, micro = numbers
    req = stage_pb2.AssignRequest(model_dir=model_dir, start_layer=start, end_layer=end, num_layers=layers,
                                  stage_index=index, num_stages=stages, micro_batches=micro,
                                  next_address=addresses[0], first_address=addresses[1], plan_id=ids[0],
                                  prev_node_id=ids[1], last_node_id=ids[2], controller_id=ids[3])
    try:
        a = wire.assignment_from_proto(req, addresses[2])
        a.check()
    except MeshError:
        return
    assert 0 <= a.start < a.end <= a.num_layers and a.num_stages <= a.num_layers and a.micro_batches <= 64
    assert "\x00" not in a.model_dir and all(len(x) <= MAX_ID_CHARS for x in (a.plan_id, a.prev_node_id))


SEQ = st.builds(lambda sid, start, ids, n, cand: stage_pb2.SeqStep(session_id=sid, start_pos=start % 2**31,
                                                                   token_ids=[i % 2**31 for i in ids],
                                                                   num_tokens=n, num_candidates=cand),
                SESSION, st.integers(0, 2**40), IDS, st.integers(0, 50), st.integers(0, 40))


@FUZZ
@given(seqs=st.lists(SEQ, max_size=6), dtype=DTYPES, shape=SHAPES, data=st.binary(max_size=256),
       with_hidden=st.booleans())
def test_step_batch_checks(seqs, dtype, shape, data, with_hidden):
    tried("StepBatch checks")
    batch = stage_pb2.StepBatch(seqs=seqs)
    if with_hidden:
        batch.hidden.CopyFrom(tensor_pb2.Tensor(dtype=dtype, shape=shape, data=data))
    try:
        msg = wire.step_from_proto(batch, vocab_size=1000, hidden_size=4, stage_index=1)
    except MeshError:
        return
    rows = sum(w.num_tokens for w in msg.works)
    assert msg.hidden.shape == (rows, 4) and all(0 <= t < 1000 for w in msg.works for t in w.token_ids)


def test_zz_report_budget():
    """Runs last in this module: every target tried its budget (the count is the CI figure)."""
    for target, n in sorted(TRIED.items()):
        print(f"fuzz: {target}: {n} inputs")
    assert TRIED and all(n >= BUDGET // 2 for n in TRIED.values()), TRIED
