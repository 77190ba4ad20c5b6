"""Two processes x 4 CPU devices under jaxembed.launch: results, faults, and bad launches."""

import io
import re
import socket
import sys
import time
from pathlib import Path

import pytest

from jaxembed import launch

HERE = Path(__file__).parent / "multihost"


def run(script, *args, processes=2, devices=4, **kwargs):
    out = io.StringIO()
    start = time.monotonic()
    code = launch.launch(
        [str(HERE / script), *args], processes=processes, devices_per_process=devices,
        out=out, **kwargs,
    )  # fmt: skip
    return code, out.getvalue(), time.monotonic() - start


def test_embedding_matches_the_dense_reference_on_every_process():
    code, out, _ = run("embedding_layouts.py", timeout_seconds=300)
    assert code == 0, out[-3000:]
    oks = re.findall(r"^\[p(\d)\] OK (\S+) (\S+) process (\d)$", out, re.M)
    assert all(prefix == pid for prefix, _, _, pid in oks)
    layouts = {(name, exchange, pid) for pid, name, exchange, _ in oks}
    assert len(layouts) == len(oks) == 2 * 2 * 6 * 2  # processes x exchanges x layouts x meshes


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
