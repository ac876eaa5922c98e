"""Serving: many live conversations stepped in one batch.

- :mod:`.server`: ``MapMatchedServer`` (open, step, close, save and restore sessions);
- :mod:`.session_store`: every session in tensors, and the tensor step (``TensorStep``);
- :mod:`.codes`: chunk ID <-> int code; :mod:`.contexts`: neighbourhoods and contexts;
- :mod:`.step_results`: the results of a step, built when read.
"""

from .server import MapMatchedServer, SessionId
from .session_store import SessionStore, StepCode, TensorStep
from .step_results import NeighborhoodCache, ServedTurn, StepRecord, StepResults, StoredTurns

__all__ = [
    "MapMatchedServer", "SessionId", "StepResults", "ServedTurn", "StepRecord", "NeighborhoodCache", "StoredTurns",
    "SessionStore", "StepCode", "TensorStep",
]
