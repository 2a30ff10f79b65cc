"""Kernel-aware cost model: functional ops, kernel classes, schema v2, fit, uncertainty."""

import dataclasses
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedelastic.cost.costmodel import CostModel, kernel_parameters
from fedelastic.devices.profile import KERNEL_CLASSES, KernelClass, LayerTiming, MeasuredTable, Quantity, get_profile
from fedelastic.errors import ConfigError
from fedelastic.modelinfo import describe
from fedelastic.models.small import mcu_net, small_cnn
from fedelastic.profiling.roofline_fit import fit_kernels, kernel_device
from tests.support import ROOT


class TimmAttention(nn.Module):
    """timm-style attention: one qkv projection, explicit matmuls and softmax, an output projection."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        attn = (q @ k.transpose(-2, -1)) * (d // self.heads) ** -0.5
        y = attn.softmax(dim=-1) @ v
        return x + self.proj(y.transpose(1, 2).reshape(b, n, d))


def test_describe_records_functional_ops_and_matches_flop_counter():
    dim, heads, tokens = 8, 2, 5
    info = describe(TimmAttention(dim, heads), torch.zeros(2, tokens, dim), model_name="attn")
    # module hooks alone: qkv (N x D x 3D) and proj (N x D x D)
    assert sum(layer.macs for layer in info.layers) == tokens * dim * 3 * dim + tokens * dim * dim
    matmuls = [f for f in info.functional if f.kind == "matmul"]
    # q @ k^T and attn @ v: heads x N x N x (D / heads) each
    assert [f.macs for f in matmuls] == [heads * tokens * tokens * (dim // heads)] * 2
    assert all(f.above == 1 for f in info.functional[:-1])  # the attention core runs before proj (layer 1)
    kinds = [f.kind for f in info.functional]
    assert "softmax" in kinds and kinds[-1] == "eltwise"  # the residual add comes last
    assert info.functional[-1].above == 2  # after the last layer: no layer above it
    assert info.flop_counter_macs == info.hooked_macs == 4 * tokens * dim * dim + 2 * heads * tokens * tokens * 4
    assert info.macs_coverage == 1.0


class HiddenConv(nn.Module):
    """A conv whose weight is a buffer called through F.conv2d: no hook and no functional class sees it."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4 * 8 * 8, 2)
        self.register_buffer("w", torch.randn(4, 3, 3, 3))

    def forward(self, x):
        return self.head(F.conv2d(x, self.w, padding=1).flatten(1))


def test_describe_warns_when_the_hooks_miss_flops():
    with pytest.warns(UserWarning, match="FlopCounterMode"):
        info = describe(HiddenConv(), torch.zeros(1, 3, 8, 8))
    assert info.hooked_macs == 4 * 8 * 8 * 2
    assert info.flop_counter_macs == 4 * 8 * 8 * 2 + 4 * 8 * 8 * 3 * 9
    assert info.macs_coverage < 0.9


def _kernel(eff, bw, overhead, width=0.0):
    return KernelClass(Quantity(eff, "t"), Quantity(bw, "t"), Quantity(overhead, "t"), Quantity(width, "t"))


def _mlp():
    return describe(nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)), torch.zeros(1, 4), model_name="mlp")


def test_kernel_classes_price_each_kernel_by_hand():
    base = get_profile("jetson_nano")
    peak, launch = base.peak_flops.value, base.launch_overhead_s.value
    kernels = {
        "gemm_fwd": _kernel(0.5, 1e9, 2e-6, width=6.0),
        "gemm_dx": _kernel(0.25, 1e9, 3e-6),
        "gemm_dw": _kernel(0.125, 1e9, 4e-6),
        "eltwise": _kernel(1.0, 1e3, 1e-6),  # 1 kB/s: element-wise kernels are bandwidth-bound
        "reduce": _kernel(1.0, 2e3, 5e-6),
    }
    dev = dataclasses.replace(base, kernels=kernels, measured={})
    cost = CostModel(_mlp(), dev, batch_size=2)
    b, e = 2, 4
    # layer 0 forward: GEMM (2 x 2 x 12 flops, (4 + 3) x 2 + 15 elements, 6 outputs) + bias add (eltwise)
    gemm = max(2 * b * 12 / (0.5 * peak), ((4 + 3) * b + 15) * e / 1e9) * (6 + 6) / 6 + launch + 2e-6
    bias_add = 2 * 3 * b * e / 1e3 + launch + 1e-6
    assert cost.t_fwd[0] == pytest.approx(gemm + bias_add)
    # bias dW: a reduction over the output gradient (outputs + bias elements)
    assert cost.t_dw[1] == pytest.approx((3 * b + 3) * e / 2e3 + launch + 5e-6)
    # layer 1 dX: its GEMM plus the ReLU's backward below it (element-wise, in + out elements)
    dx = max(2 * b * 6 / (0.25 * peak), ((3 + 2) * b + 8) * e / 1e9) + launch + 3e-6
    relu = 2 * 3 * b * e / 1e3 + launch + 1e-6
    assert cost.t_dx[2] == pytest.approx(dx + relu)
    # unfitted classes take their fallback's parameters: depthwise_dw -> reduce, layout -> eltwise
    params = kernel_parameters(dev)
    idx = list(KERNEL_CLASSES)
    assert (params[idx.index("depthwise_dw")] == params[idx.index("reduce")]).all()
    assert (params[idx.index("layout")] == params[idx.index("eltwise")]).all()


def test_v1_profile_gives_every_class_the_single_roofline():
    dev = get_profile("jetson_nano")
    assert not dev.kernels
    row = (
        dev.peak_flops.value * dev.efficiency.value,
        dev.mem_bandwidth_bytes_per_s.value,
        dev.launch_overhead_s.value,
        0,
    )
    assert (kernel_parameters(dev) == np.array(row)).all()


def test_residual_add_is_priced_forward_and_backward():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.b(x + self.a(x))

    info = describe(Block(), torch.zeros(1, 4))
    assert [(f.kind, f.above, f.out_numel) for f in info.functional] == [("eltwise", 1, 4)]
    kernels = {c: _kernel(1.0, 1e3, 0.0) for c in ("gemm_fwd", "gemm_dx", "gemm_dw", "eltwise", "reduce")}
    dev = dataclasses.replace(get_profile("jetson_nano"), kernels=kernels, measured={})
    cost = CostModel(info, dev, batch_size=1)
    launch = dev.launch_overhead_s.value
    add_fwd = (2 * 4 + 4) * 4 / 1e3 + launch  # reads both operands, writes the sum
    add_bwd = 3 * 4 * 4 / 1e3 + launch  # the gradient sum where the branches meet
    assert cost.t_ops_fwd_layer[1] == pytest.approx(add_fwd)
    gemm_dx = (4 + 4 + 20) * 4 / 1e3 + launch
    assert cost.t_dx[2] == pytest.approx(gemm_dx + add_bwd)


def _write_v2(tmp_path, profile_raw, kernels, version=2):
    import tomli_w

    raw = {**profile_raw, "schema_version": version, "kernels": kernels}
    path = tmp_path / f"{raw['name']}.toml"
    path.write_text(tomli_w.dumps(raw))
    return path


def _q(value, unit):
    return {"value": value, "unit": unit, "source": "test"}


def test_schema_v2_kernels_load_and_bad_entries_are_named(tmp_path, profile_raw):
    from fedelastic.devices.profile import load_profile

    good = {
        "efficiency": _q(0.5, "1"),
        "bandwidth": _q(10, "GB/s"),
        "overhead": _q(3, "us"),
        "width": _q(100, "elements"),
    }
    dev = load_profile(_write_v2(tmp_path, profile_raw, {"gemm_fwd": good}))
    assert dev.kernels["gemm_fwd"].bandwidth.value == 10e9 and dev.kernels["gemm_fwd"].overhead_s.value == 3e-6
    with pytest.raises(ConfigError) as info:
        load_profile(_write_v2(tmp_path, profile_raw, {"gemm": good}))
    assert info.value.key == "kernels.gemm"
    with pytest.raises(ConfigError) as info:
        load_profile(_write_v2(tmp_path, profile_raw, {"gemm_fwd": {**good, "efficiency": _q(1.5, "1")}}))
    assert info.value.key == "kernels.gemm_fwd.efficiency.value"
    with pytest.raises(ConfigError) as info:
        load_profile(_write_v2(tmp_path, profile_raw, {"gemm_fwd": good}, version=1))
    assert info.value.key == "kernels"


def _synthetic_table(info, device, batch):
    """A measured table generated by the kernel-aware cost model itself, from known parameters."""
    cost = CostModel(info, device, batch)
    layers = {}
    for li, layer in enumerate(info.layers):
        first = layer.tensors[0]
        fwd = cost.t_fwd[first] + cost.t_ops_fwd_layer[li]
        layers[layer.name] = LayerTiming(fwd, cost.t_dx[first], cost.t_dw[list(layer.tensors)].sum())
    return MeasuredTable(batch, "synthetic", layers)


def test_fit_kernels_recovers_a_known_device():
    base = dataclasses.replace(get_profile("jetson_nano"), measured={})
    truth = {
        "gemm_fwd": (0.6 * base.peak_flops.value, 8e9, 20e-6, 50.0),
        "gemm_dx": (0.4 * base.peak_flops.value, 6e9, 30e-6, 50.0),
        "gemm_dw": (0.3 * base.peak_flops.value, 5e9, 40e-6, 50.0),
        "eltwise": (0.5 * base.peak_flops.value, 4e9, 10e-6, 10.0),
        "reduce": (0.5 * base.peak_flops.value, 2e9, 15e-6, 10.0),
    }
    dev = kernel_device(base, truth)
    pairs = []
    for model, shape in (
        (small_cnn(width=8), (1, 16, 16)),
        (mcu_net(width=8, input_size=16, in_channels=1), (1, 16, 16)),
    ):
        info = describe(model, torch.zeros(1, *shape), model_name=type(model).__name__)
        pairs += [(info, _synthetic_table(info, dev, b)) for b in (1, 8, 32)]
    fit = fit_kernels(pairs, base, max_bandwidth=20e9, leave_one_out=False)
    assert abs(fit.total_rel_err) < 0.02
    assert fit.median_rel_err < 0.05
    assert {"gemm_fwd", "gemm_dx", "gemm_dw", "eltwise", "reduce"} <= set(fit.fitted)
    assert fit.uncertainty < 0.05


def test_time_band_scales_with_the_roofline_share():
    info = _mlp()
    dev = dataclasses.replace(get_profile("jetson_nano"), uncertainty=Quantity(0.1, "t"), measured={})
    cost = CostModel(info, dev, batch_size=2)
    assert cost.roofline_share() == 1.0 and cost.time_band_s(3.0) == pytest.approx(0.3)
    table = MeasuredTable(2, "t", {layer.name: LayerTiming(1e-3, 1e-3, 1e-3) for layer in info.layers})
    covered = CostModel(info, dataclasses.replace(dev, measured={"mlp": table}), batch_size=2)
    assert 0 <= covered.roofline_share() < 0.5  # what is left: the optimizer, the loss, the weightless ops
    assert math.isclose(CostModel(info, dataclasses.replace(dev, uncertainty=None), 2).time_band_s(3.0), 0.0)


def test_gpu_paths_skip_cleanly_without_cuda(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    from fedelastic.profiling.measure import get_clock

    with pytest.raises(ValueError, match="CUDA"):
        get_clock("cuda")
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_measure.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "no CUDA device" in out.stdout
    assert not any(tmp_path.iterdir())


def test_sdpa_is_one_matmul_and_its_softmax():
    class Sdpa(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(8, 24)

        def forward(self, x):
            b, n, _ = x.shape
            q, k, v = self.qkv(x).reshape(b, n, 3, 2, 4).permute(2, 0, 3, 1, 4).unbind(0)
            return F.scaled_dot_product_attention(q, k, v)

    info = describe(Sdpa(), torch.zeros(3, 5, 8))
    # heads 2, tokens 5, head dim 4: q k^T and attn v are 2 x 5 x 5 x 4 MACs each; 2 x 5 x 5 scores
    assert [(f.kind, f.macs, f.out_numel) for f in info.functional] == [("matmul", 400, 40), ("softmax", 0, 50)]


def test_layout_transposes_price_a_copy_per_conv_output_and_activation_gradient():
    model = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.Conv2d(2, 3, 1))
    info = describe(model, torch.zeros(1, 1, 4, 4), model_name="convs")
    base = get_profile("jetson_nano")
    launch = base.launch_overhead_s.value
    kernels = {c: _kernel(1.0, 1e3, 0.0) for c in ("gemm_fwd", "gemm_dx", "gemm_dw", "eltwise", "reduce")}
    kernels["layout"] = _kernel(1.0, 1e2, 7e-6)  # 100 B/s: layout copies are bandwidth-bound
    plain = dataclasses.replace(base, kernels=kernels, measured={})
    off, on = CostModel(info, plain, 2), CostModel(info, dataclasses.replace(plain, layout_transposes=True), 2)
    b, e = 2, 4

    def copy(elements):  # read and write every element once
        return 2 * elements * b * e / 1e2 + launch + 7e-6

    # conv 0 (2 x 4 x 4 outputs): its output in the forward, its output gradient before the filter gradient
    assert on.t_fwd[0] - off.t_fwd[0] == pytest.approx(copy(32))
    assert on.t_dw[0] - off.t_dw[0] == pytest.approx(copy(32))
    assert on.t_dw[1] == pytest.approx(off.t_dw[1])  # the bias gradient reads the gradient as it is
    # conv 1 (3 x 4 x 4 outputs) forward; its dx also carries the ReLU's gradient copy (2 x 4 x 4 elements)
    assert on.t_fwd[2] - off.t_fwd[2] == pytest.approx(copy(48))
    assert on.t_dx[2] - off.t_dx[2] == pytest.approx(copy(32))
    assert on.t_dx[0] == pytest.approx(off.t_dx[0])
    # a v1 profile (no kernel classes) keeps its fitted meaning: no copies priced
    v1 = dataclasses.replace(base, measured={})
    assert CostModel(info, dataclasses.replace(v1, layout_transposes=True), 2).t_fwd[0] == pytest.approx(
        CostModel(info, v1, 2).t_fwd[0]
    )


def test_layout_transposes_key_loads_in_v2_only(tmp_path, profile_raw):
    from fedelastic.devices.profile import load_profile

    good = {
        "efficiency": _q(0.5, "1"),
        "bandwidth": _q(10, "GB/s"),
        "overhead": _q(3, "us"),
        "width": _q(0, "elements"),
    }
    path = _write_v2(tmp_path, {**profile_raw, "layout_transposes": True}, {"layout": good})
    assert load_profile(path).layout_transposes
    assert not load_profile(_write_v2(tmp_path, profile_raw, {"layout": good})).layout_transposes
    with pytest.raises(ConfigError) as info:
        load_profile(_write_v2(tmp_path, {**profile_raw, "layout_transposes": "yes"}, {"layout": good}))
    assert info.value.key == "layout_transposes"
    raw = {k: v for k, v in profile_raw.items()}
    raw.update(layout_transposes=True, schema_version=1)
    import tomli_w

    path = tmp_path / f"{raw['name']}.toml"
    path.write_text(tomli_w.dumps(raw))
    with pytest.raises(ConfigError) as info:
        load_profile(path)
    assert info.value.key == "layout_transposes"


def test_fit_reports_its_objective():
    base = dataclasses.replace(get_profile("jetson_nano"), measured={})
    truth = {
        c: (0.5 * base.peak_flops.value, 4e9, 10e-6, 0.0)
        for c in ("gemm_fwd", "gemm_dx", "gemm_dw", "eltwise", "reduce")
    }
    dev = kernel_device(base, truth)
    info = describe(small_cnn(width=8), torch.zeros(1, 1, 16, 16), model_name="small_cnn")
    exact = fit_kernels(
        [(info, _synthetic_table(info, dev, b)) for b in (1, 8)], base, max_bandwidth=20e9, leave_one_out=False
    )
    # tables doubled in time cannot all be fitted as well as the model's own, up to the prior's pull
    skewed = MeasuredTable(
        8, "t", {k: LayerTiming(2 * v.fwd_s, v.dx_s, v.dw_s) for k, v in _synthetic_table(info, dev, 8).layers.items()}
    )
    worse = fit_kernels(
        [(info, _synthetic_table(info, dev, 1)), (info, skewed)], base, max_bandwidth=20e9, leave_one_out=False
    )
    assert 0 <= exact.objective_value < worse.objective_value


def test_fit_keeps_the_better_of_its_width_starts(monkeypatch):
    import fedelastic.profiling.roofline_fit as fit_module

    base = dataclasses.replace(get_profile("jetson_nano"), measured={})
    truth = {c: (0.5 * base.peak_flops.value, 4e9, 10e-6, 3e3) for c in ("gemm_fwd", "gemm_dx", "gemm_dw")}
    truth.update({c: (0.5 * base.peak_flops.value, 4e9, 10e-6, 0.0) for c in ("eltwise", "reduce")})
    dev = kernel_device(base, truth)
    info = describe(small_cnn(width=8), torch.zeros(1, 1, 16, 16), model_name="small_cnn")
    pairs = [(info, _synthetic_table(info, dev, b)) for b in (1, 8)]
    fits = {}
    for starts in ((1e2,), (1e5,), (1e2, 1e5)):
        monkeypatch.setattr(fit_module, "WIDTH_STARTS", starts)
        fits[starts] = fit_kernels(pairs, base, max_bandwidth=20e9, leave_one_out=False).objective_value
    assert fits[(1e2, 1e5)] == pytest.approx(min(fits[(1e2,)], fits[(1e5,)]))
