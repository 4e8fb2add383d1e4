"""nccl: GPU bytes between processes over NVLink / PCIe / InfiniBand, through NCCL.

Process groups of its own (``ProcessGroupNCCL``, one per link: below), built from prefixes of
one store of the control plane's (never the default process group, so it works beside the
trainer's and the engine's own groups), one GPU per process. The two ends of a link are on two
GPUs; other processes may share a GPU (a trainer and an engine colocated on each GPU, engine
replicas on one GPU), though processes on one GPU take turns on it, NCCL kernels included,
unless the GPU runs MPS.

How a send or receive completes: it is posted on NCCL's stream, the caller's current stream is
made to wait for it (so a pack into, or unpack from, the same buffer is ordered after it on the
GPU without blocking the CPU), and a CUDA event recorded there marks it done; one poller thread
per transport watches those events. A dead peer leaves NCCL kernels spinning: the base class's
wait notices through the control plane (failure report or stale heartbeat) and :meth:`_abort`
aborts the communicators, every link's at once (:meth:`_abort`), which frees the GPU.

Each writer-reader link has a ``ProcessGroupNCCL`` of its own, of two ranks (the writer 0),
and every operation on it is posted the same way (as an NCCL group, where both ends' PyTorch
have them), so that each link uses one communicator and one NCCL stream: links never queue behind
each other, and posting never creates a communicator. (One process group of every participant
would not do: PyTorch runs grouped point-to-point operations on that group's communicator of
all ranks, created lazily by the first of them as a collective of every participant, so a
participant that had died, or that never posted a group, blocked the others' first group in
NCCL's initialization, beyond any timeout; and that one communicator's stream put every link
behind every other: S2 over NCCL, one writer to three readers on 4 x H200, took 188.4 ms so
against 132.7 with a group per link.) :meth:`_connect` creates every link's communicator, several
at a time (:data:`CONNECT_AT_ONCE`), started in one global order, so the first sync pays
nothing. ``$WEIGHTBUS_NCCL_GROUPS=0``
puts one operation in each group (S1 over NCCL took 48.7 ms with an NCCL call per bucket
against 46.3 with groups on 2 x H200, when groups came); the ends of each link agree at
connect on which operations share a group (``Transport.groups_with``), so the setting may
differ between participants. A PyTorch without groups posts every operation alone, which
goes through another communicator than a group: the ends of each link tell each other at
connect whether they can group, and a link posts groups only where both can, so a
participant with another PyTorch (one joining a running job, say) slows its own links at most.

A communicator's buffers grow with its channels, and NCCL gives a link of two ranks all it
can (32 on H200s over NVLink: 260 MiB of the sender's GPU, 516 of the receiver's). So each
participant offers each of its links a share of its :data:`CHANNELS`, split among its links,
and a link asks NCCL for the smaller of its two ends' offers (``maxCTAs``; the ends tell each
other theirs at connect): a participant's links together hold about one link's buffers, and,
since links run side by side, move about as much (the figures at :data:`CHANNELS`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from weightbus._env import env_int
from weightbus.control.store import Roster
from weightbus.spec import Participant
from weightbus.transports._cuda import EventPoller, cuda_device
from weightbus.transports.base import Handle, Transport, register_transport
from weightbus.transports.links import link_class

__all__ = ["NcclTransport", "connect_at_once", "make_in_order"]

logger = logging.getLogger(__name__)

ABORT_WAIT_S = 5.0
"""How long :meth:`NcclTransport._abort` waits for its links' communicators to abort."""
CHANNELS = 32
"""Channels (an SM and a set of buffers each) that a participant's NCCL links may use
together: each link may use this many divided by the participant's links, at least
:data:`LINK_CHANNELS_MIN`, or its other end's share where smaller (``ncclConfig_t.maxCTAs``;
``$WEIGHTBUS_NCCL_CHANNELS``, which may differ between participants; 0: no limit from this
end, NCCL's own choice where the other end sets none either). A communicator's buffers grow
with its channels, and NCCL gives every link of two ranks as many as it can, so with NCCL's
choice a participant's NCCL memory grows with its links. Measured on 2 x H200 over NVLink, NCCL 2.28
(``weightbus bench links``, ``bench/results/2026-11-28-2xh200-nccl-links-cost.json``): per
two-rank communicator the sender's GPU held 245 MiB and the receiver's 517 with NCCL's choice,
260 and 516 with 32, 116 and 260 with 16, 60 and 132 with 8, 36 and 68 with 4, 18 and 36 with
2; one link moved 355 GB/s with NCCL's choice, 32 or 16 channels, 260 with 8, 130 with 4, 68
with 2; four links at once (a quarter of 1 GiB each) 345 GB/s in all with NCCL's choice or 32,
349 with 16, 353 with 8, 327 with 4, 250 with 2. In weightbus jobs over those two GPUs (a
small model), a writer with 16 readers used 5214 MiB of its GPU with NCCL's choice and 1374
with the split, a reader of 8 writers 5174 and 1590 (about 1 GiB of either is the CUDA
context and PyTorch's). A participant with one link asks for 32, no fewer than NCCL chose
there (S1 over NCCL took 47.0 ms with the split, as before)."""
LINK_CHANNELS_MIN = 2
"""The fewest channels a link gets from the split of :data:`CHANNELS`."""
CONNECT_AT_ONCE = 16
"""Links whose communicators the participants on one GPU make at once at connect: each makes
this many over the participants on its GPU, at least 1, at a time (:func:`connect_at_once`;
``$WEIGHTBUS_NCCL_CONNECT_AT_ONCE`` sets a participant's own number, and may differ between
participants). Making one takes both ends about half a second (NCCL's bootstrap, topology and
buffers), so one after another a participant with many links took that long per link.
Measured on 2 x H200 (``weightbus bench links --at-once``, writers on GPU 0, readers on GPU 1,
``bench/results/2026-11-28-2xh200-nccl-connect.json``; the slowest participant's connect,
writer / reader): a writer with 16 readers 7.3-8.8 / 8.9-10.5 s one link at a time, 2.3 / 5.0
with 4 at once, 2.1 / 4.6 with 8, 1.6 / 4.5 with 16, and 3.8 / 4.6 by this default in a run
where one at a time took 8.8 / 8.9 (the readers, 16 processes on one GPU, are slow to connect
whatever their one link does). With 8 processes on each GPU (8 writers, 8 readers, 8 links
each) more at once did not help: 5.2-6.0 / 5.8-6.5 s one at a time, 5.2-5.5 / 4.9 with 2 (this
default there: 5.4 / 5.3), 6.8-7.8 / 6.6-7.7 with 4, 6.1-8.1 / 7.0-8.1 with 8; 4 writers and 4
readers 1.9-3.5 / 2.3-3.4 s one at a time, 2.1-2.7 / 1.7-2.7 with 4. Not measured: one process
per GPU with many links (more GPUs than a machine here has), links across hosts."""
_POLL_S = 0.05
"""How often :func:`make_in_order` calls its ``poll`` while it waits."""


def _own_connection(store: Any) -> Any:
    """``store`` (its prefix and data) on a connection of its own, where it can make one
    (``Store.clone``); else ``store`` itself."""
    try:
        return store.clone()
    except (AttributeError, RuntimeError, NotImplementedError):
        return store


def connect_at_once(roster: Roster, name: str) -> int:
    """How many links participant ``name`` makes at once at connect: :data:`CONNECT_AT_ONCE`
    over the participants on its GPU (itself included), at least 1."""
    me = roster[name]
    sharing = sum(link_class(p, me) == "same_gpu" for p in roster.all)
    return max(1, CONNECT_AT_ONCE // max(sharing, 1))


def make_in_order(
    jobs: Sequence[Callable[[], None]],
    at_once: int,
    *,
    stall_s: float,
    poll: Callable[[], None] = lambda: None,
) -> None:
    """Run ``jobs`` (callables) on up to ``at_once`` threads, each job started only after every
    job before it; return once all are done, raise the first error of one, or
    ``TimeoutError(message, indices not done)`` when none finished for ``stall_s`` seconds.
    ``poll`` runs about every :data:`_POLL_S` while waiting (its exception ends the wait).

    For links, whose two ends block until both have started it (NCCL makes a communicator when
    both ranks post its first operation), started in one global order by every participant:
    the earliest link not yet made is then among the ``at_once`` earliest not made of each of
    its ends, so both have started it and it gets made; no participant waits on another for
    ever, whatever ``at_once`` each has. The threads are daemons: where a peer never comes, the
    caller's abort of the links releases them, and they never hold the process open."""
    if not jobs:
        return
    state = threading.Condition()
    taken = 0
    done: set[int] = set()
    errors: list[BaseException] = []

    def work() -> None:
        nonlocal taken
        while True:
            with state:
                if taken == len(jobs) or errors:
                    return
                i, taken = taken, taken + 1
            try:
                jobs[i]()
            except BaseException as e:
                with state:
                    errors.append(e)
                    state.notify_all()
                return
            with state:
                done.add(i)
                state.notify_all()

    for k in range(min(at_once, len(jobs))):
        threading.Thread(target=work, name=f"weightbus-nccl-connect-{k}", daemon=True).start()
    last, made = time.monotonic(), 0
    while True:
        with state:
            if not errors and len(done) < len(jobs):
                state.wait(_POLL_S)
            if errors:
                raise errors[0]
            if len(done) == len(jobs):
                return
            if len(done) > made:
                last, made = time.monotonic(), len(done)
            left = [i for i in range(len(jobs)) if i not in done]
        poll()
        if time.monotonic() - last > stall_s:
            raise TimeoutError(f"{len(left)} of {len(jobs)} jobs not done", left)


def _pairs(roster: Roster):
    """Every writer-reader pair that is a link: (writer's global rank, reader's), in the global
    order of :func:`link_order`."""
    writers = [p for p in roster.all if p.role == "writer"]
    readers = [p for p in roster.all if p.role == "reader"]
    for writer in writers:
        for reader in readers:
            if link_class(writer, reader) != "same_gpu":
                yield roster.global_rank(writer.name), roster.global_rank(reader.name)


def link_channels(roster: Roster, budgets: Mapping[int, int]) -> dict[str, int]:
    """Per link (its store prefix, as in :func:`link_order`): the channels it may use. Each
    end offers a share of its budget (:data:`CHANNELS`; per participant by global rank)
    split among its own links, at least :data:`LINK_CHANNELS_MIN` and at most
    the budget; the link takes the smaller offer, so both ends, knowing both budgets, ask
    NCCL alike. An end whose budget is 0 offers no limit (NCCL's own choice); a link without
    a limit, or with an end whose budget is not given, is left out."""
    pairs = list(_pairs(roster))
    count: dict[int, int] = {}
    for w, r in pairs:
        count[w] = count.get(w, 0) + 1
        count[r] = count.get(r, 0) + 1

    def offer(end: int) -> int | None:
        budget = budgets[end]
        if budget <= 0:
            return None
        return max(min(LINK_CHANNELS_MIN, budget), budget // count[end])

    out = {}
    for w, r in pairs:
        if w not in budgets or r not in budgets:
            continue
        offers = [x for x in (offer(w), offer(r)) if x is not None]
        if offers:
            out[f"{w}-{r}"] = min(offers)
    return out


def link_order(roster: Roster, name: str) -> list[tuple[int, str, int]]:
    """Participant ``name``'s links, in the order every participant creates them (writer-reader
    pairs sorted by the writer's global rank, then the reader's): per link the peer's global
    rank, the link's store prefix (the same on both ends) and this end's rank in the link's
    group (the writer 0, the reader 1).

    A writer and a reader on one GPU have no link: NCCL cannot join two ranks of one GPU, and
    the choice of transports never gives nccl their link (``carries("same_gpu")`` is False;
    CUDA IPC serves it, or nothing where they exchange no bytes). Both ends tell so alike, from
    the roster's GPU identities."""
    me = roster[name]
    mine = roster.global_rank(name)
    return [
        (r if me.role == "writer" else w, f"{w}-{r}", int(mine == r))
        for w, r in _pairs(roster)
        if mine in (w, r)
    ]


@register_transport
class NcclTransport(Transport):
    """GPU memory between processes on distinct GPUs, on one host or across hosts."""

    name = "nccl"
    devices = frozenset({"cuda"})
    cross_host = True
    same_gpu_zero_copy = False
    needs_staging = True
    priority = 10
    sends_any_buffer = True
    # S4 over NCCL (FSDP2 on 2 GPUs -> tensor parallel 2 on 2 others, Llama-3-8B, 4 x H200):
    # 53.7-74.8 ms with each large route alone (233 messages on each big link, the
    # row-parallel ones staged on the writer), 29.7-29.9 ms with every route packed into
    # 256 MiB buckets; S1 and S2 have no mixed link (46.4 and 132.6 ms in the same run)
    pack_mixed_links = True

    def __init__(self, **fields: Any) -> None:
        super().__init__(fields.pop("timeout", None))
        if fields:
            raise TypeError(f"nccl: unknown options {sorted(fields)}")
        self._links: dict[int, Any] = {}
        """Per peer (global rank): the ProcessGroupNCCL of this participant and that peer."""
        self._poller: EventPoller | None = None
        self._device: torch.device | None = None
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._coalesce = False  # this PyTorch can post NCCL groups
        self._grouped: dict[int, bool] = {}
        """Per peer (global rank): the link's operations go as NCCL groups (both ends can)."""
        self._group = False  # several operations to a peer in one group ($WEIGHTBUS_NCCL_GROUPS)

    @classmethod
    def unsupported(cls, participants) -> str | None:
        people = list(participants)
        if not torch.cuda.is_available() or not dist.is_nccl_available():
            return "nccl needs CUDA and a PyTorch built with NCCL"
        if any(torch.device(p.device).type != "cuda" for p in people):
            return "nccl links CUDA devices only, some participants are on " + ", ".join(
                sorted({p.device for p in people if torch.device(p.device).type != "cuda"})
            )
        # processes sharing a GPU are accepted: a link of two of them is refused as a link
        # (carries("same_gpu") is False), and link_order gives such a pair no link
        return None

    def _connect(self) -> None:
        control, roster, me = self.control, self.roster, self.participant
        assert (
            control is not None
            and roster is not None
            and me is not None
            and self.timeout is not None
        )
        self._device = cuda_device(me)
        torch.cuda.set_device(self._device)
        links = link_order(roster, me.name)
        peers = [roster.all[peer].name for peer, _, _ in links]
        # the channels of each link, from both ends' budgets: each end's share of its own
        # (per its links), the smaller of the two, so that both ends ask NCCL alike
        budget = env_int("WEIGHTBUS_NCCL_CHANNELS", CHANNELS)
        if budget < 0:
            raise ValueError(
                f"$WEIGHTBUS_NCCL_CHANNELS={budget}: channels a participant's links share "
                f"(default {CHANNELS}), or 0 for NCCL's own choice"
            )
        at_once = env_int("WEIGHTBUS_NCCL_CONNECT_AT_ONCE", connect_at_once(roster, me.name))
        if at_once < 1:
            raise ValueError(
                f"$WEIGHTBUS_NCCL_CONNECT_AT_ONCE={at_once}: links whose communicators this "
                f"participant makes at once (default {CONNECT_AT_ONCE} over the participants "
                "on its GPU; 1: one after another)"
            )
        config = getattr(dist.ProcessGroupNCCL.Options(), "config", None)
        if budget and not hasattr(config, "max_ctas"):
            logger.info("weightbus nccl: this PyTorch cannot cap NCCL's channels: NCCL's choice")
            budget = 0
        budgets = {roster.global_rank(me.name): budget}
        for name, said in self._exchange("nccl channels", {"channels": budget}, peers).items():
            budgets[roster.global_rank(name)] = said["channels"]
        channels = link_channels(roster, budgets)
        store = control.substore("nccl")
        # every link's group (creating one is local: its communicator comes with its first
        # operation), the writer rank 0, under the link's own prefix of one store, each on a
        # connection of its own: a store client serves one request at a time, so one link's
        # wait for its peer's key while communicators are made at once would hold back the
        # others' (and, where both ends wait, as Gloo's rendezvous does, deadlock them)
        for peer, prefix, rank in links:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            if prefix in channels:
                options.config.max_ctas = channels[prefix]
            self._links[peer] = dist.ProcessGroupNCCL(
                dist.PrefixStore(prefix, _own_connection(store)), rank, 2, options
            )
        self._poller = EventPoller(self)
        # ProcessGroupNCCL's groups (no argument in PyTorch 2.11); an empty group posts nothing
        if self._links:
            probe = next(iter(self._links.values()))
            try:
                probe._start_coalescing()
                probe._end_coalescing()
                self._coalesce = True
            except Exception as e:  # another signature, or none: post one at a time
                logger.info(
                    "weightbus nccl: no NCCL groups in this PyTorch (%s): posting singly", e
                )
        # both ends of a link must post alike: a group (even of one) and an operation alone
        # go through different communicators, and would wait for each other beyond any
        # timeout. A link groups where both ends' PyTorch can
        said = self._exchange("nccl posting", {"groups": self._coalesce}, peers)
        self._grouped = {
            roster.global_rank(name): self._coalesce and theirs["groups"]
            for name, theirs in said.items()
        }
        # $WEIGHTBUS_NCCL_GROUPS=0: one operation a group (which group a link's operations
        # share is agreed per link at connect: Transport.groups_with)
        self._group = bool(env_int("WEIGHTBUS_NCCL_GROUPS", 1))
        t0 = time.monotonic()
        self._make_links([peer for peer, _, _ in links], at_once)
        logger.debug(
            "weightbus nccl: %s connected (rank %d, %d links, channels %s, grouped %s) in %.2f s",
            me.name,
            roster.global_rank(me.name),
            len(self._links),
            [channels.get(prefix, "nccl") for _, prefix, _ in links],
            sorted(p for p, g in self._grouped.items() if g),
            time.monotonic() - t0,
        )

    def _make_links(self, peers: list[int], at_once: int) -> None:
        """Make every link's communicator, by a 1-byte operation posted as a sync posts them,
        up to ``at_once`` links at a time in link order (:func:`make_in_order`); raise, naming
        the peers, when none is made for the transport's timeout."""
        assert self.control is not None and self.roster is not None and self.timeout is not None
        me = self.participant
        assert me is not None
        device = self._device
        op = "send" if me.role == "writer" else "recv"
        ones = torch.zeros(len(peers), dtype=torch.uint8, device=device)

        def make(i: int) -> None:
            torch.cuda.set_device(device)  # (the current device is per thread)
            self._post_on(peers[i], op, [ones[i : i + 1]]).wait()

        try:
            make_in_order(
                [lambda i=i: make(i) for i in range(len(peers))],
                at_once,
                stall_s=self.timeout.total_seconds(),
                poll=self.control.raise_if_failed,
            )
        except TimeoutError as e:
            names = [self.roster.all[peers[i]].name for i in e.args[1]]
            raise TimeoutError(
                f"nccl: {me.name} made none of its links to {names} in "
                f"{self.timeout.total_seconds():.0f} s (made {len(peers) - len(names)} of "
                f"{len(peers)}): NCCL makes a link when both ends connect; are those "
                "participants connecting, on GPUs NCCL can reach? If they are slow to start, "
                "raise this transport's timeout (a Writer's or Reader's is the larger of "
                "SyncConfig.sync_timeout and step_timeout)"
            ) from None
        torch.cuda.synchronize(device)

    def _exchange(self, topic: str, mine: dict, peers: list[str]) -> dict[str, dict]:
        """Post ``mine`` under ``topic`` and return what each of ``peers`` (this participant's
        links' other ends) posted there, each checked against ``mine``'s fields and kinds."""
        assert self.control is not None
        self.control.post(topic, mine)
        if not peers:
            return {}
        schema = {k: type(v) for k, v in mine.items()}
        said = self.control.gather(topic, names=peers, timeout=self.timeout, schema=schema)
        return {name: value for name, value in said.items() if isinstance(value, dict)}

    def _post_on(self, peer: int, op: str, flats: list[torch.Tensor]) -> Any:
        """Post ``flats`` to ``peer`` (global rank) over its link's ProcessGroupNCCL, on the
        current stream, as one NCCL group where both ends' PyTorch have them (even one
        operation: a link's operations all go through one communicator so), else the one
        operation alone; returns the work."""
        link = self._links[peer]
        post = link.send if op == "send" else link.recv
        other = 1 - link.rank()
        if not self._grouped.get(peer, False):
            assert len(flats) == 1
            return post(flats, other, 0)
        link._start_coalescing()
        try:
            for flat in flats:
                post([flat], other, 0)
        finally:
            work = link._end_coalescing()
        return work

    def _check_buffer(self, buf: torch.Tensor, what: str) -> None:
        # a local mistake, raised before anything is posted (not reported as the peer's failure)
        super()._check_buffer(buf, what)
        if self._device is not None and buf.device != self._device:
            raise ValueError(
                f"nccl: {what} is on {buf.device}, this participant uses {self._device}: keep the "
                "bound tensors and staging on the participant's device"
            )

    def _issue_many(self, handles: list[Handle], bufs: list[torch.Tensor | None]) -> None:
        """Post operations to one peer on its side stream (:meth:`_side`), over the link's
        group (:meth:`_post_on`): more than one as one NCCL group (a launch for all; on 2 x
        H200 Llama-3-8B's 291 tensors, in groups of 8 to 32, took 44.9 ms against 47.6 for a
        send each, and 3-5 ms of host time against 26), which completes at once, with one
        event. With ``$WEIGHTBUS_NCCL_GROUPS=0``, or where either end's PyTorch has no
        groups, each through :meth:`_send` / :meth:`_recv`."""
        assert self.roster is not None and self._poller is not None
        if len(handles) > 1 and not self._groups(self.roster.global_rank(handles[0].peer.name)):
            super()._issue_many(handles, bufs)  # each through _send / _recv
            return
        flats = [buf.reshape(-1) for buf in bufs if buf is not None]
        peer, side = self._side(handles[0])
        with torch.cuda.stream(side):
            work = self._post_on(peer, handles[0].op, flats)
            work.wait()
            event = torch.cuda.Event()
            event.record(side)
        for handle, flat in zip(handles, flats, strict=True):
            handle.native = (work, event, flat)
        self._poller.add_many(handles)

    def groups_with(self, peer: Participant | str | int) -> bool:
        assert self.roster is not None
        return self._groups(self.roster.global_rank(self._peer(peer).name))

    def _groups(self, peer: int) -> bool:
        """Whether operations to ``peer`` (global rank) share NCCL groups."""
        return self._group and self._grouped.get(peer, False)

    def _side(self, handle: Handle) -> tuple[int, torch.cuda.Stream]:
        """``handle``'s peer (global rank) and the side stream its operations go through,
        made to wait for the caller's work so far. ProcessGroupNCCL makes its stream wait for
        the *current* stream at every operation; were that the caller's stream, made to wait
        for the previous operation, every link would queue behind every other. The side stream
        waits for the caller's work so far (the pack into a buffer, or the unpack that last
        used it), then carries the operation and its completion event."""
        assert self.roster is not None
        peer = self.roster.global_rank(handle.peer.name)
        if peer not in self._links:
            me = self.participant
            assert me is not None
            why = (
                f"are both on GPU {handle.peer.gpu or handle.peer.device} of "
                f"{handle.peer.host}: use CUDA IPC for colocated participants"
                if handle.peer.role != me.role
                else "are not a writer and a reader: nccl links each writer with each reader"
            )
            raise ValueError(f"nccl: {handle.peer.name!r} and {me.name!r} have no link: they {why}")
        side = self._streams.get(peer)
        if side is None:
            side = self._streams[peer] = torch.cuda.Stream(self._device)
        side.wait_stream(torch.cuda.current_stream(self._device))
        return peer, side

    def done_event(self, handle: Handle) -> torch.cuda.Event | None:
        native = handle.native  # read once: the poller drops it when the operation is done
        return None if native is None else native[1]

    def _settle(self, handle: Handle) -> None:
        if self._poller is not None:
            self._poller.settle(handle)

    def _send(self, handle: Handle, buf: torch.Tensor) -> None:
        self._issue_many([handle], [buf])

    def _recv(self, handle: Handle, buf: torch.Tensor) -> None:
        self._issue_many([handle], [buf])

    def _stop(self) -> None:
        if self._poller is not None:
            self._poller.close()
            self._poller = None

    def _close(self) -> None:
        self._stop()
        for link in self._links.values():
            try:
                link.shutdown()
            except Exception as e:  # older builds
                logger.debug("weightbus nccl: shutdown: %s", e)
        self._links = {}

    def _abort(self, reason: str) -> None:
        """Abort every link's communicator, all at once, on a thread each, waiting
        :data:`ABORT_WAIT_S` at most: one still aborting then goes on in the background, and
        the error that made this abort is raised now. One after another did not do: on 4 x
        H100 a writer whose reader died stayed inside its first link's abort (to the live
        reader) for the 20 s the test gave it, the dead reader's link not yet aborted (the
        likely cause: tearing down one communicator waits for the GPU, where the other
        link's kernel spins on the dead peer until its own abort); all at once, every abort
        took under a second (the peer-death and fault tests over NCCL, 8 runs)."""
        self._stop()
        links, self._links = list(self._links.items()), {}
        if not links:
            return
        logger.warning("weightbus nccl: aborting %d links: %s", len(links), reason)

        def abort(peer: int, link: Any) -> None:
            t0 = time.monotonic()
            try:
                link.abort()
            except Exception as e:
                logger.debug("weightbus nccl: abort: %s", e)
            took = time.monotonic() - t0
            if took > 1.0:
                logger.warning(
                    "weightbus nccl: the link to rank %d took %.1f s to abort", peer, took
                )

        threads = [
            threading.Thread(
                target=abort, args=kv, name=f"weightbus-nccl-abort-{kv[0]}", daemon=True
            )
            for kv in links
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + ABORT_WAIT_S
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        left = [t.name for t in threads if t.is_alive()]
        if left:
            logger.warning(
                "weightbus nccl: still aborting after %.0f s, going on in the background: %s",
                ABORT_WAIT_S,
                left,
            )
