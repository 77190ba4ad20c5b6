"""Raw 64-bit ids as keys `uint32[..., 2]`, the reserved empty key, and the hash.

A dynamic table's ids are raw 64-bit values from an unbounded space (hashed user ids, item
ids). JAX runs without x64 by default and would narrow an int64 to int32 silently, so inside
jaxembed an id travels as its **key**: `uint32[..., 2]` with

* `[..., 0]` the **low** 32 bits and `[..., 1]` the **high** 32 bits of the id's 64-bit
  pattern (little-endian order: `np.int64` ids `.view(np.uint32)` on a little-endian host);
* a signed id counts by its two's-complement pattern: int64 `-2` is the key of uint64
  `2**64 - 2`.

`as_keys` takes two unambiguous forms and never truncates: **64-bit integers** (numpy int64 /
uint64 or Python ints on the host; jax int64 / uint64 when `jax_enable_x64` is on) and **keys**
`uint32[..., 2]` anywhere, traced included. **int32 is refused in every shape**, eagerly and
under `jit`: with x64 off, `jax.jit` narrows a numpy int64 argument to int32 before the body
runs, so an int32 `[B, 2]` may be B narrowed pairs of ids as well as B keys' halves, and no
code can tell which (the message names the narrowing and `as_keys`). Anything else (floats,
bools, narrower integers, a uint32 array whose trailing axis is not 2) raises naming its dtype,
its shape and the form to use.

One narrowing cannot be seen: a numpy **uint64** `[B, 2]` passed to a jitted function with x64
off arrives as `uint32[B, 2]`, which is the key form itself. Convert uint64 (and int64) ids with
`as_keys` outside the jitted function, and pass the keys.

**The reserved key.** `EMPTY_ID = 2**64 - 1` (all 64 bits set: int64 `-1`, both halves
`0xFFFFFFFF`) marks an empty slot of a table's identity array, so no id may equal it. Concrete
ids equal to it raise `ValueError` (naming the first); traced ones cannot be checked: under
`jax.jit` such an id reads zeros, never gets a row, is never counted for admission and is
counted in the step's `stats.reserved`. Pass `check=False` to use it deliberately as padding.

**The hash** is MurmurHash3_x86_32 (Austin Appleby's public-domain hash) of the id's 8
little-endian bytes under a 32-bit seed: two 4-byte blocks (low half, then high half) and the
finalizer. It uses only 32-bit wrapping multiplies, rotates and xors, so numpy, XLA without
x64 and C++ (`jaxembed/_native/remap_kernels.cc`) compute bit-identical values. Each use draws
from its own **stream**, a seed derived from the table's seed and the stream's number
(`stream_seed`): stream 0 picks the bucket, streams 2, 3, ... the counter within its
bucket's share of each count-min sketch row (stream 1 is unused), so these choices are
independent of each other. An index in `[0, n)` is `hash % n` (bias below `n / 2**32`).
A table split by rows over n shards gives shard s the buckets `[s·nb/n, (s+1)·nb/n)`, so an
id's owner is its bucket's shard (`owner_of`): no hash of its own, and the same bucket (and
row) whatever the shard count.

Examples:
  >>> import numpy as np
  >>> k = as_keys(np.array([5, -2, 2**40 + 7], np.int64))
  >>> k.dtype, k.shape
  (dtype('uint32'), (3, 2))
  >>> k.tolist()
  [[5, 0], [4294967294, 4294967295], [7, 256]]
  >>> to_uint64(k).tolist()
  [5, 18446744073709551614, 1099511627783]
  >>> bucket_of(k, 8, seed=0).tolist() == bucket_of(np.asarray(k), 8, seed=0).tolist()
  True
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "EMPTY_HALF",
    "EMPTY_ID",
    "STREAM_BUCKET",
    "STREAM_SKETCH",
    "as_keys",
    "bucket_of",
    "hash32",
    "is_reserved",
    "keys_to_host",
    "owner_of",
    "sketch_index",
    "stream_seed",
    "to_uint64",
]

EMPTY_ID = 2**64 - 1  # the reserved id: all 64 bits set (int64 -1)
EMPTY_HALF = 0xFFFFFFFF  # both halves of the reserved key

STREAM_BUCKET = 0  # the bucket of an id within its table (or shard)
STREAM_SKETCH = 2  # the first row of the count-min sketch; row j draws from stream 2 + j

_MASK32 = 0xFFFFFFFF
_FORMS = (
    "pass numpy int64/uint64 ids on the host, keys uint32[..., 2] under jax.jit ([..., 0] the "
    "low 32 bits, [..., 1] the high 32 bits: keys = jaxembed.dynamic.as_keys(ids) outside the "
    "jitted function), or int64/uint64 with jax_enable_x64 on"
)
_NARROWED = (
    "int32 ids are refused: with x64 off, jax.jit narrows numpy int64 ids to int32 before "
    "the function runs (2**40 + 7 becomes 7, and an int64 [B, 2] reads as B keys' halves), "
    "and nothing tells narrowed ids from 32-bit ones. Convert the int64 ids outside the "
    "jitted function, keys = jaxembed.dynamic.as_keys(ids), and pass the keys "
    "(uint32[..., 2]); for int32 halves of keys, pass them as uint32 "
    "(jax.lax.bitcast_convert_type(pairs, jnp.uint32)); for non-negative 32-bit ids, pass "
    "np.asarray(ids, np.int64) on the host"
)


# --- the hash: MurmurHash3_x86_32 of 8 bytes, 32-bit arithmetic only -------------------------


def _rotl(x: Any, r: int) -> Any:
    return (x << r) | (x >> (32 - r))


# Typed constants: a bare Python int above 2**31 is no weak type JAX accepts.
_C1, _C2 = np.uint32(0xCC9E2D51), np.uint32(0x1B873593)
_F1, _F2 = np.uint32(0x85EBCA6B), np.uint32(0xC2B2AE35)
_N, _FIVE, _LEN = np.uint32(0xE6546B64), np.uint32(5), np.uint32(8)


def _fmix32(h: Any) -> Any:
    h = h ^ (h >> 16)
    h = h * _F1
    h = h ^ (h >> 13)
    h = h * _F2
    return h ^ (h >> 16)


def _murmur(lo: Any, hi: Any, seed: Any) -> Any:
    """MurmurHash3_x86_32 of the 8 bytes `lo` (little-endian), `hi`, with `seed`: uint32
    arrays, numpy or jax alike (every product wraps modulo 2**32)."""
    h = seed
    for block in (lo, hi):
        k = block * _C1
        k = _rotl(k, 15)
        k = k * _C2
        h = h ^ k
        h = _rotl(h, 13)
        h = h * _FIVE + _N
    return _fmix32(h ^ _LEN)


def _fmix32_int(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _MASK32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def stream_seed(seed: int, stream: int) -> int:
    """The 32-bit seed of hash stream `stream` of a table seeded `seed` (a Python int).

    Examples:
      >>> stream_seed(0, 0) != stream_seed(0, 1) != stream_seed(1, 0)
      True
    """
    return _fmix32_int(
        (int(seed) ^ _fmix32_int((int(stream) * 0x9E3779B9 + 1) & _MASK32)) & _MASK32
    )


def hash32(keys: Any, seed: int) -> Any:
    """MurmurHash3_x86_32 of each key's 8 bytes under the 32-bit `seed`: `uint32[...]`.

    Args:
      keys: `uint32[..., 2]` keys (low half first), numpy or jax (traced included).
      seed: a Python int in `[0, 2**32)` (use `stream_seed` to draw one per use).

    Returns:
      uint32 of `keys.shape[:-1]`, numpy for numpy keys, jax for jax keys: the same bits.

    Examples:
      >>> import numpy as np
      >>> hex(int(hash32(np.array([0, 0], np.uint32), 0)))  # murmur3_32(b"\\0" * 8, 0)
      '0x63852afc'
    """
    s = int(seed) & _MASK32
    if isinstance(keys, jax.Array):
        lo, hi = keys[..., 0], keys[..., 1]
        return _murmur(lo, hi, jnp.full(lo.shape, s, jnp.uint32))
    k = np.asarray(keys, np.uint32)
    shape = k.shape[:-1]
    k = k.reshape(-1, 2)  # >= 1-D: numpy warns on wrapping 0-d (scalar) arithmetic
    out = _murmur(k[:, 0], k[:, 1], np.full(k.shape[0], s, np.uint32))
    return out.reshape(shape)


def _index(h: Any, n: int) -> Any:
    if isinstance(h, jax.Array):
        return jax.lax.rem(h, jnp.full(h.shape, n, jnp.uint32)).astype(jnp.int32)
    return (h % np.uint32(n)).astype(np.int32)


def _check_count(name: str, n: Any) -> int:
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or not 1 <= n < 2**31:
        raise ValueError(f"{name}={n!r} must be an int in [1, 2**31)")
    return int(n)


def bucket_of(keys: Any, num_buckets: int, seed: int) -> Any:
    """Each key's bucket in `[0, num_buckets)`: int32 of `keys.shape[:-1]` (stream 0).

    Examples:
      >>> import numpy as np
      >>> bucket_of(np.array([[1, 0], [2, 0]], np.uint32), 1000, seed=7).tolist()
      [145, 337]
    """
    n = _check_count("num_buckets", num_buckets)
    return _index(hash32(keys, stream_seed(seed, STREAM_BUCKET)), n)


def owner_of(keys: Any, num_buckets: int, num_shards: int, seed: int) -> Any:
    """Each key's owner among `num_shards` equal row shards of a table of `num_buckets`
    buckets: the shard holding its bucket, `bucket_of(...) // (num_buckets // num_shards)`
    (int32 of `keys.shape[:-1]`; `num_shards` must divide `num_buckets`).

    Examples:
      >>> import numpy as np
      >>> k = np.array([[1, 0], [2, 0]], np.uint32)
      >>> bucket_of(k, 1000, seed=7).tolist(), owner_of(k, 1000, 4, seed=7).tolist()
      ([145, 337], [0, 1])
    """
    nb, n = _check_count("num_buckets", num_buckets), _check_count("num_shards", num_shards)
    if nb % n:
        raise ValueError(f"num_shards={n} must divide num_buckets={nb}: shards own whole buckets")
    return bucket_of(keys, nb, seed) // (nb // n)


def sketch_index(keys: Any, buckets: Any, depth: int, per_bucket: int, seed: int) -> Any:
    """Each key's counter in each row of a count-min sketch split by bucket: int32
    `[depth, *keys.shape[:-1]]`, `buckets * per_bucket + (h_j % per_bucket)` in row j, h_j
    drawn from stream `2 + j` (`buckets`: each key's bucket, or its shard's local bucket)."""
    k = _check_count("per_bucket", per_bucket)
    rows = [buckets * k + _index(hash32(keys, stream_seed(seed, STREAM_SKETCH + j)), k)
            for j in range(depth)]  # fmt: skip
    if isinstance(keys, jax.Array):
        return jnp.stack(rows) if rows else jnp.zeros((0, *keys.shape[:-1]), jnp.int32)
    return np.stack(rows) if rows else np.zeros((0, *np.shape(keys)[:-1]), np.int32)


# --- the id forms ------------------------------------------------------------------------------


def is_reserved(keys: Any) -> Any:
    """Whether each key is the reserved `EMPTY_ID` (both halves `0xFFFFFFFF`): bool[...]."""
    if isinstance(keys, jax.Array):
        return (keys[..., 0] == jnp.uint32(EMPTY_HALF)) & (keys[..., 1] == jnp.uint32(EMPTY_HALF))
    k = np.asarray(keys)
    return (k[..., 0] == EMPTY_HALF) & (k[..., 1] == EMPTY_HALF)


def _type_error(what: str, dtype: Any, shape: tuple, why: str) -> TypeError:
    return TypeError(
        f"{what} must be 64-bit integer ids, got {dtype} ids of shape {tuple(shape)}{why}: "
        f"{_FORMS}"
    )


def _pairs_from_64(ids: np.ndarray) -> np.ndarray:
    u = ids.astype(np.uint64, copy=False)  # int64 -> its two's-complement pattern
    out = np.empty((*u.shape, 2), np.uint32)
    out[..., 0] = (u & np.uint64(_MASK32)).astype(np.uint32)
    out[..., 1] = (u >> np.uint64(32)).astype(np.uint32)
    return out


def _host_ids(x: Any, what: str) -> np.ndarray:
    """Host ids (numpy, lists, Python ints, concrete jax arrays) as a numpy array of one
    integer dtype, or raises for a form that is not 64-bit ids."""
    a = np.asarray(x)
    if not isinstance(x, np.ndarray | np.generic | jax.Array) and a.dtype.kind not in "iu":
        a = np.asarray(x, dtype=object)  # Python ints numpy would round to float64
    if a.dtype == object:  # Python ints beyond int64 (or mixed with negatives)
        flat = a.reshape(-1)
        if not all(isinstance(v, int | np.integer) and not isinstance(v, bool) for v in flat):
            bad = next(
                v for v in flat if not isinstance(v, int | np.integer) or isinstance(v, bool)
            )
            raise TypeError(f"{what} must be integers, got {type(bad).__name__} {bad!r}: {_FORMS}")
        for i, v in enumerate(flat):
            if not -(2**63) <= int(v) < 2**64:
                at = np.unravel_index(i, a.shape) if a.shape else ()
                raise ValueError(
                    f"{what}[{', '.join(map(str, at))}] = {int(v)} does not fit 64 bits: ids "
                    "must be in [-2**63, 2**64) (signed ids count by their two's-complement "
                    "pattern)"
                )
        a = np.array([int(v) & (2**64 - 1) for v in flat], np.uint64).reshape(a.shape)
    return a


def _check_reserved(keys: np.ndarray, what: str) -> None:
    bad = is_reserved(keys)
    if np.any(bad):
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        index = f"{what}[{', '.join(map(str, at))}]" if at else what
        raise ValueError(
            f"{index} = {EMPTY_ID} (int64 -1, key [0xFFFFFFFF, 0xFFFFFFFF]) is EMPTY_ID, the "
            "key a dynamic table reserves for its empty slots, so no id may equal it: map it to "
            "another id or drop it (under jax.jit it reads zeros, never gets a row and is "
            "counted in stats.reserved; pass check=False to use it as padding)"
        )


def keys_to_host(x: Any, what: str = "ids", *, check: bool = True) -> np.ndarray:
    """Concrete ids in any accepted form as numpy keys `uint32[..., 2]` (low half first).

    Args:
      x: numpy int64 / uint64 ids, Python ints (in `[-2**63, 2**64)`), or keys
        `uint32[..., 2]`; a concrete jax array of these dtypes.
      what: how messages name them.
      check: raise for an id equal to `EMPTY_ID` (True), or keep it as padding (False).

    Returns:
      np.uint32 `[*ids_shape, 2]`.

    Raises:
      TypeError: floats, bools, int32 in any shape (what `jax.jit` narrows int64 ids to),
        other narrower integers, uint32 without the pair axis.
      ValueError: uint32 keys whose trailing axis is not 2; an id beyond 64 bits; with
        `check`, an id equal to `EMPTY_ID`.

    Examples:
      >>> import numpy as np
      >>> keys_to_host(np.array([[1, 2]], np.int32))
      Traceback (most recent call last):
      ...
      TypeError: ids are int32 of shape (1, 2): int32 ids are refused: with x64 off, jax.jit ...
    """
    a = _host_ids(x, what)
    dt = a.dtype
    if dt in (np.dtype(np.int64), np.dtype(np.uint64)):
        keys = _pairs_from_64(a)
    elif dt == np.dtype(np.uint32):
        _check_pairs(what, dt, a.shape)
        keys = a
    else:
        raise _form_error(what, dt, a.shape)
    if check:
        _check_reserved(keys, what)
    return np.ascontiguousarray(keys, np.uint32)


def _form_error(what: str, dtype: Any, shape: tuple) -> TypeError:
    if np.dtype(dtype) == np.int32:
        return TypeError(f"{what} are int32 of shape {tuple(shape)}: {_NARROWED}")
    if np.issubdtype(dtype, np.integer):
        why = f" ({np.dtype(dtype).itemsize * 8}-bit integers cannot hold 64-bit ids; cast "
        why += "them with np.asarray(ids, np.int64) on the host)"
    elif dtype == np.bool_:
        why = " (bools are not ids)"
    elif np.issubdtype(dtype, np.inexact):
        why = " (ids are never rounded from floats)"
    else:
        why = " (not integers)"
    return _type_error(what, dtype, shape, why)


def _check_pairs(what: str, dtype: Any, shape: tuple) -> None:
    """Keys are uint32 `[..., 2]`."""
    if len(shape) >= 1 and shape[-1] == 2:
        return
    small = (
        "for 32-bit ids cast them with np.asarray(ids, np.int64) on the host, or pair them "
        "under jax.jit: jnp.stack([ids.astype(jnp.uint32), jnp.zeros(ids.shape, jnp.uint32)], "
        "-1)"
    )
    if len(shape) <= 1:
        raise _type_error(what, dtype, shape, f" (32-bit ids without the pair axis; {small})")
    raise ValueError(
        f"{what}: {dtype} ids must be pairs uint32[..., 2] (low half, high half), got shape "
        f"{tuple(shape)}, whose trailing axis is {shape[-1]}, not 2; {small}"
    )


def as_keys(x: Any, what: str = "ids", *, check: bool = True) -> jax.Array:
    """`x` as jax keys `uint32[..., 2]` (low half, high half), never truncated.

    Host ids (numpy, Python ints) are converted and checked on the host. Jax arrays are
    converted where they are, keeping their sharding (uint32 keys as they are, int64 / uint64
    under x64 split into halves); concrete ones are then checked for `EMPTY_ID` on the host,
    traced ones cannot be (see the module's docstring for what it does under `jit`).

    Note: a numpy int64 array passed as an *argument* of a function the user jits with x64 off
    is narrowed to int32 by `jax.jit` itself before the body runs, so int32 is refused in every
    shape (a numpy uint64 array is narrowed to uint32, which cannot be seen). Convert such ids
    with `as_keys` (or `keys_to_host`) outside the jitted function and pass the keys.

    Args:
      x: the ids, in any form `keys_to_host` takes, or traced keys `uint32[..., 2]`, or
        traced int64 / uint64 (x64 on).
      what: how messages name them.
      check: for concrete ids, raise for an id equal to `EMPTY_ID` (True) or keep it (False).

    Returns:
      jax uint32 `[*ids_shape, 2]`.

    Raises:
      TypeError, ValueError: as `keys_to_host`, for concrete and traced ids alike (the
        dtype and shape are known under `jit`; only the values are not).

    Examples:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> pairs = jnp.array([[3, 0], [7, 1]], jnp.uint32)
      >>> jax.jit(as_keys)(pairs).tolist()
      [[3, 0], [7, 1]]
      >>> as_keys(jnp.array([1.0, 2.0]))
      Traceback (most recent call last):
      ...
      TypeError: ids must be 64-bit integer ids, got float32 ids of shape (2,) (ids are ...
      >>> jax.jit(as_keys)(np.array([[5, 2**40 + 7]], np.int64))  # narrowed to int32 by jit
      Traceback (most recent call last):
      ...
      TypeError: ids are int32 of shape (1, 2): int32 ids are refused: with x64 off, jax.jit ...
    """
    if isinstance(x, jax.Array):  # traced or on devices: converted in place (keeps sharding)
        keys = _device_keys(x, what)
        traced = isinstance(x, jax.core.Tracer) or not x.is_fully_addressable
        if check and not traced:
            _check_reserved(np.asarray(keys), what)
        return keys
    return jnp.asarray(keys_to_host(x, what, check=check))


def _device_keys(x: jax.Array, what: str) -> jax.Array:
    """A jax array of ids as keys, in the graph: uint32 keys as they are, int64 / uint64
    (x64 on) split into halves."""
    dt = np.dtype(x.dtype)
    if dt == np.dtype(np.uint32):
        _check_pairs(what, dt, x.shape)
        return x
    if dt in (np.dtype(np.int64), np.dtype(np.uint64)):
        u = x if dt == np.uint64 else jax.lax.bitcast_convert_type(x, jnp.uint64)
        lo = (u & jnp.uint64(_MASK32)).astype(jnp.uint32)
        hi = (u >> jnp.uint64(32)).astype(jnp.uint32)
        return jnp.stack([lo, hi], axis=-1)
    raise _form_error(what, dt, x.shape)


def to_uint64(keys: Any) -> np.ndarray:
    """Keys `uint32[..., 2]` back to their ids as numpy uint64 `[...]` (on the host).

    Examples:
      >>> import numpy as np
      >>> to_uint64(np.array([[1, 2]], np.uint32)).tolist()
      [8589934593]
    """
    k = np.asarray(keys, np.uint32)
    if k.ndim == 0 or k.shape[-1] != 2:
        raise ValueError(f"keys must be uint32[..., 2] pairs, got shape {k.shape}")
    return k[..., 0].astype(np.uint64) | (k[..., 1].astype(np.uint64) << np.uint64(32))
