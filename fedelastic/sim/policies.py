"""Server policies: what each sampled client is asked to do, and when a round closes.

A policy is one class with a registered name (``server.policy``). The engine asks it

* :meth:`Policy.sample_size`: how many clients to sample for ``clients_per_round = k``;
* :meth:`Policy.assign`: a client's :class:`Assignment` (its rho and step cap) under the round's deadline;
* :meth:`Policy.close`: given every reply's trip, when the round ends and which updates count;
* :meth:`Policy.renormalises`: whether updates made with cut step counts are FedNova-normalised.

A deadline (``server.deadline`` or ``server.deadline_quantile``) is set by the scenario, where the
policy's :attr:`Policy.deadline` says whether it is refused, optional or required. Clients are
described by :class:`ClientTimes` (their full-training times), so a policy can be tested on a
hand-built fleet. ``async`` (FedBuff) uses the same protocol for its dispatches and runs the
engine's asynchronous loop instead of rounds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from ..errors import ConfigError
from ..plugins import Registry
from .clock import Trip, sync_round
from .deadline import deadline_rho, deadline_rho_steps, deadline_steps


class ClientTimes(Protocol):
    """A client's full-training figures, in simulated seconds, by partition id."""

    @property
    def steps(self) -> Sequence[int]: ...  # local steps of a full round


    def full_comm_s(self, pid: int) -> float: ...  # download + upload of the whole model
    def full_step_s(self, pid: int) -> float: ...  # one local step training every tensor
    def probe_s(self, pid: int) -> float: ...  # the round's importance probes


@dataclass(frozen=True)
class Assignment:
    """What a client is asked to do in a round: its rho (NaN: the strategy's own) and step cap (-1: none)."""

    rho: float = math.nan
    step_cap: int = -1


class Policy:
    """The default, ``wait_all``: every sampled client trains fully and the round waits for all of them."""

    name: ClassVar[str] = "wait_all"
    deadline: ClassVar[str] = "none"  # the scenario's deadline: "none" (refused), "optional" or "required"

    def __init__(self, server: Any = None):
        self.server = server  # the scenario's [server] table (None in tests: its defaults)

    def sample_size(self, k: int, n: int) -> int:
        return k

    def assign(self, pid: int, deadline_s: float | None, times: ClientTimes) -> Assignment:
        return Assignment()

    def close(self, trips: Sequence[Trip], start_s: float, deadline_s: float | None, k: int) -> tuple[float, dict]:
        """End of the round and each trip's status (see :func:`~fedelastic.sim.clock.sync_round`)."""
        return sync_round(trips, start_s, deadline_s if self.deadline != "none" else None)

    def renormalises(self) -> bool:
        """Whether the clients' step counts may differ by the policy's doing (FedNova, ``server.fednova``)."""
        return False


POLICIES = Registry("policies", where="<register_policy>")


def register_policy(cls: type[Policy]) -> type[Policy]:
    """Class decorator (``fedelastic.register_policy``): make ``cls`` available as ``server.policy = cls.name``.

    ``cls`` subclasses :class:`Policy` and sets its own ``name`` and a known ``deadline``.
    Registering the same class again (a re-run notebook cell) is harmless; a name another class has
    is a ConfigError, as is anything else.
    """
    def check(cls: type[Policy]) -> None:
        if cls.deadline not in DEADLINES:
            raise ConfigError(POLICIES.where, f"{cls.__name__}.deadline", f"one of {DEADLINES}", cls.deadline)

    POLICIES.add_class(cls, Policy, key="server.policy", check=check)
    return cls


register = register_policy  # its earlier name
DEADLINES = ("none", "optional", "required")  # what Policy.deadline may be
register(Policy)


@register
class DeadlineDrop(Policy):
    """Every client trains fully; updates arriving after the deadline are dropped."""

    name = "deadline_drop"
    deadline = "required"


@register
class DeadlineFewerSteps(DeadlineDrop):
    """Each client runs as many full steps as fit in the deadline (FedNova renormalises them)."""

    name = "deadline_fewer_steps"

    def assign(self, pid: int, deadline_s: float | None, times: ClientTimes) -> Assignment:
        assert deadline_s is not None
        return Assignment(
            step_cap=deadline_steps(deadline_s, times.full_comm_s(pid), times.full_step_s(pid), times.steps[pid])
        )

    def renormalises(self) -> bool:
        return True


@register
class DeadlineElastic(DeadlineDrop):
    """Each client trains the share ``rho`` of the model that lets it finish by the deadline;
    below ``server.min_rho`` it trains that share with fewer steps."""

    name = "deadline_elastic"

    @property
    def min_rho(self) -> float:
        return float(getattr(self.server, "min_rho", 0.0))

    def assign(self, pid: int, deadline_s: float | None, times: ClientTimes) -> Assignment:
        assert deadline_s is not None
        comm, steps, step, probe = times.full_comm_s(pid), times.steps[pid], times.full_step_s(pid), times.probe_s(pid)
        if self.min_rho > 0:
            rho, cut = deadline_rho_steps(deadline_s, comm, steps, step, probe, self.min_rho)
            return Assignment(rho, cut if cut < steps else -1)
        return Assignment(deadline_rho(deadline_s, comm, steps, step, probe))

    def renormalises(self) -> bool:
        return self.min_rho > 0


@register
class Overcommit(Policy):
    """Sample ``server.overcommit`` x k clients; the round closes at the k-th counted arrival (or a deadline)."""

    name = "overcommit"
    deadline = "optional"

    def sample_size(self, k: int, n: int) -> int:
        return min(n, math.ceil(k * float(getattr(self.server, "overcommit", 1.3))))

    def close(self, trips: Sequence[Trip], start_s: float, deadline_s: float | None, k: int) -> tuple[float, dict]:
        return sync_round(trips, start_s, deadline_s, k)


@register
class Async(Policy):
    """FedBuff: up to ``server.concurrency`` clients in flight, an aggregation every ``server.buffer_size``
    arrivals, each update discounted by its staleness. Dispatches are full-training ones."""

    name = "async"

    def concurrency(self, k: int, n: int) -> int:
        return int(getattr(self.server, "concurrency", 0)) or k or n

    def buffer_size(self, concurrency: int) -> int:
        return int(getattr(self.server, "buffer_size", 0)) or max(1, concurrency // 2)

    def discount(self) -> Callable[[int], float]:
        from .clock import staleness_weight

        return (
            staleness_weight if getattr(self.server, "staleness", "inverse_sqrt") == "inverse_sqrt" else lambda s: 1.0
        )


def make_policy(server: Any) -> Policy:
    """The policy named by ``server.policy``."""
    return POLICIES[server.policy](server)
