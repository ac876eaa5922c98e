"""Does a served model rank as the evaluation ranked it? A model directory (``mapmatched-torch fit --out``)
over a ``--data`` folder: every turn of every conversation through ``MapMatchedRetriever.from_pretrained``
sessions and one ``MapMatchedServer.from_pretrained``, compared with the evaluation's online ranking of the
same model (``mapmatched_torch.eval.model_fit.online_rankings``).

    python benchmarks/served_model_parity.py --data INSCIT_DEV --embedder wordllama --model /tmp/model

Prints the turns compared and how many differ (decoded chunk; ranking IDs; scores bit for bit).
"""

from __future__ import annotations

import argparse
import time

from mapmatched_torch import DenseProvider, MapMatchedRetriever, MapMatchedServer, load_model
from mapmatched_torch.eval.candidates import query_texts
from mapmatched_torch.eval.data import load_directory
from mapmatched_torch.eval.embedders import make_embedder
from mapmatched_torch.eval.inputs import inputs_from_dataset
from mapmatched_torch.eval.model_fit import online_rankings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--model", required=True, help="the model directory")
    parser.add_argument("--embedder", default="hash")
    parser.add_argument("--k", type=int, default=10)
    args = parser.parse_args()
    model = load_model(args.model)
    dataset = load_directory(args.data)
    embedder = make_embedder(args.embedder, progress=False)
    inputs = inputs_from_dataset(dataset, embedder, k=args.k, candidates=model.config["candidate_limit"],
                                 maximum_distance=model.fingerprint["graph"]["maximum_distance"], progress=False)
    expected = online_rankings(inputs, model)
    provider = DenseProvider(inputs.passage_embeddings, inputs.passage_ids, lambda q: embedder.encode([q])[0])
    retriever = MapMatchedRetriever.from_pretrained(args.model, graph=inputs.graph, provider=provider,
                                                    embedder=embedder)
    server = MapMatchedServer.from_pretrained(args.model, graph=inputs.graph, provider=provider, embedder=embedder)
    texts = query_texts(dataset)
    sessions = {b: retriever.session() for b in range(len(texts))}
    for b in sessions:
        server.open(b)
    counts = {"turns": 0, "chunk": 0, "ids": 0, "scores": 0}
    started = time.perf_counter()
    for t in range(max(map(len, texts))):
        turn = {b: queries[t] for b, queries in enumerate(texts) if t < len(queries)}
        results, errors = server.step(turn)
        assert not errors, errors
        for b, query in turn.items():
            chunk, ranking = expected[b, t]
            for result in (sessions[b].retrieve(query), results[b]):
                got = [(c.chunk_id, c.trajectory_score) for c in result.candidate_ranking]
                counts["turns"] += 1
                counts["chunk"] += result.chunk_id != chunk
                counts["ids"] += [i for i, _ in got] != [i for i, _ in ranking]
                counts["scores"] += got != ranking
    print(f"{model.method} model, {len(texts)} conversations: {counts['turns']} served turns (sessions + server) "
          f"compared in {time.perf_counter() - started:.1f} s; differing: decoded chunk {counts['chunk']}, "
          f"ranking IDs {counts['ids']}, ranking (IDs, scores) bit for bit {counts['scores']}")


if __name__ == "__main__":
    main()
