"""The float64 check: a step recomputed in float64 numpy, and a result compared with it.

Three forms of the same check. `check` runs one step of a `Variant` (`jaxembed bench sparse |
bags | routed`) and compares its output and rows with `Reference`'s recomputation;
`dense_reference` and `agreement` do it for a whole table (`jaxembed bench`'s layouts);
`reference_pooled`, `reference_steps` and `compare_tables` for the recommender workloads of
`jaxembed.workloads` (`jaxembed bench recsys | planner` and the framework runners, whose
environments have numpy but no jax: this module imports jax only where a function needs it).

A step reads rows of the table (a lookup, or bags pooled by sum), gets the output's
cotangent, and updates every touched row once with the summed gradient of its ids. The
reference reads the touched rows (and a sample of untouched ones) from the devices before
and after one step, shard by shard, and recomputes output and rows in float64 numpy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxembed.workloads import EPS, LEARNING_RATE, Batch, Workload

if TYPE_CHECKING:
    import jax

Variant = Any  # a `benchmarks.common.variants.Variant` (not imported: variants imports this)

__all__ = [
    "Reference", "agreement", "check", "compare_tables", "dense_reference", "exact_cotangent",
    "host_table_rows", "reference_pooled", "reference_steps", "run_checked",
]  # fmt: skip

_SAMPLE_UNTOUCHED = 256  # untouched rows checked to be left exactly as they were


def host_table_rows(table: jax.Array, rows: np.ndarray) -> np.ndarray:
    """`table[rows]` on the host in float64, read shard by shard (the table never gathers).

    Each distinct shard contributes the rows and columns it holds, gathered on its own
    device; replicated shards are read once.
    """
    import jax.numpy as jnp

    rows = np.asarray(rows, np.int64)
    out = np.zeros((rows.size, table.shape[1]), np.float64)
    seen = set()
    for shard in table.addressable_shards:
        index = tuple((s.start or 0, s.stop) for s in shard.index)
        if index in seen:
            continue
        seen.add(index)
        (r0, r1), (c0, c1) = index
        r1 = table.shape[0] if r1 is None else r1
        c1 = table.shape[1] if c1 is None else c1
        here = np.nonzero((rows >= r0) & (rows < r1))[0]
        if here.size:
            got = shard.data[jnp.asarray(rows[here] - r0, jnp.int32)]
            out[here, c0:c1] = np.asarray(got, np.float64)
    return out


@dataclasses.dataclass(frozen=True)
class Reference:
    """A step's inputs as the reference reads them.

    Attributes:
      slot_ids: int64 `[n]`: the logical id of every slot (negative: an empty slot).
      slot_out: int64 `[n]`: the output row (lookup position or bag) each slot adds into.
      ct: float64 `[num_out, H]`: the output's cotangent, one row per output row.
      learning_rate: the optimizer's.
    """

    slot_ids: np.ndarray
    slot_out: np.ndarray
    ct: np.ndarray
    learning_rate: float

    @classmethod
    def lookup(cls, ids: np.ndarray, ct: np.ndarray, learning_rate: float) -> Reference:
        """A plain lookup: one slot per id, one output row per slot."""
        flat = np.asarray(ids, np.int64).reshape(-1)
        ct = np.asarray(ct, np.float64).reshape(flat.size, -1)
        return cls(flat, np.arange(flat.size), ct, learning_rate)

    def touched(self) -> np.ndarray:
        """The distinct ids the step reads and updates, sorted."""
        return np.unique(self.slot_ids[self.slot_ids >= 0])


def _reference_step(ref: Reference, formula: str, eps: float, rows: np.ndarray, ids: np.ndarray):
    """The output and the updated rows `ids` (sorted; the touched ones first among them)."""
    valid = ref.slot_ids >= 0
    pos = np.searchsorted(ids, ref.slot_ids[valid])
    out = np.zeros_like(ref.ct)
    np.add.at(out, ref.slot_out[valid], rows[pos])
    grad = np.zeros_like(rows)
    np.add.at(grad, pos, ref.ct[ref.slot_out[valid]])
    lr = ref.learning_rate
    if formula == "sgd":
        new = rows - lr * grad
    elif formula == "rowwise_adagrad":  # s = 0 before: s = mean(g^2)
        s = np.mean(grad**2, axis=1, keepdims=True)
        new = rows - lr * grad / (np.sqrt(s) + eps)
    elif formula == "adagrad":  # optax.adagrad(initial_accumulator_value=0, eps=0)
        acc = grad**2
        safe = np.where(acc > 0, acc + eps, 1.0)
        new = rows - lr * np.where(acc > 0, grad / np.sqrt(safe), 0.0)
    else:
        raise ValueError(f"unknown formula {formula!r}: sgd, rowwise_adagrad or adagrad")
    return out, new


def check(v: Variant, ref: Reference, *, seed: int = 0) -> dict[str, Any]:
    """Runs one step of `v` and compares it with the float64 reference.

    The output must match (rtol = atol = 1e-5), every touched row must match its reference
    update, and a sample of untouched rows must not have moved at all.

    Returns:
      `{"agrees_with_reference", "max_abs_error_out", "max_abs_error_table",
      "untouched_rows_unchanged", "fallback"}`.
    """
    touched = ref.touched()
    rng = np.random.default_rng(seed)
    num_rows = v.table_of(v.state).shape[0]
    logical_rows = v.vocab or num_rows
    sample = rng.integers(0, logical_rows, size=_SAMPLE_UNTOUCHED)
    sample = np.setdiff1d(sample, touched)
    rows = np.concatenate([touched, sample])
    order = np.argsort(rows)
    rows = rows[order]
    before = host_table_rows(v.table_of(v.state), v.phys(rows))
    out, fallback = v()
    after = host_table_rows(v.table_of(v.state), v.phys(rows))
    ref_out, ref_rows = _reference_step(ref, v.formula, v.eps, before, rows)
    is_touched = np.isin(rows, touched)
    result = agreement(out, ref_out, after[is_touched], ref_rows[is_touched])
    unchanged = bool(np.array_equal(after[~is_touched], before[~is_touched]))
    result["agrees_with_reference"] = result["agrees_with_reference"] and unchanged
    return {**result, "untouched_rows_unchanged": unchanged, "fallback": int(fallback)}


def exact_cotangent(rng: np.random.Generator, shape) -> np.ndarray:
    """A cotangent of multiples of 1/8 in [-2, 2]: its sums are exact in float32, so the
    reference and the step agree on every gradient's sign (Adagrad's g/|g|)."""
    return (rng.integers(-16, 17, size=shape) / 8).astype(np.float32)


def run_checked(
    variants: Sequence[Variant], ref: Reference, host: dict[str, np.ndarray], seed: int
) -> None:
    """Places the inputs for every ready variant, runs and checks each once."""
    from benchmarks.common.compiled import error_record

    for v in variants:
        if not v.ready:
            continue
        v.put_inputs(host)
        try:
            v.result.update(check(v, ref, seed=seed))
            v.result["status"] = "ok"
        except Exception as err:  # a variant that fails to run is a result
            v.result.update(error_record("run", err))
            v.compiled = None


# --- whole tables: the layouts benchmark -------------------------------------------------


def dense_reference(
    table: np.ndarray, ids: np.ndarray, ct: np.ndarray, learning_rate: float
) -> tuple[np.ndarray, np.ndarray]:
    """The lookup's output and the table after one SGD step, on the host in float64.

    Args:
      table: `[V, H]`. ids: `[*batch]`, all in range. ct: the output's cotangent.
      learning_rate: SGD's.

    Returns:
      `(out, new_table)`.
    """
    table64 = table.astype(np.float64)
    grad = np.zeros_like(table64)
    np.add.at(grad, ids.reshape(-1), ct.reshape(-1, table.shape[1]).astype(np.float64))
    return table64[ids], table64 - learning_rate * grad


def agreement(
    out: Any, ref_out: np.ndarray, rows: Any, ref_rows: np.ndarray, *, tol: float = 1e-5
) -> dict[str, Any]:
    """An output and table rows against their float64 references (rtol = atol = `tol`).

    Returns:
      `{"agrees_with_reference", "max_abs_error_out", "max_abs_error_table"}`.
    """
    out = np.asarray(out, np.float64).reshape(ref_out.shape)
    rows = np.asarray(rows, np.float64)
    return {
        "agrees_with_reference": bool(
            np.allclose(out, ref_out, rtol=tol, atol=tol)
            and np.allclose(rows, ref_rows, rtol=tol, atol=tol)
        ),
        "max_abs_error_out": float(np.max(np.abs(out - ref_out), initial=0.0)),
        "max_abs_error_table": float(np.max(np.abs(rows - ref_rows), initial=0.0)),
    }


# --- the recommender workloads --------------------------------------------------------------


def _bag_index(lengths: np.ndarray) -> np.ndarray:
    return np.repeat(np.arange(lengths.shape[0]), lengths)


def reference_pooled(workload: Workload, tables: Mapping[str, np.ndarray], batch: Batch):
    """The forward: float64 `[B, F, dim]`, each bag the sum of its rows."""
    b = workload.batch_size
    out = np.zeros((b, len(workload.features), workload.dim))
    for i, f in enumerate(workload.features):
        values, lengths = batch[f.name]
        ids = values[: int(lengths.sum())]
        np.add.at(out[:, i], _bag_index(lengths), tables[f.table][ids].astype(np.float64))
    return out


def _row_gradients(workload: Workload, batch: Batch, cotangent: np.ndarray, table: str):
    """(unique rows, float64 summed gradients [U, dim]) of one table for one step."""
    ids, grads = [], []
    for i, f in enumerate(workload.features):
        if f.table == table:
            values, lengths = batch[f.name]
            ids.append(values[: int(lengths.sum())])
            grads.append(cotangent[_bag_index(lengths), i])
    ids = np.concatenate(ids)
    rows, inverse = np.unique(ids, return_inverse=True)
    g = np.zeros((rows.size, workload.dim))
    np.add.at(g, inverse, np.concatenate(grads).astype(np.float64))
    return rows, g


def reference_steps(
    workload: Workload,
    tables: Mapping[str, np.ndarray],
    batches: Sequence[Batch],
    cotangent: np.ndarray,
    lr: float = LEARNING_RATE,
    eps: float = EPS,
    *,
    optimizer: str = "rowwise_adagrad",
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Runs the benchmark's step over `batches` in float64 numpy, from `tables`.

    Args:
      workload, tables, batches, cotangent: as `make_*` return them.
      lr, eps: the optimizer's.
      optimizer: `rowwise_adagrad` (FBGEMM's EXACT_ROWWISE_ADAGRAD: `s_r += mean(g_r²)`,
        `w_r -= lr g_r / (sqrt(s_r) + eps)`, s of shape `[rows]`) or `adagrad` (keras' dense
        Adagrad with initial accumulator 0: `s += g²`, `w -= lr g / sqrt(s + eps)` element-wise,
        s of shape `[rows, dim]`; rows no id touches do not move).

    Returns:
      `(tables, accumulators)`, float64, by table name.
    """
    if optimizer not in ("rowwise_adagrad", "adagrad"):
        raise ValueError(f"optimizer must be 'rowwise_adagrad' or 'adagrad', got {optimizer!r}")
    out = {name: np.asarray(w, np.float64).copy() for name, w in tables.items()}
    state = {t.name: np.zeros((t.rows,) if optimizer == "rowwise_adagrad" else (t.rows, t.dim))
             for t in workload.tables}  # fmt: skip
    for batch in batches:
        for t in workload.tables:
            if not any(f.table == t.name for f in workload.features):
                continue
            rows, g = _row_gradients(workload, batch, cotangent, t.name)
            s = state[t.name]
            if optimizer == "rowwise_adagrad":
                s[rows] += np.mean(g * g, axis=1)
                out[t.name][rows] -= lr * g / (np.sqrt(s[rows]) + eps)[:, None]
            else:
                s[rows] += g * g
                out[t.name][rows] -= lr * g / np.sqrt(s[rows] + eps)
    return out, state


def compare_tables(got: Mapping[str, np.ndarray], ref: Mapping[str, np.ndarray],
                   floor: float = LEARNING_RATE, rtol: float = 1e-4) -> dict:  # fmt: skip
    """Errors of `got` against `ref` over all tables in `ref`.

    The relative error is `|got - ref| / max(|ref|, floor)`. The default floor, the learning
    rate, is the size of one Adagrad update (|lr g / sqrt(s)| <= lr a step): the initial
    tables are +-0.01, so entries near zero are common, and their float32 error scales with
    the update, not the entry (a hot row sums thousands of gradients in float32).
    `num_over_rtol` counts the entries whose relative error passes `rtol`.

    Examples:
      >>> compare_tables({"t": np.array([2.002, 0.001])}, {"t": np.array([2.0, 0.0])})
      {'max_abs_error': 0.002, 'max_rel_error': 0.02, 'num_over_rtol': 2, 'num_entries': 2}
    """
    abs_err = rel_err = 0.0
    over = total = 0
    for name, r in ref.items():
        g = np.asarray(got[name], np.float64)
        if g.shape != r.shape:
            raise ValueError(f"table {name!r}: got shape {g.shape}, reference {r.shape}")
        d = np.abs(g - r)
        rel = d / np.maximum(np.abs(r), floor)
        abs_err = max(abs_err, float(d.max(initial=0)))
        rel_err = max(rel_err, float(rel.max(initial=0)))
        over, total = over + int((rel > rtol).sum()), total + rel.size
    return {"max_abs_error": round(abs_err, 12), "max_rel_error": round(rel_err, 9),
            "num_over_rtol": over, "num_entries": total}  # fmt: skip
