"""Whole-tensor layouts of a plain module or state dict, and the plain-module engine adapter."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from weightbus.engines.module import bind
from weightbus.layouts.module import BoundModule, bind_module, is_output_head, tied_groups
from weightbus.spec import Layout, Participant

pytestmark = pytest.mark.timeout(60)

WRITER = Participant(role="writer", rank=0)


class TinyLM(nn.Module):
    """An embedding tied to an output head, registered head first, plus buffers of each kind."""

    def __init__(self) -> None:
        super().__init__()
        self.lm_head = nn.Linear(6, 10, bias=False)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(10, 6)
        self.model.norm = nn.LayerNorm(6)
        self.model.proj = nn.Linear(6, 6)
        # a non-contiguous leaf parameter (a transposed view)
        self.model.proj.weight = nn.Parameter(torch.randn(6, 6).t())
        self.model.register_buffer("scale", torch.arange(3.0))
        self.model.register_buffer("rope_cache", torch.ones(4), persistent=False)
        self.lm_head.weight = self.model.embed_tokens.weight


def _check_gather(bound, full):
    """Each piece of the bound layout reads the independently kept copy ``full``."""
    seen = {}
    for piece in bound.layout.iter_pieces():
        local = bound.tensors[piece.key]
        assert torch.equal(
            local[piece.local_box.slices()], full[piece.tensor][piece.box.slices()]
        ), piece
        seen[piece.tensor] = seen.get(piece.tensor, 0) + piece.box.numel
    for spec in bound.layout.tensors:
        assert seen.get(spec.name, 0) == spec.numel, spec


def test_module_tensors_ties_and_buffers():
    torch.manual_seed(0)
    model = TinyLM()
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    bound = bind_module(model, WRITER)

    assert isinstance(bound, BoundModule)
    names = [t.name for t in bound.layout.tensors]
    # parameters and persistent buffers, in state-dict order; the tie kept the embedding name
    # although the head was registered first; the non-persistent buffer is not synced
    assert names == [
        "model.scale",
        "model.embed_tokens.weight",
        "model.norm.weight",
        "model.norm.bias",
        "model.proj.weight",
        "model.proj.bias",
    ]
    assert bound.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    _check_gather(bound, full)
    # local keys are the live tensors themselves, non-contiguous ones included
    assert bound.tensors["model.proj.weight"] is model.model.proj.weight
    assert not bound.tensors["model.proj.weight"].is_contiguous()
    assert bound.tensors["model.scale"] is model.model.scale
    with torch.no_grad():
        bound.tensors["model.embed_tokens.weight"][0, 0] = 42.0
    assert model.lm_head.weight[0, 0].item() == 42.0
    layout = bound.layout
    assert Layout.from_msgpack(layout.to_msgpack()).digest == layout.digest


def test_state_dict_mapping_ties_by_view_not_by_storage():
    base = torch.arange(12.0).reshape(3, 4)
    named = {
        "a": base,
        "a_again": base.view(3, 4),  # same data seen the same way: a tie
        "row0": base[0],  # same storage, another view: its own tensor
        "row1": base[1],
        "empty1": torch.empty(0),  # empty tensors may share a pointer: never a tie
        "empty2": torch.empty(0),
        "lm_head.weight": base,
    }
    assert tied_groups(named) == [["a", "a_again", "lm_head.weight"]]
    bound = bind_module(named, WRITER)
    assert bound.aliases == {"a_again": "a", "lm_head.weight": "a"}
    assert [t.name for t in bound.layout.tensors] == ["a", "row0", "row1", "empty1", "empty2"]
    _check_gather(bound, {k: v.clone() for k, v in named.items()})
    # empty tensors are declared but hold no piece, so they have no local key
    assert "empty1" not in bound.tensors


def test_heads_only_tie_keeps_the_first():
    w = torch.zeros(2, 2)
    assert is_output_head("lm_head.weight") and is_output_head("model.lm_head.weight")
    assert not is_output_head("lm_head.bias")
    bound = bind_module({"x.lm_head.weight": w, "lm_head.weight": w}, WRITER)
    assert bound.aliases == {"lm_head.weight": "x.lm_head.weight"}


def test_prefix_include_exclude():
    model = nn.Module()
    model.module = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    bound = bind_module(
        model, WRITER, prefix="module.", include=["0.*", "1.weight"], exclude="0.bias"
    )
    assert [t.name for t in bound.layout.tensors] == ["0.weight", "1.weight"]
    assert set(bound.tensors) == {"0.weight", "1.weight"}
    assert bound.tensors["1.weight"] is model.module[1].weight


def test_duplicate_after_prefix_is_named():
    named = {"module.w": torch.zeros(1), "w": torch.ones(1)}
    with pytest.raises(ValueError, match=r"'module\.w' and 'w' both become 'w'.*prefix 'module\.'"):
        bind_module(named, WRITER, prefix="module.")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"include": ["layer.weight"]},
            r"include entry 'layer\.weight' matches no tensor.*'0\.weight'",
        ),
        ({"exclude": ["*.scale"]}, r"exclude entry '\*\.scale' matches no tensor"),
        ({"include": [3]}, "names or glob patterns"),
    ],
)
def test_include_exclude_that_match_nothing(kwargs, match):
    with pytest.raises((KeyError, TypeError), match=match):
        bind_module(nn.Sequential(nn.Linear(2, 2)), WRITER, **kwargs)


def test_non_tensor_values_are_named_with_the_fix():
    named = {"w": torch.zeros(2), "_extra_state": {"fp8": True}}
    with pytest.raises(TypeError, match=r"'_extra_state' is a dict.*exclude=\['_extra_state'\]"):
        bind_module(named, WRITER)
    assert [
        t.name for t in bind_module(named, WRITER, exclude=["_extra_state"]).layout.tensors
    ] == ["w"]
    with pytest.raises(TypeError, match="nn.Module or a mapping"):
        bind_module([torch.zeros(1)], WRITER)


def test_dtensor_values_go_through_the_dtensor_provider():
    torch.manual_seed(0)
    full = {"w": torch.randn(5, 3), "b": torch.randn(3)}
    for rank in range(2):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
        try:
            mesh = init_device_mesh("cpu", (2,))
            w = nn.Parameter(distribute_tensor(full["w"], mesh, [Shard(0)], src_data_rank=None))
            named = {"w": w, "w_tied": w, "b": full["b"]}
            bound = bind_module(named, Participant(role="reader", rank=rank))
            assert bound.aliases == {"w_tied": "w"}
            assert bound.layout.tensor_spec("w").shape == (5, 3)
            (piece,) = [p for p in bound.layout.iter_pieces() if p.tensor == "w"]
            assert (piece.box.start[0], piece.box.stop[0]) == ((0, 3) if rank == 0 else (3, 5))
            assert bound.tensors["w"].shape == (3 - rank, 3)
            _check_gather_partial(bound, full)
        finally:
            dist.destroy_process_group()
            from torch.distributed.tensor import debug

            for clear in (
                "_clear_python_sharding_prop_cache",
                "_clear_fast_path_sharding_prop_cache",
            ):
                getattr(debug, clear, lambda: None)()  # not every torch has both caches


def _check_gather_partial(bound, full):
    for piece in bound.layout.iter_pieces():
        local = bound.tensors[piece.key]
        assert torch.equal(
            local[piece.local_box.slices()], full[piece.tensor][piece.box.slices()]
        ), piece


def test_engine_adapter_builds_the_participant():
    model = nn.Sequential(nn.Linear(2, 2))
    bound = bind(model, "reader", 3)
    p = bound.layout.participant
    assert (p.role, p.rank, p.name, p.host, p.device) == (
        "reader",
        3,
        "reader-3",
        socket.gethostname(),
        "cpu",
    )
    with torch.device("meta"):
        meta_model = nn.Linear(2, 2)
    p = bind(meta_model, "writer", 0, host="h1", name="trainer-a").layout.participant
    assert (p.name, p.host, p.device) == ("trainer-a", "h1", "meta")
    assert bind(nn.Sequential(), "writer", 0).layout.participant.device == "cpu"
    with pytest.raises(ValueError, match="role 'trainer'"):
        bind(model, "trainer", 0)
    with pytest.raises(TypeError, match="nn.Module"):
        bind({"w": torch.zeros(1)}, "writer", 0)
