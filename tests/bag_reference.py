"""Float64 numpy references of `embedding_bag` and its table gradient, by explicit loops.

Clear over fast, and independent of `jaxembed.ragged`: every bag is read slot by slot in
Python. The semantics (PyTorch's `embedding_bag` for sum / mean / max, TensorFlow's for sqrtn
and the weighted mean / sqrtn):

- dense `x [*batch, L]`: each row of the last axis is a bag; negative ids are empty slots.
- flat `x [*lead, N]` with `lengths [*lead, B]`: bag b is the next `max(lengths[b], 0)` ids,
  cut at N; ids past the total are ignored.
- flat with `offsets [*lead, B]` (bag starts, the last bag runs to N) or `[*lead, B+1]` with
  `include_last_offset`. Offsets are read as under `jit`: clamped to `[0, N]`, the first bag
  starting at 0, each offset at least the one before.
- An id reads a row when `0 <= id < vocab_size` and `id != padding_idx`; the others are
  skipped and not counted. w = `per_id_weights` (1 when None). sum: Σ w e; mean: Σ w e / Σ w;
  sqrtn: Σ w e / √(Σ w²) (0 when the denominator is 0); max: element-wise max over the ids
  that read a row, its gradient to the earliest slot holding the max, column by column. An
  empty bag pools to zeros for every combiner.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

COMBINERS = ("sum", "mean", "sqrtn", "max")


def _bag_bounds_from_lengths(lengths, n):
    bounds, start = [], 0
    for length in lengths:
        length = max(int(length), 0)
        bounds.append((min(start, n), min(start + length, n)))
        start += length
    return bounds


def _bag_bounds_from_offsets(offsets, n, include_last_offset):
    clean, prev = [], 0
    for i, o in enumerate(offsets):
        o = 0 if i == 0 else min(max(int(o), 0), n)
        o = max(o, prev)
        clean.append(o)
        prev = o
    if include_last_offset:
        return list(itertools.pairwise(clean))
    return list(zip(clean, [*clean[1:], n], strict=True))


def iter_bags(x, *, lengths=None, offsets=None, include_last_offset=False):
    """Yields `(out_index, [slot_index, ...])` per bag: where its result goes, which x slots.

    Dense form: out_index indexes `x.shape[:-1]` and negative ids are left out of the slots.
    Flat forms: out_index is `(*lead, b)`; every slot of the bag is listed.
    """
    x = np.asarray(x)
    if lengths is None and offsets is None:
        for idx in np.ndindex(*x.shape[:-1]):
            yield idx, [(*idx, s) for s in range(x.shape[-1]) if x[(*idx, s)] >= 0]
        return
    n = x.shape[-1]
    for lead in np.ndindex(*x.shape[:-1]):
        if lengths is not None:
            bounds = _bag_bounds_from_lengths(np.asarray(lengths)[lead], n)
        else:
            bounds = _bag_bounds_from_offsets(np.asarray(offsets)[lead], n, include_last_offset)
        for b, (start, end) in enumerate(bounds):
            yield (*lead, b), [(*lead, s) for s in range(start, end)]


def _out_lead_shape(x, lengths, offsets, include_last_offset):
    x = np.asarray(x)
    if lengths is None and offsets is None:
        return x.shape[:-1]
    if lengths is not None:
        return np.shape(lengths)
    b = np.shape(offsets)[-1] - (1 if include_last_offset else 0)
    return (*x.shape[:-1], b)


def _bags(table, x, lengths, offsets, per_id_weights, combiner, padding_idx, vocab_size,
          include_last_offset):  # fmt: skip
    """Per bag: out_index and the (id, scale) of each slot that reads a row."""
    if combiner not in COMBINERS:
        raise ValueError(f"unknown combiner {combiner!r}")
    if combiner == "max" and per_id_weights is not None:
        raise ValueError("max takes no per-id weights")
    x = np.asarray(x)
    vocab = table.shape[0] if vocab_size is None else vocab_size
    w_all = None if per_id_weights is None else np.asarray(per_id_weights, np.float64)
    for out_idx, slots in iter_bags(
        x, lengths=lengths, offsets=offsets, include_last_offset=include_last_offset
    ):
        reading = []
        for slot in slots:
            i = int(x[slot])
            if 0 <= i < vocab and i != padding_idx:
                reading.append((i, 1.0 if w_all is None else float(w_all[slot])))
        if combiner == "mean":
            total = sum(w for _, w in reading)
            reading = [(i, w / total if total != 0 else 0.0) for i, w in reading]
        elif combiner == "sqrtn":
            norm = math.sqrt(sum(w * w for _, w in reading))
            reading = [(i, w / norm if norm != 0 else 0.0) for i, w in reading]
        yield out_idx, reading


def embedding_bag_reference(table, x, *, lengths=None, offsets=None, per_id_weights=None,
                            combiner="sum", padding_idx=None, vocab_size=None,
                            include_last_offset=False):  # fmt: skip
    """The pooled bags in float64: `[*batch, H]` (dense form) or `[*lead, B, H]` (flat)."""
    table = np.asarray(table, np.float64)
    hidden = table.shape[1]
    out = np.zeros((*_out_lead_shape(x, lengths, offsets, include_last_offset), hidden))
    for out_idx, reading in _bags(table, x, lengths, offsets, per_id_weights, combiner,
                                  padding_idx, vocab_size, include_last_offset):  # fmt: skip
        if not reading:
            continue  # an empty bag pools to zeros
        if combiner == "max":
            for c in range(hidden):
                out[(*out_idx, c)] = max(table[i, c] for i, _ in reading)
        else:
            for i, scale in reading:
                out[out_idx] += scale * table[i]
    return out


def embedding_bag_grad_reference(table, x, *, out_grad, lengths=None, offsets=None,
                                 per_id_weights=None, combiner="sum", padding_idx=None,
                                 vocab_size=None, include_last_offset=False):  # fmt: skip
    """d(Σ out * out_grad)/d table in float64, shaped like the table."""
    table = np.asarray(table, np.float64)
    out_grad = np.asarray(out_grad, np.float64)
    grad = np.zeros_like(table)
    for out_idx, reading in _bags(table, x, lengths, offsets, per_id_weights, combiner,
                                  padding_idx, vocab_size, include_last_offset):  # fmt: skip
        if combiner == "max":
            for c in range(table.shape[1]):
                if not reading:
                    break
                best = max(table[i, c] for i, _ in reading)
                winner = next(i for i, _ in reading if table[i, c] == best)  # earliest slot
                grad[winner, c] += out_grad[(*out_idx, c)]
        else:
            for i, scale in reading:
                grad[i] += scale * out_grad[out_idx]
    return grad
