"""Planning: layouts in, routes and buckets out (pure, deterministic)."""

from weightbus.plan.executor import allocate, execute, fill_from_canonical, poison
from weightbus.plan.planner import PlanOptions, PlanStats, TransferPlan, make_plan
from weightbus.plan.program import BucketOp, Copy, build_program, pack, unpack

__all__ = [
    "BucketOp",
    "Copy",
    "PlanOptions",
    "PlanStats",
    "TransferPlan",
    "allocate",
    "build_program",
    "execute",
    "fill_from_canonical",
    "make_plan",
    "pack",
    "poison",
    "unpack",
]
