"""Fit lambda and beta by gradient descent, on conversations sampled from known weights.

1. A random corpus graph (a ring with random edge lengths and a few chords).
2. 1500 synthetic conversations of 5 turns x 5 candidates drawn *exactly* from the
   model with lambda = 2.0, beta = 0.6 (forward filtering, backward sampling): the
   relevant chunk of a turn is the sampled path's state; 20% of the turns are left
   unlabelled (the loss marginalizes them out).
3. ``fit_weights`` from lambda = beta = 1.0: full-batch LBFGS through the log-semiring
   partition function, early stopping on a 20% validation split.

Prints the recovered weights, the loss history and the validation nDCG@3 of the decoded
path before and after fitting. Exits non-zero if a weight is off by more than 25%.

Run: python examples/04_fit_weights.py
"""

from __future__ import annotations

import sys

import torch

from mapmatched_torch.fit import fit_weights
from mapmatched_torch.fit.sampling import random_graph, sample_conversations

TRUE_LAMBDA, TRUE_BETA = 2.0, 0.6
TOLERANCE = 0.25


def main() -> int:
    generator = torch.Generator().manual_seed(0)
    graph = random_graph(96, generator=generator)
    data = sample_conversations(
        1500, 5, 5, graph, emission_weight=TRUE_LAMBDA, transition_weight=TRUE_BETA,
        label_probability=0.8, generator=generator,
    )
    result = fit_weights(data.conversations, graph, init_emission_weight=1.0, init_transition_weight=1.0, seed=0)

    print(f"conversations {result.n_conversations} (train {result.n_train_conversations}, validation "
          f"{result.n_validation_conversations}); turns {result.n_turns}: {result.n_labelled_turns} labelled, "
          f"{result.n_unlabelled} unlabelled, {result.n_gold_missing} with the gold missing from the candidates")
    print()
    print(f"{'iteration':>9}  {'train NLL':>10}  {'valid NLL':>10}  {'lambda':>8}  {'beta':>8}")
    for step in result.history:
        print(f"{step.iteration:>9}  {step.train_loss:>10.5f}  {step.validation_loss:>10.5f}  "
              f"{step.emission_weight:>8.4f}  {step.transition_weight:>8.4f}")
    print(f"stopped: {result.stopped}; weights of iteration {result.best_iteration}")
    print()
    print(f"lambda: true {TRUE_LAMBDA:.3f}, fitted {result.emission_weight:.3f}")
    print(f"beta:   true {TRUE_BETA:.3f}, fitted {result.transition_weight:.3f}")
    print(f"validation nDCG@3 of the decoded path: {result.validation_ndcg_before:.4f} (lambda = beta = 1) -> "
          f"{result.validation_ndcg_after:.4f} (fitted)")

    errors = (abs(result.emission_weight / TRUE_LAMBDA - 1.0), abs(result.transition_weight / TRUE_BETA - 1.0))
    if max(errors) > TOLERANCE:
        print(f"FAILED: relative errors {errors[0]:.1%} (lambda), {errors[1]:.1%} (beta) exceed {TOLERANCE:.0%}")
        return 1
    print(f"OK: relative errors {errors[0]:.1%} (lambda), {errors[1]:.1%} (beta)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
