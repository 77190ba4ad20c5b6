"""Flax's lm1b examples with Flax's `Embed` and with jaxembed's: collectives and memory.

Compiles (does not run) one training step of the lm1b-style LMs of `tests/lm_models.py` at
the examples' configuration (vocab 30000, emb 512, 8 heads, 6 layers, MLP 2048, sequences
of 128 tokens, 32 sequences per device) on 8 CPU devices, Auto mesh
data=2 x fsdp=1 x tensor=4, the shared table `('tensor', 'fsdp')`, for each way the
examples build their step:

    nnx            lm1b_nnx: nnx.Optimizer, jax.jit(in_shardings=state shardings, P('data'))
    linen-unboxed  lm1b: jax.jit(init, out_shardings=...), nn.meta.unbox, no rules at apply
    linen-boxed    lm1b with the LogicallyPartitioned boxes kept, logical rules at apply

and prints, per program, from the compiled HLO: the collective wire bytes per device (ring
model, `jaxembed.hlo`), jaxembed's over Flax's, the largest collective, the collectives
shaped like the table or its shard (and whether they move the table, or only reduce a
gradient shard over `data` as every data-parallel step does), and the temp memory
(`compiled.memory_analysis()`). Targets: ratio <= 1.0 and no table-moving collective.

    python benchmarks/flax_examples.py [--json PATH] [--config lm1b|small]
        [--per-device-batch N] [--length L] [--dtype float32|bfloat16] [--variants ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

if "jax" not in sys.modules:  # 8 CPU devices, before jax starts
    flag = "--xla_force_host_platform_device_count=8"
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import flax.linen as nn
import jax
import jax.numpy as jnp
import lm_models as lm
from flax import nnx

import jaxembed.flax
import jaxembed.nnx
from jaxembed import hlo

CONFIGS = {"lm1b": lm.LM1B, "small": lm.SMALL}
VARIANTS = ("nnx", "linen-unboxed", "linen-boxed")
EMBEDS = {
    "nnx": {"flax": nnx.Embed, "jaxembed": jaxembed.nnx.Embed},
    "linen": {"flax": nn.Embed, "jaxembed": jaxembed.flax.Embed},
}


def build(variant: str, embed: str, config: lm.LMConfig, mesh) -> lm.TrainSetup:
    """The variant's setup with an abstract state (nothing is initialized)."""
    if variant == "nnx":
        return lm.build_nnx(config, mesh, EMBEDS["nnx"][embed], abstract=True)
    boxed = variant == "linen-boxed"
    return lm.build_linen(config, mesh, EMBEDS["linen"][embed], boxed=boxed, abstract=True)


def measure(setup: lm.TrainSetup, batch: int, length: int) -> dict:
    """Compiles the step for ids `[batch, length]` and reads its collectives and memory."""
    start = time.perf_counter()
    compiled = setup.compile(batch, length)
    compile_s = time.perf_counter() - start
    text = compiled.as_text()
    found = hlo.collectives(text)
    largest = hlo.largest_collective(text)
    memory = compiled.memory_analysis()
    return {
        "wire_bytes": hlo.total_wire_bytes(text),
        "collectives": len(found),
        "largest_collective": None
        if largest is None
        else {
            "kind": largest.kind,
            "mesh_axes": list(hlo.mesh_axes(largest, setup.mesh)),
            "shape": [list(s) for s in largest.result_shape],
            "dtype": largest.dtype,
            "result_bytes": largest.result_bytes,
            "wire_bytes": largest.wire_bytes,
        },
        "table_shaped": [
            {**c, "mesh_axes": list(c["mesh_axes"]), "shape": list(c["shape"])}
            for c in lm.table_collectives(text, setup)
        ],
        "temp_bytes": None if memory is None else memory.temp_size_in_bytes,
        "table_shape": list(setup.table_shape),
        "compile_s": round(compile_s, 2),
    }


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.3f}"


def _largest(m: dict) -> str:
    c = m["largest_collective"]
    if c is None:
        return "none"
    if len(c["shape"]) > 2:  # a combined collective: many small arrays
        shapes = f"[{len(c['shape'])} arrays]"
    else:
        shapes = ",".join(str(s) for s in c["shape"])
    return f"{c['kind']}({','.join(c['mesh_axes'])}) {c['dtype']}{shapes} {_mib(c['wire_bytes'])}"


def _table_shaped(m: dict) -> str:
    if not m["table_shaped"]:
        return "none"
    return "; ".join(
        f"{c['kind']}({','.join(c['mesh_axes'])}) {c['shape']}"
        + (" MOVES THE TABLE" if c["moves_table"] else " grad reduction")
        for c in m["table_shaped"]
    )


def report(record: dict) -> str:
    """The table of results and the targets, as text."""
    cfg, run = record["config"], record["run"]
    lines = [
        f"lm1b-style LM: vocab {cfg['vocab']}, emb {cfg['emb']}, heads {cfg['heads']}, "
        f"layers {cfg['layers']}, mlp {cfg['mlp']}, {cfg['dtype']}; ids "
        f"[{run['batch']}, {run['length']}] ({run['per_device_batch']} sequences per device); "
        f"mesh {record['mesh']}; MiB per device",
        "",
        f"{'program':<16}{'embed':<10}{'wire':>9}{'ratio':>7}{'temp':>10}{'compile s':>10}  "
        "largest collective | table-shaped collectives",
    ]
    for name, v in record["variants"].items():
        for embed in ("flax", "jaxembed"):
            m = v[embed]
            ratio = f"{v['ratio']:.3f}" if embed == "jaxembed" else ""
            lines.append(
                f"{name:<16}{embed:<10}{_mib(m['wire_bytes']):>9}{ratio:>7}"
                f"{_mib(m['temp_bytes']):>10}{m['compile_s']:>10.1f}  "
                f"{_largest(m)} | {_table_shaped(m)}"
            )
    t = record["targets"]
    lines += [
        "",
        "targets: jaxembed/Flax wire ratio <= 1.0 for every program: "
        + ("met" if t["ratio_at_most_1"] else "MISSED"),
        "         no collective moves the table: "
        + ("met" if t["table_never_moves"] else "MISSED"),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="lm1b")
    parser.add_argument("--per-device-batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)

    config = CONFIGS[args.config].replace(dtype=jnp.dtype(args.dtype).type)
    if args.length > config.max_len:
        parser.error(f"--length {args.length} exceeds the config's max_len {config.max_len}")
    mesh = lm.make_mesh(data=2, fsdp=1, tensor=4)
    batch = args.per_device_batch * len(jax.devices())  # lm1b: per-device batch x devices
    variants = {}
    for name in args.variants:
        flax_m = measure(build(name, "flax", config, mesh), batch, args.length)
        ours = measure(build(name, "jaxembed", config, mesh), batch, args.length)
        variants[name] = {
            "flax": flax_m,
            "jaxembed": ours,
            "ratio": ours["wire_bytes"] / flax_m["wire_bytes"],
        }
    record = {
        "config": {
            "name": args.config, "vocab": config.vocab, "emb": config.emb,
            "heads": config.heads, "layers": config.layers, "mlp": config.mlp,
            "max_len": config.max_len, "dtype": args.dtype,
        },
        "run": {"batch": batch, "length": args.length, "per_device_batch": args.per_device_batch},
        "mesh": " x ".join(f"{n}={s}" for n, s in mesh.shape.items()),
        "machine": {
            "platform": jax.devices()[0].platform, "device_count": len(jax.devices()),
            "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "jax": jax.__version__,
        },
        "variants": variants,
        "targets": {
            "ratio_at_most_1": all(v["ratio"] <= 1.0 for v in variants.values()),
            "table_never_moves": not any(
                c["moves_table"] for v in variants.values() for c in v["jaxembed"]["table_shaped"]
            ),
        },
    }  # fmt: skip
    print(report(record))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
    return record


if __name__ == "__main__":
    main()
