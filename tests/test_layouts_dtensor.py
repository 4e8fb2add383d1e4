"""DTensor layouts: shard_box / shard_regions against torch, and bind_dtensors on real DTensors.

Real DTensors for every rank of a mesh come from torch's fake process group, one rank at a time
in this process: ``distribute_tensor(..., src_data_rank=None)`` and ``parallelize_module(...,
src_data_rank=None)`` split locally without collectives, so each rank's local tensor holds the
data torch itself assigns to it (FSDP2's ``fully_shard`` also chunks locally).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

from weightbus.layouts.dtensor import bind_dtensors, shard_box, shard_regions
from weightbus.spec import Box, LayoutError, Participant

pytestmark = pytest.mark.timeout(60)


# ---------------------------------------------------------------------------------------------
# oracles
# ---------------------------------------------------------------------------------------------


def _normalized(placements, ndim):
    out = []
    for p in placements:
        if isinstance(p, _StridedShard):
            out.append(_StridedShard(p.dim % ndim, split_factor=p.split_factor))
        elif isinstance(p, Shard):
            out.append(Shard(p.dim % ndim))
        else:
            out.append(p)
    return out


def _torch_local(full, mesh_shape, coordinate, placements):
    """The local tensor torch's own splitting gives ``coordinate`` (what distribute_tensor
    computes with src_data_rank=None, mesh dim by mesh dim)."""
    t = full
    for p, n, c in zip(_normalized(placements, full.ndim), mesh_shape, coordinate, strict=True):
        if isinstance(p, (Shard, _StridedShard)):
            t = p._split_tensor(t, n, with_padding=False, contiguous=False)[0][c]
    return t


def _gather(regions, full, local_shape):
    """Build the local tensor from ``full`` using only the regions."""
    local = torch.full(local_shape, -1, dtype=full.dtype)
    covered = torch.zeros(local_shape, dtype=torch.int32)
    for gbox, lbox in regions:
        local[lbox.slices()] = full[gbox.slices()]
        covered[lbox.slices()] += 1
    return local, covered


@st.composite
def _cases(draw):
    ndim = draw(st.integers(1, 3))
    # dims smaller than the mesh, and empty dims, but mostly not
    extent = st.integers(-2, 12).map(lambda n: max(n, 0))
    shape = tuple(draw(st.lists(extent, min_size=ndim, max_size=ndim)))
    mesh = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    coordinate = tuple(draw(st.integers(0, m - 1)) for m in mesh)
    placements = []
    for _ in mesh:
        kind = draw(st.sampled_from(["shard", "strided", "strided", "replicate"]))
        dim = draw(st.integers(-ndim, ndim - 1))
        if kind == "shard":
            placements.append(Shard(dim))
        elif kind == "strided":
            placements.append(_StridedShard(dim, split_factor=draw(st.integers(1, 4))))
        else:
            placements.append(Replicate())
    return shape, mesh, coordinate, placements


# ---------------------------------------------------------------------------------------------
# pure functions
# ---------------------------------------------------------------------------------------------


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_cases())
def test_regions_and_box_match_torch(case):
    shape, mesh, coordinate, placements = case
    full = torch.arange(max(1, torch.Size(shape).numel())).reshape(-1)[: torch.Size(shape).numel()]
    full = full.reshape(shape)
    expected = _torch_local(full, mesh, coordinate, placements)
    torch_shape, torch_offset = _compute_local_shape_and_global_offset(
        shape, mesh, list(coordinate), _normalized(placements, len(shape))
    )
    assert tuple(expected.shape) == tuple(torch_shape)

    regions = shard_regions(shape, mesh, coordinate, placements)
    if expected.numel() == 0:
        assert regions == []
    else:
        local, covered = _gather(regions, full, tuple(expected.shape))
        assert torch.equal(local, expected)
        assert bool((covered == 1).all())

    # torch's region is one box exactly when its local data is the slice at its offset
    one_box = expected.numel() == 0 or torch.equal(
        full[Box.at(torch_offset, torch_shape).slices()], expected
    )
    assert (len(regions) <= 1) == one_box
    if one_box:
        box = shard_box(shape, mesh, coordinate, placements)
        assert box.shape == tuple(torch_shape)
        if regions:
            assert regions[0][0] == box
            assert box.start == tuple(torch_offset)
        else:
            assert box.empty
    else:
        with pytest.raises(LayoutError, match="not one box"):
            shard_box(shape, mesh, coordinate, placements)


def test_uneven_shard_gives_trailing_empty_shards():
    # 3 rows over 4 ranks: chunk size 1, rank 3 gets nothing.
    boxes = [shard_box((3, 5), (4,), (r,), [Shard(0)]) for r in range(4)]
    assert [b.shape for b in boxes] == [(1, 5), (1, 5), (1, 5), (0, 5)]
    assert shard_regions((3, 5), (4,), (3,), [Shard(0)]) == []
    # 5 rows over 4 ranks: chunk size 2, so 2, 2, 1, 0 (torch.chunk, not an even spread).
    assert [shard_box((5,), (4,), (r,), [Shard(0)]).shape for r in range(4)] == [
        (2,),
        (2,),
        (1,),
        (0,),
    ]


def test_nested_shard_of_one_dim():
    # (Shard(0), Shard(0)) on a 2 x 2 mesh: dp splits first, tp splits the dp chunk.
    got = [
        shard_box((10, 3), (2, 2), (i, j), [Shard(0), Shard(0)]) for i in range(2) for j in range(2)
    ]
    assert [(b.start[0], b.stop[0]) for b in got] == [(0, 3), (3, 5), (5, 8), (8, 10)]


def test_strided_shard_can_hold_several_runs():
    # transformers' packed gate_up: rows [gate | up], each half split across the 2 ranks.
    regions = shard_regions((8, 2), (2,), (0,), [_StridedShard(0, split_factor=2)])
    assert regions == [
        (Box((0, 0), (2, 2)), Box((0, 0), (2, 2))),
        (Box((4, 0), (6, 2)), Box((2, 0), (4, 2))),
    ]
    with pytest.raises(LayoutError, match=r"experts\.gate_up.*not one box"):
        shard_box((8, 2), (2,), (0,), [_StridedShard(0, split_factor=2)], name="experts.gate_up")
    # adjacent runs merge: on a mesh dim of 1 a strided shard holds everything
    assert shard_box((8,), (1,), (0,), [_StridedShard(0, split_factor=2)]) == Box((0,), (8,))
    # FSDP2 + TP placements stay one box when the dim divides evenly.
    fsdp_tp = [_StridedShard(0, split_factor=2), Shard(0)]
    boxes = [shard_box((8, 4), (2, 2), (i, j), fsdp_tp) for i in range(2) for j in range(2)]
    assert [(b.start[0], b.stop[0]) for b in boxes] == [(0, 2), (4, 6), (2, 4), (6, 8)]


def test_partial_is_rejected_with_the_fix():
    with pytest.raises(LayoutError, match=r"lm_head\.weight.*Partial.*redistribute"):
        shard_box((4, 4), (2,), (0,), [Partial()], name="lm_head.weight")


@pytest.mark.parametrize(
    ("mesh", "coordinate", "placements", "match"),
    [
        ((2,), (2,), [Shard(0)], "outside the mesh"),
        ((2, 2), (0,), [Shard(0), Shard(0)], "one entry per mesh dim"),
        ((2,), (0,), [Shard(2)], "tensor dim 2"),
        ((2,), (0,), ["Shard(0)"], "not Shard"),
    ],
)
def test_bad_arguments_are_named(mesh, coordinate, placements, match):
    with pytest.raises((ValueError, TypeError), match=match):
        shard_box((4, 4), mesh, coordinate, placements)


# ---------------------------------------------------------------------------------------------
# real DTensors
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _fake_rank(rank, world_size):
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        # DTensor caches sharding propagation by mesh *value*, so a later simulated rank would
        # get DTensors carrying an earlier rank's mesh (and coordinate).
        from torch.distributed.tensor import debug

        for clear in ("_clear_python_sharding_prop_cache", "_clear_fast_path_sharding_prop_cache"):
            getattr(debug, clear, lambda: None)()  # not every torch has both caches


def _check_pieces(bound, fulls, counts):
    """Every piece reads the right data, and the local tensors are the DTensors' storage."""
    for piece in bound.layout.iter_pieces():
        local = bound.tensors[piece.key]
        assert torch.equal(
            local[piece.local_box.slices()], fulls[piece.tensor][piece.box.slices()]
        ), piece
        counts[piece.tensor][piece.box.slices()] += 1


_PLACEMENTS_2D = {
    "rows_cols": [Shard(0), Shard(1)],
    "rows_rows_uneven": [Shard(0), Shard(0)],
    "replicated_dp": [Replicate(), Shard(1)],
    "fsdp_tp": [_StridedShard(0, split_factor=2), Shard(0)],
    "strided_cols": [Replicate(), _StridedShard(1, split_factor=2)],
    "tiny": [Shard(0), Shard(1)],
}
_SHAPES = {
    "rows_cols": (8, 6),
    "rows_rows_uneven": (7, 3),
    "replicated_dp": (4, 9),
    "fsdp_tp": (8, 5),
    "strided_cols": (3, 8),
    "tiny": (1, 3),
}
_REPLICAS = {"replicated_dp": 2, "strided_cols": 2}


def test_bind_dtensors_on_a_2d_mesh():
    torch.manual_seed(0)
    fulls = {k: torch.randn(s) for k, s in _SHAPES.items()}
    fulls["plain"] = torch.randn(3, 2)
    counts = {k: torch.zeros(v.shape, dtype=torch.int32) for k, v in fulls.items()}
    for rank in range(4):
        with _fake_rank(rank, 4):
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            named = {
                k: distribute_tensor(fulls[k], mesh, p, src_data_rank=None)
                for k, p in _PLACEMENTS_2D.items()
            }
            named["plain"] = fulls["plain"]
            bound = bind_dtensors(named, Participant(role="writer", rank=rank))
            assert {t.name: t.shape for t in bound.layout.tensors} == {
                k: tuple(v.shape) for k, v in fulls.items()
            }
            _check_pieces(bound, fulls, counts)
            # The bound tensor is the DTensor's storage: a write shows through.
            for key, local in bound.tensors.items():
                if isinstance(named[key], DTensor):
                    local.add_(1000)
                    assert torch.equal(named[key].to_local(), local)
                    assert float(named[key]._local_tensor.reshape(-1)[0]) > 500
            if rank == 3:
                # (1, 3) over dp=2: the second dp row is empty, so no local key and no piece.
                assert "tiny" not in bound.tensors
                assert "tiny" not in {p.key for p in bound.layout.iter_pieces()}
    for key, c in counts.items():
        want = 4 if key == "plain" else _REPLICAS.get(key, 1)
        assert bool((c == want).all()), (key, c)


def test_bind_dtensors_on_1d_and_3d_meshes():
    torch.manual_seed(1)
    cases = [
        (
            (3,),
            {
                "gate_up": ((2, 10, 4), [_StridedShard(1, split_factor=2)]),
                "col": ((5, 7), [Shard(-1)]),
            },
        ),
        ((2, 2, 2), {"w": ((9, 6), [Shard(0), _StridedShard(1, split_factor=3), Shard(1)])}),
    ]
    for mesh_shape, specs in cases:
        world = int(torch.tensor(mesh_shape).prod())
        fulls = {k: torch.randn(s) for k, (s, _) in specs.items()}
        counts = {k: torch.zeros(v.shape, dtype=torch.int32) for k, v in fulls.items()}
        n_pieces = 0
        for rank in range(world):
            with _fake_rank(rank, world):
                mesh = init_device_mesh("cpu", mesh_shape)
                named = {
                    k: distribute_tensor(fulls[k], mesh, p, src_data_rank=None)
                    for k, (_, p) in specs.items()
                }
                bound = bind_dtensors(named, Participant(role="reader", rank=rank))
                _check_pieces(bound, fulls, counts)
                n_pieces += len(bound.layout.pieces)
        for key, c in counts.items():
            assert bool((c == 1).all()), (mesh_shape, key, c)
        # the strided placements above do split some ranks' shards into several pieces
        assert n_pieces > world * len(specs)


def test_fsdp2_over_tensor_parallel():
    """Real FSDP2 (fully_shard on dp) over real TP (parallelize_module on tp): even dims sync."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(2)
    base = nn.Sequential(nn.Linear(6, 12), nn.Linear(12, 4))
    fulls = {k: v.detach().clone() for k, v in base.state_dict().items()}
    counts = {k: torch.zeros(v.shape, dtype=torch.int32) for k, v in fulls.items()}
    seen = set()
    for rank in range(4):
        with _fake_rank(rank, 4):
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            model = copy.deepcopy(base)
            plan = {"0": ColwiseParallel(), "1": RowwiseParallel()}
            parallelize_module(model, mesh["tp"], plan, src_data_rank=None)
            fully_shard(model, mesh=mesh["dp"])
            named = model.state_dict(keep_vars=True)
            seen.update(str(p) for v in named.values() for p in v.placements)
            bound = bind_dtensors(named, Participant(role="writer", rank=rank))
            _check_pieces(bound, fulls, counts)
    assert any(s.startswith("_S(") for s in seen), seen  # FSDP2 + TP made _StridedShard
    counts.pop("1.bias")  # replicated over tp by RowwiseParallel
    for key, c in counts.items():
        assert bool((c == 1).all()), (key, c)


def test_fsdp2_over_tensor_parallel_uneven_is_refused():
    """On an uneven dim FSDP2's data disagrees with its own _StridedShard placements: refuse."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    base = nn.Sequential(nn.Linear(6, 9))
    errors = []
    for rank in range(8):
        with _fake_rank(rank, 8):
            mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
            model = copy.deepcopy(base)
            parallelize_module(model, mesh["tp"], {"0": ColwiseParallel()}, src_data_rank=None)
            fully_shard(model, mesh=mesh["dp"])
            try:
                bind_dtensors(
                    model.state_dict(keep_vars=True), Participant(role="writer", rank=rank)
                )
            except LayoutError as e:
                errors.append(str(e))
    assert errors and all("0.weight" in e and "pad that dim" in e for e in errors), errors


def test_from_local_with_custom_shapes_is_refused():
    with _fake_rank(0, 2):
        mesh = init_device_mesh("cpu", (2,))
        dt = DTensor.from_local(
            torch.zeros(1, 4), mesh, [Shard(0)], run_check=False, shape=(5, 4), stride=(4, 1)
        )
        with pytest.raises(LayoutError, match=r"odd: .*\(1, 4\).*\(3, 4\)"):
            bind_dtensors({"odd": dt}, Participant(role="writer", rank=0))


def test_partial_dtensor_is_refused():
    with _fake_rank(0, 2):
        mesh = init_device_mesh("cpu", (2,))
        dt = DTensor.from_local(torch.zeros(4), mesh, [Partial()], run_check=False)
        with pytest.raises(LayoutError, match="grad_sum.*redistribute"):
            bind_dtensors({"grad_sum": dt}, Participant(role="writer", rank=0))


def test_non_tensor_value_is_named():
    with pytest.raises(TypeError, match="'step'.*int"):
        bind_dtensors({"step": 3}, Participant(role="writer", rank=0))


def test_to_local_copy_is_refused(monkeypatch):
    with _fake_rank(0, 2):
        mesh = init_device_mesh("cpu", (2,))
        dt = distribute_tensor(torch.zeros(4, 2), mesh, [Shard(0)], src_data_rank=None)
        monkeypatch.setattr(DTensor, "to_local", lambda self, **kw: self._local_tensor.clone())
        with pytest.raises(LayoutError, match="w: DTensor.to_local.. returned a copy"):
            bind_dtensors({"w": dt}, Participant(role="reader", rank=0))


def test_non_default_shard_order_is_refused():
    spec_mod = pytest.importorskip("torch.distributed.tensor._dtensor_spec")
    if not hasattr(spec_mod, "ShardOrderEntry"):
        pytest.skip("this torch has no shard_order")
    with _fake_rank(0, 4):
        mesh = init_device_mesh("cpu", (2, 2))
        meta = spec_mod.TensorMeta(torch.Size((8, 2)), (2, 1), torch.float32)
        order = (spec_mod.ShardOrderEntry(tensor_dim=0, mesh_dims=(1, 0)),)
        spec = spec_mod.DTensorSpec(mesh, (Shard(0), Shard(0)), tensor_meta=meta, shard_order=order)
        dt = DTensor(torch.zeros(2, 2), spec, requires_grad=False)
        with pytest.raises(LayoutError, match="w: DTensor shards in the non-default order"):
            bind_dtensors({"w": dt}, Participant(role="reader", rank=0))
