"""Einsum-notation sharding propagation, after PaddlePaddle's SPMD rules.

Every tensor axis gets a letter; tensors that share a letter share that axis. Propagation
*merges* the mesh axes of each letter across tensors, reads back a dims mapping for any
letter string, and marks as *partial* the mesh axes of letters that an output sums away.

    >>> from jaxembed.rules.engine import DistSpec, einsum_rule
    >>> hidden = DistSpec((8, 16, 64), (0, -1, -1))      # [tokens..., k]
    >>> table = DistSpec((1024, 64), (1, -1))            # [j, k], vocab split on mesh axis 1
    >>> info = einsum_rule("abk,jk->abj", hidden, table)  # the tied output projection
    >>> info.outputs[0]
    DistSpec(shape=(8, 16, 1024), dims_mapping=(0, -1, 1), partial_dims=frozenset())

This module is pure Python: it never imports jax.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from jaxembed.layout import DimsEntry, DimsMapping, entry_mesh_axes, normalize_entry

__all__ = [
    "DistSpec",
    "ShardingConflictError",
    "SpmdInfo",
    "dims_mapping_for",
    "einsum_rule",
    "merge_letters",
    "partial_dims_for",
]


class ShardingConflictError(ValueError):
    """Two tensors ask for layouts that cannot both hold.

    Raised when one axis letter is split by two different mesh axes, or one mesh axis splits
    two different letters. The message names the letters, the tensor axes behind them and the
    mesh axis. A `ValueError`, so callers that validate layouts can catch either.

    Examples:
      >>> x = DistSpec((4, 16), (0, -1))           # ids [a, b], a on mesh axis 0
      >>> w = DistSpec((512, 64), (0, -1))         # table [j, k], j on mesh axis 0 too
      >>> einsum_rule("ab,jk->abk", x, w, names=("x", "w"))
      Traceback (most recent call last):
        ...
      jaxembed.rules.engine.ShardingConflictError: Multiple tensor axes [a,j] are sharded by
      the same mesh dimension [0] (a: x axis 0; j: w axis 0); a mesh axis can split only
      one of them
    """


@dataclasses.dataclass(frozen=True)
class DistSpec:
    """A tensor's global shape and its layout over a mesh.

    Plain, frozen data: it prints, compares and hashes. The constructor normalizes its
    fields (`shape` to a tuple of ints, each mapping entry with `normalize_entry`,
    `partial_dims` to a frozenset), so equal layouts compare equal however they are spelled.

    Attributes:
      shape: the global shape.
      dims_mapping: per tensor axis, `-1` (replicated), the index of the mesh axis that
        splits it, or a tuple of mesh-axis indices (major first).
      partial_dims: mesh axes along which every shard holds a partial sum.

    Raises:
      ValueError: a negative partial dim, or a malformed mapping entry.

    Examples:
      >>> ids = DistSpec([4, 1024], [(1,), -1])   # ids f[4, 1024], rows split on mesh axis 1
      >>> ids
      DistSpec(shape=(4, 1024), dims_mapping=(1, -1), partial_dims=frozenset())
      >>> ids == DistSpec((4, 1024), (1, -1)), ids.ndim, ids.mesh_axes()
      (True, 2, frozenset({1}))
    """

    shape: tuple[int, ...]
    dims_mapping: DimsMapping
    partial_dims: frozenset[int] = frozenset()

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(
            self, "dims_mapping", tuple(normalize_entry(e) for e in self.dims_mapping)
        )
        partial = frozenset(int(a) for a in self.partial_dims)
        if any(a < 0 for a in partial):
            raise ValueError(f"partial dims are mesh axis indices >= 0, got {sorted(partial)}")
        object.__setattr__(self, "partial_dims", partial)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def mesh_axes(self) -> frozenset[int]:
        """Every mesh axis that splits some axis of this tensor."""
        return frozenset(a for e in self.dims_mapping for a in entry_mesh_axes(e))


@dataclasses.dataclass(frozen=True)
class SpmdInfo:
    """What a rule inferred: the layouts the inputs must take and the outputs' layouts.

    Every rule (`einsum_rule`, `embedding_forward`, ...) returns one. An input's layout may
    differ from the one given: that is the layout the operation must receive it in.

    Attributes:
      inputs: one `DistSpec` per input, in the rule's argument order.
      outputs: one `DistSpec` per output; partial dims mark outputs still to be summed.

    Examples:
      >>> a = DistSpec((8, 16), (0, 1))            # [a, b]: rows on mesh 0, columns on mesh 1
      >>> b = DistSpec((16, 32), (-1, -1))         # [b, c]: replicated
      >>> info = einsum_rule("ab,bc->ac", a, b)
      >>> info.inputs[1].dims_mapping               # b's rows must follow a's columns
      (1, -1)
      >>> info.outputs[0]                           # b is contracted: partial over mesh 1
      DistSpec(shape=(8, 32), dims_mapping=(0, -1), partial_dims=frozenset({1}))
    """

    inputs: tuple[DistSpec, ...]
    outputs: tuple[DistSpec, ...]


def _describe(where: list[tuple[str, int]]) -> str:
    return ", ".join(f"{name} axis {axis}" for name, axis in where)


def merge_letters(
    operands: Sequence[tuple[str, str, Sequence[DimsEntry]]],
) -> dict[str, DimsEntry]:
    """Merges the mesh axes of each axis letter across tensors (Paddle's ShardingMerge).

    Tensors are walked in order, each axis left to right. A letter seen again keeps its mesh
    axes when they are equal or when either side is replicated (`-1` with `d` gives `d`);
    two different shardings of one letter are a conflict. After the walk, a mesh axis that
    splits two different letters is a conflict.

    Args:
      operands: `(name, letters, dims_mapping)` per tensor; `name` only labels errors.

    Returns:
      letter -> merged dims entry, for every letter seen.

    Raises:
      ShardingConflictError: a letter split by two mesh axes, or a mesh axis on two letters.
      ValueError: letters and dims mapping of different lengths.

    Examples:
      >>> merge_letters([("x", "ab", (0, -1)), ("out", "abk", (-1, 1, -1))])
      {'a': 0, 'b': 1, 'k': -1}
      >>> merge_letters([("x", "ab", (0, -1)), ("y", "ab", (1, -1))])
      Traceback (most recent call last):
        ...
      jaxembed.rules.engine.ShardingConflictError: Tensor axis [a] is sharded by two
      different mesh dimensions [0] and [1] (x axis 0, y axis 0); shard it over one of
      them only
    """
    merged: dict[str, DimsEntry] = {}
    where: dict[str, list[tuple[str, int]]] = {}
    for name, letters, mapping in operands:
        if len(letters) != len(mapping):
            raise ValueError(
                f"{name}: {len(letters)} axis letters {letters!r} for a dims mapping of "
                f"length {len(mapping)} {tuple(mapping)!r}"
            )
        for axis, (letter, entry) in enumerate(zip(letters, mapping, strict=True)):
            entry = normalize_entry(entry)
            where.setdefault(letter, []).append((name, axis))
            old = merged.get(letter, -1)
            if old == -1 or old == entry:
                merged[letter] = entry
            elif entry != -1:
                raise ShardingConflictError(
                    f"Tensor axis [{letter}] is sharded by two different mesh dimensions "
                    f"[{_fmt(old)}] and [{_fmt(entry)}] ({_describe(where[letter])}); "
                    f"shard it over one of them only"
                )
    owners: dict[int, list[str]] = {}
    for letter, entry in merged.items():
        for mesh_axis in entry_mesh_axes(entry):
            owners.setdefault(mesh_axis, []).append(letter)
    for mesh_axis, letters in sorted(owners.items()):
        if len(letters) > 1:
            detail = "; ".join(f"{ltr}: {_describe(where[ltr])}" for ltr in letters)
            raise ShardingConflictError(
                f"Multiple tensor axes [{','.join(letters)}] are sharded by the same mesh "
                f"dimension [{mesh_axis}] ({detail}); a mesh axis can split only one of them"
            )
    return merged


def _fmt(entry: DimsEntry) -> str:
    return ",".join(str(a) for a in entry) if isinstance(entry, tuple) else str(entry)


def dims_mapping_for(letters: str, merged: Mapping[str, DimsEntry]) -> DimsMapping:
    """Reads back a dims mapping for a letter string; unseen letters are replicated.

    Args:
      letters: one letter per tensor axis, e.g. `"abk"`.
      merged: letter -> dims entry, as `merge_letters` returns.

    Returns:
      One entry per letter: `merged[letter]`, or `-1` for a letter not in `merged`.

    Examples:
      >>> merged = merge_letters([("x", "ab", (0, -1)), ("weight", "jk", (-1, 1))])
      >>> dims_mapping_for("abk", merged)          # the lookup's output [a, b, k]
      (0, -1, 1)
      >>> dims_mapping_for("z", merged)
      (-1,)
    """
    return tuple(merged.get(letter, -1) for letter in letters)


def partial_dims_for(
    summed_letters: Iterable[str], merged: Mapping[str, DimsEntry]
) -> frozenset[int]:
    """The mesh axes that split any of the letters an output sums away.

    A contraction over a split letter leaves each shard with the sum over its own slice:
    the output is partial over the mesh axes of that letter.

    Args:
      summed_letters: the letters that appear in the inputs but not in the output.
      merged: letter -> dims entry, as `merge_letters` returns.

    Returns:
      The mesh-axis indices of those letters (empty when none is split).

    Examples:
      >>> merged = {"a": 0, "j": (1, 2), "k": -1}
      >>> partial_dims_for("j", merged), partial_dims_for("k", merged)
      (frozenset({1, 2}), frozenset())
    """
    return frozenset(
        a for letter in summed_letters for a in entry_mesh_axes(merged.get(letter, -1))
    )


def _check_rank(spec: DistSpec, name: str) -> None:
    if len(spec.dims_mapping) != spec.ndim:
        raise ValueError(
            f"The Tensor {name}'s rank [{spec.ndim}] and {name}'s dims_mapping size "
            f"[{len(spec.dims_mapping)}] are not matched: shape {spec.shape}, dims_mapping "
            f"{spec.dims_mapping}"
        )


def einsum_rule(equation: str, *operands: DistSpec, names: Sequence[str] | None = None) -> SpmdInfo:
    """The sharding rule of `jnp.einsum(equation, *operands)`.

    Inputs take the merged layout of their letters; the output's mapping is read back from
    its letters; it is partial over the mesh axes of every contracted letter, and linear in
    each input, so partial sums of the inputs pass through.

    Args:
      equation: `"in1,in2,...->out"`, one letter per axis, no ellipsis.
      *operands: one `DistSpec` per input.
      names: labels for error messages (default `in0, in1, ...`).

    Returns:
      `SpmdInfo` with the inputs' layouts and the single output's.

    Raises:
      ValueError: no `->`, a letter group per operand missing, or letters that do not
        match an operand's rank.
      ShardingConflictError: a letter split by two mesh axes, or a mesh axis on two letters.

    Examples:
      >>> hidden = DistSpec((8, 64), (0, -1))       # f[T, H], tokens on mesh axis 0
      >>> table = DistSpec((1024, 64), (1, -1))     # f[V, H], vocab on mesh axis 1
      >>> einsum_rule("ak,jk->aj", hidden, table).outputs[0]   # logits f[T, V]
      DistSpec(shape=(8, 1024), dims_mapping=(0, 1), partial_dims=frozenset())
      >>> einsum_rule("ak,ak->a", hidden, DistSpec((8, 64), (-1, 1))).outputs[0].partial_dims
      frozenset({1})
    """
    lhs, arrow, out_letters = equation.replace(" ", "").partition("->")
    in_letters = lhs.split(",")
    if not arrow or len(in_letters) != len(operands):
        raise ValueError(
            f"einsum_rule needs an explicit output and one letter group per operand: got "
            f"{equation!r} for {len(operands)} operand(s)"
        )
    names = tuple(names) if names is not None else tuple(f"in{i}" for i in range(len(operands)))
    for spec, letters, name in zip(operands, in_letters, names, strict=True):
        _check_rank(spec, name)
        if len(letters) != spec.ndim:
            raise ValueError(
                f"{name} has rank {spec.ndim} but {len(letters)} letters {letters!r} in "
                f"{equation!r}"
            )
    merged = merge_letters(
        [(n, ltr, s.dims_mapping) for n, ltr, s in zip(names, in_letters, operands, strict=True)]
    )
    sizes: dict[str, int] = {}
    for spec, letters in zip(operands, in_letters, strict=True):
        for letter, size in zip(letters, spec.shape, strict=True):
            sizes.setdefault(letter, size)
    inputs = tuple(
        DistSpec(s.shape, dims_mapping_for(ltr, merged), s.partial_dims)
        for s, ltr in zip(operands, in_letters, strict=True)
    )
    summed = {ltr for letters in in_letters for ltr in letters} - set(out_letters)
    partial = partial_dims_for(sorted(summed), merged)
    for s in operands:
        partial |= s.partial_dims
    out = DistSpec(
        tuple(sizes[ltr] for ltr in out_letters), dims_mapping_for(out_letters, merged), partial
    )
    return SpmdInfo(inputs, (out,))


def as_dist_spec(value: Any, name: str) -> DistSpec:
    """Accepts a `DistSpec` or a `(shape, dims_mapping[, partial_dims])` tuple."""
    if isinstance(value, DistSpec):
        return value
    if isinstance(value, tuple | list) and len(value) in (2, 3):
        return DistSpec(*value)
    raise TypeError(f"{name} must be a DistSpec(shape, dims_mapping, partial_dims), got {value!r}")
