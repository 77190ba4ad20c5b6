"""Inputs shared by the Flax module tests (NNX and Linen): ids, a query and cotangents."""

import numpy as np

V, H = 64, 16
IDS_SHAPE = (8, 8)


def make_data(seed=0, vocab=V):
    """ids, an `attend` query, and cotangents for the lookup's output and for the logits."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, IDS_SHAPE).astype(np.int32)
    query = rng.normal(size=(*IDS_SHAPE, H)).astype(np.float32)
    ct_out = rng.normal(size=(*IDS_SHAPE, H)).astype(np.float32)
    ct_logits = rng.normal(size=(*IDS_SHAPE, vocab)).astype(np.float32)
    return ids, query, ct_out, ct_logits
