"""Serving: many live conversations stepped in one batch.

- :mod:`.server`: ``MapMatchedServer`` (open, step, close, save and restore sessions);
- :mod:`.step_results`: what a step keeps per session, and its lazily built results.
"""

from .server import MapMatchedServer, SessionId
from .step_results import NeighborhoodCache, ServedTurn, StepRecord, StepResults

__all__ = ["MapMatchedServer", "SessionId", "StepResults", "ServedTurn", "StepRecord", "NeighborhoodCache"]
