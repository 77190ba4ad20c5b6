"""Plans: what runs where, with every collective and its bytes, and the cost model.

* `plan_embedding` / `plan_embedding_bag` (`jaxembed.plan.lookup`): the plan of one lookup.
* `jaxembed.plan.moves`: how small operands change layout inside a kernel.
* `jaxembed.plan.cost`: the ring byte model and the time model with per-backend constants.
"""

from jaxembed.plan.cost import ring_wire_bytes as ring_wire_bytes
from jaxembed.plan.format import format_bytes as format_bytes
from jaxembed.plan.format import format_plan as format_plan
from jaxembed.plan.lookup import Exchange as Exchange
from jaxembed.plan.lookup import plan_embedding as plan_embedding
from jaxembed.plan.lookup import plan_embedding_bag as plan_embedding_bag
from jaxembed.plan.types import BagGeometry as BagGeometry
from jaxembed.plan.types import Collective as Collective
from jaxembed.plan.types import EmbeddingPlan as EmbeddingPlan
from jaxembed.plan.types import ExchangeCandidate as ExchangeCandidate
from jaxembed.plan.types import MemoryEstimate as MemoryEstimate

GradientExchange = Exchange  # round 1's name

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
