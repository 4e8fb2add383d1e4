"""weightbus: move model weights from RL trainers to inference engines after every step.

Trainer side::

    writer = weightbus.Writer(bound_layout, weightbus.ControlConfig(num_writers=2, num_readers=2))
    writer.connect()
    writer.sync(step)

Inference side::

    reader = weightbus.Reader(bound_layout, weightbus.ControlConfig(num_writers=2, num_readers=2))
    reader.connect()
    reader.wait()
"""

from weightbus._session import SyncConfig, SyncResult
from weightbus.codecs import DeltaConfig, Fp8Config
from weightbus.control.store import ControlConfig
from weightbus.errors import PeerFailure, PlanMismatch, SyncTimeout, WeightbusError
from weightbus.plan import PlanOptions, TransferPlan, make_plan
from weightbus.reader import Reader
from weightbus.spec import (
    BoundLayout,
    Box,
    Layout,
    LayoutBuilder,
    LayoutError,
    LocalTensor,
    Participant,
    Piece,
    TensorSpec,
)
from weightbus.writer import Writer

__version__ = "0.1.0"

__all__ = [
    "BoundLayout",
    "Box",
    "ControlConfig",
    "DeltaConfig",
    "Fp8Config",
    "Layout",
    "LayoutBuilder",
    "LayoutError",
    "LocalTensor",
    "Participant",
    "PeerFailure",
    "Piece",
    "PlanMismatch",
    "PlanOptions",
    "Reader",
    "SyncConfig",
    "SyncResult",
    "SyncTimeout",
    "TensorSpec",
    "TransferPlan",
    "WeightbusError",
    "Writer",
    "make_plan",
]
