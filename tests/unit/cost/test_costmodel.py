"""The cost model against hand computations; pure numpy after describe()."""

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from fedelastic.cost.costmodel import CostModel, link_times_s
from fedelastic.devices.profile import LayerTiming, MeasuredTable, Quantity, get_profile
from fedelastic.errors import ConfigError
from fedelastic.modelinfo import describe
from fedelastic.models.small import mcu_net, small_cnn


def _mlp_info():
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    return describe(model, torch.zeros(1, 4), model_name="mlp")


def _device(**changes):
    dev = get_profile("jetson_nano")
    return dataclasses.replace(dev, **{k: Quantity(v, "test") for k, v in changes.items()})


def test_describe_orders_tensors_and_counts_macs():
    info = _mlp_info()
    assert info.tensor_names == ("0.weight", "0.bias", "2.weight", "2.bias")
    assert info.tensor_roles == ("weight", "bias", "weight", "bias")
    assert [layer.macs for layer in info.layers] == [12, 6]
    assert [(op.name, op.kind, op.above) for op in info.ops] == [("1", "mask", 1)]
    conv = describe(small_cnn(width=4), torch.zeros(1, 1, 8, 8))
    assert conv.layers[0].macs == 4 * 8 * 8 * 1 * 9  # out elements x cin x k x k


def test_memory_matches_hand_computation():
    info = _mlp_info()  # fp32 device: 4 bytes per element, batch 2, SGD momentum (1 state per element)
    cost = CostModel(info, get_profile("jetson_nano"), batch_size=2)
    weights = 23 * 4
    workspace = 2 * (4 + 3) * 4  # largest layer in + out, layer 0
    # only the last weight: its input (3 per sample) is saved; backprop stops there, no ReLU mask
    m = cost.memory(np.array([0, 0, 1, 0]))
    assert (m.weights_bytes, m.activations_bytes, m.gradients_bytes, m.optimizer_bytes, m.workspace_bytes) == (
        weights,
        3 * 2 * 4,
        6 * 4,
        6 * 4,
        workspace,
    )
    # only the first bias: no activation, but the ReLU above it keeps a one-bit mask of 3 x 2 elements
    m = cost.memory(np.array([0, 1, 0, 0]))
    assert (m.activations_bytes, m.gradients_bytes) == (3 * 2 / 8, 3 * 4)
    # half the output channels of the first (dense) weight: all of its input, half the gradient
    m = cost.memory(np.array([0.5, 0, 0, 0]))
    assert (m.activations_bytes, m.gradients_bytes, m.optimizer_bytes) == (4 * 2 * 4 + 0.75, 6 * 4, 6 * 4)
    assert cost.peak_memory_bytes(np.zeros(4)) == weights + workspace
    int8 = dataclasses.replace(get_profile("stm32h743"))
    assert CostModel(info, int8, batch_size=2).memory(np.ones(4)).weights_bytes == 23


def _mcu(train_bytes: float, flash_bytes: float | None):
    """stm32h743 (int8: 1 byte per element) with its SRAM and flash set by the test."""
    dev = get_profile("stm32h743")
    flash = None if flash_bytes is None else Quantity(flash_bytes, "test")
    return dataclasses.replace(dev, memory_train_bytes=Quantity(train_bytes, "test"), memory_flash_bytes=flash)


def test_mcu_keeps_frozen_weights_in_flash_and_trained_weights_in_sram():
    # Linear(4,3) ReLU Linear(3,2): tensors 12, 3, 6, 2 elements (23); int8, batch 2, momentum
    info = _mlp_info()
    cost = CostModel(info, _mcu(40, 17), batch_size=2)
    workspace = 2 * (4 + 3)  # layer 0's input + output, 1 byte each
    # the last weight alone: its 6 elements in SRAM (updated in place), the other 17 in flash;
    # its input (3 per sample) saved; a gradient and a momentum element per trained element
    m = cost.memory(np.array([0, 0, 1, 0]))
    assert (m.weights_bytes, m.activations_bytes, m.gradients_bytes, m.optimizer_bytes, m.workspace_bytes) == (
        6,
        3 * 2,
        6,
        6,
        workspace,
    )
    assert m.flash_bytes == 17 and m.total_bytes == 6 + 6 + 6 + 6 + 14 == 38
    # half the output channels of the first weight: 6 of its 12 elements in SRAM, the rest in flash;
    # a dense weight's gradient needs all of its input (4 x 2) and the ReLU above keeps a 1-bit mask
    m = cost.memory(np.array([0.5, 0, 0, 0]))
    assert (m.weights_bytes, m.flash_bytes, m.activations_bytes) == (6, 23 - 6, 4 * 2 + 3 * 2 / 8)
    # inference only: nothing in SRAM but the workspace; full training: nothing in flash
    assert (cost.memory(np.zeros(4)).total_bytes, cost.memory(np.zeros(4)).flash_bytes) == (14, 23)
    full = cost.memory(np.ones(4))
    assert (full.weights_bytes, full.flash_bytes) == (23, 0)
    assert full.total_bytes == 23 + (4 * 2 + 3 * 2 + 0.75) + 23 + 23 + 14
    # the probes: the Fisher probe trains nothing (all 23 in flash); importance over everything
    # trains all of it (nothing in flash) and keeps its restore copies (weights, momentum) in SRAM
    fisher = cost.probe_memory("fisher")
    assert (fisher.weights_bytes, fisher.flash_bytes) == (0, 23)
    importance = cost.probe_memory("importance")
    assert (importance.weights_bytes, importance.optimizer_bytes, importance.flash_bytes) == (23 + 23, 2 * 23, 0)


def test_mcu_fits_uses_sram_and_flash():
    info = _mlp_info()
    last = np.array([0, 0, 1, 0])  # 38 bytes of SRAM, 17 of flash (previous test)
    assert CostModel(info, _mcu(40, 17), 2).fits(last)
    assert not CostModel(info, _mcu(37, 17), 2).fits(last)  # SRAM short by one byte
    assert not CostModel(info, _mcu(40, 16), 2).fits(last)  # flash short by one byte
    assert not CostModel(info, _mcu(40, 16), 2).flash_fits(last)
    # without flash every weight is in SRAM, as before: 23 + 6 + 6 + 6 + 14 = 55 bytes
    no_flash = CostModel(info, _mcu(40, None), 2)
    assert no_flash.memory(last).weights_bytes == 23 and no_flash.memory(last).flash_bytes == 0
    assert no_flash.peak_memory_bytes(last) == 55 and not no_flash.fits(last) and no_flash.flash_fits(last)
    assert CostModel(info, _mcu(55, None), 2).fits(last)
    # a model whose frozen weights do not fit flash does not fit, however much SRAM there is;
    # training more of it in SRAM leaves less in flash
    big_sram = CostModel(info, _mcu(1e6, 16), 2)
    assert not big_sram.fits(np.zeros(4)) and big_sram.fits(np.ones(4)) and big_sram.fits(np.array([1, 0, 0, 0]))


def test_flash_is_an_optional_profile_key():
    from fedelastic.devices.profile import parse_profile, read_toml

    path = Path(get_profile("stm32h743").path)
    raw = read_toml(path, "device profile")
    assert parse_profile(raw, str(path)).memory_flash_bytes.value == 2 * 2**20  # 2 MiB, the datasheet's 2 MB
    raw["memory"].pop("flash")
    assert parse_profile(raw, str(path)).memory_flash_bytes is None
    raw["memory"]["flash"] = {"value": 0, "unit": "KiB", "source": "test"}
    with pytest.raises(ConfigError, match="memory.flash"):
        parse_profile(raw, str(path))
    # boards that load the model into RAM have no flash key: all weights count against memory.train
    assert all(get_profile(n).memory_flash_bytes is None for n in ("jetson_nano", "raspberry_pi_4", "phone_midrange"))
    assert {n: get_profile(n).memory_flash_bytes.value for n in ("stm32f746", "nrf52840")} == {
        "stm32f746": 2**20,
        "nrf52840": 2**20,
    }


def test_depthwise_channel_subset_saves_only_its_inputs():
    model = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1, groups=4, bias=False), nn.Conv2d(4, 4, 1, bias=False))
    info = describe(model, torch.zeros(1, 4, 5, 5))
    cost = CostModel(info, get_profile("jetson_nano"), batch_size=1)
    per_sample_input = 4 * 5 * 5 * 4  # bytes
    assert cost.memory(np.array([0.25, 0])).activations_bytes == per_sample_input / 4
    assert cost.memory(np.array([0, 0.25])).activations_bytes == per_sample_input


def test_backward_follows_the_chain_rule():
    info = describe(small_cnn(width=4), torch.zeros(1, 1, 8, 8))
    cost = CostModel(info, get_profile("raspberry_pi_4"), batch_size=8)
    n = info.num_tensors
    for k_min in range(n):
        mask = np.zeros(n)
        mask[k_min] = 1
        mask[-1] = 1
        expected = (cost.t_dw + cost.t_opt)[mask > 0].sum() + cost.t_dx[k_min + 1 :].sum() + cost.t_bwd_fixed
        assert cost.backward_time_s(mask) == pytest.approx(expected)
    assert cost.backward_time_s(np.zeros(n)) == 0
    assert cost.step_time_s(np.zeros(n)) == pytest.approx(cost.forward_time_s)


@pytest.mark.parametrize("device", ["jetson_nano", "raspberry_pi_4", "stm32h743"])
def test_step_time_is_monotone_as_the_deepest_tensor_moves_toward_the_input(device):
    info = describe(mcu_net(width=8), torch.zeros(1, 1, 8, 8))
    cost = CostModel(info, get_profile(device), batch_size=16)
    n = info.num_tensors
    own = cost.t_dw + cost.t_opt
    above = np.zeros(n, bool)
    above[n // 2 :] = np.random.default_rng(0).random(n - n // 2) < 0.5
    chain, cumulative = [], []
    for j in range(n // 2 - 1, -1, -1):  # the deepest selected tensor moves from the middle toward the input
        mask = above.copy()
        mask[j] = True
        chain.append(cost.step_time_s(mask) - own[j])  # what reaching j costs, beyond j's own gradient
        cumulative.append(cost.step_time_s(np.arange(n) >= j))  # everything from j up trains
    assert np.all(np.diff(chain) >= -1e-15) and chain[-1] > chain[0]
    assert np.all(np.diff(cumulative) > 0)


def test_fractional_ratio_costs_between_frozen_and_full():
    info = _mlp_info()
    cost = CostModel(info, get_profile("raspberry_pi_4"), batch_size=32)
    t = [cost.backward_time_s(np.array([r, 0, 0, 0])) for r in (0.25, 0.5, 1.0)]
    assert t[0] < t[1] < t[2]


def test_small_kernels_pay_launch_overhead_on_a_gpu():
    info = describe(small_cnn(width=16), torch.zeros(1, 1, 8, 8))
    dev = get_profile("jetson_nano")
    cost = CostModel(info, dev, batch_size=4)
    launch = dev.launch_overhead_s.value
    roles = np.array(info.tensor_roles)
    norm_grads = cost.t_dw[np.isin(roles, ["norm_weight", "norm_bias", "bias"])]
    assert np.all(norm_grads >= launch) and np.all(norm_grads < 1.5 * launch)
    # with a tiny launch overhead, a bias gradient is far cheaper than a conv weight gradient
    cheap = CostModel(info, _device(launch_overhead_s=1e-9), batch_size=4)
    assert cheap.t_dw[roles == "norm_bias"].max() < 0.1 * cheap.t_dw[roles == "weight"].max()


def test_measured_table_takes_precedence():
    info = _mlp_info()
    table = MeasuredTable(
        4, "test", {"0": LayerTiming(1e-3, 2e-3, 3e-3), "2": LayerTiming(4e-3, 5e-3, 6e-3)}, 0.5e-3, 0.0
    )
    dev = dataclasses.replace(get_profile("jetson_nano"), measured={"mlp": table})
    cost = CostModel(info, dev, batch_size=8)  # twice the table's batch: times scale linearly
    assert cost.forward_time_s == pytest.approx(2 * (1e-3 + 4e-3 + 0.5e-3))
    assert cost.t_dx[[0, 2]] == pytest.approx([4e-3, 10e-3])
    assert cost.t_dw[[0, 1]].sum() == pytest.approx(6e-3)
    assert cost.t_dw[[2, 3]].sum() == pytest.approx(12e-3)
    other = CostModel(dataclasses.replace(info, model_name="other"), dev, batch_size=8)
    assert other.forward_time_s != pytest.approx(cost.forward_time_s)


def test_energy_and_communication():
    info = _mlp_info()
    dev = get_profile("raspberry_pi_4")
    cost = CostModel(info, dev, batch_size=2)
    ratios = np.array([0, 0, 1, 1.0])
    assert cost.bytes_up(ratios) == 8 * 4 and cost.bytes_down() == 23 * 4
    up_s = dev.latency_s.value + 8 * 32 / dev.uplink_bit_per_s.value
    down_s = dev.latency_s.value + 8 * 92 / dev.downlink_bit_per_s.value
    got = link_times_s(92, 32, dev.downlink_bit_per_s.value, dev.uplink_bit_per_s.value, dev.latency_s.value)
    assert got == pytest.approx((down_s, up_s))
    expected = dev.power_train_w.value * 2.0 + dev.power_transmit_w.value * up_s + dev.power_receive_w.value * down_s
    assert cost.energy_j(2.0, up_s, down_s) == pytest.approx(expected)


# ---- BatchNorm mode, per-sample norms, probes, selector work, optimizer ---------------------------
def _bn_info():
    model = nn.Sequential(
        nn.Conv2d(1, 2, 3, padding=1, bias=False), nn.BatchNorm2d(2), nn.ReLU(), nn.Flatten(), nn.Linear(32, 3)
    )
    return describe(model, torch.zeros(1, 1, 4, 4))


def test_batchnorm_memory_follows_the_mode():
    info = _bn_info()  # tensors: conv.w, bn.gamma, bn.beta, lin.w, lin.b; batch 2, fp32
    masks = 2 * (32 * 2 / 8)  # ReLU and Flatten above the norm: one bit per element each
    bn_input = 32 * 2 * 4
    frozen = CostModel(info, get_profile("jetson_nano"), batch_size=2)  # the default: frozen statistics
    train = CostModel(info, get_profile("jetson_nano"), batch_size=2, bn_mode="train")
    beta, gamma, both = np.array([0, 0, 1, 0, 0.0]), np.array([0, 1, 0, 0, 0.0]), np.array([0, 1, 1, 0, 0.0])
    # frozen: beta's gradient is a sum of dY (nothing saved), gamma's needs the normalised input
    assert frozen.memory(beta).activations_bytes == masks
    assert frozen.memory(gamma).activations_bytes == bn_input + masks
    # batch statistics: any trained tensor of the norm needs its input, once
    assert train.memory(beta).activations_bytes == bn_input + masks
    assert train.memory(both).activations_bytes == bn_input + masks
    with pytest.raises(ValueError, match="bn_mode"):
        CostModel(info, get_profile("jetson_nano"), batch_size=2, bn_mode="sometimes")


def test_layernorm_saves_its_input_whenever_the_gradient_passes_it():
    model = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 2))
    info = describe(model, torch.zeros(1, 4))  # l0.w, l0.b, ln.w, ln.b, l2.w, l2.b; batch 2, fp32
    cost = CostModel(info, get_profile("jetson_nano"), batch_size=2)
    ln_input = 6 * 2 * 4
    assert cost.memory(np.array([0, 0, 0, 0, 0, 1.0])).activations_bytes == 0  # the norm is below the deepest
    assert cost.memory(np.array([0, 1, 0, 0, 0, 0.0])).activations_bytes == ln_input  # untrained, passed
    assert cost.memory(np.array([1, 0, 0, 0, 0, 0.0])).activations_bytes == 4 * 2 * 4 + ln_input
    assert cost.memory(np.array([0, 0, 1, 0, 0, 0.0])).activations_bytes == ln_input


def test_probe_memory_matches_hand_computation():
    info = _mlp_info()  # Linear(4,3) ReLU Linear(3,2): 23 parameters; batch 2, fp32, momentum
    cost = CostModel(info, get_profile("jetson_nano"), batch_size=2)
    weights, state = 23 * 4, 23 * 4
    acts = 4 * 2 * 4 + 3 * 2 * 4 + 3 * 2 / 8  # both inputs and the ReLU mask
    workspace = 2 * (4 + 3) * 4
    # importance: full training plus the restored copies of the weights and the optimizer state
    full_batch = weights + acts + weights + state + (weights + state) + workspace
    assert cost.probe_memory("importance").total_bytes == full_batch
    one = weights + acts / 2 + weights + state + (weights + state) + workspace / 2
    assert cost.probe_memory("importance", batch_size=1).total_bytes == one
    # fisher: weights, both layers' outputs, the ReLU mask, one float32 per output channel
    assert cost.probe_memory("fisher").total_bytes == weights + (3 + 2) * 2 * 4 + 0.75 + 4 * (3 + 2) + workspace
    # the largest micro-batch that fits, and none when not even one sample fits
    assert cost.probe_plan("importance", full_batch) == (2, full_batch)
    assert cost.probe_plan("importance", one + 1) == (1, one)
    assert cost.probe_plan("importance", one - 1) == (0, one)


def test_probe_time_sums_its_micro_batches():
    info = describe(small_cnn(width=4), torch.zeros(1, 1, 8, 8))
    dev = get_profile("raspberry_pi_4")
    cost, half = CostModel(info, dev, batch_size=8), CostModel(info, dev, batch_size=4)
    ones = np.ones(info.num_tensors)

    def passes(c):  # two forwards and two gradient passes over every tensor, no update
        return 2 * (c.forward_time_s + c.backward_time_s(ones) - c.t_opt.sum())

    assert cost.probe_time_s("importance") == pytest.approx(passes(cost) + cost.t_opt.sum())
    assert cost.probe_time_s("importance", 4) == pytest.approx(2 * passes(half) + cost.t_opt.sum())
    # fisher: one forward and the error gradient down to the first layer's output, no weight gradient
    fisher = cost.forward_time_s + cost.t_dx[1:].sum() + cost.t_bwd_fixed
    assert cost.probe_time_s("fisher") == pytest.approx(fisher)


def test_probe_segments_fit_and_cover_the_top():
    info = describe(mcu_net(width=16, num_classes=10), torch.zeros(1, 1, 8, 8))
    cost = CostModel(info, get_profile("stm32f746"), batch_size=16)
    memory = cost.device.memory_train_bytes.value
    assert cost.probe_plan("importance", memory)[0] == 0  # the whole probe never fits, even on one sample
    pieces = cost.probe_segments("importance", memory)
    assert len(pieces) > 1
    covered = np.zeros(info.num_tensors, bool)
    for mask, micro in pieces:
        assert micro >= 1 and not (covered & mask).any()
        assert cost.probe_memory("importance", micro, mask).total_bytes <= memory
        covered |= mask
    assert covered[-1] and covered[np.flatnonzero(covered)[0] :].all()  # contiguous from the output down


def test_selector_work_is_priced_on_the_device():
    info = _mlp_info()
    dev = get_profile("stm32h743")
    cost = CostModel(info, dev, batch_size=2)
    # the scalar rate: 480 MHz / 4 cycles per counted operation = 1.2e8 op/s (the profile's derivation)
    assert cost.selector_time_s(10, 1000.0) == pytest.approx((10 * 8 * info.num_tensors + 1000) / 1.2e8)
    # a profile without one: its tensor rate, peak x efficiency
    tensor = CostModel(info, dataclasses.replace(dev, scalar_ops_per_s=None), batch_size=2)
    rate = dev.peak_flops.value * dev.efficiency.value
    assert tensor.selector_time_s(10, 1000.0) == pytest.approx((10 * 8 * info.num_tensors + 1000) / rate)
    before = cost.evaluations
    cost.peak_memory_bytes(np.ones(4))
    cost.backward_time_s(np.ones(4))
    assert cost.evaluations == before + 2


def test_a_selection_is_charged_its_own_evaluations_only():
    """Pricing on another thread while a selector runs (a reply's time band, an abandoned
    in-process client) does not change what the selection is charged: evaluations are counted
    per thread. The selector below makes 3 evaluations; another thread makes 5 meanwhile."""
    import threading

    from fedelastic.selection.strategy import Selection, SelectionContext
    from fedelastic.train.trainer import LocalResult, select_and_charge

    info = _mlp_info()
    cost = CostModel(info, get_profile("stm32h743"), batch_size=2)
    ones = np.ones(info.num_tensors)

    class ThreeEvaluations:
        offline, interrupt = False, False

        def select(self, ctx):
            ctx.cost.backward_time_s(ones)
            if self.interrupt:
                other = threading.Thread(target=lambda: [ctx.cost.peak_memory_bytes(ones) for _ in range(5)])
                other.start()
                other.join()
            ctx.cost.backward_time_s(ones), ctx.cost.step_macs(ones)
            return Selection(ones)

    charged = []
    for interrupt in (False, True):
        strategy, result = ThreeEvaluations(), LocalResult(fits=True, num_examples=2)
        strategy.interrupt = interrupt
        select_and_charge(strategy, SelectionContext(info, cost, 0, np.random.default_rng(0)), cost, result)
        charged.append(result.selector_time_s)
    assert charged[0] == charged[1] == pytest.approx(cost.selector_time_s(3, 0.0))  # 3 evaluations, by hand


def test_optimizer_state_follows_the_momentum(make_scenario):
    from fedelastic.environment import RunEnvironment

    info = _mlp_info()
    sgd = CostModel(info, get_profile("jetson_nano"), batch_size=2, optimizer="sgd")
    assert sgd.memory(np.ones(4)).optimizer_bytes == 0 and np.all(
        sgd.t_opt < CostModel(info, get_profile("jetson_nano"), 2).t_opt
    )
    plain = RunEnvironment(make_scenario(train={"momentum": 0.0}))
    assert plain.cost("jetson_nano").optimizer_state == 0
    heavy = RunEnvironment(make_scenario(train={"momentum": 0.9, "optimizer": "sgdw", "bn_mode": "train"}))
    assert heavy.cost("jetson_nano").optimizer_state == 1 and heavy.cost("jetson_nano").bn_mode == "train"


def test_bn_mode_auto_freezes_statistics_only_from_trained_weights(make_scenario):
    from fedelastic.environment import RunEnvironment

    auto = {"bn_mode": "auto"}
    assert RunEnvironment(make_scenario(train=auto)).bn_mode == "train"  # from the factory's initialisation
    pretrain = {"name": "small_cnn", "pretrain": {"classes": [0, 1]}}
    pretrained = RunEnvironment(make_scenario(model=pretrain, train=auto))
    assert pretrained.bn_mode == "frozen" and pretrained.cost("jetson_nano").bn_mode == "frozen"
    assert RunEnvironment(make_scenario(train={"bn_mode": "frozen"})).bn_mode == "frozen"


def test_bn_mode_default_trains_batch_statistics_pretrained_or_not(make_scenario):
    from fedelastic.environment import RunEnvironment

    pretrained = RunEnvironment(make_scenario(model={"name": "small_cnn", "pretrain": {"classes": [0, 1]}}))
    assert pretrained.bn_mode == "train" and pretrained.cost("jetson_nano").bn_mode == "train"
    assert RunEnvironment(make_scenario()).bn_mode == "train"


def test_projection_shortcut_as_deepest_tensor_skips_the_main_branch_dx():
    from fedelastic.models.mobilenetv2 import mobilenetv2
    from fedelastic.models.resnet import resnet_small
    from fedelastic.models.vit import vit_tiny
    from fedelastic.train.trainer import count_backward_nodes

    torch.manual_seed(0)
    model = resnet_small()
    x = torch.randn(2, 3, 32, 32)
    info = describe(model, x)
    names = [layer.name for layer in info.layers]
    short, main = names.index("conv2_block1_0_conv"), names.index("conv2_block1_1_conv")
    assert names[short + 1] == "conv2_block1_0_bn" and names[main : main + 6] == [
        f"conv2_block1_{i}_{k}" for i in (1, 2, 3) for k in ("conv", "bn")
    ]

    # autograd: training the shortcut conv alone builds no node of the main branch
    def nodes(trained: list[str]) -> int:
        for n, p in model.named_parameters():
            p.requires_grad_(n in trained)
        return count_backward_nodes(model(x).sum())

    alone = nodes(["conv2_block1_0_conv.weight"])
    with_main = nodes(["conv2_block1_0_conv.weight", "conv2_block1_1_conv.weight"])
    assert with_main >= alone + 6  # conv, bn, relu x2 and conv, bn of the main branch at least

    # cost model, by hand: dx of every tensor above k_min except the block's main-branch layers
    cost = CostModel(info, get_profile("jetson_nano"), batch_size=4)
    k = info.layers[short].tensors[0]
    skipped = {t for li in range(main, main + 6) for t in info.layers[li].tensors}
    chain = sum(cost.t_dx[t] for t in range(k + 1, info.num_tensors) if t not in skipped)
    r = np.zeros(info.num_tensors)
    r[k] = 1.0
    hand = cost.t_dw[k] + cost.t_opt[k] + chain + cost.t_bwd_fixed
    assert cost.backward_time_s(r) == pytest.approx(hand, rel=1e-12)
    assert chain < cost.t_dx[k + 1 :].sum()  # the fix changes something
    # a main-branch conv as the deepest tensor still pays the whole chain above it
    r2 = np.zeros(info.num_tensors)
    k2 = info.layers[main].tensors[0]
    r2[k2] = 1.0
    hand2 = cost.t_dw[k2] + cost.t_opt[k2] + cost.t_dx[k2 + 1 :].sum() + cost.t_bwd_fixed
    assert cost.backward_time_s(r2) == pytest.approx(hand2, rel=1e-12)
    # shortcut and the main branch's 2nd conv: the dX from the add down to that conv's output is paid
    both = r.copy()
    k3 = info.layers[main + 2].tensors[0]
    both[k3] = 1.0
    paid = {t for li in range(main + 3, main + 6) for t in info.layers[li].tensors}
    chain3 = sum(cost.t_dx[t] for t in range(k + 1, info.num_tensors) if t not in skipped or t in paid)
    hand3 = cost.t_dw[[k, k3]].sum() + cost.t_opt[[k, k3]].sum() + chain3 + cost.t_bwd_fixed
    assert cost.backward_time_s(both) == pytest.approx(hand3, rel=1e-12)
    assert chain < chain3
    # MACs: the main branch's layers are not charged dX MACs either
    macs = 4 * np.array([layer.macs for layer in info.layers], float)
    dx_macs = sum(macs[li] for li in range(info.tensor_layer[k] + 1, len(info.layers)) if not main <= li < main + 6)
    assert cost.step_macs(r) == pytest.approx(4 * info.hooked_macs + dx_macs + cost.tensor_macs[k], rel=1e-12)

    # models without projection shortcuts: nothing changes
    for m, sample in (
        (small_cnn(), torch.zeros(1, 1, 8, 8)),
        (mobilenetv2(0.35, num_classes=10, input_size=32), torch.zeros(1, 3, 32, 32)),
        (vit_tiny(), torch.zeros(1, 3, 32, 32)),
    ):
        other = describe(m, sample)
        assert other.parallel == ()
        plain = CostModel(other, get_profile("jetson_nano"), batch_size=2)
        assert not (plain.branch_hi > plain.branch_lo).any()


def test_a_measured_table_prices_only_the_shape_it_was_measured_at(monkeypatch):
    from fedelastic.cost import kernels
    from fedelastic.models import describe_model

    monkeypatch.setattr(kernels, "_WARNED", set())  # warned once per process: start afresh
    tx2 = get_profile("jetson_tx2")  # its tables: 224x224, batch 4, 200 classes
    roofline = dataclasses.replace(tx2, measured={})
    small = describe_model("mobilenetv2", width_mult=0.35, input_size=32, num_classes=10)
    # by hand: Conv1's input is the 32x32 RGB image zero-padded to 33x33, 3 * 33 * 33 = 3267; at 224: 3 * 225 * 225
    with pytest.warns(UserWarning, match=r"'jetson_tx2'.*'mobilenetv2'.*\(first layer\) 3267, the table's model 151875"):
        cost = CostModel(small, tx2, 16)
    assert cost.measured is None
    assert cost.full_step_time_s() == CostModel(small, roofline, 16).full_step_time_s()
    # the same resolution and classes, another width: the layers differ, so does the parameter count
    narrow = describe_model("mobilenetv2", width_mult=0.35)
    with pytest.warns(UserWarning, match=r"parameters \d+, the table's model 2480072"):
        assert CostModel(narrow, tx2, 4).measured is None
    # the paper's own shape still uses it
    paper = describe_model("mobilenetv2")
    assert CostModel(paper, tx2, 4).measured is tx2.measured["mobilenetv2"]
    assert CostModel(paper, tx2, 4).full_step_time_s() != CostModel(paper, roofline, 4).full_step_time_s()


def test_a_table_shape_is_checked_and_written_back():
    from fedelastic.devices.profile import parse_profile
    from fedelastic.profiling.writer import dumps_profile, measured_table_toml

    table = MeasuredTable(4, "test", {"0": LayerTiming(1e-3, 2e-3, 3e-3)}, shape={"input": 16, "classes": 3})
    raw = {"measured": {"mlp": measured_table_toml(table)}}
    assert raw["measured"]["mlp"]["shape"] == {"input": 16, "classes": 3}
    assert "shape = { input = 16, classes = 3 }" in dumps_profile(raw)
    import tomllib

    base = tomllib.loads(Path(get_profile("jetson_nano").path).read_text())
    base.pop("measured", None)
    assert parse_profile({**base, **raw}, "x.toml", stem="jetson_nano").measured["mlp"].shape == {"input": 16, "classes": 3}
    bad = {"measured": {"mlp": {**raw["measured"]["mlp"], "shape": {"input": 0}}}}
    with pytest.raises(ConfigError, match=r"x\.toml.*measured\.mlp\.shape\.input"):
        parse_profile({**base, **bad}, "x.toml", stem="jetson_nano")


def test_describe_counts_a_leaf_whose_weights_its_parent_calls_functionally():
    """Swin's attention calls F.linear(x, self.qkv.weight, ...) on windows folded into the batch
    axis: the leaf never runs its own forward. Hand count: 4 windows of 3 tokens of width 5 into
    an output of width 7 is 4 * 3 * 5 * 7 = 420 MACs a sample."""
    import torch.nn.functional as F
    from torch import nn

    class Windowed(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(5, 7)

        def forward(self, x):  # (batch, 12, 5) -> (batch * 4 windows, 3, 5)
            w = F.linear(x.reshape(-1, 3, 5), self.qkv.weight, self.qkv.bias)
            return w.reshape(x.shape[0], -1).sum(dim=1, keepdim=True)

    info = describe(Windowed(), torch.randn(2, 12, 5))
    assert [(layer.name, layer.kind, layer.macs) for layer in info.layers] == [("qkv", "linear", 420)]
    assert info.num_tensors == 2
