"""Vocab-parallel softmax cross-entropy for tied output heads.

`vocab_parallel_cross_entropy(hidden, table, labels)` is the softmax cross-entropy of the
logits `hidden @ table.T` against integer labels, computed without ever holding the logits
of the whole vocabulary on one device. Each device multiplies its tokens by its own rows of
the table (`[tokens, V/n]`, or `[tokens, chunk]` with `vocab_chunk_size`) and keeps four
numbers per token: the running max and the sum of exponentials below it (an online
log-sum-exp over the chunks), the label's logit and the sum of the logits (for label
smoothing; both linear in the rows, so computed from the rows without a logits block). One
`all_gather` of those `[n, 4, tokens]` statistics over the vocab axes lets every device
combine them into the log-sum-exp, where Megatron's form needs two collectives (a `pmax`,
then one all-reduce of the two sums); the statistics are a few bytes per token, so the
gather's extra bytes cost less than the second collective's latency.

The backward (`jax.custom_vjp`) recomputes each chunk of logits from the saved
log-sum-exp, so nothing `[tokens, chunk]`-sized lives between the passes; unchunked, it reuses
the forward's block of exponentials (the softmax is then one multiply, no second `exp`):

    dlogits      = g * ((1 + 2 z lse) softmax - targets)      per chunk, f32[T, C]
    hidden_grad  = psum_R(dlogits @ table_chunk)               f[T, H/K]
    table_grad   = psum_B(dlogits.T @ hidden)                  f[V/R, H/K], the table's layout

`dlogits` itself is never written: the softmax block enters both products, its per-token
factor applied to their `[T, H]` sides, and the targets' part is a gather of the labels' rows
(for `hidden_grad`), a scatter into them (for `table_grad`) and, with smoothing, a rank-1 term.

with R the mesh axes splitting the table's rows, K its hidden axis and B the tokens. The
layouts come from the rule `jaxembed.rules.cross_entropy`; `plan_cross_entropy` prints them.

With Gemma 2's `softcap=c` each chunk's logits become `c * tanh(z / c)` once whole (after
the psum over K), and the backward multiplies `dlogits` by `1 - tanh(z / c) ** 2`; the sum
of the capped logits (label smoothing's) is no longer linear in the rows, so it joins the
online statistics chunk by chunk. Per-token `weights` scale the per-token loss (a weighted
mean with `reduction="mean"`).

The metrics `argmax`, `top_k` and `accuracy` run in the same layouts and chunks
(`jaxembed.kernels.vocab_metrics`): each device keeps its best `k` per token, and one
`all_gather` of those `[R, tokens, k]` candidates over R decides; ties go to the lowest id.
"""

from jaxembed.kernels.cross_entropy import Reduction as Reduction
from jaxembed.kernels.cross_entropy import (
    vocab_parallel_cross_entropy as vocab_parallel_cross_entropy,
)
from jaxembed.kernels.vocab_metrics import accuracy as accuracy
from jaxembed.kernels.vocab_metrics import argmax as argmax
from jaxembed.kernels.vocab_metrics import top_k as top_k
from jaxembed.plan.cross_entropy import CrossEntropyPlan as CrossEntropyPlan
from jaxembed.plan.cross_entropy import plan_cross_entropy as plan_cross_entropy

__all__ = [
    "CrossEntropyPlan",
    "accuracy",
    "argmax",
    "plan_cross_entropy",
    "top_k",
    "vocab_parallel_cross_entropy",
]
