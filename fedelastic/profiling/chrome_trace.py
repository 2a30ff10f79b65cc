"""Import measured per-layer training times from Chrome-trace files.

Two producers are understood, detected from the events:

**TensorFlow profiler** (e.g. the Jetson TX2 traces in ``shared/data/measured``). Ops are the
``"X"`` events of the thread named ``TensorFlow Ops``; ``args.long_name`` holds
``<scope path>:<op type>``. Steps are the events of the thread named ``Steps``.

**torch.profiler**, as written by ``fedelastic profile measure``: regions recorded with
``torch.profiler.record_function(f"fedelastic::{layer}::{phase}")``, phase in ``fwd``, ``dx``,
``dw``, on any thread (if CUDA copies of the regions, category ``gpu_user_annotation``, exist,
only those are used). Steps are ``fedelastic::step`` regions, or ``ProfilerStep#N`` events.
Regions must not nest.

Name contract
-------------
Table keys are the PyTorch qualified module names of the project model's layers (the modules
that own parameters directly, in ``named_modules()`` order; see :func:`trainable_layer_names`).
The project models in :mod:`fedelastic.models` are named after the Keras layers, so a layer's
Keras scope is its torch name with ``.`` replaced by ``/`` (``conv2_block1_1_conv``,
``Transformer/encoderblock_0/MultiHeadDotProductAttention_1/query``). A TensorFlow op belongs
to the layer whose scope appears as a run of whole components in the op's scope path (longest
match wins), after dropping the ``gradient_tape/`` prefix and undoing vit-keras' MLP naming
(``.../MlpBlock_3/Transformer/encoderblock_0/Dense_0`` is read as ``.../MlpBlock_3/Dense_0``).

Attribution rules (TensorFlow traces)
-------------------------------------
- Backward ops are those under ``gradient_tape/`` plus the root-level ``AddN`` ops (and their
  layout transposes) with which TensorFlow sums the gradients of tensors that fan out. All
  other ops are forward, except data augmentation (Keras ``random_flip``, ``random_rotation``,
  ... layers), which counts as *other*.
- A layer's backward op is a weight-gradient op (``dw``) if it is a ``...BackpropFilter``, a
  ``BiasAddGrad``, the second MatMul of a Dense gradient (TensorFlow builds dX as ``MatMul``
  and dW as ``MatMul_1``), the gamma/beta reductions of a LayerNormalization, the batch sum of
  a broadcast parameter (position embedding, class token); otherwise it is ``dx``.
  ``FusedBatchNormGrad*`` computes both: a share :data:`FUSED_BN_GRAD_DX_SHARE` of its time is
  ``dx`` and the rest ``dw``. (In the TX2 traces, BN runs in inference mode; its gradient
  kernels are two channel reductions, for gamma and beta, plus one elementwise pass for dX,
  which takes about a third of the time.)
- Weightless ops (ReLU, add, pad, pooling, softmax, GELU, gradient sums...) are charged to
  the *nearest trainable layer above them*, i.e. closer to the loss. Forward: the ops of a
  weightless Keras layer (the outermost scope of the op that encloses no trainable layer, e.g.
  ``conv2_block1_out`` or ``dropout``) go to the next trainable layer whose forward op runs
  after the last of them (set ``charge_weightless_fwd=False`` to keep them in
  ``unattributed_fwd_s`` instead). Backward: to the ``dx`` of the layer their forward
  counterpart (the forward ops with the longest common scope) went to or, when that is
  ambiguous or missing (``AddN``, fused forward ops), of the layer whose backward op ran last
  before them. So a layer's ``dx`` is the time to pass the gradient from its output through it
  and through the weightless ops below it, down to the next trainable layer.
- What has no trainable layer above it (the loss and its gradient) is *unattributed*.
- Ops TensorFlow fused stay with the scope they carry: in the TX2 ResNet-50 most
  ``BN + add + ReLU`` run as one ``_FusedBatchNormEx`` in the BN's scope, so that forward
  time is the BN layer's.
- Each op belongs to the step whose ``[ts, ts + dur)`` contains its start; the last step is
  dropped (partial) unless ``drop_last_step=False``; per-layer times are medians over the
  remaining steps, and so are the totals. ``other_s`` is the rest of the step: augmentation,
  anything else outside forward and backward, and idle gaps between ops. Per step, the layer
  times plus the unattributed times equal forward plus backward exactly; with medians taken
  separately, the identity holds to within the step-to-step spread.

All times are in seconds.
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..devices.profile import LayerTiming, MeasuredTable

__all__ = [
    "FUSED_BN_GRAD_DX_SHARE",
    "import_trace",
    "keras_scope",
    "load_trace_events",
    "MODEL_ALIASES",
    "project_layer_names",
    "trainable_layer_names",
]

#: Share of a ``FusedBatchNormGrad`` op's time charged to dX (the rest is dW of gamma/beta).
FUSED_BN_GRAD_DX_SHARE = 1.0 / 3.0

#: Model names of trace files that differ from the built-in names of :mod:`fedelastic.models`.
MODEL_ALIASES: dict[str, str] = {"vit": "vit_b16"}

_US = 1e-6  # Chrome-trace times are microseconds
_PHASES = ("fwd", "dx", "dw")
_AUGMENTATION = re.compile(r"random_(flip|rotation|zoom|crop|translation|contrast|brightness|height|width)(_\d+)?")
_GRAD_SUM = re.compile(r"AddN(_\d+)?(-.*)?")  # root-level gradient aggregation (+ layout transposes)
_VIT_KERAS_MLP = re.compile(r"/(MlpBlock_\d+)/[^/]+/encoderblock_\d+/")
_DW = re.compile(
    r"BackpropFilter"  # Conv2D / DepthwiseConv2dNative kernel gradient and its layout transposes
    r"|BiasAddGrad"  # bias gradient
    r"|(^|/)MatMul_1:MatMul$"  # Dense / Tensordot kernel gradient (dX is MatMul, dW is MatMul_1)
    r"|^batchnorm/mul/(Mul_1|Sum_1):"  # LayerNormalization gamma gradient
    r"|^batchnorm/sub/Sum:"  # LayerNormalization beta gradient
    r"|^add/Sum:"  # broadcast-added parameter (position embedding)
    r"|^(Sum|Slice):"  # class token: its slice of the concat gradient, summed over the batch
)
_BN_GRAD = re.compile(r"FusedBatchNormGrad")
_LAYOUT_COPY = "LayoutOptimizer"  # in the names of the transposes TensorFlow's layout optimizer inserts
# op types that compute a parameter gradient whatever the layer: every one must have an owner
_PARAM_GRAD_TYPES = frozenset(
    {
        "Conv2DBackpropFilter",
        "DepthwiseConv2dNativeBackpropFilter",
        "BiasAddGrad",
        "FusedBatchNormGrad",
        "FusedBatchNormGradV2",
        "FusedBatchNormGradV3",
    }
)


def load_trace_events(path: str | Path) -> list[dict[str, Any]]:
    """Read the events of a Chrome-trace file (``.json`` or ``.json.gz``).

    Accepts both the object form (``{"traceEvents": [...]}``) and the bare array form.
    """
    import zlib

    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise
    except (OSError, EOFError, ValueError, zlib.error) as exc:  # a corrupt or cut gzip, not JSON, not UTF-8
        raise ValueError(f"{path}: not a readable Chrome trace ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})") from None
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ValueError(f"{path}: 'traceEvents' is not a list")
    if not all(isinstance(e, dict) for e in events):
        raise ValueError(f"{path}: trace events that are JSON objects (got {next(e for e in events if not isinstance(e, dict))!r})")
    return events


def trainable_layer_names(model: Any) -> list[str]:
    """Qualified names of the modules that own parameters directly, in ``named_modules()`` order.

    Works on any ``torch.nn.Module`` (duck-typed, so this module does not import torch).
    """
    return [
        name
        for name, module in model.named_modules()
        if name and next(iter(module.parameters(recurse=False)), None) is not None
    ]


def project_layer_names(model: str) -> list[str]:
    """Layer names of a project model: a built-in name of :mod:`fedelastic.models` (or an alias
    from :data:`MODEL_ALIASES`) or a ``"package.module:callable"`` factory.

    Builds the model with its default arguments on PyTorch's meta device (no memory used).
    """
    import torch  # only here: the importer itself needs no torch

    from ..models import BUILTIN, resolve_factory

    name = MODEL_ALIASES.get(model, model)
    if name not in BUILTIN and ":" not in name:
        raise ValueError(f"no project model named {model!r}; built-in: {sorted(BUILTIN)} (or pass layers=...)")
    factory = resolve_factory(name, context="import_trace", key="model")
    with torch.device("meta"):
        return trainable_layer_names(factory())


def keras_scope(name: str) -> str:
    """Keras scope of the project layer with torch qualified ``name`` (``.`` becomes ``/``)."""
    return name.replace(".", "/")


def import_trace(
    path: str | Path,
    *,
    model: str,
    batch_size: int,
    source: str | None = None,
    layers: Sequence[str] | None = None,
    charge_weightless_fwd: bool = True,
    drop_last_step: bool | None = None,
    strict: bool = True,
) -> MeasuredTable:
    """Build a :class:`MeasuredTable` from a Chrome-trace file.

    Parameters
    ----------
    path : str or Path
        ``.json`` or ``.json.gz`` trace.
    model : str
        Model name stored in the table; for TensorFlow traces it also selects the project model
        whose layer names key the table, unless ``layers`` is given.
    batch_size : int
        Batch size of the measured steps.
    source : str, optional
        Provenance text; defaults to the file name.
    layers : sequence of str, optional
        Torch layer names in forward order (default: :func:`project_layer_names` of ``model``
        for TensorFlow traces, the names found in the trace for PyTorch traces).
    charge_weightless_fwd : bool
        Charge the forward time of weightless ops to the next trainable layer (default) or keep
        it in ``unattributed_fwd_s``. TensorFlow traces only.
    drop_last_step : bool, optional
        Drop the last step as partial. Default: True for TensorFlow traces, False for PyTorch.
    strict : bool
        Raise ``ValueError`` if a layer has no forward op in the trace, or (TensorFlow) if a
        parameter-gradient op belongs to no layer, i.e. if the trace and the model disagree.

    Returns
    -------
    MeasuredTable
    """
    events = load_trace_events(path)
    src = source if source is not None else Path(path).name
    if any(str(e.get("name", "")).startswith("fedelastic::") for e in events):
        table = _import_torch(events, model, batch_size, src, layers, bool(drop_last_step), strict)
        if not table.layers:
            raise ValueError(f"{path}: no layer regions ('fedelastic::<layer>::fwd|dx|dw'): nothing to measure")
        return table
    threads = _thread_names(events)
    if "TensorFlow Ops" not in threads.values():
        raise ValueError(f"{path}: neither a TensorFlow trace ('TensorFlow Ops' thread) nor fedelastic regions")
    names = list(layers) if layers is not None else project_layer_names(model)
    drop = True if drop_last_step is None else drop_last_step
    return _import_tensorflow(events, threads, model, batch_size, src, names, charge_weightless_fwd, drop, strict)


# ----------------------------------------------------------------------------- helpers


def _thread_names(events: Iterable[dict[str, Any]]) -> dict[tuple[Any, Any], str]:
    return {
        (e.get("pid"), e.get("tid")): str(e.get("args", {}).get("name", ""))
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }


def _complete(events: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e.get("ph") == "X" and "ts" in e]


def _step_windows(steps: list[dict[str, Any]], drop_last: bool) -> tuple[np.ndarray, int]:
    """All steps as a sorted ``[n, 2]`` array of (start, end) in µs, and how many to keep."""
    windows = np.asarray(
        sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in steps), dtype=float
    ).reshape(-1, 2)
    n_keep = len(windows) - 1 if drop_last else len(windows)
    if n_keep < 1:
        raise ValueError(f"the trace has no complete step ({len(windows)} step events)")
    return windows, n_keep


def _step_of(ts: float, windows: np.ndarray, contained: bool) -> int:
    """Index of the last step starting at or before ``ts`` (-1 if none or, if ``contained``, past its end)."""
    i = int(np.searchsorted(windows[:, 0], ts, side="right")) - 1
    if i < 0 or (contained and ts >= windows[i, 1]):
        return -1
    return i


def _match_layer(parts: list[str], scopes: dict[tuple[str, ...], str]) -> tuple[str | None, int, int]:
    """Longest run ``parts[i:j]`` that is a layer scope: (name, i, j), or (None, 0, 0)."""
    best: tuple[str | None, int, int] = (None, 0, 0)
    for i in range(len(parts)):
        for j in range(len(parts), i + (best[2] - best[1]), -1):
            name = scopes.get(tuple(parts[i:j]))
            if name is not None:
                best = (name, i, j)
                break
    return best


@dataclass(frozen=True)
class _Op:
    """What an op's ``long_name`` says about it."""

    phase: str  # "fwd", "bwd" or "other"
    parts: tuple[str, ...]  # scope path (no gradient_tape/, no op type)
    owner: str | None  # layer that owns it
    root: tuple[str, ...]  # path components before the owner's scope
    dx_share: float  # backward ops of an owner: share charged to dx (rest dw)
    param_grad: bool  # computes a parameter gradient whatever the layer


def _classify(long_name: str, op_type: str, scopes: dict[tuple[str, ...], str]) -> _Op:
    path, _, typ = long_name.rpartition(":")
    if not path:
        path, typ = long_name, op_type
    grad = path.startswith("gradient_tape/")
    if grad:
        path = path[len("gradient_tape/") :]
    path = _VIT_KERAS_MLP.sub(r"/\1/", path)
    parts = path.split("/")
    if _GRAD_SUM.fullmatch(parts[0]):
        grad = True
    if not grad and any(_AUGMENTATION.fullmatch(p) for p in parts):
        return _Op("other", tuple(parts), None, (), 0.0, False)
    owner, i, j = _match_layer(parts, scopes)
    param_grad = grad and (typ in _PARAM_GRAD_TYPES or (typ == "MatMul" and parts[-1] == "MatMul_1"))
    dx_share = 1.0
    if grad and owner is not None:
        remainder = "/".join(parts[j:]) + ":" + typ
        if _BN_GRAD.search(remainder):
            dx_share = FUSED_BN_GRAD_DX_SHARE
        elif _DW.search(remainder):
            dx_share = 0.0
    return _Op("bwd" if grad else "fwd", tuple(parts), owner, tuple(parts[:i]), dx_share, param_grad)


def _import_tensorflow(
    events: list[dict[str, Any]],
    threads: dict[tuple[Any, Any], str],
    model: str,
    batch_size: int,
    source: str,
    names: list[str],
    charge_weightless_fwd: bool,
    drop_last: bool,
    strict: bool,
) -> MeasuredTable:
    scopes = {tuple(keras_scope(n).split("/")): n for n in names}
    index = {n: k for k, n in enumerate(names)}
    complete = _complete(events)
    ops = [e for e in complete if threads.get((e.get("pid"), e.get("tid"))) == "TensorFlow Ops"]
    steps = [e for e in complete if threads.get((e.get("pid"), e.get("tid"))) == "Steps"]
    windows, n_steps = _step_windows(steps, drop_last)

    cache: dict[tuple[str, str], _Op] = {}
    per_step: list[list[tuple[float, float, _Op]]] = [[] for _ in range(n_steps)]
    for e in ops:
        key = (str(e.get("args", {}).get("long_name", e.get("name", ""))), str(e.get("name", "")))
        op = cache.get(key)
        if op is None:
            op = cache[key] = _classify(key[0], key[1], scopes)
        s = _step_of(float(e["ts"]), windows, contained=True)
        if 0 <= s < n_steps:
            per_step[s].append((float(e["ts"]), float(e.get("dur", 0.0)) * _US, op))

    if strict:
        seen = {op.owner for op in cache.values() if op.phase == "fwd" and op.owner is not None}
        missing = [n for n in names if n not in seen]
        orphans = sorted({"/".join(op.parts) for op in cache.values() if op.param_grad and op.owner is None})
        if missing or orphans:
            raise ValueError(
                f"trace and model {model!r} disagree: layers without forward ops {missing[:10]}"
                f"{' ...' if len(missing) > 10 else ''}; parameter-gradient ops of unknown layers "
                f"{orphans[:10]}{' ...' if len(orphans) > 10 else ''}"
            )
    owned = [op for op in cache.values() if op.owner is not None]
    roots = {op.root for op in owned}
    model_heads = {(op.root + op.parts)[0] for op in owned}
    # scopes that enclose a layer (model, backbone, encoder block, attention...)
    layer_paths = {op.root + tuple(keras_scope(op.owner).split("/")) for op in owned if op.owner}
    containers = {path[:k] for path in layer_paths for k in range(1, len(path))}

    def group(op: _Op) -> tuple[str, ...]:
        """The weightless Keras layer of an op: its outermost scope that encloses no layer."""
        k = 1
        while k < len(op.parts) and op.parts[:k] in containers:
            k += 1
        return op.parts[:k]

    times = np.zeros((n_steps, len(names), 3))
    totals = np.zeros((n_steps, 5))  # step, fwd, bwd, unattributed fwd, unattributed bwd
    for s, step_ops in enumerate(per_step):
        step_ops.sort(key=lambda t: t[0])
        totals[s, 0] = (windows[s, 1] - windows[s, 0]) * _US
        fwd = [(d, op) for _, d, op in step_ops if op.phase == "fwd"]
        bwd = [(d, op) for _, d, op in step_ops if op.phase == "bwd"]
        totals[s, 1] = sum(d for d, _ in fwd)
        totals[s, 2] = sum(d for d, _ in bwd)

        # forward: a weightless layer goes to the next trainable layer that runs after its last op
        next_owner: list[str | None] = [None] * len(fwd)
        upcoming: str | None = None
        for k in range(len(fwd) - 1, -1, -1):
            next_owner[k] = upcoming
            upcoming = fwd[k][1].owner or upcoming
        last_of_group = {group(op): k for k, (_, op) in enumerate(fwd) if op.owner is None}
        prefix_targets: dict[tuple[str, ...], set[str | None]] = {}
        for d, op in fwd:
            if op.owner is not None:
                times[s, index[op.owner], 0] += d
                continue
            charged = next_owner[last_of_group[group(op)]] if op.parts[0] in model_heads else None
            for k in range(1, len(op.parts) + 1):
                prefix_targets.setdefault(op.parts[:k], set()).add(charged)
            if charged is not None and charge_weightless_fwd:
                times[s, index[charged], 0] += d
            else:
                totals[s, 3] += d

        # backward: weightless ops go to the dx of the layer their forward counterpart went to,
        # else to the layer whose backward op ran last before them
        last: str | None = None
        for d, op in bwd:
            if op.owner is not None:
                last = op.owner
                times[s, index[op.owner], 1] += d * op.dx_share
                times[s, index[op.owner], 2] += d * (1.0 - op.dx_share)
                continue
            charged = last
            if op.parts[0] in model_heads:
                for k in range(len(op.parts), 0, -1):
                    found = prefix_targets.get(op.parts[:k])
                    if found is not None:
                        if len(found) == 1 and op.parts[:k] not in roots:
                            charged = next(iter(found))
                        break
            elif not _GRAD_SUM.fullmatch(op.parts[0]):
                charged = None  # outside the model: the loss gradient
            if charged is None:
                totals[s, 4] += d
            else:
                times[s, index[charged], 1] += d

    table = _table(model, batch_size, source, names, times, totals, n_steps)
    return replace(table, layout_transposes=any(_LAYOUT_COPY in key[0] for key in cache))


def _table(
    model: str,
    batch_size: int,
    source: str,
    names: list[str],
    times: np.ndarray,
    totals: np.ndarray,
    n_steps: int,
) -> MeasuredTable:
    med = np.median(times, axis=0)
    tot = np.median(totals, axis=0)
    other = float(np.median(totals[:, 0] - totals[:, 1] - totals[:, 2]))
    return MeasuredTable(
        model=model,
        batch_size=batch_size,
        source=source,
        layers={n: LayerTiming(float(med[k, 0]), float(med[k, 1]), float(med[k, 2])) for k, n in enumerate(names)},
        step_s=float(tot[0]),
        forward_s=float(tot[1]),
        backward_s=float(tot[2]),
        other_s=other,
        unattributed_fwd_s=float(tot[3]),
        unattributed_bwd_s=float(tot[4]),
        n_steps=n_steps,
    )


def _import_torch(
    events: list[dict[str, Any]],
    model: str,
    batch_size: int,
    source: str,
    layers: Sequence[str] | None,
    drop_last: bool,
    strict: bool,
) -> MeasuredTable:
    complete = _complete(events)
    regions = [
        e for e in complete if str(e.get("name", "")).startswith("fedelastic::") and e["name"] != "fedelastic::step"
    ]
    if any(e.get("cat") == "gpu_user_annotation" for e in regions):
        regions = [e for e in regions if e.get("cat") == "gpu_user_annotation"]
    steps = [e for e in complete if e.get("name") == "fedelastic::step"] or [
        e for e in complete if re.fullmatch(r"ProfilerStep#\d+", str(e.get("name", "")))
    ]
    if not steps:
        raise ValueError("PyTorch trace without 'fedelastic::step' or 'ProfilerStep#N' events")
    cats = {e.get("cat") for e in regions}
    steps = [e for e in steps if e.get("cat") in cats] or steps  # one copy of each step
    windows, n_steps = _step_windows(steps, drop_last)

    parsed: list[tuple[float, str, str, float]] = []
    for e in regions:
        _, layer, phase = (str(e["name"]).split("::") + ["", ""])[:3]
        if phase not in _PHASES or not layer:
            raise ValueError(f"bad fedelastic region name {e['name']!r}: expected 'fedelastic::<layer>::fwd|dx|dw'")
        parsed.append((float(e["ts"]), layer, phase, float(e.get("dur", 0.0)) * _US))
    parsed.sort()
    found = list(dict.fromkeys(layer for _, layer, _, _ in parsed))
    names = list(layers) if layers is not None else found
    if strict:
        missing = [n for n in names if n not in found]
        unknown = [n for n in found if n not in set(names)]
        if missing or unknown:
            raise ValueError(f"trace and layers disagree: missing {missing[:10]}, unknown {unknown[:10]}")
    index = {n: k for k, n in enumerate(names)}
    times = np.zeros((n_steps, len(names), 3))
    totals = np.zeros((n_steps, 5))
    totals[:, 0] = (windows[:n_steps, 1] - windows[:n_steps, 0]) * _US
    for ts, layer, phase, dur in parsed:
        s = _step_of(ts, windows, contained=False)
        if not 0 <= s < n_steps or layer not in index:
            continue
        p = _PHASES.index(phase)
        times[s, index[layer], p] += dur
        totals[s, 1 if p == 0 else 2] += dur
    return _table(model, batch_size, source, names, times, totals, n_steps)
