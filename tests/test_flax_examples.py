"""The drop-in `Embed`s in real Flax programs: lm1b-style LMs on an Auto mesh.

Each program is a small decoder-only Transformer (`lm_models`) trained as Flax's
`examples/lm1b_nnx` (NNX) and `examples/lm1b` (Linen) train it, on the Auto mesh
`data=2 x fsdp=1 x tensor=4` of 8 CPU devices, with the shared table annotated
`('tensor', 'fsdp')` (rows over `tensor`). A variant swaps Flax's `Embed` for jaxembed's
and changes nothing else, or also passes `inputs_sharding=P('data')` (`+ids`):

    nnx/...            nnx.Optimizer, jax.jit(in_shardings=state shardings, P('data'))
    linen-unboxed/...  jax.jit(init, out_shardings=...), then nn.meta.unbox (lm1b)
    linen-boxed/...    the LogicallyPartitioned boxes kept, logical rules active at apply
                       (compared with linen-unboxed/flax: Flax's Embed ignores the boxes)

What jaxembed must do there: the table never moves; ids without a layout default to the
batch split over the mesh axes the table does not use (`data`); the compiled lookup is the
one `plan_embedding` lists; ids `[1, 1]` (the vmapped decoder) work; every assumption warns
at most once per call site. Every build, compile and decode records its warnings (they are
checked in one place, `test_each_assumption_warns_at_most_once_per_call_site`).
"""

import collections
import contextlib
import difflib
import functools
import os
import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import lm_models as lm
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxembed
import jaxembed.flax
import jaxembed.nnx
from jaxembed import hlo

# The batch: 16 sequences of 16 tokens, 8 per `data` shard. Chosen so that the embedding's
# traffic is a visible part of the step's: the table-gradient shard f32[256, 64] (64 KiB,
# what a dense data-parallel exchange all-reduces) is twice one data shard's out_grad
# f32[8, 16, 64] (32 KiB, what the rows exchange gathers), so a lookup that runs in the
# right layout sends fewer bytes than Flax's, and one that looks up the global batch
# (a psum of f32[16, 16, 64] instead of f32[8, 16, 64]) or gathers the table
# (f32[1024, 64], 256 KiB) sends more.
# One block (compiles dominate the file's time; the blocks are not what is tested).
CONFIG = lm.SMALL.replace(layers=1)  # vocab 1024, emb 64, heads 4, mlp 128, max_len 32
BATCH, LENGTH = 16, 16
STEPS = 3
TABLE_SPEC = P(*lm.mesh_axes("vocab", "embed"))  # P('tensor', 'fsdp')

# name -> (framework, embed_cls, boxed, ids_sharding)
VARIANTS = {
    "nnx/flax": ("nnx", nnx.Embed, False, None),
    "nnx/jaxembed": ("nnx", jaxembed.nnx.Embed, False, None),
    "nnx/jaxembed+ids": ("nnx", jaxembed.nnx.Embed, False, P("data")),
    "linen-unboxed/flax": ("linen", nn.Embed, False, None),
    "linen-unboxed/jaxembed": ("linen", jaxembed.flax.Embed, False, None),
    "linen-boxed/jaxembed": ("linen", jaxembed.flax.Embed, True, None),
    "linen-boxed/jaxembed+ids": ("linen", jaxembed.flax.Embed, True, P("data")),
}
SWAPPED = [name for name in VARIANTS if "/jaxembed" in name]
ASSUMING = [name for name in SWAPPED if not name.endswith("+ids")]  # no layout given
FLAX = [name for name in VARIANTS if name.endswith("/flax")]


def baseline(name: str) -> str:
    """The Flax program a swapped variant is compared with: the same one with Flax's Embed.

    Flax's Linen `Embed` unboxes its parameter whatever the caller does, so lm1b's program
    (unboxed) is also the boxed one's (the same HLO, the same losses).
    """
    return "nnx/flax" if name.startswith("nnx/") else "linen-unboxed/flax"


# --- building, compiling and decoding, once per variant, with the warnings recorded ---------

WARNINGS: dict[str, list[warnings.WarningMessage]] = collections.defaultdict(list)


@contextlib.contextmanager
def recording(name: str):
    """Records every warning (none raised) under `name`, including on failure."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        finally:
            WARNINGS[name].extend(caught)


@functools.cache
def mesh():
    return lm.make_mesh(data=2, fsdp=1, tensor=4)


@functools.cache
def setup(name: str) -> lm.TrainSetup:
    framework, embed_cls, boxed, ids_sharding = VARIANTS[name]
    config = CONFIG.replace(ids_sharding=ids_sharding)
    with recording(name):
        if framework == "nnx":
            return lm.build_nnx(config, mesh(), embed_cls)
        return lm.build_linen(config, mesh(), embed_cls, boxed=boxed)


def compiled(name: str, batch: int = BATCH, length: int = LENGTH):
    with recording(name):
        return setup(name).compile(batch, length)


@functools.cache
def hlo_text(name: str) -> str:
    return compiled(name).as_text()


@functools.cache
def losses(name: str) -> tuple[float, ...]:
    s, out = setup(name), []
    state = s.state
    with recording(name):
        for i in range(STEPS):
            state, loss = s.run(state, lm.make_batch(i, BATCH, LENGTH, CONFIG.vocab))
            out.append(float(loss))
    return tuple(out)


def prompts(n: int = 8, length: int = 8, given: int = 3) -> np.ndarray:
    """n prompts `[n, 1, length]` (one per device, as the sampler pads them): `given`
    tokens, then 0s for the decoder to fill."""
    ids = lm.make_batch(100, n, length, CONFIG.vocab, pad=False)
    ids[:, given:] = 0
    return ids[:, None, :]


@functools.cache
def decoded(name: str, length: int = 8) -> tuple[np.ndarray, np.ndarray]:
    with recording(name):
        tokens, logits = setup(name).decode(prompts(length=length))
    return np.asarray(tokens), np.asarray(logits)


def collective_rows(text: str) -> collections.Counter:
    """The collectives of an HLO text as `kind axes dtype[shapes] wire` strings, counted."""
    return collections.Counter(
        f"{c.kind} {','.join(hlo.mesh_axes(c, mesh()))} {c.dtype}"
        f"{','.join(str(list(s)) for s in c.result_shape)} {c.wire_bytes:,.0f}"
        for c in hlo.collectives(text)
    )


def difference(ours: str, theirs: str) -> str:
    """The collectives only one of two HLO texts has."""
    a, b = collective_rows(ours), collective_rows(theirs)
    first, second = sorted((a - b).elements()), sorted((b - a).elements())
    return f"only in the first: {first}; only in the second: {second}"


# --- 1. the swap gives Flax's losses ----------------------------------------------------------


@pytest.mark.parametrize("name", SWAPPED)
def test_swap_gives_flax_losses(name):
    ref = losses(baseline(name))
    assert all(np.isfinite(ref)) and ref[-1] < ref[0], f"the Flax program does not train: {ref}"
    np.testing.assert_allclose(losses(name), ref, rtol=1e-5, atol=0)


# --- 2. the table never moves ------------------------------------------------------------------


@pytest.mark.parametrize("name", list(VARIANTS))
def test_the_table_never_moves(name):
    """Only gradient shards are reduced, over the batch axis; nothing table-sized is gathered.

    A data-parallel step must all-reduce the table's gradient shard f32[V/4, H] over `data`
    (Flax's program does, for the lookup's and the tied head's gradients). Nothing else may
    carry a table-shaped array: no gather of the table or of its shard, no collective over
    `tensor`/`fsdp` (the table's own axes), no full-table f32[V, H] array
    (`lm_models.table_collectives`). The Flax programs are the control: the rule holds there.
    """
    moving = [c for c in lm.table_collectives(hlo_text(name), setup(name)) if c["moves_table"]]
    assert not moving, f"the table moves (table {setup(name).table_shape}): {moving}"


@pytest.mark.parametrize("name", ["nnx/jaxembed", "linen-unboxed/jaxembed"])
def test_the_step_is_the_same_outside_the_mesh_context(name):
    """lm1b and lm1b_nnx call their jitted steps outside any mesh or rules context: the
    shardings come from `in_shardings` alone. The traced program must be the one traced
    inside `jax.set_mesh` (the same StableHLO text)."""
    with recording(name):
        inside = setup(name).trace(BATCH, LENGTH).as_text()
        outside = setup(name).trace(BATCH, LENGTH, in_context=False).as_text()
    diff = difflib.unified_diff(inside.splitlines(), outside.splitlines(), lineterm="", n=0)
    assert outside == inside, "inside vs outside:\n" + "\n".join(list(diff)[:12])


# --- 3. no more bytes than Flax ---------------------------------------------------------------


@pytest.mark.parametrize("name", SWAPPED)
def test_collective_bytes_at_most_flax(name):
    ours = hlo.total_wire_bytes(hlo_text(name))
    theirs = hlo.total_wire_bytes(hlo_text(baseline(name)))
    assert ours <= theirs, (
        f"{name}: {ours:,.0f} wire bytes per device, {ours / theirs:.3f}x Flax's {theirs:,.0f} "
        f"(jaxembed's program first): {difference(hlo_text(name), hlo_text(baseline(name)))}"
    )


# --- 4. the vmapped decoder, ids [1, 1] ----------------------------------------------------


@pytest.mark.parametrize("name", SWAPPED)
def test_vmapped_decode_matches_flax(name):
    """lm1b's predict step: jit(vmap(decode)) over 8 prompts, the model on ids [1, 1]."""
    tokens, logits = decoded(name)
    ref_tokens, ref_logits = decoded(baseline(name))
    assert tokens.shape == (8, 1, 8) and logits.shape == (8, 1, 8, CONFIG.vocab)
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(tokens, ref_tokens)


@pytest.mark.parametrize("name", ["nnx/flax", "linen-unboxed/flax"])
def test_decoder_matches_the_forward_pass(name):
    """The test programs themselves: decoding a whole prompt token by token with the cache
    gives the training forward's logits (teacher forcing), so the decode path is the model."""
    full = prompts(given=8)
    with recording(name):
        _, logits = setup(name).decode(full)
        forward = setup(name).logits(full[:, 0])
    np.testing.assert_allclose(np.asarray(logits)[:, 0], forward, rtol=1e-5, atol=1e-5)


# --- 5. warnings -----------------------------------------------------------------------------

MODELS_FILE = os.path.abspath(lm.__file__)


def jaxembed_warnings(name: str) -> list[warnings.WarningMessage]:
    """Warnings of a swapped variant that its Flax baseline does not give (by message)."""
    flax_messages = {(w.category, str(w.message)) for w in WARNINGS[baseline(name)]}
    return [w for w in WARNINGS[name] if (w.category, str(w.message)) not in flax_messages]


@functools.cache
def trace_everything(name: str) -> None:
    """Build, compile the step for two batch shapes (two traces), run, and decode.

    The Flax baseline, whose messages tell which warnings are jaxembed's, skips the second
    trace: it repeats the first's messages.
    """
    losses(name)
    decoded(name)
    if name not in FLAX:
        with recording(name):
            setup(name).trace(2 * BATCH, LENGTH)


@pytest.mark.parametrize("name", ASSUMING)
def test_each_assumption_warns_at_most_once_per_call_site(name):
    trace_everything(baseline(name))
    trace_everything(name)
    # One warning per assumption and call site: the same assumption made again for another
    # shape (a decoding batch after a training batch) stays silent.
    sites = collections.Counter(
        (w.filename, w.lineno, re.sub(r"\(\d+(, \d+)*\)|P\([^)]*\)", "", str(w.message)))
        for w in jaxembed_warnings(name)
    )
    repeated = {site[:2]: n for site, n in sites.items() if n > 1}
    assert not repeated, (
        f"warned more than once per call site: {repeated}; messages: "
        f"{sorted({str(w.message) for w in jaxembed_warnings(name)})}"
    )


@pytest.mark.parametrize("name", ASSUMING)
def test_warnings_point_at_the_models_call_site(name):
    """A warning names the user's line (the model's `embed(...)` or `attend` call in
    lm_models.py), not a line inside jaxembed or Flax: that line is the call site."""
    trace_everything(baseline(name))
    trace_everything(name)
    misplaced = [
        f"{w.filename}:{w.lineno}: {w.message}"
        for w in jaxembed_warnings(name)
        if os.path.abspath(w.filename) != MODELS_FILE
    ]
    assert not misplaced, "warnings not attributed to the model's line:\n" + "\n".join(misplaced)


# --- 6. the plan is the compiled lookup -------------------------------------------------------


def lookup_program(framework: str, boxed: bool) -> tuple[str, tuple[int, int]]:
    """The compiled forward and backward of the embedding alone, as the model calls it.

    The table laid out `('tensor', 'fsdp')` from the same metadata as in the model, the ids
    and the output's cotangent `P('data')` (`in_shardings`, as the train step), the module
    called without `inputs_sharding`, as the model calls it.
    """
    ids_shape, rules = (BATCH, LENGTH), tuple(lm.LOGICAL_RULES)
    batch = NamedSharding(mesh(), P("data"))
    ids = jax.ShapeDtypeStruct(ids_shape, jnp.int32, sharding=batch)
    ct = jax.ShapeDtypeStruct((*ids_shape, CONFIG.emb), jnp.float32, sharding=batch)
    init = nnx.initializers.normal(stddev=1.0)
    if framework == "nnx":
        with jax.set_mesh(mesh()):
            embed = jaxembed.nnx.Embed(
                CONFIG.vocab, CONFIG.emb, rngs=nnx.Rngs(0),
                embedding_init=nnx.with_partitioning(init, tuple(TABLE_SPEC)),
            )  # fmt: skip
        graphdef, params = nnx.split(embed)
        params_sharding = nnx.get_named_sharding(params, mesh())
        apply = lambda p, i: nnx.merge(graphdef, p)(i)
        table_shape = tuple(embed.embedding.shape)
    else:
        module = jaxembed.flax.Embed(
            CONFIG.vocab, CONFIG.emb,
            embedding_init=nn.with_logical_partitioning(init, ("vocab", "embed")),
        )  # fmt: skip
        key, zeros = jax.random.key(0), jnp.zeros(ids_shape, jnp.int32)
        abstract = jax.eval_shape(module.init, key, zeros)
        with jax.set_mesh(mesh()), nn.logical_axis_rules(rules):
            shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh(), rules)
            variables = jax.jit(module.init, out_shardings=shardings)(key, zeros)
        params, params_sharding = variables["params"], shardings["params"]
        params = params if boxed else nn.meta.unbox(params)
        apply = lambda p, i: module.apply({"params": p}, i)
        table_shape = tuple(nn.meta.unbox(params)["embedding"].shape)

    def forward_and_backward(params, ids, ct):
        out, vjp = jax.vjp(lambda p: apply(p, ids), params)
        return out, vjp(ct)[0]

    step = jax.jit(forward_and_backward, in_shardings=(params_sharding, batch, batch))
    with contextlib.ExitStack() as context:
        context.enter_context(jax.set_mesh(mesh()))
        if framework == "linen" and boxed:
            context.enter_context(nn.logical_axis_rules(rules))
        return step.lower(params, ids, ct).compile().as_text(), table_shape


@pytest.mark.parametrize(
    "framework, boxed", [("nnx", False), ("linen", True), ("linen", False)],
    ids=["nnx", "linen-boxed", "linen-unboxed"],
)  # fmt: skip
def test_plan_is_the_compiled_lookup(framework, boxed):
    """`plan_embedding` for the layouts the model uses lists the program's collectives.

    The layouts: the table `('tensor', 'fsdp')`, the ids split over the axis the table
    does not use, `P('data')`. Compared as (kind, mesh axes, per-device shape), one entry
    per array (a combined collective counts per array); nothing else may run.
    """
    with recording(f"lookup/{framework}/{boxed}"):
        text, table_shape = lookup_program(framework, boxed)
    plan = jaxembed.plan_embedding(
        mesh(), (BATCH, LENGTH), table_shape, x_spec=P("data"), weight_spec=TABLE_SPEC,
        vocab_size=CONFIG.vocab,
    )  # fmt: skip
    kinds = {"psum": "all-reduce", "psum_scatter": "reduce-scatter", "all_gather": "all-gather"}
    assert all(c.op in kinds for c in (*plan.forward, *plan.backward)), str(plan)
    planned = sorted(
        (kinds[c.op], tuple(c.axes), tuple(c.shape)) for c in (*plan.forward, *plan.backward)
    )
    actual = sorted(
        (c.kind, hlo.mesh_axes(c, mesh()), shape)
        for c in hlo.collectives(text)
        for shape in c.result_shape
    )
    assert actual == planned, (
        f"compiled {actual}\n!= planned {planned}\n{plan}\n{hlo.summarize(text, mesh())}"
    )
