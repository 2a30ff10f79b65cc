"""Tests for the Chrome-trace importer and the Keras-named project models."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from fedelastic.devices.profile import MeasuredTable
from fedelastic.models.mobilenetv2 import mobilenetv2
from fedelastic.models.resnet import resnet50, resnet_small
from fedelastic.models.vit import vit_b16, vit_tiny
from fedelastic.profiling.chrome_trace import (
    FUSED_BN_GRAD_DX_SHARE,
    import_trace,
    keras_scope,
    load_trace_events,
    project_layer_names,
    trainable_layer_names,
)
from fedelastic.profiling.writer import measured_table_toml
from tests.support import ROOT

# the shared data sit beside the checkout (../shared), or beside its parent for a git worktree
MEASURED = next(
    (p / "shared/data/measured/jetson_tx2" for p in ROOT.parents[:2] if (p / "shared").is_dir()),
    ROOT.parent / "shared/data/measured/jetson_tx2",
)
OPS_TID, STEPS_TID = 7, 9

# ------------------------------------------------------------------ a small TensorFlow trace

LAYERS = ["conv1_conv", "conv1_bn", "dense"]
# one training step of a conv -> bn -> relu -> pool -> dropout -> dense net, as TF names its ops (µs)
STEP_OPS: list[tuple[str, float]] = [
    ("model/sequential/random_flip/ReverseV2:ReverseV2", 7),  # augmentation: other
    ("model/dropout/dropout/random_uniform/RandomUniform:RandomUniform", 3),  # mask made early: dense
    ("model/net/conv1_conv/Conv2D:Conv2D", 100),
    ("model/net/conv1_conv/BiasAdd:BiasAdd", 10),
    ("model/net/conv1_bn/FusedBatchNormV3:FusedBatchNormV3", 20),
    ("model/net/conv1_relu/Relu:Relu", 5),  # weightless: dense
    ("model/global_average_pooling2d/Mean:Mean", 4),  # weightless: dense
    ("model/dropout/dropout/Mul_1:Mul", 2),  # weightless: dense
    ("model/dense/MatMul:MatMul", 6),
    ("model/dense/BiasAdd:BiasAdd", 1),
    ("sparse_categorical_crossentropy/SparseSoftmaxCrossEntropyWithLogits/x:SparseSoftmaxCrossEntropyWithLogits", 2),
    ("gradient_tape/sparse_categorical_crossentropy/SparseSoftmaxCrossEntropyWithLogits/mul:Mul", 1),
    ("gradient_tape/model/dense/MatMul:MatMul", 3),  # dx
    ("gradient_tape/model/dense/MatMul_1:MatMul", 4),  # dw
    ("gradient_tape/model/dense/BiasAdd/BiasAddGrad:BiasAddGrad", 2),  # dw
    ("gradient_tape/model/dropout/dropout/Mul_1:Mul", 1),  # dense dx
    ("gradient_tape/model/global_average_pooling2d/Tile:Tile", 2),  # dense dx
    ("gradient_tape/model/net/conv1_relu/ReluGrad:ReluGrad", 3),  # dense dx
    ("gradient_tape/model/net/conv1_bn/FusedBatchNormGradV3:FusedBatchNormGradV3", 30),  # split
    ("AddN_1:AddN", 6),  # gradient sum, after conv1_bn's backward: conv1_bn dx
    ("gradient_tape/model/net/conv1_conv/Conv2D/Conv2DBackpropInput:Conv2DBackpropInput", 40),
    (
        "gradient_tape/model/net/conv1_conv/Conv2D/Conv2DBackpropFilter-0-TransposeNHWCToNCHW-LayoutOptimizer"
        ":Transpose",
        8,
    ),
    ("gradient_tape/model/net/conv1_conv/Conv2D/Conv2DBackpropFilter:Conv2DBackpropFilter", 50),
    ("gradient_tape/model/net/conv1_conv/BiasAdd/BiasAddGrad:BiasAddGrad", 5),
]
STEP_US = 600.0
BN_DX = 30 * FUSED_BN_GRAD_DX_SHARE
EXPECTED_US = {  # (fwd, dx, dw) per layer
    "conv1_conv": (110, 40, 63),
    "conv1_bn": (20, BN_DX + 6, 30 - BN_DX),
    "dense": (3 + 5 + 4 + 2 + 6 + 1, 3 + 1 + 2 + 3, 6),
}


def _tf_trace(steps: list[list[tuple[str, float]]], step_us: list[float]) -> dict[str, Any]:
    """Chrome trace with a 'TensorFlow Ops' and a 'Steps' thread; ops back to back, 1 µs apart."""
    events: list[dict[str, Any]] = [
        {"ph": "M", "pid": 1, "tid": OPS_TID, "name": "thread_name", "args": {"name": "TensorFlow Ops"}},
        {"ph": "M", "pid": 1, "tid": STEPS_TID, "name": "thread_name", "args": {"name": "Steps"}},
        {"ph": "M", "pid": 1, "tid": 3, "name": "thread_name", "args": {"name": "Stream #13(Compute)"}},
        # a kernel on another thread and an op before the first step: both ignored
        {"ph": "X", "pid": 1, "tid": 3, "ts": 1500.0, "dur": 50.0, "name": "sgemm", "args": {}},
        {"ph": "X", "pid": 1, "tid": OPS_TID, "ts": 10.0, "dur": 999.0, "name": "Conv2D",
         "args": {"long_name": "model/net/conv1_conv/Conv2D:Conv2D"}},
    ]  # fmt: skip
    t = 1000.0
    for k, (ops, dur) in enumerate(zip(steps, step_us, strict=True)):
        start = t
        events.append({"ph": "X", "pid": 1, "tid": STEPS_TID, "ts": start, "dur": dur, "name": f"train {k}"})
        for long_name, d in ops:
            op_type = long_name.rpartition(":")[2]
            events.append(
                {"ph": "X", "pid": 1, "tid": OPS_TID, "ts": t, "dur": float(d), "name": op_type,
                 "args": {"long_name": long_name}}
            )  # fmt: skip
            t += d + 1.0
        t = start + dur
    return {"displayTimeUnit": "ns", "traceEvents": events}


def _write(tmp_path: Path, trace: Any, name: str = "t.trace.json.gz") -> Path:
    path = tmp_path / name
    text = json.dumps(trace)
    if name.endswith(".gz"):
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


@pytest.fixture
def small_trace(tmp_path: Path) -> Path:
    slow = [(n, 300 if n.endswith("/Conv2D:Conv2D") else d) for n, d in STEP_OPS]  # an outlier step
    partial = STEP_OPS[:5]
    return _write(tmp_path, _tf_trace([STEP_OPS, slow, STEP_OPS, partial], [STEP_US] * 3 + [120.0]))


def test_small_tf_trace_table(small_trace: Path) -> None:
    table = import_trace(small_trace, model="toy", batch_size=4, layers=LAYERS)
    assert isinstance(table, MeasuredTable)
    assert (table.model, table.batch_size, table.source, table.n_steps) == ("toy", 4, small_trace.name, 3)
    assert list(table.layers) == LAYERS
    for name, (fwd, dx, dw) in EXPECTED_US.items():
        t = table.layers[name]
        assert (t.fwd_s, t.dx_s, t.dw_s) == pytest.approx((fwd * 1e-6, dx * 1e-6, dw * 1e-6)), name
    fwd_us = 110 + 20 + 21 + 2  # layers + loss; the outlier step does not move the median
    bwd_us = 1 + 3 + 4 + 2 + 1 + 2 + 3 + 30 + 6 + 40 + 8 + 50 + 5
    assert table.step_s == pytest.approx(STEP_US * 1e-6)
    assert table.forward_s == pytest.approx(fwd_us * 1e-6)
    assert table.backward_s == pytest.approx(bwd_us * 1e-6)
    assert table.other_s == pytest.approx((STEP_US - fwd_us - bwd_us) * 1e-6)
    assert table.unattributed_fwd_s == pytest.approx(2e-6)
    assert table.unattributed_bwd_s == pytest.approx(1e-6)
    layer_sum = sum(t.fwd_s + t.dx_s + t.dw_s for t in table.layers.values())
    assert layer_sum + table.unattributed_fwd_s + table.unattributed_bwd_s + table.other_s == pytest.approx(
        table.step_s
    )


def test_layout_optimizer_transposes_are_flagged(small_trace: Path, tmp_path: Path) -> None:
    # STEP_OPS holds one '...-LayoutOptimizer:Transpose' (TensorFlow's NHWC <-> NCHW copies)
    assert import_trace(small_trace, model="toy", batch_size=4, layers=LAYERS).layout_transposes
    plain = [(n, d) for n, d in STEP_OPS if "LayoutOptimizer" not in n]
    path = _write(tmp_path, _tf_trace([plain, plain], [STEP_US] * 2), "plain.json")
    assert not import_trace(path, model="toy", batch_size=4, layers=LAYERS).layout_transposes


def test_small_tf_trace_options(small_trace: Path) -> None:
    separate = import_trace(small_trace, model="toy", batch_size=4, layers=LAYERS, charge_weightless_fwd=False)
    assert separate.layers["dense"].fwd_s == pytest.approx(7e-6)
    assert separate.unattributed_fwd_s == pytest.approx((2 + 3 + 5 + 4 + 2) * 1e-6)
    # keeping the (partial) last step changes the step median
    kept = import_trace(small_trace, model="toy", batch_size=4, layers=LAYERS, drop_last_step=False)
    assert kept.n_steps == 4


def test_to_toml(small_trace: Path) -> None:
    table = import_trace(small_trace, model="toy", batch_size=4, layers=LAYERS, source="unit test")
    toml = measured_table_toml(table)
    assert set(toml) == {"batch_size", "source", "layers", "unattributed_fwd", "unattributed_bwd"}
    assert toml["unattributed_fwd"] == pytest.approx(2e-6) and toml["unattributed_bwd"] == pytest.approx(1e-6)
    assert toml["batch_size"] == 4 and toml["source"] == "unit test"
    assert list(toml["layers"]) == LAYERS
    assert toml["layers"]["conv1_conv"] == pytest.approx({"fwd": 110e-6, "dx": 40e-6, "dw": 63e-6})


def test_strict_mode_catches_name_mismatches(tmp_path: Path) -> None:
    unknown = ("gradient_tape/model/net/conv9_conv/Conv2D/Conv2DBackpropFilter:Conv2DBackpropFilter", 5)
    path = _write(tmp_path, _tf_trace([STEP_OPS + [unknown]] * 2, [STEP_US] * 2))
    with pytest.raises(ValueError, match="conv9_conv"):
        import_trace(path, model="toy", batch_size=4, layers=LAYERS)
    with pytest.raises(ValueError, match="conv2_conv"):
        import_trace(path, model="toy", batch_size=4, layers=[*LAYERS, "conv2_conv"])
    table = import_trace(path, model="toy", batch_size=4, layers=[*LAYERS, "conv2_conv"], strict=False)
    assert table.layers["conv2_conv"].fwd_s == 0.0


def test_no_complete_step_is_an_error(tmp_path: Path) -> None:
    path = _write(tmp_path, _tf_trace([STEP_OPS], [STEP_US]))
    with pytest.raises(ValueError, match="no complete step"):
        import_trace(path, model="toy", batch_size=4, layers=LAYERS)


def test_vit_keras_scopes(tmp_path: Path) -> None:
    block = "model/vit-b16/Transformer/encoderblock_0"
    mlp = f"{block}/MlpBlock_3/Transformer/encoderblock_0"
    ops = [
        (f"{block}/LayerNorm_2/batchnorm/mul_1:Mul", 2),
        (f"{mlp}/Dense_0/Tensordot/MatMul:MatMul", 10),
        (f"{block}/MlpBlock_3/lambda/Gelu/Erf:Erf", 3),
        (f"{mlp}/Dense_1/Tensordot/MatMul:MatMul", 11),
        (f"gradient_tape/{mlp}/Dense_1/Tensordot/MatMul/MatMul_1:MatMul", 7),
        (f"gradient_tape/{mlp}/Dense_1/Tensordot/MatMul/MatMul:MatMul", 8),
        (f"gradient_tape/{block}/MlpBlock_3/lambda/Gelu/mul_1/Mul:Mul", 4),
        (f"gradient_tape/{mlp}/Dense_0/Tensordot/MatMul/MatMul_1:MatMul", 5),
        (f"gradient_tape/{mlp}/Dense_0/BiasAdd/BiasAddGrad:BiasAddGrad", 1),
        (f"gradient_tape/{block}/LayerNorm_2/batchnorm/sub/Sum:Sum", 2),
        (f"gradient_tape/{block}/LayerNorm_2/batchnorm/mul_1/Mul:Mul", 3),
    ]
    path = _write(tmp_path, _tf_trace([ops] * 2, [200.0] * 2), "vit.json")
    names = [
        "Transformer.encoderblock_0.LayerNorm_2",
        "Transformer.encoderblock_0.MlpBlock_3.Dense_0",
        "Transformer.encoderblock_0.MlpBlock_3.Dense_1",
    ]
    assert keras_scope(names[1]) == "Transformer/encoderblock_0/MlpBlock_3/Dense_0"
    table = import_trace(path, model="vit", batch_size=1, layers=names)
    ln, d0, d1 = (table.layers[n] for n in names)
    assert (ln.fwd_s, ln.dx_s, ln.dw_s) == pytest.approx((2e-6, 3e-6, 2e-6))
    assert (d0.fwd_s, d0.dx_s, d0.dw_s) == pytest.approx((10e-6, 0.0, 6e-6))
    assert (d1.fwd_s, d1.dx_s, d1.dw_s) == pytest.approx((14e-6, 12e-6, 7e-6))  # GELU is charged to Dense_1


def test_load_trace_events_formats(tmp_path: Path) -> None:
    events = [{"ph": "X", "name": "a", "ts": 1, "dur": 2}]
    for name, payload in [("a.json", {"traceEvents": events}), ("b.json.gz", events)]:
        assert load_trace_events(_write(tmp_path, payload, name)) == events


def test_unknown_trace_is_an_error(tmp_path: Path) -> None:
    path = _write(tmp_path, {"traceEvents": [{"ph": "X", "name": "x", "ts": 0, "dur": 1}]}, "x.json")
    with pytest.raises(ValueError, match="TensorFlow"):
        import_trace(path, model="toy", batch_size=1, layers=LAYERS)


# ------------------------------------------------------------------ PyTorch traces


def test_synthetic_torch_trace(tmp_path: Path) -> None:
    events: list[dict[str, Any]] = []
    for k, t0 in enumerate([0.0, 1000.0, 2000.0]):
        scale = 3.0 if k == 1 else 1.0
        events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{k}", "ts": t0, "dur": 900.0})
        for i, (region, dur) in enumerate([("a::fwd", 100), ("b::fwd", 50), ("b::dx", 20), ("b::dw", 30),
                                           ("a::dw", 40)]):  # fmt: skip
            events.append(
                {"ph": "X", "cat": "user_annotation", "name": f"fedelastic::{region}", "ts": t0 + 1 + 150 * i,
                 "dur": dur * scale}
            )  # fmt: skip
    table = import_trace(_write(tmp_path, events, "torch.json"), model="m", batch_size=2)
    assert list(table.layers) == ["a", "b"] and table.n_steps == 3
    assert (table.layers["a"].fwd_s, table.layers["a"].dx_s, table.layers["a"].dw_s) == pytest.approx(
        (100e-6, 0.0, 40e-6)
    )
    assert table.forward_s == pytest.approx(150e-6) and table.backward_s == pytest.approx(90e-6)
    assert table.step_s == pytest.approx(900e-6) and table.other_s == pytest.approx(660e-6)
    bad = [*events, {"ph": "X", "name": "fedelastic::a::bwd", "ts": 5.0, "dur": 1.0}]
    with pytest.raises(ValueError, match="fedelastic::a::bwd"):
        import_trace(_write(tmp_path, bad, "bad.json"), model="m", batch_size=2)


def test_real_torch_profiler_trace(tmp_path: Path) -> None:
    from torch.profiler import ProfilerActivity, profile, record_function

    model = resnet_small(num_classes=3, blocks=(1,), width=4, input_size=16)
    x = torch.randn(2, 3, 16, 16)
    names = trainable_layer_names(model)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            with record_function("fedelastic::step"):
                for name in names:
                    with record_function(f"fedelastic::{name}::fwd"):
                        torch.mm(torch.randn(8, 8), torch.randn(8, 8))
                with record_function(f"fedelastic::{names[-1]}::dw"):
                    model(x).sum().backward()
    path = tmp_path / "torch.json"
    prof.export_chrome_trace(str(path))
    table = import_trace(path, model="resnet_small", batch_size=2, layers=names)
    assert list(table.layers) == names and table.n_steps == 3
    assert all(t.fwd_s > 0 for t in table.layers.values())
    assert table.layers[names[-1]].dw_s > 0 and table.backward_s > 0


# ------------------------------------------------------------------ project models


@pytest.mark.parametrize(
    ("build", "params", "n_layers"),
    [(resnet50, 23_944_392, 107), (mobilenetv2, 2_480_072, 105), (vit_b16, 85_952_456, 101)],
)
def test_full_size_models_match_keras(build: Any, params: int, n_layers: int) -> None:
    with torch.device("meta"):
        model = build(num_classes=200)
        assert sum(p.numel() for p in model.parameters()) == params
        assert len(trainable_layer_names(model)) == n_layers
        assert model(torch.empty(2, 3, 224, 224)).shape == (2, 200)


@pytest.mark.parametrize(
    "build",
    [
        lambda: resnet_small(num_classes=5),
        lambda: mobilenetv2(0.35, num_classes=5, input_size=32),
        lambda: vit_tiny(num_classes=5),
    ],
    ids=["resnet_small", "mobilenetv2_035", "vit_tiny"],
)
def test_small_models_run_in_forward_order(build: Any) -> None:
    torch.manual_seed(0)
    model = build()
    names = trainable_layer_names(model)
    fired: list[str] = []
    for name in names:
        model.get_submodule(name).register_forward_hook(lambda *_, n=name: fired.append(n))
    out = model(torch.randn(2, 3, model.input_size, model.input_size))
    assert out.shape == (2, 5)
    assert fired == names  # named_modules() order is the forward execution order
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_tf_same_padding() -> None:
    # Keras pads strided 3x3 convs like TF "same": an even input gets its extra pixel at bottom/right
    from fedelastic.models.mobilenetv2 import _same_pad

    even = _same_pad(torch.ones(1, 1, 8, 8), 3, 2)
    assert even.shape[-2:] == (9, 9)
    assert even[0, 0, -1].sum() == 0 and even[0, 0, :, -1].sum() == 0 and even[0, 0, 0].sum() == 8
    odd = _same_pad(torch.ones(1, 1, 7, 7), 3, 2)
    assert odd.shape[-2:] == (9, 9) and odd[0, 0, 0].sum() == 0 and odd[0, 0, -1].sum() == 0


# ------------------------------------------------------------------ the measured TX2 traces

README = {  # model: (step, forward, backward) in ms, from shared/data/measured/README.md
    "resnet50": (502, 154, 340),
    "mobilenetv2": (230, 53, 169),
    "vit": (1460, 547, 894),
}


@pytest.mark.parametrize("model", sorted(README))
def test_measured_traces_cover_every_layer(model: str) -> None:
    path = MEASURED / f"{model}.trace.json.gz"
    if not path.exists():
        pytest.skip(f"{path} not present")
    table = import_trace(path, model=model, batch_size=4)  # strict: raises on any name mismatch
    names = project_layer_names(model)
    assert list(table.layers) == names  # every project layer has a row, in forward order, and vice versa
    assert all(t.fwd_s > 0 and t.dw_s > 0 for t in table.layers.values())
    assert table.n_steps == 4
    assert table.layout_transposes  # all three were recorded with TensorFlow's layout optimizer on
    step, fwd, bwd = (v * 1e-3 for v in README[model])
    assert table.step_s == pytest.approx(step, rel=0.03)
    # the README counts the gradient sums (AddN) and augmentation as forward; the total agrees
    assert table.forward_s + table.backward_s == pytest.approx(fwd + bwd, rel=0.03)
    layer_sum = sum(t.fwd_s + t.dx_s + t.dw_s for t in table.layers.values())
    total = layer_sum + table.unattributed_fwd_s + table.unattributed_bwd_s + table.other_s
    assert total == pytest.approx(table.step_s, rel=0.02)
    assert sum(t.fwd_s for t in table.layers.values()) + table.unattributed_fwd_s == pytest.approx(
        table.forward_s, rel=0.02
    )
