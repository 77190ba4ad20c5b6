"""Checkpoints of tiered tables (`TieredTable.save` / `restore`): whole or absent.

A child process trains a tiered table, saves a checkpoint after 3 steps, trains 3 more, and
is killed (SIGKILL, from inside the function it dies in, so the point is exact) in the middle
of a write-back, of the save's flush, of the copy, just before and just after the commit.
The checkpoint left must restore bitwise to the in-memory table after 3 steps (or 6, once the
commit has happened), rows, optimizer state and step count, and training from it must go on
as the in-memory table does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxembed
from jaxembed.tiered import TableStore, TieredTable, create_store

H, ROWS, LR = 8, 400, 0.1


def stream(steps=9):
    """The batches (bags of 3, some empty slots) and cotangents, the same in every process."""
    rng = np.random.default_rng(11)
    init = rng.normal(size=(ROWS, H)).astype(np.float32)
    batches, grads = [], []
    for _ in range(steps):
        ids = rng.integers(0, ROWS, (4, 3))
        ids[rng.random((4, 3)) < 0.15] = -1
        batches.append(ids)
        grads.append(rng.normal(size=(4, H)).astype(np.float32))
    return init, batches, grads


def train_step():
    opt = jaxembed.optim.rowwise_adagrad(LR)

    def step(table, state, ids, g):
        out = jaxembed.embedding_bag(ids, table, combiner="sum")
        return opt.update(table, state, ids, g, combiner="sum", after=out)

    return opt, jax.jit(step, donate_argnums=(0, 1))


def train(tiered, step, batches, grads):
    for ids, g in zip(batches, grads, strict=True):
        slots, _ = tiered.prepare(ids)
        tiered.table, tiered.opt_state = step(tiered.table, tiered.opt_state, slots, g)


def reference(steps):
    """The in-memory table and its optimizer state after `steps` steps."""
    init, batches, grads = stream()
    opt, step = train_step()
    table = jnp.asarray(init)
    state = opt.init(table)
    for ids, g in zip(batches[:steps], grads[:steps], strict=True):
        table, state = step(table, state, jnp.asarray(ids), jnp.asarray(g))
    return np.asarray(table), np.asarray(state.slots["accumulator"]), int(state.count)


def assert_store_is(store, steps):
    table, acc, count = reference(steps)
    np.testing.assert_array_equal(np.asarray(store.table), table)
    np.testing.assert_array_equal(np.asarray(store.slot_arrays["accumulator"]), acc)
    assert store.count == count


# The child: 3 steps, a checkpoint, 3 steps, then a kill where `mode` says.
CHILD = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    import numpy as np
    from test_tiered_checkpoint import stream, train, train_step
    from jaxembed.tiered import TableStore, TieredTable, checkpoint, create_store

    mode, d = sys.argv[1], sys.argv[2]
    die = lambda: os.kill(os.getpid(), signal.SIGKILL)
    init, batches, grads = stream()
    opt, step = train_step()
    store = create_store(d + "/work", rows=len(init), dim=init.shape[1], optimizer=opt,
                         table=init)
    tiered = TieredTable(store, 16, optimizer=opt, bucket_size=4, spill_rows=8)
    train(tiered, step, batches[:3], grads[:3])
    tiered.save(d + "/ckpt")

    if mode in ("write-back", "save-flush"):  # half a write-back's rows, then killed
        write = TableStore.write
        def half(self, ids, rows, slots):
            if ids.size > 1:
                k = ids.size // 2
                write(self, ids[:k], rows[:k], {{n: a[:k] for n, a in slots.items()}})
                self.flush()
                die()
            write(self, ids, rows, slots)
        if mode == "write-back":
            TableStore.write = half
    train(tiered, step, batches[3:6], grads[3:6])
    if mode == "save-flush":
        TableStore.write = half
    if mode == "save-copy":  # the second file half copied, then killed
        copy, calls = checkpoint._copy_file, []
        def half_copy(src, dst):
            calls.append(src)
            if len(calls) == 2:
                with open(src, "rb") as f, open(dst, "wb") as g:
                    g.write(f.read(os.path.getsize(src) // 2))
                die()
            copy(src, dst)
        checkpoint._copy_file = half_copy
    if mode == "save-commit":  # everything copied, killed before the symlink's swap
        replace = os.replace
        def before(src, dst):
            if src.endswith(".link"):
                die()
            replace(src, dst)
        checkpoint.os.replace = before
    if mode == "save-cleanup":  # killed after the swap, before the old one is removed
        checkpoint._remove_others = lambda *a, **k: die()
    tiered.save(d + "/ckpt")
    sys.exit(3)  # not killed: the test fails
    """
)


@pytest.mark.parametrize(
    ("mode", "saved_steps"),
    [("write-back", 3), ("save-flush", 3), ("save-copy", 3), ("save-commit", 3),
     ("save-cleanup", 6)],
)  # fmt: skip
def test_killed_process_leaves_last_checkpoint_whole(tmp_path, mode, saved_steps):
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(tests=os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = ""
    root = os.path.dirname(os.path.dirname(jaxembed.__file__))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(script), mode, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]

    saved = TableStore.open(tmp_path / "ckpt", readonly=True)
    assert_store_is(saved, saved_steps)

    # Restored onto a cache of another size, training goes on as the in-memory table does.
    _, batches, grads = stream()
    opt, step = train_step()
    tiered = TieredTable.restore(tmp_path / "ckpt", tmp_path / "work", 64, optimizer=opt,
                                 rows=ROWS, dim=H, bucket_size=16)  # fmt: skip
    assert int(tiered.opt_state.count) == saved_steps
    train(tiered, step, batches[saved_steps:9], grads[saved_steps:9])
    tiered.save(tmp_path / "ckpt")
    assert_store_is(TableStore.open(tmp_path / "ckpt", readonly=True), 9)
    assert_store_is(tiered.store, 9)
    left = sorted(f for f in os.listdir(tmp_path) if f.startswith(".ckpt."))
    assert len(left) == 1 and os.readlink(tmp_path / "ckpt") == left[0]  # leftovers removed


def test_save_keeps_training_and_restores_bitwise(tmp_path):
    init, batches, grads = stream()
    opt, step = train_step()
    store = create_store(tmp_path / "work", rows=ROWS, dim=H, optimizer=opt, table=init)
    tiered = TieredTable(store, 16, optimizer=opt, bucket_size=4, spill_rows=8)
    train(tiered, step, batches[:4], grads[:4])
    assert tiered.save(tmp_path / "ckpt") > 0
    train(tiered, step, batches[4:9], grads[4:9])  # write-backs after the save
    assert_store_is(TableStore.open(tmp_path / "ckpt", readonly=True), 4)
    tiered.flush()
    assert_store_is(store, 9)
    small = TieredTable.restore(tmp_path / "ckpt", tmp_path / "other", 24, optimizer=opt,
                                bucket_size=8, spill_rows=8)  # fmt: skip
    train(small, step, batches[4:9], grads[4:9])
    small.flush()
    assert_store_is(small.store, 9)


def test_checkpoint_of_another_table_refused(tmp_path):
    init, *_ = stream()
    opt, _ = train_step()
    tiered = TieredTable(create_store(tmp_path / "w", rows=ROWS, dim=H, optimizer=opt,
                                      table=init), 16, optimizer=opt, bucket_size=8)  # fmt: skip
    tiered.save(tmp_path / "ckpt")
    ck = tmp_path / "ckpt"
    with pytest.raises(ValueError, match=r"checkpoint .*ckpt.* holds float32\[400, 8\] .* but "
                                         r"float32\[400, 16\]"):  # fmt: skip
        TieredTable.restore(ck, tmp_path / "r", 16, bucket_size=8, optimizer=opt, dim=16)
    with pytest.raises(ValueError, match=r"holds float32\[400, 8\] .* but bfloat16\[400, 8\]"):
        TieredTable.restore(
            ck, tmp_path / "r", 16, bucket_size=8, optimizer=opt, dtype=jnp.bfloat16
        )
    with pytest.raises(ValueError, match=r"holds float32\[400, 8\] .* but float32\[500, 8\]"):
        TieredTable.restore(ck, tmp_path / "r", 16, bucket_size=8, optimizer=opt, rows=500)
    with pytest.raises(ValueError, match=r"slots \['accumulator'\], but .* slots \['mu', 'nu'\]"):
        TieredTable.restore(
            ck, tmp_path / "r", 16, bucket_size=8, optimizer=jaxembed.optim.adam(0.1)
        )
    with pytest.raises(FileNotFoundError, match="no store"):
        TieredTable.restore(tmp_path / "none", tmp_path / "r", 16, bucket_size=8, optimizer=opt)
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match="exists and is not a checkpoint"):
        tiered.save(tmp_path / "plain")
    with pytest.raises(ValueError, match="is the working store"):
        tiered.save(tmp_path / "w")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("x")
    with pytest.raises(ValueError, match=r"holds \['a.txt'\], so it is not a store"):
        TieredTable.restore(ck, tmp_path / "notes", 16, bucket_size=8, optimizer=opt)
    assert (tmp_path / "notes" / "a.txt").exists()
    with pytest.raises(ValueError, match=r"is a symlink .* not a working store"):
        TieredTable.restore(ck, ck, 16, bucket_size=8, optimizer=opt)
    assert_store_is(TableStore.open(ck, readonly=True), 0)  # untouched
    assert not os.path.exists(tmp_path / "r")
