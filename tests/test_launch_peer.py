"""A peer's death under jaxembed.launch is reported as the cause of what follows.

When one process of a multi-process run dies, the survivors' last words are the runtime's
(gloo's "collective mismatch", a heartbeat timeout, an abort): the launcher names the dead
process and its exit code or signal, says that the others' errors follow from it, stops
them, and returns the dead process's code.
"""

import io
import re
import signal
import textwrap
import time

from jaxembed import launch

# Process 1 joins the runtime, runs one collective with process 0, then exits with code 3;
# process 0 goes on to the next collective, which can never complete.
PEER_DIES = """
import os

from jaxembed.launch import initialize

initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

mesh = jax.make_mesh((jax.device_count(),), ("x",))
x = jax.make_array_from_process_local_data(
    NamedSharding(mesh, P("x")), np.ones((jax.local_device_count(),), np.float32)
)
total = jax.jit(jnp.sum)
print("sum", float(total(x)), flush=True)
if jax.process_index() == 1:
    print("exiting with 3", flush=True)
    os._exit(3)
for _ in range(3):
    print("sum", float(total(x)), flush=True)
"""


def run(tmp_path, script, **kwargs):
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(script))
    out = io.StringIO()
    start = time.monotonic()
    code = launch.launch([str(path)], out=out, **kwargs)
    return code, out.getvalue(), time.monotonic() - start


def launcher_lines(out):
    return [line for line in out.splitlines() if line.startswith("[launch] ")]


def test_a_peer_that_dies_after_initialize_is_named_as_the_cause(tmp_path):
    code, out, elapsed = run(
        tmp_path, PEER_DIES, processes=2, devices_per_process=2, grace_seconds=20,
        timeout_seconds=60, heartbeat_timeout_seconds=3,
    )  # fmt: skip
    assert code == 3, out[-3000:]  # the dead process's code, not the survivor's abort
    assert out.count("[p0] sum 4.0") >= 1 and "[p1] exiting with 3" in out, out[-3000:]
    lines = launcher_lines(out)
    assert re.match(
        r"\[launch\] process 1 exited with code 3 while process 0 still runs: process 1 "
        r"failed first, so the errors the others print from now on \(gloo's 'collective "
        r"mismatch', .*\) are a consequence of its exit",
        lines[0],
    ), lines
    # The survivor stops (the runtime's heartbeat, or the launcher after the grace) ...
    survivor = [line for line in lines if line.startswith("[launch] process 0 ")]
    assert re.fullmatch(
        r"\[launch\] process 0 (exited with code [1-9]|was killed by SIG\w+) \(after process 1 "
        r"failed\)",
        survivor[0],
    ), lines
    # ... and the last line names the cause again, after the survivor's errors.
    assert out.splitlines()[-1] == (
        "[launch] process 1 failed first (exited with code 3); the failures of process 0 "
        "followed from its exit: see the [p1] lines above for the cause"
    )
    assert elapsed < 30


def test_the_launcher_kills_a_hung_survivor_and_returns_the_dead_process_code(tmp_path):
    script = """
    import os, time
    if os.environ["JAXEMBED_PROCESS_ID"] == "1":
        raise SystemExit(3)
    time.sleep(60)  # a survivor stuck in a collective that cannot complete
    """
    code, out, elapsed = run(
        tmp_path, script, processes=2, devices_per_process=1, grace_seconds=1,
        timeout_seconds=30,
    )  # fmt: skip
    assert code == 3, out  # not 137, the survivor's SIGKILL
    lines = launcher_lines(out)
    assert lines[0].startswith("[launch] process 1 exited with code 3 while process 0 still runs")
    assert "The others get 1 s to stop, then are killed" in lines[0]
    assert lines[1] == "[launch] killing the processes still running 1 s after a failure"
    assert lines[2] == "[launch] process 0 was killed by SIGKILL (after process 1 failed)"
    assert lines[3].startswith("[launch] process 1 failed first (exited with code 3)")
    assert elapsed < 20


def test_a_peer_killed_by_a_signal_is_named_with_the_signal(tmp_path):
    script = """
    import os, signal, time
    if os.environ["JAXEMBED_PROCESS_ID"] == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
    """
    code, out, _ = run(
        tmp_path, script, processes=3, devices_per_process=1, grace_seconds=1,
        timeout_seconds=30,
    )  # fmt: skip
    assert code == 128 + signal.SIGKILL
    lines = launcher_lines(out)
    assert lines[0].startswith(
        "[launch] process 0 was killed by SIGKILL while processes 1, 2 still run: process 0 "
        "failed first"
    ), lines
    assert lines[-1].startswith(
        "[launch] process 0 failed first (was killed by SIGKILL); the failures of processes "
        "1, 2 followed from its exit"
    ), lines


def test_a_failure_with_no_peer_running_says_only_what_happened(tmp_path):
    script = """
    import os, time
    if os.environ["JAXEMBED_PROCESS_ID"] == "1":
        time.sleep(0.5)
        raise SystemExit(4)
    """
    code, out, _ = run(tmp_path, script, processes=2, devices_per_process=1, timeout_seconds=30)
    assert code == 4
    assert launcher_lines(out) == ["[launch] process 1 exited with code 4"]
    code, out, _ = run(tmp_path, "pass\n", processes=2, devices_per_process=1)
    assert code == 0 and launcher_lines(out) == []
