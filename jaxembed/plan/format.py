"""Every formatter of the plans: what `str(plan)`, `jaxembed plan` and `--tables` print.

* `format_plan`: an `EmbeddingPlan` as a readable table;
* `format_collection_plan`: a `CollectionPlan`, in the spirit of TorchRec's planner
  statistics: one row per table (placement, exchange, bytes, modelled time, memory, why),
  one per `embedding_bag` call, and one per device (what it holds, the buffers, the peak
  against the budget);
* `format_cross_entropy_plan`: a `CrossEntropyPlan`; `format_id_stats`: an `IdStats`;
* `format_bytes`: bytes for people (`jaxembed.plan.specs`, where the plans' own messages
  use it).

The formatters import the plans they print; no plan module imports them. The face
`jaxembed.plan` makes them the plans' `__str__`.
"""

from __future__ import annotations

from jaxembed.plan.collection import CollectionPlan
from jaxembed.plan.cross_entropy import CrossEntropyPlan
from jaxembed.plan.idstats import IdStats
from jaxembed.plan.specs import format_bytes
from jaxembed.plan.table_moves import format_mib
from jaxembed.plan.types import EmbeddingPlan

__all__ = [
    "format_bytes",
    "format_collection_plan",
    "format_cross_entropy_plan",
    "format_id_stats",
    "format_plan",
]


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
        *_table_move_lines(plan),
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
    r = plan.routed
    if plan.exchange == "routed" and r is not None:
        where = "the owners pool each bag's slots" if r.pooled_at_owner else (
            "each distinct id's row comes back and the source pools")  # fmt: skip
        lines.append(
            f"  routed over {r.axes}: {r.num_buckets} owners, capacity {r.capacity} a bucket "
            f"({r.capacity_factor:.2f}x the mean), {r.slots} slots a device; {where}"
        )
        for variant, wire, ms in r.pool_costs:
            mark = "*" if (variant == "owner") == r.pooled_at_owner else " "
            lines.append(f"  {mark}pooled at {variant:<7}{format_bytes(wire):>12}{ms:>13.3f} ms")
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
        + (f", gathered table {format_bytes(m.gathered_table)}" if m.gathered_table else "")
    )
    lines.append(f"  kernels: {plan.impl}")
    return "\n".join(lines)


def _table_move_lines(plan: EmbeddingPlan) -> list[str]:
    """The weight gather's lines: the move taken and why, and every move priced (none where
    the table's hidden axes split no batch: nothing was weighed)."""
    if not plan.move_reason:
        return []
    gathered = f" over {plan.gathered_axes}" if plan.gathered_axes else ""
    lines = [f"  table move: {plan.table_move}{gathered} ({plan.move_reason})"]
    for move, wire, peak in plan.move_alternatives:
        mark = "*" if move == plan.table_move else " "
        lines.append(
            f"   {mark} {move:<7}wire {format_bytes(wire):>12}  peak {format_bytes(peak):>12}"
        )
    return lines


_MAX_ROWS = 16  # of the per-device table


def format_collection_plan(plan: CollectionPlan) -> str:
    """The plan as a readable table (what `str(plan)` and `jaxembed plan --tables` print)."""
    mesh = " x ".join(f"{n}={s}" for n, s in plan.mesh_axes)
    over = ", ".join(plan.batch_axes) or "no axis"
    lines = [
        f"CollectionPlan  mesh: {mesh}  batch {plan.batch_size} over ({over})  "
        f"backend {plan.backend}",
        f"  modelled step {plan.step_ms:.3f} ms (slowest device); peak memory "
        f"{format_bytes(plan.peak_bytes)} of {format_bytes(plan.memory_per_device)} per device",
        f"  ids: {plan.ids}; {plan.evaluations} layouts priced; "
        f"EmbeddingBagCollection(..., placements=plan, exchange={plan.exchange!r})",
    ]
    if plan.serving:
        served = ", ".join(f"{t} {p}" for t, p in plan.precision) or "none"
        lines.append(f"  serving: the lookups alone, no optimizer state; quantized: {served}")
    lines += [
        "",
        f"  {'table':<16} {'rows x dim':>18}  {'placement':<11}{'rows by':<8}{'exchange':<9}"
        f"{'wire/step':>11}{'ms':>9}{'mem/device':>12}  why",
    ]
    for t in plan.tables:
        by = t.row_sharding if t.placement in ("rows", "table_rows") else "-"
        lines.append(
            f"  {t.name:<16} {f'{t.vocab_size} x {t.dim}':>18}  {t.placement:<11}"
            f"{by:<8}{t.exchange:<9}{format_bytes(t.wire_bytes):>11}"
            f"{t.modelled_ms:>9.3f}{format_bytes(t.memory_bytes):>12}  {t.reason}"
        )
    lines += ["", f"  {'call':<48} {'ids':>12} {'bags':>5}  {'exchange':<9}{'forward':>11}"
              f"{'step':>11}{'ms':>9}"]  # fmt: skip
    for c in plan.calls:
        label = f"{c.stack_name} {c.combiner}"
        lines.append(
            f"  {label:<48} {f'{list(c.x_shape)}':>12} {c.num_bags:>5}  {c.exchange:<9}"
            f"{format_bytes(c.forward_bytes):>11}{format_bytes(c.wire_bytes):>11}"
            f"{c.modelled_ms:>9.3f}" + (f"  ({c.note})" if c.note else "")
        )
    lines += ["", f"  {'device':<8}{'tables+state used':>18}{'allocated':>12}{'buffers':>12}"
              f"{'peak':>12}{'update ms':>11}"]  # fmt: skip
    rows: list[list] = []  # devices with the same figures share a row
    for d, (used, update) in enumerate(zip(plan.used_bytes, plan.update_ms, strict=True)):
        if rows and rows[-1][1:] == [used, round(update, 3)]:
            rows[-1][0][1] = d
        else:
            rows.append([[d, d], used, round(update, 3)])
    for (first, last), used, update in rows[:_MAX_ROWS]:
        name = f"{first}" if first == last else f"{first}-{last}"
        lines.append(
            f"  {name:<8}{format_bytes(used):>18}{format_bytes(plan.allocated_bytes):>12}"
            f"{format_bytes(plan.buffer_bytes):>12}{format_bytes(plan.peak_bytes):>12}"
            f"{update:>11.3f}"
        )
    if len(rows) > _MAX_ROWS:
        used = plan.used_bytes
        lines.append(f"  ... {len(rows) - _MAX_ROWS} more rows; used from "
                     f"{format_bytes(min(used))} to {format_bytes(max(used))}")  # fmt: skip
    return "\n".join(lines)


def format_cross_entropy_plan(plan: CrossEntropyPlan) -> str:
    """A readable table of a cross-entropy's plan (what `str(plan)` prints)."""
    mesh = " x ".join(f"{n}={s}" for n, s in plan.mesh_axes) or "one device"
    lines = [
        f"CrossEntropyPlan  mesh: {mesh}",
        f"  table   {list(plan.table_shape)}  vocab {plan.vocab_size}  layout "
        f"{plan.weight_spec}  rows per device {plan.rows_per_shard} in "
        f"{plan.num_chunks} chunk(s) of {plan.chunk_rows}",
        f"  hidden  {list(plan.hidden_shape)}  given {plan.given_hidden_spec}  runs as "
        f"{plan.hidden_spec}",
        f"  loss    {plan.out_spec}  logits block per device f32"
        f"[{plan.local_tokens}, {plan.chunk_rows}]",
    ]
    lines.append(f"  chunks  {plan.chunk_reason}" if plan.chunk_reason else "")
    lines.append(f"  move    {plan.table_move}: {plan.move_reason}" if plan.move_reason else "")
    for move, wire, peak in plan.alternatives:
        mark = "*" if move == plan.table_move else " "
        lines.append(f"   {mark} {move:<7}wire {format_mib(wire):>12}  peak {format_mib(peak):>12}")
    for phase, op, axes, operand, wire in plan.priced_collectives:
        lines.append(f"  {phase:<9}{op:<13}{','.join(axes):<16}{operand:<30}{format_mib(wire):>12}")
    lines.append(f"  total wire bytes per device and step {format_mib(plan.wire_bytes)}")
    return "\n".join(line for line in lines if line)


def format_id_stats(stats: IdStats) -> str:
    """A sample's id statistics, per feature and per table (what `str(stats)` prints)."""
    lines = [f"IdStats  {stats.num_batches} batches of {stats.batch_size:g} examples"]
    for name, n in stats.ids_per_bag.items():
        lines.append(f"  feature {name:<20} {n:8.2f} ids per bag")
    for name, n in stats.ids_per_batch.items():
        lines.append(f"  table   {name:<20} {n:10.0f} ids, {stats.unique_per_batch[name]:10.0f} "
                     f"distinct per batch (x{stats.duplication(name):.2f})")  # fmt: skip
    return "\n".join(lines)
