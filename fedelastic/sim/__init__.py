"""The round engine: the simulation's rules in pure Python/numpy (no torch, Flower or Ray).

* :mod:`~fedelastic.sim.clock`: every client's trip on one simulated timeline;
* :mod:`~fedelastic.sim.aggregate`: partial-aware averaging (and FedNova, FedBuff);
* :mod:`~fedelastic.sim.records`: the results schema (one client row, one round row);
* :mod:`~fedelastic.sim.columns`: the names of its columns that readers of the tables use;
* :mod:`~fedelastic.sim.policies`: the server policies (when a round closes, what each client is asked);
* :mod:`~fedelastic.sim.engine`: a round's plan and its settlement.

The Flower layer (:mod:`fedelastic.fl.server`) only encodes plans into messages and decodes replies.
"""
