"""Column-wise box arithmetic for the planner: overlap joins and grouping, on numpy arrays.

Boxes are rows of ``start``/``stop`` arrays of shape ``(n, ndim)``. Every function works on whole
columns, so planning a model with a million pieces costs numpy passes, not Python iterations.
"""

from __future__ import annotations

import numpy as np

# Composite sort keys pack (group, coordinate) into one int64: coordinates stay below 2**40
# (a terabyte-long dim), groups below 2**23.
_COORD_BITS = 40
_MAX_GROUP = 1 << (63 - _COORD_BITS)


def expand_ranges(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For ranges ``[lo[i], hi[i])``: (row i repeated per element, the elements)."""
    counts = np.maximum(hi - lo, 0)
    total = int(counts.sum())
    rows = np.repeat(np.arange(len(lo), dtype=np.int64), counts)
    if total == 0:
        return rows, np.zeros(0, np.int64)
    first = np.cumsum(counts) - counts
    within = np.arange(total, dtype=np.int64) - np.repeat(first, counts)
    return rows, np.repeat(lo.astype(np.int64), counts) + within


def group_starts(sorted_keys: list[np.ndarray]) -> np.ndarray:
    """Row indices where any of the (already sorted) key columns changes; includes row 0."""
    n = len(sorted_keys[0])
    if n == 0:
        return np.zeros(0, np.int64)
    change = np.zeros(n, bool)
    change[0] = True
    for k in sorted_keys:
        if k.ndim == 1:
            change[1:] |= k[1:] != k[:-1]
        else:
            change[1:] |= np.any(k[1:] != k[:-1], axis=1)
    return np.flatnonzero(change)


def lexsort_rows(*cols: np.ndarray) -> np.ndarray:
    """Stable order sorting by ``cols[0]`` first, then ``cols[1]``... (2-D columns expand)."""
    keys: list[np.ndarray] = []
    for c in cols:
        if c.ndim == 1:
            keys.append(c)
        else:
            keys.extend(c[:, d] for d in range(c.shape[1]))
    return np.lexsort(keys[::-1])


def _sweep_dims(
    group: np.ndarray, start: np.ndarray, stop: np.ndarray, n_groups: int
) -> np.ndarray:
    """Per group, the dim its boxes are cut along most: the largest span of starts measured
    in the group's longest extent along that dim (a cheap stand-in for distinct starts)."""
    ndim = start.shape[1]
    order = np.argsort(group, kind="stable")
    g = group[order]
    firsts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
    present = g[firsts]
    score = np.zeros((len(firsts), ndim))
    for d in range(ndim):
        s, e = start[order, d], stop[order, d]
        span = np.maximum.reduceat(s, firsts) - np.minimum.reduceat(s, firsts)
        longest = np.maximum.reduceat(e - s, firsts)
        score[:, d] = span / np.maximum(longest, 1)
    best = np.zeros(n_groups, np.int64)
    best[present] = np.argmax(score, axis=1)
    return best


def overlap_join(
    ga: np.ndarray,
    sa: np.ndarray,
    ea: np.ndarray,
    gb: np.ndarray,
    sb: np.ndarray,
    eb: np.ndarray,
    n_groups: int,
) -> tuple[np.ndarray, np.ndarray]:
    """All pairs ``(i, j)`` with ``ga[i] == gb[j]`` whose boxes overlap.

    Not quadratic: B's boxes are swept along one dim per group (the dim with most distinct
    starts); each A box probes only the B boxes whose start lies within the longest B extent
    of its own range, then the candidates are checked on every dim.
    """
    if len(ga) == 0 or len(gb) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    if n_groups >= _MAX_GROUP:
        _, inv = np.unique(np.concatenate([ga, gb]), return_inverse=True)
        ga, gb, n_groups = inv[: len(ga)], inv[len(ga) :], int(inv.max()) + 1
    dim = _sweep_dims(gb, sb, eb, n_groups)
    rows_b = np.arange(len(gb))
    key_b = sb[rows_b, dim[gb]]
    ext_b = eb[rows_b, dim[gb]] - key_b
    comp_b = (gb.astype(np.int64) << _COORD_BITS) | key_b
    order = np.argsort(comp_b, kind="stable")
    comp_sorted = comp_b[order]
    maxlen = np.zeros(n_groups, np.int64)
    np.maximum.at(maxlen, gb, ext_b)

    rows_a = np.arange(len(ga))
    da = dim[ga]
    lo_key = np.maximum(sa[rows_a, da] - maxlen[ga] + 1, 0)
    hi_key = ea[rows_a, da]
    ga64 = ga.astype(np.int64) << _COORD_BITS
    lo = np.searchsorted(comp_sorted, ga64 | lo_key, side="left")
    hi = np.searchsorted(comp_sorted, ga64 | hi_key, side="left")
    ia, pos = expand_ranges(lo, hi)
    ib = order[pos]
    keep = overlaps(sa[ia], ea[ia], sb[ib], eb[ib])
    return ia[keep], ib[keep]


def volume(start: np.ndarray, stop: np.ndarray) -> np.ndarray:
    """Elements per box (numpy reduces a 3-wide axis slowly; columns are faster)."""
    ext = np.maximum(stop - start, 0)
    out = ext[:, 0].copy()
    for d in range(1, ext.shape[1]):
        out *= ext[:, d]
    return out


def overlaps(sa: np.ndarray, ea: np.ndarray, sb: np.ndarray, eb: np.ndarray) -> np.ndarray:
    """Row-wise: do boxes a and b overlap on every dim."""
    ok = np.maximum(sa[:, 0], sb[:, 0]) < np.minimum(ea[:, 0], eb[:, 0])
    for d in range(1, sa.shape[1]):
        ok &= np.maximum(sa[:, d], sb[:, d]) < np.minimum(ea[:, d], eb[:, d])
    return ok
