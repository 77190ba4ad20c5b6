"""The weight-gathering move (FSDP's), priced beside the moves of activations or logits.

A plan whose table splits its hidden axis over mesh axes G that also split the work's batch
(FSDP: the table's hidden axis and the tokens both over the data-parallel axis) may either
move the small operands (ids, activations, logits) and keep the table where it is (`"none"`),
or all-gather the table's shard over G for the step and reduce-scatter its gradient back
over G (`"gather"`). Both the lookup's plan (`jaxembed.plan.lookup`) and the loss's
(`jaxembed.plan.cross_entropy`) price every candidate in ring-model wire bytes and peak
memory and take the one these helpers choose:

* `check_table_move`: the option's values;
* `choose_move`: the requested move, or the one with the fewest bytes (ties: less memory),
  and the reason the plan prints;
* `format_mib`: bytes in MiB, as the reasons print them.

Examples:
  >>> move, why, priced = choose_move("auto", {"none": (3 * 2**20, 10), "gather": (2**21, 20)}, "")
  >>> move, why
  ('gather', "fewest bytes: 2.00 MiB against 3.00 MiB for 'none'")
  >>> priced
  (('none', 3145728.0, 10), ('gather', 2097152.0, 20))
  >>> choose_move("auto", {"none": (1.0, 0)}, "the table's hidden axis is not split")[1]
  "the only move: no weight gather (the table's hidden axis is not split)"
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["TABLE_MOVES", "check_table_move", "choose_move", "format_mib"]

TABLE_MOVES = ("auto", "gather", "none")


def check_table_move(table_move: str) -> str:
    """`table_move` when it is `"auto"`, `"gather"` or `"none"`.

    Raises:
      ValueError: any other value (the message names it).
    """
    if table_move not in TABLE_MOVES:
        raise ValueError(f"table_move must be 'auto', 'gather' or 'none', got {table_move!r}")
    return table_move


def choose_move(
    table_move: str, costs: Mapping[str, tuple[float, int]], refused: str
) -> tuple[str, str, tuple[tuple[str, float, int], ...]]:
    """The move a plan takes, why, and every move priced.

    Args:
      table_move: `"auto"`, or the move asked for (it must be a key of `costs`).
      costs: `{move: (wire bytes per device and step, peak bytes per device)}` of every move
        that applies, `"none"` first.
      refused: why the weight gather does not apply (printed when only one move does).

    Returns:
      `(move, reason, alternatives)`, `alternatives` as `((move, wire, peak), ...)`.
    """
    pick = table_move if table_move != "auto" else min(costs, key=lambda m: costs[m])
    alternatives = tuple((m, float(w), int(p)) for m, (w, p) in costs.items())
    if table_move != "auto":
        return pick, f"table_move={table_move!r} given", alternatives
    if len(costs) == 1:
        return pick, f"the only move: no weight gather ({refused})", alternatives
    other = min((m for m in costs if m != pick), key=lambda m: costs[m])
    why = (
        f"fewest bytes: {format_mib(costs[pick][0])} against {format_mib(costs[other][0])} "
        f"for {other!r}"
    )
    return pick, why, alternatives


def format_mib(n: float) -> str:
    """Bytes in MiB, two decimals: `1.50 MiB`."""
    return f"{n / 2**20:.2f} MiB"
