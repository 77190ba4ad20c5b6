"""`python -m benchmarks.quant.fbgemm`: quantized pooled lookups, jaxembed against FBGEMM (CPU).

T tables of V rows x D, quantized by `jaxembed.quant.quantize` (int8, int4 and int2: FBGEMM's
row-wise formats, `SparseType.INT8 / INT4 / INT2`; fp8: its `SparseType.FP8`, the hfp8 code
of `exponent_bits` 4 and `exponent_bias` 7 by default, which the TBE takes as
`fp8_exponent_bits / fp8_exponent_bias`), B bags a table of L uniform ids each, sum pooling,
one device. Three implementations pool the same quantized bytes:

* `jaxembed`: `jaxembed.kernels.quant_native.pool_sum`, the native kernel, on the T tables
  stacked into one `QuantizedTable` of T·V rows (table t's ids offset by t·V, its bag b is
  segment t·B + b): one custom call, as the TBE is one op;
* `jaxembed[xla]`: `jaxembed.kernels.quant.pool_sum`, the XLA path (plain StableHLO), on the
  same stack;
* `fbgemm`: FBGEMM's `IntNBitTableBatchedEmbeddingBagsCodegen` (fbgemm-gpu-cpu, float32
  output; `fbgemm_runner`), its weights written with `jaxembed.quant.to_fbgemm_rows` and read
  back with `from_fbgemm_rows` to check they are jaxembed's bytes.

Before timing, each output is compared with FBGEMM's (bitwise, and its largest difference) and
with a float64 sum of the dequantized rows. Each implementation is compiled ahead of time
(`jax.jit(...).lower(...).compile()`) and timed around `block_until_ready` in interleaved,
rotated rounds (`benchmarks.common.timing`), each call on the next of `batches_per_case`
batches of fresh ids (a batch's rows would otherwise stay in the last-level cache from the
call before), no settling call. The record keeps the median, p90 and samples, the ratio of
medians to FBGEMM and the median of the per-round ratios (robust to a machine whose load
changes during the run: both calls of a round see the same load), and the median process CPU
time of a call (robust to the time slices a loaded machine takes away; with n > 1 threads it
counts every thread's time, so it is no speed at n > 1).

Targets: jaxembed's native kernels at most FBGEMM's time for int8 and int4; int2 and fp8
are measured and their ratios reported, with no threshold.

Threads: for each thread count n, `JAXEMBED_NUM_THREADS=n` (read when the kernel is traced)
and `torch.set_num_threads(n)`; FBGEMM 1.8's CPU forward pools on one thread whatever n.

    XLA_FLAGS=--xla_force_host_platform_device_count=1 python -m benchmarks.quant.fbgemm \\
        --json benchmarks/results/quant/fbgemm.json --markdown benchmarks/results/quant/fbgemm.md
    python -m benchmarks.quant.fbgemm --quick              # tiny shapes: exercises the code
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from benchmarks.common.timing import QUICK_TIMING, TimingPolicy, time_interleaved, time_record

__all__ = ["QUICK", "FbgemmConfig", "main", "run_fbgemm", "tables", "targets"]

SCHEMA = "benchmarks.quant.fbgemm/1"
IMPLEMENTATIONS = ("jaxembed", "jaxembed[xla]", "fbgemm")
TARGET_PRECISIONS = ("int8", "int4")
"""The precisions held to <= 1.0x FBGEMM's time (int2 and fp8 are measured and reported)."""


TIMING = TimingPolicy(repeats=100, warmup=3, settle=0, min_samples=5, max_seconds=4.0)
"""100 rounds; the XLA path, ~10x slower, stops after 4 s of timed calls (5 samples at least)."""


@dataclasses.dataclass(frozen=True)
class FbgemmConfig:
    """What `run_fbgemm` measures.

    Attributes:
      num_tables, rows, dim: T tables of V rows x D.
      batches: the batch sizes B (bags a table).
      bag_length: L, the ids of every bag.
      precisions: of `jaxembed.quant.quantize` ("int8", "int4", "int2", "fp8").
      fp8_exponent_bits, fp8_exponent_bias: fp8's format, for `quantize` and the TBE alike
        (FBGEMM's `SparseType.FP8.default_config()`: 4 and 7).
      threads: thread counts, each a case (`JAXEMBED_NUM_THREADS`, `torch.set_num_threads`).
      batches_per_case: batches of fresh ids a case cycles through.
      seed: of the tables and the ids.
      timing: the interleaved rounds (settle is not used: each call takes the next batch).
      quick: tiny shapes (a label for the record).
    """

    num_tables: int = 8
    rows: int = 100_000
    dim: int = 64
    batches: tuple[int, ...] = (512, 2048)
    bag_length: int = 20
    precisions: tuple[str, ...] = ("int8", "int4", "int2", "fp8")
    fp8_exponent_bits: int = 4
    fp8_exponent_bias: int = 7
    threads: tuple[int, ...] = (1, 2)
    batches_per_case: int = 8
    seed: int = 0
    timing: TimingPolicy = dataclasses.field(default_factory=lambda: TIMING)
    quick: bool = False


QUICK = FbgemmConfig(num_tables=2, rows=1000, batches=(16,), bag_length=4, threads=(1,),
                     batches_per_case=2, timing=QUICK_TIMING, quick=True)  # fmt: skip
"""`--quick`: two small tables, one batch, two rounds: exercises the code; times mean nothing."""


def _case_name(precision: str, batch: int, threads: int, config: FbgemmConfig) -> str:
    return (f"precision={precision},tables={config.num_tables},rows={config.rows},"
            f"dim={config.dim},batch={batch},bag={config.bag_length},"
            f"threads={threads}")  # fmt: skip


def _quantized_tables(config: FbgemmConfig, precision: str, rng: np.random.Generator):
    """The T tables quantized, and their stack (T·V rows) as jaxembed pools it."""
    import jax.numpy as jnp

    from jaxembed.quant import QuantizedTable, quantize

    shape = (config.rows, config.dim)
    fp8 = _fp8_format(config) if precision == "fp8" else {}
    tables = [quantize(rng.standard_normal(shape, np.float32), precision, **fp8)
              for _ in range(config.num_tables)]  # fmt: skip

    def stack(name):  # fp8 has no scale and bias
        parts = [getattr(q, name) for q in tables]
        return None if parts[0] is None else jnp.concatenate(parts)

    first = tables[0]
    stacked = QuantizedTable(stack("data"), stack("scale"), stack("bias"), precision,
                             first.exponent_bits, first.exponent_bias)  # fmt: skip
    return tables, stacked


def _fp8_format(config: FbgemmConfig) -> dict[str, int]:
    """fp8's format, as `quantize` and FBGEMM's TBE both take it."""
    return {"fp8_exponent_bits": config.fp8_exponent_bits,
            "fp8_exponent_bias": config.fp8_exponent_bias}  # fmt: skip


def _same_bytes(fbgemm, tables) -> bool:
    """Whether FBGEMM's weights, read back as `QuantizedTable`s, are jaxembed's arrays."""
    from jaxembed.quant import from_fbgemm_rows

    for q, rows in zip(tables, fbgemm.weights(), strict=True):
        fp8 = {"fp8_exponent_bits": q.exponent_bits, "fp8_exponent_bias": q.exponent_bias}
        back = from_fbgemm_rows(rows, q.precision, q.dim, **(fp8 if q.precision == "fp8" else {}))
        for a, b in ((q.data, back.data), (q.scale, back.scale), (q.bias, back.bias)):
            if (a is None) != (b is None):
                return False
            if a is not None and not np.array_equal(np.asarray(a), np.asarray(b)):
                return False
    return True


def _reference(stacked, ids: np.ndarray, config: FbgemmConfig) -> np.ndarray:
    """float64 `[B, T*D]`: each bag the sum of its dequantized rows, in FBGEMM's layout."""
    from jaxembed.quant import dequantize

    t, b, length = ids.shape
    flat = (ids + (np.arange(t) * config.rows)[:, None, None]).reshape(-1)
    unique, inverse = np.unique(flat, return_inverse=True)
    table = np.asarray(dequantize(stacked), np.float32)[unique].astype(np.float64)
    pooled = table[inverse].reshape(t, b, length, -1).sum(axis=2)  # [T, B, D]
    return pooled.transpose(1, 0, 2).reshape(b, -1)


def _compare(got: np.ndarray, fbgemm: np.ndarray, reference: np.ndarray) -> dict[str, Any]:
    scale = max(float(np.abs(reference).max()), 1.0)
    error = float(np.abs(got.astype(np.float64) - reference).max())
    return {
        "bitwise_equal_to_fbgemm": bool(np.array_equal(got, fbgemm)),
        "max_abs_diff_to_fbgemm": float(np.abs(got - fbgemm).max()),
        "max_abs_error_to_float64": error,
        "agrees_with_reference": error <= 1e-5 * scale,  # float32 sums of L rows
    }


def _jaxembed_runners(stacked, ids_list, config: FbgemmConfig, batch: int):
    """(compiled native, compiled XLA) and per implementation a runner cycling the batches."""
    import jax
    import jax.numpy as jnp

    from jaxembed.kernels import quant, quant_native

    t, length = config.num_tables, config.bag_length
    segments = jnp.asarray(np.repeat(np.arange(t * batch, dtype=np.int32), length))
    valid = jnp.ones(segments.shape, bool)
    scale = jnp.ones(segments.shape, jnp.float32)  # sum bags, no weights
    offset = (np.arange(t, dtype=np.int32) * config.rows)[:, None, None]
    locals_ = [jnp.asarray((ids + offset).reshape(-1)) for ids in ids_list]
    compiled = {}
    for name, impl in (("jaxembed", quant_native), ("jaxembed[xla]", quant)):
        fn = lambda q, local, v, s, w, impl=impl: impl.pool_sum(q, local, v, s, w, t * batch)
        compiled[name] = jax.jit(fn).lower(stacked, locals_[0], valid, segments, scale).compile()

    def runner(name: str) -> Callable[[], Any]:
        fn, k = compiled[name], [0]

        def run():
            local = locals_[k[0] % len(locals_)]
            k[0] += 1
            return fn(stacked, local, valid, segments, scale).block_until_ready()

        return run

    def pooled(name: str) -> np.ndarray:  # batch 0, in FBGEMM's layout [B, T*D]
        out = np.asarray(compiled[name](stacked, locals_[0], valid, segments, scale))
        return out.reshape(t, batch, -1).transpose(1, 0, 2).reshape(batch, -1)

    return runner, pooled


def _fbgemm_runner(fbgemm, ids_list) -> Callable[[], Any]:
    inputs = [fbgemm.inputs(ids) for ids in ids_list]
    runs = [fbgemm.runner(*x) for x in inputs]
    k = [0]

    def run():
        out = runs[k[0] % len(runs)]()
        k[0] += 1
        return out

    return run


def _paired_ratio(mine: Sequence[float], base: Sequence[float]) -> float | None:
    """The median over rounds of mine / base (None unless both have one sample a round)."""
    if not mine or len(mine) != len(base):
        return None
    return round(float(np.median(np.asarray(mine) / np.asarray(base))), 4)


def _case(config, precision, batch, threads, tables, stacked, fbgemm, say) -> dict[str, Any]:
    rng = np.random.default_rng([config.seed, batch, threads, len(precision)])
    shape = (config.num_tables, batch, config.bag_length)
    ids_list = [rng.integers(0, config.rows, shape, dtype=np.int32)
                for _ in range(max(1, config.batches_per_case))]  # fmt: skip
    os.environ["JAXEMBED_NUM_THREADS"] = str(threads)  # read when the kernel is traced
    import torch

    torch.set_num_threads(threads)
    name = _case_name(precision, batch, threads, config)
    say(f"{name}: compiling")
    runner, pooled = _jaxembed_runners(stacked, ids_list, config, batch)
    fb_out = fbgemm.pooled(*fbgemm.inputs(ids_list[0]))
    reference = _reference(stacked, ids_list[0], config)
    impls: dict[str, Any] = {"fbgemm": _compare(fb_out, fb_out, reference)}
    for impl in ("jaxembed", "jaxembed[xla]"):
        impls[impl] = _compare(pooled(impl), fb_out, reference)
    say(f"{name}: timing")
    load = os.getloadavg()[0]
    timed = time_interleaved({"jaxembed": {"forward": runner("jaxembed")},
                              "jaxembed[xla]": {"forward": runner("jaxembed[xla]")},
                              "fbgemm": {"forward": _fbgemm_runner(fbgemm, ids_list)}},
                             config.timing)  # fmt: skip
    samples = {impl: timed[impl]["forward"][0] for impl in IMPLEMENTATIONS}  # wall seconds
    cpu = {impl: timed[impl]["forward"][1] for impl in IMPLEMENTATIONS}  # process CPU seconds
    for impl in IMPLEMENTATIONS:
        impls[impl].update(time_record(samples[impl]))
        impls[impl]["cpu_time_median_in_ms"] = round(float(np.median(cpu[impl])) * 1e3, 4)
    base = impls["fbgemm"]["time_median_in_ms"]
    for impl in ("jaxembed", "jaxembed[xla]"):
        impls[impl]["time_ratio_to_fbgemm"] = round(impls[impl]["time_median_in_ms"] / base, 4)
        impls[impl]["paired_time_ratio_to_fbgemm"] = _paired_ratio(samples[impl],
                                                                   samples["fbgemm"])  # fmt: skip
        cpu_base = impls["fbgemm"]["cpu_time_median_in_ms"]
        impls[impl]["cpu_time_ratio_to_fbgemm"] = round(
            impls[impl]["cpu_time_median_in_ms"] / cpu_base, 4
        )
    slots = config.num_tables * batch * config.bag_length
    for impl in IMPLEMENTATIONS:
        impls[impl]["ns_per_row"] = round(impls[impl]["time_median_in_ms"] * 1e6 / slots, 2)
    return {
        "case": name, "precision": precision, "batch": batch, "threads": threads,
        "rows_looked_up": slots, "load_average_1min": [round(load, 2),
                                                       round(os.getloadavg()[0], 2)],
        "implementations": impls,
    }  # fmt: skip


def run_fbgemm(config: FbgemmConfig | None = None, say: Callable[[str], None] | None = None):
    """Measures every (precision, batch, threads) case of `config`.

    Args:
      config: what to measure (default `FbgemmConfig()`; `QUICK` for tiny shapes).
      say: called with a line of progress now and then.

    Returns:
      `{"schema", "machine", "config", "cases": [case, ...], "targets"}`; a case has per
      implementation its checks against FBGEMM and float64 (`bitwise_equal_to_fbgemm`,
      `max_abs_diff_to_fbgemm`, `agrees_with_reference`), its times and its ratios to FBGEMM;
      `same_bytes` says that FBGEMM's weights read back are jaxembed's table.

    Raises:
      RuntimeError: torch or fbgemm_gpu is missing, or the native kernels are unavailable.
    """
    from benchmarks.common.report import machine
    from benchmarks.quant import fbgemm_runner
    from jaxembed.kernels import native

    config = FbgemmConfig() if config is None else config
    say = say or (lambda message: None)
    fbgemm_runner.require()
    if not native.available():
        raise RuntimeError(f"the native kernels are unavailable: {native.why_unavailable()}")
    import jax

    record: dict[str, Any] = {
        "schema": SCHEMA,
        "machine": {**machine(), **fbgemm_runner.versions(), "cpu": _cpu_model(),
                    "jax_devices_used": 1, "jax_device_count": len(jax.devices()),
                    "nice": os.nice(0), "load_average_1min": round(os.getloadavg()[0], 2)},
        "config": {**dataclasses.asdict(config), "timing": dataclasses.asdict(config.timing)},
        "cases": [],
    }  # fmt: skip
    rng = np.random.default_rng(config.seed)
    for precision in config.precisions:
        say(f"{precision}: quantizing {config.num_tables} tables of {config.rows}x{config.dim}")
        tables, stacked = _quantized_tables(config, precision, rng)
        fbgemm = fbgemm_runner.IntNBitTables(precision, config.num_tables, config.rows,
                                             config.dim, **_fp8_format(config))  # fmt: skip
        from jaxembed.quant import to_fbgemm_rows

        fbgemm.load([np.asarray(to_fbgemm_rows(q, row_alignment=fbgemm.row_alignment))
                     for q in tables])  # fmt: skip
        same = _same_bytes(fbgemm, tables)
        for batch in config.batches:
            for threads in config.threads:
                case = _case(config, precision, batch, threads, tables, stacked, fbgemm, say)
                case["same_bytes"] = same
                record["cases"].append(case)
        del fbgemm, tables, stacked
    record["machine"].pop("torch_num_threads", None)  # set per case (config.threads)
    record["targets"] = targets(record)
    return record


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def targets(record: dict[str, Any]) -> dict[str, Any]:
    """jaxembed's median time <= FBGEMM's (ratio <= 1.0) in every int8 and int4 case (int2
    and fp8: the ratio is reported, with no threshold), and every output equal to FBGEMM's
    within float32 rounding of the float64 sums."""
    out: dict[str, Any] = {"at_target_shapes": not record["config"]["quick"]}
    for c in record["cases"]:
        mine = c["implementations"]["jaxembed"]
        ratio = mine["time_ratio_to_fbgemm"]
        threshold = 1.0 if c["precision"] in TARGET_PRECISIONS else None
        out[f"{c['precision']} batch={c['batch']} threads={c['threads']}: time vs fbgemm"] = {
            "value": ratio, "threshold": threshold,
            "met": None if threshold is None else ratio <= threshold,
            "paired": mine["paired_time_ratio_to_fbgemm"],
            "cpu": mine["cpu_time_ratio_to_fbgemm"] if c["threads"] == 1 else None,
            "where": "jaxembed (native) / fbgemm, median forward",
        }  # fmt: skip
    out["all_agree_with_reference"] = all(
        r["agrees_with_reference"] for c in record["cases"] for r in c["implementations"].values()
    ) and all(c["same_bytes"] for c in record["cases"])
    return out


def tables(record: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """The record as (title, headers, rows) tables: one row per case and implementation,
    then the targets."""
    cfg = record["config"]
    m = record["machine"]
    title = (f"quant fbgemm: {cfg['num_tables']} tables x {cfg['rows']} rows x {cfg['dim']}, "
             f"bags of {cfg['bag_length']} uniform ids, sum; {m.get('cpu') or m['processor']}, "
             f"{m['cpu_count']} cores; torch {m['torch']}, fbgemm_gpu {m['fbgemm_gpu']}, "
             f"jax {m['jax']}")  # fmt: skip
    headers = ["precision", "batch", "threads", "implementation", "median ms", "p90 ms",
               "min ms", "ns / row", "x fbgemm", "x fbgemm (paired)", "cpu ms", "x fbgemm (cpu)",
               "= fbgemm bitwise", "max |diff|", "load"]  # fmt: skip
    rows = []
    for c in record["cases"]:
        for impl in IMPLEMENTATIONS:
            r = c["implementations"][impl]
            head = [c["precision"], str(c["batch"]), str(c["threads"])] if impl == "jaxembed" \
                else ["", "", ""]  # fmt: skip
            rows.append([*head, impl, f"{r['time_median_in_ms']:.3f}", f"{r['time_p90_in_ms']:.3f}",
                         f"{r['time_min_in_ms']:.3f}", f"{r['ns_per_row']:.1f}",
                         _fmt(r.get("time_ratio_to_fbgemm")),
                         _fmt(r.get("paired_time_ratio_to_fbgemm")),
                         f"{r['cpu_time_median_in_ms']:.3f}",
                         _fmt(r.get("cpu_time_ratio_to_fbgemm")),
                         "-" if impl == "fbgemm" else str(r["bitwise_equal_to_fbgemm"]),
                         "-" if impl == "fbgemm" else f"{r['max_abs_diff_to_fbgemm']:.3g}",
                         "-" if impl != "jaxembed" else
                         "/".join(f"{x:.1f}" for x in c["load_average_1min"])])  # fmt: skip
    t = record["targets"]
    target_rows = [[k, _fmt(v["value"]), _fmt(v["paired"]), _fmt(v["cpu"]),
                    "-" if v["threshold"] is None else f"<= {v['threshold']}",
                    "-" if v["met"] is None else "yes" if v["met"] else "NO"]
                   for k, v in t.items() if isinstance(v, dict)]  # fmt: skip
    target_rows.append(["every output agrees with float64, FBGEMM holds jaxembed's bytes",
                        str(t["all_agree_with_reference"]), "", "", "", ""])  # fmt: skip
    quick = "" if t["at_target_shapes"] else " (quick shapes: indicative only)"
    return [(title, headers, rows),
            (f"quant fbgemm targets{quick}", ["target", "ratio of medians", "paired",
                                               "cpu (1 thread)", "threshold", "met"],
             target_rows)]  # fmt: skip


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m benchmarks.quant.fbgemm [--quick] [--json PATH] [--markdown PATH] ...`."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.quant.fbgemm",
        description="Quantized pooled lookups: jaxembed's native kernels and XLA path "
        "against FBGEMM's IntNBit TBE on the CPU, on the same quantized bytes.",
    )
    p.add_argument("--quick", action="store_true", help="tiny shapes, two rounds (for tests)")
    p.add_argument("--json", metavar="PATH", help="write the record as JSON")
    p.add_argument("--markdown", metavar="PATH", help="write the tables as Markdown")
    p.add_argument("--precisions", nargs="+", choices=("int8", "int4", "int2", "fp8"))
    p.add_argument("--fp8-exponent-bits", type=int, metavar="E", help="fp8's (default 4)")
    p.add_argument("--fp8-exponent-bias", type=int, metavar="B", help="fp8's (default 7)")
    p.add_argument("--batches", nargs="+", type=int, metavar="B", help="bags a table")
    p.add_argument("--threads", nargs="+", type=int, metavar="N", help="thread counts")
    p.add_argument("--rows", type=int, metavar="V", help="rows a table")
    p.add_argument("--repeats", type=int, metavar="N", help="interleaved timing rounds")
    p.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    config = QUICK if args.quick else FbgemmConfig()
    changes: dict[str, Any] = {}
    for flag, field in (("precisions", "precisions"), ("batches", "batches"),
                        ("threads", "threads")):  # fmt: skip
        if getattr(args, flag):
            changes[field] = tuple(dict.fromkeys(getattr(args, flag)))
    if args.rows:
        changes["rows"] = args.rows
    for flag in ("fp8_exponent_bits", "fp8_exponent_bias"):
        if getattr(args, flag) is not None:
            changes[flag] = getattr(args, flag)
    if args.repeats:
        changes["timing"] = dataclasses.replace(config.timing, repeats=args.repeats)
    config = dataclasses.replace(config, **changes)
    _one_device()
    start = time.perf_counter()
    say = (lambda m: None) if args.no_progress else (
        lambda m: print(f"[{time.perf_counter() - start:7.1f}s] {m}", file=sys.stderr))  # fmt: skip
    try:
        record = run_fbgemm(config, say)
    except RuntimeError as err:
        print(f"python -m benchmarks.quant.fbgemm: error: {err}", file=sys.stderr)
        return 3
    from benchmarks.common.report import markdown_tables, print_table_list, write_outputs

    table_list = tables(record)
    print_table_list("jaxembed bench quant-fbgemm", table_list)
    write_outputs(record, json_path=args.json, markdown_path=args.markdown,
                  markdown=lambda: markdown_tables(table_list))  # fmt: skip
    return 0


def _one_device() -> None:
    """One jax device (the benchmark's setting), unless jax already started with more."""
    flag = "--xla_force_host_platform_device_count"
    if "jax" not in sys.modules and flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}=1".strip()


if __name__ == "__main__":
    sys.exit(main())
