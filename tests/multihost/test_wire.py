"""The typed wire (``kvjax.multihost.wire``): every message that crosses a process boundary
round-trips exactly, and decoding refuses a pickle, an unknown or missing field, a wrong type,
another message type and another version, naming the field; encoding refuses what could not
decode equal elsewhere."""

from __future__ import annotations

import json
import pickle
from dataclasses import dataclass

import pytest

from kvjax.multihost import wire
from kvjax.multihost.agreement import AgreedValues
from kvjax.multihost.channel import LoopbackChannel, all_gather_message
from kvjax.multihost.digest import StateDigest
from kvjax.serve.multihost.request_broadcast import RequestSpec, StepMessage
from kvjax.serve.serving_req import ServingReq


def spec(**overrides: object) -> RequestSpec:
    fields: dict = dict(rid="a", prompt=(1, 2, 3), max_new_tokens=4, stop_token_ids=(2,), extra_key="tenant-1")
    return RequestSpec(**{**fields, **overrides})


def step_with_request() -> dict:
    """A step message's JSON (one request, a digest), to alter."""
    return json.loads(StepMessage(5, (spec(),), {"tree": "ab"}).encode())


def decode_step(obj: dict) -> StepMessage:
    return StepMessage.decode(json.dumps(obj).encode())


@pytest.mark.parametrize(
    "message",
    [
        StepMessage(7),
        StepMessage(3, (spec(), spec(rid=12, extra_key=None, priority=-2), spec(extra_key=99, stop_token_ids=()))),
        StepMessage(0, (), {"tree": "0f", "allocator": "aa"}),
        StepMessage(2**40, (spec(prompt=tuple(range(1000))),), {}),
        StepMessage(1, (spec(rid="r\u00e9\ud800", extra_key="t\u00e9nant"),)),  # any str, lone surrogates too
    ],
)
def test_step_messages_round_trip(message):
    raw = message.encode()
    assert StepMessage.decode(raw) == message
    assert b"pickle" not in raw and not raw.startswith(b"\x80")


def test_the_steady_step_is_eight_bytes_and_requests_are_json():
    assert len(StepMessage(9).encode()) == 8
    obj = step_with_request()
    assert obj["type"] == "step" and obj["version"] == 1
    assert obj["fields"]["requests"][0]["fields"] == {
        "rid": "a",
        "prompt": [1, 2, 3],
        "max_new_tokens": 4,
        "stop_token_ids": [2],
        "extra_key": "tenant-1",
        "priority": 0,
        "retention_seconds": None,
        "images": [],
    }


def test_agreement_and_digest_messages_round_trip():
    for message in (AgreedValues((3, -1, 0)), AgreedValues(()), StateDigest({"tree": "x", "requests": "y"})):
        assert wire.decode(wire.encode(message), type(message)) == message


def test_a_request_spec_carries_the_request_and_builds_an_equal_one():
    req = ServingReq(17, [5, 6], max_new_tokens=3, extra_key="salt", stop_token_ids=[9, 4], retention_seconds=30)
    req.priority = 2
    sent = RequestSpec.of(req)
    assert sent == RequestSpec(17, (5, 6), 3, (4, 9), "salt", 2, 30.0, ())
    got = StepMessage.decode(StepMessage(0, (sent,)).encode()).requests[0].build()
    assert (got.rid, list(got.origin_input_ids), got.max_new_tokens) == (17, [5, 6], 3)
    assert (got.extra_key, got.stop_token_ids, got.priority) == ("salt", frozenset({4, 9}), 2)
    assert got.retention_seconds == 30.0


def test_a_pickle_is_refused_and_never_unpickled():
    ran = []

    class Evil:
        def __reduce__(self):
            return (ran.append, ("unpickled",))

    payload = pickle.dumps(StepMessage(1, (spec(),)))
    with pytest.raises(wire.WireError, match=r"StepMessage: not UTF-8 JSON .*not a kvjax message"):
        StepMessage.decode(payload)
    with pytest.raises(wire.WireError, match="not a kvjax message"):
        wire.decode(pickle.dumps(Evil(), protocol=0), AgreedValues)  # protocol 0 is ASCII text
    assert not ran


@pytest.mark.parametrize(
    ("alter", "where", "says"),
    [
        (lambda o: o["fields"].update(session="s1"), "StepMessage.session", "unknown field of 'step' version 1"),
        (
            lambda o: o["fields"]["requests"][0]["fields"].update(evil=1),
            r"StepMessage.requests\[0\].evil",
            "unknown field of 'request'",
        ),
        (lambda o: o["fields"].pop("digest"), "StepMessage.digest", "missing field"),
        (
            lambda o: o["fields"]["requests"][0]["fields"].pop("priority"),
            r"StepMessage.requests\[0\].priority",
            "missing field",
        ),
        (lambda o: o["fields"].update(step="5"), "StepMessage.step", "expected int, got str '5'"),
        (lambda o: o["fields"].update(step=True), "StepMessage.step", "expected int, got bool True"),
        (lambda o: o["fields"].update(step=5.0), "StepMessage.step", "expected int, got float 5.0"),
        (
            lambda o: o["fields"]["requests"][0]["fields"].update(rid=[1]),
            r"StepMessage.requests\[0\].rid",
            r"expected str \| int, got list \[1\]",
        ),
        (
            lambda o: o["fields"]["requests"][0]["fields"].update(prompt=[1, "2"]),
            r"StepMessage.requests\[0\].prompt\[1\]",
            "expected int, got str",
        ),
        (lambda o: o["fields"].update(digest={"tree": 3}), r"StepMessage.digest\['tree'\]", "expected str"),
        (lambda o: o.update(version=2), "StepMessage", "'step' message of version 2, this process reads version 1"),
        (
            lambda o: o["fields"]["requests"][0].update(version=0),
            r"StepMessage.requests\[0\]",
            "'request' message of version 0",
        ),
        (lambda o: o.update(type="agree"), "StepMessage", "expected a 'step' message, got str 'agree'"),
        (lambda o: o.update(extra=1), "StepMessage", r"exactly the keys type, version, fields; \['extra'\] differ"),
        (lambda o: o.pop("version"), "StepMessage", r"\['version'\] differ"),
    ],
)
def test_decoding_refuses_naming_the_field(alter, where, says):
    obj = step_with_request()
    alter(obj)
    with pytest.raises(wire.WireError, match=says) as e:
        decode_step(obj)
    assert e.value.where == where.replace("\\", "")


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b'{"type":"agree","type":"agree","version":1,"fields":{"values":[]}}', "duplicate key 'type'"),
        (b'{"type":"agree","version":1,"fields":{"values":[NaN]}}', "NaN is not a JSON number"),
        (b"[1, 2]", r"expected a 'agree' message, got list"),
        (b'{"type":"agree"', "not valid JSON"),
    ],
)
def test_decoding_refuses_what_is_not_strict_json(raw, says):
    with pytest.raises(wire.WireError, match=says):
        wire.decode(raw, AgreedValues)


def test_encoding_refuses_what_would_not_decode_equal():
    with pytest.raises(wire.WireError, match=r"RequestSpec.rid: .*expected str \| int, got tuple \('a', 1\)"):
        RequestSpec.of(ServingReq(("a", 1), [1], max_new_tokens=1))
    with pytest.raises(wire.WireError, match=r"RequestSpec.extra_key: .*expected str \| int \| None, got bytes"):
        RequestSpec.of(ServingReq("a", [1], max_new_tokens=1, extra_key=b"salt"))
    with pytest.raises(wire.WireError, match=r"AgreedValues.values\[1\]: expected int, got bool True"):
        wire.encode(AgreedValues((1, True)))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dict is not a wire message"):
        wire.encode({"values": [1]})
    with pytest.raises(TypeError, match="int is not a wire message"):
        all_gather_message(LoopbackChannel(), "x", 3)


def test_typed_gather_on_one_process():
    assert all_gather_message(LoopbackChannel(), "x", AgreedValues((4,))) == [AgreedValues((4,))]


def test_a_message_type_declares_only_types_that_travel():
    @wire.wire_message("test-any", version=1)
    @dataclass(frozen=True)
    class Loose:
        value: object

    with pytest.raises(TypeError, match=r"Loose.value: .* cannot travel"):
        wire.encode(Loose(1))
    with pytest.raises(TypeError, match="taken by"):
        wire.wire_message("step", version=1)(Loose)
    with pytest.raises(ValueError, match="version 0 must be an integer from 1"):
        wire.wire_message("test-v0", version=0)
