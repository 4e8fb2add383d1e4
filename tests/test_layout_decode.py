"""Layouts arrive from other processes: malformed or hostile ones are refused with LayoutError.

A fuzz test of the decoder: random bytes, and valid layouts with one field broken at random,
must either decode to a layout that passes the same checks or raise LayoutError, never another
exception.
"""

from __future__ import annotations

import copy

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightbus.layouts.describe import build_layouts
from weightbus.layouts.families import model_spec
from weightbus.spec import Layout, LayoutError

pytestmark = pytest.mark.faults


def _layout() -> Layout:
    return build_layouts(model_spec("tiny-llama"), "vllm:tp=2", "reader")[1]


def test_round_trip_is_exact():
    layout = _layout()
    back = Layout.from_msgpack(layout.to_msgpack())
    assert back.digest == layout.digest
    assert Layout.from_json(layout.to_json()).digest == layout.digest


@pytest.mark.parametrize(
    "break_it, says",
    [
        (lambda d: d.update(format="other/1"), "not a weightbus layout"),
        (lambda d: d.update(n=-1), "piece count"),
        (lambda d: d.update(ndim=99), "ndim=99"),
        (lambda d: d["pieces"].update(tensor=d["pieces"]["tensor"][:-4]), "column tensor"),
        (lambda d: d["tensors"].append(d["tensors"][0]), "names a tensor twice"),
        (lambda d: d["locals"][0].__setitem__(2, "float77"), "malformed layout"),
        (lambda d: d["tensors"][0].__setitem__(1, [-4, 2]), "malformed layout"),
        (lambda d: d["participant"].update(role="boss"), "malformed layout"),
        (lambda d: d["pieces"].pop("stop"), "exactly the columns"),
        (lambda d: d.update(participant=None), "malformed layout from '\\?'"),
    ],
)
def test_broken_fields_are_named(break_it, says):
    d = _layout().to_dict(binary=True)
    break_it(d)
    with pytest.raises(LayoutError, match=says):
        Layout.from_msgpack(msgpack.packb(d, use_bin_type=True))


def test_piece_outside_its_tensor_is_refused_naming_it():
    d = _layout().to_dict()
    ndim = d["ndim"]
    d["pieces"]["stop"][ndim - 1] += 10_000  # the first piece's last dim runs off its tensor
    with pytest.raises(LayoutError, match="piece 0 .* outside the tensors' shapes"):
        Layout.from_dict(d)
    d = _layout().to_dict()
    d["pieces"]["key"][0] = len(d["locals"])  # a local tensor that does not exist
    with pytest.raises(LayoutError, match="local tensor index"):
        Layout.from_dict(d)


@settings(
    max_examples=1000, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(st.binary(max_size=512))
def test_random_bytes_never_escape_as_other_errors(data):
    with pytest.raises(LayoutError):
        Layout.from_msgpack(data)


_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.binary(max_size=64),
    st.lists(st.integers(min_value=-5, max_value=10**6), max_size=6),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=3),
)


def _paths(d, prefix=()):
    """Every (container, key) in a nested dict/list, to replace one value."""
    items = d.items() if isinstance(d, dict) else enumerate(d)
    for k, v in items:
        yield (d, k, prefix + (k,))
        if isinstance(v, (dict, list)) and len(prefix) < 4:
            yield from _paths(v, prefix + (k,))


BASE = _layout().to_dict(binary=True)
PATHS = [p for _, _, p in _paths(BASE)]


@settings(
    max_examples=1500, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(st.sampled_from(PATHS), _VALUES)
def test_one_broken_value_decodes_or_raises_layout_error(path, value):
    d = copy.deepcopy(BASE)
    target = d
    for k in path[:-1]:
        target = target[k]
    target[path[-1]] = value
    try:
        data = msgpack.packb(d, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        return  # msgpack itself cannot carry this value: nothing to receive
    try:
        layout = Layout.from_msgpack(data)
    except LayoutError:
        return
    # accepted: then it is self-consistent, and re-encodes to what was decoded
    p = layout.pieces
    assert len(p.tensor) == len(p.key) == p.start.shape[0]
    assert np.all(p.stop >= p.start)
    assert Layout.from_msgpack(layout.to_msgpack()).digest == layout.digest
