"""torchvision's ImageNet weights in fedelastic's ResNet / MobileNetV2 (``fedelastic.models.imagenet``).

No torchvision here (its wheels do not import against this torch) and no network: the stand-in is a
reference written below from torchvision's published architecture, with torchvision's tensor names,
saved to disk as torchvision saves its weights. The checks are that our model, loaded from that file,
computes the reference's function, and the parameter counts torchvision documents.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedelastic.errors import ConfigError
from fedelastic.models.imagenet import imagenet_state
from fedelastic.models.layout import MEAN, STD
from fedelastic.models.mobilenetv2 import _BLOCKS, _make_divisible, mobilenetv2
from fedelastic.models.resnet import resnet50, resnet_small
from tests.support import ROOT


def _bn(c: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(c)  # torchvision's: eps 1e-5


class TVBottleneck(nn.Module):  # torchvision.models.resnet.Bottleneck (v1.5: stride on conv2)
    def __init__(self, cin: int, width: int, stride: int, down: bool):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), _bn(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), _bn(width)
        self.conv3, self.bn3 = nn.Conv2d(width, 4 * width, 1, bias=False), _bn(4 * width)
        self.relu = nn.ReLU()
        self.downsample = (
            nn.Sequential(nn.Conv2d(cin, 4 * width, 1, stride, bias=False), _bn(4 * width)) if down else None
        )

    def forward(self, x):
        idt = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + idt)


class TVResNet(nn.Module):  # torchvision.models.resnet.ResNet
    def __init__(self, blocks, width: int, num_classes: int):
        super().__init__()
        self.conv1, self.bn1, self.relu = nn.Conv2d(3, width, 7, 2, 3, bias=False), _bn(width), nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin = width
        for stage, n in enumerate(blocks):
            w = width * 2**stage
            layers = [
                TVBottleneck(cin if i == 0 else 4 * w, w, (1 if stage == 0 else 2) if i == 0 else 1, i == 0)
                for i in range(n)
            ]
            self.add_module(f"layer{stage + 1}", nn.Sequential(*layers))
            cin = 4 * w
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for stage in range(4):
            x = getattr(self, f"layer{stage + 1}")(x)
        return self.fc(x.mean((2, 3)))


def _cbr(cin, cout, k, s, groups=1):  # torchvision's Conv2dNormActivation with ReLU6
    return nn.Sequential(nn.Conv2d(cin, cout, k, s, (k - 1) // 2, groups=groups, bias=False), _bn(cout), nn.ReLU6())


class TVInvertedResidual(nn.Module):
    def __init__(self, cin, cout, stride, t):
        super().__init__()
        hid = cin * t
        layers = [_cbr(cin, hid, 1, 1)] if t != 1 else []
        layers += [_cbr(hid, hid, 3, stride, groups=hid), nn.Conv2d(hid, cout, 1, bias=False), _bn(cout)]
        self.conv, self.res = nn.Sequential(*layers), stride == 1 and cin == cout

    def forward(self, x):
        return x + self.conv(x) if self.res else self.conv(x)


class TVMobileNetV2(nn.Module):  # torchvision.models.mobilenetv2.MobileNetV2 (width 1.0)
    def __init__(self, num_classes: int):
        super().__init__()
        feats, cin = [_cbr(3, 32, 3, 2)], 32
        for t, c, s in _BLOCKS:
            feats.append(TVInvertedResidual(cin, _make_divisible(c), s, t))
            cin = _make_divisible(c)
        feats.append(_cbr(cin, 1280, 1, 1))
        self.features = nn.Sequential(*feats)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(1280, num_classes))

    def forward(self, x):
        return self.classifier(self.features(x).mean((2, 3)))


def _randomise_norms(model: nn.Module) -> None:
    g = torch.Generator().manual_seed(0)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            m.weight.data.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            m.bias.data.copy_(torch.randn(m.num_features, generator=g) * 0.1)


def _saved(ref: nn.Module, tmp_path) -> str:
    _randomise_norms(ref)
    path = tmp_path / "weights.pth"
    torch.save(ref.state_dict(), path)
    return str(path)


@pytest.mark.parametrize(
    "ref, ours",
    [
        (
            lambda: TVResNet((2, 1, 1, 1), 8, 10),
            lambda: resnet_small(10, blocks=(2, 1, 1, 1), width=8, layout="torchvision"),
        ),
        (lambda: TVMobileNetV2(10), lambda: mobilenetv2(1.0, num_classes=10, input_size=32, layout="torchvision")),
    ],
    ids=["resnet", "mobilenetv2"],
)
def test_loaded_model_computes_torchvisions_function(ref, ours, tmp_path):
    torch.manual_seed(0)
    reference, model = ref(), ours()
    path = _saved(reference, tmp_path)
    state, kept = imagenet_state(model, f"torchvision:{path}")
    model.load_state_dict(state)
    assert all(k.endswith(".bias") and "conv" in k for k in kept)  # only ResNet's conv biases, set to 0
    x = torch.rand(2, 3, 40, 40)  # images in [0, 1]; torchvision's transforms normalise before its model
    normalised = (x - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)
    with torch.no_grad():
        want = reference.eval()(normalised)
        got = model.eval()(x)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()


def test_parameter_counts_are_torchvisions():
    # torchvision's documented counts: resnet50 25,557,032, mobilenet_v2 3,504,872 (ResNet's Keras conv
    # biases, which stay 0, are not among them)
    r = resnet50(1000, layout="torchvision")
    conv_bias = sum(p.numel() for n, p in r.named_parameters() if n.endswith("conv.bias"))
    assert sum(p.numel() for p in r.parameters()) - conv_bias == 25_557_032
    assert sum(p.numel() for p in mobilenetv2(1.0, num_classes=1000, layout="torchvision").parameters()) == 3_504_872


def test_new_task_head_is_kept_and_backbone_loaded(tmp_path):
    torch.manual_seed(0)
    path = _saved(TVMobileNetV2(1000), tmp_path)  # ImageNet's 1,000-way head
    model = mobilenetv2(1.0, num_classes=7, input_size=32, layout="torchvision")
    state, kept = imagenet_state(model, f"torchvision:{path}")
    assert kept == ["dense.weight", "dense.bias"]
    assert torch.equal(state["dense.weight"], model.state_dict()["dense.weight"])
    assert torch.equal(state["Conv_1.weight"], torch.load(path)["features.18.0.weight"])


def test_refusals_name_the_problem(tmp_path):
    path = _saved(TVMobileNetV2(10), tmp_path)
    with pytest.raises(ConfigError, match="layout"):
        imagenet_state(mobilenetv2(1.0, num_classes=10, input_size=32), f"torchvision:{path}")
    with pytest.raises(ConfigError, match="shape"):  # a file of another width
        imagenet_state(mobilenetv2(0.5, num_classes=10, input_size=32, layout="torchvision"), f"torchvision:{path}")
    with pytest.raises(ConfigError, match="missing"):  # a MobileNetV2 file for a ResNet
        imagenet_state(resnet_small(10, layout="torchvision"), f"torchvision:{path}")
    with pytest.raises(ConfigError, match="existing"):
        imagenet_state(mobilenetv2(1.0, num_classes=10, layout="torchvision"), f"torchvision:{tmp_path / 'none.pth'}")
    # a download that fails (nothing listens on port 9): one line with the URL and what to do offline
    with pytest.raises(ConfigError, match="download failed.*torchvision:PATH"):
        imagenet_state(mobilenetv2(1.0, num_classes=10, layout="torchvision"), "torchvision:http://127.0.0.1:9/w.pth")


def test_a_scenario_starts_from_torchvision_weights(make_scenario, tmp_path, monkeypatch):
    from fedelastic.environment import RunEnvironment
    from fedelastic.train.pretrain import initial_state

    monkeypatch.setenv("FEDELASTIC_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(0)
    path = tmp_path / "mobilenet_v2.pth"
    torch.save(TVMobileNetV2(1000).state_dict(), path)
    model = {"name": "mobilenetv2", "options": {"layout": "torchvision"}, "weights": f"torchvision:{path}"}
    env = RunEnvironment(make_scenario(data={"dataset": "synth_digits", "size": 400}, model=model))
    state = initial_state(env)
    saved = torch.load(path)
    assert torch.equal(state["block_16_project.weight"], saved["features.17.conv.2.weight"])
    assert state["dense.weight"].shape == (10, 1280)  # the scenario's 10 classes: a new head


def test_the_paper_regime_scenario_parses():
    import tomllib

    from fedelastic.comparisons.comparison import expand

    path = ROOT / "benchmarks" / "reproduce" / "closest_regime" / "paper_regime.toml"
    _, variants = expand(tomllib.loads(path.read_text()), str(path))
    assert len(variants) == 7 * 5  # seven strategies, five seeds
    sc = variants[0].scenario
    assert (sc.model.name, sc.model.weights, sc.model.options["layout"]) == ("resnet50", "torchvision", "torchvision")
    assert (sc.data.dataset, sc.data.image_size) == ("Donghyun99/CUB-200-2011", 224)
