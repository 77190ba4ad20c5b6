"""What a compiled program says about itself: its collectives, its memory, its errors.

Every benchmark records these the same way (`error_record` for a stage that raised,
`memory_record` from `memory_analysis()`, `collective_record` per collective of the HLO, and
`run_bytes`: what a program holds over all devices while it runs).
"""

from __future__ import annotations

from typing import Any

from jaxembed import hlo

__all__ = ["collective_record", "error_record", "memory_record", "run_bytes"]

_ERROR_CHARS = 400  # an error message is cut to this many characters in the record


def error_record(stage: str, err: BaseException) -> dict[str, Any]:
    message = " ".join(str(err).split())
    if len(message) > _ERROR_CHARS:
        message = message[: _ERROR_CHARS - 3] + "..."
    return {"status": "error", "stage": stage, "error_type": type(err).__name__, "error": message}


def collective_record(c: hlo.Collective, mesh: Any) -> dict[str, Any]:
    shape = ",".join(f"[{','.join(map(str, dims))}]" for dims in c.result_shape)
    return {
        "kind": c.kind,
        "mesh_axes": list(hlo.mesh_axes(c, mesh)),
        "shape": f"{c.dtype}{shape}",
        "result_bytes": int(c.result_bytes),
        "wire_bytes": float(c.wire_bytes),  # one execution; a step runs it `trips` times
        "trips": c.trips,
    }


def memory_record(compiled: Any) -> dict[str, int]:
    analysis = compiled.memory_analysis()
    fields = {
        "temp_bytes": "temp_size_in_bytes",
        "argument_bytes": "argument_size_in_bytes",
        "output_bytes": "output_size_in_bytes",
        "alias_bytes": "alias_size_in_bytes",
        "code_bytes": "generated_code_size_in_bytes",
    }
    return {key: int(getattr(analysis, attr, 0) or 0) for key, attr in fields.items()}


def run_bytes(result: dict[str, Any], num_devices: int) -> int:
    """Host bytes a compiled step holds over all (simulated) devices while it runs."""
    per_device = (
        result["temp_bytes"] + result["argument_bytes"] + result["output_bytes"]
        - result["alias_bytes"]
    )  # fmt: skip
    return per_device * num_devices
