"""Two processes x 4 CPU devices under jaxembed.launch: results, faults, and bad launches."""

import io
import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jaxembed import launch
from jaxembed.kernels import native

HERE = Path(__file__).parent / "multihost"


def run(script, *args, processes=2, devices=4, **kwargs):
    out = io.StringIO()
    start = time.monotonic()
    code = launch.launch(
        [str(HERE / script), *args], processes=processes, devices_per_process=devices,
        out=out, **kwargs,
    )  # fmt: skip
    return code, out.getvalue(), time.monotonic() - start


# The default run starts two processes once, here (the cheapest run that checks numbers on
# every process); the heavier multi-process runs below are marked slow (`pytest -m slow`).
def test_embedding_matches_the_dense_reference_on_every_process():
    code, out, _ = run("embedding_layouts.py", timeout_seconds=300)
    assert code == 0, out[-3000:]
    oks = re.findall(r"^\[p(\d)\] OK (\S+) (\S+) process (\d)$", out, re.M)
    assert all(prefix == pid for prefix, _, _, pid in oks)
    layouts = {(name, exchange, pid) for pid, name, exchange, _ in oks}
    assert len(layouts) == len(oks) == 2 * 2 * 6 * 2  # processes x exchanges x layouts x meshes


@pytest.mark.slow  # ~70 s: the launch and the per-process checks are the test above's
def test_bags_and_row_sparse_updates_match_the_reference_on_every_process():
    code, out, _ = run("recsys_layouts.py", timeout_seconds=400)
    assert code == 0, out[-3000:]
    oks = re.findall(r"^\[p(\d)\] OK (\S+) (\S+) (\S+) process (\d)$", out, re.M)
    assert all(prefix == pid for prefix, *_, pid in oks)
    impls = {impl for *_, impl, _ in oks}
    assert impls == ({"xla", "native"} if native.available() else {"xla"})
    # layouts x exchanges (rows: 4, routed: 2) x impls x processes
    assert len(set(oks)) == len(oks) == 6 * len(impls) * 2
    # The collections (table-wise, mod rows routed and pooled at the source or the owner,
    # or with a plan's capacity factor, block rows gathered): each process checked its
    # shards, for each kernel impl.
    found = set(re.findall(r"^\[p(\d)\] COLLECTION OK (\S+) (\S+) process (\d)$", out, re.M))
    names = ("tablewise", "mod-routed", "mod-routed-owner-pooled", "mod-routed-sized",
             "block-gathered")  # fmt: skip
    want = {(p, name, impl, p) for p in "01" for name in names for impl in impls}
    assert found == want, out[-3000:]


# ~15 s of waiting for the runtime's heartbeat timeout; a dead peer named and the others
# stopped: by default in tests/test_launch_peer.py (seconds)
@pytest.mark.slow
def test_a_killed_process_stops_the_others_within_60_seconds():
    code, out, elapsed = run("killed_peer.py", grace_seconds=120, timeout_seconds=180)
    assert "[launch] process 1 was killed by SIGKILL" in out
    assert re.search(
        r"\[launch\] process 0 (exited with code [1-9]|was killed by SIG(ABRT|SEGV))", out
    ), out[-3000:]
    killed_at = float(re.search(r"killing myself at step \d+ at ([\d.]+)", out).group(1))
    assert elapsed < 120, "the launcher had to kill process 0: it hung"
    # The runtime names the lost process.
    assert re.search(r"Task 1 heartbeat timeout|unhealthy \(stopped sending heartbeats\)", out), (
        out[-3000:]
    )
    assert code != 0
    assert time.time() - killed_at < 60 + 5 or elapsed < 60


def test_a_coordinator_port_in_use_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(
            launch.LaunchError, match=rf"port {port} on 127.0.0.1 is already in use"
        ):
            launch.launch(["-c", "pass"], processes=2, devices_per_process=4, port=port)


@pytest.mark.parametrize(("processes", "devices"), [(0, 4), (2, 0)])
def test_bad_counts_are_rejected_before_starting(processes, devices):
    with pytest.raises(launch.LaunchError, match=r"need at least 1 process and 1 device"):
        launch.launch(["-c", "pass"], processes=processes, devices_per_process=devices)


@pytest.mark.parametrize(
    ("what", "message"),
    [
        ("processes", r"was started as one of 3 processes, but the runtime .* has 2"),
        ("devices", r"sees 4 local and 6 global devices, expected 4 and 8"),
    ],
)
def test_mismatched_counts_fail_fast_with_a_message(what, message):
    code, out, elapsed = run(
        "miscount.py", what, timeout_seconds=120, grace_seconds=30,
        env={launch.ENV_INIT_TIMEOUT: "20"},
    )  # fmt: skip
    assert code == 1
    assert re.search(message, out), out[-3000:]
    assert elapsed < 60


def test_the_command_line_returns_the_worst_exit_code(capsys):
    code = launch.main(["--processes", "2", "--devices-per-process", "1", "--", "-c",
                        "import os, sys; sys.exit(int(os.environ['JAXEMBED_PROCESS_ID']) * 3)"])  # fmt: skip
    assert code == 3
    assert "[launch] process 1 exited with code 3" in capsys.readouterr().out


def test_a_missing_command_is_a_usage_error(capsys):
    assert launch.main(["--processes", "2"]) == 2
    assert "no command to run" in capsys.readouterr().err


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


@pytest.mark.parametrize(
    ("env", "detected"),
    [
        ({}, False),
        ({"SLURM_NTASKS": "1"}, False),  # a single-task job is one process
        ({"SLURM_NTASKS": "4"}, True),
        ({"OMPI_COMM_WORLD_SIZE": "2"}, True),
        ({"JOB_COMPLETION_INDEX": "0"}, True),
        ({"TPU_WORKER_HOSTNAMES": "t0,t1"}, True),
        ({"TPU_WORKER_HOSTNAMES": "t0"}, False),
        ({"JAXEMBED_DISTRIBUTED": "1"}, True),
    ],
)
def test_cluster_detection(monkeypatch, env, detected):
    for name in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "JOB_COMPLETION_INDEX",
                 "TPU_WORKER_HOSTNAMES", "JAXEMBED_DISTRIBUTED", "JAX_COORDINATOR_ADDRESS"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert launch._cluster_detected() is detected


# --- the training example across processes ---------------------------------------------------

TRAIN_LM = Path(__file__).parents[1] / "examples" / "train_lm.py"
TRAIN_FLAGS = ["--steps", "12", "--save-every", "4", "--no-progress", "--batch", "16",
               "--seq", "32", "--vocab", "127"]  # fmt: skip


def train(tmp_path, name, *flags):
    """Runs examples/train_lm.py in a fresh process; returns (exit code, output, metrics)."""
    metrics = tmp_path / f"{name}.json"
    proc = subprocess.run(
        [sys.executable, str(TRAIN_LM), *TRAIN_FLAGS, "--metrics-out", str(metrics), *flags],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    return proc.returncode, out, json.loads(metrics.read_text()) if metrics.exists() else None


@pytest.mark.slow  # ~75 s: four training runs, three of them over two processes
def test_training_across_processes_survives_a_killed_process(tmp_path):
    # One process x 8 devices and 2 processes x 4 devices train the same numbers.
    code, out, single = train(tmp_path, "single")
    assert code == 0, out[-3000:]
    code, out, multi = train(tmp_path, "multi", "--processes", "2", "--ckpt-dir", "ckpt-multi")
    assert code == 0, out[-3000:]
    assert multi["processes"] == 2 and single["processes"] == 1
    np.testing.assert_allclose(
        [multi["losses"][k] for k in single["losses"]], list(single["losses"].values()), rtol=1e-5
    )

    # Process 1 dies before step 10: process 0 stops on its own, naming the lost process.
    code, out, _ = train(
        tmp_path, "crashed", "--processes", "2", "--ckpt-dir", "ckpt", "--crash-at-step", "10"
    )
    assert code != 0
    assert "[launch] process 1 was killed by SIGKILL" in out
    assert re.search(r"\[launch\] process 0 (exited with code [1-9]|was killed by SIGABRT)", out)
    assert "killing the processes still running" not in out, "process 0 hung past the grace"
    assert re.search(r"Task 1 heartbeat timeout|unhealthy \(stopped sending heartbeats\)", out)

    # The last completed checkpoint is intact: resuming from it retraces the uninterrupted run.
    steps = sorted(int(p.name) for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit())
    assert steps and steps[-1] < 10, steps  # whatever committed before the crash
    code, out, resumed = train(
        tmp_path, "resumed", "--processes", "2", "--ckpt-dir", "ckpt", "--resume"
    )
    assert code == 0, out[-3000:]
    assert resumed["first_step"] == steps[-1] + 1
    for step, loss in resumed["losses"].items():
        np.testing.assert_allclose(loss, multi["losses"][step], rtol=1e-6, err_msg=step)
