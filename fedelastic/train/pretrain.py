"""The starting weights of a run: factory init, a user's weights file, or a cached pretrain.

Pretraining trains centrally on a *source* task (some classes, or a clean domain) drawn from the
run's training split only, so the server's test set is never seen. The weights are cached under
``$FEDELASTIC_CACHE`` (default ``~/.cache/fedelastic``) by a hash of everything that shapes them,
and always loaded with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..config import to_dict
from ..data.registry import is_plugin
from ..errors import ConfigError
from ..models.imagenet import imagenet_state, is_torchvision
from .optim import SGD
from .trainer import batches, seed_everything, torch_threads

if TYPE_CHECKING:
    from ..environment import RunEnvironment


def cache_dir() -> Path:
    return Path(os.environ.get("FEDELASTIC_CACHE", Path.home() / ".cache" / "fedelastic"))


def load_weights(path: str | Path, model: torch.nn.Module, *, src: str, key: str = "model.weights") -> dict:
    """Load a state dict with ``weights_only=True`` and check it matches ``model``."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ConfigError(src, key, "an existing weights file", str(path)) from None
    except Exception as exc:  # torch's refusal runs to many lines: its first says why
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(src, key, f"a torch state_dict loadable with weights_only=True ({why})", str(path)) from None
    expected = model.state_dict()
    if not isinstance(state, dict) or set(state) != set(expected):
        got = set(state) if isinstance(state, dict) else type(state).__name__
        raise ConfigError(src, key, f"a state_dict with the model's keys ({len(expected)} tensors)", f"{path}: {got}")
    for name, value in state.items():
        if tuple(value.shape) != tuple(expected[name].shape):
            raise ConfigError(src, key, f"tensor {name} of shape {tuple(expected[name].shape)}", tuple(value.shape))
    return state


def pretrain_key(env: RunEnvironment) -> str:
    """The cache key: a hash of everything that shapes the pretrained weights (the pretraining
    config, model, data and the seed of pretraining and split: ``Scenario.split_seed``)."""
    sc = env.scenario
    model = to_dict(sc.model)
    (model["pretrain"] or {}).pop("seed", None)  # the seed that counts is split_seed (keys of older caches unchanged)
    doc = {
        "model": model,
        "dataset": sc.data.dataset,
        "test_fraction": sc.data.test_fraction,
        "seed": sc.split_seed,
    }
    if sc.data.size:  # a generated set of another size is other data (0 keeps older keys unchanged)
        doc["size"] = sc.data.size
    if not is_plugin(sc.data.dataset):  # what shapes an external dataset's training split
        doc["external"] = [sc.data.classes, sc.data.image_column, sc.data.label_column, sc.data.image_size]
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def pretrain(env: RunEnvironment) -> dict:
    """Train centrally on the source task, on ``simulation.torch_threads`` threads; returns the state dict."""
    with torch_threads(env.scenario.simulation.torch_threads):
        return _pretrain(env)


def _pretrain(env: RunEnvironment) -> dict:
    from .trainer import evaluate_model  # noqa: PLC0415 (training imports torch: loaded when needed)

    sc, cfg = env.scenario, env.scenario.model.pretrain
    source = env.view(env.split[0], cfg.classes, cfg.transform)  # the training split only
    rng = seed_everything([sc.split_seed, 0x9E])
    model = env.new_model()
    opt = SGD(model.parameters(), lr=cfg.lr, momentum=0.9, weight_decay=5e-4)  # torch's SGD, bit for bit
    x, y = torch.from_numpy(source.x), torch.from_numpy(source.y)
    model.train()
    per_epoch = -(-len(source) // cfg.batch_size)
    print(f"pretraining {sc.model.name} on {len(source)} source samples for {cfg.epochs} epochs", flush=True)
    for step, idx in enumerate(batches(len(source), cfg.batch_size, cfg.epochs, rng)):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
        if (step + 1) % per_epoch == 0 and ((step + 1) // per_epoch) % max(1, cfg.epochs // 10) == 0:
            print(f"  epoch {(step + 1) // per_epoch}/{cfg.epochs}: loss {loss.item():.3f}", flush=True)
    accuracy, _ = evaluate_model(model, source.x, source.y)
    print(f"pretrained {sc.model.name} on {len(source)} source samples: train accuracy {accuracy:.3f}")
    return model.state_dict()


def initial_state(env: RunEnvironment) -> dict:
    """The run's starting state dict."""
    sc = env.scenario
    model = env.new_model()
    if is_torchvision(sc.model.weights):
        return imagenet_state(model, sc.model.weights, src=sc.source or "<scenario>")[0]
    if sc.model.weights:
        return load_weights(sc.model.weights, model, src=sc.source or "<scenario>")
    if sc.model.pretrain is None:
        return model.state_dict()
    path = cache_dir() / "pretrained" / f"{sc.model.name.replace(':', '_')}-{pretrain_key(env)}.pt"
    if path.exists():
        print(f"pretrained weights from the cache: {path}", flush=True)
        return load_weights(path, model, src=str(path), key="<cached pretrain>")
    state = pretrain(env)
    print(f"pretrained weights cached at {path}", flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # two runs pretraining at once must not share it
    torch.save(state, tmp)
    os.replace(tmp, path)
    return load_weights(path, model, src=str(path), key="<cached pretrain>")
