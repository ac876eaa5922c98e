"""PNG plots of an :class:`~mapmatched_torch.eval.summary.EvalResult` (matplotlib, extra ``[plots]``).

- :func:`plot_beta_sweep`: nDCG@3 against beta, one panel per slice, one line per
  (lambda, lag) of the grid with its bootstrap interval as a band; pointwise (beta =
  0) as a dashed line with its band, the geodesic bound (beta -> infinity) dotted.
- :func:`plot_split`: for one conversation, the decoded path's per-turn weighted
  emission (lambda * s, up) and weighted transition cost (beta * d, stacked down
  from the emission's negative part), the running score as a line, and each turn's
  decoded chunk (a check mark when relevant; the pointwise choice when it differs).

Figures are drawn on the Agg canvas directly (``matplotlib.figure.Figure``), so no
global backend is switched and nothing needs a display.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

from ..core.errors import MapMatchedValueError
from ..core.files import atomic_path
from ..core.optional import import_optional
from .report import SLICE_TITLES
from .runner import PRIMARY_METRIC, EvalResult, MethodResult, PathSplit

__all__ = ["plot_beta_sweep", "plot_split", "write_plots"]

PathLike = Union[str, Path]

_TITLE = PRIMARY_METRIC.replace("ndcg", "nDCG")


def _figure(width: float, height: float) -> Any:
    import_optional("matplotlib", "plots", "evaluation plots")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(figure)
    return figure


def _save(figure: Any, path: PathLike) -> Path:
    path = Path(path)
    with atomic_path(path) as temporary:  # a temporary file, then a rename: never a torn PNG
        figure.savefig(temporary, format="png", bbox_inches="tight")
    return path


def _bounds(method: MethodResult, slice_name: str) -> Tuple[float, float, float]:
    piece = method.slices[slice_name].interval
    return piece.mean, piece.low, piece.high


def _sweep_lines(result: EvalResult) -> Dict[Tuple[float, Any], List[MethodResult]]:
    lines: Dict[Tuple[float, Any], List[MethodResult]] = {}
    for method in result.methods:
        if method.method == "map-matched" and method.params["beta"] > 0:
            lines.setdefault((method.params["lambda"], method.params["lag"]), []).append(method)
    for members in lines.values():
        members.sort(key=lambda m: m.params["beta"])
    return lines


def plot_beta_sweep(result: EvalResult, path: PathLike) -> Path:
    """nDCG@3 vs beta per slice with interval bands (see the module docstring); returns the path.

    Raises:
        MapMatchedValueError: the grid has no beta > 0 setting.
    """
    lines = _sweep_lines(result)
    if not lines:
        raise MapMatchedValueError("the beta sweep plot needs map-matched settings with beta > 0")
    slices = [name for name in SLICE_TITLES if name in result.methods[0].slices]
    betas = sorted({m.params["beta"] for members in lines.values() for m in members})
    pointwise = result.method("pointwise")
    geodesic = next((m for m in result.methods if m.method == "geodesic"), None)
    figure = _figure(3.3 * len(slices) + 0.5, 3.6)
    axes = figure.subplots(1, len(slices), sharey=True, squeeze=False)[0]
    palette = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive"]
    for axis, name in zip(axes, slices):
        mean, low, high = _bounds(pointwise, name)
        axis.axhline(mean, color="gray", linestyle="--", linewidth=1.2, label="pointwise (beta = 0)")
        if math.isfinite(low):
            axis.axhspan(low, high, color="gray", alpha=0.15, linewidth=0)
        if geodesic is not None:
            axis.axhline(_bounds(geodesic, name)[0], color="black", linestyle=":", linewidth=1.2,
                         label="geodesic bound (beta -> inf)")
        for color, ((lam, lag), members) in zip(palette * 4, lines.items()):
            xs = [m.params["beta"] for m in members]
            values = [_bounds(m, name) for m in members]
            label = f"lambda={lam:g}, " + ("full" if lag is None else f"lag {lag}")
            axis.plot(xs, [v[0] for v in values], marker="o", markersize=3.5, color=color, label=label)
            lows, highs = [v[1] for v in values], [v[2] for v in values]
            if all(math.isfinite(v) for v in lows + highs):
                axis.fill_between(xs, lows, highs, color=color, alpha=0.18, linewidth=0)
        first = result.methods[0].slices[name]
        axis.set_title(f"{SLICE_TITLES[name]} (n = {first.n_turns})", fontsize=10)
        axis.set_xscale("symlog", linthresh=min(betas))
        axis.set_xticks(betas)
        axis.set_xticklabels([f"{beta:g}" for beta in betas], fontsize=8)
        axis.minorticks_off()
        axis.set_xlabel("beta (transition weight)")
        axis.grid(True, alpha=0.3)
    axes[0].set_ylabel(f"{_TITLE} (mean, {result.config.get('confidence', 0.95):.0%} interval)")
    handles, labels = axes[0].get_legend_handles_labels()
    # to the right of the panels, one entry per line: never over the axis labels, however many lines
    axes[-1].legend(handles, labels, loc="center left", bbox_to_anchor=(1.03, 0.5), fontsize=8, frameon=False)
    figure.suptitle(f"{result.name}: {_TITLE} vs beta by slice (online rankings)", fontsize=11)
    return _save(figure, path)


def plot_split(split: PathSplit, path: PathLike, *, title: Optional[str] = None) -> Path:
    """Per-turn emission vs transition split of one decoded conversation (see the module docstring)."""
    figure = _figure(max(6.0, 0.9 * len(split.chunk_ids) + 2.5), 4.4)
    axis = figure.subplots()
    turns = list(range(len(split.chunk_ids)))
    emission = list(split.weighted_emission)
    cost = [-value for value in split.weighted_transition]
    # transition cost stacked below the emission's negative part
    bottoms = [min(value, 0.0) for value in emission]
    axis.bar(turns, emission, color="tab:blue", label="weighted emission (lambda * s)")
    axis.bar(turns, cost, bottom=bottoms, color="tab:red", label="weighted transition cost (-beta * d)")
    axis.plot(turns, split.cumulative, color="black", marker="o", markersize=3.5, label="cumulative score")
    axis.axhline(0.0, color="gray", linewidth=0.8)
    labels = []
    for turn, chunk, relevant, other in zip(turns, split.chunk_ids, split.relevant, split.pointwise_chunk_ids):
        text = f"{turn}: {chunk}" + (" \u2713" if relevant else "")
        if other != chunk:
            text += f"\n(pointwise: {other})"
        labels.append(text)
    axis.set_xticks(turns)
    axis.set_xticklabels(labels, rotation=35, ha="right", fontsize=7)
    axis.set_xlabel("turn: decoded chunk (\u2713 relevant)")
    axis.set_ylabel("score")
    axis.grid(True, axis="y", alpha=0.3)
    axis.legend(fontsize=8, loc="upper left", frameon=False)
    setting = split.setting.label
    axis.set_title(title or f"conversation {split.conversation_id}: decoded path, emission vs transition ({setting})",
                   fontsize=10)
    return _save(figure, path)


def write_plots(result: EvalResult, directory: PathLike) -> List[Path]:
    """Write ``ndcg_vs_beta.png`` and ``emission_transition_split.png`` (when available) into ``directory``."""
    directory = Path(directory)
    written: List[Path] = []
    if _sweep_lines(result):
        written.append(plot_beta_sweep(result, directory / "ndcg_vs_beta.png"))
    if result.split is not None:
        written.append(plot_split(result.split, directory / "emission_transition_split.png"))
    return written
