"""Draws the figures of `docs/plan.md` from jaxembed's plans: bytes by formula, no timing.

    python docs/make_figures.py                # writes docs/exchange_crossover.png
    python docs/make_figures.py --out /tmp/x.png

`exchange_crossover.png`: the bytes each device sends for the gradient exchange of one
training step, dense (`psum` of the gradient shard) against rows (`all_gather` of ids and
output gradients), as the batch grows at a fixed table, for three layouts of the table on a
(data=2, model=4) mesh with the ids' batch on `data`. The marker is where
`gradient_exchange="auto"` switches from rows to dense, found by asking `plan_embedding`.

Plans need no devices: the mesh is a `jax.sharding.AbstractMesh`.
"""

from __future__ import annotations

import argparse
import pathlib
from collections.abc import Sequence

from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from jaxembed.plan import plan_embedding

VOCAB, HIDDEN, SEQ = 65536, 128, 128
MESH = AbstractMesh((2, 4), ("data", "model"))
IDS_SPEC = P("data", None)
LAYOUTS = {  # name -> (table spec, line style)
    "rows on model (vocab parallel)": (P("model", None), {"color": "tab:blue", "lw": 4}),
    "hidden on model": (P(None, "model"), {"color": "tab:orange", "lw": 2}),
    "replicated table (data parallel)": (P(), {"color": "tab:green", "lw": 1.5, "ls": "--"}),
}
BATCHES = [2**i for i in range(1, 13)]  # sequences of SEQ tokens; divisible by data=2
DEFAULT_OUT = pathlib.Path(__file__).with_name("exchange_crossover.png")


def exchange_bytes(table_spec: P, batch: int) -> tuple[float, float, str]:
    """(dense bytes, rows bytes, the exchange `auto` picks) for a batch of `batch` sequences."""
    plan = plan_embedding(
        MESH, (batch, SEQ), (VOCAB, HIDDEN), x_spec=IDS_SPEC, weight_spec=table_spec
    )
    return plan.dense_exchange_bytes, plan.rows_exchange_bytes, plan.gradient_exchange


def crossover(table_spec: P, high: int = 2**16) -> int:
    """The smallest even batch for which `auto` picks the dense exchange (bisection)."""
    low = 2  # rows at low, dense at high
    if (
        exchange_bytes(table_spec, low)[2] != "rows"
        or exchange_bytes(table_spec, high)[2] != "dense"
    ):
        raise ValueError(f"no switch between batch {low} and {high} for {table_spec}")
    while high - low > 2:
        mid = (low + high) // 4 * 2
        if exchange_bytes(table_spec, mid)[2] == "dense":
            high = mid
        else:
            low = mid
    return high


def plot_exchange_crossover(path: pathlib.Path) -> None:
    """Left: dense vs rows for the vocab-parallel table. Right: what `auto` sends, per layout."""
    import matplotlib.pyplot as plt

    mib = 2**20
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6), dpi=90)
    switches = {name: crossover(spec) for name, (spec, _) in LAYOUTS.items()}
    batches = {  # the switch and the batch just before it, so that the knee is drawn sharp
        name: sorted({*BATCHES, switches[name] - 2, switches[name]}) for name in LAYOUTS
    }
    curves = {
        name: [exchange_bytes(spec, b) for b in batches[name]]
        for name, (spec, _) in LAYOUTS.items()
    }

    name = "rows on model (vocab parallel)"
    spec, _ = LAYOUTS[name]
    dense, rows, _ = zip(*curves[name], strict=True)
    dense_label = "dense: psum of the f32 gradient shard [V/4, H] over data"
    rows_label = "rows: all_gather of ids [B, S] and out_grad [B, S, H] over data"
    left.plot(batches[name], [d / mib for d in dense], "--", color="tab:red", label=dense_label)
    left.plot(batches[name], [r / mib for r in rows], "-", color="tab:blue", label=rows_label)
    auto = [min(d, r) / mib for d, r in zip(dense, rows, strict=True)]
    left.plot(
        batches[name], auto, "-", color="k", lw=5, alpha=0.15, label='gradient_exchange="auto"'
    )
    switch = switches[name]
    left.axvline(switch, color="gray", lw=1, ls=":")
    left.annotate(
        f"auto switches to dense\nat B = {switch} ({switch * SEQ} tokens)",
        (switch, exchange_bytes(spec, switch)[0] / mib),
        textcoords="offset points",
        xytext=(-150, 30),
        fontsize=8,
        arrowprops={"arrowstyle": "->", "color": "gray"},
    )
    left.set_title(f"{name}: table shard [V/4, H] on each device", fontsize=10)

    for name, (spec, style) in LAYOUTS.items():
        chosen = [min(d, r) / mib for d, r, _ in curves[name]]
        right.plot(batches[name], chosen, label=name, **style)
        switch = switches[name]
        right.plot([switch], [exchange_bytes(spec, switch)[0] / mib], "o", color=style["color"])
    right.set_title('what gradient_exchange="auto" sends; dots: switch to dense', fontsize=10)

    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(f"batch B (sequences of S = {SEQ} tokens)")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    left.set_ylabel("MiB sent per device (ring model)")
    fig.suptitle(
        f"Gradient exchange of one step: table V x H = {VOCAB} x {HIDDEN} float32, ids [B, S] "
        "on data, mesh data=2 x model=4 (from plan_embedding, no timing)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT, help="PNG to write")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    plot_exchange_crossover(args.out)
    for name, (spec, _) in LAYOUTS.items():
        print(f"{name}: auto switches to dense at B={crossover(spec)} ({SEQ}-token sequences)")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
