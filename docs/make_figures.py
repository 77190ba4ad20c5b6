"""Draws the figures of `docs/plan.md` from jaxembed's plans: bytes by formula, no timing.

    python docs/make_figures.py                # writes docs/exchange_crossover.png and
                                               # docs/routed_skew.png
    python docs/make_figures.py --out /tmp/x.png --skew-out /tmp/y.png

`exchange_crossover.png`: the bytes each device sends for the gradient exchange of one
training step, dense (`psum` of the gradient shard) against rows (`all_gather` of ids and
output gradients), as the batch grows at a fixed table, for three layouts of the table on a
(data=2, model=4) mesh with the ids' batch on `data`. The marker is where `exchange="auto"`
(the cost model: bytes and work) switches from rows to dense, found by asking `plan_embedding`.

`routed_skew.png`: the bytes each device sends per training step on an (8,) mesh with ids and
rows both split over it (V = 1M, H = 128, ids 64 x 128), for the gather exchange and the routed
one with block and mod rows, as the ids' Zipf exponent grows. The routed exchange's bytes are
static (its capacity); a step where a bucket overflows runs the gather exchange instead, so its
expected bytes are (1 - p) · routed + p · (flag + fallback), with p the share of sampled batches
that overflow (200 batches of Zipf ids, bucketed as the kernel does).

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
    dense, rows, chosen_name = zip(*curves[name], strict=True)
    dense_label = "dense: psum of the f32 gradient shard [V/4, H] over data"
    rows_label = "rows: all_gather of ids [B, S] and out_grad [B, S, H] over data"
    left.plot(batches[name], [d / mib for d in dense], "--", color="tab:red", label=dense_label)
    left.plot(batches[name], [r / mib for r in rows], "-", color="tab:blue", label=rows_label)
    auto = [(d if c == "dense" else r) / mib for d, r, c in zip(dense, rows, chosen_name,
                                                              strict=True)]  # fmt: skip
    left.plot(batches[name], auto, "-", color="k", lw=5, alpha=0.15, label='exchange="auto"')
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
        chosen = [(d if c == "dense" else r) / mib for d, r, c in curves[name]]
        right.plot(batches[name], chosen, label=name, **style)
        switch = switches[name]
        right.plot([switch], [exchange_bytes(spec, switch)[0] / mib], "o", color=style["color"])
    right.set_title('what exchange="auto" sends; dots: switch to dense', fontsize=10)

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


SKEW_OUT = pathlib.Path(__file__).with_name("routed_skew.png")
EXPONENTS = (0.0, 0.5, 0.8, 1.0, 1.1, 1.2, 1.3, 1.5)


def overflow_share(s: float, row_sharding: str, capacity: int, *, samples: int = 200) -> float:
    """The share of sampled batches (64 x 128 Zipf ids over 1M rows, 8 devices) in which some
    device's bucket holds more than `capacity` distinct ids."""
    import numpy as np

    from jaxembed.workloads import zipf_ids

    rng = np.random.default_rng(0)
    rows, n, per = 1 << 20, 8, 64 * 128 // 8
    over = 0
    for _ in range(samples):
        ids = zipf_ids(rng, 64 * 128, rows, s).reshape(n, per)
        for device in ids:
            distinct = np.unique(device)
            owner = distinct % n if row_sharding == "mod" else distinct // (rows // n)
            if np.bincount(owner, minlength=n).max() > capacity:
                over += 1
                break
    return over / samples


def plot_routed_skew(path: pathlib.Path) -> list[tuple]:
    """Expected bytes per step against the Zipf exponent: gather vs routed (block, mod)."""
    import matplotlib.pyplot as plt

    mesh = AbstractMesh((8,), ("model",))
    kw = dict(x_spec=P("model"), weight_spec=P("model", None))
    shape, table = (64, 128), (1 << 20, 128)
    gather = plan_embedding(mesh, shape, table, exchange="rows", **kw)
    routed = plan_embedding(mesh, shape, table, exchange="routed", **kw)
    total = lambda p: p.forward_wire_bytes + p.backward_wire_bytes
    r = routed.routed
    flag = sum(c.wire_bytes for c in (*r.forward, *r.backward) if c.operand == "overflow")
    fallback = flag + sum(c.wire_bytes for c in (*r.fallback_forward, *r.fallback_backward))
    rows = []
    for s in EXPONENTS:
        p = {sh: overflow_share(s, sh, r.capacity) for sh in ("block", "mod")}
        expected = {sh: (1 - p[sh]) * total(routed) + p[sh] * fallback for sh in p}
        rows.append((s, total(gather), expected["block"], expected["mod"], p["block"], p["mod"]))
    mib = 2**20
    fig, ax = plt.subplots(figsize=(7.5, 4.4), dpi=90)
    xs = [row[0] for row in rows]
    ax.plot(xs, [row[1] / mib for row in rows], "--", color="tab:red", label="gather exchange")
    ax.plot(xs, [row[2] / mib for row in rows], "-o", color="tab:blue",
            label="routed, block rows")  # fmt: skip
    ax.plot(xs, [row[3] / mib for row in rows], "-s", color="tab:green", label="routed, mod rows")
    for row in rows:
        if row[4] > 0:
            ax.annotate(f"{row[4]:.0%}", (row[0], row[2] / mib), textcoords="offset points",
                        xytext=(4, 4), fontsize=7, color="tab:blue")  # fmt: skip
    ax.set_xlabel("Zipf exponent s of the ids (0: uniform)")
    ax.set_ylabel("MiB sent per device per step (expected)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="center left")
    ax.set_title(
        f"(8,) mesh, V = 1M x 128, ids 64 x 128, capacity {r.capacity}: routed falls back "
        "(labels: share of steps) when a bucket overflows", fontsize=8,
    )  # fmt: skip
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT, help="PNG to write")
    parser.add_argument("--skew-out", type=pathlib.Path, default=SKEW_OUT, help="PNG to write")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    for s, gather, block, mod, p_block, p_mod in plot_routed_skew(args.skew_out):
        print(f"s={s}: gather {gather / 2**20:.2f} MiB, routed block {block / 2**20:.2f} MiB "
              f"({p_block:.0%} fall back), mod {mod / 2**20:.2f} MiB ({p_mod:.0%})")  # fmt: skip
    print(f"wrote {args.skew_out}")
    plot_exchange_crossover(args.out)
    for name, (spec, _) in LAYOUTS.items():
        print(f"{name}: auto switches to dense at B={crossover(spec)} ({SEQ}-token sequences)")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
