"""Partial-aware federated averaging, pure numpy.

Each client sends only the tensors it trained, plus a 0/1 mask for the tensors it trained only
in part: 1-D over output channels (dim 0), or any array that broadcasts to the tensor (e.g.
``(1, C_in, 1, 1)`` for a conv trained on some input channels). Every element is averaged, weighted by number of examples,
over the clients that trained it; an element that no client trained keeps its global value.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class ClientUpdate:
    weight: float  # number of examples
    arrays: Mapping[str, np.ndarray]
    channel_masks: Mapping[str, np.ndarray] = field(default_factory=dict)


def _value_and_weight(upd: ClientUpdate, name: str, current: np.ndarray) -> tuple[np.ndarray, np.ndarray | float]:
    """Client ``upd``'s value of tensor ``name`` and its per-element weight (examples x channel mask).

    Without a mask the weight is one number: the same products and sums, element by element, as
    an array filled with it, without making that array.
    """
    value = np.asarray(upd.arrays[name], dtype=np.float64)
    if value.shape != current.shape:
        raise ValueError(f"tensor {name!r}: update shape {value.shape} != global {current.shape}")
    if name not in upd.channel_masks:
        return value, float(upd.weight)
    w = np.full(current.shape, float(upd.weight))
    mask = np.asarray(upd.channel_masks[name], dtype=np.float64)
    if mask.ndim == 1:
        mask = mask.reshape((-1,) + (1,) * (current.ndim - 1))
    return value, w * np.broadcast_to(mask, current.shape)


_STACKED_MAX = 1 << 20  # elements of one tensor's stacked updates that :func:`_unmasked_sums` holds (8 MB)


def _unmasked_sums(name: str, current: np.ndarray, having: list[ClientUpdate]) -> tuple[np.ndarray, float] | None:
    """(sum of weight x value, sum of weights) of tensor ``name`` over ``having``, none of which masks it.

    The per-update loop of :func:`aggregate_partial` in a few numpy calls (not three calls
    per update and tensor): the same float64 products, added in the same order from a row of
    0.0. A sum over the first axis of a C-ordered array is not along the fast axis in memory,
    where numpy adds each row in turn (its documented rule for ``np.add.reduce``; pairwise
    summation is only used along the fast axis, hence not for a tensor of one element).
    tests/unit/fl/test_client_fast_paths.py checks it against per-element Python sums, with values whose
    sum depends on the order. None where the loop should run instead: one element, a shape that
    differs (the loop names it) or more than ``_STACKED_MAX`` elements (memory stays flat).
    """
    size = current.size * (len(having) + 1)
    if current.size < 2 or size > _STACKED_MAX or any(np.shape(u.arrays[name]) != current.shape for u in having):
        return None
    rows = np.empty((len(having) + 1, *current.shape))
    rows[0] = 0.0
    for i, upd in enumerate(having, 1):
        rows[i] = upd.arrays[name]  # cast to float64 on the copy, as np.asarray(value, float64)
    weights = [float(u.weight) for u in having]
    den = 0.0
    for w in weights:  # added in order, as the loop does
        den += w
    rows[1:] *= np.array(weights).reshape((-1,) + (1,) * current.ndim)
    return np.add.reduce(rows, axis=0), den


def aggregate_partial(global_state: Mapping[str, np.ndarray], updates: Sequence[ClientUpdate]) -> dict[str, np.ndarray]:
    """New global state: per element, the weighted mean over the clients that trained it."""
    new_state = {}
    for name, current in global_state.items():
        having = [u for u in updates if name in u.arrays]
        sums = None if any(name in u.channel_masks for u in having) else _unmasked_sums(name, current, having)
        den: np.ndarray | float
        if sums is not None:
            num, den = sums
        else:
            num, den = np.zeros(current.shape, dtype=np.float64), 0.0
            # while no update of this tensor has a mask, every element's weight sum is the same: one float,
            # the same float64 additions in the same order as the array's (filled when a mask comes)
            for upd in having:
                value, w = _value_and_weight(upd, name, current)
                num += w * value
                if isinstance(den, float) and not isinstance(w, float):
                    den = np.full(current.shape, den)
                den += w
        if isinstance(den, float):  # dividing by a float divides each element by it, as by an array of it
            merged = np.asarray(num / den) if den > 0 else np.array(current, dtype=np.float64)  # a 0-d array stays one
        else:
            trained = den > 0
            merged = np.where(trained, num / np.where(trained, den, 1.0), current)
        new_state[name] = merged.astype(current.dtype, copy=False)
    return new_state


def fednova_rescale(
    global_state: Mapping[str, np.ndarray], updates: Sequence[ClientUpdate], steps: Sequence[int], names: set[str]
) -> list[ClientUpdate]:
    """FedNova's normalisation of updates made with different numbers of local steps.

    Client i's change of each tensor in ``names`` is divided by its steps ``tau_i`` and scaled by
    ``tau_eff = sum_i p_i tau_i`` (``p_i``: its share of examples), so that averaging the returned
    updates with :func:`aggregate_partial` gives ``x + tau_eff * sum_i p_i (x_i - x) / tau_i``
    (Wang et al., NeurIPS 2020, with plain local SGD). Other arrays (norm statistics) pass unchanged.
    """
    total = sum(u.weight for u in updates)
    if not updates or total <= 0:
        return list(updates)
    tau_eff = sum(u.weight / total * t for u, t in zip(updates, steps))
    out = []
    for upd, tau in zip(updates, steps):
        arrays = {}
        for name, value in upd.arrays.items():
            if name in names and tau > 0:
                base = np.asarray(global_state[name], dtype=np.float64)
                scaled = base + (np.asarray(value, dtype=np.float64) - base) * (tau_eff / tau)
                arrays[name] = scaled.astype(np.asarray(value).dtype, copy=False)
            else:
                arrays[name] = value
        out.append(ClientUpdate(upd.weight, arrays, upd.channel_masks))
    return out


def aggregate_buffered(
    global_state: Mapping[str, np.ndarray],
    updates: Sequence[ClientUpdate],
    bases: Sequence[Mapping[str, np.ndarray]],
    discounts: Sequence[float],
) -> dict[str, np.ndarray]:
    """FedBuff's step from a buffer of possibly stale partial updates.

    Update i was trained from ``bases[i]`` (the global state it downloaded). Per element,
    ``x + sum_i d_i w_i m_i (x_i - base_i) / sum_i w_i m_i``: the example-weighted mean change
    over the clients that trained the element, each change discounted by ``d_i`` (its staleness
    weight). Fresh updates (all ``d_i = 1``, bases equal to ``x``) give :func:`aggregate_partial`.
    """
    new_state = {}
    for name, current in global_state.items():
        num = np.zeros(current.shape, dtype=np.float64)
        den = np.zeros(current.shape, dtype=np.float64)
        for upd, base, discount in zip(updates, bases, discounts):
            if name not in upd.arrays:
                continue
            value, w = _value_and_weight(upd, name, current)
            num += discount * w * (value - np.asarray(base[name], dtype=np.float64))
            den += w
        trained = den > 0
        merged = np.asarray(current, dtype=np.float64) + np.where(trained, num / np.where(trained, den, 1.0), 0.0)
        new_state[name] = merged.astype(current.dtype, copy=False)
    return new_state
