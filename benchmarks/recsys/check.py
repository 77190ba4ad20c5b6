"""Checking a recommender step against float64 numpy, on the rows the steps touch.

`reference_steps` of `jaxembed.workloads` copies every table to float64; at 1e7 rows
that is 5 GB per table for a check that only the touched rows can fail. `touched_reference`
runs the same reference on the touched rows alone (each table cut down to the rows its ids
read, ids renumbered), and `compare` checks an implementation's rows there, and that a sample
of the other rows did not move (table exactly as it was, accumulator zero).

Tolerances (as the TorchRec and keras-rs runners apply them): row-wise Adagrad, every entry of
the tables and accumulators within `rtol` = 1e-4 of the reference (relative to
`max(|ref|, lr)`, see `workloads.compare_tables`); element-wise Adagrad, one entry in 10^6
may pass `rtol` (where a step's |g| is near sqrt(eps) the update is ill-conditioned: see
`kerasrs_runner`; 10^6 entries of the tables, touched or not, as that runner counts them) but
none may be off by more than lr a step. The forward: 1e-5 absolute.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from benchmarks.common.reference import compare_tables, reference_steps
from jaxembed import workloads as W

__all__ = ["Expected", "compare", "touched_reference", "untouched_sample"]

FORWARD_ATOL = 1e-5
RTOL = 1e-4


class Expected(NamedTuple):
    """What a table should hold after the checked steps.

    Attributes:
      rows: the touched rows (sorted ids).
      table: float64 `[U, H]`, those rows after the steps.
      accumulator: float64 `[U]` (row-wise) or `[U, H]` (element-wise Adagrad).
    """

    rows: np.ndarray
    table: np.ndarray
    accumulator: np.ndarray


def _ids(workload: W.Workload, batches: Sequence[W.Batch], table: str) -> np.ndarray:
    out = [np.zeros(0, np.int32)]
    for batch in batches:
        for f in workload.features:
            if f.table == table:
                values, lengths = batch[f.name]
                out.append(values[: int(lengths.sum())])
    return np.concatenate(out)


def touched_reference(
    workload: W.Workload,
    tables: Mapping[str, np.ndarray],
    batches: Sequence[W.Batch],
    cotangent: np.ndarray,
    *,
    optimizer: str,
    lr: float = W.LEARNING_RATE,
    eps: float = W.EPS,
) -> dict[str, Expected]:
    """`workloads.reference_steps` on the rows the batches touch: per table, what they become.

    Args:
      workload, tables, batches, cotangent: the step's inputs (`tables` float32, by name).
      optimizer: `"rowwise_adagrad"` or `"adagrad"`, as `reference_steps`.
      lr, eps: the optimizer's.

    Returns:
      `{table: Expected}` for every table (a table no id reads: its row 0, unchanged).

    Examples:
      >>> w = W.Workload("w", (W.TableSpec("t0", 50, 4),), (W.FeatureSpec("f", "t0"),), 4)
      >>> tables = W.make_tables(w, 0)
      >>> batches, cot = [W.make_batch(w, 0, 0)], W.make_cotangent(w, 0)
      >>> got = touched_reference(w, tables, batches, cot, optimizer="rowwise_adagrad")
      >>> full, acc = reference_steps(w, tables, batches, cot)
      >>> e = got["t0"]
      >>> bool(np.allclose(full["t0"][e.rows], e.table)), bool(np.allclose(acc["t0"][e.rows],
      ...                                                               e.accumulator))
      (True, True)
    """
    rows = {t.name: np.unique(np.append(_ids(workload, batches, t.name), 0))
            for t in workload.tables}  # fmt: skip
    sub = W.Workload(
        workload.name + "[touched]",
        tuple(W.TableSpec(t.name, rows[t.name].size, t.dim) for t in workload.tables),
        workload.features, workload.batch_size,
    )  # fmt: skip
    sub_tables = {t.name: np.asarray(tables[t.name][rows[t.name]]) for t in workload.tables}
    sub_batches = []
    for batch in batches:
        renumbered = {}
        for f in workload.features:
            values, lengths = batch[f.name]
            n = int(lengths.sum())
            local = np.zeros_like(values)
            local[:n] = np.searchsorted(rows[f.table], values[:n])
            renumbered[f.name] = (local, lengths)
        sub_batches.append(renumbered)
    new, state = reference_steps(sub, sub_tables, sub_batches, cotangent, lr, eps,
                                   optimizer=optimizer)  # fmt: skip
    return {t: Expected(rows[t], new[t], state[t]) for t in rows}


def untouched_sample(
    workload: W.Workload, expected: Mapping[str, Expected], tables: Mapping[str, np.ndarray],
    size: int = 1024, seed: int = 0,
) -> dict[str, tuple[np.ndarray, np.ndarray]]:  # fmt: skip
    """Up to `size` rows of each table that no checked step touches, with their values.

    Returns:
      `{table: (rows, float32 [k, H] initial values)}`.
    """
    rng = np.random.default_rng(seed)
    out = {}
    for t in workload.tables:
        draw = rng.integers(0, t.rows, size=min(size * 2, 4 * t.rows))
        free = rng.permutation(np.setdiff1d(draw, expected[t.name].rows))[:size]
        free.sort()
        out[t.name] = (free, np.array(tables[t.name][free]))
    return out


def compare(
    read: Any,
    expected: Mapping[str, Expected],
    untouched: Mapping[str, tuple[np.ndarray, np.ndarray]],
    *,
    optimizer: str,
    steps: int,
    num_table_entries: int,
    lr: float = W.LEARNING_RATE,
) -> dict[str, Any]:
    """An implementation's tables after the checked steps against `expected`.

    Args:
      read: `(table, rows) -> (table rows [U, H], accumulator rows)`.
      expected: from `touched_reference`.
      untouched: from `untouched_sample`.
      optimizer: `"rowwise_adagrad"` (every entry within `RTOL`) or `"adagrad"` (one entry in
        10^6 of the tables may pass it, none by more than `lr` a step).
      steps: the steps run (the element-wise bound is `lr * steps`).
      num_table_entries: the entries of all the tables (rows x dim), touched or not: the
        element-wise rule's 10^6 counts them all, as the keras-rs runner's check does.
      lr: the learning rate.

    Returns:
      The errors (`workloads.compare_tables`' keys, `accumulator_*`, `untouched_*`), the
      tolerance applied and `agrees_with_reference`.
    """
    got_t, got_a, ref_t, ref_a = {}, {}, {}, {}
    moved = 0
    for name, e in expected.items():
        got_t[name], got_a[name] = read(name, e.rows)
        ref_t[name], ref_a[name] = e.table, e.accumulator
        rows, initial = untouched[name]
        if rows.size:
            table, acc = read(name, rows)
            moved += int(np.sum(np.any(table != initial, axis=1)))
            moved += int(np.sum(np.reshape(acc, (rows.size, -1)).any(axis=1)))
    out = compare_tables(got_t, ref_t, floor=lr, rtol=RTOL)
    acc = compare_tables(got_a, ref_a, floor=lr, rtol=RTOL)
    out.update({f"accumulator_{k}": v for k, v in acc.items() if k != "num_entries"})
    out["untouched_rows_checked"] = int(sum(r.size for r, _ in untouched.values()))
    out["untouched_rows_moved"] = moved
    if optimizer == "rowwise_adagrad":
        allowed, bound = 0, None
    else:
        allowed, bound = max(1, num_table_entries // 10**6), lr * steps
    out["tolerance"] = {"rtol": RTOL, "max_entries_over_rtol": allowed, "max_abs_error": bound}
    out["agrees_with_reference"] = bool(
        out["num_over_rtol"] <= allowed and out["accumulator_num_over_rtol"] <= allowed
        and (bound is None or out["max_abs_error"] <= bound) and moved == 0
    )  # fmt: skip
    return out
