"""Variant groups: what `jaxembed bench sparse | bags | routed` share.

A `Variant` is one implementation of one training step on one mesh, written as

    step(state, *inputs) -> (state, out, fallback)

with the state (table and optimizer state) donated, `out` the lookup's output and
`fallback` an int32 flag (1 when a routed exchange overflowed and ran its exact fallback).
The loss gradient that drives the update reads the forward's output, as in training (here
`g = where(isfinite(out), ct, 0)`: exactly the fixed cotangent `ct`); a step whose update
did not depend on its forward would make XLA copy the donated table.

Variants compared side by side form a group, run as `benchmarks.layouts.run` runs a case:

1. `compile_group` lowers each variant on abstract inputs (nothing is allocated), reads its
   collectives and wire bytes from the compiled HLO (`hlo_bytes`, which tells the routed
   exchange's two branches apart), its memory from `memory_analysis()`, its compile time;
2. `admit` keeps the variants whose buffers fit in the memory budget (the rest are
   reported `not_run`, with why);
3. `run_checked` runs each variant once and compares its output and every row it touched
   (plus a sample of rows it did not) with a float64 numpy reference of the step
   (`benchmarks.common.reference`);
4. `time_group` times the variants interleaved (`benchmarks.common.timing`: a rotated order
   each round, an untimed call before each timed one) and records medians and p90s.

The benchmarks reach those helpers through this module, imported as `harness`
(`harness.Reference`, `harness.hlo_bytes`, ...).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from benchmarks.common.compiled import error_record, memory_record, run_bytes
from benchmarks.common.hlo_bytes import hlo_bytes
from benchmarks.common.reference import (
    Reference,
    check,
    exact_cotangent,
    host_table_rows,
    run_checked,
)
from benchmarks.common.timing import QUICK_TIMING, TimingPolicy, time_interleaved, time_record

__all__ = [
    "QUICK_TIMING",
    "TIMING",
    "Reference",
    "Variant",
    "admit",
    "check",
    "compile_group",
    "exact_cotangent",
    "hlo_bytes",
    "host_table_rows",
    "init_table",
    "memory_budget",
    "run_checked",
    "time_group",
]

TIMING = TimingPolicy(repeats=10, warmup=1, settle=1, min_samples=3, max_seconds=3.0)
"""The full runs' timing: 10 interleaved rounds, 3 s of timed calls per variant and group."""

# --- variants ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Variant:
    """One implementation of a step, and (once built) its compiled program and state.

    Attributes:
      name: the implementation's name in the record.
      mesh: the concrete mesh it runs on.
      fn: `fn(state, *inputs) -> (state, out, fallback)`.
      abstract_state: the state as `ShapeDtypeStruct`s with shardings (for compiling).
      init_state: builds the concrete state (called only when the variant runs).
      input_specs: the inputs by name (`ids`, `ct`, ...; the group's host inputs have the
        same names), in order, each with its `PartitionSpec` on `mesh`.
      formula: the reference update: `"sgd"`, `"rowwise_adagrad"` or `"adagrad"`.
      eps: the formula's eps (`"adagrad"` is optax's: g/√(s + eps), none where s = 0).
      table_of: the table inside a state.
      phys: logical ids -> the table's physical rows (mod row order permutes them).
      out_shardings: for Auto meshes, the outputs' shardings (None: from the types).
      info: extra fields for the record (the plan's exchange, capacity, ...).
      vocab: the logical rows when the table is padded (mod row order), else None.
    """

    name: str
    mesh: Any
    fn: Callable[..., Any]
    abstract_state: Any
    init_state: Callable[[], Any]
    input_specs: dict[str, Any]
    formula: str
    eps: float = 0.0
    table_of: Callable[[Any], jax.Array] = lambda state: state[0]
    phys: Callable[[np.ndarray], np.ndarray] = lambda ids: ids
    out_shardings: Any = None
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    vocab: int | None = None
    result: dict[str, Any] = dataclasses.field(default_factory=dict)
    compiled: Any = None
    state: Any = None
    inputs: tuple[Any, ...] = ()
    hlo_text: str = ""

    @property
    def ready(self) -> bool:
        return self.compiled is not None and self.state is not None

    def put_inputs(self, host: dict[str, np.ndarray]) -> None:
        """Places the host inputs it reads in its layouts (replacing the previous ones)."""
        self.inputs = tuple(
            jax.device_put(host[name], NamedSharding(self.mesh, spec))
            for name, spec in self.input_specs.items()
        )

    def __call__(self) -> tuple[Any, int]:
        """One step on the current inputs; returns `(out, fallback)`."""
        self.state, out, fallback = self.compiled(self.state, *self.inputs)
        jax.block_until_ready((self.state, out))
        return out, fallback

    def release(self) -> None:
        """Frees the state's buffers now (a variant may hold a table of gigabytes)."""
        if self.state is not None:
            for leaf in jax.tree.leaves(self.state):
                if isinstance(leaf, jax.Array) and not leaf.is_deleted():
                    leaf.delete()
        self.state, self.inputs = None, ()


def abstract(shape, dtype, mesh, spec) -> jax.ShapeDtypeStruct:
    """A `ShapeDtypeStruct` laid out as `spec` on `mesh`."""
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=NamedSharding(mesh, spec))


def init_table(shape, mesh, spec, *, seed: int = 0, transform: Callable | None = None):
    """A deterministic table in `[-0.5, 0.5)` made on the devices, in its layout.

    Row i's values are a hash of (i, column, seed): no host copy and no random-number
    kernel, so even a 2 GiB table appears in a second or two. `transform` (e.g.
    `lambda t: jaxembed.to_mod_order(t, n)`) runs on it before it is laid out.
    """
    rows, hidden = shape

    def make():
        i = jax.lax.broadcasted_iota(jnp.uint32, (rows, hidden), 0)
        j = jax.lax.broadcasted_iota(jnp.uint32, (rows, hidden), 1)
        h = i * jnp.uint32(0x9E3779B1) + j * jnp.uint32(0x85EBCA77) + jnp.uint32(seed * 7919)
        h = (h ^ (h >> 15)) * jnp.uint32(0x2C1B3C6D)
        h = h ^ (h >> 12)
        t = (h >> 8).astype(jnp.float32) / 2.0**24 - 0.5
        return t if transform is None else transform(t)

    with jax.set_mesh(mesh):
        return jax.jit(make, out_shardings=NamedSharding(mesh, spec))()


# --- compile: bytes and memory ------------------------------------------------------------------


def compile_group(variants: Sequence[Variant], host: dict[str, np.ndarray]) -> None:
    """Compiles every variant on abstract inputs; fills `variant.result` (errors included).

    Args:
      variants: the group.
      host: the group's inputs by name (only their shapes and dtypes are used here).
    """
    for v in variants:
        args = tuple(abstract(host[n].shape, host[n].dtype, v.mesh, spec)
                     for n, spec in v.input_specs.items())  # fmt: skip
        kwargs = {} if v.out_shardings is None else {"out_shardings": v.out_shardings}
        try:
            start = time.perf_counter()
            with jax.set_mesh(v.mesh):
                jitted = jax.jit(v.fn, donate_argnums=(0,), **kwargs)
                v.compiled = jitted.lower(v.abstract_state, *args).compile()
            seconds = time.perf_counter() - start
        except Exception as err:  # an implementation that does not compile is a result
            v.result = {**error_record("compile", err), **v.info}
            v.compiled = None
            continue
        v.hlo_text = v.compiled.as_text()
        v.result = {
            "status": "compiled",
            "compile_time_in_s": round(seconds, 4),
            **hlo_bytes(v.hlo_text, v.mesh),
            **memory_record(v.compiled),
            **v.info,
        }


def memory_budget(limit: int | None) -> int:
    """Bytes the runnable variants of a group may hold together: `limit`, else 60% of the
    memory available now (`/proc/meminfo`), else 8 GiB where that cannot be read."""
    if limit is not None:
        return int(limit)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(0.6 * int(line.split()[1]) * 1024)
    except OSError:
        pass
    return 8 * 2**30


def admit(variants: Sequence[Variant], budget: int) -> list[Variant]:
    """The compiled variants that fit in `budget` together, in order; the others get a
    `not_run` reason."""
    admitted, used = [], 0
    for v in variants:
        if v.compiled is None:
            continue
        need = run_bytes(v.result, v.mesh.size)
        v.result["run_bytes"] = need
        if used + need > budget:
            v.result["not_run"] = (
                f"needs {need / 2**30:.2f} GiB over {v.mesh.size} devices; "
                f"{(budget - used) / 2**30:.2f} GiB of the {budget / 2**30:.2f} GiB budget "
                "were left"
            )
            v.compiled = None
            continue
        used += need
        admitted.append(v)
    return admitted


# --- timing -------------------------------------------------------------------------------------


def time_group(variants: Sequence[Variant], policy: TimingPolicy) -> None:
    """Times the ready variants interleaved and adds their times to their results."""
    ready = {v.name: v for v in variants if v.ready and v.result.get("status") == "ok"}
    if not ready:
        return
    samples = time_interleaved(dict(ready), policy)
    for name, v in ready.items():
        v.result.update(time_record(samples[name]))


def ratio(a: float | None, b: float | None) -> float | None:
    """`a / b` rounded, or None when either is missing or b is 0."""
    if a is None or b is None or not b:
        return None
    return round(a / b, 4)


def geomean(values: Sequence[float | None]) -> float | None:
    """The geometric mean of the positive finite values, or None."""
    values = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    return round(math.exp(sum(map(math.log, values)) / len(values)), 4) if values else None


def median_ms(result: dict[str, Any] | None) -> float | None:
    """A result's median time, if it ran and agreed with the reference."""
    if not result or result.get("status") != "ok" or not result.get("agrees_with_reference"):
        return None
    return result.get("time_median_in_ms")


def progress(enabled: bool, prefix: str) -> Callable[[str], None]:
    """A `say(message)` that prints `[prefix  12.3 s] message` to stderr when enabled."""
    start = time.perf_counter()

    def say(message: str) -> None:
        if enabled:
            elapsed = time.perf_counter() - start
            print(f"[{prefix} {elapsed:7.1f} s] {message}", file=sys.stderr, flush=True)

    return say


# --- the command line ---------------------------------------------------------------------------


def parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The flags every variant-group benchmark (sparse, bags, routed) takes."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--quick", action="store_true", help="tiny shapes, few repeats (for tests)")
    p.add_argument("--json", metavar="PATH", help="write the record as JSON")
    p.add_argument("--plot", metavar="DIR", help="write PNG plots into DIR")
    p.add_argument("--markdown", metavar="PATH", help="write the tables as Markdown")
    p.add_argument("--repeats", type=int, metavar="N", help="interleaved timing rounds")
    p.add_argument("--max-seconds", type=float, metavar="S",
                   help="timed seconds per implementation and group, after 3 samples")  # fmt: skip
    p.add_argument("--memory-gib", type=float, metavar="GIB",
                   help="host memory the variants of a group may hold together (default: 60%% "
                   "of what is available)")  # fmt: skip
    p.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    return p


def common_changes(args: argparse.Namespace, config: Any) -> dict[str, Any]:
    """`dataclasses.replace` changes from the common flags (timing and memory)."""
    timing = {}
    if args.repeats:
        timing["repeats"] = args.repeats
    if args.max_seconds is not None:
        timing["max_seconds"] = args.max_seconds
    changes: dict[str, Any] = {}
    if timing:
        changes["timing"] = dataclasses.replace(config.timing, **timing)
    if args.memory_gib is not None:
        changes["memory_budget_bytes"] = int(args.memory_gib * 2**30)
    return changes


def all_agree(points: Sequence[dict[str, Any]]) -> bool | None:
    """Whether every implementation that ran in `points` agreed with the float64 reference
    (None when none ran)."""
    agree = [r.get("agrees_with_reference") for p in points
             for r in p["implementations"].values() if r.get("status") == "ok"]  # fmt: skip
    return all(agree) if agree else None


def run_and_finish(
    prog: str,
    run: Callable[..., dict[str, Any]],
    config: Any,
    args: argparse.Namespace,
    tables: Callable[[dict[str, Any]], list[Any]],
    plot: Callable[[dict[str, Any], str], list[str]],
) -> int:
    """A bench command's end: `run(config, say=...)`, a bad config's ValueError as `prog:
    error: ...` (exit 2), else `finish` with the record's tables and plots."""
    try:
        record = run(config, say=progress(not args.no_progress, prog.removeprefix("jaxembed ")))
    except ValueError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    return finish(record, args, tables(record), plot)


def finish(
    record: dict[str, Any],
    args: argparse.Namespace,
    tables: list[Any],
    plot: Callable[[dict[str, Any], str], list[str]],
) -> int:
    """Prints the tables and writes the JSON, Markdown and plots the flags ask for."""
    from benchmarks.common import report

    m = record["machine"]
    header = (f"{record['schema']} on {m['device_count']} {m['platform']} devices, "
              f"{m['cpu_count']} CPU cores; jax {m['jax']}")  # fmt: skip
    report.print_table_list(header, tables)
    report.write_outputs(
        record, json_path=args.json, markdown_path=args.markdown,
        markdown=lambda: report.markdown_tables(tables), plot_path=args.plot, plot=plot,
    )  # fmt: skip
    return 0


def config_record(config: Any) -> dict[str, Any]:
    """A config dataclass as JSON-ready data."""
    return json.loads(json.dumps(dataclasses.asdict(config), default=list))
