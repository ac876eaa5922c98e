"""Serving over Ray: load from bounded async HTTP clients on loopback.

Serves a ``--data`` folder (hash embedder, dense provider, kNN graph: what
``mapmatched-torch serve`` builds) and sends S sessions x T query turns. Each session's
turns go one after another (a turn waits for the previous answer, as a chat does);
at most C requests are in flight. Reports, per configuration, p50 / p99 request
latency, turns per second and the shards' batch-size distribution:

- ``in-process batched``: one ``ShardCore.turns`` call per turn of every session (one
  embed + search + step for all S), no Ray, no HTTP: the floor;
- ``in-process one at a time``: the same turns, one call per request;
- ``ray N shard(s)``: the Ray Serve application over HTTP with C clients;
- ``ray 1 shard, C=1``: one request at a time over HTTP;
- ``recovery`` (``--recovery``): a 1-shard app with a state directory: 8 sessions take
  two turns, the shard's replica is killed (``ray.kill``), and the seconds until the
  next turn is answered are measured, with every session's turn count checked (no
  acknowledged turn lost).

Every configuration first serves 4 warm-up sessions x 1 turn (counted in the batch sizes).

Run:  python benchmarks/serve_load.py --data ../shared/data/inscit_dev --sessions 64 --turns 5 --clients 32
"""

import argparse
import asyncio
import functools
import json
import re
import socket
import statistics
import time
from pathlib import Path

from mapmatched_torch.cli import _serve_parts
from mapmatched_torch.eval.data import load_directory
from mapmatched_torch.integrations._shard import ShardCore


def queries(data, sessions, turns):
    """Session i's T query texts, from the data's conversations (cycled)."""
    conversations = load_directory(data).conversations
    return {f"s{i}": [conversations[i % len(conversations)].turns[t % len(conversations[i % len(conversations)].turns)].query
                      for t in range(turns)] for i in range(sessions)}


def summary(latencies, seconds, turns):
    ordered = sorted(latencies)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return {"p50_ms": 1e3 * statistics.median(ordered), "p99_ms": 1e3 * p99, "turns_per_s": turns / seconds}


def in_process(factory, texts, batched):
    core = ShardCore(factory())
    for session_id, rows in list(texts.items())[:4]:  # the warm-up the Ray runs get too
        core.open("warm-" + session_id)
        core.turns([("warm-" + session_id, {"query": rows[0]})])
    for session_id in texts:
        core.open(session_id)
    turns = len(next(iter(texts.values())))
    latencies, started = [], time.perf_counter()
    for t in range(turns):
        if batched:
            begin = time.perf_counter()
            core.turns([(s, {"query": rows[t]}) for s, rows in texts.items()])
            latencies += [time.perf_counter() - begin] * len(texts)  # every request waits for the whole step
        else:
            for s, rows in texts.items():
                begin = time.perf_counter()
                core.turns([(s, {"query": rows[t]})])
                latencies.append(time.perf_counter() - begin)
    return summary(latencies, time.perf_counter() - started, turns * len(texts))


async def http_load(url, texts, clients, prefix):
    import httpx

    gate = asyncio.Semaphore(clients)
    latencies = []

    async def session(client, session_id, rows):
        async with gate:
            reply = await client.post(f"{url}/v1/sessions", json={"session_id": prefix + session_id}, timeout=60)
            assert reply.status_code == 201, reply.text
        for text in rows:
            async with gate:
                begin = time.perf_counter()
                reply = await client.post(f"{url}/v1/sessions/{prefix}{session_id}/turns", json={"query": text}, timeout=60)
                latencies.append(time.perf_counter() - begin)
                assert reply.status_code == 200, reply.text

    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(limits=limits) as client:
        started = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(session(client, s, rows) for s, rows in texts.items())), 600)
        seconds = time.perf_counter() - started
        metrics = (await client.get(f"{url}/metrics", timeout=60)).text
    result = summary(latencies, seconds, len(latencies))
    result["batch_sizes"] = batch_sizes(metrics)
    return result


def recovery(url, texts):
    """Seconds from killing the only shard's replica to the next answered turn, and
    whether every session's turn count survived."""
    import httpx
    import ray

    sessions = list(texts)[:8]
    with httpx.Client(timeout=60) as client:
        for session_id in sessions:
            assert client.post(f"{url}/v1/sessions", json={"session_id": "r-" + session_id}).status_code == 201
            for t in range(2):
                reply = client.post(f"{url}/v1/sessions/r-{session_id}/turns", json={"query": texts[session_id][t]})
                assert reply.status_code == 200, reply.text
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "mapmatched-shard-0" in a["name"]]
        killed = time.perf_counter()
        for name in names:
            ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        answered, kept = None, False
        while time.perf_counter() - killed < 120:
            reply = client.post(f"{url}/v1/sessions/r-{sessions[0]}/turns", json={"query": texts[sessions[0]][2]})
            if reply.status_code == 200:
                answered = time.perf_counter() - killed
                kept = reply.json()["turn"] == 2
                break
            time.sleep(0.05)
        for session_id in sessions[1:]:
            reply = client.post(f"{url}/v1/sessions/r-{session_id}/turns", json={"query": texts[session_id][2]})
            kept = kept and reply.status_code == 200 and reply.json()["turn"] == 2
    return {"seconds_to_serve_again": answered, "no_turn_lost": bool(answered is not None and kept)}


def batch_sizes(metrics):
    """Batches per size bucket, summed over the shards (from /metrics)."""
    counts = {}
    for shard in sorted(set(re.findall(r'mapmatched_batch_size_bucket\{shard="(\d+)"', metrics))):
        previous = 0
        for bound, value in re.findall(rf'mapmatched_batch_size_bucket\{{shard="{shard}",le="([^"]+)"\}} (\d+)', metrics):
            counts[bound] = counts.get(bound, 0) + int(value) - previous
            previous = int(value)
    return {f"<={bound}": count for bound, count in counts.items() if count}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True)
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--shards", default="1,2")
    parser.add_argument("--json", default=None)
    parser.add_argument("--recovery", action="store_true", help="also measure a killed shard's recovery")
    args = parser.parse_args()
    import ray
    from ray import serve

    from mapmatched_torch.integrations.ray_serve import build_app

    data = str(Path(args.data).resolve())
    factory = functools.partial(_serve_parts, data, "hash", None, None, 10, 10.0, 20, 1.0, None)
    texts = queries(data, args.sessions, args.turns)
    rows = {"in-process batched": in_process(factory, texts, True),
            "in-process one at a time": in_process(factory, texts, False)}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             configure_logging=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    try:
        configs = [(int(n), args.clients) for n in args.shards.split(",")] + [(1, 1)]
        for number, (shards, clients) in enumerate(configs):
            serve.run(build_app(factory, shards=shards), name=f"load{number}", route_prefix="/")
            asyncio.run(http_load(url, {s: rows_[:1] for s, rows_ in list(texts.items())[:4]}, 4, f"warm{number}-"))
            label = f"ray {shards} shard{'s' if shards > 1 else ''}, C={clients}"
            rows[label] = asyncio.run(http_load(url, texts, clients, f"run{number}-"))
            serve.delete(f"load{number}")
        if args.recovery:
            import tempfile

            with tempfile.TemporaryDirectory() as state:
                serve.run(build_app(factory, shards=1, state_dir=state), name="recovery", route_prefix="/")
                recovered = recovery(url, texts)
                serve.delete("recovery")
    finally:
        serve.shutdown()
        ray.shutdown()
    print(f"{args.sessions} sessions x {args.turns} turns, {args.clients} clients, data {Path(data).name}")
    print(f"{'configuration':32} {'p50 ms':>9} {'p99 ms':>9} {'turns/s':>9}  batch sizes")
    for label, row in rows.items():
        print(f"{label:32} {row['p50_ms']:9.1f} {row['p99_ms']:9.1f} {row['turns_per_s']:9.1f}  {row.get('batch_sizes', '')}")
    if args.recovery:
        print(f"recovery: served again {recovered['seconds_to_serve_again']:.2f} s after the kill; "
              f"no acknowledged turn lost: {recovered['no_turn_lost']}")
        rows["recovery"] = recovered
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
