"""One "host" of the two-namespace rdma test: a trainer process or an inference process.

    python -m tests.rdma_netns_worker writer 10.1.2.1:29731    (in the writer's namespace)
    python -m tests.rdma_netns_worker reader 10.1.2.1:29731    (in the reader's namespace)

The writer hosts the control store on its address and syncs SYNCS versions of a small float32
model; the reader holds it in bfloat16, poisons every tensor with NaN before each sync, and
checks every byte against the version it should hold. Both print one JSON line last.
"""

from __future__ import annotations

import json
import socket
import sys
import zlib
from datetime import timedelta

import torch
from torch import nn

SYNCS = 3


def _model(dtype: torch.dtype) -> nn.Module:
    # a few MB with tensors of several sizes: large ones travel in place, small ones staged
    model = nn.Sequential(nn.Linear(1024, 2048), nn.Linear(2048, 1024), nn.LayerNorm(1024))
    return model.to(dtype)


def _weights(name: str, shape: torch.Size, version: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) * 100 + version)
    return torch.randn(shape, generator=g)


def main(role: str, store: str) -> int:
    import weightbus
    import weightbus.transports  # noqa: F401  (registers rdma)
    from weightbus.engines import module

    host = f"{role}-host-{socket.gethostname()}"
    control = weightbus.ControlConfig(
        num_writers=1,
        num_readers=1,
        address=store,
        job="netns",
        timeout=timedelta(seconds=60),
        heartbeat_interval=timedelta(milliseconds=500),
        heartbeat_timeout=timedelta(seconds=10),
    )
    sync = weightbus.SyncConfig(
        cast={"float32": "bfloat16"},
        bucket_bytes=1 << 20,
        staging_buffers=2,
        direct_bytes=64 << 10,
        transport="rdma",
        sync_timeout=timedelta(seconds=60),
        connect_timeout=timedelta(seconds=60),
        step_timeout=timedelta(seconds=90),
    )
    report: dict = {"role": role, "host": host}
    if role == "writer":
        model = _model(torch.float32)
        w = weightbus.Writer(module.bind(model, "writer", 0, host=host), control, sync)
        w.connect()
        for v in range(1, SYNCS + 1):
            with torch.no_grad():
                for name, p in model.named_parameters():
                    p.copy_(_weights(name, p.shape, v))
            w.sync(v)
        report.update(transport=w.transport.name, syncs=SYNCS, bytes_per_sync=w.bytes_per_sync)
        w.close()
    else:
        model = _model(torch.bfloat16)
        r = weightbus.Reader(module.bind(model, "reader", 0, host=host), control, sync)
        r.connect()
        exact, poisoned = [], True
        for v in range(1, SYNCS + 1):
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(float("nan"))
                    poisoned &= bool(torch.isnan(p).all())
            result = r.wait()
            ok = result.version == v
            for name, p in model.named_parameters():
                want = _weights(name, p.shape, v).to(torch.bfloat16)
                ok &= torch.equal(p.detach().view(torch.int16), want.view(torch.int16))
            exact.append(bool(ok))
        report.update(
            transport=r.transport.name,
            syncs=SYNCS,
            bit_exact=exact,
            poisoned_nan=poisoned,
            bytes_per_sync=r.bytes_per_sync,
        )
        r.close()
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
