"""The float64 reference of a round-2 step, and the check of a `Variant` against it.

A step reads rows of the table (a lookup, or bags pooled by sum), gets the output's
cotangent, and updates every touched row once with the summed gradient of its ids. The
reference reads the touched rows (and a sample of untouched ones) from the devices before
and after one step, shard by shard, and recomputes output and rows in float64 numpy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxembed.bench._run import _error

if TYPE_CHECKING:
    from jaxembed.bench._round2 import Variant

__all__ = ["Reference", "check", "exact_cotangent", "host_table_rows", "run_checked"]

_SAMPLE_UNTOUCHED = 256  # untouched rows checked to be left exactly as they were


def host_table_rows(table: jax.Array, rows: np.ndarray) -> np.ndarray:
    """`table[rows]` on the host in float64, read shard by shard (the table never gathers).

    Each distinct shard contributes the rows and columns it holds, gathered on its own
    device; replicated shards are read once.
    """
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
    got = np.asarray(out, np.float64).reshape(ref_out.shape)
    is_touched = np.isin(rows, touched)
    out_err = float(np.max(np.abs(got - ref_out), initial=0.0))
    table_err = float(np.max(np.abs(after[is_touched] - ref_rows[is_touched]), initial=0.0))
    unchanged = bool(np.array_equal(after[~is_touched], before[~is_touched]))
    agrees = bool(
        np.allclose(got, ref_out, rtol=1e-5, atol=1e-5)
        and np.allclose(after[is_touched], ref_rows[is_touched], rtol=1e-5, atol=1e-5)
        and unchanged
    )
    return {
        "agrees_with_reference": agrees,
        "max_abs_error_out": out_err,
        "max_abs_error_table": table_err,
        "untouched_rows_unchanged": unchanged,
        "fallback": int(fallback),
    }


def exact_cotangent(rng: np.random.Generator, shape) -> np.ndarray:
    """A cotangent of multiples of 1/8 in [-2, 2]: its sums are exact in float32, so the
    reference and the step agree on every gradient's sign (Adagrad's g/|g|)."""
    return (rng.integers(-16, 17, size=shape) / 8).astype(np.float32)


def run_checked(
    variants: Sequence[Variant], ref: Reference, host: dict[str, np.ndarray], seed: int
) -> None:
    """Places the inputs for every ready variant, runs and checks each once."""
    for v in variants:
        if not v.ready:
            continue
        v.put_inputs(host)
        try:
            v.result.update(check(v, ref, seed=seed))
            v.result["status"] = "ok"
        except Exception as err:  # a variant that fails to run is a result
            v.result.update(_error("run", err))
            v.compiled = None
