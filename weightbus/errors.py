"""Errors weightbus raises across processes: peer failures, timeouts, disagreements.

Every error a participant raises because of *another* participant names that participant,
says what it saw and what to do about it. User mistakes inside one process stay
``ValueError`` / ``TypeError`` / ``KeyError``.
"""

from __future__ import annotations

__all__ = [
    "AccessDenied",
    "ChecksumMismatch",
    "MembershipError",
    "PeerFailure",
    "PlanMismatch",
    "ProtocolError",
    "SyncTimeout",
    "WeightbusError",
]


class WeightbusError(Exception):
    """Base class of the errors weightbus raises itself."""


class PeerFailure(WeightbusError):
    """Another participant failed, died, or the control store went away.

    ``failures`` lists ``(participant name, what happened)``, first reported first.
    """

    def __init__(self, message: str, failures: list[tuple[str, str]] | None = None) -> None:
        super().__init__(message)
        self.failures: list[tuple[str, str]] = list(failures or [])
        """``(participant name, what happened)``, first reported first."""


class SyncTimeout(WeightbusError, TimeoutError):
    """A wait passed its timeout; ``missing`` names the participants it was still waiting for."""

    def __init__(self, message: str, missing: list[str] | None = None) -> None:
        super().__init__(message)
        self.missing: list[str] = list(missing or [])
        """Participants (or slots) still missing when the wait gave up."""


class PlanMismatch(WeightbusError):
    """Participants hold different digests; ``groups`` maps each digest to who holds it."""

    def __init__(self, message: str, groups: dict[str, list[str]] | None = None) -> None:
        super().__init__(message)
        self.groups: dict[str, list[str]] = dict(groups or {})
        """Each digest -> the participants holding it."""


class MembershipError(WeightbusError, ValueError):
    """A participant cannot join: duplicate rank or name, rank out of range, counts disagree."""


class AccessDenied(WeightbusError, PermissionError):
    """A participant presented a shared-secret token that does not match the job's."""


class ProtocolError(WeightbusError):
    """A participant posted a control message that is malformed: not what the protocol allows
    for that topic (missing or unknown fields, wrong types, undecodable bytes)."""


class ChecksumMismatch(WeightbusError):
    """Bytes a reader holds after a sync differ from what a writer sent (``SyncConfig.verify``).

    The message names the tensor, its region, the bucket, the writer, the reader and both sums;
    the attributes carry the same on the reader that raised it.
    """

    def __init__(
        self,
        message: str,
        *,
        tensor: str,
        writer: str,
        reader: str,
        bucket: int,
        expected: tuple[int, int] | None,
        got: tuple[int, int] | None,
    ) -> None:
        super().__init__(message)
        self.tensor = tensor
        """Canonical name of the tensor whose route differs ("" when no route could be named)."""
        self.writer = writer
        """The writer that sent it."""
        self.reader = reader
        """The reader that holds it."""
        self.bucket = bucket
        """The bucket it travelled in."""
        self.expected = expected
        """The writer's sums ``(s1, s2)``, or None (full compare)."""
        self.got = got
        """The reader's sums ``(s1, s2)``, or None (full compare)."""
