"""Raw 64-bit ids never read wrong: int32 is refused wherever a dynamic id enters, and the
step counter's wrap changes no decision.

1. With x64 off, `jax.jit` narrows a numpy int64 argument to int32 before the body runs; an
   int64 `[B, 2]` would then read as B keys' (low, high) halves: 2 ids admitted for 4, outputs
   of the right shape and wrong numbers. Every entry point (the functional `prepare`,
   `remap_table` and `rows_for`, a collection's `prepare` and `read_rows`, NNX and Linen
   collections, NNX and Linen `DynamicEmbed`) refuses int32 ids in every shape, eagerly and
   under `jit`, naming the narrowing and `as_keys`; the same ids converted with `as_keys`
   outside the jitted step read all 2B ids, as the pure-Python reference does (and, in a
   subprocess with x64 on, as int64 ids passed directly do).
2. The step counter is 32 bits read modulo 2**32: a stream started just before the int32
   counter wraps (2**31 - 1 -> -2**31) or the 32-bit one (2**32 - 1 -> 0) makes every decision
   (rows, admissions, evictions, refusals, values) the one started at step 0 makes, under
   `jit`, on 1 and 8 devices, for lru, lfu and ttl.
"""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxembed
import jaxembed.flax
import jaxembed.nnx
from jaxembed.collection import FeatureConfig, TableConfig, layout_collection
from jaxembed.dynamic import DynamicTableConfig, as_keys
from jaxembed.dynamic import keys as K
from jaxembed.dynamic import reference as R
from jaxembed.optim import dynamic as D
from jaxembed.optim import dynamic_collection as DC

H = 4
INIT = jax.nn.initializers.normal(0.5)
KEY = jax.random.key(3)
SPREAD = np.uint64(0x9E3779B97F4A7C15)  # spreads small ints over all 64 bits
NARROWED = r"int32 ids are refused: with x64 off, jax.jit narrows numpy int64 ids to int32"


def raw_ids(shape, seed=0):
    """int64 ids that need all 64 bits (so a narrowing loses them), none reserved."""
    rng = np.random.default_rng(seed)
    return (rng.integers(1, 50, shape).astype(np.uint64) * SPREAD).view(np.int64)


def cfg(policy="lru", **kw):
    return DynamicTableConfig(capacity=32, bucket_size=4, policy=policy, **kw)


# --- 1. int32 refused at every entry, [B, 2] included -------------------------------------


def functional_entries():
    c = cfg()
    dyn = D.init_table(c, H)
    kw = dict(initializer=INIT, key=KEY)
    return {
        "prepare": lambda ids: D.prepare(c, dyn, None, ids, 0, optimizer=None, **kw),
        "remap_table": lambda ids: D.remap_table(c, dyn, ids, 0, **kw),
        "rows_for": lambda ids: D.rows_for(c, dyn.state, ids),
    }


def collection_entries():
    tables = [TableConfig("user", 32, H, placement="replicated", dynamic=cfg())]
    layout = layout_collection(tables, [FeatureConfig("user_id", "user")], None)
    remaps = DC.init_states(layout)
    stacks = {0: jnp.zeros((32, H))}
    return {
        "collection prepare": lambda ids: DC.prepare(
            layout, stacks, None, remaps, {"user_id": ids}, 0, key=KEY, optimizer=None
        ),
        "collection read_rows": lambda ids: DC.read_rows(layout, remaps, {"user_id": ids}),
    }


ENTRIES = ["prepare", "remap_table", "rows_for", "collection prepare", "collection read_rows"]


# Every entry with the shape [B, 2]; a functional and a collection entry (they share
# the check with the others of their kind) in every shape.
@pytest.mark.parametrize(
    ("entry", "shape"),
    [(e, (3, 2)) for e in ENTRIES]
    + [(e, shape) for e in ("prepare", "collection read_rows") for shape in [(6,), (2, 2, 2)]],
    ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else x,
)
def test_functional_entries_refuse_int32_eagerly_and_under_jit(entry, shape):
    fn = {**functional_entries(), **collection_entries()}[entry]
    ids = raw_ids(shape)
    with pytest.raises(TypeError, match=NARROWED):
        jax.jit(fn)(ids)  # the numpy int64 argument arrives as int32
    with pytest.raises(TypeError, match=NARROWED):
        fn(ids.astype(np.int32))
    fn(ids)  # numpy int64 on the host: every id, in full
    jax.jit(fn)(as_keys(ids))  # keys made outside the jitted function


def test_a_collection_names_the_feature_and_the_table():
    fn = collection_entries()["collection prepare"]
    with pytest.raises(TypeError, match=r"feature 'user_id' \(dynamic table 'user'\) ids are "
                                        r"int32 of shape \(3, 2\): " + NARROWED):  # fmt: skip
        jax.jit(fn)(raw_ids((3, 2)))
    with pytest.raises(TypeError, match=r"feature 'user_id' \(dynamic table 'user'\) ids must "
                                        r"be 64-bit integer ids, got float32 ids of shape "
                                        r"\(3,\) \(ids are never rounded from floats\)"):  # fmt: skip
        fn(jnp.ones(3))
    with pytest.raises(ValueError, match=r"feature 'user_id' \(dynamic table 'user'\) "
                                         r"ids\[1\] = 18446744073709551615"):  # fmt: skip
        fn(np.array([5, -1], np.int64))  # the reserved id, eagerly


def test_b_by_2_int64_ids_read_as_2b_ids_once_converted():
    """The issue's case: 4 ids in a [2, 2] batch, admit_after=1: 4 admitted, not 2."""
    c = cfg(admit_after=1)
    ids = (np.array([[3, 2**33 + 3], [7, 2**40 + 7]], np.uint64) * SPREAD).view(np.int64)
    ref = R.step(c, R.init_state(c), ids, 0)
    step = jax.jit(lambda k: D.remap_table(c, D.init_table(c, H), k, 0, initializer=INIT,
                                           key=KEY))  # fmt: skip
    rows, _, _, stats = step(as_keys(ids))
    assert rows.shape == (2, 2) and int(stats.admitted) == ref.stats.admitted == 4
    np.testing.assert_array_equal(rows, ref.rows)


def two_b_stream(steps=4, seed=1):
    for t in range(steps):
        yield raw_ids((3, 2), seed=seed + t)


def nnx_embed(mesh=None, config=None):
    metadata = {"out_sharding": ("model", None)} if mesh is not None else {}
    return jaxembed.nnx.DynamicEmbed(config or cfg(), H, embedding_init=INIT, impl="xla",
                                     rngs=nnx.Rngs(0), embedding_metadata=metadata)  # fmt: skip


# On 8 devices (the refusal is the same check on one device, where tests/test_dynamic_modules.py
# reads keys through both modules).
@pytest.mark.parametrize("devices", [8])
def test_modules_refuse_int32_and_read_keys_as_the_reference(devices):
    """NNX DynamicEmbed, Linen DynamicEmbed and an NNX collection with a dynamic table: an int64
    [3, 2] batch into a jitted call is refused (the module's state untouched); as keys, every
    step's rows equal the pure-Python reference's."""
    mesh = jax.make_mesh((8,), ("model",)) if devices == 8 else None
    with jax.set_mesh(mesh) if mesh is not None else _nullcontext():
        embed = nnx_embed(mesh)
        call = nnx.jit(lambda m, k: m(k))
        with pytest.raises(TypeError, match=r"jaxembed.nnx.DynamicEmbed's ids are int32 of "
                                            r"shape \(3, 2\): " + NARROWED):  # fmt: skip
            call(embed, raw_ids((3, 2)))
        assert int(embed.step.get_value()) == 0
        ref = R.init_state(cfg())
        for t, ids in enumerate(two_b_stream()):
            out = call(embed, as_keys(ids))
            r = R.step(cfg(), ref, ids, t)
            ref = r.state
            assert out.shape == (3, 2, H)
            np.testing.assert_array_equal(np.asarray(out).any(-1), r.found)
            np.testing.assert_array_equal(embed.remap.get_value().keys, ref.keys)

        model = jaxembed.flax.DynamicEmbed(cfg(), H, embedding_init=INIT, impl="xla")
        keys0 = as_keys(raw_ids((3, 2)))
        variables = model.init(jax.random.key(0), keys0)
        apply = jax.jit(lambda v, k: model.apply(v, k, mutable=["dynamic"]))
        with pytest.raises(TypeError, match=r"jaxembed.flax.DynamicEmbed's ids are int32 of "
                                            r"shape \(3, 2\): " + NARROWED):  # fmt: skip
            apply(variables, raw_ids((3, 2)))
        _, upd = apply(variables, keys0)
        r = R.step(cfg(), R.init_state(cfg()), K.keys_to_host(keys0), 0)
        np.testing.assert_array_equal(upd["dynamic"]["remap"].keys, r.state.keys)

        tables = [TableConfig("user", 32, H, placement="rows" if mesh else "replicated",
                              dynamic=cfg())]  # fmt: skip
        coll = jaxembed.nnx.EmbeddingBagCollection(
            tables, [FeatureConfig("user_id", "user")], rngs=nnx.Rngs(0), mesh=mesh
        )
        ccall = nnx.jit(lambda m, b: m(b))
        with pytest.raises(TypeError, match=r"feature 'user_id' \(dynamic table 'user'\) ids "
                                            r"are int32 of shape \(3, 2\)"):  # fmt: skip
            ccall(coll, {"user_id": raw_ids((3, 2))})
        with pytest.raises(TypeError, match=r"feature 'user_id' \(dynamic table 'user'\) ids "
                                            r"must be 64-bit integer ids, got float32"):  # fmt: skip
            ccall(coll, {"user_id": jnp.ones((3, 2))})
        ccall(coll, {"user_id": as_keys(raw_ids((3, 2)))})


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


X64_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp, numpy as np
    from jaxembed.dynamic import DynamicTableConfig, as_keys
    from jaxembed.optim import dynamic as D
    c = DynamicTableConfig(capacity=32, bucket_size=4, admit_after=1)
    ids = np.array(json.loads(sys.argv[1]), np.int64)
    run = jax.jit(lambda i: D.remap_table(c, D.init_table(c, 4), i, 0,
                  initializer=jax.nn.initializers.normal(0.5), key=jax.random.key(3)))
    rows, _, _, stats = run(ids)                 # int64 [B, 2] directly: 2B ids
    rows_k, _, _, _ = run(as_keys(ids))          # the same ids as keys
    print(json.dumps({"rows": np.asarray(rows).tolist(), "keys": np.asarray(rows_k).tolist(),
                      "admitted": int(stats.admitted)}))
""")


def test_x64_on_reads_int64_b_by_2_as_2b_ids():
    ids = raw_ids((3, 2), seed=9)
    env = {**os.environ, "JAX_ENABLE_X64": "1"}
    out = subprocess.run(
        [sys.executable, "-c", X64_SCRIPT, json.dumps(ids.tolist())],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    c = cfg(admit_after=1)
    ref = R.step(c, R.init_state(c), ids, 0)
    assert got["admitted"] == ref.stats.admitted == len(np.unique(ids))
    assert got["rows"] == got["keys"] == ref.rows.tolist()


# --- 2. the step counter wraps without changing a decision ---------------------------------

STARTS = {"t0": 0, "wrap31": 2**31 - 3, "wrap32": 2**32 - 3}


def policy_stream(steps=8, seed=4):
    """Batches that overflow the table: admissions, evictions (and ttl refusals) every step."""
    rng = np.random.default_rng(seed)
    for t in range(steps):
        raw = (2 * t + rng.integers(0, 24, (4, 3))).astype(np.uint64)
        yield (raw * SPREAD).view(np.int64)


# Compiled once for all the starts of a case (the module's structure and config are the same):
# the call, and the rows' lookup.
CALL = nnx.jit(lambda m, k: m(k))
ROWS_FOR = jax.jit(jaxembed.optim.dynamic.rows_for, static_argnums=0)


def run_from(start, policy, mesh):
    """NNX DynamicEmbed under nnx.jit from step `start` (its counter set as an int32 holds it):
    each step's output, rows' keys, stats and the final state."""
    embed = nnx_embed(mesh, cfg(policy, ttl_steps=2) if policy == "ttl" else cfg(policy))
    step = embed.step.get_value()
    bits = np.array(start % 2**32, np.uint32).view(np.int32)
    bits = jnp.asarray(bits)  # on one device uncommitted as the rest: the call compiles once
    embed.step.set_value(bits if mesh is None else jax.device_put(bits, step.sharding))
    outs, stats = [], []
    for ids in policy_stream():
        keys = as_keys(ids)
        out = np.asarray(CALL(embed, keys))
        # each id's row, by the key the remap holds there (a reset row's values are drawn
        # from the step, so they differ between starts; its holder must not)
        rows = np.asarray(ROWS_FOR(embed.config, embed.remap.get_value(), keys))
        outs.append((rows, out.any(-1)))
        stats.append(tuple(int(x) for x in embed.stats.get_value()))
    state = embed.remap.get_value()
    return outs, stats, np.asarray(state.keys), np.asarray(state.count), int(embed.step.get_value())


@pytest.mark.parametrize("policy, devices", [("lru", 1), ("lfu", 1), ("ttl", 1), ("ttl", 8)])
def test_a_wrapping_step_counter_changes_no_decision(policy, devices):
    mesh = jax.make_mesh((8,), ("model",)) if devices == 8 else None
    with jax.set_mesh(mesh) if mesh is not None else _nullcontext():
        base = run_from(0, policy, mesh)
        evicted = sum(s[2] for s in base[1])
        assert evicted > 0, "the stream must evict for the order to matter"
        for name in ("wrap31", "wrap32"):
            got = run_from(STARTS[name], policy, mesh)
            for t, (a, b) in enumerate(zip(got[0], base[0], strict=True)):
                np.testing.assert_array_equal(a[0], b[0], err_msg=f"{name}: step {t} rows")
                np.testing.assert_array_equal(a[1], b[1], err_msg=f"{name}: step {t} read")
            assert got[1] == base[1], name
            np.testing.assert_array_equal(got[2], base[2], err_msg=name)
            np.testing.assert_array_equal(got[3], base[3], err_msg=name)
            assert got[4] == np.array((STARTS[name] + 8) % 2**32, np.uint32).view(np.int32)


def test_the_reference_decides_by_age_across_the_wrap():
    """Two ids in one bucket, one seen just before the int32 wrap and one just after: lru
    evicts the older (seen before), whatever the signs of the steps."""
    c = DynamicTableConfig(capacity=4, bucket_size=2, policy="lru")
    found, i = [], 1
    while len(found) < 3:  # three ids of bucket 0
        if int(K.bucket_of(K.keys_to_host(np.array([i], np.int64)), 2, c.seed)[0]) == 0:
            found.append(i)
        i += 1
    a, b, new = (np.array([x], np.int64) for x in found)
    for start in (0, 2**31 - 1, 2**32 - 1):
        state = R.init_state(c)
        state = R.step(c, state, a, start).state
        state = R.step(c, state, b, start + 1).state
        out = R.step(c, state, new, start + 2)
        assert out.evicted == [int(a[0])], start
