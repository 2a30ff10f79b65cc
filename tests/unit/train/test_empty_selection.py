"""An importance selection that picks nothing says why, with the figures, also in the rounds it is carried.

Hand-built importances on a described model (torch only describes the model; the selection is numpy).
"""

from __future__ import annotations

import numpy as np
import torch

from fedelastic.cost.costmodel import CostModel
from fedelastic.data import load_digits_dataset
from fedelastic.devices.profile import get_profile
from fedelastic.modelinfo import describe
from fedelastic.models.small import small_cnn
from fedelastic.selection.strategy import CARRIED, SelectionContext, make_strategy
from fedelastic.train.trainer import LocalTraining, no_step_reason, train_local

OPTIONS = {"rho": 0.5, "interval": 8, "interval_unit": "steps"}


def setup():
    torch.manual_seed(0)
    model = small_cnn(width=8)
    info = describe(model, torch.zeros(1, 1, 8, 8), "small_cnn")
    cost = CostModel(info, get_profile("jetson_tx2"), 16)
    budget = cost.backward_budget_s(0.5) - cost.t_bwd_fixed
    dw, dx = cost.t_dw + cost.t_opt, cost.t_dx
    alone = np.array([dw[k] + dx[k + 1 :].sum() for k in range(info.num_tensors)])  # by hand: a tensor trained alone
    return model, info, cost, alone, alone <= budget


def fmt(seconds: float) -> str:
    """A time as the reasons print it: three significant figures, in us below 1 ms, else ms."""
    return f"{seconds * 1e6:.3g} us" if seconds < 1e-3 else f"{seconds * 1e3:.3g} ms"


def select(info, cost, importance):
    strategy = make_strategy("elastic_tensor", OPTIONS)
    ctx = SelectionContext(info, cost, 0, np.random.default_rng(0), importance=np.asarray(importance, float))
    return strategy, ctx, strategy.select(ctx)


def test_the_setup_affords_some_tensors_and_not_others():
    _, info, cost, alone, afford = setup()
    assert afford.any() and not afford.all()
    assert all(cost.peak_memory_bytes((np.arange(info.num_tensors) == k).astype(float)) < 1e9 for k in range(3))


def test_no_positive_importance_selects_nothing_and_says_why_with_figures():
    _, info, cost, alone, afford = setup()
    importance = -np.linspace(0.5, 0.1, info.num_tensors)  # every tensor's probe step raised the loss
    strategy, ctx, sel = select(info, cost, importance)
    budget = cost.backward_budget_s(0.5)
    assert not sel.mask.any() and ctx.note == ""  # something could train: not a device limit
    note = strategy.empty_note
    assert f"backward budget of {fmt(budget)}" in note and "'jetson_tx2'" in note
    assert (
        f"the {int(afford.sum())} it affords score {importance[afford].min():.3g} to {importance[afford].max():.3g}"
        in note
    )
    assert f"none of the {info.num_tensors} tensors scores above 0" in note and "raised the loss" in note
    reason = no_step_reason(strategy, ctx.note)
    assert reason.startswith("strategy ElasticTensor selected no tensor") and note in reason


def test_positive_importance_only_where_unaffordable_names_its_cost():
    _, info, cost, alone, afford = setup()
    importance = np.where(afford, -0.2, 0.0)
    deep = int(np.flatnonzero(~afford)[0])
    importance[deep] = 3.0  # the only positive tensor costs more than the budget alone
    strategy, _, sel = select(info, cost, importance)
    assert not sel.mask.any()
    cheapest = fmt(alone[deep] + cost.t_bwd_fixed)
    assert f"the 1 of positive importance (of {info.num_tensors}) cost at least {cheapest} alone" in strategy.empty_note
    importance[np.flatnonzero(afford)[-1]] = 0.1  # one affordable tensor worth training: it is selected, no note
    strategy, _, sel = select(info, cost, importance)
    assert sel.mask.sum() == 1 and strategy.empty_note == ""


def test_a_carried_empty_selection_keeps_its_reason_in_the_next_round():
    model, info, cost, _, _ = setup()
    first, _, sel = select(info, cost, -np.ones(info.num_tensors))
    first.carried, first.since = sel, 3  # as the trainer leaves it after 3 steps
    later = make_strategy("elastic_tensor", OPTIONS)
    later.load_state({k: np.array(v) for k, v in first.state().items()})
    assert later.carried is not None and later.empty_note == CARRIED + first.empty_note
    again = make_strategy("elastic_tensor", OPTIONS)
    again.load_state(later.state())
    assert again.empty_note == later.empty_note  # said once, however many rounds carry it
    data = load_digits_dataset()
    data = data.subset(np.arange(32))
    result = train_local(model, info, later, cost, data, LocalTraining(epochs=1, batch_size=16, lr=0.05, max_steps=2))
    assert result.fits and result.steps == 0 and result.probes == 0  # the interval (8 steps) is not due
    assert result.reason == f"strategy ElasticTensor selected no tensor to train on this device: {later.empty_note}"
    assert "backward budget of" in result.reason
