"""Docs build: turn the reST habits of weightbus docstrings into Markdown for mkdocstrings.

Docstrings are written to read well as plain text and use a few reST forms: roles
(``:class:`~weightbus.errors.PeerFailure```), ``text::`` before an indented literal block, and
doctest lines (``>>> writer.connect()``). Rendered as Markdown the first shows its markup, the
second a stray colon, and the third becomes nested block quotes. This griffe extension rewrites
each docstring once, when griffe loads it: roles become code spans (the last dotted part when
the target starts with ``~``), ``::`` becomes ``:``, and runs of doctest lines become fenced
``pycon`` blocks. Nothing else changes.
"""

from __future__ import annotations

import re

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|data|mod|exc|obj|const|envvar):`(~?)([^`]+)`")
_DOCTEST = re.compile(r"^(\s*)(>>>|\.\.\.)( |$)")


def _role(match: re.Match) -> str:
    tilde, target = match.group(1), match.group(2)
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


def markdown(text: str) -> str:
    """The docstring ``text`` with roles, ``::`` and doctest runs rewritten (module docstring)."""
    text = _ROLE.sub(_role, text)
    out: list[str] = []
    fence: str | None = None  # indentation of the open doctest fence
    for line in text.splitlines():
        m = _DOCTEST.match(line)
        if m and fence is None and not m.group(1):
            out.append("```pycon")
            fence = m.group(1)
        elif not m and fence is not None:
            out.append("```")
            fence = None
        if line.rstrip().endswith("::") and not m:
            stripped = line.rstrip()[:-2].rstrip()
            line = stripped + ":" if stripped else ""
        out.append(line)
    if fence is not None:
        out.append("```")
    return "\n".join(out)


class SphinxRoles(griffe.Extension):
    """Rewrites every docstring griffe loads (see the module docstring)."""

    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
