"""Native CPU twins of the shard-local kernels: XLA FFI custom calls compiled on first use.

XLA:CPU runs gather, sort and scatter as single-threaded scalar loops; these kernels do the
same work in C++ (`embedding_kernels.cc`): rows prefetched ahead of use, loops vectorized over
H, slots grouped by row with a radix sort (no comparison sort), the optimizer applied to each
touched row in place. Each function here has the signature and the semantics of its XLA twin
in `jaxembed.kernels.local` / `jaxembed.kernels.sparse`, so a `shard_map` body can call
either; the collectives stay in JAX.

    native                      XLA twin
    gather_rows                 local.gather_rows
    pool_sum, pool_max          local.pool_sum, local.pool_max
    pool_sum_pieces             local.pool_sum_pieces (the table as an all_to_all's pieces)
    scatter_add                 local.scatter_add
    scatter_add_pieces          local.scatter_add_pieces (the grads as an all_to_all's pieces)
    bag_scatter_add             local.bag_scatter_add (local.scatter_add of bag slot grads)
    bag_scatter_add_pieces      local.bag_scatter_add_pieces (into an all_to_all's pieces)
    dedup_rows                  sparse.dedup_rows
    bucket_ids                  local.bucket_ids (the routed exchange's bucketing by owner)
    apply_rows                  sparse.apply_rows (hidden_axes=() only)
    apply_rows_pieces           sparse.apply_rows of the pieces' concatenation (an all_to_all's)
    bag_apply_rows              sparse.bag_apply_rows (sparse.apply_rows of bag slot grads)

Availability: the first call of `available()` (or of a kernel) compiles the library with the
machine's C++ compiler (~15-30 s, then cached: see `jaxembed._native.build`). Without a
compiler, or with `JAXEMBED_NATIVE=0`, `available()` is False, `why_unavailable()` says why and
one `NativeKernelsUnavailable` warning is raised per process; calling a kernel then raises
RuntimeError.

The C++ sources and their build and loader are in `jaxembed._native` (floor 0); `available`,
`why_unavailable`, `supports_dtype` and `TABLE_DTYPES` are its own, re-exported here.

Element types: tables of `TABLE_DTYPES` (float32, bfloat16), read and written in their own
type; gradients of another float type are taken as float32, as the XLA twins take them. A plan
runs these kernels only for such tables (`supports_dtype`; `impl="auto"` runs XLA's kernels for
float16 or float64 tables).

Threads: each kernel call runs on `num_threads()` threads, `JAXEMBED_NUM_THREADS` if set,
else the cores divided by the devices that run the call at once: in a `shard_map` (or under
`jax.set_mesh`) the mesh's devices on this process, `min(mesh.size, jax.local_device_count())`;
elsewhere `jax.local_device_count()`. Simulated CPU devices run their kernels concurrently, so
8 devices on 2 cores get 1 thread each, and a 1-device mesh in the same process gets both. The
value is read when a function is traced (an attribute of the custom call).

Examples:
  >>> import jax.numpy as jnp
  >>> from jaxembed.kernels import local, native
  >>> impl = native if native.available() else local
  >>> impl.gather_rows(jnp.eye(3), jnp.array([2, 0]), jnp.array([True, False])).tolist()
  [[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]
"""

from __future__ import annotations

import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxembed._native import (
    TABLE_DTYPES,
    NativeKernelsUnavailable,
    available,
    build,
    supports_dtype,
    why_unavailable,
)

__all__ = [
    "TABLE_DTYPES",
    "NativeKernelsUnavailable",
    "apply_rows",
    "apply_rows_pieces",
    "available",
    "bag_apply_rows",
    "bag_scatter_add",
    "bag_scatter_add_pieces",
    "bucket_ids",
    "dedup_rows",
    "gather_rows",
    "num_threads",
    "pool_max",
    "pool_sum",
    "pool_sum_pieces",
    "scatter_add",
    "scatter_add_pieces",
    "segments_from_lengths",
    "supports_dtype",
    "why_unavailable",
]


def num_threads() -> int:
    """Threads per kernel call: `$JAXEMBED_NUM_THREADS`, else the cores over the devices that
    run at once (the current mesh's on this process, else all local devices; module
    docstring).

    Raises:
      ValueError: `JAXEMBED_NUM_THREADS` is not an integer in [1, 1024].
    """
    env = os.environ.get("JAXEMBED_NUM_THREADS", "").strip()
    if env:
        try:
            n = int(env)
        except ValueError:
            n = 0
        if not 1 <= n <= 1024:
            raise ValueError(f"JAXEMBED_NUM_THREADS={env!r} must be an integer in [1, 1024]")
        return n
    devices = jax.local_device_count()
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:  # a mesh bigger than this process's devices spans processes
        devices = min(devices, mesh.size)
    return max(1, (os.cpu_count() or 1) // devices)


def _require(kernel: str) -> np.int64:
    why = build.ensure()
    if why is not None:
        raise RuntimeError(
            f"jaxembed.kernels.native.{kernel}: the native kernels are unavailable ({why}); "
            "check native.available() and use the XLA kernels of jaxembed.kernels.local instead"
        )
    return np.int64(num_threads())


def _table(kernel: str, name: str, table: Any) -> None:
    if table.ndim != 2 or not supports_dtype(table.dtype):
        raise TypeError(
            f"{kernel}: {name} must be a 2-D float32 or bfloat16 array [rows, H], got "
            f"{table.dtype}{list(table.shape)}; for other dtypes use the XLA twin in "
            "jaxembed.kernels.local (a plan with impl='auto' or 'xla' does)"
        )


def _grads(kernel: str, name: str, grads: Any) -> Any:
    """`grads` as the kernels read them: float32 or bfloat16 as given, another float type
    (float16, float64) as float32, as the XLA twins compute with it."""
    if not supports_dtype(grads.dtype) and jnp.issubdtype(grads.dtype, jnp.floating):
        grads = grads.astype(jnp.float32)
    _table(kernel, name, grads)
    return grads


def _grad_pieces(kernel: str, pieces: Any, m: int, hidden: int) -> list[Any]:
    """The M slots' gradients as n pieces [C, H] (slot i's in piece i // C), checked to be
    n·C = M rows of `hidden` columns, each as the kernels read it (`_grads`)."""
    pieces = list(pieces)
    want = (m // max(len(pieces), 1), hidden)
    for j, piece in enumerate(pieces):
        if piece.shape != want or len(pieces) * want[0] != m:
            raise ValueError(
                f"{kernel}: piece {j} has shape {piece.shape}; {len(pieces)} pieces for M={m} "
                f"slots and H={hidden} must each be {want}"
            )
    return [_grads(kernel, f"piece {j}", p) for j, p in enumerate(pieces)]


def _bag_slots(kernel: str, local: Any, valid: Any, segments: Any, scale: Any) -> list[Any]:
    """`[local, valid, segments, scale]` as a bag kernel reads them: [M], int32 / bool /
    int32 / float32, checked to have one shape (`_slots`)."""
    args = _slots(kernel, local, valid, ("segments", segments), ("scale", scale))
    args[2], args[3] = args[2].astype(jnp.int32), args[3].astype(jnp.float32)
    return args


def _slots(kernel: str, local: Any, valid: Any, *others: tuple[str, Any]):
    """local, valid (and segments, scale, ...) flattened to [M], checked to have one shape."""
    for name, a in (("valid", valid), *others):
        if a.shape != local.shape:
            raise ValueError(
                f"{kernel}: {name} has shape {a.shape} but local has {local.shape}: every "
                "per-slot operand must have the slots' shape"
            )
    flat = [jnp.reshape(local, -1).astype(jnp.int32), jnp.reshape(valid, -1).astype(bool)]
    return flat + [jnp.reshape(a, -1) for _, a in others]


def _varying(x: Any) -> frozenset[str]:
    axis_type = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(axis_type.varying) if axis_type is not None else frozenset()


def _call(target: str, results, *args, aliases=None, **attrs):
    # Inside a shard_map the results vary over every mesh axis any operand varies over (a
    # custom call's type does not say so by itself); the operands are cast up to that too.
    axes = frozenset().union(*(_varying(a) for a in args))
    if axes:
        args = tuple(
            jax.lax.pcast(a, tuple(sorted(axes - _varying(a))), to="varying")
            if axes - _varying(a) else a
            for a in args
        )  # fmt: skip
    out = jax.ffi.ffi_call(target, results, vmap_method="sequential", input_output_aliases=aliases)(
        *args, **attrs
    )
    if not axes:
        return out
    cast = lambda r: jax.lax.pcast(r, tuple(sorted(axes - _varying(r))), to="varying")
    return tuple(cast(r) for r in out) if isinstance(out, tuple | list) else cast(out)


# --- gather, pool, scatter ---------------------------------------------------------------------


def gather_rows(table: jax.Array, local: jax.Array, valid: jax.Array) -> jax.Array:
    """`table[local]` where valid, zero rows elsewhere: `[*ids, H]`.

    Never `jnp.take`'s default NaN fill: masked slots read nothing and are zeroed (a valid
    slot's row is clipped into `[0, R)`, as the XLA twin's `mode="clip"`).
    """
    threads = _require("gather_rows")
    _table("gather_rows", "table", table)
    flat_local, flat_valid = _slots("gather_rows", local, valid)
    out = jax.ShapeDtypeStruct((flat_local.shape[0], table.shape[1]), table.dtype)
    rows = _call("jaxembed_gather_rows", out, table, flat_local, flat_valid, num_threads=threads)
    return rows.reshape(*local.shape, table.shape[1])


def segments_from_lengths(lengths: jax.Array, capacity: int) -> jax.Array:
    """`jaxembed.ragged.segments_from_lengths` (same arguments, same result) in one pass over
    the slots: the bag of every slot of a flat block, -1 past the bags' total.

    Args:
      lengths: int `[*lead, B]` (negative lengths count as 0).
      capacity: N, the slots per lead element.

    Returns:
      int32 `[*lead, N]`.
    """
    _require("segments_from_lengths")
    lengths = jnp.asarray(lengths)
    lead, num_bags = lengths.shape[:-1], lengths.shape[-1]
    if capacity == 0 or num_bags == 0 or math.prod(lead) == 0:
        return jnp.full((*lead, capacity), -1, jnp.int32)
    clamped = jnp.clip(lengths, 0, capacity).astype(jnp.int32)  # in range before the cast
    out = jax.ShapeDtypeStruct((math.prod(lead), int(capacity)), jnp.int32)
    segments = _call("jaxembed_segments_from_lengths", out, clamped.reshape(-1, num_bags))
    return segments.reshape(*lead, capacity)


def pool_sum(
    table: jax.Array,
    local: jax.Array,
    valid: jax.Array,
    segments: jax.Array,
    scale: jax.Array,
    num_segments: int,
) -> jax.Array:
    """`out[s] = Σ_{i: segments[i] = s, valid[i]} scale[i] · table[local[i]]`, float32.

    Each bag is summed by one thread in slot order (the same order as XLA's segment_sum).

    Args:
      table: f[V_local, H] this device's shard.
      local, valid: int[M], bool[M] from `local_rows` (flattened).
      segments: int[M] in `[0, num_segments)`, or -1 for a slot that belongs to no bag
        (any segment outside `[0, num_segments)` is ignored).
      scale: f32[M] each slot's factor (weights and the combiner's normalization).
      num_segments: the number of bags.

    Returns:
      f32[num_segments, H].
    """
    threads = _require("pool_sum")
    _table("pool_sum", "table", table)
    args = _bag_slots("pool_sum", local, valid, segments, scale)
    out = jax.ShapeDtypeStruct((int(num_segments), table.shape[1]), jnp.float32)
    return _call("jaxembed_pool_sum", out, table, *args, num_threads=threads)


def pool_sum_pieces(
    pieces: Any,
    local: jax.Array,
    valid: jax.Array,
    segments: jax.Array,
    scale: jax.Array,
    num_segments: int,
) -> jax.Array:
    """`pool_sum` over a table held as n pieces f[C, H], row r in piece r // C, read in
    place: the results of an `all_to_all`, which XLA:CPU keeps as separate buffers (a
    `jnp.concatenate` of them would be one more copy of every row). Same result as
    `local.pool_sum_pieces`.

    Args:
      pieces: n arrays f[C, H], one shape and dtype.
      local, valid, segments, scale, num_segments: as `pool_sum` (local < n·C).

    Returns:
      f32[num_segments, H].
    """
    threads = _require("pool_sum_pieces")
    pieces = list(pieces)
    for j, piece in enumerate(pieces):
        _table("pool_sum_pieces", f"piece {j}", piece)
        if piece.shape != pieces[0].shape or piece.dtype != pieces[0].dtype:
            raise ValueError(f"pool_sum_pieces: piece {j} is {piece.dtype}{list(piece.shape)}, "
                             f"piece 0 {pieces[0].dtype}{list(pieces[0].shape)}: pass pieces "
                             "of one shape and dtype")  # fmt: skip
    args = _bag_slots("pool_sum_pieces", local, valid, segments, scale)
    out = jax.ShapeDtypeStruct((int(num_segments), pieces[0].shape[1]), jnp.float32)
    return _call("jaxembed_pool_sum_pieces", out, *args, *pieces, num_threads=threads)


def pool_max(
    table: jax.Array,
    local: jax.Array,
    valid: jax.Array,
    segments: jax.Array,
    num_segments: int,
) -> tuple[jax.Array, jax.Array]:
    """`jaxembed.kernels.local.pool_max` (same arguments and results): each bag's
    element-wise maximum on this shard and the earliest slot that gave it, one thread a bag."""
    threads = _require("pool_max")
    _table("pool_max", "table", table)
    args = _slots("pool_max", local, valid, ("segments", segments))
    args[2] = args[2].astype(jnp.int32)
    shape = (int(num_segments), table.shape[1])
    out = (jax.ShapeDtypeStruct(shape, jnp.float32), jax.ShapeDtypeStruct(shape, jnp.int32))
    maxima, winners = _call("jaxembed_pool_max", out, table, *args, num_threads=threads)
    return maxima, winners


def scatter_add(
    shape: tuple[int, int], local: jax.Array, valid: jax.Array, grads: jax.Array
) -> jax.Array:
    """A zero f32 shard of `shape` with `grads[i]` added at row `local[i]` where valid.

    Args:
      shape: the gradient shard's `(V_local, H_local)`.
      local, valid: int[*ids], bool[*ids].
      grads: f[*ids, H_local].

    Returns:
      f32[V_local, H_local].
    """
    threads = _require("scatter_add")
    rows, hidden = (int(d) for d in shape)
    flat_local, flat_valid = _slots("scatter_add", local, valid)
    if grads.shape != (*local.shape, hidden):
        raise ValueError(
            f"scatter_add: grads has shape {grads.shape}, expected {(*local.shape, hidden)} "
            "(the slots' shape, then the shard's H)"
        )
    grads = _grads("scatter_add", "grads", grads.reshape(-1, hidden))
    out = jax.ShapeDtypeStruct((rows, hidden), jnp.float32)
    return _call("jaxembed_scatter_add", out, flat_local, flat_valid, grads, num_threads=threads)


def scatter_add_pieces(
    shape: tuple[int, int], local: jax.Array, valid: jax.Array, pieces: Any
) -> jax.Array:
    """`scatter_add` with the slots' gradients as n pieces f[C, H] (slot i's in piece
    i // C), read in place: the results of an `all_to_all`, which XLA:CPU keeps as separate
    buffers (their `jnp.concatenate` would be one more copy of every gradient). Same result
    as `local.scatter_add_pieces`.

    Args:
      shape: the gradient shard's `(V_local, H_local)`.
      local, valid: int[M], bool[M] (n·C = M).
      pieces: n arrays f[C, H_local], one shape and dtype.

    Returns:
      f32[V_local, H_local].
    """
    threads = _require("scatter_add_pieces")
    rows, hidden = (int(d) for d in shape)
    flat_local, flat_valid = _slots("scatter_add_pieces", local, valid)
    pieces = _grad_pieces("scatter_add_pieces", pieces, flat_local.shape[0], hidden)
    out = jax.ShapeDtypeStruct((rows, hidden), jnp.float32)
    return _call("jaxembed_scatter_add_pieces", out, flat_local, flat_valid, *pieces,
                 num_threads=threads)  # fmt: skip


def bag_scatter_add(
    shape: tuple[int, int],
    local: jax.Array,
    valid: jax.Array,
    segments: jax.Array,
    scale: jax.Array,
    out_grad: jax.Array,
) -> jax.Array:
    """`scatter_add` of the bag slots' gradients `scale[i] · out_grad[segments[i]]`, fused.

    No `[M, H]` gradient is built: each slot's gradient is made when it is added. A slot whose
    segment is outside `[0, S)` adds nothing. Same result as `local.bag_scatter_add`.

    Args:
      shape: the gradient shard's `(V_local, H)`.
      local, valid, segments, scale: int[M], bool[M], int[M], f32[M] as `pool_sum`.
      out_grad: f[S, H] the pooled output's cotangent.

    Returns:
      f32[V_local, H].
    """
    threads = _require("bag_scatter_add")
    rows, hidden = (int(d) for d in shape)
    out_grad = _grads("bag_scatter_add", "out_grad", out_grad)
    args = _bag_slots("bag_scatter_add", local, valid, segments, scale)
    if out_grad.shape[1] != hidden:
        raise ValueError(f"bag_scatter_add: out_grad {out_grad.shape} must have H={hidden} columns")
    out = jax.ShapeDtypeStruct((rows, hidden), jnp.float32)
    return _call("jaxembed_bag_scatter_add", out, *args, out_grad, num_threads=threads)


def bag_scatter_add_pieces(
    num_pieces: int,
    shape: tuple[int, int],
    local: jax.Array,
    valid: jax.Array,
    segments: jax.Array,
    scale: jax.Array,
    out_grad: jax.Array,
) -> list[jax.Array]:
    """`bag_scatter_add` into `num_pieces` pieces f32[C, H] (`shape` is `(C, H)`), row r in
    piece r // C, written in place: the operands of an `all_to_all`, which XLA:CPU would
    otherwise slice out of one f32[n·C, H] (one more copy of every row). Same result as
    `local.bag_scatter_add_pieces`.

    Returns:
      A list of `num_pieces` arrays f32[C, H].
    """
    threads = _require("bag_scatter_add_pieces")
    rows, hidden = (int(d) for d in shape)
    if num_pieces < 1:
        raise ValueError(f"bag_scatter_add_pieces: num_pieces must be >= 1, got {num_pieces}")
    out_grad = _grads("bag_scatter_add_pieces", "out_grad", out_grad)
    args = _bag_slots("bag_scatter_add_pieces", local, valid, segments, scale)
    if out_grad.shape[1] != hidden:
        raise ValueError(
            f"bag_scatter_add_pieces: out_grad {out_grad.shape} must have H={hidden} columns"
        )
    out = [jax.ShapeDtypeStruct((rows, hidden), jnp.float32)] * int(num_pieces)
    return list(_call("jaxembed_bag_scatter_add_pieces", out, *args, out_grad,
                      num_threads=threads))  # fmt: skip


# --- dedup --------------------------------------------------------------------------------------


def dedup_rows(local: jax.Array, valid: jax.Array, num_rows: int) -> tuple[jax.Array, jax.Array]:
    """`jaxembed.kernels.sparse.dedup_rows` (same arguments, same results, bitwise) by a
    stable radix sort of the slots by row instead of a comparison sort."""
    threads = _require("dedup_rows")
    flat_local, flat_valid = _slots("dedup_rows", local, valid)
    m = flat_local.shape[0]
    out = (jax.ShapeDtypeStruct((m,), jnp.int32), jax.ShapeDtypeStruct((m,), jnp.int32))
    unique, which = _call("jaxembed_dedup_rows", out, flat_local, flat_valid,
                          num_rows=np.int64(num_rows), num_threads=threads)  # fmt: skip
    return unique, which


# --- the routed exchange's bucketing -----------------------------------------------------------


def bucket_ids(
    dest: jax.Array, key: jax.Array, num_buckets: int, capacity: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`jaxembed.kernels.local.bucket_ids` (same arguments, same results, bitwise) without a
    comparison sort of the slots.

    A stable counting sort of the slots by bucket, O(M); then each bucket, on one thread, numbers
    its distinct ids with an open-addressing hash (first occurrence, O(its slots)), sorts only
    those distinct ids (an LSD radix over their span, at most 3 passes of 11 bits; `std::sort`
    when fewer than 128) and gives each slot its id's rank. O(M + D) in all, D the distinct
    (bucket, id) pairs; the buckets are spread over `num_threads()` threads. Slots of bucket
    `num_buckets` are ranked as the XLA twin ranks them (never sent, never an overflow).

    Args:
      dest: i32[M] each slot's bucket in `[0, num_buckets]` (outside it: the call fails with
        an error naming the slot).
      key: i32[M] each slot's id.
      num_buckets: n; capacity: C.

    Returns:
      `(send, pos, overflow)`: i32[n, C], i32[M], bool[] as the XLA twin.
    """
    threads = _require("bucket_ids")
    if dest.ndim != 1 or key.shape != dest.shape:
        raise ValueError(
            f"bucket_ids: dest {dest.shape} and key {key.shape} must be one 1-D shape [M] "
            "(flatten the slots first)"
        )
    n, c = int(num_buckets), int(capacity)
    if n < 1 or c < 1:
        raise ValueError(f"bucket_ids: num_buckets={n} and capacity={c} must be positive")
    m = dest.shape[0]
    out = (
        jax.ShapeDtypeStruct((n, c), jnp.int32),
        jax.ShapeDtypeStruct((m,), jnp.int32),
        jax.ShapeDtypeStruct((), jnp.bool_),
    )
    send, pos, overflow = _call("jaxembed_bucket_ids", out, dest.astype(jnp.int32),
                                key.astype(jnp.int32), num_buckets=np.int64(n),
                                capacity=np.int64(c), num_threads=threads)  # fmt: skip
    return send, pos, overflow


# --- the row-sparse update ---------------------------------------------------------------------


def _update_attrs(formula: Any, hidden_size: int, threads: np.int64) -> dict[str, Any]:
    """The formula's constant hyperparameters, rounded to float32 as jnp rounds them."""
    h = formula.hparams
    b1, b2 = h.get("b1", 0.0), h.get("b2", 0.0)
    q = -h.get("learning_rate_power", -0.5)
    f32 = np.float32
    return dict(
        formula=formula.name,
        num_threads=threads,
        weight_decay=f32(h.get("weight_decay", 0.0)),
        has_weight_decay=np.int64(bool(h.get("weight_decay", 0.0))),
        decoupled=np.int64(h.get("weight_decay_mode") == "decoupled"),
        eps=f32(h.get("eps", 0.0)),
        b1=f32(b1),
        one_minus_b1=f32(1.0 - b1),
        b2=f32(b2),
        one_minus_b2=f32(1.0 - b2),
        hidden=f32(hidden_size),
        q=f32(q),
        l1=f32(h.get("l1", 0.0)),
        two_l2=f32(2.0 * h.get("l2", 0.0)),
        beta=f32(h.get("beta", 0.0)),
        power_mode=np.int64(0 if q == 0.0 else 1 if q == 0.5 else 2),
    )


def _check_update(kernel, formula, table, slots, hidden_size, hidden_axes) -> None:
    if hidden_axes:
        raise ValueError(
            f"{kernel}: hidden_axes={hidden_axes!r}: the native update needs whole rows on "
            "each device (a split hidden axis needs a psum of each row's g²); use "
            "jaxembed.kernels.sparse.apply_rows for it"
        )
    _table(kernel, "table", table)
    if len(slots) != len(formula.slots):
        names = ", ".join(s.name for s in formula.slots) or "none"
        raise ValueError(
            f"{kernel}: {formula.name} takes {len(formula.slots)} state arrays ({names}), got "
            f"{len(slots)}"
        )
    for slot, s in zip(formula.slots, slots, strict=True):
        want = table.shape[:1] if slot.per_row else table.shape
        if s.shape != want or s.dtype != jnp.float32:
            raise ValueError(
                f"{kernel}: state {slot.name!r} is {s.dtype}{list(s.shape)}, expected "
                f"float32{list(want)}"
            )
    if not (isinstance(hidden_size, int | np.integer) and hidden_size >= table.shape[1]):
        raise ValueError(
            f"{kernel}: hidden_size={hidden_size!r} must be the global H, an int >= the local "
            f"columns {table.shape[1]}"
        )


def _update(target, formula, table, slots, count, slot_args, hidden_size):
    threads = _require(target.removeprefix("jaxembed_"))
    slots = tuple(slots)
    first = 1 + len(slot_args)  # scalars, the slot operands, then table and state
    out = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (table, *slots))
    aliases = {first + k: k for k in range(len(out))}
    new = _call(target, out, formula.step_scalars(count), *slot_args, table, *slots,
                aliases=aliases, **_update_attrs(formula, hidden_size, threads))  # fmt: skip
    return new[0], tuple(new[1:])


def apply_rows(
    formula: Any,
    table: jax.Array,
    slots: tuple[jax.Array, ...],
    count: jax.Array,
    local: jax.Array,
    valid: jax.Array,
    grads: jax.Array,
    *,
    hidden_size: int,
    hidden_axes: tuple[str, ...] = (),
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """One row-sparse step on a shard: dedup, gather, the formula, scatter — in place.

    The valid slots are grouped by row (radix sort), each touched row's gradients summed in
    slot order and the formula applied to the row and its state where they lie: the table and
    state are aliased to the results, so under `jit` with donated table and state no copy is
    made. Untouched rows and state stay bitwise unchanged; valid slots whose row is outside
    `[0, V/R)` are dropped.

    Args:
      formula: a `jaxembed.optim.formulas.RowFormula`.
      table: f[V/R, H] this device's shard (float32 or bfloat16).
      slots: the optimizer state, each f32[V/R, H] or f32[V/R] (one per row).
      count: int32[] updates applied before this one.
      local, valid: int32[M], bool[M]: each slot's local row, and whether it is this
        shard's and reads a row.
      grads: f[M, H] each slot's gradient.
      hidden_size: the global H.
      hidden_axes: must be `()` (the hidden axis is not split); kept for the XLA signature.

    Returns:
      The new shard and state.

    Raises:
      ValueError: a split hidden axis, or state that does not fit the formula.
    """
    _check_update("apply_rows", formula, table, slots, hidden_size, hidden_axes)
    flat_local, flat_valid = _slots("apply_rows", local, valid)
    if grads.shape != (flat_local.shape[0], table.shape[1]):
        raise ValueError(
            f"apply_rows: grads has shape {grads.shape}, expected "
            f"{(flat_local.shape[0], table.shape[1])} ([M, H])"
        )
    grads = _grads("apply_rows", "grads", grads)
    slot_args = (flat_local, flat_valid, grads)
    return _update("jaxembed_apply_rows", formula, table, slots, count, slot_args, hidden_size)


def apply_rows_pieces(
    formula: Any,
    table: jax.Array,
    slots: tuple[jax.Array, ...],
    count: jax.Array,
    local: jax.Array,
    valid: jax.Array,
    pieces: Any,
    *,
    hidden_size: int,
    hidden_axes: tuple[str, ...] = (),
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """`apply_rows` with the gradients as n pieces f[C, H] (slot i's in piece i // C), read
    in place: the results of an `all_to_all`, which XLA:CPU keeps as separate buffers (their
    `jnp.concatenate` would be one more copy of every gradient). Same result as `apply_rows`
    of the concatenation.

    Args:
      pieces: n arrays f[C, H], one shape and dtype, n·C = M.
      formula, table, slots, count, local, valid, hidden_size, hidden_axes: as `apply_rows`.
    """
    _check_update("apply_rows_pieces", formula, table, slots, hidden_size, hidden_axes)
    flat_local, flat_valid = _slots("apply_rows_pieces", local, valid)
    pieces = _grad_pieces("apply_rows_pieces", pieces, flat_local.shape[0], table.shape[1])
    slot_args = (flat_local, flat_valid, *pieces)
    return _update("jaxembed_apply_rows_pieces", formula, table, slots, count, slot_args,
                   hidden_size)  # fmt: skip


def bag_apply_rows(
    formula: Any,
    table: jax.Array,
    slots: tuple[jax.Array, ...],
    count: jax.Array,
    local: jax.Array,
    valid: jax.Array,
    segments: jax.Array,
    scale: jax.Array,
    out_grad: jax.Array,
    *,
    hidden_size: int,
    hidden_axes: tuple[str, ...] = (),
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """`apply_rows` of the bag slots' gradients `scale[i] · out_grad[segments[i]]`, fused.

    The backward of a sum / mean / sqrtn bag and the optimizer step in one pass: no `[M, H]`
    gradient is built. A valid slot whose segment is outside `[0, S)` still touches its row,
    with a zero gradient (as `sparse.bag_apply_rows`).

    Args:
      formula, table, slots, count, local, valid, hidden_size, hidden_axes: as `apply_rows`.
      segments: int32[M] each slot's bag.
      scale: f32[M] each slot's factor.
      out_grad: f[S, H] the pooled output's cotangent.

    Returns:
      The new shard and state.

    Raises:
      ValueError: as `apply_rows`.
    """
    _check_update("bag_apply_rows", formula, table, slots, hidden_size, hidden_axes)
    args = _bag_slots("bag_apply_rows", local, valid, segments, scale)
    out_grad = _grads("bag_apply_rows", "out_grad", out_grad)
    if out_grad.shape[1] != table.shape[1]:
        raise ValueError(
            f"bag_apply_rows: out_grad {out_grad.shape} must have the table's H={table.shape[1]}"
        )
    slot_args = (*args, out_grad)
    return _update("jaxembed_bag_apply_rows", formula, table, slots, count, slot_args, hidden_size)
