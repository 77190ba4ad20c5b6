"""Sharding rules: an einsum-notation propagation engine and the embedding rules on it.

Pure Python; importable without jax.
"""

from jaxembed.rules.bag import embedding_bag_forward as embedding_bag_forward
from jaxembed.rules.bag import embedding_bag_grad as embedding_bag_grad
from jaxembed.rules.cross_entropy import cross_entropy_forward as cross_entropy_forward
from jaxembed.rules.cross_entropy import cross_entropy_grad as cross_entropy_grad
from jaxembed.rules.embedding import embedding_forward as embedding_forward
from jaxembed.rules.embedding import embedding_grad as embedding_grad
from jaxembed.rules.embedding import embedding_reverse as embedding_reverse
from jaxembed.rules.embedding import ids_letters as ids_letters
from jaxembed.rules.engine import DistSpec as DistSpec
from jaxembed.rules.engine import ShardingConflictError as ShardingConflictError
from jaxembed.rules.engine import SpmdInfo as SpmdInfo
from jaxembed.rules.engine import dims_mapping_for as dims_mapping_for
from jaxembed.rules.engine import einsum_rule as einsum_rule
from jaxembed.rules.engine import merge_letters as merge_letters
from jaxembed.rules.engine import partial_dims_for as partial_dims_for

__all__ = [
    "DistSpec",
    "ShardingConflictError",
    "SpmdInfo",
    "cross_entropy_forward",
    "cross_entropy_grad",
    "dims_mapping_for",
    "einsum_rule",
    "embedding_bag_forward",
    "embedding_bag_grad",
    "embedding_forward",
    "embedding_grad",
    "embedding_reverse",
    "ids_letters",
    "merge_letters",
    "partial_dims_for",
]
