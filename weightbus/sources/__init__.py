"""Sources of weights other than a trainer's GPU tensors: checkpoints and host memory.

* :func:`open_checkpoint` / :class:`HostCheckpoint`: safetensors files and ``save_pretrained``
  directories (files in ``/dev/shm`` mapped and page-locked in place), or tensors given in
  memory, held in host memory, whole or one shard of them.
* :func:`load_into`: a checkpoint straight into live tensors of this process (an engine's
  parameters, any reader layout), through the plan.
* :class:`HostSource`: shards of a checkpoint served by writer processes to the readers of a
  job, staged to each source's GPU in pipelined chunks (the design is in
  :mod:`weightbus.sources.host`).
"""

from weightbus.sources.checkpoint import (
    HostCheckpoint,
    Part,
    checkpoint_files,
    load_into,
    open_checkpoint,
    read_header,
    split_rows,
)
from weightbus.sources.host import HostSource, SourceConfig, writer_rank

__all__ = [
    "HostCheckpoint",
    "HostSource",
    "Part",
    "SourceConfig",
    "checkpoint_files",
    "load_into",
    "open_checkpoint",
    "read_header",
    "split_rows",
    "writer_rank",
]
