"""Serving beyond one process with Ray Serve (the ``[ray]`` extra: ``ray[serve]``).

The application is N shard deployments and one router (the HTTP ingress):

- Each **shard** (deployment ``mapmatched-shard-<i>``, one replica) holds a
  :class:`~mapmatched_torch.integrations._shard.ShardCore`: an embedder, a provider
  and a :class:`~mapmatched_torch.serving.MapMatchedServer`, built in the replica by
  the ``factory`` you give (it returns :class:`ShardParts`). Concurrent turn requests
  are gathered by ``@serve.batch`` into one embedder call, one provider search and one
  server step. With ``state_dir``, the shard writes snapshots (``MapMatchedServer.save``,
  every ``snapshot_every`` mutations or ``snapshot_seconds``) and, in between, appends
  every accepted open, close and turn to a write-ahead log and fsyncs it before
  answering; a replica restarted by Serve (after a crash or ``ray.kill``) restores the
  snapshot and replays the log, so no acknowledged turn is lost. A directory written
  for another graph, settings or shard count is refused with a clear error.
- The **router** (deployment ``mapmatched-router``) picks a session's shard by a stable
  hash of its ID (:func:`shard_of`: blake2b, never Python's salted ``hash``) and
  forwards; a shard whose replica is being restarted is retried for up to
  ``retry_seconds``.

HTTP JSON API (bind 127.0.0.1 unless told otherwise)::

    POST   /v1/sessions               {"session_id": "s1"}     -> 201 {"session_id": "s1"}; 409 if open
    DELETE /v1/sessions/{id}                                   -> 200; 404 if not open
    POST   /v1/sessions/{id}/turns    exactly one of {"query": "text"}, {"vector": [...]},
                                      {"candidates": [{"chunk_id": "c", "score": 1.0}, ...]},
                                      optional "trace": true
        -> 200 {"session_id", "turn", "chunk_id", "context_chunk_ids", "revised_turns",
                "committed_through"} (+ "trace")
    GET    /healthz                                            -> 200 {"status": "ok", "shards": N, ...}
    GET    /metrics                                            -> Prometheus text

A refused request is a 4xx JSON ``{"error": kind, "detail": message, "status": code}``:
400 malformed JSON, 404 unknown session, 409 session already open, 413 a body over
``max_body_bytes`` or more than ``max_candidates`` candidates, 422 anything else that is
wrong with a turn (no or two kinds, a NaN or wrong-dimension vector, unknown chunk IDs,
a turn the server refuses). A failed turn changes nothing, and the other requests of
its batch are served. :class:`MapMatchedClient` does the same through a Ray
``DeploymentHandle``, without HTTP.

Resizing N -> M shards: stop the application and call :func:`reshard` (each old
shard's sessions are read from its ``state_dict`` and stepped, turn by turn, in their
new shard; the new directory gets one snapshot per shard), then deploy with M shards
on the new directory.

Retries: a router retries a shard call only when the replica is gone, with the
request ID it gave the call: a shard logs each mutation's request ID and response with
it (and carries the open sessions' last ones over a snapshot), so a mutation whose
replica died after logging it but before answering is answered again, not applied
twice (exactly once per acknowledged request). Limits: each shard has one replica (its
sessions live in one server); scale with more shards.

Example (``mapmatched-torch serve`` does this for a ``--data`` folder)::

    from mapmatched_torch.integrations.ray_serve import ShardParts, run
    handle, url = run(make_parts, shards=2, state_dir="/var/lib/mm", port=8000)
"""


import asyncio
import json
import time
import uuid
from functools import lru_cache
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..core.optional import import_optional
from ._shard import RequestError, ShardCore, ShardParts, render_metrics, reshard, shard_directory, shard_of

__all__ = ["ShardParts", "RequestError", "ServeRequestError", "MapMatchedClient", "build_app", "run", "shard_of",
           "reshard", "SHARD_DEPLOYMENT", "ROUTER_DEPLOYMENT"]

#: Deployment names: ``SHARD_DEPLOYMENT.format(shard=i)`` and the router's.
SHARD_DEPLOYMENT = "mapmatched-shard-{shard}"
ROUTER_DEPLOYMENT = "mapmatched-router"

_FEATURE = "mapmatched_torch.integrations.ray_serve"


def _modules() -> Tuple[Any, Any, Any]:
    """(ray, ray.serve, fastapi), or MissingDependencyError naming ``[ray]``."""
    ray = import_optional("ray", "ray", _FEATURE)
    serve = import_optional("ray.serve", "ray", _FEATURE)
    fastapi = import_optional("fastapi", "ray", _FEATURE)
    return ray, serve, fastapi


class ServeRequestError(Exception):
    """A request the application refused: ``status`` (4xx / 5xx) and the JSON ``body``."""

    def __init__(self, status: int, body: Dict[str, Any]) -> None:
        super().__init__(f"{status} {body.get('error')}: {body.get('detail')}")
        self.status, self.body = status, body


def _answer(call: Callable[[], Any], status: int = 200) -> Dict[str, Any]:
    """``{"status", "body"}`` of a shard call (its RequestError as a 4xx answer)."""
    try:
        return {"status": status, "body": call()}
    except RequestError as error:
        return {"status": error.status, "body": error.to_dict()}


@lru_cache(maxsize=1)
def _deployments() -> Tuple[Any, Any]:
    """The shard and router deployment classes (defined once ray is imported)."""
    ray, serve, fastapi = _modules()
    from fastapi.responses import JSONResponse, PlainTextResponse

    class ShardReplica:
        """One shard: a :class:`ShardCore` restored from its directory, turns batched."""

        def __init__(self, factory, state_dir, shard, shards, options, batching):
            directory = shard_directory(state_dir, shard) if state_dir is not None else None
            self.core = ShardCore(factory(), directory, shard=shard, shards=shards, **options)
            self.turns.set_max_batch_size(batching[0])
            self.turns.set_batch_wait_timeout_s(batching[1])

        async def open(self, session_id: str, request_id: Optional[str] = None) -> Dict[str, Any]:
            return _answer(lambda: self.core.open(session_id, request_id), 201)

        async def close(self, session_id: str, request_id: Optional[str] = None) -> Dict[str, Any]:
            return _answer(lambda: self.core.close(session_id, request_id))

        @serve.batch(max_batch_size=64, batch_wait_timeout_s=0.005)
        async def turns(self, session_ids: List[str], bodies: List[Any], request_ids: List[Optional[str]]
                        ) -> List[Dict[str, Any]]:
            answers = self.core.turns(list(zip(session_ids, bodies, request_ids)))
            return [{"status": a.status, "body": a.to_dict()} if isinstance(a, RequestError) else {"status": 200, "body": a}
                    for a in answers]

        async def turn(self, session_id: str, body: Any, request_id: Optional[str] = None) -> Dict[str, Any]:
            return await self.turns(session_id, body, request_id)

        async def state(self) -> Dict[str, Any]:
            return self.core.state()

        async def snapshot(self) -> None:
            self.core.snapshot()

        def __del__(self) -> None:
            core = getattr(self, "core", None)
            if core is not None:
                core.close_files()

    app = fastapi.FastAPI(title="mapmatched-torch", docs_url=None, redoc_url=None, openapi_url=None)
    retried = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)

    class Router:
        """Picks each session's shard (:func:`shard_of`) and forwards; also the HTTP ingress."""

        def __init__(self, shards: List[Any], options: Dict[str, Any]) -> None:
            from ._shard import Metrics

            self.shards, self.options, self.metrics = shards, options, Metrics()

        async def _call(self, shard: int, method: str, *args: Any) -> Dict[str, Any]:
            deadline = time.monotonic() + self.options["retry_seconds"]
            attempt = 0
            while True:
                try:
                    return await getattr(self.shards[shard], method).remote(*args)
                except retried:
                    attempt += 1
                    if time.monotonic() >= deadline:
                        self.metrics.error("shard_unavailable")
                        return {"status": 503, "body": {"error": "shard_unavailable", "status": 503,
                                                        "detail": f"shard {shard} did not answer within "
                                                                  f"{self.options['retry_seconds']} s"}}
                    await asyncio.sleep(min(0.1 * attempt, 1.0))

        def _shard(self, session_id: Any) -> int:
            if not isinstance(session_id, str) or not session_id:
                raise RequestError(422, "invalid", f"a session ID is a non-empty string, got {session_id!r}")
            return shard_of(session_id, len(self.shards))

        async def _timed(self, work) -> Dict[str, Any]:
            started = time.perf_counter()
            try:
                answer = await work()
            except RequestError as error:
                answer = {"status": error.status, "body": error.to_dict()}
            self.metrics.request_seconds.observe(time.perf_counter() - started)
            if answer["status"] >= 400:
                self.metrics.error(answer["body"].get("error", "error"))
            return answer

        # ---------------------------------------------------- the handle API
        # each mutation carries one request ID through every retry: a shard that logged it
        # before dying answers the retry with the same response instead of applying it twice
        async def open_session(self, session_id: str) -> Dict[str, Any]:
            request = uuid.uuid4().hex
            return await self._timed(lambda: self._call(self._shard(session_id), "open", session_id, request))

        async def close_session(self, session_id: str) -> Dict[str, Any]:
            request = uuid.uuid4().hex
            return await self._timed(lambda: self._call(self._shard(session_id), "close", session_id, request))

        async def turn(self, session_id: str, body: Any) -> Dict[str, Any]:
            request = uuid.uuid4().hex
            return await self._timed(lambda: self._call(self._shard(session_id), "turn", session_id, body, request))

        async def health(self) -> Dict[str, Any]:
            states = await asyncio.gather(*(self._call(i, "state") for i in range(len(self.shards))))
            sessions = [state["gauges"]["open_sessions"] if "gauges" in state else None for state in states]
            return {"status": "ok", "shards": len(self.shards), "open_sessions": sessions}

        async def metrics_text(self) -> str:
            states = await asyncio.gather(*(self._call(i, "state") for i in range(len(self.shards))))
            parts = [({"shard": str(i)}, state) for i, state in enumerate(states) if "steps" in state]
            return render_metrics([({"shard": "router"}, self.metrics.state())] + parts)

        async def snapshot(self) -> None:
            await asyncio.gather(*(self._call(i, "snapshot") for i in range(len(self.shards))))

        # ---------------------------------------------------- HTTP
        async def _json(self, request: Any) -> Any:
            body = await request.body()
            if len(body) > self.options["max_body_bytes"]:
                raise RequestError(413, "oversized", f"the body has {len(body)} bytes, at most "
                                                     f"{self.options['max_body_bytes']} are accepted")
            try:
                return json.loads(body)
            except ValueError as error:
                raise RequestError(400, "malformed", f"the body is not valid JSON: {error}") from None

        @staticmethod
        def _reply(answer: Dict[str, Any]) -> Any:
            return JSONResponse(answer["body"], status_code=answer["status"])

        @app.post("/v1/sessions")
        async def http_open(self, request: fastapi.Request) -> Any:
            async def work():
                body = await self._json(request)
                if not isinstance(body, dict) or set(body) != {"session_id"}:
                    raise RequestError(422, "invalid", 'open a session with {"session_id": "..."}')
                return await self._call(self._shard(body["session_id"]), "open", body["session_id"])
            return self._reply(await self._timed(work))

        @app.delete("/v1/sessions/{session_id}")
        async def http_close(self, session_id: str) -> Any:
            return self._reply(await self.close_session(session_id))

        @app.post("/v1/sessions/{session_id}/turns")
        async def http_turn(self, session_id: str, request: fastapi.Request) -> Any:
            async def work():
                body = await self._json(request)
                return await self._call(self._shard(session_id), "turn", session_id, body)
            return self._reply(await self._timed(work))

        @app.get("/healthz")
        async def http_health(self) -> Any:
            return JSONResponse(await self.health())

        @app.get("/metrics")
        async def http_metrics(self) -> Any:
            return PlainTextResponse(await self.metrics_text(), media_type="text/plain; version=0.0.4")

    return ShardReplica, serve.ingress(app)(Router)


def build_app(
    factory: Callable[[], ShardParts],
    *,
    shards: int = 2,
    state_dir: Optional[str] = None,
    max_batch_size: int = 64,
    batch_wait_timeout_s: float = 0.005,
    snapshot_every: int = 1000,
    snapshot_seconds: float = 30.0,
    max_candidates: int = 1000,
    max_body_bytes: int = 1 << 20,
    retry_seconds: float = 30.0,
    num_cpus: float = 0.0,
) -> Any:
    """The Ray Serve application (router + ``shards`` shard deployments), not yet running.

    Args:
        factory: builds a shard's :class:`ShardParts` in its replica (a picklable
            callable: graph, provider, embedder and a fresh server).
        shards: N, shard deployments (one replica each).
        state_dir: snapshots and write-ahead logs, ``<state_dir>/shard-<i>`` (None: not durable).
        max_batch_size, batch_wait_timeout_s: ``@serve.batch`` of the turn requests.
        snapshot_every, snapshot_seconds: when a shard saves a snapshot.
        max_candidates, max_body_bytes: larger requests get 413.
        retry_seconds: how long the router retries a shard whose replica is gone.
        num_cpus: Ray CPUs reserved per replica (0 lets a small machine hold them all).
    """
    _, serve, _ = _modules()
    if not isinstance(shards, int) or shards < 1:
        raise ValueError(f"shards must be a positive int, got {shards!r}")
    shard_class, router_class = _deployments()
    options = {"snapshot_every": snapshot_every, "snapshot_seconds": snapshot_seconds, "max_candidates": max_candidates}
    actor = {"num_cpus": num_cpus}
    handles = [
        serve.deployment(shard_class, name=SHARD_DEPLOYMENT.format(shard=shard), num_replicas=1,
                         ray_actor_options=actor, max_ongoing_requests=max(4 * max_batch_size, 64))
        .bind(factory, state_dir, shard, shards, options, (max_batch_size, batch_wait_timeout_s))
        for shard in range(shards)
    ]
    router = serve.deployment(router_class, name=ROUTER_DEPLOYMENT, ray_actor_options=actor,
                              max_ongoing_requests=max(8 * max_batch_size, 256))
    return router.bind(handles, {"max_body_bytes": max_body_bytes, "retry_seconds": retry_seconds})


def run(factory: Callable[[], ShardParts], *, host: str = "127.0.0.1", port: int = 8000, name: str = "mapmatched",
        **options: Any) -> Tuple[Any, str]:
    """Start Serve's HTTP proxy on ``host:port`` (Ray must be initialized, or is started
    locally), deploy :func:`build_app` and return ``(router handle, base URL)``."""
    ray, serve, _ = _modules()
    if not ray.is_initialized():
        ray.init(include_dashboard=False)
    serve.start(http_options={"host": host, "port": port})
    handle = serve.run(build_app(factory, **options), name=name, route_prefix="/")
    return handle, f"http://{host}:{port}"


class MapMatchedClient:
    """The HTTP API's operations on the router's ``DeploymentHandle`` (no HTTP).

    Each call blocks for the answer; a refused request raises :class:`ServeRequestError`
    with the status and JSON body HTTP would give.

    Example::

        client = MapMatchedClient(handle)
        client.open("s1")
        client.turn("s1", query="what is a cat?")["chunk_id"]
    """

    def __init__(self, handle: Any, timeout_s: float = 60.0) -> None:
        self.handle, self.timeout_s = handle, timeout_s

    def _result(self, response: Any) -> Dict[str, Any]:
        answer = response.result(timeout_s=self.timeout_s)
        if answer["status"] >= 400:
            raise ServeRequestError(answer["status"], answer["body"])
        return answer["body"]

    def open(self, session_id: str) -> Dict[str, Any]:
        return self._result(self.handle.open_session.remote(session_id))

    def close(self, session_id: str) -> Dict[str, Any]:
        return self._result(self.handle.close_session.remote(session_id))

    def turn(self, session_id: str, *, query: Optional[str] = None, vector: Optional[List[float]] = None,
             candidates: Optional[List[Dict[str, Any]]] = None, trace: bool = False) -> Dict[str, Any]:
        body: Dict[str, Any] = {key: value for key, value in
                                (("query", query), ("vector", vector), ("candidates", candidates)) if value is not None}
        if trace:
            body["trace"] = True
        return self._result(self.handle.turn.remote(session_id, body))

    def health(self) -> Dict[str, Any]:
        return self.handle.health.remote().result(timeout_s=self.timeout_s)

    def metrics(self) -> str:
        return self.handle.metrics_text.remote().result(timeout_s=self.timeout_s)
