"""`str(plan)`: an `EmbeddingPlan` as a readable table (what `jaxembed plan` prints)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxembed.plan.lookup import EmbeddingPlan

__all__ = ["format_bytes", "format_plan"]


def format_bytes(n: float) -> str:
    """Bytes for people: `512 B`, `4.0 KiB`, `1.3 MiB`, `2.0 GiB`.

    >>> format_bytes(1536), format_bytes(3 * 2**20)
    ('1.5 KiB', '3.0 MiB')
    """
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def format_plan(plan: EmbeddingPlan) -> str:
    """A readable table of the plan (what `str(plan)` and `jaxembed plan` print)."""
    mesh = " x ".join(f"{n}={s}" for n, s in plan.mesh_axes)
    vocab = f"{plan.vocab_size}" + (
        f" (table padded to {plan.weight_shape[0]})"
        if plan.vocab_size < plan.weight_shape[0]
        else ""
    )
    kind = "EmbeddingPlan" if plan.bag is None else f"EmbeddingPlan (bag, {plan.bag.combiner})"
    lines = [
        f"{kind}  mesh: {mesh}",
        f"  table   {plan.dtype}{list(plan.weight_shape)}  vocab {vocab}  layout {plan.weight_spec}"
        f"  shard {list(plan.table_shard_shape)}"
        + (f"  rows by {plan.row_sharding}" if plan.row_sharding != "block" else ""),
        f"  ids     {plan.ids_dtype}{list(plan.x_shape)}  given {plan.x_spec}"
        f"  runs as {plan.ids_spec}",
    ]
    if plan.bag is not None:
        b = plan.bag
        shape = "[*batch, L]: a bag per row" if b.form == "dense" else f"{b.num_bags} bags per row"
        lines.append(
            f"  bags    {shape}{', weighted' if b.weighted else ''}"
            + (f", each device pools its bags over {plan.bag_split_axes}" if plan.bag_split_axes
               else "")
        )  # fmt: skip
    lines += [
        f"  out     {plan.out_spec}"
        + (f"  (body emits {plan.body_out_spec})" if plan.needs_out_reshard else ""),
        f"  rows split over {plan.row_axes or '-'}, hidden over {plan.hidden_axes or '-'}, "
        f"batch over {plan.batch_axes or '-'}"
        + (f", padding_idx {plan.padding_idx}" if plan.padding_idx is not None else ""),
        "",
        f"  {'phase':<9}{'collective':<14}{'axes':<18}{'operand':<12}{'per-device result':<26}"
        f"{'wire bytes':>12}",
    ]
    for c in (*plan.forward, *plan.backward):
        res = f"{c.dtype}{list(c.shape)}"
        lines.append(
            f"  {c.phase:<9}{c.op:<14}{','.join(c.axes) or '-':<18}{c.operand:<12}{res:<26}"
            f"{format_bytes(c.wire_bytes):>12}"
        )
    if not plan.forward and not plan.backward:
        lines.append("  (no collectives)")
    m = plan.memory
    lines += [
        "",
        f"  wire bytes per device: forward {format_bytes(plan.forward_wire_bytes)}, "
        f"backward {format_bytes(plan.backward_wire_bytes)}",
        f"  exchange: {plan.exchange} ({plan.exchange_reason})",
    ]
    if len(plan.candidates) > 1:
        lines.append(
            f"  {'candidate':<11}{'wire bytes':>12}{'rows gathered':>15}{'rows scattered':>16}"
            f"{'modelled ms':>13}"
        )
        for c in plan.candidates:
            mark = "*" if c.name == plan.exchange else " "
            lines.append(
                f"  {mark}{c.name:<10}{format_bytes(c.wire_bytes):>12}{c.rows_gathered:>15}"
                f"{c.rows_scattered:>16}{c.modelled_ms:>13.3f}"
            )
    if plan.for_update:
        lines.append(
            f"  row-sparse update: the backward's collectives; each device updates at most "
            f"{m.touched_rows} rows in place (buffers {format_bytes(m.update_buffers)}"
            + (f", optimizer state {format_bytes(m.state_bytes)}" if m.state_bytes else "")
            + "), no table-sized buffer"
        )
    lines.append(
        f"  memory per device: table shard {format_bytes(m.table_shard)}, "
        f"ids {format_bytes(m.ids)}, out {format_bytes(m.out)}, "
        + (f"weight_grad f32 {format_bytes(m.weight_grad_f32)}, " if not plan.for_update else "")
        + f"exchange buffers {format_bytes(m.exchange_buffers)}"
    )
    lines.append(f"  kernels: {plan.impl}")
    return "\n".join(lines)
