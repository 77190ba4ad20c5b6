"""What the tests of the variant-group benchmarks (`jaxembed bench sparse | bags | routed`)
share: one `--quick` run through a command, and the check of one implementation's result."""

import json


def plot_flag(out):
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return []
    return ["--plot", str(out / "plots")]


def quick_run(tmp_path_factory, name, entry):
    out = tmp_path_factory.mktemp(name)
    argv = [name, "--quick", "--no-progress", "--json", str(out / "r.json"),
            "--markdown", str(out / "r.md"), *plot_flag(out)]  # fmt: skip
    assert entry(argv) == 0
    return json.loads((out / "r.json").read_text()), out


def check_ok(result, where):
    assert result["status"] == "ok", (where, result)
    assert result["agrees_with_reference"], (where, result)
    assert result["untouched_rows_unchanged"], where
    assert result["max_abs_error_out"] <= 1e-5 and result["max_abs_error_table"] <= 1e-5, where
    assert result["time_median_in_ms"] > 0 and result["time_p90_in_ms"] > 0, where
    for key in ("wire_bytes", "temp_bytes", "argument_bytes", "compile_time_in_s"):
        assert isinstance(result[key], int | float) and result[key] >= 0, (where, key)
