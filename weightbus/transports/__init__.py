"""Transports: gloo, nccl, cuda_ipc, local (built into :mod:`weightbus.transports.base`),
rdma; :mod:`weightbus.transports.links` chooses one per link."""

from weightbus.transports import base as _base

# imported on first use by name, like the built-in ones (its library, NIXL, is optional)
_base._BUILTIN.setdefault("rdma", "weightbus.transports.rdma:RdmaTransport")
