"""The batch sweep of `jaxembed bench routed`: does the plan pick the faster exchange?

On `rows-on-model` ((data=2, model=4), rows on `model`, ids `[B, S]` on `data`) the gradient
exchange is `rows` (gather ids and out_grad over `data`, bytes ∝ B) or `dense` (all-reduce
the gradient shard, bytes ∝ V): the plan switches as B grows. Each point runs
`benchmarks.layouts.run.run_case` (fwd + bwd + optax SGD, checked against the float64
reference, timed interleaved) with the exchange forced `rows`, forced `dense`, and `auto`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.common.timing import TimingPolicy
from benchmarks.layouts.cases import LAYOUTS, Case

__all__ = ["BATCH_SWEEP_IMPLS", "batch_sweep", "batch_targets"]

BATCH_SWEEP_IMPLS = ("jaxembed", "jaxembed[rows]", "jaxembed[dense]")
"""auto, then the two forced exchanges."""


def batch_sweep(
    batches: Sequence[int],
    *,
    vocab: int,
    hidden: int,
    seq: int,
    timing: TimingPolicy,
    learning_rate: float = 0.1,
    seed: int = 0,
    say: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """One `run_case` record per batch size B (ids `[B, seq]`), with the plan's verdict.

    Each point's `summary` gains `auto_time_ratio_to_best_forced` (auto's median over the
    fastest forced exchange's), `auto_same_program_as` (auto compiles the very program of
    the exchange its plan picked) and `picked_exchange_time_ratio_to_best_forced` (that
    forced program's median over the fastest: the same question without timing one program
    twice).
    """
    from benchmarks.layouts.run import run_case
    from benchmarks.layouts.run import slim as _slim

    say = say or (lambda message: None)
    points = []
    for b in batches:
        case = Case(LAYOUTS["rows-on-model"], vocab, hidden, (b, seq), tag="batch-sweep")
        say(f"batch sweep B={b}")
        record = run_case(case, BATCH_SWEEP_IMPLS, execute=True, timing=timing,
                          learning_rate=learning_rate, seed=seed)  # fmt: skip
        points.append(_slim(record))
        _verdict(points[-1])
    return points


def _ok_median(result: dict[str, Any] | None) -> float | None:
    if not result or not result.get("agrees_with_reference"):
        return None
    return result.get("time_median_in_ms")


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 4)


def _verdict(point: dict[str, Any]) -> None:
    t = {n: _ok_median(point["implementations"].get(n)) for n in BATCH_SWEEP_IMPLS}
    forced = {n: t[n] for n in BATCH_SWEEP_IMPLS[1:] if t[n] is not None}
    best = min(forced.values()) if forced else None
    picked = f"jaxembed[{point['plan'].get('gradient_exchange')}]"
    s = point["summary"]
    s["auto_time_ratio_to_best_forced"] = _ratio(t["jaxembed"], best)
    s["auto_same_program_as"] = picked if picked in forced else None
    s["picked_exchange_time_ratio_to_best_forced"] = _ratio(forced.get(picked), best)


def batch_targets(points: list[dict[str, Any]]) -> dict[str, Any]:
    """The exchange choice's target over the batch: auto within 10% of the fastest forced
    exchange at every B (and the same for the forced program of the plan's pick)."""
    out: dict[str, Any] = {}
    for key, what in (("auto_time_ratio_to_best_forced", "auto / fastest forced"),
                      ("picked_exchange_time_ratio_to_best_forced",
                       "plan's pick (forced) / fastest forced")):  # fmt: skip
        sweep = {p["ids_shape"][0]: p["summary"].get(key) for p in points}
        values = [v for v in sweep.values() if v is not None]
        if sweep:
            out[f"batch sweep: {what}"] = {
                "per_case": {f"B={b}": v for b, v in sweep.items()}, "threshold": 1.1,
                "met": bool(values) and len(values) == len(sweep) and max(values) <= 1.1,
                "where": "rows-on-model (2x4), forced rows and dense",
            }  # fmt: skip
    return out
