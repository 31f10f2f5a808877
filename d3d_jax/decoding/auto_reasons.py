"""Why auto ran each row of a round as it did: the reasons ``/metrics`` and ``--json`` count.

A row in a round either speculated (a part of width > 1) or ran plain; the reason says which
decision put it there, so a mixed load shows whether its plain rounds came from the rows
themselves or from the batch around them:

* ``gain``: the row speculated, its expected tokens paying for the round (the policy's plan).
* ``explore``: the row speculated in an exploring round (speculation tried after many plain rounds
  in a row, so that a pessimistic estimate cannot keep a batch plain for good).
* ``batch``: the plan ran the whole batch in one geometry and the row went along (plain rows in
  a speculative round, or speculative-class rows in a round priced cheaper plain).
* ``gate``: an all-plain round the gate ran (speculation delivered less per wall second here).
* ``acceptance``: set aside for plain rounds by its own speculative rounds' acceptance.
* ``prompt``: set aside by its prompt score, before speculative rounds of its own.
* ``grammar``: a constrained request in plain rounds, by the grammar pool's acceptance.
"""

from __future__ import annotations

import collections

REASONS = ("gain", "explore", "batch", "gate", "acceptance", "prompt", "grammar")


def row_reason(info, speculative: bool, gated: bool, min_rounds: int, explore: bool = False) -> str:
    """The reason of one row (``info``: its SlotInfo) in a part that speculates or not, of a
    round the gate ran all-plain (``gated``) or not, an exploring round (``explore``) or not."""
    if gated:
        return "gate"
    aside = info.stats.get("class", 0) == 1
    if speculative:
        return "explore" if explore else "batch" if aside else "gain"
    if not aside:
        return "batch"
    acc = info.stats.get("acceptance")
    if getattr(info.request, "grammar", None) is not None and (acc is None or acc.rounds < min_rounds):
        return "grammar"
    return "prompt" if acc is None or acc.rounds < min_rounds else "acceptance"


def part_reasons(infos: list, lo: int, hi: int, speculative: bool, gated: bool, min_rounds: int,
                 explore: bool = False) -> tuple:
    """Each row's reason in a part over placement rows ``lo … hi-1``."""
    return tuple(row_reason(infos[r], speculative, gated, min_rounds, explore) for r in range(lo, hi))


def count(part, snapshot) -> None:
    """Each row's reason into its request's tally (``stats["reasons"]``, read by slot metrics)."""
    for row, reason in zip(range(part.lo, part.hi), part.row_reasons):
        info = snapshot[row][1]
        if info is not None:
            info.stats.setdefault("reasons", collections.Counter())[reason] += 1
