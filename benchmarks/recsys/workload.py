"""The recommender benchmark's workloads, by name: (a) and DLRM, and their variations."""

from __future__ import annotations

from jaxembed import workloads as W

__all__ = ["make_workload"]


def make_workload(kind: str, *, batch_size: int | None = None, largest_rows: int | None = None,
                  quick: bool = False) -> W.Workload:  # fmt: skip
    """The benchmark's workloads.

    Args:
      kind: `"a"` (`workloads.workload_a`: 8 tables of 1e6..100 rows) or `"dlrm"`
        (`workloads.dlrm_workload`: 26 features over 20 tables, 4.2M rows).
      batch_size: default 4096 (64 with `quick`).
      largest_rows: workload (a) with its largest table (t0) resized (the sweep).
      quick: tiny tables (dim 16, rows / 1000 for (a), Criteo / 4096 for the DLRM tables).

    Examples:
      >>> w = make_workload("a", largest_rows=10**7)
      >>> w.tables[0].rows, w.batch_size, w.name
      (10000000, 4096, 'workload_a[t0=10000000]')
      >>> [t.rows for t in make_workload("a", quick=True).tables]
      [1000, 500, 100, 100, 50, 10, 10, 10]
    """
    b = batch_size or (64 if quick else 4096)
    if kind == "dlrm":
        if largest_rows is not None:
            raise ValueError("largest_rows resizes workload (a) only: drop it for 'dlrm'")
        return W.dlrm_workload(b, scale=1 / 4096, dim=16) if quick else W.dlrm_workload(b)
    if kind != "a":
        raise ValueError(f"workload must be 'a' or 'dlrm', got {kind!r}")
    w = W.workload_a(b)
    tables = w.tables
    if quick:
        tables = tuple(W.TableSpec(t.name, max(10, t.rows // 1000), 16) for t in tables)
    name = w.name
    if largest_rows is not None:
        tables = (W.TableSpec(tables[0].name, int(largest_rows), tables[0].dim), *tables[1:])
        name = f"{w.name}[t0={int(largest_rows)}]"
    return W.Workload(name, tables, w.features, b)
