"""Client-rounds that trained nothing, per device: how many, and why.

A client-round *trained nothing* when it ran no training step: its strategy selected no tensor
(e.g. rho leaves a backward budget below the cheapest tensor's), it did not fit in memory, a
deadline left it no time, or it failed. A device that trains nothing contributes no update, so a
run's figures are then those of the rest of the fleet; every summary says so per device
(:func:`by_device`), and a comparison flags a device that idled in more than
:data:`IDLE_OVER` of its client-rounds (:func:`flagged`).
"""

from __future__ import annotations

import pandas as pd

from ..sim.columns import ClientCol as C

IDLE_OVER = 0.5  # a device idle in more than this share of its client-rounds is flagged

# why a client-round trained nothing, by its row's status (its own reason text first, where it has one)
_BY_STATUS = {
    "too_slow": "the round's deadline left no time for a forward pass",
    "not_fitting": "did not fit in memory",
    "failed": "failed",
}


def percent(share: float) -> str:
    """A share as a whole percentage; one above 0 never reads 0% (``<1%``), one below 1 never 100% (``>99%``)."""
    if 0 < share < 0.005:
        return "<1%"
    return ">99%" if 0.995 <= share < 1 else f"{share:.0%}"


def trained_nothing(clients: pd.DataFrame) -> pd.Series:
    """Per client row: whether it ran no training step (0 steps, or none recorded: a failed client)."""
    if C.STEPS not in clients:
        return pd.Series(False, index=clients.index)
    return clients[C.STEPS].fillna(0).astype(float) == 0


def _reason(row: pd.Series) -> str:
    status = str(row.get(C.STATUS, "") or "")
    own = row.get(C.ERROR) if status == "failed" else row.get(C.FITS_REASON)
    own = own if isinstance(own, str) and own else ""
    head = _BY_STATUS.get(status, "")
    if head and own:
        return f"{head}: {own}"
    return head or own or "0 steps"


def by_device(clients: pd.DataFrame) -> pd.DataFrame:
    """Per device (sorted by name): ``client_rounds``, ``trained_nothing`` (how many of them ran no
    step), ``share`` of them, and ``why`` (the most frequent reason, with how many others there were)."""
    columns = ["client_rounds", "trained_nothing", "share", "why"]
    if not len(clients) or C.DEVICE not in clients:
        return pd.DataFrame(columns=columns)
    idle = trained_nothing(clients)
    rows = {}
    for device, g in clients.groupby(C.DEVICE, sort=True):
        mask = idle.loc[g.index]
        reasons = g[mask].apply(_reason, axis=1).value_counts() if mask.any() else pd.Series(dtype=int)
        why = str(reasons.index[0]) if len(reasons) else ""
        if len(reasons) > 1:
            why += f" (and {len(reasons) - 1} other reason{'s' if len(reasons) > 2 else ''})"
        rows[device] = {"client_rounds": len(g), "trained_nothing": int(mask.sum()), "why": why}
    out = pd.DataFrame.from_dict(rows, orient="index")
    out["share"] = out.trained_nothing / out.client_rounds
    return out[columns]


def lines(table: pd.DataFrame) -> dict[str, str]:
    """Device -> one line, for each device of :func:`by_device` that trained nothing in some client-round."""
    return {
        str(device): f"{device} trained nothing in {r.trained_nothing} of {r.client_rounds} client-rounds "
        f"({percent(r.share)}): {r.why}"
        for device, r in table.iterrows()
        if r.trained_nothing
    }


def flagged(table: pd.DataFrame) -> list[str]:
    """The devices of :func:`by_device` that trained nothing in more than :data:`IDLE_OVER` of their client-rounds."""
    return [str(d) for d, share in table["share"].items() if share > IDLE_OVER]


# ---- a comparison: per (fleet, strategy), over its seeds ------------------------------------------


def per_cell(runs: pd.DataFrame) -> pd.DataFrame:
    """Per (fleet, strategy), from ``runs`` (one row per run and device: ``fleet``, ``strategy``,
    ``device`` and :func:`by_device`'s columns), over every seed that left a clients table, whatever
    its status: ``trained_nothing`` (each device's share of client-rounds that trained nothing,
    ``"jetson_nano 0%, jetson_tx2 100%"``), ``trained_nothing_why`` (why, for each device with a
    share above 0) and ``idle_devices`` (the devices above :data:`IDLE_OVER`; "" if none)."""
    out = []
    for (fleet, strategy), g in runs.groupby(["fleet", "strategy"], sort=False):
        pooled = g.groupby("device", sort=True).agg(
            client_rounds=("client_rounds", "sum"), trained_nothing=("trained_nothing", "sum")
        )
        pooled["share"] = pooled.trained_nothing / pooled.client_rounds
        why = {d: next((w for w in g[g.device == d].why if isinstance(w, str) and w), "") for d in pooled.index}
        out.append(
            {
                "fleet": fleet,
                "strategy": strategy,
                "trained_nothing": ", ".join(f"{d} {percent(s)}" for d, s in pooled.share.items()),
                "trained_nothing_why": "; ".join(f"{d}: {why[d]}" for d in pooled.index[pooled.trained_nothing > 0]),
                "idle_devices": ", ".join(flagged(pooled)),
            }
        )
    return pd.DataFrame(out, columns=["fleet", "strategy", "trained_nothing", "trained_nothing_why", "idle_devices"])


def text(column: pd.Series) -> pd.Series:
    """A text column read back from CSV, "" where empty (an all-empty one reads back as float NaN)."""
    return column.astype(object).where(column.notna(), "")


def verdicts(table: pd.DataFrame) -> list[str]:
    """One line per cell of a comparison's ``summary_by_strategy`` table that has idle devices:
    which devices trained nothing in most client-rounds, and that its figures are the other devices'."""
    if "idle_devices" not in table:
        return []
    out = []
    for row in table[text(table.idle_devices) != ""].itertuples():
        out.append(
            f"{row.fleet} / {row.strategy}: {row.idle_devices} trained nothing in more than half of its "
            f"client-rounds ({row.trained_nothing}); the cell's figures are the rest of the fleet's "
            f"(why: {row.trained_nothing_why})"
        )
    return out
