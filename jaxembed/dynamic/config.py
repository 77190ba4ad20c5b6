"""A dynamic table's options, its state and a step's counts, as plain data.

`DynamicTableConfig` is static (frozen, hashable: a `jax.jit` static argument); `DynamicState`
is arrays only, every leading axis the table's `capacity` or the sketch's own, so it is donated
through a step, sharded with the table and checkpointed like optimizer state. The XLA engine
is `jaxembed.kernels.remap`; `jaxembed.dynamic.reference` is its pure-Python twin.

**Buckets.** Row r lives in bucket `r // bucket_size`; an id may only hold a row of its own
bucket (`keys.bucket_of`), so a lookup compares one bucket's `bucket_size` keys (the bounded
probe) and every decision about a bucket is local to it. When more ids want a bucket than it
has slots, the rest are refused (`ttl`) or evict one another (`lru`, `lfu`).

**Refusals at 1.33x over-provisioning** (load factor α = live ids / capacity = 0.75). Ids
hash uniformly, so the ids that want one bucket of S slots are Poisson(λ = α·S); the fraction
of ids that find their bucket full is `E[(X - S)+] / λ` (`overflow_fraction`):

    S = 16: λ = 12, 2.05% refused      S = 32: λ = 24, 0.55% refused (the default)
    S = 64: λ = 48, 0.074% refused     (S = 8: 5.2%)

S = 32 keys are 256 contiguous bytes (4 cache lines) per probe; S = 64 halves the refusals
again for twice the bytes.

**Admission** (`admit_after` = a > 1) counts the ids without a row in a count-min sketch of
`sketch_depth` = d rows of `sketch_width` = w int32 counters; an id's estimate is the minimum
of its d counters. The sketch is split by bucket like the rows: each bucket b has its own k = w
/ num_buckets counters of each row, `[b·k, (b+1)·k)`, and an id of bucket b counts in counter
`b·k + (h_j mod k)` of row j (h_j its hash stream `2 + j`), so every decision but the halving
is local to a bucket, and a table split by rows splits its sketch with them. It never
under-counts. It over-counts by the other ids that share all d of its counters: with N counts
in the sketch, spread over the buckets by a uniform hash, each row's excess has mean <= N / w
(a bucket's N / num_buckets counts over its k counters), so an id seen c < a times is admitted
early with probability at most `(N / (w·(a - c)))**d` (Markov's bound, each row independent).
To keep N bounded on an unbounded stream every counter is halved (and N with it) whenever N
reaches `sketch_window` (TinyLFU's reset): then N < window + one batch, and with the defaults
(w = window = capacity, d = 4) an id seen once is admitted early at `admit_after=3` with
probability <= (1/2)**4 = 6% by the bound (0.5% for Poisson(1) excesses); seen counts are
therefore "recent" counts, each halving forgetting half.

Examples:
  >>> cfg = DynamicTableConfig(capacity=1024, admit_after=3, policy="ttl", ttl_steps=10)
  >>> cfg.num_buckets, cfg.sketch_shape
  (32, (4, 1024))
  >>> round(100 * overflow_fraction(0.75, 32), 2)
  0.55
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

__all__ = [
    "POLICIES",
    "DynamicState",
    "DynamicTableConfig",
    "StepStats",
    "overflow_fraction",
]

POLICIES = ("lru", "lfu", "ttl")
INT32_MAX = 2**31 - 1
_MAX_BUCKET = 1024
_MAX_SKETCH = 2**30


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int_in(name: str, v: Any, lo: int, hi: int, hint: str = "") -> None:
    if not _is_int(v) or not lo <= v <= hi:
        raise ValueError(f"{name}={v!r} must be an int in [{lo}, {hi}]{hint}")


@dataclasses.dataclass(frozen=True)
class DynamicTableConfig:
    """A dynamic table: how many rows, how they are probed, admitted and evicted.

    Every field is checked when the config is made; the defaults of `sketch_width` and
    `sketch_window` (None) resolve to numbers then, so equal tables compare and hash equal.

    Args:
      capacity: rows of the table (int32 row numbers: at most 2**31 - 1); a multiple of
        `bucket_size`.
      bucket_size: slots per bucket, the probe bound (1 to 1024; default 32: 0.55% of ids
        refused at load factor 0.75, see the module's docstring).
      admit_after: an id gets a row the step it has been seen this many times without one
        (1: at once; otherwise counted by the count-min sketch).
      policy: which row a new id takes when its bucket has no free slot: `"lru"` (the least
        recently seen id's), `"lfu"` (the least frequently seen, then least recently), or
        `"ttl"` (only an id not seen for more than `ttl_steps` steps, oldest first; with none
        expired the new id is refused). A row looked up in the current step is never taken.
      ttl_steps: for `"ttl"` only: an id seen at step s expires at step `s + ttl_steps + 1`.
      sketch_depth: rows of the count-min sketch (1 to 16); used when `admit_after > 1`.
      sketch_width: counters per sketch row (default: `capacity`), a multiple of
        `num_buckets` (each bucket has `sketch_width // num_buckets` of them).
      sketch_window: counts after which every sketch counter is halved (default: the width).
      seed: the table's hash seed, in `[0, 2**32)` (buckets, owners, sketch rows).

    Raises:
      ValueError: a field out of range, naming it, its value and the fix.

    Examples:
      >>> DynamicTableConfig(capacity=1000)
      Traceback (most recent call last):
      ...
      ValueError: capacity=1000 is not a multiple of bucket_size=32: ...
    """

    capacity: int
    bucket_size: int = 32
    admit_after: int = 1
    policy: str = "lru"
    ttl_steps: int | None = None
    sketch_depth: int = 4
    sketch_width: int | None = None
    sketch_window: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        _int_in("bucket_size", self.bucket_size, 1, _MAX_BUCKET)
        c, s = self.capacity, self.bucket_size
        if not _is_int(c) or not 1 <= c <= INT32_MAX:
            raise ValueError(
                f"capacity={c!r} must be a positive int (rows of the table, at most "
                f"{INT32_MAX}), e.g. capacity={32 * s} for {32 * s} rows"
            )
        if c % s:
            down, up = c - c % s, c - c % s + s
            sizes = f"capacity={up}" + (f" (or {down})" if down else "")
            raise ValueError(
                f"capacity={c} is not a multiple of bucket_size={s}: a table is whole buckets; "
                f"use {sizes}, or a bucket_size that divides {c}"
            )
        _int_in("admit_after", self.admit_after, 1, _MAX_SKETCH, " (1 admits an id at once)")
        if self.policy not in POLICIES:
            known = ", ".join(repr(p) for p in POLICIES)
            raise ValueError(f"policy={self.policy!r} is not an eviction policy; known: {known}")
        if self.policy == "ttl":
            if self.ttl_steps is None:
                raise ValueError(
                    "policy='ttl' needs ttl_steps, the steps an id may go unseen before its "
                    "row can be taken (e.g. ttl_steps=1000)"
                )
            _int_in("ttl_steps", self.ttl_steps, 1, INT32_MAX - 1)
        elif self.ttl_steps is not None:
            raise ValueError(
                f"ttl_steps={self.ttl_steps!r} applies only to policy='ttl' (got "
                f"policy={self.policy!r}): drop it, or pass policy='ttl'"
            )
        _int_in("sketch_depth", self.sketch_depth, 1, 16)
        width = self.capacity if self.sketch_width is None else self.sketch_width
        _int_in("sketch_width", width, 1, _MAX_SKETCH)
        nb = c // s
        if self.admit_after > 1 and width % nb:
            up = -(-width // nb) * nb
            raise ValueError(
                f"sketch_width={width} is not a multiple of num_buckets={nb} (capacity {c} / "
                f"bucket_size {s}): each bucket has its own share of the sketch's counters; "
                f"use sketch_width={up}, or leave it out (default: capacity)"
            )
        window = width if self.sketch_window is None else self.sketch_window
        _int_in("sketch_window", window, 1, _MAX_SKETCH)
        _int_in("seed", self.seed, 0, 2**32 - 1)
        object.__setattr__(self, "sketch_width", width)
        object.__setattr__(self, "sketch_window", window)

    @property
    def num_buckets(self) -> int:
        """`capacity // bucket_size`."""
        return self.capacity // self.bucket_size

    @property
    def uses_sketch(self) -> bool:
        """Whether admission counts ids (`admit_after > 1`)."""
        return self.admit_after > 1

    @property
    def sketch_shape(self) -> tuple[int, int]:
        """The state's sketch: `(sketch_depth, sketch_width)`, or `(1, 1)` when unused (a
        placeholder never read: orbax cannot save a zero-size array)."""
        return (self.sketch_depth, self.sketch_width) if self.uses_sketch else (1, 1)

    @property
    def sketch_per_bucket(self) -> int:
        """k, each bucket's counters in each sketch row (`sketch_width // num_buckets`; 1
        when the sketch is unused)."""
        return self.sketch_shape[1] // self.num_buckets if self.uses_sketch else 1

    def shard(self, num_shards: int) -> DynamicTableConfig:
        """The config of one of `num_shards` equal row shards: its buckets, rows and sketch
        counters (the same bucket size, sketch share a bucket, policy, window and seed).

        Raises:
          ValueError: `num_shards` does not divide the buckets, naming a capacity it divides.

        Examples:
          >>> DynamicTableConfig(capacity=1024, admit_after=2).shard(8).capacity
          128
        """
        n, nb = int(num_shards), self.num_buckets
        if n < 1 or nb % n:
            step = self.bucket_size * n
            up = -(-self.capacity // step) * step
            raise ValueError(
                f"capacity={self.capacity} ({nb} buckets of {self.bucket_size}) does not split "
                f"into {n} row shards of whole buckets: each shard owns its buckets' ids; use "
                f"capacity={up} (a multiple of bucket_size x {n} = {step})"
            )
        if n == 1:
            return self
        return dataclasses.replace(self, capacity=self.capacity // n,
                                   sketch_width=self.sketch_width // n)  # fmt: skip

    @property
    def state_bytes(self) -> int:
        """The bytes of its `DynamicState`: 16 a row (keys 8, last_seen 4, count 4), the
        sketch's int32 counters and its total; a table split by rows splits all but the total
        with them (`shard`).

        Examples:
          >>> DynamicTableConfig(capacity=1024, bucket_size=16).state_bytes    # no sketch
          16392
        """
        depth, width = self.sketch_shape
        return 16 * self.capacity + 4 * depth * width + 4


class DynamicState(NamedTuple):
    """A dynamic table's identity and metadata: arrays only (jax, or numpy in the reference).

    Every field but the sketch's has leading axis `capacity` (row r's entry at index r), so
    the state shards with the table's rows; the sketch is the admission's own.
    """

    keys: Any  # uint32[capacity, 2]  the id holding each row (low, high); EMPTY_HALF pairs: free
    last_seen: Any  # int32[capacity]  the step its id was last seen; -1: free
    count: Any  # int32[capacity]  times its id was seen (saturating at 2**31 - 1); 0: free
    sketch: Any  # int32[depth, width]  count-min counters of ids without a row; [1, 1] if unused
    sketch_total: Any  # int32[1]  counts added to the sketch since its last halving


class StepStats(NamedTuple):
    """What one step decided, in distinct ids (int32 scalars; `reserved` counts id slots).

    `hits + admitted + refused + pending` is the number of distinct ids in the batch
    (the reserved id aside).
    """

    hits: Any  # ids that held a row already (touched)
    admitted: Any  # ids given a row this step (each row is in the step's reset_rows)
    evicted: Any  # of those, the ones that took a row another id held
    refused: Any  # ids due for a row that found no slot (bucket full / none expired)
    pending: Any  # ids without a row, seen fewer than admit_after times so far
    reserved: Any  # id slots equal to EMPTY_ID (read zeros, counted nowhere else)


def overflow_fraction(load_factor: float, bucket_size: int) -> float:
    """The expected fraction of ids that find their bucket full at `load_factor`.

    `E[(X - S)+] / λ` for X ~ Poisson(λ = load_factor·S): the limit of many buckets with
    uniformly hashed ids. Exact finite sum: `E[(X - S)+] = λ - S + Σ_{k<S} (S - k)·P(X = k)`.

    Examples:
      >>> [round(100 * overflow_fraction(0.75, s), 3) for s in (16, 32, 64)]
      [2.053, 0.55, 0.074]
    """
    s = int(bucket_size)
    lam = float(load_factor) * s
    if lam <= 0:
        return 0.0
    # P(X = k) in log space: exp(-λ) alone underflows for big buckets.
    log_p = lambda k: -lam + k * math.log(lam) - math.lgamma(k + 1)
    under = sum((s - k) * math.exp(log_p(k)) for k in range(s))
    return max(0.0, lam - s + under) / lam
