"""Reports of an :class:`~mapmatched_torch.eval.summary.EvalResult`: markdown and JSON.

- :func:`to_markdown`: a header (data, slice rule with the entropy threshold, interval
  method, the headline's verdict and how it was chosen, missing gold), the nDCG@3
  table (methods x slices, with intervals), the verdict table (follow-up lift and
  standalone change vs pointwise), with repeated fold splits the repeated
  cross-fitting table (each cross-fitted ranking's mean and range over the splits
  beside its bootstrap interval), and one table per slice (nDCG@3 with its
  interval, the lift, MRR, Recall@10, n).
- :func:`to_json_dict` / :func:`to_json` / :func:`write_json`: everything except the
  per-turn tensors, with sorted keys; NaN and infinities become ``null`` (the output is
  strict JSON).
- :func:`judge`: what both say of a method: ``baseline`` (pointwise, beta = 0),
  ``PASS`` / ``FAIL`` (the interval verdict), or ``UNJUDGED`` when the intervals cannot
  back a verdict; :func:`report_warnings`: the degenerate-data warnings both record.

Example:
    >>> sanitize({"b": float("nan"), "a": (1, float("inf"))})
    {'b': None, 'a': [1, None]}
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, Union

from ..core.errors import MapMatchedValueError
from ..core.files import write_text_atomic
from .bootstrap import BootstrapResult
from .runner import PRIMARY_METRIC, EvalResult, MethodResult
from .selection import SELECTION_METHOD

__all__ = [
    "SLICE_TITLES",
    "STATUSES",
    "Judgement",
    "judge",
    "report_warnings",
    "sanitize",
    "to_json_dict",
    "to_json",
    "write_json",
    "to_markdown",
    "write_markdown",
]

#: Report titles of the slice names.
SLICE_TITLES = {
    "all": "all",
    "follow-up": "follow-up",
    "standalone": "standalone",
    "topic-switch": "topic switch",
    "same-topic": "same topic",
}


#: The verdict words of a report.
STATUSES = ("baseline", "PASS", "FAIL", "UNJUDGED")


class Judgement(NamedTuple):
    """What a report says of one method.

    Attributes:
        status: one of :data:`STATUSES`.
        reason: a one-line explanation starting with the status (the bounds, or why
            the intervals cannot judge).
    """

    status: str
    reason: str


#: Why ``--bootstrap 0`` verdicts are UNJUDGED (asked for: not a warning).
_NO_BOOTSTRAP = "no intervals (--bootstrap 0)"


def _slices_clause(names: List[str], singular: str, plural: str) -> str:
    return f"the {' and '.join(names)} slice{'s ' + plural if len(names) > 1 else ' ' + singular}"


def _unjudged(method: MethodResult) -> Optional[str]:
    """Why the intervals cannot back the method's verdict, or None (a baseline has no verdict to back)."""
    if method.verdict is None:
        return None
    lifts = {name: method.slices[name].lift for name in ("follow-up", "standalone")}
    if any(lift is None or lift.n_resamples == 0 for lift in lifts.values()):
        return _NO_BOOTSTRAP
    empty = [name for name, lift in lifts.items() if lift.n == 0]
    single = [name for name, lift in lifts.items() if lift.n == 1]
    problems = []
    if empty:
        problems.append(f"no intervals: {_slices_clause(empty, 'is empty', 'are empty')}")
    if single:
        problems.append(f"cannot judge: {_slices_clause(single, 'has', 'have')} labelled turns in only 1 "
                        "conversation (zero-width intervals)")
    if not problems and not all(math.isfinite(v) for lift in lifts.values() for v in (lift.low, lift.high)):
        problems.append("no intervals (not finite)")
    if problems:
        return "; ".join(problems)
    followup = lifts["follow-up"]
    if method.verdict.passed and followup.low == followup.high:
        return (f"cannot judge: the follow-up lift interval is zero-width ({followup.low:+.4f}: every resample "
                "gives the same lift), so it cannot show a lift")
    return None


def judge(method: MethodResult) -> Judgement:
    """The report's verdict of one method (see :data:`STATUSES`).

    - ``baseline``: pointwise and map-matching at beta = 0 (no verdict: they are
      what the lifts are measured against);
    - ``UNJUDGED``: the verdict's intervals are missing (``--bootstrap 0``, an empty
      slice), rest on fewer than 2 conversations, or a PASS would rest on a
      zero-width follow-up interval;
    - else ``PASS`` / ``FAIL`` as :func:`~mapmatched_torch.eval.bootstrap.verdict` says.
    """
    verdict = method.verdict
    if verdict is None:
        return Judgement("baseline", "baseline: ranks as pointwise retrieval, the reference of every lift")
    problem = _unjudged(method)
    if problem is None:
        return Judgement("PASS" if verdict.passed else "FAIL", verdict.reason)
    followup, standalone = method.slices["follow-up"].lift, method.slices["standalone"].lift
    estimates = (f"follow-up lift {_number(followup.mean if followup else math.nan, True)}, standalone change "
                 f"{_number(standalone.mean if standalone else math.nan, True)} (point estimates)")
    return Judgement("UNJUDGED", f"UNJUDGED: {problem}; {estimates}")


def _gold_note(info: Dict[str, Any]) -> Optional[str]:
    """The missing-gold warning of ``info["gold_missing"]`` (:func:`~mapmatched_torch.eval.inputs.inputs_from_dataset`), or None."""
    gold = info.get("gold_missing")
    if not gold or not gold.get("missing_judgements"):
        return None
    counts = (f"{gold['missing_judgements']} gold judgement{'s' if gold['missing_judgements'] != 1 else ''} "
              f"({gold['missing_ids']} passage IDs) of {gold['labelled_turns_with_missing']} labelled turns "
              "are not in the corpus")
    empty = gold["labelled_turns_without_gold_in_corpus"]
    if info.get("qrels") == "in-corpus":
        return f"{counts}: --qrels in-corpus dropped them ({empty} turns left without gold are unjudged)"
    return (f"{counts}: they count as misses that no method can retrieve ({empty} turns have no gold in the corpus "
            "at all); --qrels in-corpus drops them")


def report_warnings(result: EvalResult) -> List[str]:
    """The warnings a report records: the result's degenerate-data warnings, then one per
    reason that leaves verdicts UNJUDGED (except ``--bootstrap 0``, which was asked for)."""
    notes = list(result.warnings)
    gold = _gold_note(result.info)
    if gold is not None:
        notes.append(gold)
    counts: Dict[str, int] = {}
    for method in result.methods:
        problem = _unjudged(method)
        if problem is not None and problem != _NO_BOOTSTRAP:
            counts[problem] = counts.get(problem, 0) + 1
    notes += [f"{count} verdict{'s' if count > 1 else ''} UNJUDGED: {problem}" for problem, count in counts.items()]
    return notes


def sanitize(value: Any) -> Any:
    """A JSON-ready copy: NaN/inf -> None, tuples -> lists, dict keys -> str, numbers as float/int."""
    if isinstance(value, dict):
        return {str(key): sanitize(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [sanitize(item) for item in value]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:  # 0-dim tensors / numpy scalars
        return sanitize(value.item())
    raise MapMatchedValueError(f"cannot write {type(value).__name__} to JSON")


def _interval(result: Optional[BootstrapResult]) -> Optional[Dict[str, Any]]:
    return None if result is None else result.to_dict()


def _method_dict(method: MethodResult) -> Dict[str, Any]:
    verdict = method.verdict
    judged = judge(method)
    return {
        "key": method.key,
        "method": method.method,
        "title": method.title,
        "params": method.params,
        "status": judged.status,
        "verdict": None if verdict is None else {
            "status": judged.status, "passed": judged.status == "PASS", "followup_ok": verdict.followup_ok,
            "standalone_ok": verdict.standalone_ok, "tolerance": verdict.tolerance, "reason": judged.reason,
        },
        "slices": {
            name: {
                "n_turns": piece.n_turns, "n_conversations": piece.n_conversations, "means": piece.means,
                "interval": _interval(piece.interval), "lift": _interval(piece.lift),
            }
            for name, piece in method.slices.items()
        },
    }


def _primary_dict(result: EvalResult) -> Dict[str, Any]:
    """The headline: its key, whether it was chosen on the data, and (cross-fitted) each fold's choice."""
    out: Dict[str, Any] = {"key": result.primary, "selected_on_data": result.primary_selected_on_data,
                           "cross_fitted": False}
    row = next((m for m in result.methods if m.key == result.primary), None)
    if row is not None and row.method == SELECTION_METHOD:
        out.update(cross_fitted=True, folds=row.params["folds"], choices=row.params["choices"],
                   candidates=row.params["candidates"])
    return out


def _repeats_dict(repeats: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    if repeats is None:
        return None
    return {
        "seeds": repeats["seeds"], "primary_choices": repeats["primary_choices"],
        "methods": {key: {kind: {name: value.to_dict() for name, value in ranges.items()}
                          for kind, ranges in summary.items()}
                    for key, summary in repeats["methods"].items()},
    }


def to_json_dict(result: EvalResult) -> Dict[str, Any]:
    """The result as plain JSON-ready data (no per-turn tensors)."""
    split = result.split
    return sanitize({
        "name": result.name,
        "info": result.info,
        "config": result.config,
        "primary_metric": PRIMARY_METRIC,
        "entropy_threshold": {"value": result.threshold, "configured": result.threshold_configured},
        "primary": _primary_dict(result),
        "repeats": _repeats_dict(result.repeats),
        "methods": [_method_dict(method) for method in result.methods],
        "skipped": result.skipped,
        "warnings": report_warnings(result),
        "split": None if split is None else {
            "conversation_id": split.conversation_id, "setting": split.setting.to_dict(),
            "chunk_ids": split.chunk_ids, "relevant": split.relevant,
            "weighted_emission": split.weighted_emission, "distance": split.distance,
            "weighted_transition": split.weighted_transition, "cumulative": split.cumulative,
            "pointwise_chunk_ids": split.pointwise_chunk_ids,
        },
        "timings": result.timings,
        "world_size": result.world_size,
    })


def to_json(result: EvalResult, indent: Optional[int] = 2) -> str:
    """Strict JSON text (sorted keys, ``null`` for NaN)."""
    return json.dumps(to_json_dict(result), sort_keys=True, allow_nan=False, indent=indent)


def write_json(result: EvalResult, path: Union[str, Path]) -> Path:
    """Write :func:`to_json` to ``path`` (parents created; atomically, see
    :mod:`mapmatched_torch.core.files`); returns the path."""
    return _write(path, to_json(result) + "\n")


def write_markdown(result: EvalResult, path: Union[str, Path]) -> Path:
    """Write :func:`to_markdown` to ``path`` (parents created; atomically, see
    :mod:`mapmatched_torch.core.files`); returns the path."""
    return _write(path, to_markdown(result))


def _write(path: Union[str, Path], text: str) -> Path:
    return write_text_atomic(path, text)  # a temporary file, then a rename: never a torn report


# --------------------------------------------------------------------------- markdown


def _number(value: float, signed: bool = False) -> str:
    if value is None or not math.isfinite(value):
        return "n/a"
    return f"{value:+.3f}" if signed else f"{value:.3f}"


def _with_interval(result: Optional[BootstrapResult], signed: bool = False) -> str:
    if result is None:
        return ""
    text = _number(result.mean, signed)
    if math.isfinite(result.low) and math.isfinite(result.high):
        text += f" [{_number(result.low, signed)}, {_number(result.high, signed)}]"
    return text


def _table(header: List[str], rows: List[List[str]]) -> List[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _header(result: EvalResult) -> List[str]:
    info, config = result.info, result.config
    facts = [f"{info.get('conversations', '?')} conversations", f"{info.get('turns', '?')} turns"]
    if "labelled_turns" in info:
        facts.append(f"{info['labelled_turns']} labelled")
    facts += [f"{info.get('passages', '?')} passages", f"{info.get('candidates_per_turn', '?')} candidates per turn",
              f"graph: {info.get('graph', '?')}"]
    if "embedder" in info:
        facts.append(f"embedder: {info['embedder']}")
    rule = "given" if result.threshold_configured else "median of the later labelled turns"
    lines = [
        f"# Map-matched retrieval evaluation: {result.name}",
        "",
        ", ".join(facts) + ".",
        "",
        f"Slices (labelled turns only): **follow-up** = a later turn whose emission entropy at lambda = "
        f"{config.get('slice_emission_weight', 1.0):g} is > {_number(result.threshold)} nats ({rule}); "
        "**standalone** = first turns and the other later turns; **topic switch** / **same topic** as labelled.",
        f"Intervals: {config.get('confidence', 0.95):.0%} percentile bootstrap over conversations "
        f"({config.get('n_bootstrap')} resamples, seed {config.get('seed')}); "
        "lift = paired difference to pointwise. Rankings are online (turn t uses turns 0..t).",
    ]
    if result.primary is not None:
        lines += ["", f"**Verdict** for {result.primary} ({_headline_how(result)}): "
                      f"{judge(result.method(result.primary)).reason}."]
    warnings = report_warnings(result)
    if warnings:
        lines += ["", "## Warnings", ""] + [f"- {note}" for note in warnings]
    return lines


def _headline_how(result: EvalResult) -> str:
    """How the headline was chosen, in words."""
    if result.primary_selected_on_data:
        return "best nDCG@3 over all turns, chosen on this data"
    row = result.method(result.primary)
    if row.method != SELECTION_METHOD:
        return "configured"
    picks = ", ".join(f"fold {c['fold']}: {c['method']}" for c in row.params["choices"])
    return (f"cross-fitted, not chosen on the data it is scored on: each fold is ranked by the method with the best "
            f"nDCG@3 on the other folds ({picks})")


def _repeat_cell(value: Any, signed: bool = False) -> str:
    """``mean [min, max]`` of a :class:`~mapmatched_torch.eval.selection.RepeatRange`."""
    if value is None or not math.isfinite(value.mean):
        return "n/a"
    return f"{_number(value.mean, signed)} [{_number(value.low, signed)}, {_number(value.high, signed)}]"


def _repeats_section(result: EvalResult, slices: List[str]) -> List[str]:
    """The repeated cross-fitting table: per cross-fitted ranking, the bootstrap interval of the
    follow-up lift beside the mean [min, max] of its slice lifts over the fold splits."""
    repeats = result.repeats
    if not repeats or not repeats["methods"]:
        return []
    count = len(repeats["seeds"])
    lines = ["", f"## Repeated cross-fitting ({count} fold splits, seeds {repeats['seeds'][0]}..{repeats['seeds'][-1]})",
             "", f"nDCG@3 lift over pointwise: the bootstrap interval of the reported split, then mean [min, max] "
                 f"over the {count} splits (different conversation-to-fold assignments).", ""]
    rows = []
    for key, summary in repeats["methods"].items():
        row = result.method(key)
        cells = [key, _with_interval(row.slices["follow-up"].lift, True)]
        cells += [_repeat_cell(summary["lift"].get(name), True) for name in slices]
        rows.append(cells)
    lines += _table(["method", "follow-up lift (bootstrap)"] + [f"{SLICE_TITLES[s]} lift (splits)" for s in slices],
                    rows)
    if any(choices is not None for choices in repeats["primary_choices"]):
        picks = "; ".join(f"seed {seed}: " + ", ".join(choices) for seed, choices
                          in zip(repeats["seeds"], repeats["primary_choices"]) if choices is not None)
        lines += ["", f"Cross-fitted primary's choices per split (fold order): {picks}."]
    return lines


def to_markdown(result: EvalResult) -> str:
    """The markdown report (see the module docstring)."""
    slices = [name for name in SLICE_TITLES if any(name in m.slices for m in result.methods)]
    lines = _header(result)

    lines += ["", "## nDCG@3 by slice", ""]
    rows = [[m.key] + [_with_interval(m.slices[s].interval) for s in slices] + [judge(m).status]
            for m in result.methods]
    lines += _table(["method"] + [SLICE_TITLES[s] for s in slices] + ["verdict"], rows)

    tolerance = result.config.get("tolerance", 0.0)
    lines += ["", f"## Verdict: follow-up lift > 0, standalone change >= -{tolerance:g} (nDCG@3 vs pointwise)", ""]
    rows = [[m.key, _with_interval(m.slices["follow-up"].lift, True), _with_interval(m.slices["standalone"].lift, True),
             judge(m).status] for m in result.methods if m.slices["follow-up"].lift is not None]
    lines += _table(["method", "follow-up lift", "standalone change", "verdict"], rows)
    lines += _repeats_section(result, slices)

    for name in slices:
        first = result.methods[0].slices[name]
        lines += ["", f"## {SLICE_TITLES[name]} ({first.n_turns} turns, {first.n_conversations} conversations)", ""]
        rows = [[m.key, _with_interval(m.slices[name].interval), _with_interval(m.slices[name].lift, True),
                 _number(m.slices[name].means.get("mrr", math.nan)),
                 _number(m.slices[name].means.get("recall@10", math.nan)), str(m.slices[name].n_turns)]
                for m in result.methods]
        lines += _table(["method", "nDCG@3", "lift", "MRR", "Recall@10", "n"], rows)

    if result.skipped:
        lines += ["", "Skipped: " + "; ".join(f"{name} ({reason})" for name, reason in result.skipped.items()) + "."]
    return "\n".join(lines) + "\n"
