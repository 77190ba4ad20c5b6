"""The `jaxembed` command: `plan` prints the same plan as the Python API; `demo` checks out."""

import subprocess
import sys

import jax
import pytest
from jax.sharding import PartitionSpec as P

from jaxembed import cli, demo
from jaxembed.plan import plan_embedding


def test_plan_prints_the_python_plan(capsys):
    argv = ["plan", "--mesh", "data=2,model=4", "--ids", "16x128", "--table", "65536x128",
            "--ids-spec", "data", "--table-spec", "model,None", "--out-spec", "data,model,None"]  # fmt: skip
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    mesh = jax.sharding.AbstractMesh((2, 4), ("data", "model"))
    plan = plan_embedding(
        mesh, (16, 128), (65536, 128), x_spec=P("data"), weight_spec=P("model", None),
        out_spec=P("data", "model", None),
    )  # fmt: skip
    assert printed.strip() == str(plan).strip()


def test_plan_with_rows_over_two_axes_padding_and_unreduced(capsys):
    argv = ["plan", "--mesh", "data=2,model=4", "--ids", "8x16", "--table", "50264x64",
            "--ids-spec", "data", "--table-spec", "data+model,None", "--vocab-size", "50257",
            "--padding-idx", "0", "--out-spec", "data,None,None", "--out-unreduced", "model",
            "--dtype", "bfloat16"]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "vocab 50257 (table padded to 50264)" in out
    assert "bfloat16[50264, 64]" in out
    assert "psum_scatter  data" in out and "psum          model" not in out


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--table-spec", "vocab,None"], "names mesh axis 'vocab', which is not one of"),
        (["--table", "50257x128", "--table-spec", "model,None"], "pad the table to 50260 rows"),
    ],
)
def test_plan_errors_exit_2_with_the_reason(capsys, argv, match):
    base = ["plan", "--mesh", "data=2,model=4", "--ids", "16x128", "--table", "65536x128"]
    assert cli.main(base + argv) == 2
    assert match in capsys.readouterr().err


def test_bad_mesh_flag_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        cli.main(["plan", "--mesh", "data:2", "--ids", "4", "--table", "8x8"])
    assert "name=size pairs" in capsys.readouterr().err


def test_demo_checks_every_layout(capsys):
    assert demo.run(vocab=4096, hidden=32, ids_shape=(8, 16)) == 0
    out = capsys.readouterr().out
    assert out.count(": ok;") == len(demo.LAYOUTS)
    assert "MISMATCH" not in out and "FAIL" not in out


def test_console_script_sets_its_own_devices():
    """`jaxembed plan` runs in a fresh process (the console script's entry point)."""
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from jaxembed.cli import main; sys.exit(main())",
         "plan", "--mesh", "model=8", "--ids", "64", "--table", "1024x16", "--table-spec",
         "model,None"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "psum          model" in proc.stdout


def test_plan_reports_the_bytes_that_cross_hosts(capsys):
    argv = ["plan", "--mesh", "data=2,model=4", "--ids", "16x128", "--table", "65536x128",
            "--ids-spec", "data", "--table-spec", "None,model", "--host-axes", "data"]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    plan = plan_embedding(
        jax.sharding.AbstractMesh((2, 4), ("data", "model")), (16, 128), (65536, 128),
        x_spec=P("data"), weight_spec=P(None, "model"),
    )  # fmt: skip
    # Hidden split on model: only the rows exchange over data leaves a host.
    assert plan.wire_bytes_over(["model"]) == 0
    assert plan.wire_bytes_over(["data"]) == plan.backward_wire_bytes > 0
    assert "across hosts (data spans hosts): 132.0 KiB per device" in out
    with pytest.raises(ValueError, match=r"\['seq'\] are not axes of the plan's mesh"):
        plan.wire_bytes_over(["seq"])


def test_bench_flags_reach_the_benchmark(monkeypatch):
    """`jaxembed bench --quick ...` hands every flag, the first included, to benchmarks.main."""
    benchmarks = cli._checkout_benchmarks()

    seen = []
    monkeypatch.setattr(benchmarks, "main", lambda argv: seen.append(argv) or 0)
    assert cli.main(["bench", "--quick", "--json", "out.json"]) == 0
    assert seen == [["--quick", "--json", "out.json"]]


def test_plan_of_a_bag_update(capsys):
    """`--combiner` plans a bag lookup, `--optimizer` a row-sparse update of it."""
    code = cli.main(["plan", "--mesh", "data=2,model=4", "--ids", "4096x20", "--table",
                 "1000000x64", "--ids-spec", "data", "--table-spec", "model,None",
                 "--combiner", "mean", "--optimizer", "rowwise_adagrad", "--impl", "xla"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "bag, mean" in out and "float32[2048, 64]" in out  # the pooled [B/2, H] is reduced
    assert "row-sparse update" in out and "optimizer state 976.6 KiB" in out
    assert "kernels: xla" in out
    assert cli.main(["plan", "--mesh", "data=2,model=4", "--ids", "8x8", "--table", "64x8",
                 "--optimizer", "nadam"]) == 2  # fmt: skip
    assert "is not a jaxembed.optim optimizer" in capsys.readouterr().err


def test_plan_of_a_routed_lookup(capsys):
    assert cli.main(["plan", "--mesh", "model=8", "--ids", "64x128", "--table", "1048576x128",
                 "--ids-spec", "model", "--table-spec", "model,None", "--exchange", "routed",
                 "--row-sharding", "mod"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "all_to_all" in out and "rows by mod" in out and "*routed" in out
