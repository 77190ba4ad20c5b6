"""`jaxembed bench --calibrate` (the cost model's CPU constants), the dispatcher (`python -m
benchmarks`, `jaxembed bench` from a checkout, its error without one), and the modules that the
framework runners import (numpy only: their environments have no jax)."""

import json
import os
import subprocess
import sys

import pytest

import benchmarks
from jaxembed import cli
from jaxembed.kernels import native
from jaxembed.plan import cost


@pytest.mark.slow  # ~20 s of measuring; the dispatch and the constants' file run by default
def test_calibrate(tmp_path, monkeypatch, capsys):
    path = tmp_path / "cost.json"
    monkeypatch.setenv("JAXEMBED_COST_FILE", str(path))
    try:
        assert benchmarks.main(["--calibrate", "--repeats", "3"]) == 0
        text = capsys.readouterr().out
        assert f"saved to {path}" in text and "link bandwidth" in text
        saved = json.loads(path.read_text())
        assert set(saved) == ({"cpu", "cpu-native"} if native.available() else {"cpu"})
        for entry in saved.values():
            for key in (
                "link_bytes_per_s",
                "memory_bytes_per_s",
                "latency_s",
                "sort_ids_per_s",
                "slot_s",
            ):
                assert entry[key] > 0, key
        assert cost.load_constants("cpu").source.startswith("jaxembed bench --calibrate")
        other = tmp_path / "other.json"
        monkeypatch.setenv("JAXEMBED_COST_FILE", str(other))
        assert benchmarks.main(["--calibrate", "--no-save", "--repeats", "3"]) == 0
        assert "not saved" in capsys.readouterr().out and not other.exists()
    finally:
        monkeypatch.undo()
        cost.load_constants.cache_clear()  # later plans use the defaults again


def test_a_calibration_from_before_a_constant_keeps_its_default(tmp_path, monkeypatch):
    """A file written before `slot_s` existed: its constants are read, `slot_s` is the
    default's, not zero (which would price the gather path's walk of every slot as free)."""
    path = tmp_path / "old.json"
    old = {"backend": "cpu-native", "link_bytes_per_s": 2e9, "memory_bytes_per_s": 4e9,
           "latency_s": 1e-4, "sort_ids_per_s": 1e7, "source": "an older calibration"}  # fmt: skip
    path.write_text(json.dumps({"cpu-native": old}))
    monkeypatch.setenv("JAXEMBED_COST_FILE", str(path))
    cost.load_constants.cache_clear()
    try:
        got = cost.load_constants("cpu", "native")
        assert (got.link_bytes_per_s, got.source) == (2e9, "an older calibration")
        assert got.slot_s == cost.BACKENDS["cpu-native"].slot_s > 0
    finally:
        monkeypatch.undo()
        cost.load_constants.cache_clear()


def test_bad_flags(capsys):
    assert benchmarks.main(["--no-save"]) == 2
    assert "--calibrate" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        benchmarks.main(["routed", "--layouts", "no-such-layout"])
    with pytest.raises(SystemExit):
        benchmarks.main(["sparse", "--optimizers", "adam"])


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_runner_modules_import_without_jax():
    code = ("import sys, jaxembed.workloads, benchmarks.common.reference, "
            "benchmarks.common.timing, benchmarks.recsys.files; assert 'jax' not in sys.modules")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=ROOT)


def test_python_m_benchmarks_dispatches():
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "bags", "-h"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0 and "jaxembed bench bags" in proc.stdout, proc.stderr


def test_bench_without_a_checkout_says_so(monkeypatch, capsys):
    real = os.path.isfile
    monkeypatch.setattr(cli.os.path, "isfile",
                        lambda p: False if p.endswith(os.path.join("benchmarks", "__init__.py")) else real(p))  # fmt: skip
    assert cli.main(["bench", "--quick"]) == 2
    assert (
        "benchmarks live in the repository, not in the installed package" in capsys.readouterr().err
    )
    # The calibration is a library tool (jaxembed.calibrate): it runs without a checkout.
    monkeypatch.setenv("JAXEMBED_COST_FILE", "")
    assert cli.main(["bench", "--calibrate", "--no-save", "--repeats", "1"]) == 0
    assert "not saved" in capsys.readouterr().out
