"""weightbus: move model weights from RL trainers to inference engines after every step."""

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

__version__ = "0.1.0"

__all__ = [
    "BoundLayout",
    "Box",
    "Layout",
    "LayoutBuilder",
    "LayoutError",
    "LocalTensor",
    "Participant",
    "Piece",
    "TensorSpec",
]
