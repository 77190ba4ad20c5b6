"""The `jaxembed` command: `plan`, `demo` and `bench`.

A thin shell: flags are parsed here and handed to the same typed functions a Python user
calls (`plan_embedding`, `jaxembed.demo.run`); `bench` runs the checkout's `benchmarks`
package (`python -m benchmarks`), which is not installed with jaxembed.

    jaxembed plan --mesh data=2,model=4 --ids 16x128 --table 65536x128 \\
                  --ids-spec data --table-spec model,None
    jaxembed demo
    jaxembed bench --quick
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxembed.collection.config import FeatureConfig, TableConfig

__all__ = ["load_tables_json", "main", "parse_mesh", "parse_shape", "parse_spec"]


def parse_mesh(text: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Parses `--mesh`: `"data=2,model=4"` -> `(("data", "model"), (2, 4))`.

    Args:
      text: `name=size` pairs separated by commas, major axis first.

    Returns:
      `(axis_names, axis_sizes)`, ready for `jax.make_mesh(sizes, names)`.

    Raises:
      argparse.ArgumentTypeError: a pair without `=`, an empty name, or a size below 1.

    Examples:
      >>> parse_mesh("data=2,model=4")
      (('data', 'model'), (2, 4))
    """
    names, sizes = [], []
    for part in text.split(","):
        name, eq, size = part.partition("=")
        if not eq or not name or not size.isdigit() or int(size) < 1:
            raise argparse.ArgumentTypeError(
                f"--mesh takes name=size pairs separated by commas, like data=2,model=4; "
                f"got {text!r}"
            )
        names.append(name.strip())
        sizes.append(int(size))
    return tuple(names), tuple(sizes)


def parse_shape(text: str) -> tuple[int, ...]:
    """Parses `--ids` and `--table`: `"16x128"` -> `(16, 128)`; `""` or `"scalar"` -> `()`.

    Args:
      text: positive sizes joined by `x` (or `X`), or `""`/`"scalar"` for rank 0.

    Returns:
      The shape as a tuple of ints.

    Raises:
      argparse.ArgumentTypeError: a size that is not a positive integer.

    Examples:
      >>> parse_shape("16x128"), parse_shape("scalar")
      ((16, 128), ())
    """
    if text in ("", "scalar"):
        return ()
    try:
        shape = tuple(int(d) for d in text.lower().split("x"))
    except ValueError:
        shape = ()
    if not shape or any(d < 1 for d in shape):
        raise argparse.ArgumentTypeError(
            f"a shape is sizes joined by 'x', like 16x128; got {text!r}"
        )
    return shape


def parse_spec(text: str | None):
    """Parses a spec flag: `"model,None"` -> `P("model", None)`.

    Entries are separated by commas, one per tensor axis: a mesh axis name, `None` (also
    `none`, `-` or empty) for a replicated axis, or names joined by `+` for an axis split
    over several mesh axes, major first. None, an empty string or `replicated` is `P()`.

    Args:
      text: the flag's value, or None when the flag was not given.

    Returns:
      A `jax.sharding.PartitionSpec`.

    Examples:
      >>> from jax.sharding import PartitionSpec as P
      >>> parse_spec("data+model,None") == P(("data", "model"), None)
      True
      >>> parse_spec("model,-") == P("model", None), parse_spec(None) == P()
      (True, True)
    """
    from jax.sharding import PartitionSpec as P

    if text is None or text in ("", "replicated"):
        return P()
    entries = []
    for part in text.split(","):
        part = part.strip()
        if part in ("None", "none", "-", ""):
            entries.append(None)
        elif "+" in part:
            entries.append(tuple(p.strip() for p in part.split("+")))
        else:
            entries.append(part)
    return P(*entries)


def _add_plan_parser(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="print the plan of a sharded lookup: layouts, collectives, bytes, memory",
        description="Print the EmbeddingPlan that jaxembed.embedding runs for a mesh, shapes "
        "and layouts. Specs are comma-separated entries: a mesh axis name, None, or names "
        "joined by '+' for an axis split over several mesh axes (major first).",
    )
    p.add_argument("--mesh", type=parse_mesh, required=True, help="e.g. data=2,model=4")
    p.add_argument("--ids", type=parse_shape, default=None, help="ids shape, e.g. 16x128")
    p.add_argument("--table", type=parse_shape, default=None, help="table shape, e.g. 65536x128")
    coll = p.add_argument_group(
        "a collection of tables (jaxembed.plan.collection.plan_collection; docs/planner.md)"
    )
    coll.add_argument("--tables", default=None, help="TABLES.json: the tables and features")
    coll.add_argument("--batch", type=int, default=None, help="global batch size, e.g. 4096")
    coll.add_argument("--memory", default=None, help="budget per device, e.g. 2GiB")
    coll.add_argument("--batch-axes", default=None, help="mesh axes of the batch (default all)")
    coll.add_argument(
        "--serving",
        action="store_true",
        help="plan the lookups alone (no update, no optimizer state)",
    )
    coll.add_argument(
        "--precision",
        default=None,
        help="tables served quantized (implies --serving): int8, int4, int2 "
        "or fp8 for all, or per table, e.g. item=int4,user=int8",
    )
    coll.add_argument("--backend", choices=("cpu", "gpu", "tpu"), default=None,
                      help="cost constants (default: this machine's)")  # fmt: skip
    p.add_argument("--ids-spec", default=None, help="e.g. data (default: replicated)")
    p.add_argument("--table-spec", default=None, help="e.g. model,None (default: replicated)")
    p.add_argument("--out-spec", default=None, help="e.g. data,model,None (default: derived)")
    p.add_argument("--out-unreduced", default="", help="row axes to leave unreduced, e.g. model")
    p.add_argument("--vocab-size", type=int, default=None, help="real rows of a padded table")
    p.add_argument("--padding-idx", type=int, default=None)
    p.add_argument("--dtype", default="float32", help="table dtype (float32, bfloat16)")
    p.add_argument("--exchange", choices=("auto", "dense", "rows", "routed"), default="auto",
                   help="how ids reach rows and gradients reach the table")  # fmt: skip
    p.add_argument("--row-sharding", choices=("block", "mod"), default="block")
    p.add_argument("--capacity", type=int, default=None, help="the routed exchange's C")
    p.add_argument("--impl", choices=("auto", "xla", "native"), default="auto",
                   help="shard-local kernels")  # fmt: skip
    bag = p.add_argument_group("a bag lookup (jaxembed.embedding_bag) or a row-sparse update")
    bag.add_argument(
        "--combiner", choices=("sum", "mean", "sqrtn", "max"), default=None,
        help="pool the ids' last axis into bags ([*batch, L] -> [*batch, H])",
    )  # fmt: skip
    bag.add_argument(
        "--bags", type=int, default=None,
        help="flat form: ids [*lead, N] hold this many bags per lead element",
    )  # fmt: skip
    bag.add_argument("--weighted", action="store_true", help="per-id weights")
    bag.add_argument("--optimizer", default=None,
                     help="plan a row-sparse update with this jaxembed.optim optimizer, e.g. "
                          "rowwise_adagrad")  # fmt: skip
    p.add_argument("--axis-types", choices=("explicit", "auto"), default="explicit")
    p.add_argument(
        "--host-axes", default="",
        help="mesh axes that span hosts, e.g. data: prints the bytes that leave a host",
    )  # fmt: skip


def _run_plan(args: argparse.Namespace) -> int:
    import jax.numpy as jnp
    from jax.sharding import AbstractMesh, AxisType
    from jax.sharding import PartitionSpec as P

    from jaxembed.plan import plan_embedding

    if args.tables is not None:
        return _run_plan_tables(args)
    if args.ids is None or args.table is None:
        why = "give --ids and --table (one lookup) or --tables (a collection)"
        print(f"jaxembed plan: error: {why}", file=sys.stderr)
        return 2
    names, sizes = args.mesh
    axis_type = AxisType.Explicit if args.axis_types == "explicit" else AxisType.Auto
    mesh = AbstractMesh(sizes, names, axis_types=(axis_type,) * len(names))
    out_spec = None
    if args.out_spec is not None or args.out_unreduced:
        base = parse_spec(args.out_spec)
        unreduced = {a for a in args.out_unreduced.split(",") if a}
        out_spec = P(*base.partitions, unreduced=unreduced) if unreduced else base
    common = dict(
        x_spec=parse_spec(args.ids_spec), weight_spec=parse_spec(args.table_spec),
        out_spec=out_spec, padding_idx=args.padding_idx, vocab_size=args.vocab_size,
        dtype=jnp.dtype(args.dtype), exchange=args.exchange, row_sharding=args.row_sharding,
        capacity=args.capacity, impl=args.impl,
    )  # fmt: skip
    bag = args.combiner is not None or args.bags is not None
    try:
        if args.optimizer is not None:
            import jaxembed.optim

            factory = getattr(jaxembed.optim, args.optimizer, None)
            if factory is None or not callable(factory) or args.optimizer.startswith("Row"):
                raise ValueError(
                    f"--optimizer {args.optimizer!r} is not a jaxembed.optim optimizer (sgd, "
                    "adagrad, fbgemm_adagrad, rowwise_adagrad, adam, partial_rowwise_adam, ftrl)"
                )
            if bag:
                common.update(combiner=args.combiner or "sum", num_bags=args.bags,
                              weighted=args.weighted)  # fmt: skip
            plan = factory(learning_rate=0.01).plan(mesh, args.ids, args.table, **common)
        elif bag:
            from jaxembed.plan import plan_embedding_bag

            plan = plan_embedding_bag(
                mesh, args.ids, args.table, combiner=args.combiner or "sum",
                num_bags=args.bags, weighted=args.weighted, **common,
            )  # fmt: skip
        else:
            plan = plan_embedding(mesh, args.ids, args.table, **common)
    except (TypeError, ValueError) as e:
        print(f"jaxembed plan: error: {e}", file=sys.stderr)
        return 2
    print(plan)
    host_axes = [a for a in args.host_axes.split(",") if a]
    if host_axes:
        from jaxembed.plan import format_bytes

        try:
            over = plan.wire_bytes_over(host_axes)
        except ValueError as e:
            print(f"jaxembed plan: error: {e}", file=sys.stderr)
            return 2
        spans = ",".join(host_axes)
        print(f"  across hosts ({spans} spans hosts): {format_bytes(over)} per device")
    return 0


# --- `jaxembed plan --tables`: a collection of tables from TABLES.json ---------------------
#
# TABLES.json (see docs/planner.md):
#
#     {"tables":   [{"name": "item", "vocab_size": 1000000, "dim": 64},
#                   {"name": "country", "vocab_size": 200, "dim": 16,
#                    "placement": "replicated"}],
#      "features": [{"name": "clicked", "table": "item", "combiner": "mean", "max_ids": 50},
#                   {"name": "country", "table": "country"}]}
#
# Table keys are `TableConfig`'s (`placement` defaults to `"auto"`; `dtype` a name such as
# `"bfloat16"`), feature keys `FeatureConfig`'s; without `"features"`, each table gets one
# single-id feature of its own name. A dynamic table's `"dynamic"` holds `DynamicTableConfig`'s
# keys (`{"capacity": 1048576, "bucket_size": 16, "admit_after": 2}`); its `vocab_size` may be
# left out (it is the capacity).


def _allowed_keys(cls: type) -> set[str]:
    """The keys an entry of a config may have: its fields (a table's initializer apart)."""
    return {f.name for f in dataclasses.fields(cls)} - {"initializer"}


def _required(cls: type) -> list[str]:
    """The fields of a config without a default (in order): the keys every entry needs."""
    return [
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]


def _keys_text(cls: type, allowed: set[str]) -> str:
    required = _required(cls)
    optional = [f.name for f in dataclasses.fields(cls) if f.name in allowed - set(required)]
    return f"an entry takes {required} and optionally {optional}"


def _entries(data: Any, key: str, cls: type, path: str) -> list[dict]:
    allowed = _allowed_keys(cls)
    items = data.get(key)
    if not isinstance(items, list) or not all(isinstance(x, dict) for x in items):
        raise ValueError(f"{path}: {key!r} must be a list of objects, got {items!r}")
    for i, x in enumerate(items):
        entry = f"{key}[{i}]" + (f" ({x['name']!r})" if "name" in x else "")
        extra = sorted(set(x) - allowed)
        if extra:
            close = {k: difflib.get_close_matches(k, sorted(allowed), n=1) for k in extra}
            hints = [f"{k!r} -> {m[0]!r}" for k, m in close.items() if m]
            raise ValueError(
                f"{path}: {entry} has unknown keys {extra}: {_keys_text(cls, allowed)}"
                + (f" (did you mean {', '.join(hints)}?)" if hints else "")
            )
        missing = [k for k in _required(cls) if k not in x]
        if key == "tables" and "dynamic" in x:  # a dynamic table's rows are its capacity
            missing = [k for k in missing if k != "vocab_size"]
        if missing:
            raise ValueError(
                f"{path}: {entry} is missing the key{'s' if len(missing) > 1 else ''} "
                f"{missing}: {_keys_text(cls, allowed)}, e.g. {_EXAMPLES[key]}"
            )
    return items


_EXAMPLES = {
    "tables": '{"name": "item", "vocab_size": 1000000, "dim": 64}',
    "features": '{"name": "clicked", "table": "item", "combiner": "mean", "max_ids": 50}',
}


def _build(cls: type, x: dict, key: str, i: int, path: str) -> Any:
    """`cls(**x)`, its errors prefixed with the file and the entry (same exception type); a
    table's `"dynamic"` object is a `DynamicTableConfig`'s keys."""
    try:
        if key == "tables" and isinstance(x.get("dynamic"), dict):
            from jaxembed.dynamic.config import DynamicTableConfig

            dynamic = DynamicTableConfig(**x["dynamic"])
            x = {"vocab_size": dynamic.capacity, **x, "dynamic": dynamic}
        return cls(**x)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{path}: {key}[{i}] ({x['name']!r}): {e}") from None


def load_tables_json(path: str | Path) -> tuple[list[TableConfig], list[FeatureConfig]]:
    """Reads a TABLES.json: `{"tables": [...], "features": [...]}` (the format above).

    Raises:
      ValueError: unreadable JSON, an entry with unknown keys or without a required one
        (tables need `name`, `vocab_size` and `dim`; features `name` and `table`), or a
        value `TableConfig` or `FeatureConfig` rejects with a ValueError; every message
        names the file and the entry (its index and name).
      TypeError: a value `TableConfig` or `FeatureConfig` rejects with a TypeError (e.g. a
        dtype that is not a float dtype), named likewise.
    """
    from jaxembed.collection.config import FeatureConfig, TableConfig

    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read the tables file {str(path)!r}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected an object with 'tables' and 'features'")
    path = str(path)
    tables = [
        _build(TableConfig, x, "tables", i, path)  # a dtype name: TableConfig reads it
        for i, x in enumerate(_entries(data, "tables", TableConfig, path))
    ]
    if "features" in data:
        entries = _entries(data, "features", FeatureConfig, path)
        features = [_build(FeatureConfig, x, "features", i, path) for i, x in enumerate(entries)]
    else:
        features = [FeatureConfig(t.name, t.name) for t in tables]
    return tables, features


def _parse_precision(text: str | None) -> str | dict[str, str] | None:
    """`--precision`: `"int4"` (every table) or `"item=int4,user=int8"` (those tables)."""
    if not text or "=" not in text:
        return text or None
    out = {}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise ValueError(
                f"--precision {text!r}: use one precision (int4) or table=precision pairs "
                f"separated by commas (item=int4,user=int8); {part!r} is neither"
            )
        out[name.strip()] = value.strip()
    return out


def _run_plan_tables(args: argparse.Namespace) -> int:
    """`jaxembed plan --tables ...`: plans the collection and prints it (exit code 0, or 2
    with the error on stderr)."""
    from jax.sharding import AbstractMesh, AxisType

    from jaxembed.plan.collection import plan_collection

    names, sizes = args.mesh
    if args.batch is None or args.memory is None:
        print("jaxembed plan: error: --tables needs --batch and --memory", file=sys.stderr)
        return 2
    mesh = AbstractMesh(sizes, names, axis_types=(AxisType.Explicit,) * len(names))
    try:
        tables, features = load_tables_json(args.tables)
        batch_axes = [a for a in args.batch_axes.split(",") if a] if args.batch_axes else None
        precision = _parse_precision(args.precision)
        plan = plan_collection(
            tables, features, mesh, batch_size=args.batch, memory_per_device=args.memory,
            batch_axes=batch_axes, backend=args.backend,
            serving=True if args.serving or precision else None, precision=precision,
        )  # fmt: skip
    except (TypeError, ValueError) as e:
        print(f"jaxembed plan: error: {e}", file=sys.stderr)
        return 2
    print(plan)
    return 0


def _ensure_cpu_devices(count: int) -> None:
    """Asks XLA for `count` CPU devices; must run before jax is imported."""
    if "jax" in sys.modules:
        return
    flag = f"--xla_force_host_platform_device_count={count}"
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `jaxembed` console script: `plan`, `demo` or `bench`.

    `plan` builds an `AbstractMesh` (no devices needed), calls `plan_embedding` and prints
    the plan; `--host-axes` adds the bytes that cross hosts. `demo` runs
    `jaxembed.demo.run` on `--devices` CPU devices; `bench` hands its arguments to
    `benchmarks.main` of the checkout beside the package. Both ask XLA for CPU devices (8 by
    default), which takes effect only when jax is not imported yet, and set glibc's malloc
    to keep XLA's per-step buffers for reuse (`jaxembed.host.tune_malloc`).

    Args:
      argv: the arguments after the program name (default `sys.argv[1:]`).

    Returns:
      The exit code: 0 on success, 2 for flags the plan rejects (the error goes to stderr),
      or the demo's or the benchmark's own code.

    Examples:
      >>> main(["plan", "--mesh", "data=2,model=4", "--ids", "16x128", "--table", "65536x128",
      ...       "--ids-spec", "data", "--table-spec", "model,None", "--host-axes", "data"])
      EmbeddingPlan  mesh: data=2 x model=4
      ...
        wire bytes per device: forward 768.0 KiB, backward 516.0 KiB
      ...
        across hosts (data spans hosts): 516.0 KiB per device
      0
    """
    parser = argparse.ArgumentParser(
        prog="jaxembed", description="Sharded embedding lookups for JAX."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_plan_parser(sub)
    demo = sub.add_parser("demo", help="run the lookup on 8 CPU devices and check it")
    demo.add_argument("--devices", type=int, default=8, help="CPU devices to simulate")
    sub.add_parser(
        "bench", help="benchmark against XLA, Flax and one-hot lookups (jaxembed bench -h)",
        add_help=False,
    )  # fmt: skip
    argv = list(sys.argv[1:] if argv is None else argv)
    # `bench` owns its flags (argparse.REMAINDER would reject a first one like --quick).
    args, bench_args = (
        parser.parse_known_args(argv) if argv[:1] == ["bench"] else (parser.parse_args(argv), [])
    )

    if args.command == "plan":
        return _run_plan(args)
    if args.command in ("demo", "bench"):  # before jax starts its backend
        from jaxembed import host

        host.tune_malloc(warn=False)
    if args.command == "demo":
        _ensure_cpu_devices(args.devices)
        from jaxembed import demo as demo_module

        return demo_module.run()
    if args.command == "bench":
        _ensure_cpu_devices(8)
        if "--calibrate" in bench_args and bench_args[0].startswith("-"):  # works installed
            from jaxembed import calibrate

            return calibrate.main([a for a in bench_args if a != "--calibrate"])
        benchmarks = _checkout_benchmarks()
        return 2 if benchmarks is None else benchmarks.main(bench_args)
    raise AssertionError(args.command)


def _checkout_benchmarks():
    """The `benchmarks` package of the checkout jaxembed runs from (None, said on stderr, when
    jaxembed is installed without one: the benchmarks are not part of the package)."""
    import importlib

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.isfile(os.path.join(root, "benchmarks", "__init__.py")):
        print(
            f"jaxembed bench: error: no benchmarks/ beside the jaxembed package ({root}); the "
            "benchmarks live in the repository, not in the installed package: clone it, "
            "`pip install -e .` there, and run `jaxembed bench ...` or `python -m benchmarks ...` "
            "from its root (`jaxembed bench --calibrate` works anywhere)",
            file=sys.stderr,
        )
        return None
    if root not in sys.path:
        sys.path.insert(0, root)
    return importlib.import_module("benchmarks")


if __name__ == "__main__":
    sys.exit(main())
