"""int8/fp16 training numerics (fedelastic/train/quant.py) against hand-quantised small layers.

Every expected value is computed here with numpy: integer arithmetic for the int8 forward, the
chain rule written out for the gradients, and the QAS factors from their definition.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fedelastic.cost.costmodel import CostModel
from fedelastic.data import load_digits_dataset
from fedelastic.devices.profile import get_profile
from fedelastic.errors import ConfigError
from fedelastic.modelinfo import describe
from fedelastic.models.small import small_cnn
from fedelastic.scenario import TrainConfig, parse_scenario
from fedelastic.selection.strategy import make_strategy
from fedelastic.train.quant import FP32, Numerics, device_numerics, emulate, quantize_weight
from fedelastic.train.trainer import LocalTraining, train_local

W1 = np.array([[0.50, -0.25, 0.10], [0.0015, -0.001, 0.0005]], dtype=np.float32)  # channel 1: 333x smaller
B1 = np.array([0.30, -0.01], dtype=np.float32)
X = np.array([[0.2, -1.0, 3.0], [1.5, 0.7, -0.4], [2.9, 0.0, 1.1]], dtype=np.float32)


def two_layer() -> tuple[nn.Sequential, object]:
    """Linear(3, 2) -> ReLU -> Linear(2, 2): the first layer is quantised, the second is the fp32 head."""
    model = nn.Sequential(nn.Linear(3, 2), nn.ReLU(), nn.Linear(2, 2))
    with torch.no_grad():
        model[0].weight.copy_(torch.from_numpy(W1))
        model[0].bias.copy_(torch.from_numpy(B1))
        model[2].weight.copy_(torch.tensor([[1.0, -2.0], [0.5, 0.25]]))
        model[2].bias.zero_()
    return model, describe(model, torch.zeros(1, 3), "two_layer")


def hand_int8(x: np.ndarray, w: np.ndarray, b: np.ndarray):
    """The int8 layer by hand: scales, integer tensors and the output from an int64 accumulator."""
    s_w = np.abs(w).max(axis=1) / 127  # per output channel
    w_int = np.clip(np.round(w / s_w[:, None]), -127, 127).astype(np.int64)
    lo, hi = min(x.min(), 0.0), max(x.max(), 0.0)  # per tensor, asymmetric
    s_x = (hi - lo) / 255
    z = -128 - int(np.round(lo / s_x))
    x_int = np.clip(np.round(x / s_x) + z, -128, 127).astype(np.int64)
    b_int = np.round(b / (s_w * s_x)).astype(np.int64)  # int32 bias in units of s_w * s_x
    acc = (x_int - z) @ w_int.T + b_int  # integer arithmetic only
    return acc * (s_w * s_x), dict(s_w=s_w, w_int=w_int, s_x=s_x, z=z, x_int=x_int, b_int=b_int)


def first_layer_output(model, info, numerics, x: np.ndarray) -> torch.Tensor:
    out = {}
    handle = model[0].register_forward_hook(lambda _m, _i, o: out.setdefault("y", o))
    with emulate(model, info, numerics):
        model(torch.from_numpy(x))
    handle.remove()
    return out["y"]


def test_int8_forward_equals_integer_arithmetic():
    model, info = two_layer()
    expected, q = hand_int8(X, W1, B1)
    got = first_layer_output(model, info, Numerics("int8"), X)
    np.testing.assert_allclose(got.detach().numpy(), expected, rtol=1e-5, atol=1e-7)
    assert q["w_int"].max() == 127 and q["w_int"].min() >= -127  # the largest |w| of a channel maps to 127
    assert not np.allclose(expected, X @ W1.T + B1, atol=1e-4)  # quantisation is visible at this size


def test_weight_scales_per_channel_and_activation_scale_per_tensor():
    model, info = two_layer()
    with emulate(model, info, Numerics("int8")) as em:
        model(torch.from_numpy(X))
        layer = em.layers["0"]
        np.testing.assert_allclose(layer.w_scale.numpy(), np.abs(W1).max(axis=1) / 127, rtol=1e-6)
        scale, zero = layer.x_qparams  # one (scale, zero point) pair for the whole tensor
        assert scale == pytest.approx((X.max() - X.min()) / 255, rel=1e-6)
        assert zero == -128 - round(float(X.min()) / scale)
        # per channel, the small channel keeps its own 255 levels: 0.0015 * 127 / 0.0015 = 127,
        # -0.001 * 127 / 0.0015 = -84.67 -> -85, 0.0005 * 127 / 0.0015 = 42.33 -> 42 ...
        ints = quantize_weight(model[0].weight.detach(), layer.w_scale).numpy()
        np.testing.assert_array_equal(ints, [[127, -64, 25], [127, -85, 42]])
        # ... where one scale for the whole tensor (0.5 / 127) would round all of channel 1 to zero
        assert np.all(np.round(W1[1] / (0.5 / 127)) == 0)
        assert "2" in em.layers and em.layers["2"].w_scale is None  # the head keeps fp32 weights
        # the scales stay fixed: a later batch with a wider range is clipped, not re-calibrated
        model(torch.from_numpy(X * 10))
        assert layer.x_qparams == (scale, zero)


def test_straight_through_gradients_and_clipping_mask():
    model, info = two_layer()
    _, q = hand_int8(X, W1, B1)
    x2 = X.copy()
    x2[0, 2] = 50.0  # beyond the calibrated range: clipped, so no gradient
    g0 = np.array([[1.0, -0.5], [0.25, 2.0], [-1.0, 0.5]], dtype=np.float32)
    with emulate(model, info, Numerics("int8")) as em:
        model(torch.from_numpy(X))  # calibrates on X
        xt = torch.from_numpy(x2).requires_grad_(True)
        layer = em.layers["0"]
        y = layer.forward(xt)
        (y * torch.from_numpy(g0)).sum().backward()
    s_x, z, s_w = q["s_x"], q["z"], q["s_w"]
    x_int = np.clip(np.round(x2 / s_x) + z, -128, 127)
    xq = (x_int - z) * s_x
    wq = q["w_int"] * s_w[:, None]
    inside = (np.round(x2 / s_x) + z <= 127) & (np.round(x2 / s_x) + z >= -128)
    np.testing.assert_allclose(model[0].weight.grad.numpy(), g0.T @ xq, rtol=1e-5, atol=1e-6)  # dL/dW at q(x)
    np.testing.assert_allclose(xt.grad.numpy(), (g0 @ wq) * inside, rtol=1e-5, atol=1e-7)  # through q(W)
    assert xt.grad[0, 2] == 0 and inside.sum() == 8
    np.testing.assert_allclose(model[0].bias.grad.numpy(), g0.sum(0), rtol=1e-6)


def one_sgd_step(numerics: Numerics, lr: float = 0.1):
    """One plain SGD step of the two-layer model: (before, after, gradients of the forward, gradients applied)."""
    model, info = two_layer()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    x, y = torch.from_numpy(X), torch.tensor([0, 1, 1])
    with emulate(model, info, numerics):
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
    applied = {k: p.grad.clone() for k, p in model.named_parameters()}  # after the optimizer's pre-step hook
    return before, model.state_dict(), grads, applied


def test_qas_scaling_matches_hand_computation():
    lr = 0.1
    _, q = hand_int8(X, W1, B1)
    s_w, s_x = q["s_w"], q["s_x"]
    for qas in (False, True):
        before, after, grads, applied = one_sgd_step(Numerics("int8", qas=qas), lr)
        g_w, g_b = grads["0.weight"].numpy(), grads["0.bias"].numpy()  # real-unit gradients of the forward
        if qas:  # G~_W = s_W^-2 G_W~ with G_W~ = s_W G_W: the step on W~ = W / s_W moves W by -lr G_W
            exp_w, exp_b = g_w, g_b
            dw = (after["0.weight"] - before["0.weight"]).numpy()
            np.testing.assert_allclose(dw, -lr * g_w, rtol=1e-4, atol=1e-7)
        else:  # the SGD step on the integer tensors, seen in real units: s^2 G
            exp_w, exp_b = s_w[:, None] ** 2 * g_w, (s_w * s_x) ** 2 * g_b
        np.testing.assert_allclose(applied["0.weight"].numpy(), exp_w, rtol=1e-5, atol=0)
        np.testing.assert_allclose(applied["0.bias"].numpy(), exp_b, rtol=1e-5, atol=0)
        np.testing.assert_array_equal(applied["2.weight"].numpy(), grads["2.weight"].numpy())  # fp32 head
    assert (s_w**2).max() < 1e-4  # without QAS the weights barely move: the scale mismatch QAS fixes


def test_scaling_applies_once_per_step_with_sgdw():
    """The trainer's SGDW (fedelastic.train.optim) fires the emulation's hooks once a step, with torch's
    SGD in use too (its hooks are registered as well): the gradient is scaled once."""
    from fedelastic.train.trainer import SGDW

    _, q = hand_int8(X, W1, B1)
    model, info = two_layer()
    torch.optim.SGD(model.parameters(), lr=0.1)  # torch's optimizers in the same process
    opt = SGDW(model.parameters(), lr=0.1, momentum=0.0, weight_decay=0.0)
    with emulate(model, info, Numerics("int8", qas=False)):
        nn.functional.cross_entropy(model(torch.from_numpy(X)), torch.tensor([0, 1, 1])).backward()
        g = model[0].weight.grad.numpy().copy()
        opt.step()
    np.testing.assert_allclose(model[0].weight.grad.numpy(), q["s_w"][:, None] ** 2 * g, rtol=1e-5, atol=0)


def test_qas_folded_norm_beta_and_gamma():
    """A norm after a quantised conv: beta is the folded int32 bias, gamma a float scale (never scaled)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 2, 3, bias=False), nn.BatchNorm2d(2), nn.ReLU(), nn.Flatten(), nn.Linear(8, 2))
    info = describe(model, torch.zeros(1, 1, 4, 4), "conv_bn")
    with torch.no_grad():
        model[1].weight.copy_(torch.tensor([0.5, -2.0]))
        model[1].running_var.copy_(torch.tensor([4.0, 0.25]))
    model[1].eval()  # running statistics frozen, as on a device
    x = torch.randn(4, 1, 4, 4)
    lr = 0.5
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    with emulate(model, info, Numerics("int8", qas=False)) as em:
        nn.functional.cross_entropy(model(x), torch.tensor([0, 1, 0, 1])).backward()
        g_beta, g_gamma = model[1].bias.grad.clone(), model[1].weight.grad.clone()
        s_x = em.layers["0"].x_qparams[0]
        opt.step()
    s_w = before["0.weight"].abs().flatten(1).amax(1).numpy() / 127
    s_wf = s_w * np.array([0.5, 2.0]) / np.sqrt(np.array([4.0, 0.25]) + 1e-5)  # |gamma| / sqrt(var + eps)
    np.testing.assert_allclose(model[1].bias.grad.numpy(), (s_wf * s_x) ** 2 * g_beta.numpy(), rtol=1e-5, atol=0)
    d_gamma = (model[1].weight - before["1.weight"]).detach().numpy()
    np.testing.assert_allclose(d_gamma, -lr * g_gamma.numpy(), rtol=1e-5)


def test_quantized_gradients_per_channel():
    model, info = two_layer()
    with torch.no_grad():
        model[0].bias[1] = 0.5  # channel 1 active (ReLU), so both channels get a gradient
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with emulate(model, info, Numerics("int8", quantized_gradients=True)):
        nn.functional.cross_entropy(model(torch.from_numpy(X)), torch.tensor([0, 1, 1])).backward()
        g = model[0].weight.grad.numpy().copy()
        opt.step()
    s = np.abs(g).max(axis=1, keepdims=True) / 127
    assert np.all(s > 0) and not np.allclose(np.round(g / s) * s, g, rtol=1e-4, atol=0)  # rounding is visible
    np.testing.assert_allclose(model[0].weight.grad.numpy(), np.round(g / s) * s, rtol=1e-5, atol=1e-9)  # applied


def test_master_weights_device_stores_int8():
    before, after, _, _ = one_sgd_step(Numerics("int8", master_weights="device"), lr=0.5)
    s_w = np.abs(before["0.weight"].numpy()).max(axis=1) / 127
    steps = after["0.weight"].numpy() / s_w[:, None]
    np.testing.assert_allclose(steps, np.round(steps), atol=1e-3)  # on the fixed int8 grid
    assert np.abs(np.round(steps)).max() <= 127
    _, after_fp32, _, _ = one_sgd_step(Numerics("int8", master_weights="fp32"), lr=0.5)
    steps = after_fp32["0.weight"].numpy() / s_w[:, None]
    assert np.abs(steps - np.round(steps)).max() > 0.01  # the fp32 copy keeps sub-step updates


def test_fp16_rounds_weights_and_activations():
    model, info = two_layer()
    x = np.array([[1.0 + 2**-12, 0.1, 3.3]], dtype=np.float32)
    got = first_layer_output(model, info, Numerics("fp16"), x)
    x16, w16, b16 = (a.astype(np.float16).astype(np.float32) for a in (x, W1, B1))
    np.testing.assert_allclose(got.detach().numpy(), x16 @ w16.T + b16, rtol=1e-6)


def test_forward_is_restored_after_the_block():
    model, info = two_layer()
    reference = model(torch.from_numpy(X)).detach()
    with emulate(model, info, Numerics("int8")):
        assert not torch.equal(model(torch.from_numpy(X)), reference)
    assert torch.equal(model(torch.from_numpy(X)), reference)
    assert "forward" not in model[0].__dict__


# ---- integration ---------------------------------------------------------------------------------


def digits_subset(n: int = 96):
    ds = load_digits_dataset()
    return ds.subset(np.random.default_rng(0).permutation(len(ds))[:n])


def train_once(numerics, device="stm32h743", strategy="full"):
    torch.manual_seed(0)
    model = small_cnn(width=4)
    info = describe(model, torch.zeros(1, 1, 8, 8), "small_cnn")
    cost = CostModel(info, get_profile(device), 16)
    kwargs = {} if numerics == "absent" else {"numerics": numerics}
    local = LocalTraining(epochs=1, batch_size=16, lr=0.05)
    result = train_local(model, info, make_strategy(strategy), cost, digits_subset(), local, seed=1, **kwargs)
    return result, model.state_dict()


def test_fp32_device_is_bit_identical_to_no_emulation():
    base, base_state = train_once("absent", device="raspberry_pi_4")
    for numerics in (None, FP32, device_numerics(TrainConfig(), "fp32")):
        result, state = train_once(numerics, device="raspberry_pi_4")
        assert result.train_loss == base.train_loss
        assert all(torch.equal(state[k], base_state[k]) for k in base_state)


def test_int8_device_trains_differently_and_the_switch_turns_it_off():
    base, base_state = train_once("absent")
    int8, int8_state = train_once(device_numerics(TrainConfig(), get_profile("stm32h743").train_dtype))
    assert int8.steps == base.steps and int8.train_loss != base.train_loss
    assert any(not torch.equal(int8_state[k], base_state[k]) for k in base_state)
    off, off_state = train_once(device_numerics(TrainConfig(numerics="fp32"), "int8"))
    assert off.train_loss == base.train_loss and all(torch.equal(off_state[k], base_state[k]) for k in base_state)


def test_numerics_config_is_validated(tmp_path):
    from tests.support import small_scenario_dict

    for key, value in (("numerics", "bf16"), ("qas", "yes"), ("master_weights", "int8")):
        raw = small_scenario_dict(tmp_path, train={key: value})
        with pytest.raises(ConfigError, match=f"train.{key}"):
            parse_scenario(raw, src="s.toml")
    assert TrainConfig().numerics == "device" and TrainConfig().qas


def test_a_weight_past_its_fixed_range_saturates_only_in_int8_storage():
    for master, expected_steps in (("fp32", 127 * 3), ("device", 127)):
        model, info = two_layer()
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        with emulate(model, info, Numerics("int8", master_weights=master)) as em:
            model(torch.from_numpy(X))
            s = em.layers["0"].w_scale[0].item()  # 0.5 / 127
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
            model[0].weight.grad[0, 0] = -1.0  # one step of lr 1 takes W[0, 0] from 0.5 to 1.5
            opt.step()
            out = {}
            model[0].register_forward_hook(lambda _m, _i, o, out=out: out.setdefault("y", o))
            x = np.array([[1.0, 0.0, 0.0]], dtype=np.float32)  # picks column 0 (x is calibrated already)
            model(torch.from_numpy(x))
        _, q = hand_int8(X, W1, B1)
        x_int = np.round(1.0 / q["s_x"]) + q["z"]
        expected = (x_int - q["z"]) * q["s_x"] * expected_steps * s + q["b_int"][0] * s * q["s_x"]
        assert out["y"][0, 0].item() == pytest.approx(expected, rel=1e-5)
        stored = model[0].weight[0, 0].item()
        assert stored == pytest.approx(1.5 if master == "fp32" else 127 * s, rel=1e-6)
