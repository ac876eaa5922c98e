"""A built-in, deterministic synthetic benchmark: a topic graph and conversations over it.

The world: ``topics`` topics, each a chain of ``passages_per_topic`` passages (one
per *facet*: "history", "economy", ...; a topic's facets are shuffled along its
chain). Adjacent passages of a topic are joined by unit edges; ``cross_links`` unit
edges join random passages of different topics.

A conversation starts on a random passage (turn 0, standalone) and then, at each
turn, either *jumps* (probability ``jump_probability``: a random passage of another
topic; ``topic_switch=True``) or *drills* (moves to a chain neighbour of the current
passage, i.e. graph distance 1).

Retrieval is simulated, so no embedder is needed: every turn has ``candidates``
scored candidates (the gold passage is always among them), sorted by raw score, with
raw score = mean + N(0, 1) noise:

- standalone turns (turn 0 and jumps) name topic and facet ("What about the economy
  of Topic 007?"): the gold's mean is ``standalone_signal`` (well separated); the
  distractors are other facets of the same topic and the same facet of other topics
  (mean ``distractor_signal``). Low emission entropy; pointwise top-1 is mostly right.
- follow-up turns (drills) are underspecified ("And what about its economy?") unless
  specific (probability ``specific_followup_probability``: the query names the
  topic and the turn is scored like a standalone one). On an underspecified turn
  the gold and the same facet of other topics match alike; the gold's mean is only
  ``followup_signal`` above them. With probability ``revisit_probability`` the
  previous turn's gold (graph distance 1 from the gold, 0 from the previous turn)
  is a candidate with mean ``revisit_signal``, and with probability
  ``sibling_probability`` the previous gold's other chain neighbour (distance 2 from
  the gold) with mean 0. High emission entropy; pointwise top-1 is often wrong,
  while the gold is the only candidate one step from the previous gold.

So map-matching has a lot to gain on follow-ups (the graph neighbourhood of the
previous turn finds the gold) and little on standalone turns (their gold wins on
its own; too heavy a transition weight starts to pull them towards the previous
topic's neighbourhood, which is the trade-off a beta sweep shows).

Everything is drawn from one seeded ``torch.Generator`` on the CPU with vectorized
tensor operations (no per-conversation Python loop): 10k conversations x 8 turns x
16 candidates take about a second on one core, most of it building the
:class:`~mapmatched_torch.eval.data.Dataset`'s Python objects, which
``with_conversations=False`` skips (a million conversations: ~15 s of one core).

Example:
    >>> bench = make_synthetic(n_conversations=3, turns=4, candidates=8, seed=1)
    >>> bench.candidate_index.shape, bench.dataset.num_turns
    (torch.Size([3, 4, 8]), 12)
    >>> [c.chunk_id for c in bench.candidates[0][0]][:2] == [bench.dataset.passages[int(i)].id for i in bench.candidate_index[0, 0, :2]]
    True
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Tuple

import torch

from ..core.errors import MapMatchedValueError
from ..core.models import ScoredCandidate
from ..kernels.ranking_metrics import SparseQrels
from .data import Conversation, Dataset, Passage, Turn

__all__ = [
    "FACETS",
    "MOVE_NAMES",
    "START",
    "DRILL",
    "JUMP",
    "SyntheticBenchmark",
    "make_synthetic",
]

#: Facet words; a topic with more passages than facets gets ``aspect<i>`` for the rest.
FACETS = (
    "history", "geography", "economy", "culture", "politics", "climate", "population", "education",
    "transport", "sport", "cuisine", "architecture", "religion", "language", "music", "literature",
    "science", "health", "media", "tourism", "military", "law", "agriculture", "energy",
)

#: Move codes of :attr:`SyntheticBenchmark.moves`.
START, DRILL, JUMP = 0, 1, 2
#: Names of the move codes, by code.
MOVE_NAMES = ("start", "drill", "jump")


@dataclass(frozen=True, eq=False)
class SyntheticBenchmark:
    """A synthetic dataset with precomputed retrieval candidates and its corpus graph.

    B = conversations, T = turns, M = candidates per turn, P = passages, E = edges.

    Attributes:
        dataset: the conversations (one gold passage per turn, grade 1.0) and passages;
            without conversations when built with ``with_conversations=False``.
        candidate_index: (B, T, M) long, candidate passage indices (into
            ``dataset.passages``) in provider order (decreasing raw score).
        candidate_scores: (B, T, M) float64 raw scores, decreasing along M.
        gold_index: (B, T) long, the gold passage of each turn.
        moves: (B, T) long, :data:`START` / :data:`DRILL` / :data:`JUMP` per turn.
        ambiguous: (B, T) bool, the underspecified follow-ups (drills whose query does
            not name the topic): the generator's ground truth for the follow-up slice.
        edges: the undirected graph edges ``(source_id, target_id, distance)``, each
            once (``InMemoryCorpusGraph(bench.edges)`` builds the reference graph).
        config: the generator's arguments (for reports).
    """

    dataset: Dataset
    candidate_index: torch.Tensor
    candidate_scores: torch.Tensor
    gold_index: torch.Tensor
    moves: torch.Tensor
    ambiguous: torch.Tensor
    edges: Tuple[Tuple[str, str, float], ...]
    config: Dict[str, Any] = field(default_factory=dict)

    @cached_property
    def candidates(self) -> List[List[List[ScoredCandidate]]]:
        """``[conversation][turn]`` -> the turn's :class:`ScoredCandidate` list (built on first use)."""
        ids = self.dataset.passage_ids
        index = self.candidate_index.tolist()
        scores = self.candidate_scores.tolist()
        return [
            [[ScoredCandidate(ids[i], s) for i, s in zip(turn_ids, turn_scores)] for turn_ids, turn_scores in zip(conv_ids, conv_scores)]
            for conv_ids, conv_scores in zip(index, scores)
        ]

    @property
    def shape(self) -> Tuple[int, int, int]:
        """(B, T, M)."""
        return tuple(self.candidate_index.shape)  # type: ignore[return-value]

    @property
    def topic_switch(self) -> torch.Tensor:
        """(B, T) bool, the jump turns (the ``topic_switch`` label)."""
        return self.moves == JUMP

    def qrels(self) -> SparseQrels:
        """The flat (B*T, 1) qrels: each turn's gold passage with grade 1.0 (no Python loop)."""
        ids = self.gold_index.reshape(-1, 1)
        return SparseQrels(ids.clone(), torch.ones(ids.shape, dtype=torch.float64))

    def conversation_index(self) -> torch.Tensor:
        """(B*T,) long, the conversation of each flat turn (for :mod:`~mapmatched_torch.eval.bootstrap`)."""
        conversations, turns = self.gold_index.shape
        return torch.arange(conversations).repeat_interleave(turns)

    def edge_tensors(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """The graph as ``(edge_index (2, 2E) long, edge_weight (2E,) float64)`` with both directions.

        Node indices are positions in ``dataset.passages`` (PyG's undirected convention).
        """
        index = self.dataset.passage_index
        pairs = [(index[a], index[b]) for a, b, _ in self.edges]
        weights = [w for _, _, w in self.edges]
        forward = torch.tensor(pairs, dtype=torch.long).reshape(-1, 2).t()
        edge_index = torch.cat([forward, forward.flip(0)], dim=1)
        edge_weight = torch.tensor(weights + weights, dtype=torch.float64)
        return edge_index, edge_weight



def _check_int(value: Any, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise MapMatchedValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _check_float(value: Any, name: str, low: float = float("-inf"), high: float = float("inf")) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= float(value) <= high:
        raise MapMatchedValueError(f"{name} must be a number in [{low}, {high}], got {value!r}")
    return float(value)


def _distinct(generator: torch.Generator, shape: Tuple[int, ...], count: int, modulus: int) -> torch.Tensor:
    """(*shape, count) long: per row, ``count`` distinct values of ``range(modulus)``.

    Each row is a random arithmetic progression ``(a * j + c) mod modulus`` with ``a``
    a random unit modulo ``modulus`` (so the values are distinct) and ``c`` uniform:
    O(rows * count) work, no sort (this is what keeps a million conversations cheap).
    """
    units = torch.tensor([a for a in range(1, max(modulus, 2)) if math.gcd(a, modulus) == 1] or [1])
    step = units[torch.randint(0, units.numel(), shape, generator=generator)]
    start = torch.randint(0, modulus, shape, generator=generator)
    return (step.unsqueeze(-1) * torch.arange(count) + start.unsqueeze(-1)) % modulus


def _walk(generator: torch.Generator, conversations: int, turns: int, topics: int, length: int,
          jump_probability: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(topic, position, move), each (B, T) long: the gold trajectory of every conversation."""
    topic = torch.empty((conversations, turns), dtype=torch.long)
    position = torch.empty((conversations, turns), dtype=torch.long)
    move = torch.full((conversations, turns), DRILL, dtype=torch.long)
    topic[:, 0] = torch.randint(0, topics, (conversations,), generator=generator)
    position[:, 0] = torch.randint(0, length, (conversations,), generator=generator)
    move[:, 0] = START
    for t in range(1, turns):
        jump = torch.rand(conversations, generator=generator) < jump_probability
        other = (topic[:, t - 1] + 1 + torch.randint(0, topics - 1, (conversations,), generator=generator)) % topics
        fresh = torch.randint(0, length, (conversations,), generator=generator)
        step = torch.randint(0, 2, (conversations,), generator=generator) * 2 - 1
        drilled = position[:, t - 1] + step
        drilled = torch.where((drilled < 0) | (drilled >= length), position[:, t - 1] - step, drilled)
        topic[:, t] = torch.where(jump, other, topic[:, t - 1])
        position[:, t] = torch.where(jump, fresh, drilled)
        move[:, t] = torch.where(jump, torch.full_like(step, JUMP), torch.full_like(step, DRILL))
    return topic, position, move


def make_synthetic(
    n_conversations: int = 200,
    turns: int = 8,
    candidates: int = 16,
    seed: int = 0,
    *,
    topics: int = 64,
    passages_per_topic: int = 24,
    jump_probability: float = 0.25,
    specific_followup_probability: float = 1.0 / 3.0,
    standalone_signal: float = 5.0,
    followup_signal: float = 0.75,
    distractor_signal: float = 0.5,
    revisit_probability: float = 0.5,
    revisit_signal: float = 0.25,
    sibling_probability: float = 0.5,
    cross_links: int = 32,
    name: str = "synthetic",
    with_conversations: bool = True,
) -> SyntheticBenchmark:
    """Generate the synthetic benchmark (see the module docstring for the model).

    Args:
        n_conversations: B >= 1.
        turns: T >= 1 turns per conversation.
        candidates: M >= 3 candidates per turn (at most ``topics``).
        seed: the generator seed; the same arguments give identical output.
        topics: number of topics (>= 2 and >= ``candidates``).
        passages_per_topic: chain length (>= 3).
        jump_probability: chance that a later turn switches topic.
        specific_followup_probability: chance that a drill's query is specific
            (names the topic): scored like a standalone turn.
        standalone_signal: gold's mean score on standalone turns.
        followup_signal: gold's mean score on follow-up turns (other candidates: 0).
        distractor_signal: distractors' mean score on standalone turns.
        revisit_probability: chance that a follow-up's candidates include the
            previous gold.
        revisit_signal: the previous gold's mean score when it is a candidate.
        sibling_probability: chance that a follow-up's candidates include the
            previous gold's other chain neighbour (mean 0).
        cross_links: number of extra unit edges between random passages of
            different topics.
        name: the dataset name.
        with_conversations: build the :class:`~mapmatched_torch.eval.data.Conversation`
            objects (default). False skips that Python work (for millions of
            conversations): the dataset then holds only the passages, and the
            tensors, :meth:`SyntheticBenchmark.qrels` and
            :meth:`SyntheticBenchmark.conversation_index` carry everything.

    Returns:
        A :class:`SyntheticBenchmark`.

    Raises:
        MapMatchedValueError: an argument out of range (naming it).
    """
    config = _validated(dict(locals()))
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    facet_of, position_of = _facets(generator, config)
    drawn = _draw(generator, facet_of, position_of, config["n_conversations"], config)
    link_source, link_target = _links(generator, config)
    dataset, edges = _build_dataset(
        name, facet_of, drawn.topic, drawn.facet, drawn.moves, drawn.ambiguous, drawn.gold, link_source, link_target,
        with_conversations,
    )
    return SyntheticBenchmark(dataset, drawn.index, drawn.scores, drawn.gold, drawn.moves, drawn.ambiguous, edges,
                              config)


def _validated(arguments: Dict[str, Any]) -> Dict[str, Any]:
    """The checked arguments of :func:`make_synthetic` (its ``config``), raising on a bad one."""
    conversations = _check_int(arguments["n_conversations"], "n_conversations", 1)
    turns = _check_int(arguments["turns"], "turns", 1)
    width = _check_int(arguments["candidates"], "candidates", 3)
    topics = _check_int(arguments["topics"], "topics", 2)
    length = _check_int(arguments["passages_per_topic"], "passages_per_topic", 3)
    cross_links = _check_int(arguments["cross_links"], "cross_links", 0)
    seed = _check_int(arguments["seed"], "seed", -(2 ** 63))
    if width > topics:
        raise MapMatchedValueError(f"candidates ({width}) must not exceed topics ({topics})")
    unit = {name: _check_float(arguments[name], name, 0.0, 1.0) for name in (
        "jump_probability", "specific_followup_probability", "revisit_probability", "sibling_probability")}
    signals = {name: _check_float(arguments[name], name) for name in (
        "standalone_signal", "followup_signal", "distractor_signal", "revisit_signal")}
    return {
        "n_conversations": conversations, "turns": turns, "candidates": width, "seed": seed, "topics": topics,
        "passages_per_topic": length, "jump_probability": unit["jump_probability"],
        "specific_followup_probability": unit["specific_followup_probability"],
        "standalone_signal": signals["standalone_signal"], "followup_signal": signals["followup_signal"],
        "distractor_signal": signals["distractor_signal"], "revisit_probability": unit["revisit_probability"],
        "revisit_signal": signals["revisit_signal"], "sibling_probability": unit["sibling_probability"],
        "cross_links": cross_links, "name": arguments["name"],
        "with_conversations": bool(arguments["with_conversations"]),
    }


def _facets(generator: torch.Generator, config: Dict[str, Any]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(facet_of, position_of), each (topics, length): the facets along each topic's chain and the inverse."""
    # shape: (topics, length): facet_of[topic, position]; position_of is its inverse
    facet_of = torch.argsort(torch.rand((config["topics"], config["passages_per_topic"]), generator=generator), dim=1)
    return facet_of, torch.argsort(facet_of, dim=1)


def _links(generator: torch.Generator, config: Dict[str, Any]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(source, target), each (cross_links,) long: the cross-topic links' passages (self-links dropped later)."""
    topics, length, cross_links = config["topics"], config["passages_per_topic"], config["cross_links"]
    link_source = torch.randint(0, topics * length, (cross_links,), generator=generator)
    link_topic = (link_source // length + torch.randint(1, topics, (cross_links,), generator=generator)) % topics
    link_target = link_topic * length + torch.randint(0, length, (cross_links,), generator=generator)
    return link_source, link_target


class _Drawn(NamedTuple):
    """The conversations' tensors: index and scores (B, T, M); gold, moves, ambiguous, topic, facet (B, T)."""

    index: torch.Tensor
    scores: torch.Tensor
    gold: torch.Tensor
    moves: torch.Tensor
    ambiguous: torch.Tensor
    topic: torch.Tensor
    facet: torch.Tensor


def _draw(generator: torch.Generator, facet_of: torch.Tensor, position_of: torch.Tensor, conversations: int,
          config: Dict[str, Any]) -> _Drawn:
    """Draw ``conversations`` conversations over the world (see the module docstring), vectorized."""
    turns, width, topics = config["turns"], config["candidates"], config["topics"]
    length = config["passages_per_topic"]

    # --- gold trajectories
    topic, position, moves = _walk(generator, conversations, turns, topics, length, config["jump_probability"])
    # shape: (B, T)
    gold = topic * length + position
    facet = facet_of[topic, position]
    specific = torch.rand((conversations, turns), generator=generator) < config["specific_followup_probability"]
    ambiguous = (moves == DRILL) & ~specific  # the underspecified follow-ups
    previous_gold = torch.cat([gold[:, :1], gold[:, :-1]], dim=1)
    previous_position = torch.cat([position[:, :1], position[:, :-1]], dim=1)

    # --- distractor pools
    # same facet, distinct other topics: shape (B, T, M - 1)
    other_topics = (topic.unsqueeze(2) + 1 + _distinct(generator, gold.shape, width - 1, topics - 1)) % topics
    same_facet = other_topics * length + position_of[other_topics, facet.unsqueeze(2).expand_as(other_topics)]
    # same topic, distinct other positions: shape (B, T, S)
    same_count = min((width - 1) // 3, length - 1)
    same_topic = topic.unsqueeze(2) * length + (
        position.unsqueeze(2) + 1 + _distinct(generator, gold.shape, same_count, length - 1)
    ) % length

    # --- assemble: slot 0 gold, then distractors; shape (B, T, M)
    index = torch.cat([gold.unsqueeze(2), same_facet], dim=2)
    means = torch.zeros((conversations, turns, width), dtype=torch.float64)
    means[:, :, 0] = torch.where(ambiguous, config["followup_signal"], config["standalone_signal"])
    means[:, :, 1:] = torch.where(ambiguous, 0.0, config["distractor_signal"]).unsqueeze(2)
    standalone = ~ambiguous  # turn 0, jumps and specific drills
    # standalone turns: slots 1..S are same-topic passages
    index[:, :, 1:1 + same_count] = torch.where(
        standalone.unsqueeze(2), same_topic, index[:, :, 1:1 + same_count]
    )
    # follow-ups: slot 1 may be the previous gold, slot 2 the previous gold's other neighbour
    revisit = ambiguous & (torch.rand((conversations, turns), generator=generator) < config["revisit_probability"])
    index[:, :, 1] = torch.where(revisit, previous_gold, index[:, :, 1])
    means[:, :, 1] = torch.where(revisit, config["revisit_signal"], means[:, :, 1])
    sibling_position = 2 * previous_position - position
    sibling = ambiguous & (torch.rand((conversations, turns), generator=generator) < config["sibling_probability"])
    sibling &= (sibling_position >= 0) & (sibling_position < length)
    index[:, :, 2] = torch.where(sibling, topic * length + sibling_position.clamp(0, length - 1), index[:, :, 2])
    means[:, :, 2] = torch.where(sibling, 0.0, means[:, :, 2])

    scores = means + torch.randn((conversations, turns, width), generator=generator, dtype=torch.float64)
    # provider order: decreasing score (stable: equal scores keep slot order)
    scores, order = torch.sort(scores, dim=2, descending=True, stable=True)
    index = torch.gather(index, 2, order)
    return _Drawn(index, scores, gold, moves, ambiguous, topic, facet)


def _facet_word(facet: int) -> str:
    return FACETS[facet] if facet < len(FACETS) else f"aspect{facet}"


def _build_dataset(name: str, facet_of: torch.Tensor, topic: torch.Tensor, facet: torch.Tensor, moves: torch.Tensor,
                   ambiguous: torch.Tensor, gold: torch.Tensor, link_source: torch.Tensor, link_target: torch.Tensor,
                   with_conversations: bool = True) -> Tuple[Dataset, Tuple[Tuple[str, str, float], ...]]:
    """The Dataset objects and the edge list (Python work, kept out of the tensor code)."""
    topics, length = facet_of.shape
    facet_rows = facet_of.tolist()
    ids: List[str] = []
    passages: List[Passage] = []
    for t in range(topics):
        title = f"Topic {t:03d}"
        for p in range(length):
            word = _facet_word(facet_rows[t][p])
            passage_id = f"topic{t:03d}:{p}"
            ids.append(passage_id)
            passages.append(Passage(
                passage_id, f"{title}, {word}: passage {p} of {title}, about its {word}.",
                doc_id=f"topic{t:03d}", position=p, title=title, section_path=(title, word),
            ))
    edges: List[Tuple[str, str, float]] = []
    for t in range(topics):
        for p in range(length - 1):
            edges.append((ids[t * length + p], ids[t * length + p + 1], 1.0))
    seen = {(a, b) for a, b, _ in edges}
    for source, target in zip(link_source.tolist(), link_target.tolist()):
        pair = (ids[min(source, target)], ids[max(source, target)])
        if source != target and pair not in seen:
            seen.add(pair)
            edges.append((pair[0], pair[1], 1.0))

    conversations: List[Conversation] = []
    if not with_conversations:
        return Dataset(name, (), tuple(passages)), tuple(edges)
    width = len(str(max(gold.shape[0] - 1, 0)))
    for b, (topic_row, facet_row, move_row, ambiguous_row, gold_row) in enumerate(
        zip(topic.tolist(), facet.tolist(), moves.tolist(), ambiguous.tolist(), gold.tolist())
    ):
        turns = []
        for t, (topic_id, facet_id, move, vague, gold_id) in enumerate(
            zip(topic_row, facet_row, move_row, ambiguous_row, gold_row)
        ):
            word = _facet_word(facet_id)
            resolved = f"What about the {word} of Topic {topic_id:03d}?"
            query = f"And what about its {word}?" if vague else resolved
            turns.append(Turn(t, query, resolved, {ids[gold_id]: 1.0}, move == JUMP))
        conversations.append(Conversation(f"{name}-{b:0{width}d}", tuple(turns)))
    return Dataset(name, tuple(conversations), tuple(passages)), tuple(edges)


#: Conversations per block of a :class:`SyntheticStream`: the unit of its seeding.
STREAM_BLOCK = 1024


@dataclass(frozen=True, eq=False)
class SyntheticStream:
    """The synthetic benchmark generated on demand, block by block, in bounded memory.

    The world (passages, facets, graph edges) is drawn once from ``seed``; the
    conversations are drawn in blocks of :data:`STREAM_BLOCK` (``block_size``), block
    k from its own generator seeded by ``(seed, k)``. So conversation b is the same
    whatever range it is asked for in (:meth:`select` of any chunk size, any
    shard), and a run never holds more than the chunk it works on (plus one cached
    block). The model is :func:`make_synthetic`'s; the draws are not (its world
    also draws the cross links after the conversations, from one generator), so a
    stream and a :func:`make_synthetic` of the same seed are different samples.

    Build it with :func:`synthetic_stream`. B = ``n_conversations``.

    Attributes:
        dataset: the passages only (no conversation objects).
        edges: the undirected graph edges ``(source_id, target_id, distance)``.
        facet_of: (topics, length) long, the facet at each chain position.
        config: the generator's arguments (with ``block_size`` and ``stream``).
    """

    dataset: Dataset
    edges: Tuple[Tuple[str, str, float], ...]
    facet_of: torch.Tensor
    config: Dict[str, Any]
    _cache: Dict[int, "_Drawn"] = field(default_factory=dict, repr=False)

    @property
    def n_conversations(self) -> int:
        """B, the conversations of the stream."""
        return self.config["n_conversations"]

    @property
    def shape(self) -> Tuple[int, int, int]:
        """(B, T, M)."""
        return self.n_conversations, self.config["turns"], self.config["candidates"]

    def _block(self, block: int) -> "_Drawn":
        """Block ``block``'s conversations (the last one drawn is kept). Always a whole block, so a
        conversation does not depend on how many follow it (the last block is cut by :meth:`select`)."""
        if block not in self._cache:
            generator = torch.Generator(device="cpu")
            generator.manual_seed(_block_seed(self.config["seed"], block))
            drawn = _draw(generator, self.facet_of, torch.argsort(self.facet_of, dim=1), self.config["block_size"],
                          self.config)
            self._cache.clear()
            self._cache[block] = drawn
        return self._cache[block]

    def select(self, start: int, stop: int) -> SyntheticBenchmark:
        """Conversations ``[start, stop)`` as a :class:`SyntheticBenchmark` (without conversation objects).

        Raises:
            MapMatchedValueError: the range is empty or outside ``[0, B]``.
        """
        if not 0 <= start < stop <= self.n_conversations:
            raise MapMatchedValueError(f"select needs 0 <= start < stop <= {self.n_conversations}, "
                                       f"got start={start}, stop={stop}")
        size = self.config["block_size"]
        parts = []
        for block in range(start // size, (stop - 1) // size + 1):
            low, high = max(start - block * size, 0), min(stop - block * size, size)
            parts.append(_Drawn(*(tensor[low:high] for tensor in self._block(block))))
        drawn = _Drawn(*(torch.cat(tensors) for tensors in zip(*parts))) if len(parts) > 1 else parts[0]
        return SyntheticBenchmark(self.dataset, drawn.index, drawn.scores, drawn.gold, drawn.moves, drawn.ambiguous,
                                  self.edges, self.config)

    def chunks(self, size: int, start: int = 0, stop: Optional[int] = None) -> Iterator[SyntheticBenchmark]:
        """:meth:`select` of ``[start, stop)`` (default: everything) in chunks of ``size`` conversations."""
        size = _check_int(size, "size", 1)
        stop = self.n_conversations if stop is None else stop
        for low in range(start, stop, size):
            yield self.select(low, min(low + size, stop))

    def materialize(self) -> SyntheticBenchmark:
        """Every conversation at once (small streams, tests: equal to concatenating any chunks)."""
        return self.select(0, self.n_conversations)


def _block_seed(seed: int, block: int) -> int:
    """The seed of block ``block`` of a stream seeded by ``seed`` (a 64-bit mix of both)."""
    return (seed * 0x9E3779B97F4A7C15 + (block + 1) * 0xBF58476D1CE4E5B9) % (1 << 64)


def synthetic_stream(
    n_conversations: int = 200,
    turns: int = 8,
    candidates: int = 16,
    seed: int = 0,
    *,
    block_size: int = STREAM_BLOCK,
    **options: Any,
) -> SyntheticStream:
    """A :class:`SyntheticStream`: the synthetic benchmark drawn on demand, in blocks.

    Args:
        n_conversations, turns, candidates, seed: as in :func:`make_synthetic`.
        block_size: conversations per seeded block (the stream's content depends on
            it, not on the chunks it is read in).
        options: :func:`make_synthetic`'s keyword arguments (``topics``,
            ``jump_probability``, ...; ``with_conversations`` is always False).

    Raises:
        MapMatchedValueError: an argument out of range (naming it), or an unknown one.

    Example:
        >>> stream = synthetic_stream(10, 3, 4, seed=1, block_size=4, topics=6, passages_per_topic=4)
        >>> whole = stream.materialize().candidate_index
        >>> parts = torch.cat([bench.candidate_index for bench in stream.chunks(3)])
        >>> bool(torch.equal(whole, parts)), tuple(whole.shape)
        (True, (10, 3, 4))
    """
    import inspect

    defaults = {name: parameter.default for name, parameter in inspect.signature(make_synthetic).parameters.items()}
    unknown = sorted(set(options) - set(defaults) - {"with_conversations"})
    if unknown:
        raise MapMatchedValueError(f"unknown synthetic option(s) {unknown} (have: {', '.join(sorted(defaults))})")
    arguments = dict(defaults, **options, n_conversations=n_conversations, turns=turns, candidates=candidates,
                     seed=seed, with_conversations=False)
    config = dict(_validated(arguments), block_size=_check_int(block_size, "block_size", 1), stream=True)
    generator = torch.Generator(device="cpu")
    generator.manual_seed(config["seed"])
    facet_of, _ = _facets(generator, config)
    link_source, link_target = _links(generator, config)
    empty = torch.empty((0, config["turns"]), dtype=torch.long)
    dataset, edges = _build_dataset(config["name"], facet_of, empty, empty, empty, empty.bool(), empty, link_source,
                                    link_target, False)
    return SyntheticStream(dataset, edges, facet_of, config)
