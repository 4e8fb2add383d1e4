"""What the CUDA transports share: a participant's device, and completion through CUDA events."""

from __future__ import annotations

import threading
import time

import torch

from weightbus.spec import Participant
from weightbus.transports.base import Handle, Transport

__all__ = ["EventPoller", "cuda_device"]


def cuda_device(p: Participant) -> torch.device:
    d = torch.device(p.device)
    if d.type != "cuda":
        raise ValueError(
            f"participant {p.name!r} is on {p.device}; CUDA transports move CUDA memory"
        )
    return torch.device("cuda", d.index if d.index is not None else torch.cuda.current_device())


class EventPoller:
    """Marks handles done when the CUDA event recorded after their NCCL work completes."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.items: list[Handle] = []
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.stop = False
        self.thread = threading.Thread(
            target=self._run, name=f"weightbus-{transport.name}-poller", daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        """Stop the thread (bounded: it never blocks for long)."""
        self.stop = True
        self.wake.set()
        self.thread.join(2.0)

    def add(self, handle: Handle) -> None:
        with self.lock:
            self.items.append(handle)
        self.wake.set()

    def _run(self) -> None:
        while not self.stop:
            with self.lock:
                items = list(self.items)
            if not items:
                self.wake.wait(0.05)
                self.wake.clear()
                continue
            done = []
            try:
                for h in items:
                    native = h.native
                    if native is None or native[1].query():
                        done.append(h)
            except Exception as e:  # a sticky CUDA error: nothing pending can finish now
                with self.lock:
                    failed, self.items = self.items, []
                for h in failed:
                    self.transport._completed(h, e)
                return
            if done:
                gone = set(map(id, done))
                with self.lock:
                    self.items = [h for h in self.items if id(h) not in gone]
                for h in done:
                    self.transport._completed(h)
            else:
                time.sleep(50e-6)
