"""Control messages come from other processes: each sync message is checked against its schema
before use, and anything malformed raises ProtocolError naming who posted what.

A fuzz test runs the decoder and the checks on random bytes: only ProtocolError may come out.
"""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_control import _job, _run
from weightbus.control.store import ACK, BEGIN, COMMIT, HOLDS, _decode, check_message
from weightbus.errors import ProtocolError

pytestmark = [pytest.mark.faults, pytest.mark.timeout(60)]


def test_messages_of_the_protocol_pass():
    assert check_message({"version": 3}, BEGIN, "writer 'w'", "begin/0") == {"version": 3}
    check_message({"version": 3, "ok": True, "bytes": 10}, ACK, "reader 'r'", "ack/0")
    check_message({"holds": None, "checksum": False}, HOLDS, "reader 'r'", "holds/0")
    check_message({"holds": 7, "checksum": True}, HOLDS, "reader 'r'", "holds/0")
    check_message({"version": 0}, COMMIT, "writer 'w'", "commit/0")


@pytest.mark.parametrize(
    "value, schema, says",
    [
        ({"version": "3"}, BEGIN, "version='3': the protocol wants int"),
        ({"version": True}, BEGIN, "version=True: the protocol wants int"),
        ({"version": 2**64}, BEGIN, "the protocol wants int"),
        ({"version": 3, "extra": 1}, BEGIN, r"fields \['extra', 'version'\]"),
        ({}, BEGIN, r"fields \[\], the protocol has \['version'\]"),
        ([3], BEGIN, "as list, not a message"),
        ({"version": 3, "ok": 1, "bytes": 10}, ACK, "ok=1: the protocol wants bool"),
        ({"holds": "x", "checksum": False}, HOLDS, "int or NoneType"),
    ],
)
def test_malformed_messages_are_refused_naming_who_and_what(value, schema, says):
    with pytest.raises(ProtocolError, match=says) as e:
        check_message(value, schema, "reader 'infer-1'", "ack/4")
    assert "reader 'infer-1'" in str(e.value) and "'ack/4'" in str(e.value)


@settings(
    max_examples=1000, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(st.binary(max_size=64), st.sampled_from([BEGIN, ACK, COMMIT, HOLDS]))
def test_decoder_on_random_bytes_raises_only_protocol_errors(data, schema):
    try:
        value = _decode(b"m" + data)
    except ProtocolError:
        return
    try:
        check_message(value, schema, "writer 'w'", "begin/0")
    except ProtocolError:
        pass


_ANY = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=5)
    | st.binary(max_size=5),
    lambda kids: (
        st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids, max_size=3)
    ),
    max_leaves=8,
)


@settings(
    max_examples=1000, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(_ANY, st.sampled_from([BEGIN, ACK, COMMIT, HOLDS]))
def test_any_decoded_value_is_accepted_only_when_it_fits(value, schema):
    try:
        data = b"m" + msgpack.packb(value, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        return
    try:
        got = check_message(_decode(data), schema, "writer 'w'", "begin/0")
    except ProtocolError:
        return
    assert set(got) == set(schema)


def test_a_malformed_message_in_a_gather_names_its_sender():
    planes = _job(1, 1)

    def body(c):
        if c.participant.role == "writer":
            c.post("begin/0", {"version": "seven"})
            c.gather("done", role="reader")
            return None
        try:
            return c.gather("begin/0", role="writer", schema=BEGIN)
        finally:
            c.post("done", {})

    out = _run(planes, body)
    err = out["reader-0"]
    assert isinstance(err, ProtocolError), out
    assert "writer 'writer-0'" in str(err) and "'begin/0'" in str(err) and "seven" in str(err)
