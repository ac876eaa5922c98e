"""Ray Serve application: HTTP equals one in-process server, a killed shard replica
loses nothing, every bad input gets its 4xx; the shard core's snapshot + log, resizing
and the stable shard hash without Ray.

The Ray tests share one local cluster on loopback (2 CPUs, no dashboard), started once
per module and shut down at the end; they skip when ray[serve] is not installed.
"""

from __future__ import annotations

import asyncio
import functools
import json
import socket
import sys
import time
from pathlib import Path

import pytest
import torch

from mapmatched_torch.cli.serve import serve_parts as _serve_parts
from mapmatched_torch.core.errors import MapMatchedValueError, MissingDependencyError
from mapmatched_torch.core.optional import clear_cache, has_module
from mapmatched_torch.integrations._shard import (RequestError, ShardCore, read_shard_sessions, render_metrics,
                                                  reshard, shard_directory, shard_of)

TOPICS = ("cheese milk goat sheep", "volcano lava magma eruption", "piano keys music chord", "rocket orbit fuel launch")


def write_data(folder: Path) -> Path:
    """A small normalized --data folder: 4 topics x 12 passages, 4 conversations."""
    folder.mkdir(parents=True, exist_ok=True)
    passages, conversations = [], []
    for t, words in enumerate(TOPICS):
        for i in range(12):
            text = f"{words.split()[i % 4]} {words} part {i} " + " ".join(words.split()[: 1 + i % 3])
            passages.append({"id": f"topic{t}:{i}", "doc_id": f"topic{t}", "position": i, "title": words.split()[0],
                             "section_path": [words.split()[0]], "text": text})
        conversations.append({"conversation_id": f"c{t}", "turns": [
            {"turn": n, "query": q, "qrels": {f"topic{t}:{n}": 1}} for n, q in enumerate(words.split())]})
    (folder / "tiny.passages.jsonl").write_text("".join(json.dumps(p) + "\n" for p in passages))
    (folder / "tiny.conversations.jsonl").write_text("".join(json.dumps(c) + "\n" for c in conversations))
    return folder


def make_factory(data: Path, fixed_lag=None):
    return functools.partial(_serve_parts, str(data), "hash", 64, None, 4, 10.0, 8, 1.0, fixed_lag)


def turn_bodies(sessions, turns):
    """Each session's turn bodies: queries mostly, some vectors and candidate lists."""
    bodies = {}
    for s, session_id in enumerate(sessions):
        rows = []
        for t in range(turns):
            words = TOPICS[(s + (t // 2)) % 4].split()
            kind = (s + t) % 5
            if kind == 3:
                rows.append({"candidates": [{"chunk_id": f"topic{(s + t) % 4}:{i}", "score": float(10 - i) / 3}
                                            for i in range(6)]})
            elif kind == 4:
                vector = torch.zeros(64, dtype=torch.float64)
                vector[(s * 7 + t) % 64] = 1.0
                vector[(s + 3 * t) % 64] = -0.5
                rows.append({"vector": vector.tolist(), "trace": True})
            else:
                rows.append({"query": f"{words[t % 4]} {words[(s + t) % 4]}", "trace": t == turns - 1})
        bodies[session_id] = rows
    return bodies


def reference(factory, bodies, turns):
    """The same turns through one in-process MapMatchedServer, one step per turn."""
    parts = factory()
    server, provider, embedder = parts.server, parts.provider, parts.embedder
    answers = {session_id: [] for session_id in bodies}
    for session_id in bodies:
        server.open(session_id)
    for t in range(turns):
        step = {}
        for session_id, rows in bodies.items():
            body = rows[t]
            if "candidates" in body:
                step[session_id] = [(c["chunk_id"], c["score"]) for c in body["candidates"]]
                continue
            vector = embedder.encode([body["query"]])[0] if "query" in body else torch.tensor(body["vector"])
            row = provider.search(vector.to(torch.float64).unsqueeze(0), server.candidate_limit)[0]
            step[session_id] = [(c.chunk_id, float(c.score)) for c in row]
        results, errors = server.step(step)
        assert not errors
        for session_id, result in results.items():
            trace = result.trace
            answer = {"session_id": session_id, "turn": t, "chunk_id": result.chunk_id,
                      "context_chunk_ids": list(result.context_chunk_ids),
                      "revised_turns": list(trace.revised_prior_indices),
                      "committed_through": trace.committed_through_index}
            if bodies[session_id][t].get("trace"):
                answer["trace"] = json.loads(trace.to_json())
            answers[session_id].append(answer)
    return answers


# ------------------------------------------------------------------------------ without Ray


def test_shard_of_is_a_stable_hash():
    assert [shard_of(f"s{i}", 3) for i in range(8)] == [shard_of(f"s{i}", 3) for i in range(8)]
    pinned = {(session_id, 7): shard_of(session_id, 7) for session_id in ("alice", "bob", "ü")}
    assert pinned == {("alice", 7): 0, ("bob", 7): 4, ("ü", 7): 3}  # blake2b: the same on every machine
    counts = [sum(shard_of(f"session-{i}", 2) == shard for i in range(400)) for shard in range(2)]
    assert min(counts) > 150


def test_a_shard_restores_snapshot_and_log_and_refuses_another_graph(tmp_path):
    factory = make_factory(write_data(tmp_path / "data"))
    sessions = [f"s{i}" for i in range(6)]
    bodies = turn_bodies(sessions, 4)
    expected = reference(factory, bodies, 4)
    directory = tmp_path / "state"
    core = ShardCore(factory(), directory, snapshot_every=9)
    for session_id in sessions:
        assert core.open(session_id) == {"session_id": session_id}
    for t in range(2):
        assert core.turns([(s, bodies[s][t]) for s in sessions]) == [expected[s][t] for s in sessions]
    assert core.generation >= 1  # a snapshot was taken, and more turns went to the log after it
    core.close_files()
    with open(directory / f"wal-{core.generation:08d}.jsonl", "ab") as log:
        log.write(b'{"op": "turn", "session_id": "s0", "candid')  # a torn, never acknowledged line
    restarted = ShardCore(factory(), directory, snapshot_every=9)
    for t in range(2, 4):
        assert restarted.turns([(s, bodies[s][t]) for s in sessions]) == [expected[s][t] for s in sessions]
    restarted.close_files()
    other = factory()._replace(fingerprint="another graph")
    with pytest.raises(MapMatchedValueError, match="another graph, settings or shard layout"):
        ShardCore(other, directory)


@pytest.mark.parametrize("snapshot_every", [1, 1000])
def test_a_retried_request_is_answered_again_not_applied_twice(tmp_path, snapshot_every):
    """A session's last mutation, logged before its replica died, retried with its
    request ID: the restarted shard (snapshot + log, or with snapshot_every=1 a snapshot
    taken right after it) answers with the same response and applies it once."""
    factory = make_factory(write_data(tmp_path / "data"))
    bodies = turn_bodies(["s0", "s1"], 2)
    directory = tmp_path / "state"
    core = ShardCore(factory(), directory, snapshot_every=snapshot_every)
    opened = core.open("s0", "open-1")
    core.close_files()  # the replica dies before answering the open: the retry gets the same answer, not a 409
    core = ShardCore(factory(), directory, snapshot_every=snapshot_every)
    assert core.open("s0", "open-1") == opened
    first = core.turns([("s0", bodies["s0"][0], "turn-1"), ("s1", bodies["s1"][0], "x")])
    assert isinstance(first[1], RequestError) and first[1].status == 404  # s1 was never opened
    assert core.turns([("s0", bodies["s0"][0], "turn-1")]) == first[:1]  # the same request again
    assert core.server.turn_count("s0") == 1
    core.close_files()  # the replica dies before answering
    restarted = ShardCore(factory(), directory, snapshot_every=snapshot_every)
    assert restarted.turns([("s0", bodies["s0"][0], "turn-1")]) == first[:1]
    assert restarted.server.turn_count("s0") == 1
    second = restarted.turns([("s0", bodies["s0"][1], "turn-2")])  # a new request is applied
    assert restarted.server.turn_count("s0") == 2 and second[0]["turn"] == 1
    assert restarted.close("s0", "close-1") == restarted.close("s0", "close-1") == {"session_id": "s0", "closed": True}
    with pytest.raises(RequestError, match="unknown session"):
        restarted.close("s0", "close-2")
    restarted.close_files()


def test_resizing_two_shards_into_three_moves_every_session_through_its_state(tmp_path):
    factory = make_factory(write_data(tmp_path / "data"), fixed_lag=1)
    sessions = [f"s{i}" for i in range(12)]
    bodies = turn_bodies(sessions, 4)
    expected = reference(factory, bodies, 4)
    cores = [ShardCore(factory(), shard_directory(tmp_path / "old", i), shard=i, shards=2) for i in range(2)]
    for t in range(4):
        for session_id in sessions:
            core = cores[shard_of(session_id, 2)]
            if t == 0:
                core.open(session_id)
            assert core.turns([(session_id, bodies[session_id][t])]) == [expected[session_id][t]]
    before = {}
    for core in cores:
        before.update(read_shard_sessions(core.server))
        core.close_files()
    counts = reshard(tmp_path / "old", tmp_path / "new", 2, 3, factory)
    assert sum(counts.values()) == len(sessions)
    moved = [ShardCore(factory(), shard_directory(tmp_path / "new", j), shard=j, shards=3) for j in range(3)]
    after = {}
    for j, core in enumerate(moved):
        assert all(shard_of(session_id, 3) == j for session_id in core.server.session_ids)
        after.update(read_shard_sessions(core.server))
        for session_id in core.server.session_ids:  # the decoded paths survive the move
            assert core.server.trace(session_id).path_chunk_ids[-1] == expected[session_id][-1]["chunk_id"]
        core.close_files()
    assert after == before
    with pytest.raises(MapMatchedValueError, match="shard layout"):
        ShardCore(factory(), shard_directory(tmp_path / "new", 0), shard=0, shards=2)


def test_bad_turns_are_refused_alone_with_their_status(tmp_path):
    core = ShardCore(make_factory(write_data(tmp_path / "data"))(), max_candidates=3)
    core.open("a")
    requests = [
        ("a", {"query": "cheese milk"}),
        ("nobody", {"query": "cheese"}),
        ("a", {"query": "x", "vector": [1.0]}),
        ("a", {}),
        ("a", {"vector": [float("nan")] * 64}),
        ("a", {"vector": [1.0] * 3}),
        ("a", {"candidates": [{"chunk_id": "nope", "score": 1.0}]}),
        ("a", {"candidates": [{"chunk_id": f"topic0:{i}", "score": 1.0} for i in range(4)]}),
        ("a", "not an object"),
        ("a", {"query": "volcano"}),  # the session's second turn this batch: a later round
    ]
    answers = core.turns(requests)
    statuses = [a.status if isinstance(a, RequestError) else 200 for a in answers]
    assert statuses == [200, 404, 422, 422, 422, 422, 422, 413, 400, 200]
    assert [a.kind for a in answers if isinstance(a, RequestError)] == [
        "unknown_session", "invalid", "invalid", "nonfinite", "wrong_dimension", "unknown_chunk", "oversized", "malformed"]
    assert answers[0]["turn"] == 0 and answers[-1]["turn"] == 1
    with pytest.raises(RequestError, match="already open"):
        core.open("a")
    core.embedder = lambda texts: (_ for _ in ()).throw(RuntimeError("embedder down"))
    broken = core.turns([("a", {"query": "cheese"}), ("a", {"candidates": [{"chunk_id": "topic0:1", "score": 1.0}]})])
    assert broken[0].status == 500 and "embedder down" in broken[0].message and broken[1]["turn"] == 2
    text = render_metrics([({"shard": "0"}, core.state())])
    assert 'mapmatched_errors_total{shard="0",kind="unknown_session"} 1' in text
    assert 'mapmatched_errors_total{shard="0",kind="retrieval_failed"} 1' in text
    assert 'mapmatched_batch_size_bucket{shard="0",le="16"} 2' in text and 'mapmatched_open_sessions{shard="0"} 1' in text


def test_without_ray_the_module_names_the_extra(monkeypatch):
    from mapmatched_torch.integrations import ray_serve

    monkeypatch.setitem(sys.modules, "ray", None)
    clear_cache("ray")
    ray_serve._deployments.cache_clear()
    try:
        with pytest.raises(MissingDependencyError, match=r"mapmatched-torch\[ray\]"):
            ray_serve.build_app(lambda: None)
    finally:
        clear_cache("ray")


# ------------------------------------------------------------------------------ with Ray

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    if not has_module("ray.serve") or not has_module("httpx"):
        pytest.skip("needs ray[serve] (the [ray] extra) and httpx")
    import ray
    from ray import serve

    from mapmatched_torch.integrations.ray_serve import run

    root = tmp_path_factory.mktemp("ray_serve")
    factory = make_factory(write_data(root / "data"))
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             configure_logging=False, runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parents[2])}})
    try:
        handle, url = run(factory, port=free_port(), shards=2, state_dir=str(root / "state"), snapshot_every=25,
                          max_candidates=50, max_body_bytes=20000, max_batch_size=32, batch_wait_timeout_s=0.01)
        yield {"handle": handle, "url": url, "factory": factory}
    finally:
        serve.shutdown()
        ray.shutdown()


async def post_turns(client, url, bodies, t, limit=16):
    """Turn t of every session, at most ``limit`` requests in flight."""
    gate = asyncio.Semaphore(limit)

    async def one(session_id):
        async with gate:
            reply = await client.post(f"{url}/v1/sessions/{session_id}/turns", json=bodies[session_id][t], timeout=60)
            return session_id, reply.status_code, reply.json()

    return await asyncio.gather(*(one(session_id) for session_id in bodies))


def drive(app, sessions, bodies, turns, between=None):
    import httpx

    async def main():
        got = {session_id: [] for session_id in sessions}
        async with httpx.AsyncClient() as client:
            opened = await asyncio.gather(*(client.post(f"{app['url']}/v1/sessions", json={"session_id": s}, timeout=60)
                                            for s in sessions))
            assert [reply.status_code for reply in opened] == [201] * len(sessions)
            for t in range(turns):
                if between is not None:
                    between(t)
                for session_id, status, body in await post_turns(client, app["url"], bodies, t):
                    assert status == 200, body
                    got[session_id].append(body)
        return got

    return asyncio.run(asyncio.wait_for(main(), 240))


def test_two_shards_over_http_equal_one_in_process_server(app):
    sessions = [f"http-{i}" for i in range(60)]
    bodies = turn_bodies(sessions, 5)
    assert drive(app, sessions, bodies, 5) == reference(app["factory"], bodies, 5)
    import httpx

    metrics = httpx.get(f"{app['url']}/metrics", timeout=30).text
    assert 'mapmatched_steps_total{shard="0"}' in metrics and "mapmatched_request_seconds_bucket" in metrics
    assert "mapmatched_batch_size_bucket" in metrics and "mapmatched_open_sessions" in metrics
    health = httpx.get(f"{app['url']}/healthz", timeout=30).json()
    assert health["status"] == "ok" and health["shards"] == 2 and sum(health["open_sessions"]) >= 60


def test_a_killed_shard_replica_restores_and_loses_no_acknowledged_turn(app):
    import ray

    sessions = [f"kill-{i}" for i in range(24)]
    bodies = turn_bodies(sessions, 5)

    def kill(t):
        if t != 3:
            return
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if "mapmatched-shard-0" in a["name"]]
        assert names
        for name in names:
            ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)

    assert drive(app, sessions, bodies, 5, between=kill) == reference(app["factory"], bodies, 5)


def test_every_bad_input_gets_its_4xx(app):
    import httpx

    from mapmatched_torch.integrations.ray_serve import MapMatchedClient, ServeRequestError

    url = app["url"]
    turns = f"{url}/v1/sessions/bad/turns"
    with httpx.Client(timeout=60) as client:
        assert client.post(f"{url}/v1/sessions", json={"session_id": "bad"}).status_code == 201
        cases = [
            (client.post(f"{url}/v1/sessions", json={"session_id": "bad"}), 409, "session_exists"),
            (client.post(f"{url}/v1/sessions", content=b"{not json"), 400, "malformed"),
            (client.post(turns, content=b"{not json"), 400, "malformed"),
            (client.post(f"{url}/v1/sessions/ghost/turns", json={"query": "cheese"}), 404, "unknown_session"),
            (client.delete(f"{url}/v1/sessions/ghost"), 404, "unknown_session"),
            (client.post(turns, json={"query": "a", "vector": [1.0]}), 422, "invalid"),
            (client.post(turns, content=b'{"vector": [NaN' + b", 0.0" * 63 + b"]}"), 422, "nonfinite"),
            (client.post(turns, json={"vector": [1.0, 2.0]}), 422, "wrong_dimension"),
            (client.post(turns, json={"candidates": [{"chunk_id": "nope", "score": 1.0}]}), 422, "unknown_chunk"),
            (client.post(turns, json={"candidates": [{"chunk_id": "topic0:1", "score": 1.0}] * 51}), 413, "oversized"),
            (client.post(turns, json={"query": "x" * 30000}), 413, "oversized"),
        ]
        for reply, status, kind in cases:
            assert (reply.status_code, reply.json()["error"]) == (status, kind), reply.json()
            assert reply.json()["detail"]
        ok = client.post(turns, json={"query": "cheese goat"})  # nothing above changed the session
        assert ok.status_code == 200 and ok.json()["turn"] == 0
        assert client.delete(f"{url}/v1/sessions/bad").status_code == 200
    client = MapMatchedClient(app["handle"])
    assert client.open("handle-1") == {"session_id": "handle-1"}
    assert client.turn("handle-1", query="volcano lava")["turn"] == 0
    with pytest.raises(ServeRequestError) as refused:
        client.turn("handle-1", vector=[float("nan")] * 64)
    assert refused.value.status == 422 and refused.value.body["error"] == "nonfinite"
    assert client.turn("handle-1", candidates=[{"chunk_id": "topic1:2", "score": 1.0}])["turn"] == 1


def test_the_serve_command_names_the_extra_without_ray(monkeypatch, tmp_path, capsys):
    from mapmatched_torch.cli import main

    assert main(["serve", "--help"]) == 0
    assert "--shards" in capsys.readouterr().out
    monkeypatch.setitem(sys.modules, "ray", None)
    clear_cache("ray")
    try:
        assert main(["serve", "--data", str(tmp_path), "--quiet"]) == 2
    finally:
        clear_cache("ray")
    assert "mapmatched-torch[ray]" in capsys.readouterr().err
