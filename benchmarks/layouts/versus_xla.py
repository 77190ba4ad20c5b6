"""jaxembed against XLA's own partitioning of `jnp.take(mode='clip')` (the first comparison).

Both run the same step under `jax.jit` with the same in/out shardings on a (data=2, model=4)
mesh: the lookup, its backward for a given cotangent, and an SGD update. Table 65536 x 128
float32, ids 16 x 128, five layouts, plus the dense-regime case (ids 256 x 128 on the first
layout), reported apart. Per layout: wire bytes per device and the largest collective (from the
compiled HLO), temp memory (`memory_analysis()`), the time ratio of interleaved medians, and
DESIGN.md's analytical minimum.

    python -m benchmarks.layouts.versus_xla [--json PATH] [--repeats N] [--quick]

It uses `benchmarks.layouts.bench`'s machinery (`jaxembed bench --impls jaxembed xla` measures
the same).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

if "jax" not in sys.modules:  # 8 CPU devices, before jax starts
    flag = "--xla_force_host_platform_device_count=8"
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()

from benchmarks.layouts import bench
from benchmarks.layouts.cases import MAIN_LAYOUTS


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:8.3f}"


def _largest(result: dict) -> str:
    c = result.get("largest_collective")
    if not c:
        return "none"
    return f"{c['kind']}({','.join(c['mesh_axes'])}) {c['shape']}"


def report(record: dict) -> str:
    """The per-layout table and the targets, as text."""
    lines = [
        "jaxembed vs jax.jit(jnp.take(mode='clip')), same in/out shardings; bytes per device, MiB",
        f"{record['machine']['device_count']} {record['machine']['platform']} devices on "
        f"{record['machine']['cpu_count']} cores (simulated devices share the cores)",
        "",
        f"{'layout':<28}{'minimum':>9}{'jaxembed':>10}{'x min':>7}{'xla':>9}  "
        f"{'temp jx':>8}{'temp xla':>9}{'time jx/xla':>12}  largest collective: jaxembed | xla",
    ]
    for case in record["cases"]:
        jx, xla = case["implementations"]["jaxembed"], case["implementations"]["xla"]
        s = case["summary"]
        ids = "x".join(map(str, case["ids_shape"]))
        name = case["layout"] + (f" ids {ids}" if case["tag"] else "")
        ratio = s.get("jaxembed_time_ratio_to_xla")
        lines.append(
            f"{name:<28}{_mib(case['minimum_wire_bytes']['total']):>9}{_mib(jx['wire_bytes']):>10}"
            f"{s['jaxembed_wire_ratio_to_minimum']:>7.3f}{_mib(xla.get('wire_bytes')):>9}  "
            f"{_mib(jx['temp_bytes']):>8}{_mib(xla.get('temp_bytes')):>9}"
            f"{'-' if ratio is None else f'{ratio:.3f}':>12}  {_largest(jx)} | {_largest(xla)}"
        )
    t = record["targets"]
    lines += [
        "(the last row is the dense-regime case, reported apart)"
        if record["cases"][-1]["tag"]
        else "",
        "",
        f"targets (V={t['vocab']}{'' if t['at_target_shapes'] else ', NOT the target shapes'}):",
        f"  wire bytes within 1.1x of the minimum on the five: "
        f"{'met' if t['wire_within_1.1x_of_minimum']['met'] else 'MISSED'}",
        "  wire bytes at most XLA's everywhere: "
        f"{'met' if t['wire_at_most_xla']['met'] else 'MISSED'}",
        f"  time ratio geomean over the five <= 0.6: {t['time_ratio_to_xla_geomean']['geomean']} "
        f"({'met' if t['time_ratio_to_xla_geomean']['met'] else 'MISSED'})",
    ]
    if "dense_regime_time_ratio_to_xla" in t:
        d = t["dense_regime_time_ratio_to_xla"]
        lines.append(
            f"  dense regime at parity (<= 1.05): {d['value']} ({'met' if d['met'] else 'MISSED'})"
        )
    lines.append(f"  every step matches the dense reference: {t['all_agree_with_reference']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Runs the comparison and prints it; `--json PATH` also writes the record."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="write the record as JSON")
    parser.add_argument("--repeats", type=int, default=40, help="interleaved timing rounds")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (a smoke test)")
    args = parser.parse_args(argv)
    base = bench.QUICK if args.quick else bench.BenchConfig()
    config = dataclasses.replace(
        base,
        layouts=MAIN_LAYOUTS,
        implementations=("jaxembed", "xla"),
        sweeps=(),
        timing=dataclasses.replace(base.timing, repeats=args.repeats if not args.quick else 2),
    )
    record = bench.run_bench(config)
    print(report(record))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1, allow_nan=False)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
