"""Plans: what runs where, with every collective and its bytes, and the cost model.

* `plan_embedding` / `plan_embedding_bag` (`jaxembed.plan.lookup`): the plan of one lookup.
* `jaxembed.plan.moves`: how small operands change layout inside a kernel.
* `jaxembed.plan.cost`: the ring byte model and the time model with per-backend constants.
* `jaxembed.plan.collection`: the collection planner; `jaxembed.plan.cross_entropy`: the
  vocab-parallel loss's plan.
* `jaxembed.plan.table_moves`: the weight gather's choice, shared by the lookup's and the
  loss's plans.

Inside, each module imports only those below it: `types` (the plans' data), `specs` (mesh
and spec helpers), `moves`, `cost`, `table_moves`; `layouts`; `exchange`, `routed`; `lookup`; the
collection planner; `format` (every formatter), which only this face imports: it makes the
formatters the plans' `str()`.
"""

from jaxembed.plan import format as _format
from jaxembed.plan.collection import CollectionPlan as _CollectionPlan
from jaxembed.plan.cost import ring_wire_bytes as ring_wire_bytes
from jaxembed.plan.cross_entropy import CrossEntropyPlan as _CrossEntropyPlan
from jaxembed.plan.format import format_bytes as format_bytes
from jaxembed.plan.format import format_plan as format_plan
from jaxembed.plan.idstats import IdStats as _IdStats
from jaxembed.plan.lookup import Exchange as Exchange
from jaxembed.plan.lookup import plan_embedding as plan_embedding
from jaxembed.plan.lookup import plan_embedding_bag as plan_embedding_bag
from jaxembed.plan.types import BagGeometry as BagGeometry
from jaxembed.plan.types import Collective as Collective
from jaxembed.plan.types import EmbeddingPlan as EmbeddingPlan
from jaxembed.plan.types import ExchangeCandidate as ExchangeCandidate
from jaxembed.plan.types import MemoryEstimate as MemoryEstimate

GradientExchange = Exchange  # the old name

# `str(plan)` prints a plan's table. The plans' modules sit below the formatters (which
# import them), so the face attaches them, once, before any plan can be printed.
EmbeddingPlan.__str__ = _format.format_plan  # type: ignore[method-assign]
_CollectionPlan.__str__ = _format.format_collection_plan  # type: ignore[method-assign]
_CrossEntropyPlan.__str__ = _format.format_cross_entropy_plan  # type: ignore[method-assign]
_IdStats.__str__ = _format.format_id_stats  # type: ignore[method-assign]

__all__ = [
    "BagGeometry",
    "Collective",
    "EmbeddingPlan",
    "Exchange",
    "ExchangeCandidate",
    "GradientExchange",
    "MemoryEstimate",
    "format_bytes",
    "format_plan",
    "plan_embedding",
    "plan_embedding_bag",
    "ring_wire_bytes",
]
