"""An optional decoder backend: composable-model-graph's trellis decoder.

:class:`CMGDecoder` is upstream ``mapmatched``'s ``CMGDecoder``: it hands a trellis to
``composable_model_graph.decode_path`` (or ``decode_path_fixed_lag``), reads back the
chosen state IDs and reports the path exactly as :class:`~mapmatched_torch.standalone.
decoder.StandaloneDecoder` does (one piece of code, :func:`~mapmatched_torch.core.
path_reports.report_path`, builds both reports, so on the same choice the two paths are
equal bit for bit).

composable-model-graph is not on PyPI and no extra of this package installs it; it is
imported when :meth:`CMGDecoder.decode` first runs, after the arguments are checked.
Without a compatible installation ``decode`` raises
:class:`~mapmatched_torch.core.errors.CMGBackendUnavailableError` (an ``ImportError``)
saying how to install it.

How the trellis is translated (composable-model-graph's API: ``CandidateState(id,
score, value=None)``; ``decode_path(steps, transition_cost=None,
transition_weight=1.0)``; ``decode_path_fixed_lag(steps, lag, transition_cost=None,
transition_weight=1.0)``; both return an object whose ``state_ids`` is a ``list`` of
``str``):

- each candidate becomes ``CandidateState(id=chunk_id, score=lambda * normalized_score)``
  (the emission weight folded into the state score);
- the transition cost of a pair is the unweighted ``graph.distance(previous.id,
  current.id)``; beta goes in as ``transition_weight``;
- the lag is passed positionally, the cost and weight by keyword.

Where this differs from upstream: with ``transition_weight == 0`` the reported
distances are 0.0 (as StandaloneDecoder reports them) rather than the graph's
distances, and the cumulative score is accumulated in the decoder's own order
(docs/spec.md section 5), so a CMG path equals the StandaloneDecoder path of the same
choice for every beta.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, List, Optional, Sequence

from ..core.checks import check_trellis
from ..core.errors import CMGBackendUnavailableError, MapMatchedBackendError
from ..core.models import DecodedPath, DecoderCandidate
from ..core.path_reports import report_path
from ..core.protocols import CorpusGraph
from ..core.settings import DecodeSettings

__all__ = ["CMGDecoder", "CMGBackendUnavailableError", "CMG_MODULES", "CMG_NAMES"]

#: Where composable-model-graph keeps its trellis decoder: the package root (newer
#: versions re-export it), else its ``estimation`` subpackage (older ones).
CMG_MODULES = ("composable_model_graph", "composable_model_graph.estimation")

#: The names :class:`CMGDecoder` needs from that module.
CMG_NAMES = ("CandidateState", "decode_path", "decode_path_fixed_lag")


def _load_backend() -> ModuleType:
    """The first module of :data:`CMG_MODULES` that imports and has every name of
    :data:`CMG_NAMES`; else :class:`CMGBackendUnavailableError`, chaining the root
    package's ImportError (an installation that lacks a name counts as incompatible)."""
    cause: Optional[BaseException] = None
    for name in CMG_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as error:
            cause = cause or error
            continue
        missing = [attribute for attribute in CMG_NAMES if not hasattr(module, attribute)]
        if not missing:
            return module
        cause = cause or ImportError(f"{name} has no {', '.join(missing)}")
    raise CMGBackendUnavailableError() from cause


def _chosen_indices(state_ids: Any, turns: Sequence[Sequence[DecoderCandidate]]) -> List[int]:
    """The backend's ``state_ids`` as one candidate index per turn, or a
    :class:`MapMatchedBackendError` (a ValueError and a RuntimeError) with upstream's
    text first."""
    if not isinstance(state_ids, list) or not all(isinstance(state_id, str) for state_id in state_ids):
        raise MapMatchedBackendError(
            f"CMG decoder returned invalid state IDs: expected a list of chunk ID strings, got {state_ids!r}"
        )
    if len(state_ids) != len(turns):
        raise MapMatchedBackendError(
            f"CMG decoder returned a path with the wrong length: {len(state_ids)} state IDs for {len(turns)} turns"
        )
    chosen = []
    for turn_index, (state_id, turn) in enumerate(zip(state_ids, turns)):
        positions = {candidate.chunk_id: position for position, candidate in enumerate(turn)}
        if state_id not in positions:
            raise MapMatchedBackendError(
                f"CMG decoder returned an unknown state ID: {state_id!r} is not a candidate of turn {turn_index}"
            )
        chosen.append(positions[state_id])
    return chosen


class CMGDecoder:
    """The ``Decoder`` protocol on composable-model-graph's trellis decoder (see the
    module docstring for the translation and how to install the backend).

    Stateless, like :class:`~mapmatched_torch.standalone.decoder.StandaloneDecoder`. It
    has no ``decode_ranked`` (the backend returns no trajectory scores), so a session
    decoding with it reports ``candidate_ranking == ()``, as upstream's does.

    Example:
        >>> from mapmatched_torch import CMGBackendUnavailableError, CMGDecoder, DecoderCandidate, InMemoryCorpusGraph
        >>> trellis = [[DecoderCandidate("a", 1.0, 1.0)]]
        >>> try:
        ...     path = CMGDecoder().decode(trellis, graph=InMemoryCorpusGraph())
        ... except CMGBackendUnavailableError as error:  # composable-model-graph is not installed
        ...     path = None
        >>> path is None or path.chunk_ids == ("a",)
        True
    """

    def decode(
        self,
        trellis: Sequence[Sequence[DecoderCandidate]],
        graph: CorpusGraph,
        *,
        emission_weight: float = 1.0,
        transition_weight: float = 1.0,
        fixed_lag: Optional[int] = None,
    ) -> DecodedPath:
        """Decode the best path with composable-model-graph.

        Args:
            trellis: T >= 1 turns, each a non-empty sequence of :class:`DecoderCandidate`
                (unique chunk IDs within a turn), checked as StandaloneDecoder checks it.
            graph: gives ``distance(a, b)``, the transition cost the backend sees.
            emission_weight: lambda >= 0. transition_weight: beta >= 0.
            fixed_lag: None for full decoding (``decode_path``), or L >= 0
                (``decode_path_fixed_lag``).

        Returns:
            The :class:`DecodedPath` of the backend's choice, one step per turn, reported
            as StandaloneDecoder reports a path.

        Raises:
            ValueError: a bad trellis or option (before the backend is imported).
            CMGBackendUnavailableError: (an ImportError) no compatible
                composable-model-graph is installed.
            MapMatchedBackendError: (a ValueError and a RuntimeError) the backend's
                ``state_ids`` is not a list of strings, has the wrong length, or names a
                chunk that is not a candidate of its turn.
        """
        turns = check_trellis(trellis)
        settings = DecodeSettings(emission_weight, transition_weight, fixed_lag)
        lam, beta, lag = settings.emission_weight, settings.transition_weight, settings.fixed_lag
        backend = _load_backend()
        states = [
            [backend.CandidateState(id=candidate.chunk_id, score=lam * candidate.normalized_score) for candidate in turn]
            for turn in turns
        ]

        def transition_cost(previous: Any, current: Any, step_index: int) -> float:
            return graph.distance(previous.id, current.id)

        if lag is None:
            result = backend.decode_path(states, transition_cost=transition_cost, transition_weight=beta)
        else:
            result = backend.decode_path_fixed_lag(states, lag, transition_cost=transition_cost, transition_weight=beta)
        state_ids = getattr(result, "state_ids", None)
        chosen = _chosen_indices(state_ids, turns)
        return report_path(
            turns,
            chosen,
            lambda t: graph.distance(state_ids[t - 1], state_ids[t]),
            settings,
        )
