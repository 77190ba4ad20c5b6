"""The cost model: wire bytes of a collective, and the modelled time of a plan's step.

One place for the numbers every plan uses:

* **Bytes** follow the ring model of DESIGN.md, with n the group size and N the bytes of the
  per-device result: all-reduce 2(n-1)/n·N, reduce-scatter (n-1)·N, all-gather and
  all-to-all (n-1)/n·N. The HLO reader (`jaxembed.hlo`) uses the same function, so a plan's
  bytes and a compiled program's bytes are comparable to the byte.
* **Time** is modelled per device as

      time ≈ wire_bytes / link_bandwidth + rows_touched · row_bytes / memory_bandwidth
             + ids_sorted / sort_rate + collectives · latency + slots_walked · slot_s

  with one set of constants per backend and kernels (`BACKENDS`: `cpu` for XLA's kernels,
  `cpu-native` for jaxembed's C++ ones, `gpu`, `tpu`). The work terms count the table rows a
  device gathers, scatters or updates, the ids it sorts (the routed exchange's buckets, a
  row-sparse update's dedup) and the slots its kernels walk (the gather path walks the whole
  batch's on every device, owned or not): on a CPU, where a "collective" between simulated
  devices is a memory copy, they are what tells a fast exchange from one that merely sends
  fewer bytes.
  `jaxembed bench --calibrate` measures the CPU constants on the machine it runs on and saves
  them; `load_constants` picks them up (set `JAXEMBED_COST_FILE` to choose the file, or to an
  empty string to ignore it).

Examples:
  >>> ring_wire_bytes("all-reduce", 4, 1024), ring_wire_bytes("all-to-all", 8, 8192)
  (1536.0, 7168.0)
  >>> cpu = BACKENDS["cpu"]
  >>> t = modelled_seconds(cpu, wire_bytes=2**20, rows=1000, row_bytes=512, collectives=2)
  >>> round(t * 1e6, 1) == round((2**20 / cpu.link_bytes_per_s + 1000 * 512 /
  ...     cpu.memory_bytes_per_s + 2 * cpu.latency_s) * 1e6, 1)
  True
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

__all__ = [
    "BACKENDS",
    "KNOWN_BACKENDS",
    "CostConstants",
    "calibration_path",
    "check_backend",
    "load_constants",
    "modelled_seconds",
    "ring_wire_bytes",
    "save_constants",
]


def ring_wire_bytes(kind: str, n: int, result_bytes: float) -> float:
    """Ring-model bytes that one device sends for a collective over a group of `n`.

    DESIGN.md's model, the one source of it for the plan and for the HLO reader: all-reduce
    of N bytes 2(n-1)/n·N; reduce-scatter to an N-byte result (n-1)·N; all-gather to an
    N-byte result and all-to-all (n-1)/n·N.

    Examples:
      >>> ring_wire_bytes("all-reduce", 4, 1024), ring_wire_bytes("reduce-scatter", 4, 256)
      (1536.0, 768.0)
      >>> ring_wire_bytes("all-gather", 2, 1024), ring_wire_bytes("all-gather", 1, 1024)
      (512.0, 0.0)
    """
    if n <= 1:
        return 0.0
    factor = {
        "all-reduce": 2 * (n - 1) / n,
        "reduce-scatter": n - 1,
        "all-gather": (n - 1) / n,
        "all-to-all": (n - 1) / n,
    }[kind]
    return float(factor * result_bytes)


@dataclasses.dataclass(frozen=True)
class CostConstants:
    """Per-backend constants of the time model (per device).

    Attributes:
      backend: `"cpu"`, `"gpu"` or `"tpu"`.
      link_bytes_per_s: bytes per second one device sends over a collective.
      memory_bytes_per_s: bytes per second of table rows gathered, scattered or updated
        (random row access, not streaming bandwidth).
      latency_s: fixed cost of one collective.
      sort_ids_per_s: ids per second a device sorts (or groups) by key.
      slot_s: seconds a kernel spends on each slot it walks, whether this shard holds its
        row or not (reading the id, its bag and factor, testing it): the gather path's
        kernels walk every slot of the batch on every device, the routed exchange's only
        the slots sent to the owner.
      source: where the numbers come from (a default, or a calibration file).
    """

    backend: str
    link_bytes_per_s: float
    memory_bytes_per_s: float
    latency_s: float
    sort_ids_per_s: float = 1e6
    slot_s: float = 0.0
    source: str = "default"


# Defaults: CPU from `jaxembed bench --calibrate` on the 2-core development machine with 8
# simulated devices (a collective there is a memcpy between threads; all devices measured at
# once, so the figures are per device under contention), XLA's kernels (`cpu`) and jaxembed's
# native ones (`cpu-native`: rows that a masked gather skips cost no row read, and a radix
# sort). A walked slot: 24 ns with the native kernels, 8 devices at once (a masked pool of
# 2^14-2^18 slots, bags of 20, rows of 128 floats); XLA's masked gather and segment sum cost
# more than a row read there, which its rows term already charges, so its slot term is the
# native one. GPU and TPU are order-of-magnitude figures for one H100/H200 over NVLink and a
# TPU v5 chip over ICI; their slot term is not measured (0: their bandwidth terms price it).
BACKENDS: dict[str, CostConstants] = {
    "cpu": CostConstants("cpu", 1.4e9, 0.7e9, 160e-6, 2.0e6, 24e-9),
    "cpu-native": CostConstants("cpu-native", 1.4e9, 3.0e9, 160e-6, 1.5e7, 24e-9),
    "gpu": CostConstants("gpu", 150e9, 1.5e12, 15e-6, 2e9),
    "tpu": CostConstants("tpu", 90e9, 8e11, 10e-6, 5e8),
}

KNOWN_BACKENDS = ("cpu", "gpu", "tpu")  # what a caller names; "cpu-native" is `impl="native"`


def check_backend(backend: str, *, source: str | None = None) -> str:
    """Returns `backend` when the cost model has constants for it.

    Args:
      backend: `"cpu"`, `"gpu"` or `"tpu"` (or `"cpu-native"`, the CPU with jaxembed's
        kernels, as `load_constants(backend, impl)` names it).
      source: where the value came from, for the message (e.g. `"the mesh's platform"`).

    Returns:
      `backend`.

    Raises:
      ValueError: any other backend (the message names it and the known ones).

    Examples:
      >>> check_backend("gpu")
      'gpu'
      >>> check_backend("npu")
      Traceback (most recent call last):
      ...
      ValueError: backend='npu' has no cost constants: the known backends are ...
    """
    if not isinstance(backend, str) or backend not in BACKENDS:
        where = f" ({source})" if source else ""
        raise ValueError(
            f"backend={backend!r}{where} has no cost constants: the known backends are "
            f"{KNOWN_BACKENDS}; pass backend= one of them, the platform whose constants to "
            "plan with"
        )
    return backend


def modelled_seconds(
    constants: CostConstants,
    *,
    wire_bytes: float,
    rows: float,
    row_bytes: float,
    collectives: int,
    sorted_ids: float = 0.0,
    slots: float = 0.0,
) -> float:
    """Modelled time of one device's share of a step.

    Args:
      constants: the backend's `CostConstants`.
      wire_bytes: bytes this device sends over collectives (ring model).
      rows: table rows this device gathers, scatters or updates.
      row_bytes: bytes of one row as the device touches it (local hidden × itemsize).
      collectives: how many collectives run.
      sorted_ids: ids this device sorts or groups by key.
      slots: slots its kernels walk, whether they read a row or not (`slot_s` each).

    Returns:
      Seconds.
    """
    return (
        wire_bytes / constants.link_bytes_per_s
        + rows * row_bytes / constants.memory_bytes_per_s
        + sorted_ids / constants.sort_ids_per_s
        + collectives * constants.latency_s
        + slots * constants.slot_s
    )


def calibration_path() -> Path | None:
    """Where `jaxembed bench --calibrate` saves the CPU constants (None: ignore calibrations).

    `$JAXEMBED_COST_FILE` when set (an empty value disables calibration files), else
    `~/.cache/jaxembed/cost_constants.json`.
    """
    env = os.environ.get("JAXEMBED_COST_FILE")
    if env is not None:
        return Path(env) if env else None
    return Path.home() / ".cache" / "jaxembed" / "cost_constants.json"


def save_constants(constants: CostConstants, path: Path | None = None) -> Path:
    """Writes calibrated constants as JSON (one entry per backend in the file)."""
    path = path or calibration_path() or Path("cost_constants.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(path.read_text()) if path.exists() else {}
    data[constants.backend] = dataclasses.asdict(constants)
    path.write_text(json.dumps(data, indent=2) + "\n")
    load_constants.cache_clear()
    return path


def _load(backend: str) -> CostConstants:
    default = BACKENDS[check_backend(backend)]
    path = calibration_path()
    if path is None or not path.exists():
        return default
    try:
        entry = json.loads(path.read_text()).get(backend)
    except (OSError, ValueError):
        return default
    if not entry:
        return default
    fields = {f.name for f in dataclasses.fields(CostConstants)}
    # A file from before a constant existed keeps that constant's default.
    return dataclasses.replace(default, **{k: v for k, v in entry.items() if k in fields})


class _Cached:
    """`load_constants(backend)`, cached per backend; `cache_clear()` after a calibration."""

    def __init__(self):
        self._cache: dict[str, CostConstants] = {}

    def __call__(self, backend: str = "cpu", impl: str = "xla") -> CostConstants:
        """The constants for `backend` and its kernels (`impl`: `"xla"` or `"native"`): a
        calibration file's when there is one, else the defaults. `"native-dedup"`: XLA's
        kernels with the native sort (an update over a split hidden axis).

        Raises:
          ValueError: a backend without constants (not `"cpu"`, `"gpu"` or `"tpu"`).
        """
        if impl == "native-dedup":
            xla, native = self(backend, "xla"), self(backend, "native")
            return dataclasses.replace(xla, sort_ids_per_s=native.sort_ids_per_s)
        key = f"{backend}-native" if impl == "native" and f"{backend}-native" in BACKENDS else (
            backend
        )  # fmt: skip
        if key not in self._cache:
            self._cache[key] = _load(key)
        return self._cache[key]

    def cache_clear(self) -> None:
        self._cache.clear()


load_constants = _Cached()
