"""The planner's oracle check, shared by the property tests.

Fill the writers' local tensors from full canonical tensors (everything else poisoned), run the
plan with the reference executor into poisoned reader tensors, then require that every reader
tensor equals its expected slices bit for bit, that every element a reader piece covers is
written exactly once and nothing else is written, and that each reader receives exactly the
bytes its pieces cover.
"""

from __future__ import annotations

import numpy as np
import torch

from weightbus.plan import TransferPlan, allocate, execute, fill_from_canonical
from weightbus.spec import Layout


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def check_plan(
    plan: TransferPlan,
    writers: list[Layout],
    readers: list[Layout],
    canon: dict[str, torch.Tensor],
    reader_dtype: torch.dtype,
    context: object = "",
) -> None:
    wt = [allocate(lay) for lay in writers]  # poisoned: a route reading outside a piece shows
    for lay, t in zip(writers, wt, strict=True):
        fill_from_canonical(lay, canon, t)
    got = [allocate(lay) for lay in readers]
    execute(plan, wt, got)

    want_canon = {n: v.to(reader_dtype) for n, v in canon.items()}
    r = plan.routes
    for ri, (lay, g) in enumerate(zip(readers, got, strict=True)):
        want = allocate(lay)
        fill_from_canonical(lay, want_canon, want)
        for key in want:
            assert torch.equal(_bits(g[key]), _bits(want[key])), (context, lay.name, key)
        assert plan.stats.reader_bytes[ri] == lay.nbytes, (context, lay.name)
        count = {lt.key: torch.zeros(lt.shape, dtype=torch.int32) for lt in lay.locals}
        cover = {lt.key: torch.zeros(lt.shape, dtype=torch.int32) for lt in lay.locals}
        for p in lay.iter_pieces():
            cover[p.key][p.local_box.slices()] += 1
        for i in np.flatnonzero(r.dst == ri):
            local = lay.locals[r.dst_key[i]]
            nd = len(local.shape)
            a, e = r.dst_local[i][-nd:], (r.stop[i] - r.start[i])[-nd:]
            count[local.key][
                tuple(slice(x, x + y) for x, y in zip(a.tolist(), e.tolist(), strict=True))
            ] += 1
        for key in count:
            assert torch.equal(count[key], cover[key]), (context, lay.name, key)
