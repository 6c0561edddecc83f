"""The members aside in a heal step (Quorum.aside: a healing group and its source): out of the
step's FTAR, so neither can stall it, they take its average from rank k of the exchange's first
member, which offers it on its heal server with [contributors, failed, quorum id]."""

from collections.abc import Callable

import torch

from ftcore import timeouts
from ftcore.ftar import FTARResult
from ftcore.heal import HealError, HealServer, fetch
from ftcore.messages import Quorum


def offer_average(
    server: HealServer,
    group: int,
    quorums: tuple[Quorum, Quorum],
    tensors: list[torch.Tensor],
    res: FTARResult | None,
    step: int,
) -> None:
    """As the exchange's first member of either quorum (the one the step began in, or the
    survivors' it re-ran in), offer the step's average (`res`: None or a peer error, the exchange
    failed); an aside member takes it only for its own quorum. Otherwise withdraw the last one."""
    first, final = quorums
    if not any(x.aside() and x.exchange()[0] == group for x in (first, final)):
        server.withdraw("update")  # the last one offered (a copy of the gradients) is done
        return
    n = res.contributors if res is not None and not res.peer_error else -1  # -1: the exchange failed
    meta = torch.tensor([max(n, 0), int(n < 0), final.quorum_id], dtype=torch.int64)
    server.offer(step, {"average": list(tensors) if n >= 0 else [], "meta": meta}, kind="update")


def take_average(
    tensors: list[torch.Tensor], q: Quorum, step: int, token: str | None, abort: Callable[[], bool] | None = None
) -> int:
    """An aside member's exchange: the step's average into `tensors`, fetched from rank k of
    the exchange's first member (bounded as FTAR is, and given up once `abort()`: that member
    was failed); returns its contributors. HealError (the step fails, not theirs) when it
    cannot be had or does not fit."""
    try:
        tree = fetch(q.update_from, step, token, timeouts.COLLECTIVE_TIMEOUT, kind="update", abort=abort)
        average, (n, failed, qid) = tree["average"], tree["meta"].tolist()
    except (KeyError, TypeError, ValueError) as e:
        raise HealError(str(e)) from None
    if failed or qid != q.quorum_id:
        raise HealError(f"the exchange of step {step} in quorum {q.quorum_id} did not complete")
    if [(a.shape, a.dtype) for a in average] != [(x.shape, x.dtype) for x in tensors]:
        raise HealError("the average does not match this group's gradients")
    for x, a in zip(tensors, average, strict=True):
        x.copy_(a)
    return int(n)
