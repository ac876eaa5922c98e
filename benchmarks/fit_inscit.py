"""Fitted lambda and beta vs a beta grid on INSCIT dev: held-out nDCG@3 of the decoded path.

Set-up (one process, deterministic for ``--seed``):

- corpus: the 996 passages of ``inscit_dev``; graph: the kNN graph (k = ``--neighbors``,
  cosine distance) over the passage embeddings
  (:func:`mapmatched_torch.graph.knn_graph`, its distances precomputed as a dense table);
- candidates: the top ``--candidates`` passages of a :class:`~mapmatched_torch.providers.dense.DenseProvider`
  (cosine) for each turn's raw query, embedded with the same embedder (wordllama by
  default, ``--embedder hash`` for the dependency-free hash embedder);
- relevant chunks: the turn's qrels (grade > 0).

For each of ``--splits`` seeded random splits of the 86 conversations into a train
half and a held-out half:

- **fitted**: :func:`mapmatched_torch.fit.fit_weights` on the train half (LBFGS on the
  set-valued NLL, no validation split, to convergence) gives (lambda, beta);
- **grid**: lambda = 1 and the beta of {0, 0.25, 0.5, 1, 2} with the best train nDCG@3
  (ties to the smaller beta);
- **retriever**: beta = 0, i.e. the provider's own ranking (the reference row).

Each is scored on the held-out half by nDCG@3 of the decoded path (the decoded chunk
ranked first, then the turn's other candidates by score; ideal DCG over all relevant
passages, so a turn whose gold the provider missed scores 0), over labelled turns, and
on the slices of :mod:`mapmatched_torch.eval.slices`: turn 0 is standalone; a later
turn is a follow-up when its emission entropy (lambda = 1) is above the median of the
held-out later turns, else standalone. The table shows the mean over splits (and the
standard deviation across splits).

Usage::

    python benchmarks/fit_inscit.py                       # wordllama, 10 candidates, 5 splits
    python benchmarks/fit_inscit.py --embedder hash --splits 10
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, NamedTuple, Sequence, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mapmatched_torch.eval import load_directory, make_embedder  # noqa: E402
from mapmatched_torch.eval.slices import emission_entropy, entropy_slices  # noqa: E402
from mapmatched_torch.fit import LabelledBatch, decoded_ndcg_per_turn, fit_weights, pack_conversations  # noqa: E402
from mapmatched_torch.graph import knn_graph  # noqa: E402
from mapmatched_torch.fit.model import MapMatchedModel  # noqa: E402
from mapmatched_torch.providers.dense import DenseProvider  # noqa: E402

GRID = (0.0, 0.25, 0.5, 1.0, 2.0)
SLICES = ("all", "follow-up", "standalone")
RETRIEVER, GRID_BEST, FITTED = "retriever (beta = 0)", "grid-best beta (lambda = 1)", "fitted (lambda, beta)"
DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "inscit_dev"


class Scores(NamedTuple):
    """One method's held-out result on one split."""

    emission_weight: float
    transition_weight: float
    ndcg: Dict[str, float]


def build(data: Path, embedder_kind: str, candidates: int, neighbors: int):
    """(conversations in fit_weights' format, graph, summary line)."""
    dataset = load_directory(data)
    embedder = make_embedder(embedder_kind)
    passages = embedder.encode(dataset.passage_texts)
    graph = knn_graph(passages, dataset.passage_ids, neighbors).precompute_dense()
    provider = DenseProvider(passages, dataset.passage_ids, metric="cosine")
    turns = [turn for conversation in dataset.conversations for turn in conversation.turns]
    results = iter(provider.search(embedder.encode([turn.query for turn in turns]), candidates))
    conversations = [
        [(next(results), set(turn.relevant_ids)) for turn in conversation.turns]
        for conversation in dataset.conversations
    ]
    missing = sum(1 for c in conversations for cands, relevant in c
                  if relevant and not relevant & {candidate.chunk_id for candidate in cands})
    summary = (f"{dataset.name}: {len(conversations)} conversations, {len(turns)} turns, "
               f"{dataset.labelled_turn_count} labelled ({missing} with no relevant passage among the candidates), "
               f"{len(dataset.passages)} passages; embedder "
               f"{embedder!r}; kNN graph k={neighbors}; {candidates} candidates per turn")
    return conversations, graph, summary


def slice_masks(batch: LabelledBatch) -> Dict[str, torch.Tensor]:
    """(B, T) bool masks of the labelled turns of each slice (entropy at lambda = 1)."""
    entropy = emission_entropy(batch.scores, batch.mask, 1.0)
    positions = torch.arange(batch.mask.shape[1])
    slices = entropy_slices(entropy, positions, eligible=batch.labelled)
    return {"all": batch.labelled, "follow-up": slices.followup, "standalone": slices.standalone}


def evaluate(model: MapMatchedModel, batch: LabelledBatch, masks: Dict[str, torch.Tensor]) -> Dict[str, float]:
    values = decoded_ndcg_per_turn(model, batch)
    return {name: float(values[mask].mean()) for name, mask in masks.items()}


def best_grid_beta(train: LabelledBatch) -> float:
    """The grid beta (lambda = 1) with the best train nDCG@3; ties to the smaller beta."""
    labelled = train.labelled
    means = [float(decoded_ndcg_per_turn(MapMatchedModel(1.0, beta), train)[labelled].mean()) for beta in GRID]
    return GRID[max(range(len(GRID)), key=lambda i: (means[i], -i))]


def run_split(conversations: Sequence, graph, split: int, seed: int) -> Tuple[Dict[str, Scores], Dict[str, int]]:
    order = torch.randperm(len(conversations), generator=torch.Generator().manual_seed(seed + split)).tolist()
    half = len(order) // 2
    train_part = [conversations[i] for i in order[:half]]
    test_part = [conversations[i] for i in order[half:]]
    train, test = pack_conversations(train_part, graph), pack_conversations(test_part, graph)
    masks = slice_masks(test)
    fitted = fit_weights(train_part, graph, validation_fraction=0.0, seed=seed + split, progress=False)
    beta = best_grid_beta(train)
    methods = {
        RETRIEVER: (1.0, 0.0),
        GRID_BEST: (1.0, beta),
        FITTED: (fitted.emission_weight, fitted.transition_weight),
    }
    scores = {name: Scores(lam, b, evaluate(MapMatchedModel(lam, b), test, masks)) for name, (lam, b) in methods.items()}
    return scores, {name: int(mask.sum()) for name, mask in masks.items()}


def _mean_sd(values: List[float]) -> str:
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.4f} ± {spread:.4f}"


def report(runs: List[Tuple[Dict[str, Scores], Dict[str, int]]]) -> None:
    counts = {name: statistics.fmean(run[1][name] for run in runs) for name in SLICES}
    print("\nheld-out nDCG@3 of the decoded path (mean ± sd over splits; turns per split: "
          + ", ".join(f"{name} {counts[name]:.0f}" for name in SLICES) + ")\n")
    print("| method | lambda | beta | " + " | ".join(SLICES) + " |")
    print("|---|---|---|" + "---|" * len(SLICES))
    for method in runs[0][0]:
        rows = [run[0][method] for run in runs]
        lam = _mean_sd([row.emission_weight for row in rows])
        beta = _mean_sd([row.transition_weight for row in rows])
        cells = [_mean_sd([row.ndcg[name] for row in rows]) for name in SLICES]
        print(f"| {method} | {lam} | {beta} | " + " | ".join(cells) + " |")
    gaps = [_mean_sd([run[0][FITTED].ndcg[name] - run[0][GRID_BEST].ndcg[name] for run in runs]) for name in SLICES]
    print("| fitted - grid (paired by split) | | | " + " | ".join(gaps) + " |")
    print("\nper split (lambda, beta): " + "; ".join(
        ", ".join(f"{method.split(' ')[0]} ({s.emission_weight:.3g}, {s.transition_weight:.3g})"
                  for method, s in run[0].items() if method != RETRIEVER)
        for run in runs
    ))


def main(argv: Sequence[str] = ()) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="the inscit_dev directory")
    parser.add_argument("--embedder", choices=("wordllama", "hash"), default="wordllama")
    parser.add_argument("--candidates", type=int, default=10, help="candidates per turn (M)")
    parser.add_argument("--neighbors", type=int, default=10, help="k of the kNN graph")
    parser.add_argument("--splits", type=int, default=5, help="random train/held-out splits")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(list(argv) or None)
    start = time.perf_counter()
    conversations, graph, summary = build(args.data, args.embedder, args.candidates, args.neighbors)
    print(summary)
    runs = [run_split(conversations, graph, split, args.seed) for split in range(args.splits)]
    report(runs)
    print(f"\n{time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
