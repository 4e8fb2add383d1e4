"""Docs build hooks: the benchmark plots from ``bench/results`` and the CLI's own help text.

* ``on_files`` publishes every ``bench/results/*.png`` at ``bench/<name>.png`` so the
  benchmark page shows the committed plots without copying them into ``docs/``.
* ``on_page_markdown`` replaces ``<!-- cli-help: ARGS -->`` with the output of
  ``weightbus ARGS --help``, run in this process, so the CLI page always matches the code.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
_HELP = "<!-- cli-help:"


def on_files(files, config):
    for png in sorted((ROOT / "bench" / "results").glob("*.png")):
        files.append(File.generated(config, f"bench/{png.name}", abs_src_path=str(png)))
    return files


def _help(args: list[str]) -> str:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from weightbus import cli

    os.environ["COLUMNS"] = "100"
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            cli.main([*args, "--help"])
        except SystemExit:
            pass
    return out.getvalue().rstrip()


def on_page_markdown(markdown, page, config, files):
    if _HELP not in markdown:
        return markdown
    lines = []
    for line in markdown.splitlines():
        if line.startswith(_HELP) and line.rstrip().endswith("-->"):
            args = line[len(_HELP) : line.rindex("-->")].split()
            lines += ["```text", _help(args), "```"]
        else:
            lines.append(line)
    return "\n".join(lines)
