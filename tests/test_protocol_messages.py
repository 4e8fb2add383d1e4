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
    begin = {"version": 3, "pieces": False}
    assert check_message(begin, BEGIN, "writer 'w'", "begin/0") == begin
    check_message({"version": 3, "ok": True, "bytes": 10}, ACK, "reader 'r'", "ack/0")
    check_message({"holds": None, "checksum": False}, HOLDS, "reader 'r'", "holds/0")
    check_message({"holds": 7, "checksum": True}, HOLDS, "reader 'r'", "holds/0")
    check_message({"version": 0}, COMMIT, "writer 'w'", "commit/0")


@pytest.mark.parametrize(
    "value, schema, says",
    [
        ({"version": "3", "pieces": False}, BEGIN, "version='3': the protocol wants int"),
        ({"version": True, "pieces": False}, BEGIN, "version=True: the protocol wants int"),
        ({"version": 2**64, "pieces": False}, BEGIN, "the protocol wants int"),
        ({"version": 3, "pieces": 1}, BEGIN, "pieces=1: the protocol wants bool"),
        ({"version": 3}, BEGIN, r"fields \['version'\], the protocol has \['pieces', 'version'\]"),
        ({}, BEGIN, r"fields \[\], the protocol has \['pieces', 'version'\]"),
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
            c.post("begin/0", {"version": "seven", "pieces": False})
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


# ---------------------------------------------------------------------------------------------
# the membership records, the status records and the transports' connect-time tables
# ---------------------------------------------------------------------------------------------


def _more_schemas() -> list:
    from weightbus.control.status import STATUS
    from weightbus.control.store import FAILURE, MEMBER, MEMBERS, ROSTER
    from weightbus.transports.cuda_ipc import RELAY_TABLE, TABLE

    return [MEMBERS, ROSTER, MEMBER, FAILURE, STATUS, TABLE, RELAY_TABLE]


@settings(
    max_examples=1000, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(st.binary(max_size=64), st.integers(0, 6))
def test_decoder_on_random_bytes_raises_only_protocol_errors_for_every_record(data, which):
    try:
        value = _decode(b"m" + data, limit=1 << 16)
    except ProtocolError:
        return
    try:
        check_message(value, _more_schemas()[which], "writer 'w'", "roster/1")
    except ProtocolError:
        pass


@settings(
    max_examples=1000, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(_ANY, st.integers(0, 6))
def test_any_value_passes_a_record_schema_only_when_it_fits(value, which):
    schema = _more_schemas()[which]
    try:
        got = check_message(value, schema, "writer 'w'", "roster/1")
    except ProtocolError:
        return
    assert set(got) == set(schema)


def _table() -> dict:
    return {
        "device": 0,
        "event": b"e" * 64,
        "order": 0,
        "events": [b"v" * 64],
        "storages": [[0, b"h" * 64, 4096, 0, b"", 0, b"", True]],
        "tensors": [[0, 0, [16, 8], [8, 1], "bfloat16"], [0, 128, [8], [1], "float32"]],
        "buckets": [
            [1, 0, 256, [[0, [[0, 16], [0, 8]], 0, 256]]],
            [2, 1, 32, [[1, [[0, 8]], 0, 32]]],
        ],
        "covers": [0, 0],
    }


def _paths(value, prefix=()):
    """Every place inside a nested message, as a path of keys and indices."""
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*prefix, i))


@settings(
    max_examples=1000, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(st.data())
def test_a_transport_table_changed_anywhere_raises_only_protocol_errors(data):
    """One value anywhere in a CUDA IPC table replaced by anything: the schema and the
    cross-reference checks either pass it (then everything it points at exists) or raise
    ProtocolError; nothing else comes out."""
    from weightbus.transports.cuda_ipc import RELAY_TABLE, _check_table

    table = _table()
    paths = [p for p in _paths(table) if p]
    path = data.draw(st.sampled_from(paths))
    new = data.draw(_ANY | st.integers(-3, 40))
    parent = table
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = new
    try:
        check_message(table, RELAY_TABLE, "reader 'r'", "cuda_ipc/0/relay")
        _check_table(table, "reader 'r'", "cuda_ipc/0/relay", 3)
    except ProtocolError:
        return
    for storage, *_ in table["tensors"]:
        assert 0 <= storage < len(table["storages"])
    for _peer, _tag, _n, copies in table["buckets"]:
        for tid, box, _o, _b in copies:
            shape = table["tensors"][tid][2]
            assert all(0 <= lo <= hi <= n for (lo, hi), n in zip(box, shape, strict=True))
    assert all(0 <= e < len(table["events"]) for e in table["covers"])
