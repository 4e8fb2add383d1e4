"""The ``weightbus`` command: ``demo``, ``plan``, ``bench``, ``status``.

Run ``weightbus --help``, or ``weightbus <command> --help``.
"""

from __future__ import annotations

import argparse
import logging
import sys


def _demo(argv: list[str]) -> int:
    from weightbus import demo

    return demo.main(argv)


def _plan(argv: list[str]) -> int:
    from weightbus.plan import cli as plan_cli

    return plan_cli.main(argv)


def _status(argv: list[str]) -> int:
    from weightbus.control import status

    return status.main(argv)


def _bench(argv: list[str]) -> int:
    from weightbus.bench import cli as bench_cli

    return bench_cli.main(argv)


COMMANDS = {
    "demo": (
        _demo,
        "trainer -> inference on this machine: a few steps, synced and checked (no GPU needed)",
    ),
    "plan": (_plan, "plan a transfer between two layouts of a model and print its statistics"),
    "bench": (
        _bench,
        "measure syncs against the hardware's ceilings (`bench plan` for planner scale)",
    ),
    "status": (
        _status,
        "live view of a running job from its control store: participants, versions, last sync",
    ),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    width = max(map(len, COMMANDS))
    epilog = "commands:\n" + "\n".join(f"  {k:<{width}}  {v[1]}" for k, v in COMMANDS.items())
    p = argparse.ArgumentParser(
        prog="weightbus",
        description="Move model weights from RL trainers to inference engines.",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("command", choices=sorted(COMMANDS), metavar="command")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO (-v) to stderr")
    p.add_argument("args", nargs=argparse.REMAINDER)
    ns = p.parse_args(argv)
    if ns.verbose:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    return COMMANDS[ns.command][0](ns.args)


if __name__ == "__main__":
    sys.exit(main())
