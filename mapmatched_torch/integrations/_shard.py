"""One serving shard without Ray or HTTP: requests, a durable ``MapMatchedServer``, metrics.

:class:`ShardCore` is what a Ray Serve shard replica holds
(:mod:`mapmatched_torch.integrations.ray_serve` wraps it): an embedder, a provider and
a :class:`~mapmatched_torch.serving.MapMatchedServer`, stepped once per batch of turn
requests, with a snapshot + write-ahead log in a directory so a restarted replica
loses no acknowledged turn. Everything here is plain Python over the server; a request
problem is a :class:`RequestError` carrying the HTTP-style status the ingress answers.

Durability (one directory per shard)::

    manifest.json            fingerprint of graph + settings, shard index and count
    snapshot-<g>.pt          MapMatchedServer.save after generation g-1's log (atomic)
    wal-<g>.jsonl            every open / close / accepted turn since snapshot g

A mutation is applied in memory, appended to the current log and fsynced, and only
then acknowledged. Every ``snapshot_every`` steps or ``snapshot_seconds`` seconds the
server is saved as snapshot g+1 (atomically), log g+1 starts, and generation g's files
are removed. A restart loads the newest snapshot and replays its log (a torn last line,
never acknowledged, is dropped), so a crash at any point loses nothing acknowledged and
applies nothing twice. A turn is logged as the candidates it was decoded with, so
replay needs no embedder and gives the same decode; only the previous query text that
contextual providers read is not restored by the log.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
import re
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from ..core.errors import MapMatchedValueError
from ..core.files import write_text_atomic
from ..serving import MapMatchedServer

__all__ = ["RequestError", "ShardCore", "ShardParts", "shard_of", "read_shard_sessions", "replay_sessions", "reshard",
           "render_metrics"]

#: Turn request keys: exactly one of the first three, and an optional trace flag.
TURN_KINDS = ("query", "vector", "candidates")


def shard_of(session_id: str, shards: int) -> int:
    """The shard of a session: blake2b (8 bytes, little-endian) of its UTF-8 ID modulo
    ``shards``: the same on every process, machine and Python version (unlike ``hash``)."""
    digest = hashlib.blake2b(session_id.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % shards


class RequestError(Exception):
    """A request refused with an HTTP-style ``status`` (4xx), a short ``kind`` (the
    metrics label) and a message naming the problem."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message

    def to_dict(self) -> Dict[str, Any]:
        return {"error": self.kind, "detail": self.message, "status": self.status}


class ShardParts(NamedTuple):
    """What a shard is built from (a factory returns one in each replica).

    Attributes:
        server: a fresh, empty :class:`~mapmatched_torch.serving.MapMatchedServer`.
        provider: with ``search(vectors (Q, D), limit)`` (e.g.
            :class:`~mapmatched_torch.providers.DenseProvider`), its ``dimension`` and
            ``chunk_ids``; None: only candidate turns.
        embedder: texts -> ``(Q, D)`` vectors: a callable, or an object with ``encode``;
            None: no query turns.
        fingerprint: names the graph, embedder and settings the state belongs to
            (default: the graph's nodes and the server's options).
    """

    server: MapMatchedServer
    provider: Any = None
    embedder: Any = None
    fingerprint: Optional[str] = None


def default_fingerprint(server: MapMatchedServer) -> str:
    """SHA-256 of the server's options and its graph's node IDs (when it lists them)."""
    settings = server.settings
    described = {
        "candidate_limit": server.candidate_limit, "emission_weight": settings.emission_weight,
        "transition_weight": settings.transition_weight, "fixed_lag": settings.fixed_lag,
        "score_normalization": settings.score_normalization, "context_radius": server.context_radius,
        "context_limit": server.context_limit, "graph": type(server.graph).__name__,
        "nodes": list(getattr(server.graph, "nodes", ()) or ()),
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=repr).encode()).hexdigest()


class TurnRequest(NamedTuple):
    kind: str  # one of TURN_KINDS
    value: Any  # query text, (D,) float64 tensor, or list of (chunk ID, score)
    trace: bool


def parse_turn(body: Any, *, max_candidates: int, dimension: Optional[int], known: Optional[frozenset]) -> TurnRequest:
    """A turn request body, checked (RequestError 400 / 413 / 422 naming the problem)."""
    if not isinstance(body, Mapping):
        raise RequestError(400, "malformed", f"a turn request must be a JSON object, got {type(body).__name__}")
    given = [key for key in TURN_KINDS if key in body]
    unknown = sorted(set(body) - set(TURN_KINDS) - {"trace"})
    if unknown:
        raise RequestError(422, "invalid", f"unknown field(s) {unknown}: a turn takes one of {list(TURN_KINDS)} and 'trace'")
    if len(given) != 1:
        raise RequestError(422, "invalid", f"a turn takes exactly one of {list(TURN_KINDS)}, got {given or 'none'}")
    trace = body.get("trace", False)
    if not isinstance(trace, bool):
        raise RequestError(422, "invalid", f"'trace' must be true or false, got {trace!r}")
    kind, value = given[0], body[given[0]]
    if kind == "query":
        if not isinstance(value, str) or not value.strip():
            raise RequestError(422, "invalid", f"'query' must be a non-empty string, got {value!r}")
        return TurnRequest(kind, value, trace)
    if kind == "vector":
        if not isinstance(value, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value):
            raise RequestError(422, "invalid", "'vector' must be a list of numbers")
        if dimension is not None and len(value) != dimension:
            raise RequestError(422, "wrong_dimension", f"'vector' has dimension {len(value)}, the index has {dimension}")
        bad = next((i for i, x in enumerate(value) if not math.isfinite(x)), None)
        if bad is not None:
            raise RequestError(422, "nonfinite", f"'vector' entry {bad} is {value[bad]!r}: every entry must be finite")
        return TurnRequest(kind, torch.tensor(value, dtype=torch.float64), trace)
    if not isinstance(value, list) or not value:
        raise RequestError(422, "invalid", "'candidates' must be a non-empty list of {\"chunk_id\", \"score\"} objects")
    if len(value) > max_candidates:
        raise RequestError(413, "oversized", f"'candidates' has {len(value)} entries, at most {max_candidates} are accepted")
    pairs = []
    for position, entry in enumerate(value):
        if not (isinstance(entry, Mapping) and set(entry) == {"chunk_id", "score"} and isinstance(entry["chunk_id"], str)
                and entry["chunk_id"] and isinstance(entry["score"], (int, float)) and not isinstance(entry["score"], bool)):
            raise RequestError(422, "invalid", f"candidate {position} must be {{\"chunk_id\": non-empty string, "
                                               f"\"score\": number}}, got {entry!r}")
        if not math.isfinite(entry["score"]):
            raise RequestError(422, "nonfinite", f"candidate {position} ({entry['chunk_id']!r}) has score {entry['score']!r}")
        pairs.append((entry["chunk_id"], float(entry["score"])))
    if known is not None:
        missing = [chunk_id for chunk_id, _ in pairs if chunk_id not in known]
        if missing:
            raise RequestError(422, "unknown_chunk", f"unknown chunk ID(s) {missing[:5]} (not in the corpus)")
    return TurnRequest(kind, pairs, trace)


# ---------------------------------------------------------------------------------- metrics

#: Histogram bounds: batch sizes, and latencies in seconds.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Histogram:
    """Cumulative Prometheus histogram (``observe``; ``state()`` as plain values)."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds, self.counts, self.total, self.count = tuple(bounds), [0] * (len(bounds) + 1), 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def state(self) -> Dict[str, Any]:
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.total, "count": self.count}


class Metrics:
    """A shard's (or the router's) counters and histograms, as plain values for rendering."""

    def __init__(self) -> None:
        self.steps = 0
        self.batch_sizes = Histogram(BATCH_BUCKETS)
        self.step_seconds = Histogram(LATENCY_BUCKETS)
        self.request_seconds = Histogram(LATENCY_BUCKETS)
        self.errors: Dict[str, int] = {}

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1

    def state(self, **gauges: float) -> Dict[str, Any]:
        return {"steps": self.steps, "batch_size": self.batch_sizes.state(), "step_seconds": self.step_seconds.state(),
                "request_seconds": self.request_seconds.state(), "errors": dict(self.errors), "gauges": gauges}


_FAMILIES = (
    ("steps", "counter", "mapmatched_steps_total", "batched server steps"),
    ("batch_size", "histogram", "mapmatched_batch_size", "turn requests per batched step"),
    ("step_seconds", "histogram", "mapmatched_step_seconds", "seconds per batched step (embed, search, decode, log)"),
    ("request_seconds", "histogram", "mapmatched_request_seconds", "seconds per request, as the router saw it"),
)


def _labels(labels: Mapping[str, str]) -> str:
    return "{" + ",".join(f'{key}="{value}"' for key, value in labels.items()) + "}" if labels else ""


def render_metrics(parts: Sequence[Tuple[Mapping[str, str], Mapping[str, Any]]]) -> str:
    """Prometheus text exposition of ``(labels, Metrics.state())`` pairs (one family each)."""
    lines: List[str] = []
    for key, kind, name, help_text in _FAMILIES:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        for labels, state in parts:
            if kind == "counter":
                lines.append(f"{name}{_labels(labels)} {state[key]}")
                continue
            hist, running = state[key], 0
            for bound, count in zip(hist["bounds"] + ["+Inf"], hist["counts"]):
                running += count
                lines.append(f"{name}_bucket{_labels({**labels, 'le': str(bound)})} {running}")
            lines += [f"{name}_sum{_labels(labels)} {hist['sum']!r}", f"{name}_count{_labels(labels)} {hist['count']}"]
    lines += ["# HELP mapmatched_open_sessions open sessions", "# TYPE mapmatched_open_sessions gauge"]
    lines += [f"mapmatched_open_sessions{_labels(labels)} {state['gauges'].get('open_sessions', 0)}"
              for labels, state in parts if "open_sessions" in state["gauges"]]
    lines += ["# HELP mapmatched_errors_total refused requests by kind", "# TYPE mapmatched_errors_total counter"]
    lines += [f"mapmatched_errors_total{_labels({**labels, 'kind': kind})} {count}"
              for labels, state in parts for kind, count in sorted(state["errors"].items())]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------- the shard

_SNAPSHOT = re.compile(r"snapshot-(\d{8})\.pt")


class ShardCore:
    """One shard: a :class:`MapMatchedServer`, its provider and embedder, made durable.

    Args:
        parts: the :class:`ShardParts` (a fresh server, provider, embedder, fingerprint).
        state_dir: this shard's directory (None: nothing is written; a restart forgets).
        shard, shards: this shard's index and the shard count (kept in the manifest: a
            directory of another layout is refused).
        snapshot_every, snapshot_seconds: save a snapshot after this many logged
            mutations, or this long after the last snapshot (checked at each mutation).
        max_candidates: most candidates one turn request may carry (413 beyond).

    Raises:
        MapMatchedValueError: ``state_dir`` holds the state of another graph, settings
            or shard layout (its manifest's fingerprint differs); nothing is read.
    """

    def __init__(self, parts: ShardParts, state_dir: Union[str, os.PathLike, None] = None, *, shard: int = 0,
                 shards: int = 1, snapshot_every: int = 1000, snapshot_seconds: float = 30.0,
                 max_candidates: int = 1000) -> None:
        self.server, self.provider, self.embedder = parts.server, parts.provider, parts.embedder
        self.fingerprint = parts.fingerprint or default_fingerprint(self.server)
        self.shard, self.shards = shard, shards
        self.snapshot_every, self.snapshot_seconds, self.max_candidates = snapshot_every, snapshot_seconds, max_candidates
        self.metrics = Metrics()
        dimension = getattr(self.provider, "dimension", None)
        self.dimension = int(dimension) if dimension is not None else None
        ids = getattr(self.provider, "chunk_ids", None) or getattr(self.server.graph, "nodes", None)
        self.known = frozenset(ids) if ids is not None else None
        self._empty = self.server.state_dict()
        self.directory = Path(state_dir) if state_dir is not None else None
        self.generation, self._logged, self._last_snapshot, self._log = 0, 0, time.monotonic(), None
        #: session ID -> (request ID, response) of its last acknowledged mutation: a retried
        #: request (the same ID) gets that response again instead of being applied twice
        self._acknowledged: Dict[str, Tuple[str, Dict[str, Any]]] = {}
        self._carried: set = set()  # closed sessions whose last response a snapshot carried over already
        if self.directory is not None:
            self._check_manifest()
            self._restore()

    # ------------------------------------------------------------ durability

    def _check_manifest(self) -> None:
        assert self.directory is not None
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / "manifest.json"
        mine = {"fingerprint": self.fingerprint, "shard": self.shard, "shards": self.shards}
        if path.is_file():
            saved = json.loads(path.read_text())
            if saved != mine:
                raise MapMatchedValueError(
                    f"refusing the state in {self.directory}: it was written for another graph, settings or shard "
                    f"layout (saved {saved}, this shard {mine}); serve with its data and options, reshard it, or give "
                    "an empty state directory")
        else:
            write_text_atomic(path, json.dumps(mine, sort_keys=True) + "\n")

    def _restore(self) -> None:
        """Load the newest snapshot and replay its log (also after a failed log write)."""
        assert self.directory is not None
        if self._log is not None:
            self._log.close()
            self._log = None
        generations = sorted(int(m.group(1)) for m in map(_SNAPSHOT.fullmatch, os.listdir(self.directory)) if m)
        self.generation = generations[-1] if generations else 0
        if generations:
            self.server.load(self.directory / f"snapshot-{self.generation:08d}.pt")
        else:
            self.server.load_state_dict(self._empty)
        self._acknowledged = {}
        log = self._log_path(self.generation)
        valid = 0
        if log.is_file():
            data = log.read_bytes()
            for line in data.splitlines(keepends=True):
                if not line.endswith(b"\n"):
                    break  # a torn last line: never acknowledged
                self._replay(json.loads(line))
                valid += len(line)
            if valid != len(data):
                with open(log, "r+b") as handle:
                    handle.truncate(valid)
        self._log = open(log, "ab")
        self._logged, self._last_snapshot = 0, time.monotonic()

    def _log_path(self, generation: int) -> Path:
        assert self.directory is not None
        return self.directory / f"wal-{generation:08d}.jsonl"

    def _replay(self, record: Mapping[str, Any]) -> None:
        op = record["op"]
        if op == "acknowledged":  # the last responses, carried over a snapshot
            self._acknowledged.update({sid: (rid, response) for sid, (rid, response) in record["entries"].items()})
            return
        session_id = record["session_id"]
        if record.get("request_id") is not None:
            self._acknowledged[session_id] = (record["request_id"], record["response"])
        if op == "open":
            self.server.open(session_id)
        elif op == "close":
            self.server.close(session_id)
        else:
            _, errors = self.server.step({session_id: [tuple(pair) for pair in record["candidates"]]})
            if errors:
                raise MapMatchedValueError(f"replaying {self._log_path(self.generation)}: {errors[session_id]}")

    def _append(self, records: List[Dict[str, Any]]) -> None:
        """Log ``records`` (already applied in memory) durably; on failure go back to the
        durable state and raise RequestError 503 (nothing of them is acknowledged)."""
        if self._log is None or not records:
            return
        try:
            self._log.write(b"".join(json.dumps(r, allow_nan=False).encode() + b"\n" for r in records))
            self._log.flush()
            os.fsync(self._log.fileno())
        except OSError as error:
            self._restore()
            raise RequestError(503, "log_failed", f"the write-ahead log could not be written ({error}); retry") from error
        self._logged += len(records)
        if self._logged >= self.snapshot_every or time.monotonic() - self._last_snapshot >= self.snapshot_seconds:
            self.snapshot()

    def snapshot(self) -> None:
        """Save the server as the next generation's snapshot, start its log, drop the old files."""
        if self.directory is None or self._log is None:
            return
        old = self.generation
        self.server.save(self.directory / f"snapshot-{old + 1:08d}.pt")
        self._log.close()
        self.generation = old + 1
        self._log = open(self._log_path(self.generation), "ab")
        # the last responses, first in the new log (a retry may follow the snapshot): of open
        # sessions, and of sessions closed since the last snapshot (carried over once)
        self._acknowledged = {sid: done for sid, done in self._acknowledged.items()
                              if sid in self.server or sid not in self._carried}
        self._carried = {sid for sid in self._acknowledged if sid not in self.server}
        if self._acknowledged:
            entries = {sid: [rid, response] for sid, (rid, response) in self._acknowledged.items()}
            self._log.write(json.dumps({"op": "acknowledged", "entries": entries}, allow_nan=False).encode() + b"\n")
            self._log.flush()
            os.fsync(self._log.fileno())
        for stale in (self._log_path(old), self.directory / f"snapshot-{old:08d}.pt"):
            stale.unlink(missing_ok=True)
        self._logged, self._last_snapshot = 0, time.monotonic()

    def close_files(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    # ------------------------------------------------------------ sessions

    def _repeated(self, session_id: str, request_id: Optional[str]) -> Optional[Dict[str, Any]]:
        """The response already given to ``request_id`` for this session (a retry), or None."""
        done = self._acknowledged.get(session_id)
        return dict(done[1]) if request_id is not None and done is not None and done[0] == request_id else None

    def _acknowledge(self, records: List[Dict[str, Any]]) -> None:
        """Remember the responses of ``records`` (each with its request ID) and log them
        (the map first: a snapshot the log write triggers carries it over; a failed write
        restores the map from the durable log)."""
        for record in records:
            if record.get("request_id") is not None:
                self._acknowledged[record["session_id"]] = (record["request_id"], record["response"])
        self._append(records)

    def open(self, session_id: str, request_id: Optional[str] = None) -> Dict[str, Any]:
        _check_session_id(session_id)
        repeated = self._repeated(session_id, request_id)
        if repeated is not None:
            return repeated
        if session_id in self.server:
            raise RequestError(409, "session_exists", f"session {session_id!r} is already open")
        self.server.open(session_id)
        response = {"session_id": session_id}
        self._acknowledge([{"op": "open", "session_id": session_id, "request_id": request_id, "response": response}])
        return dict(response)

    def close(self, session_id: str, request_id: Optional[str] = None) -> Dict[str, Any]:
        _check_session_id(session_id)
        repeated = self._repeated(session_id, request_id)
        if repeated is not None:
            return repeated
        if session_id not in self.server:
            raise RequestError(404, "unknown_session", f"unknown session {session_id!r} (open it first)")
        self.server.close(session_id)
        response = {"session_id": session_id, "closed": True}
        self._acknowledge([{"op": "close", "session_id": session_id, "request_id": request_id, "response": response}])
        return dict(response)

    def state(self) -> Dict[str, Any]:
        """``Metrics.state`` with the open-session gauge."""
        return self.metrics.state(open_sessions=len(self.server))

    # ------------------------------------------------------------ turns

    def turns(self, requests: Sequence[Tuple[Any, ...]]) -> List[Union[Dict[str, Any], RequestError]]:
        """Serve a batch of ``(session ID, turn body)`` or ``(session ID, turn body, request
        ID)``: one embedder call for its queries, one provider search, one server step per
        round (a session listed twice steps in a later round). Each answer is the turn's
        response or its RequestError; a failed turn changes nothing. A request ID that was
        already acknowledged for its session (a retry after a lost answer) gets the same
        response again and is not applied twice."""
        started = time.perf_counter()
        answers: List[Any] = [None] * len(requests)
        parsed: Dict[int, TurnRequest] = {}
        request_ids = [request[2] if len(request) > 2 else None for request in requests]
        for position, (session_id, body, *_) in enumerate(requests):
            try:
                _check_session_id(session_id)
                repeated = self._repeated(session_id, request_ids[position])
                if repeated is not None:
                    answers[position] = repeated
                    continue
                turn = parse_turn(body, max_candidates=self.max_candidates, dimension=self.dimension, known=self.known)
                if session_id not in self.server:
                    raise RequestError(404, "unknown_session", f"unknown session {session_id!r} (open it first)")
                parsed[position] = turn
            except RequestError as error:
                answers[position] = error
        try:
            candidates = self._search(parsed, answers)
        except Exception as error:  # the embedder or provider failed: its turns fail, candidate turns go on
            failed = RequestError(500, "retrieval_failed", f"embedding or search failed: {type(error).__name__}: {error}")
            for position, turn in parsed.items():
                if turn.kind != "candidates" and answers[position] is None:
                    answers[position] = failed
            candidates = {p: t.value for p, t in sorted(parsed.items()) if t.kind == "candidates"}
        rounds: List[Dict[str, int]] = []
        for position in candidates:
            session_id = requests[position][0]
            target = next((r for r in rounds if session_id not in r), None)
            if target is None:
                rounds.append(target := {})
            target[session_id] = position
        records = []
        for round_ in rounds:
            results, errors = self.server.step({sid: candidates[pos] for sid, pos in round_.items()})
            for session_id, position in round_.items():
                if session_id in errors:
                    answers[position] = _as_request_error(errors[session_id])
                    continue
                answers[position] = _response(session_id, results[session_id], parsed[position].trace)
                kept = candidates[position][: self.server.candidate_limit]
                records.append({"op": "turn", "session_id": session_id, "candidates": [list(p) for p in kept],
                                "request_id": request_ids[position], "response": answers[position]})
        if records:
            try:
                self._acknowledge(records)
            except RequestError as error:
                answers = [error if isinstance(answer, dict) else answer for answer in answers]
        self.metrics.steps += len(rounds)
        self.metrics.batch_sizes.observe(len(requests))
        self.metrics.step_seconds.observe(time.perf_counter() - started)
        for answer in answers:
            if isinstance(answer, RequestError):
                self.metrics.error(answer.kind)
        return answers

    def _search(self, parsed: Dict[int, TurnRequest], answers: List[Any]) -> Dict[int, List[Tuple[str, float]]]:
        """Candidates of every parsed turn: queries embedded in one call, then every vector
        searched in one provider call."""
        found: Dict[int, List[Tuple[str, float]]] = {p: t.value for p, t in parsed.items() if t.kind == "candidates"}
        queries = [p for p, t in parsed.items() if t.kind == "query"]
        vectors = {p: t.value for p, t in parsed.items() if t.kind == "vector"}
        if queries:
            if self.embedder is None or self.provider is None:
                for p in queries:
                    answers[p] = RequestError(422, "no_embedder", "this shard has no embedder: send vector or candidates")
            else:
                embedded = _embed(self.embedder, [parsed[p].value for p in queries]).to(torch.float64)
                vectors.update(zip(queries, embedded))
        if vectors and self.provider is None:
            for p in vectors:
                answers[p] = RequestError(422, "no_provider", "this shard has no provider: send candidates")
        elif vectors:
            order = sorted(vectors)
            search = getattr(self.provider, "search_vectors", None) or self.provider.search
            rows = search(torch.stack([vectors[p] for p in order]), self.server.candidate_limit)
            for p, row in zip(order, rows):
                found[p] = [(c.chunk_id, float(c.score)) for c in row]
        return {p: found[p] for p in sorted(found)}


def _embed(embedder: Any, texts: List[str]) -> torch.Tensor:
    encode = getattr(embedder, "encode", None)
    return torch.as_tensor(encode(texts) if callable(encode) else embedder(texts))


def _check_session_id(session_id: Any) -> None:
    if not isinstance(session_id, str) or not session_id or len(session_id) > 256:
        raise RequestError(422, "invalid", f"a session ID is a non-empty string of at most 256 characters, got {session_id!r}")


def _as_request_error(error: Exception) -> RequestError:
    text = str(error)
    if text.startswith("unknown session"):
        return RequestError(404, "unknown_session", text)
    return RequestError(422, "rejected_turn", f"{type(error).__name__}: {text}")


def _response(session_id: str, result: Any, trace: bool) -> Dict[str, Any]:
    steps = result.trace
    answer = {
        "session_id": session_id, "turn": len(steps.steps) - 1, "chunk_id": result.chunk_id,
        "context_chunk_ids": list(result.context_chunk_ids), "revised_turns": list(steps.revised_prior_indices),
        "committed_through": steps.committed_through_index,
    }
    if trace:
        answer["trace"] = json.loads(steps.to_json())
    return answer


def read_shard_sessions(server: MapMatchedServer) -> Dict[Any, List[List[Tuple[str, float]]]]:
    """Every open session's turns as the candidates they were decoded with (provider
    order, the kept ones), read from ``server.state_dict()``: what moves a session to
    another server (step them there in order and it decodes the same)."""
    state = server.state_dict()
    tensors = state["store"]["decoder"]["tensors"]
    codes, raw, lengths = tensors["payload.codes"], tensors["payload.raw"], tensors["lengths"]
    names = server.store.codes.names
    sessions: Dict[Any, List[List[Tuple[str, float]]]] = {}
    for session_id, slot in state["sessions"]:
        turns = []
        for turn in range(int(lengths[slot])):
            row = [code for code in codes[slot, turn].tolist() if code >= 0]
            turns.append(list(zip(names(row), raw[slot, turn, : len(row)].tolist())))
        sessions[session_id] = turns
    return sessions


def replay_sessions(server: MapMatchedServer, sessions: Mapping[Any, Sequence[Sequence[Tuple[str, float]]]]) -> None:
    """Open ``sessions`` in ``server`` and step their turns, turn by turn in one batch each."""
    for session_id in sessions:
        server.open(session_id)
    depth = max((len(turns) for turns in sessions.values()), default=0)
    for turn in range(depth):
        _, errors = server.step({sid: list(turns[turn]) for sid, turns in sessions.items() if len(turns) > turn})
        if errors:
            raise MapMatchedValueError(f"replaying moved sessions: {errors}")


def shard_directory(state_dir: Union[str, os.PathLike], shard: int) -> Path:
    """Where shard ``shard`` keeps its snapshot and log under ``state_dir``."""
    return Path(state_dir) / f"shard-{shard}"


def reshard(state_dir: Union[str, os.PathLike], new_state_dir: Union[str, os.PathLike], shards: int,
            new_shards: int, factory: Callable[[], ShardParts]) -> Dict[int, int]:
    """Move every session of an ``shards``-shard state into a ``new_shards``-shard one
    (offline: with the application stopped).

    Each old shard is restored (snapshot + log) into a server from ``factory()``; its
    sessions are read out of its ``state_dict`` (:func:`read_shard_sessions`: each turn's
    kept candidates), sent to ``shard_of(session ID, new_shards)`` and stepped there turn
    by turn, which decodes them exactly as before; each new shard is then saved as a
    snapshot in ``new_state_dir`` (which must not hold a state yet). The old directory is
    only read. Returns new shard -> number of sessions.
    """
    moved: Dict[Any, List[List[Tuple[str, float]]]] = {}
    for shard in range(shards):
        core = ShardCore(factory(), shard_directory(state_dir, shard), shard=shard, shards=shards)
        moved.update(read_shard_sessions(core.server))
        core.close_files()
    counts = {}
    for shard in range(new_shards):
        target = shard_directory(new_state_dir, shard)
        if target.exists() and any(target.iterdir()):
            raise MapMatchedValueError(f"reshard: {target} already holds a state; give an empty new_state_dir")
        core = ShardCore(factory(), target, shard=shard, shards=new_shards)
        mine = {sid: turns for sid, turns in moved.items() if shard_of(sid, new_shards) == shard}
        replay_sessions(core.server, mine)
        core.snapshot()
        core.close_files()
        counts[shard] = len(mine)
    return counts
