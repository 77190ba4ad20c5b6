"""64-bit ids as uint32 pairs, the reserved id, the hash, and the dynamic table's config.

The hash is checked against MurmurHash3_x86_32 written from its specification over bytes (and
that against the published test vectors), so numpy, XLA and C++ agree with the hash itself,
not only with one another.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxembed.dynamic import keys as K
from jaxembed.dynamic.config import DynamicTableConfig, overflow_fraction

M32 = 0xFFFFFFFF


def murmur3_32(data: bytes, seed: int) -> int:
    """MurmurHash3_x86_32 over bytes, from the reference implementation's definition."""
    rotl = lambda x, r: ((x << r) | (x >> (32 - r))) & M32
    h, n = seed & M32, len(data)
    for i in range(0, n - n % 4, 4):
        k = int.from_bytes(data[i : i + 4], "little")
        k = rotl((k * 0xCC9E2D51) & M32, 15) * 0x1B873593 & M32
        h = (rotl(h ^ k, 13) * 5 + 0xE6546B64) & M32
    tail = int.from_bytes(data[n - n % 4 :], "little")
    if n % 4:
        h ^= rotl((tail * 0xCC9E2D51) & M32, 15) * 0x1B873593 & M32
    h ^= n
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


@pytest.mark.parametrize(
    "data, seed, want",
    [
        (b"", 0, 0),
        (b"", 1, 0x514E28B7),
        (b"", 0xFFFFFFFF, 0x81F16F39),
        (b"\0\0\0\0", 0, 0x2362F9DE),
        (b"aaaa", 0x9747B28C, 0x5A97808A),
        (b"abcd", 0x9747B28C, 0xF0478627),
        (b"Hello, world!", 0x9747B28C, 0x24884CBA),
        (b"The quick brown fox jumps over the lazy dog", 0x9747B28C, 0x2FA826CD),
    ],
)
def test_the_bytes_murmur_meets_the_published_vectors(data, seed, want):
    assert murmur3_32(data, seed) == want


def test_hash32_is_murmur3_of_the_ids_bytes_in_numpy_and_xla(rng):
    ids = np.concatenate([
        rng.integers(-(2**63), 2**63 - 1, size=200, dtype=np.int64),
        np.array([0, 1, -2, 2**32, 2**32 - 1, 2**63 - 1, -(2**63)], np.int64),
    ])  # fmt: skip
    keys = K.keys_to_host(ids)
    for seed in (0, 1, 0xDEADBEEF, K.stream_seed(7, 1)):
        want = [murmur3_32(int(i).to_bytes(8, "little", signed=True), seed) for i in ids]
        assert K.hash32(keys, seed).tolist() == want
        assert (
            np.asarray(jax.jit(lambda k, s=seed: K.hash32(k, s))(jnp.asarray(keys))).tolist()
            == want
        )


def test_bucket_and_sketch_draw_independent_bits(rng):
    keys = K.keys_to_host(rng.integers(0, 2**62, size=40_000, dtype=np.int64))
    bucket = K.bucket_of(keys, 4, seed=3)
    cell = K.sketch_index(keys, bucket, 2, 4, seed=3)  # [2, N]: 4 counters a bucket and row
    assert cell.shape == (2, 40_000) and np.all(cell // 4 == bucket)
    # 16 cells of 2500 expected: a chi-square far beyond its 15 degrees of freedom's 99.9% (37.7)
    # would mean the counter's bits within a bucket predict the bucket's (or row 0's row 1's).
    for a, b in ((bucket, cell[0] % 4), (cell[0] % 4, cell[1] % 4)):
        joint = np.bincount(a * 4 + b, minlength=16)
        chi2 = ((joint - 2500.0) ** 2 / 2500.0).sum()
        assert chi2 < 37.7, joint
    assert len({K.stream_seed(0, s) for s in range(8)} | {K.stream_seed(1, 0)}) == 9


def test_owner_is_the_shard_holding_the_bucket(rng):
    keys = K.keys_to_host(rng.integers(0, 2**62, size=1000, dtype=np.int64))
    bucket = K.bucket_of(keys, 32, seed=5)
    for n in (1, 2, 4, 8, 32):
        assert np.array_equal(K.owner_of(keys, 32, n, seed=5), bucket // (32 // n))
    with pytest.raises(ValueError, match="num_shards=3 must divide num_buckets=32"):
        K.owner_of(keys, 32, 3, seed=5)


def test_forms_convert_without_truncation():
    want = [[5, 0], [M32 - 1, M32], [7, 256], [0, 2**31]]
    ids = np.array([5, -2, 2**40 + 7, -(2**63)], np.int64)
    assert K.keys_to_host(ids).tolist() == want
    assert K.keys_to_host(ids.astype(np.uint64)).tolist() == want
    assert K.keys_to_host([5, 2**64 - 2, 2**40 + 7, 2**63]).tolist() == want  # Python ints
    assert K.keys_to_host([5, -2]).tolist() == want[:2]
    pairs = np.array(want, np.uint32)
    assert K.as_keys(pairs).tolist() == want
    assert np.asarray(jax.jit(K.as_keys)(jnp.asarray(pairs))).tolist() == want
    assert K.to_uint64(K.as_keys(ids)).tolist() == ids.astype(np.uint64).tolist()
    assert K.as_keys(np.int64(3)).shape == (2,)


def test_x64_ids_are_split_under_jit():
    ids = np.array([5, -2, 2**40 + 7], np.int64)
    with jax.enable_x64(True):
        traced = jax.jit(K.as_keys)(jnp.asarray(ids))
        traced_u = jax.jit(K.as_keys)(jnp.asarray(ids.astype(np.uint64)))
    assert np.asarray(traced).tolist() == K.keys_to_host(ids).tolist()
    assert np.asarray(traced_u).tolist() == K.keys_to_host(ids).tolist()


@pytest.mark.parametrize(
    "ids, error, match",
    [
        (
            np.array([1.0, 2.0]),
            TypeError,
            r"got float64 ids of shape \(2,\) \(ids are never rounded",
        ),
        (np.array([True, False]), TypeError, r"got bool ids of shape \(2,\) \(bools are not ids"),
        (
            np.array([1, 2], np.int16),
            TypeError,
            r"int16 ids .*16-bit integers cannot hold 64-bit ids.*np.int64",
        ),
        (
            np.array([1, 2, 3], np.int32),
            TypeError,
            r"ids are int32 of shape \(3,\): int32 ids are refused.*narrows.*as_keys.*np.int64",
        ),
        (
            np.array([[1, 2], [3, 4]], np.int32),
            TypeError,
            r"ids are int32 of shape \(2, 2\): int32 ids are refused.*as_keys",
        ),
        (
            np.array([1, 2, 3], np.uint32),
            TypeError,
            r"uint32 ids of shape \(3,\) \(32-bit ids without the pair axis.*np.int64",
        ),
        (
            np.array([[1, 2, 3]], np.uint32),
            ValueError,
            r"uint32 ids must be pairs uint32\[..., 2\].*shape \(1, 3\), whose trailing axis is 3",
        ),
        ([1, 2**64], ValueError, r"ids\[1\] = 18446744073709551616 does not fit 64 bits"),
        ([1, "a"], TypeError, r"ids must be integers, got str"),
        (
            np.array([3, -1], np.int64),
            ValueError,
            r"ids\[1\] = 18446744073709551615 \(int64 -1.*is EMPTY_ID.*stats.reserved",
        ),
        (np.array([[3, 0], [M32, M32]], np.uint32), ValueError, r"ids\[1\] = 18446744073709551615"),
    ],
)
def test_hostile_ids_are_named_with_the_fix(ids, error, match):
    with pytest.raises(error, match=match):
        K.as_keys(ids)


@pytest.mark.parametrize(
    "x, error, match",
    [
        (jnp.array([1, 2], jnp.int32), TypeError, r"int32 ids are refused.*narrows.*as_keys"),
        (jnp.array([[1, 2]], jnp.int32), TypeError, r"int32 of shape \(1, 2\).*as_keys"),
        (jnp.array([1, 2], jnp.uint32)[:1], TypeError, r"32-bit ids without the pair axis"),
        (jnp.array([[1, 2, 3]], jnp.uint32), ValueError, r"trailing axis is 3, not 2"),
        (jnp.array([1.0, 2.0]), TypeError, r"float32 ids of shape \(2,\)"),
        (jnp.array([1, 2], jnp.int16), TypeError, r"int16 ids"),
    ],
)
def test_hostile_traced_ids_fail_when_traced(x, error, match):
    with pytest.raises(error, match=match):
        jax.jit(K.as_keys)(x)


def test_the_reserved_id_passes_as_padding_only_when_asked():
    keys = K.keys_to_host(np.array([3, -1], np.int64), check=False)
    assert K.is_reserved(keys).tolist() == [False, True]
    assert np.asarray(K.is_reserved(jnp.asarray(keys))).tolist() == [False, True]


def test_config_resolves_and_compares():
    a = DynamicTableConfig(capacity=256, admit_after=2)
    assert a == DynamicTableConfig(capacity=256, admit_after=2, sketch_width=256, sketch_window=256)
    assert hash(a) == hash(DynamicTableConfig(capacity=256, admit_after=2))
    assert a.num_buckets == 8 and a.sketch_shape == (4, 256)
    assert DynamicTableConfig(capacity=256).sketch_shape == (1, 1)  # unused: a placeholder
    assert abs(overflow_fraction(0.75, 32) - 0.005496) < 1e-5


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(capacity=0), r"capacity=0 must be a positive int"),
        (dict(capacity=True), r"capacity=True must be a positive int"),
        (dict(capacity=2**31), r"capacity=2147483648 must be a positive int .*at most 2147483647"),
        (
            dict(capacity=1000),
            r"capacity=1000 is not a multiple of bucket_size=32: .*use capacity=1024 \(or 992\)",
        ),
        (dict(capacity=64, bucket_size=0), r"bucket_size=0 must be an int in \[1, 1024\]"),
        (dict(capacity=64, admit_after=0), r"admit_after=0 must be an int in \[1, "),
        (dict(capacity=64, admit_after=1.5), r"admit_after=1.5 must be an int"),
        (
            dict(capacity=64, policy="LRU"),
            r"policy='LRU' is not an eviction policy; known: 'lru', 'lfu', 'ttl'",
        ),
        (dict(capacity=64, policy="ttl"), r"policy='ttl' needs ttl_steps"),
        (dict(capacity=64, policy="ttl", ttl_steps=0), r"ttl_steps=0 must be an int in \[1, "),
        (
            dict(capacity=64, ttl_steps=5),
            r"ttl_steps=5 applies only to policy='ttl' \(got policy='lru'\)",
        ),
        (dict(capacity=64, sketch_depth=0), r"sketch_depth=0 must be an int in \[1, 16\]"),
        (dict(capacity=64, sketch_width=0), r"sketch_width=0 must be an int"),
        (dict(capacity=64, seed=-1), r"seed=-1 must be an int in \[0, 4294967295\]"),
    ],
)
def test_bad_configs_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DynamicTableConfig(**kwargs)


def test_device_ids_keep_their_sharding_and_are_checked():
    mesh = jax.make_mesh((8,), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    pairs = jax.device_put(K.keys_to_host(np.arange(16, dtype=np.int64)), sharding)
    keys = K.as_keys(pairs)
    assert keys is pairs and keys.sharding == sharding
    with pytest.raises(ValueError, match=r"ids\[3\] = 18446744073709551615"):
        K.as_keys(jnp.asarray(K.keys_to_host(np.array([0, 1, 2, -1]), check=False)))


@pytest.mark.parametrize("shape", [(4,), (4, 2), (2, 3, 2)])
def test_int64_ids_narrowed_by_jit_are_refused_in_every_shape(shape):
    """With x64 off, jax.jit narrows a numpy int64 argument to int32 before the body runs:
    an int64 [B, 2] would read as B keys' halves. Refused, naming the narrowing and as_keys."""
    ids = np.arange(np.prod(shape), dtype=np.int64).reshape(shape) + 2**40
    with pytest.raises(TypeError, match=r"int32 ids are refused: with x64 off, jax.jit narrows"):
        jax.jit(K.as_keys)(ids)
    with pytest.raises(TypeError, match=r"keys = jaxembed.dynamic.as_keys\(ids\)"):
        K.as_keys(ids.astype(np.int32))  # eagerly too
    keys = K.as_keys(ids)  # converted outside jit: every id, in full
    got = np.asarray(jax.jit(lambda k: k)(keys))
    assert K.to_uint64(got).tolist() == ids.astype(np.uint64).tolist()
