"""Integer ids of any width, checked before they are narrowed to the kernels' int32.

Every lookup, bag, collection and update reads its ids through `as_ids`. JAX holds ids as
int32 unless `jax_enable_x64` is on, and its own conversions narrow silently: with x64 off,
`jnp.asarray(np.int64(2**32 + 3))` is 3, a real row. jaxembed therefore never lets JAX
convert ids for it:

* **concrete ids** (numpy arrays, lists, jax arrays outside `jit`, and numpy arrays closed
  over inside `jit`) are checked on the host in their own width first: an id that int32
  cannot hold raises, naming it and where it is;
* **traced ids** wider than int32 (int64 or uint64 under x64, uint32 always) are narrowed by a
  saturating cast: ids below int32 become `INT32_MIN`, ids past it `INT32_MAX`, the rest keep
  their value. Both ends stay outside every table's `[0, rows)`, so a wide id reads zero and
  gets no gradient, exactly as it would have; no id wraps onto a real row.

A table has at most `INT32_MAX` rows, so the saturated id is out of range for all of them.

One thing no library can see: a numpy int64 array passed as an *argument* of a function the
user jits with x64 off is narrowed by `jax.jit` itself before the function body runs. Check
such ids on the host first (`jaxembed.check_ids_fit`, or pass them through `jaxembed.embedding`
eagerly once), or turn x64 on.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["INT32_MAX", "as_ids", "check_ids_fit", "concrete", "saturate"]

INT32_MAX = int(np.iinfo(np.int32).max)
_INT32_MIN = int(np.iinfo(np.int32).min)
# Integer dtypes whose every value int32 holds: they widen, never narrow.
_FITS = {np.dtype(t) for t in (np.int8, np.int16, np.int32, np.uint8, np.uint16)}


def concrete(a: Any) -> np.ndarray | None:
    """`a`'s values as a numpy array (in its own dtype) when they are known here, else None:
    a tracer, or an array another process holds part of."""
    if isinstance(a, jax.core.Tracer):
        return None
    if isinstance(a, jax.Array) and not a.is_fully_addressable:
        return None
    return np.asarray(a)


def _type_error(what: str, dtype: Any, shape: Any, where: str) -> TypeError:
    return TypeError(
        f"{where}{what} must be integers, got {dtype} {what} of shape {tuple(shape)}: cast "
        f"them with {what}.astype(jnp.int32) if they hold whole numbers"
    )


def check_ids_fit(x: Any, what: str = "ids", where: str = "") -> np.ndarray:
    """Checks on the host that concrete integer ids fit int32, in their own width.

    Args:
      x: concrete ids of any integer dtype (numpy, a list, a concrete jax array).
      what: how messages name them.
      where: what messages start with (e.g. `"feature 'ads' (table 'ad'): "`).

    Returns:
      The ids as a numpy array of their own dtype.

    Raises:
      TypeError: ids that are not integers (floats, bools, Python objects).
      ValueError: an id int32 cannot hold, named with its index.

    Examples:
      >>> import numpy as np
      >>> check_ids_fit(np.array([3, 2**32 + 3], np.int64))
      Traceback (most recent call last):
      ...
      ValueError: ids[1] = 4294967299 does not fit int32, ...
    """
    ids = np.asarray(x)
    if ids.dtype == object:  # Python ints too wide for int64
        try:
            ids = ids.astype(np.int64)
        except (OverflowError, TypeError):
            raise ValueError(
                f"{where}{what} hold values that do not fit a 64-bit integer (e.g. "
                f"{ids.reshape(-1)[0]!r}): ids must be integers in [0, rows)"
            ) from None
    if not np.issubdtype(ids.dtype, np.integer):
        raise _type_error(what, ids.dtype, ids.shape, where)
    if ids.dtype in _FITS or ids.size == 0:
        return ids
    bad = (ids > INT32_MAX) | (ids < _INT32_MIN) if np.issubdtype(ids.dtype, np.signedinteger) \
        else ids > INT32_MAX  # fmt: skip
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        index = f"{what}[{', '.join(map(str, at))}]" if at else what
        if what in ("lengths", "offsets"):
            advice = f"{what} count id slots, which an int32 axis holds"
        else:
            advice = (
                f"so it cannot name a row of any table (rows are 0 to at most {INT32_MAX - 1}); "
                "jaxembed never narrows it to a wrong row. Map hashed 64-bit ids onto the table "
                "first (e.g. ids % vocab_size), or drop them; under jax.jit such an id reads "
                "zero and gets no gradient"
            )
        raise ValueError(f"{where}{index} = {int(ids[at])} does not fit int32, {advice}.")
    return ids


def saturate(x: jax.Array) -> jax.Array:
    """`x` narrowed to int32 by a saturating cast: ids past int32 to `INT32_MAX`, ids below
    it to `INT32_MIN` (dtypes int32 holds are returned as they are).

    Every id keeps its meaning: in range stays itself, out of range stays out of range.
    """
    dtype = np.dtype(x.dtype)
    if dtype in _FITS:
        return x  # every value fits: nothing to narrow
    if np.issubdtype(dtype, np.signedinteger):
        return jnp.clip(x, _INT32_MIN, INT32_MAX).astype(jnp.int32)
    return jnp.minimum(x, INT32_MAX).astype(jnp.int32)


def as_ids(x: Any, what: str = "ids", *, where: str = "", check: bool = True) -> jax.Array:
    """`x` as jax ids int32 holds, never wrapped: checked in its own width, then narrowed.

    Args:
      x: integer ids of any width and rank: numpy, a list, a jax array, or a tracer.
      what: how messages name them.
      where: what messages start with (e.g. `"feature 'ads' (table 'ad'): "`).
      check: raise for concrete ids int32 cannot hold (True); False narrows them by the
        saturating cast instead, so that they read nothing, as under `jit`.

    Returns:
      A jax array of `x`'s shape: int32, or the narrower integer dtype `x` already had (a
      concrete jax array keeps its sharding).

    Raises:
      TypeError: ids that are not integers.
      ValueError: with `check`, a concrete id that does not fit int32.

    Examples:
      >>> import numpy as np, jax, jax.numpy as jnp
      >>> as_ids(np.array([1, -5], np.int64)).tolist()
      [1, -5]
      >>> as_ids(np.array([1, 2**32 + 3]), check=False).tolist()    # out of range stays out
      [1, 2147483647]
      >>> jax.jit(lambda x: as_ids(x))(jnp.array([7, 2**31 + 1], jnp.uint32)).tolist()
      [7, 2147483647]
    """
    if isinstance(x, jax.core.Tracer) or (isinstance(x, jax.Array) and not x.is_fully_addressable):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise _type_error(what, x.dtype, x.shape, where)
        return saturate(x)
    if isinstance(x, jax.Array):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise _type_error(what, x.dtype, x.shape, where)
        if check and np.dtype(x.dtype) not in _FITS:
            check_ids_fit(x, what, where)
        return saturate(x)  # on device: the array keeps its sharding
    ids = np.asarray(x) if check is False else check_ids_fit(x, what, where)
    if ids.dtype == object or not np.issubdtype(ids.dtype, np.integer):
        raise _type_error(what, ids.dtype, ids.shape, where)
    if ids.dtype in _FITS:
        return jnp.asarray(ids)
    if np.issubdtype(ids.dtype, np.signedinteger):
        return jnp.asarray(np.clip(ids, _INT32_MIN, INT32_MAX).astype(np.int32))
    return jnp.asarray(np.minimum(ids, INT32_MAX).astype(np.int32))
