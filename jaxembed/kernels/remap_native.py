"""Native CPU twins of the dynamic table's remap: `lookup` and `step` as XLA FFI custom calls.

Same signatures, same checks and the same results, bitwise, as `jaxembed.kernels.remap`
(XLA), whose decisions `jaxembed.dynamic.reference` states one id at a time. The C++ is
`jaxembed/_native/remap_kernels.cc`, compiled with the other native kernels into one library on
first use (`jaxembed._native.build`): where XLA sorts every id twice, it hashes the batch's ids
into an open-addressing table (O(M)), radix-sorts the distinct ids by bucket, and decides each
bucket (lookups, touches, admissions, evictions) in one pass over the buckets in ascending
order, split over the threads in runs of whole buckets (the results do not depend on the
split). `python -m benchmarks.dynamic.throughput` measures it against XLA.

    native              XLA twin
    lookup              remap.lookup
    step                remap.step   (the state's five arrays aliased to the new state's)

Without a compiler (or with `JAXEMBED_NATIVE=0`) `available()` is False and calling these
raises RuntimeError, as `jaxembed.kernels.native` does; the XLA twins always run.

Examples:
  >>> import numpy as np
  >>> from jaxembed.dynamic.config import DynamicTableConfig
  >>> from jaxembed.dynamic.keys import as_keys
  >>> from jaxembed.kernels import remap, remap_native
  >>> impl = remap_native if remap_native.available() else remap
  >>> cfg = DynamicTableConfig(capacity=64, bucket_size=8)
  >>> out = impl.step(cfg, remap.init_state(cfg), as_keys(np.array([3, 9, 3], np.int64)), 0)
  >>> out.found.tolist(), int(out.stats.admitted)
  ([True, True, True], 2)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxembed.dynamic.config import POLICIES, DynamicState, DynamicTableConfig, StepStats
from jaxembed.dynamic.keys import as_keys
from jaxembed.kernels import native
from jaxembed.kernels.remap import Shard, StepResult, check_state, check_step_index

__all__ = ["available", "lookup", "step"]

available = native.available


def _place(config: DynamicTableConfig, shard: Shard | None) -> tuple[jax.Array, np.int64]:
    """The shard's first bucket (an int32 operand) and the table's buckets (0: whole)."""
    if shard is None:
        return jnp.zeros((), jnp.int32), np.int64(0)
    first = jnp.asarray(shard.first_bucket).astype(jnp.int32).reshape(())
    return first, np.int64(shard.num_buckets)


def lookup(
    config: DynamicTableConfig, state: DynamicState, ids: Any, *, check: bool = True,
    shard: Shard | None = None,
) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """`jaxembed.kernels.remap.lookup` (same arguments, same results, bitwise) in C++: each
    id's row (capacity where none) and whether it has one.

    Raises:
      TypeError, ValueError: as the XLA twin; RuntimeError: the native kernels are unavailable.
    """
    check_state(config, state)
    threads = native._require("remap_lookup")
    keys = as_keys(ids, check=check)  # check=False: the caller checked the ids
    batch = keys.shape[:-1]
    flat = keys.reshape(-1, 2)  # uint32[M, 2]
    m = flat.shape[0]
    out = (jax.ShapeDtypeStruct((m,), jnp.int32), jax.ShapeDtypeStruct((m,), jnp.bool_))
    first, total = _place(config, shard)
    rows, found = native._call("jaxembed_remap_lookup", out, flat, state.keys, first,
                               bucket_size=np.int64(config.bucket_size), num_buckets=total,
                               seed=np.int64(config.seed), num_threads=threads)  # fmt: skip
    return rows.reshape(batch), found.reshape(batch)


def step(
    config: DynamicTableConfig,
    state: DynamicState,
    ids: Any,
    step_index: Any,
    *,
    check: bool = True,
    shard: Shard | None = None,
) -> StepResult:
    """`jaxembed.kernels.remap.step` (same arguments, same results, bitwise) in C++.

    The five state arrays are aliased to the new state's: under `jax.jit` with the state
    donated (`donate_argnums`) the step writes them in place, with no copy.

    Raises:
      TypeError, ValueError: as the XLA twin; RuntimeError: the native kernels are unavailable.
    """
    check_state(config, state)
    t = check_step_index(step_index)
    threads = native._require("remap_step")
    keys = as_keys(ids, check=check)  # check=False: the caller checked the ids
    batch = keys.shape[:-1]
    flat = keys.reshape(-1, 2)  # uint32[M, 2]
    m = flat.shape[0]
    like = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype)
    out = (
        *(like(a.shape, a.dtype) for a in state),
        like((m,), jnp.int32),  # rows
        like((m,), jnp.bool_),  # found
        like((6,), jnp.int32),  # stats
        like((m,), jnp.int32),  # reset_rows
        like((m, 2), jnp.uint32),  # evicted_keys
    )
    aliases = {3 + k: k for k in range(len(state))}  # operands: ids, t, first, then the state
    first, total = _place(config, shard)
    res = native._call(
        "jaxembed_remap_step", out, flat, t, first, *state, aliases=aliases,
        bucket_size=np.int64(config.bucket_size),
        num_buckets=total,
        admit_after=np.int64(config.admit_after),
        policy=np.int64(POLICIES.index(config.policy)),
        ttl_steps=np.int64(config.ttl_steps or 0),
        sketch_window=np.int64(config.sketch_window),
        halve=np.int64(shard is None),
        seed=np.int64(config.seed),
        num_threads=threads,
    )  # fmt: skip
    new_state = DynamicState(*res[:5])
    rows, found, stats, reset_rows, evicted_keys = res[5:]
    return StepResult(new_state, rows.reshape(batch), found.reshape(batch),
                      StepStats(*(stats[k] for k in range(6))), reset_rows,
                      evicted_keys)  # fmt: skip
