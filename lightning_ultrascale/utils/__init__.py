"""Measurement utilities: bytes per collective (:mod:`.comm`) and model-state memory (:mod:`.memory`)."""

from lightning_ultrascale.utils.comm import CommRecord, CommTracer, wire_bytes
from lightning_ultrascale.utils.memory import (
    ModelStateBytes,
    format_bytes,
    model_state_bytes,
    playbook_model_state_bytes,
)

__all__ = [
    "CommRecord",
    "CommTracer",
    "ModelStateBytes",
    "format_bytes",
    "model_state_bytes",
    "playbook_model_state_bytes",
    "wire_bytes",
]
