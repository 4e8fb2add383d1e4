"""``weightbus bench <scenario>``: ``plan`` (planner scale, CPU); GPU scenarios need CUDA."""

from __future__ import annotations

import sys

SCENARIOS = {
    "plan": "planner scale: DeepSeek-V3-shaped model, 256 writers -> 128 readers, one CPU core",
    "gpu": "syncs between GPUs of this host (S1-S7, S4e) beside measured ceilings; needs CUDA",
    "links": "what an NCCL link costs (GPU memory, GB/s) by its channels; needs 2 CUDA GPUs",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SCENARIOS:
        print("usage: weightbus bench <scenario> [options]\n\nscenarios:")
        for k, v in SCENARIOS.items():
            print(f"  {k:<6} {v}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    if argv[0] == "plan":
        from weightbus.bench import plan_scale

        return plan_scale.main(argv[1:])
    if argv[0] == "links":
        from weightbus.bench import links

        return links.main(argv[1:])
    from weightbus.bench import gpu

    return gpu.main(argv[1:])
