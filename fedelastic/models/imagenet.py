"""torchvision's ImageNet weights in fedelastic's own ResNet-50 and MobileNetV2 (no torchvision needed).

A model built with ``layout="torchvision"`` computes torchvision's function (ResNet v1.5 strides,
symmetric padding, BatchNorm epsilon 1e-5, ImageNet mean/std normalisation of [0, 1] inputs inside
the model). :func:`imagenet_state` reads torchvision's weight file (downloaded by URL into
``$FEDELASTIC_CACHE/weights``, or a local path) and renames its tensors to the model's Keras names.
The classifier is loaded only when its shape fits (1,000 classes); otherwise the model keeps its
own freshly initialised head, as a transfer run needs. Anything that does not fit is a ConfigError
naming the file, the tensor and what was expected.

A scenario starts from them with ``model.weights = "torchvision"`` (the model's default URL below)
or ``"torchvision:PATH_OR_URL"``, and ``model.options.layout = "torchvision"``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from ..errors import ConfigError
from .layout import ImageNetNorm
from .mobilenetv2 import MobileNetV2
from .resnet import ResNet

# torchvision's IMAGENET1K_V1 weights (top-1 76.13% and 71.88% at 224x224)
URLS = {
    "resnet50": "https://download.pytorch.org/models/resnet50-0676ba61.pth",
    "mobilenetv2": "https://download.pytorch.org/models/mobilenet_v2-b0353104.pth",
}
PREFIX = "torchvision"


def is_torchvision(weights: str) -> bool:
    """Whether ``model.weights`` asks for torchvision's weights (``torchvision`` or ``torchvision:PATH_OR_URL``)."""
    return weights == PREFIX or weights.startswith(PREFIX + ":")


def _bn(dst: str, src: str) -> dict[str, str]:
    return {
        f"{dst}.{k}": f"{src}.{k}" for k in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")
    }


def resnet_names(model: nn.Module) -> dict[str, str]:
    """Our ResNet's tensor names -> torchvision's (``layer{stage}.{block}.conv{k}`` ...)."""
    names = {
        "conv1_conv.weight": "conv1.weight",
        **_bn("conv1_bn", "bn1"),
        "dense.weight": "fc.weight",
        "dense.bias": "fc.bias",
    }
    for name, projection in model._plan:  # type: ignore[union-attr]
        stage, block = name.removeprefix("conv").split("_block")
        src = f"layer{int(stage) - 1}.{int(block) - 1}"
        for k in (1, 2, 3):
            names[f"{name}_{k}_conv.weight"] = f"{src}.conv{k}.weight"
            names.update(_bn(f"{name}_{k}_bn", f"{src}.bn{k}"))
        if projection:
            names[f"{name}_0_conv.weight"] = f"{src}.downsample.0.weight"
            names.update(_bn(f"{name}_0_bn", f"{src}.downsample.1"))
    return names


def mobilenetv2_names(model: nn.Module) -> dict[str, str]:
    """Our MobileNetV2's tensor names -> torchvision's (``features.{i}.conv.{j}`` ...)."""
    names = {"Conv1.weight": "features.0.0.weight", **_bn("bn_Conv1", "features.0.1")}
    for i, (prefix, expand, _, _) in enumerate(model._plan):  # type: ignore[union-attr]
        src = f"features.{i + 1}.conv"
        parts = [("expand", "0.0"), ("expand_BN", "0.1")] if expand else []
        d = 1 if expand else 0
        parts += [
            ("depthwise", f"{d}.0"),
            ("depthwise_BN", f"{d}.1"),
            ("project", f"{d + 1}"),
            ("project_BN", f"{d + 2}"),
        ]
        for ours, theirs in parts:
            if ours.endswith("BN"):
                names.update(_bn(prefix + ours, f"{src}.{theirs}"))
            else:
                names[f"{prefix}{ours}.weight"] = f"{src}.{theirs}.weight"
    last = f"features.{len(model._plan) + 1}"  # type: ignore[arg-type]
    names.update({"Conv_1.weight": f"{last}.0.weight", **_bn("Conv_1_bn", f"{last}.1")})
    names.update({"dense.weight": "classifier.1.weight", "dense.bias": "classifier.1.bias"})
    return names


def _family(model: nn.Module, src: str, key: str) -> tuple[str, dict[str, str]]:
    if not isinstance(model.input_norm, ImageNetNorm):
        raise ConfigError(src, "model.options", 'layout = "torchvision" for torchvision\'s weights', "layout 'keras'")
    if isinstance(model, ResNet):
        return "resnet50", resnet_names(model)
    if isinstance(model, MobileNetV2):
        return "mobilenetv2", mobilenetv2_names(model)
    raise ConfigError(
        src, key, "torchvision weights for a model they exist for: resnet50 or mobilenetv2", type(model).__name__
    )


def weights_dir() -> Path:
    return Path(os.environ.get("FEDELASTIC_CACHE", Path.home() / ".cache" / "fedelastic")) / "weights"


def read_torchvision(location: str, *, src: str, key: str) -> dict[str, torch.Tensor]:
    """torchvision's state dict from a URL (downloaded once into :func:`weights_dir`) or a local file."""
    if location.startswith(("http://", "https://")):
        try:
            return torch.hub.load_state_dict_from_url(
                location, model_dir=str(weights_dir()), map_location="cpu", progress=False, weights_only=True
            )
        except Exception as exc:  # noqa: BLE001 (no network, a 404, a bad hash: one line with the cause)
            why = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            raise ConfigError(
                src, key, f"torchvision weights downloadable from {location} (download failed: {type(exc).__name__}: "
                f"{why}); without a network, fetch the file elsewhere and give its path as 'torchvision:PATH'",
                location,
            ) from None  # fmt: skip
    path = Path(location).expanduser()
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ConfigError(src, key, "an existing torchvision weights file (or an https:// URL)", str(path)) from None
    except Exception as exc:  # noqa: BLE001
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise ConfigError(src, key, f"a torch state_dict loadable with weights_only=True ({why})", str(path)) from None
    if not isinstance(state, dict):
        raise ConfigError(src, key, "a state_dict (a dict of tensors)", f"{path}: {type(state).__name__}")
    return state


def imagenet_state(model: nn.Module, weights: str = PREFIX, *, src: str = "<weights>", key: str = "model.weights"):
    """``model``'s state dict filled from torchvision's ImageNet weights, and the names kept from ``model``.

    ``weights``: ``torchvision`` (the model's URL in :data:`URLS`), ``torchvision:URL`` or
    ``torchvision:PATH`` (or a bare URL or path). Kept from ``model``: the conv biases torchvision
    has none of (set to 0), and the classifier when the file's has another shape (a new task's head).
    """
    family, names = _family(model, src, key)
    location = weights.removeprefix(PREFIX).removeprefix(":") or URLS[family]
    theirs = read_torchvision(location, src=src, key=key)
    ours = model.state_dict()
    out, kept = {}, []
    for name, value in ours.items():
        source = names.get(name)
        if source is None:  # a conv bias (ResNet's Keras layout has them; torchvision's convs do not)
            out[name], _ = torch.zeros_like(value), kept.append(name)
            continue
        if source not in theirs and name.endswith("num_batches_tracked"):  # older files have none
            out[name] = value
            continue
        if source not in theirs:
            raise ConfigError(
                src, key, f"torchvision's {family} weights: tensor {source} (for {name}) is missing", location
            )
        got = theirs[source]
        if name.startswith("dense.") and tuple(got.shape) != tuple(value.shape):
            out[name], _ = value, kept.append(name)  # a new task's head
            continue
        if tuple(got.shape) != tuple(value.shape):
            raise ConfigError(
                src, key, f"tensor {source} of shape {tuple(value.shape)} (for {name}: a {family} of the model's width)",
                f"{location}: shape {tuple(got.shape)}",
            )  # fmt: skip
        out[name] = got.to(value.dtype)
    unused = sorted(set(theirs) - set(names.values()))
    if unused:
        raise ConfigError(
            src, key, f"torchvision's {family} weights only ({len(unused)} tensors have no place in the model)",
            f"{location}: {', '.join(unused[:3])}{'...' if len(unused) > 3 else ''}",
        )  # fmt: skip
    return out, kept
