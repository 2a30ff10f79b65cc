"""The ElasticTrainer accuracy script's shift parsing and norm recalibration, against hand computations."""

import importlib.util

import numpy as np
import pytest
import torch

from fedelastic.data.shifts import Shift
from tests.support import ROOT

SCRIPT = ROOT / "benchmarks" / "reproduce" / "elastictrainer_accuracy" / "run.py"


@pytest.fixture(scope="module")
def run():
    spec = importlib.util.spec_from_file_location("elastictrainer_accuracy_run", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shift_text_parses_to_the_named_fields(run):
    assert run.parse_shift("rotation=90") == (Shift(rotation=90.0), 0)
    assert run.parse_shift("blur=1.5,noise=0.1") == (Shift(blur=1.5, noise=0.1), 0)
    assert run.parse_shift("clean")[0].is_identity
    assert run.parse_shift("labels=1") == (Shift(), 1)
    assert run.shift_label("rotation=90,labels=3") == "rotation=90,labels+3"
    with pytest.raises(SystemExit, match="rotate"):  # a field that does not exist names the ones that do
        run.parse_shift("rotate=90")
    with pytest.raises(SystemExit, match="FIELD=NUMBER"):
        run.parse_shift("blur")


def test_a_label_offset_relabels_every_target_split_and_keeps_the_images(run):
    x = np.random.default_rng(0).random((10, 3, 4, 4)).astype(np.float32)
    y = np.arange(10)
    d = {
        "src_x": x,
        "src_y": y,
        "tr_x": x[:4],
        "tr_y": y[:4],
        "va_x": x[4:6],
        "va_y": y[4:6],
        "te_x": x[6:],
        "te_y": y[6:],
    }
    out = run.shifted(d, "labels=1")
    assert (
        out["tr_y"].tolist() == [1, 2, 3, 4] and out["va_y"].tolist() == [5, 6] and out["te_y"].tolist() == [7, 8, 9, 0]
    )
    np.testing.assert_array_equal(out["te_x"], x[6:])
    assert out["src_y"] is y  # the source is untouched


def test_recalibrated_norm_statistics_are_the_exact_average_over_the_data(run):
    torch.manual_seed(0)
    model, _ = run.build("mcu_net", {"width": 4})
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x = np.random.default_rng(0).random((600, 3, 32, 32)).astype(np.float32)
    fresh = run.recalibrate_norms("mcu_net", {"width": 4}, state, x, "cpu")
    # the first norm follows the first conv: its statistics are that conv's output moments, by hand
    with torch.no_grad():
        z = torch.nn.functional.conv2d(torch.from_numpy(x), state["0.weight"], padding=1).double()
    # three batches of 250, 250, 100 averaged with equal weight (PyTorch's cumulative average), each batch's
    # variance unbiased over its own N x H x W values
    parts = [z[i : i + 250] for i in range(0, 600, 250)]
    mean = sum(p.mean((0, 2, 3)) for p in parts) / 3
    var = sum(p.var((0, 2, 3), unbiased=True) for p in parts) / 3
    torch.testing.assert_close(fresh["1.running_mean"].double(), mean, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fresh["1.running_var"].double(), var, rtol=1e-4, atol=1e-5)
    # weights are untouched, and the statistics moved from their initial 0 / 1
    torch.testing.assert_close(fresh["0.weight"], state["0.weight"])
    assert not torch.allclose(state["1.running_mean"], fresh["1.running_mean"])


def test_folding_the_norms_into_the_convs_keeps_the_function(run):
    torch.manual_seed(0)
    model, _ = run.build("mcu_net", {"width": 4})
    state = {k: v.clone() for k, v in model.state_dict().items()}  # not views: loading writes into those
    for key in state:  # every norm's statistics and affine parameters far from the identity
        if key.endswith(("running_mean", "bias", "weight")) and state[key].dim() == 1 and "running" not in key:
            state[key] = torch.randn_like(state[key])
        if key.endswith("running_mean"):
            state[key] = torch.randn_like(state[key])
        if key.endswith("running_var"):
            state[key] = torch.rand_like(state[key]) + 0.1
    state["1.running_var"][0] = 1e-12  # a dead channel, as recalibration finds them
    x = torch.from_numpy(np.random.default_rng(1).random((8, 3, 32, 32)).astype(np.float32))
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        want = model(x)
    folded = run.fold_norms("mcu_net", {"width": 4}, state)
    model.load_state_dict(folded)
    with torch.no_grad():
        got = model(x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # the first norm is now an identity plus a bias; its conv carries the scale g / sqrt(var + eps)
    eps = model[1].eps
    torch.testing.assert_close(folded["1.weight"], torch.ones(4))
    torch.testing.assert_close(folded["1.running_var"], torch.full((4,), 1 - eps))
    scale = state["1.weight"] / torch.sqrt(state["1.running_var"] + eps)
    torch.testing.assert_close(folded["0.weight"], state["0.weight"] * scale.view(-1, 1, 1, 1))


def test_a_pick_at_the_grid_edge_widens_and_a_binding_limit_is_marked(run, monkeypatch):
    import argparse
    import math

    best = {"full": 0.0005, "elastic_0.5": 0.3}  # full below the grid; elastic far above it

    def fake(name, opts, state, strategy, lr, seed, d, dev, epochs, evalx):
        acc = 0.9 - 0.1 * abs(math.log10(lr / best[strategy]))
        return {"strategy": strategy, "lr": lr, "seed": seed, "accuracy": acc, "before": 0.1, "diverged": False,
                "wall_s": 0.0, "fraction_trained": 1.0, "emulated_train_s": 0.0}  # fmt: skip

    monkeypatch.setattr(run, "finetune", fake)
    args = argparse.Namespace(strategies=["full", "elastic_0.5"], lrs=[0.003, 0.01, 0.03], max_widen=2, seeds=1,
                              device="cpu")  # fmt: skip
    out = run.tune_and_run("m", {}, {}, {}, args, 1)
    lrs = [(s["strategy"], s["lr"]) for s in out["tuning"]]
    # full: 0.003 at the bottom (ratio 0.3): 0.0009 (best, the bottom), 0.00027 (worse): 0.0009 is interior.
    # elastic: 0.03 at the top (ratio 3): 0.09, then 0.27, the limit of 2: still at the top
    assert lrs == [("full", 0.003), ("full", 0.01), ("full", 0.03), ("full", 0.0009), ("full", 0.00027),
                   ("elastic_0.5", 0.003), ("elastic_0.5", 0.01), ("elastic_0.5", 0.03), ("elastic_0.5", 0.09),
                   ("elastic_0.5", 0.27)]  # fmt: skip
    assert out["searches"] == {"full": {"chosen": 0.0009, "edge": "", "added": 2},
                               "elastic_0.5": {"chosen": 0.27, "edge": "top", "added": 2}}  # fmt: skip
    assert [r["lr"] for r in out["runs"]] == [0.0009, 0.27]
    doc = {"models": {"m": {"shifts": {"rot": {"before": 0.1, **out}}}}}
    assert "| 0.27 (top edge) |" in run.table(doc)[-1]
