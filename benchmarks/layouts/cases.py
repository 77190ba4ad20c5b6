"""Benchmark cases: the layouts `jaxembed bench` measures and their minimum communication.

A `Layout` is a mesh plus the `PartitionSpec`s of the table, the ids and the output. A `Case`
adds the shapes. `minimum_wire_bytes` is DESIGN.md's "Minimum communication per layout"
table, evaluated for a case: the bytes one device must send under the ring model when the
gradient exchange is the cheaper of `rows` and `dense`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
from jax.sharding import PartitionSpec as P

__all__ = ["LAYOUTS", "MAIN_LAYOUTS", "Case", "Layout", "minimum_wire_bytes", "spec_text"]


@dataclasses.dataclass(frozen=True)
class Layout:
    """A mesh and the layouts of table, ids and output.

    Attributes:
      name: short name, used on the command line (`--layouts`) and in case names.
      mesh_shape, mesh_axes: the mesh.
      table_spec, ids_spec, out_spec: `PartitionSpec`s (ids of rank 2, output of rank 3).
      kind: the row of DESIGN.md's minimum table: `rows`, `rows-seq`, `rows-over-batch`,
        `hidden` or `replicated`.
      description: one line for tables and plots.
    """

    name: str
    mesh_shape: tuple[int, ...]
    mesh_axes: tuple[str, ...]
    table_spec: P
    ids_spec: P
    out_spec: P
    kind: str
    description: str

    @property
    def mesh_text(self) -> str:
        """`data2xmodel4`: the mesh as it appears in case names."""
        return "x".join(f"{n}{s}" for n, s in zip(self.mesh_axes, self.mesh_shape, strict=True))

    @property
    def num_devices(self) -> int:
        return math.prod(self.mesh_shape)


_D, _M = ("data", "model")
LAYOUTS: dict[str, Layout] = {
    layout.name: layout
    for layout in (
        Layout("rows-on-model", (2, 4), (_D, _M), P(_M, None), P(_D, None), P(_D, None, None),
               "rows", "rows on model, ids on data"),
        Layout("rows-seq-split-out", (2, 4), (_D, _M), P(_M, None), P(_D, None),
               P(_D, _M, None), "rows-seq", "rows on model, output split over model on S"),
        Layout("rows-over-data-model", (2, 4), (_D, _M), P((_D, _M), None), P(_D, None),
               P(_D, None, None), "rows-over-batch", "rows over (data, model), ids on data"),
        Layout("hidden-on-model", (2, 4), (_D, _M), P(None, _M), P(_D, None),
               P(_D, None, _M), "hidden", "hidden on model, ids on data"),
        Layout("replicated-table", (2, 4), (_D, _M), P(None, None), P(_D, None),
               P(_D, None, None), "replicated", "replicated table, ids on data"),
        Layout("data-parallel-8", (8,), (_D,), P(None, None), P(_D, None), P(_D, None, None),
               "replicated", "pure data parallel on (8,)"),
        Layout("mesh-2x2x2-rows", (2, 2, 2), (_D, "seq", _M), P(_M, None), P(_D, "seq"),
               P(_D, "seq", None), "rows", "(2,2,2): rows on model, ids on (data, seq)"),
    )
}  # fmt: skip
"""Every layout `jaxembed bench` knows, by name."""

MAIN_LAYOUTS = (
    "rows-on-model",
    "rows-seq-split-out",
    "rows-over-data-model",
    "hidden-on-model",
    "replicated-table",
)
"""The five (2, 4) layouts of the targets."""


def sweep_layout(name: str, num_devices: int) -> Layout:
    """The 1-D layouts of the device sweep on `num_devices` devices.

    `data-parallel`: a replicated table and ids split over `data`; `fully-sharded`: the table's
    rows and the ids both split over `data`.
    """
    if name == "data-parallel":
        return Layout(name, (num_devices,), (_D,), P(None, None), P(_D, None),
                      P(_D, None, None), "replicated", "replicated table, ids on data")  # fmt: skip
    if name == "fully-sharded":
        return Layout(name, (num_devices,), (_D,), P(_D, None), P(_D, None), P(_D, None, None),
                      "rows-over-batch", "rows and ids on data")  # fmt: skip
    raise ValueError(f"unknown sweep layout {name!r}: use 'data-parallel' or 'fully-sharded'")


@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmark case: a layout with shapes.

    Attributes:
      layout: the `Layout`.
      vocab, hidden: the table's shape.
      ids_shape: global shape of the ids (rank 2, `[B, S]`).
      dtype: the table's element type name.
      tag: an extra label (e.g. `dense-regime`), or "".
    """

    layout: Layout
    vocab: int
    hidden: int
    ids_shape: tuple[int, int]
    dtype: str = "float32"
    tag: str = ""

    @property
    def name(self) -> str:
        """`vocab=65536,hidden=128,ids=16x128,mesh=data2xmodel4,layout=rows-on-model`."""
        ids = "x".join(map(str, self.ids_shape))
        name = (
            f"vocab={self.vocab},hidden={self.hidden},ids={ids},mesh={self.layout.mesh_text},"
            f"layout={self.layout.name}"
        )
        return f"{name},{self.tag}" if self.tag else name

    @property
    def table_shape(self) -> tuple[int, int]:
        return (self.vocab, self.hidden)

    @property
    def out_shape(self) -> tuple[int, int, int]:
        return (*self.ids_shape, self.hidden)


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def spec_text(spec: P) -> str:
    """`P('model', None)` -> `"model,None"`; `P(('data', 'model'))` -> `"data+model"`."""
    parts = ["+".join(_axes(e)) or "None" for e in spec]
    return ",".join(parts) or "replicated"


def minimum_wire_bytes(case: Case, exchange: str | None = None) -> dict[str, Any]:
    """DESIGN.md's minimum wire bytes per device for a case, with its parts.

    With nd the devices splitting the ids (the batch axes B), nm those splitting the table
    outside B, A the bytes of the whole batch's output and I of its ids. DESIGN.md's table
    is for the rows regime; here the backward takes the cheaper of the rows exchange and the
    dense one (`2(nd-1)/nd` times the gradient shard), which only matters in the dense regime.
    The ids' gather counts as ids bytes (int32), as in DESIGN.md.

    Args:
      case: the case.
      exchange: the exchange to take the minimum of (`"rows"` or `"dense"`: the one the plan
        chose, which its cost model may pick for speed over bytes); None: the cheaper.

    Returns:
      `{"forward": ..., "backward": ..., "total": ..., "exchange": "rows" | "dense" | "none",
      "formula": ..., "nd": ..., "nm": ...}`, bytes as floats.

    Examples:
      >>> m = minimum_wire_bytes(Case(LAYOUTS["rows-on-model"], 65536, 128, (16, 128)))
      >>> m["forward"], m["backward"], m["exchange"]  # 1.5 * A/2, then (A + I)/2
      (786432.0, 528384.0, 'rows')
    """
    layout = case.layout
    sizes = dict(zip(layout.mesh_axes, layout.mesh_shape, strict=True))
    batch = {a for e in layout.ids_spec for a in _axes(e)}
    rows = _axes(layout.table_spec[0]) if len(layout.table_spec) > 0 else ()
    hidden = _axes(layout.table_spec[1]) if len(layout.table_spec) > 1 else ()
    nd = math.prod(sizes[a] for a in batch)
    nm = math.prod(sizes[a] for a in (*rows, *hidden) if a not in batch)
    e = np.dtype(case.dtype).itemsize
    n_ids = math.prod(case.ids_shape)
    a_bytes, i_bytes = n_ids * case.hidden * e, n_ids * 4
    shard = case.vocab // math.prod(sizes[a] for a in rows) * case.hidden
    shard //= math.prod(sizes[a] for a in hidden)
    dense = 2 * (nd - 1) / nd * shard * e
    kind = layout.kind
    if kind == "rows":
        forward = 2 * (nm - 1) / nm * a_bytes / nd
        rows_x = (nd - 1) / nd * (a_bytes + i_bytes)
        formula = "2(nm-1)/nm*A/nd + (nd-1)/nd*(A+I)"
    elif kind == "rows-seq":
        forward = (nm - 1) * a_bytes / (nd * nm)
        gather_out_grad = (nm - 1) / nm * a_bytes / nd  # the transpose of the reduce-scatter
        rows_x = gather_out_grad + (nd - 1) / nd * (a_bytes + i_bytes)
        dense += gather_out_grad
        formula = "(nm-1)*A/(nd*nm) + (nm-1)/nm*A/nd + (nd-1)/nd*(A+I)"
    elif kind == "rows-over-batch":
        forward = (nd - 1) / nd * i_bytes + (nd - 1) * a_bytes / nd
        forward += 2 * (nm - 1) / nm * a_bytes / nd
        rows_x, dense = (nd - 1) / nd * a_bytes, math.inf  # no dense alternative
        formula = "(nd-1)/nd*I + (nd-1)*A/nd + 2(nm-1)/nm*A/nd + (nd-1)/nd*A"
    elif kind == "hidden":
        forward = 0.0
        rows_x = (nd - 1) / nd * (a_bytes / nm + i_bytes)
        formula = "(nd-1)/nd*(A/nm + I)"
    elif kind == "replicated":
        forward = 0.0
        rows_x = (nd - 1) / nd * (a_bytes + i_bytes)
        formula = "(nd-1)/nd*(A+I)"
    else:
        raise ValueError(f"unknown layout kind {kind!r}")
    if nd == 1:
        backward, exchange = 0.0, "none"
    elif exchange == "rows" or (exchange != "dense" and rows_x <= dense) or math.isinf(dense):
        backward, exchange = rows_x, "rows"
    else:
        backward, exchange = dense, "dense"
        formula += "  [dense exchange: backward 2(nd-1)/nd*shard]"
    return {
        "forward": float(forward),
        "backward": float(backward),
        "total": float(forward + backward),
        "exchange": exchange,
        "formula": formula,
        "nd": nd,
        "nm": nm,
    }
