"""The incremental max-plus decoder: a slot table of live conversations on one device.

:class:`SlotDecoder` keeps, for every open conversation (a *slot*), the per-turn state
of the max-plus dynamic program in preallocated tensors, so that a new turn of S
conversations costs one batched M x M step (plus, with a fixed lag L, L more steps to
recompute the uncommitted tail under the new lock) and one batched backtrack -- never
a re-run of earlier turns. The results equal re-decoding every whole trellis with the
standalone decoder (same paths, committed turns, forward scores bit for bit).

State per slot (``C`` slots, ``T`` turn capacity, ``M`` candidates, all on ``device``):

- ``alphas`` (C, T, M): forward scores of every turn, under the current locks;
- ``backpointers`` (C, T, M) long: best predecessor of every candidate;
- ``link_distances`` (C, T, M) float64: the graph distance from each candidate's
  backpointer to it, so the distances along any decoded path are one gather (a decoded
  path always follows the backpointers, also with locks);
- ``emissions`` (C, T, M), ``allowed`` (C, T, M) bool (real candidates and locks);
- ``window`` (C, L+1, M, M) float64 (fixed lag only): distances into the newest L+1
  turns, for the tail recomputation; ``argmax`` (C, T) long (beta = 0 only).

Steps are transactional per conversation: a conversation whose forward scores overflow
gets ``ok = False`` and its slot is left exactly as it was; the others commit.
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Union

import torch
from torch import Tensor

from ..core.checks import check_decode_options, check_positive_int
from ..core.errors import MapMatchedValueError
from . import chain
from .semiring import MAX_PLUS

__all__ = ["SlotDecoder", "SlotStep"]

_INF = float("inf")


class SlotStep(NamedTuple):
    """What :meth:`SlotDecoder.step` returns for S stepping conversations.

    Attributes:
        ok: (S,) bool; False where a forward score overflowed (that slot is unchanged).
        paths: (S, T) long decoded candidate index per turn, -1 after the end.
        path_distances: (S, T) float64 graph distance into each turn along the path
            (0 at turn 0; 0 everywhere when beta = 0).
        final_scores: (S, M) forward scores of the new turn under the locks (-inf at
            padding and locked-out candidates): the ranking of the final candidates.
        lengths: (S,) long number of turns after the step.
    """

    ok: Tensor
    paths: Tensor
    path_distances: Tensor
    final_scores: Tensor
    lengths: Tensor


_STATE_TENSORS = ("alphas", "backpointers", "link_distances", "emissions", "allowed", "argmax", "window", "lengths")


class SlotDecoder:
    """A slot table of incremental max-plus decoders (full or fixed-lag).

    Args:
        width: M, the most candidates per turn (e.g. the retriever's candidate_limit).
        emission_weight, transition_weight: lambda and beta (fixed for the table).
        fixed_lag: None (full decoding) or L >= 0.
        capacity: initial number of slots (grows by doubling).
        turn_capacity: initial turns per slot (grows by doubling).
        dtype: of the scores (float64 for exact parity). device: where the table lives.

    Cost: a step of S conversations is O(S (L+1) M^2) time and one host-device round
    trip; memory O(C T M) plus O(C (L+1) M^2) with a lag.
    """

    def __init__(
        self,
        width: int,
        *,
        emission_weight: float = 1.0,
        transition_weight: float = 1.0,
        fixed_lag: Optional[int] = None,
        capacity: int = 16,
        turn_capacity: int = 8,
        dtype: torch.dtype = torch.float64,
        device: Optional[Union[str, torch.device]] = None,
    ) -> None:
        self.width = check_positive_int(width, "width")
        self.emission_weight, self.transition_weight, self.fixed_lag = check_decode_options(
            emission_weight, transition_weight, fixed_lag
        )
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._free: List[int] = []
        self._allocated = 0
        self._tensors: Dict[str, Tensor] = {}
        self._resize(check_positive_int(capacity, "capacity"), check_positive_int(turn_capacity, "turn_capacity"))

    # ------------------------------------------------------------------ storage

    @property
    def capacity(self) -> int:
        return int(self._tensors["lengths"].shape[0])

    @property
    def turn_capacity(self) -> int:
        return int(self._tensors["alphas"].shape[1])

    def _blank(self, name: str, capacity: int, turns: int) -> Tensor:
        width, window = self.width, (self.fixed_lag if self.fixed_lag is not None else -1) + 1
        shapes = {
            "alphas": ((capacity, turns, width), self.dtype, -_INF),
            "backpointers": ((capacity, turns, width), torch.long, 0),
            "link_distances": ((capacity, turns, width), torch.float64, 0.0),
            "emissions": ((capacity, turns, width), self.dtype, 0.0),
            "allowed": ((capacity, turns, width), torch.bool, False),
            "argmax": ((capacity, turns), torch.long, -1),
            "window": ((capacity, max(window, 0), width, width), torch.float64, 0.0),
            "lengths": ((capacity,), torch.long, 0),
        }
        shape, dtype, fill = shapes[name]
        return torch.full(shape, fill, dtype=dtype, device=self.device)

    def _resize(self, capacity: int, turns: int) -> None:
        for name in _STATE_TENSORS:
            new = self._blank(name, capacity, turns)
            old = self._tensors.get(name)
            if old is not None:
                region = tuple(slice(0, min(a, b)) for a, b in zip(old.shape, new.shape))
                new[region] = old[region]
            self._tensors[name] = new

    def allocate(self) -> int:
        """A fresh, empty slot (grows the table when full)."""
        if self._free:
            slot = self._free.pop()
        else:
            if self._allocated == self.capacity:
                self._resize(2 * self.capacity, self.turn_capacity)
            slot = self._allocated
            self._allocated += 1
        self._clear(slot)
        return slot

    def release(self, slot: int) -> None:
        """Give a slot back; its state is cleared on the next :meth:`allocate`."""
        if not 0 <= slot < self._allocated or slot in self._free:
            raise MapMatchedValueError(f"slot {slot} is not allocated")
        self._free.append(slot)

    def _clear(self, slot: int) -> None:
        for name in _STATE_TENSORS:
            self._tensors[name][slot] = self._blank(name, 1, self.turn_capacity)[0]

    def snapshot(self, slot: int) -> Dict[str, Tensor]:
        """A copy of one slot's state (for :meth:`restore`)."""
        return {name: tensor[slot].clone() for name, tensor in self._tensors.items()}

    def restore(self, slot: int, snapshot: Dict[str, Tensor]) -> None:
        """Put back a :meth:`snapshot` (the table may have grown since)."""
        for name, saved in snapshot.items():
            row = self._blank(name, 1, self.turn_capacity)[0]
            row[tuple(slice(0, size) for size in saved.shape)] = saved
            self._tensors[name][slot] = row

    def length(self, slot: int) -> int:
        """Number of turns decoded in ``slot``."""
        return int(self._tensors["lengths"][slot])

    # ------------------------------------------------------------------- a step

    def step(
        self, slots: Tensor, emissions: Tensor, mask: Tensor, distances: Optional[Tensor] = None
    ) -> SlotStep:
        """Add one turn to each of S distinct slots.

        Args:
            slots: (S,) long distinct allocated slots.
            emissions: (S, M) normalized scores of the new turn (lambda is applied here).
            mask: (S, M) bool real candidates; every row needs at least one.
            distances: (S, M, M) float64 graph distances ``[s, from, to]`` from the
                slot's previous turn to the new one (None when beta = 0 or when no slot
                has a previous turn).

        Returns:
            A :class:`SlotStep`. Slots whose scores overflowed are left unchanged.
        """
        state = self._tensors
        slots = slots.to(self.device)
        count = slots.shape[0]
        if count == 0:
            raise MapMatchedValueError("step needs at least one slot")
        if not bool(mask.any(dim=1).all()):
            raise MapMatchedValueError("every stepping conversation needs at least one candidate")
        lengths = state["lengths"][slots]
        if int(lengths.max()) + 1 > self.turn_capacity:
            self._resize(self.capacity, 2 * self.turn_capacity)
            state = self._tensors
        # shape: (S, M)
        weighted = torch.where(mask, self.emission_weight * emissions.to(self.device, torch.float64), 0.0).to(self.dtype)
        started = lengths > 0
        if self.transition_weight == 0.0 or distances is None:
            distances = torch.zeros((count, self.width, self.width), dtype=torch.float64, device=self.device)
        # shape: (S, M, M)
        distances = distances.to(self.device, torch.float64)
        previous_allowed = state["allowed"][slots, (lengths - 1).clamp_min(0)]
        pairs = previous_allowed.unsqueeze(2) & mask.unsqueeze(1)
        # (-beta) * d == -(beta * d) bit for bit (IEEE multiplication is sign-symmetric): one pass
        transitions = torch.where(pairs, distances * -self.transition_weight, 0.0).to(self.dtype)
        # shape: (S, M): -inf at the previous turn's disallowed candidates, 0 before a first turn
        previous_alpha = torch.where(
            started.unsqueeze(1),
            torch.where(previous_allowed, state["alphas"][slots, (lengths - 1).clamp_min(0)], -_INF),
            0.0,
        )
        step = chain.chain_step(MAX_PLUS, previous_alpha, started, weighted, transitions, mask)
        new = {
            "alpha": step.alpha,
            "backpointers": step.backpointers,
            "links": distances.gather(1, step.backpointers.unsqueeze(1)).squeeze(1),
            "allowed": mask,
            "emissions": weighted,
        }
        nonfinite = step.nonfinite
        turn = lengths
        updates = {}  # (name, turn index tensor) -> (S, M) values, written for ok rows
        argmax = None
        if self.transition_weight == 0.0:
            # beta = 0: the exact per-turn argmax; locks never change a value.
            argmax = torch.where(mask, weighted, -_INF).max(dim=1).indices
            if self.fixed_lag == 0:
                keep = torch.arange(self.width, device=self.device).unsqueeze(0) == argmax.unsqueeze(1)
                new["alpha"] = torch.where(keep, new["alpha"], -_INF)
                new["allowed"] = mask & keep
        elif self.fixed_lag is not None:
            nonfinite = nonfinite | self._commit(slots, lengths, weighted, distances, new, updates)
        ok = ~nonfinite
        window = distances[ok] if self.fixed_lag is not None and self.fixed_lag > 0 else None
        self._write(slots[ok], turn[ok], new, updates, ok, window, argmax)
        return self._result(slots, ok, lengths + 1, new["alpha"])

    def _commit(self, slots, lengths, weighted, distances, new, updates) -> Tensor:
        """Fixed lag: commit turn ``n - L`` and recompute turns ``n-L+1..n`` under the lock."""
        state, lag = self._tensors, self.fixed_lag
        assert lag is not None
        commit = lengths >= lag  # the new turn n = lengths has index >= lag
        window_turns = [(lengths - lag + s).clamp_min(0) for s in range(lag + 1)]
        alphas = [torch.where(state["allowed"][slots, t], state["alphas"][slots, t], -_INF) for t in window_turns[:-1]]
        alphas.append(new["alpha"])
        backpointers = [state["backpointers"][slots, t] for t in window_turns[:-1]] + [new["backpointers"]]
        emissions = [state["emissions"][slots, t] for t in window_turns[:-1]] + [weighted]
        allowed = [state["allowed"][slots, t] for t in window_turns[:-1]] + [new["allowed"]]
        # shape: (S, L+1, M, M)
        ring = state["window"][slots]
        rows = torch.arange(slots.shape[0], device=self.device)
        # window_distances[s] leads from window slot s into slot s + 1; the last one is the new turn's
        window_distances = [
            distances if s == lag - 1 else ring[rows, t % (lag + 1)] for s, t in enumerate(window_turns[1:])
        ]
        transitions = [
            torch.where(
                allowed[s].unsqueeze(2) & allowed[s + 1].unsqueeze(1), -(self.transition_weight * d), 0.0
            ).to(self.dtype)
            for s, d in enumerate(window_distances)
        ]
        tail = chain.commit_tail(
            MAX_PLUS,
            alphas,
            backpointers,
            [torch.where(a, e, 0.0) for a, e in zip(allowed, emissions)],
            transitions,
            allowed,
            commit,
        )
        for s in range(lag):  # window slots that are older turns: rewrite them
            links = window_distances[s - 1].gather(1, tail.backpointers[s].unsqueeze(1)).squeeze(1) if s else None
            updates[s] = (window_turns[s], tail.alphas[s], tail.backpointers[s], links, tail.allowed if s == 0 else None)
        updates["rows"] = commit
        new["alpha"] = tail.alphas[-1]
        new["backpointers"] = tail.backpointers[-1]
        new["links"] = distances.gather(1, tail.backpointers[-1].unsqueeze(1)).squeeze(1)
        if lag == 0:
            new["allowed"] = tail.allowed
        return tail.nonfinite

    def _write(self, slots, turn, new, updates, ok, distances, argmax) -> None:
        state = self._tensors
        state["alphas"][slots, turn] = new["alpha"][ok]
        state["backpointers"][slots, turn] = new["backpointers"][ok]
        state["link_distances"][slots, turn] = new["links"][ok]
        state["allowed"][slots, turn] = new["allowed"][ok]
        state["emissions"][slots, turn] = new["emissions"][ok]
        if argmax is not None:
            state["argmax"][slots, turn] = argmax[ok]
        committing = updates.pop("rows", None)
        # only conversations that committed rewrite older turns (others gathered clamped copies)
        rows = committing[ok] if committing is not None else None
        for turns, alpha, backpointers, links, allowed in updates.values():
            where = (slots[rows], turns[ok][rows])
            state["alphas"][where] = alpha[ok][rows]
            state["backpointers"][where] = backpointers[ok][rows]
            if links is not None:
                state["link_distances"][where] = links[ok][rows]
            if allowed is not None:
                state["allowed"][where] = allowed[ok][rows]
        if self.fixed_lag is not None and self.fixed_lag > 0:
            state["window"][slots, turn % (self.fixed_lag + 1)] = distances
        state["lengths"][slots] = turn + 1

    def _result(self, slots: Tensor, ok: Tensor, lengths: Tensor, final_alpha: Tensor) -> SlotStep:
        state = self._tensors
        turns = self.turn_capacity
        # shape: (S, T)
        advanced = torch.arange(turns, device=self.device).unsqueeze(0) < lengths.unsqueeze(1)
        if self.transition_weight == 0.0:
            paths = torch.where(advanced, state["argmax"][slots], -1)
            distances = torch.zeros(paths.shape, dtype=torch.float64, device=self.device)
        else:
            last = MAX_PLUS.sum(final_alpha, dim=1)[1]
            paths = chain.backtrack(state["backpointers"][slots], advanced, last)
            links = state["link_distances"][slots].gather(2, paths.clamp_min(0).unsqueeze(2)).squeeze(2)
            distances = torch.where(advanced, links, 0.0)
            distances[:, 0] = 0.0
        return SlotStep(ok, paths, distances, final_alpha, lengths)

    # ------------------------------------------------------------- persistence

    def state_dict(self) -> Dict[str, object]:
        """Every tensor of the table (copies on the CPU: later steps do not change them)
        plus the slot bookkeeping."""
        return {
            "tensors": {name: tensor.detach().to("cpu", copy=True) for name, tensor in self._tensors.items()},
            "free": list(self._free),
            "allocated": self._allocated,
            "config": self._config(),
        }

    def _config(self) -> Dict[str, object]:
        """The configuration a saved state must match."""
        return {
            "width": self.width,
            "emission_weight": self.emission_weight,
            "transition_weight": self.transition_weight,
            "fixed_lag": self.fixed_lag,
            "dtype": str(self.dtype).replace("torch.", ""),
        }

    def load_state_dict(self, state: Dict[str, object]) -> None:
        """Restore :meth:`state_dict` (the configuration must match)."""
        config = state["config"]
        mine = self._config()
        if config != mine:
            raise MapMatchedValueError(f"slot decoder configuration differs: saved {config}, this decoder {mine}")
        # copies: two decoders loaded from one state must not write into each other
        self._tensors = {name: tensor.to(self.device, copy=True) for name, tensor in state["tensors"].items()}
        self._free = list(state["free"])
        self._allocated = int(state["allocated"])
