"""Deprecated: the first home of `embedding`; the kernels now live in `jaxembed.kernels`.

A face only, kept so that `from jaxembed.ops import embedding` goes on working: use
`jaxembed.embedding` (or `jaxembed.kernels.lookup`). Nothing inside the package imports it.
"""

from jaxembed.kernels.arrays import is_explicit as is_explicit
from jaxembed.kernels.arrays import move as move
from jaxembed.kernels.arrays import normalize_spec as normalize_spec
from jaxembed.kernels.arrays import resolve_mesh as resolve_mesh
from jaxembed.kernels.arrays import spec_of as spec_of
from jaxembed.kernels.arrays import warn_if_layout_unknown as warn_if_layout_unknown
from jaxembed.kernels.lookup import check_ids as check_ids
from jaxembed.kernels.lookup import embedding as embedding

__all__ = ["check_ids", "embedding", "resolve_mesh", "spec_of"]
