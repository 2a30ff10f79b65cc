"""Describe a torch model as plain data for the cost model and the selectors.

:func:`describe` runs one forward pass with hooks and records, in forward order, every module
that owns parameters (a *layer*) and every weightless leaf module (an *op*: ReLU, pooling...).
The result, :class:`ModelInfo`, is pure Python/numpy: nothing downstream needs torch.

Functional operations inside a ``forward`` (a residual ``x + y``, an attention core's
``q @ k.T``, ``softmax`` and ``@ v``, ``F.scaled_dot_product_attention``, ``F.gelu``...) are not
seen by module hooks. :func:`describe` records them with a torch function mode (every torch call
made outside a leaf module's forward) as :class:`FunctionalOp` entries. It also counts the
forward's FLOPs as ``torch.utils.flop_counter.FlopCounterMode`` does (:func:`flop_count_mode`:
torch's FLOP formulas over the aten ops the forward runs) and warns when the layers and
functional ops it saw hold less than 90% of them (something else runs that nothing prices).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from functools import cache, cached_property
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch is imported only by describe(): the data classes stay torch-free
    import torch
    from torch import nn


@cache
def _module_types() -> tuple[tuple, tuple]:
    """(norm layer types, activation types whose backward needs only a one-bit mask)."""
    from torch import nn

    norms = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.LayerNorm, nn.GroupNorm, nn.InstanceNorm2d)
    cheap = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.Hardtanh, nn.Dropout, nn.Identity, nn.Flatten)
    return norms, cheap


@dataclass(frozen=True)
class LayerInfo:
    """A module that owns parameters; sizes are per sample."""

    name: str
    kind: str  # conv | linear | norm | attention | other
    macs: int
    in_numel: int
    out_numel: int
    out_channels: int
    tensors: tuple[int, ...]
    groups: int = 1  # conv groups: a grouped (depthwise) conv's output channel needs only its own inputs
    batch_stats: bool = False  # a BatchNorm (its statistics can be frozen); other norms normalise per sample
    # geometry, for the sampled kernel predictors (fedelastic.devices.kernelsample); 0: not recorded
    in_channels: int = 0  # conv in_channels, linear in_features, norm features
    kernel: int = 0  # conv kernel area (kh * kw)
    stride: int = 0  # conv stride area (sh * sw)


@dataclass(frozen=True)
class OpInfo:
    """A weightless leaf module; ``above`` is the index of the next layer toward the loss."""

    name: str
    kind: str  # mask (backward needs one bit per element) | saved (backward needs its input)
    in_numel: int
    out_numel: int
    above: int
    module: str = ""  # the module's class name (ReLU, MaxPool2d...), for the sampled kernel predictors


@dataclass(frozen=True)
class FunctionalOp:
    """A torch call made outside any leaf module (sizes per sample); ``above`` as in :class:`OpInfo`.

    ``kind``: ``matmul`` (batched matrix products; ``macs``), ``softmax`` (a row reduction),
    ``eltwise`` (adds, activations...), ``layout`` (copies: ``cat``, ``contiguous``...).
    """

    name: str
    kind: str
    macs: int
    in_numel: int
    out_numel: int
    above: int


#: the figures of :meth:`ModelInfo.shape`, in the order a mismatch is reported
SHAPE_FIGURES = ("input", "classes", "params", "macs")


@dataclass(frozen=True)
class ModelInfo:
    """Tensors and layers of a model, in forward order (index 0 is nearest the input)."""

    model_name: str
    layers: tuple[LayerInfo, ...]
    ops: tuple[OpInfo, ...]
    tensor_names: tuple[str, ...]
    tensor_roles: tuple[str, ...]  # weight | bias | norm_weight | norm_bias | other
    tensor_layer: np.ndarray
    tensor_numel: np.ndarray
    tensor_channels: np.ndarray  # size of dim 0 (output channels)
    functional: tuple[FunctionalOp, ...] = ()
    flop_counter_macs: int = 0  # per sample, FlopCounterMode's forward FLOPs / 2 (0: not counted)
    #: per layer (empty: none anywhere), the layers on a parallel branch whose dX a selection does not
    #: need when its deepest tensor is in this layer (a projection shortcut's main branch)
    parallel: tuple[tuple[int, ...], ...] = ()

    @property
    def num_tensors(self) -> int:
        return len(self.tensor_names)

    @cached_property  # asked per client and round (a reply's bytes down)
    def num_params(self) -> int:
        return int(self.tensor_numel.sum())

    def parallel_of_tensor(self) -> list[np.ndarray]:
        """Per tensor, the tensors of :attr:`parallel` layers of its layer (each a sorted index array)."""
        if not self.parallel:
            return [np.zeros(0, dtype=np.int64)] * self.num_tensors
        per_layer = [np.array(sorted(t for li in p for t in self.layers[li].tensors), np.int64) for p in self.parallel]
        return [per_layer[li] for li in self.tensor_layer]

    def layer_first_tensor(self) -> np.ndarray:
        return np.array([layer.tensors[0] for layer in self.layers], dtype=np.int64)

    def shape(self) -> dict[str, int]:
        """Per-sample figures a measured per-layer table must match (:data:`SHAPE_FIGURES`): the
        elements of the first layer's input (the input resolution), the last layer's output
        channels (the classes), the parameters and the layers' forward MACs (widths, resolution)."""
        if not self.layers:
            return {}
        return {
            "input": int(self.layers[0].in_numel),
            "classes": int(self.layers[-1].out_channels),
            "params": self.num_params,
            "macs": int(sum(layer.macs for layer in self.layers)),
        }

    @property
    def hooked_macs(self) -> int:
        """Forward MACs per sample of the layers and the functional matmuls."""
        return sum(layer.macs for layer in self.layers) + sum(op.macs for op in self.functional)

    @property
    def macs_coverage(self) -> float:
        """``hooked_macs`` over the FLOP counter's count (FlopCounterMode's; 1.0 when it was not counted)."""
        return self.hooked_macs / self.flop_counter_macs if self.flop_counter_macs else 1.0


#: Share of the forward's FLOPs (FlopCounterMode's count) below which :func:`describe` warns.
MIN_MACS_COVERAGE = 0.9

# functional torch calls by the kernel class that prices them (names as ``func.__name__``)
_FN_MATMUL = {"matmul", "__matmul__", "__rmatmul__", "bmm", "baddbmm", "einsum", "scaled_dot_product_attention"}
_FN_SOFTMAX = {"softmax", "log_softmax", "_softmax"}
_FN_ELTWISE = {
    "add", "__add__", "__radd__", "__iadd__", "sub", "__sub__", "__rsub__", "mul", "__mul__", "__rmul__",
    "__imul__", "div", "__truediv__", "__itruediv__", "relu", "relu_", "gelu", "silu", "sigmoid", "tanh",
    "hardswish", "hardtanh", "relu6", "dropout", "layer_norm", "exp", "sqrt", "rsqrt", "pow", "__pow__",
    "neg", "__neg__", "where", "clamp", "clip", "mean", "sum", "amax",
}  # fmt: skip
_FN_LAYOUT = {"cat", "stack", "contiguous", "clone", "repeat", "roll", "pad"}


def _matmul_macs(name: str, args: tuple, out) -> int:
    """MACs of a (batched) matrix product from its operands' shapes."""
    import torch

    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if name == "scaled_dot_product_attention" and len(tensors) >= 3:
        q, k, v = tensors[:3]
        # q @ k^T and softmax(.) @ v: [.., L, E] x [.., S, E] and [.., L, S] x [.., S, Ev]
        lead = int(np.prod(q.shape[:-2]))
        return lead * q.shape[-2] * k.shape[-2] * (q.shape[-1] + v.shape[-1])
    if name == "einsum" or out is None or len(tensors) < 2 or tensors[0].dim() == 0:
        return 0
    inner = tensors[0].shape[-1]
    return int(out.numel()) * int(inner)


def _fn_kind(name: str) -> str | None:
    if name in _FN_MATMUL:
        return "matmul"
    if name in _FN_SOFTMAX:
        return "softmax"
    if name in _FN_ELTWISE:
        return "eltwise"
    if name in _FN_LAYOUT:
        return "layout"
    return None


def _geometry(module: nn.Module) -> tuple[int, int, int]:
    """(in_channels, kernel area, stride area) of a layer (0 where it has none)."""
    shape = getattr(module, "normalized_shape", None)
    cin = getattr(module, "in_channels", getattr(module, "in_features", getattr(module, "num_features", 0)))
    cin = int(shape[-1]) if shape else int(cin or 0)
    kernel, stride = getattr(module, "kernel_size", None), getattr(module, "stride", None)
    return cin, int(np.prod(kernel)) if kernel else 0, int(np.prod(stride)) if stride else 0


def _kind(module: nn.Module) -> str:
    from torch import nn

    if isinstance(module, nn.modules.conv._ConvNd):
        return "conv"
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, _module_types()[0]):
        return "norm"
    if isinstance(module, nn.MultiheadAttention):
        return "attention"
    return "other"


# functional ops that do what a leaf module of that kind does: a leaf whose weights its parent
# passes to one of them is recorded there (anything else, e.g. MultiheadAttention's fused forward
# with its out_proj's weights, stays unreached and is refused)
_LEAF_OPS = {"linear": "linear", "conv1d": "conv", "conv2d": "conv", "conv3d": "conv"}


def _macs(module: nn.Module, kind: str, inp: torch.Tensor, out: torch.Tensor, batch: int) -> int:
    """Multiply-accumulates per sample of a batch of ``batch`` (a module may fold other axes into
    its tensors' first one, as Swin's windows do)."""
    if kind == "conv":
        kernel = int(np.prod(module.kernel_size))
        return out.numel() // batch * (module.in_channels // module.groups) * kernel
    if kind == "linear":
        return out.numel() // batch * module.in_features
    if kind == "attention":
        tokens, dim = inp.shape[1], module.embed_dim
        return 4 * tokens * dim * dim + 2 * tokens * tokens * dim
    return 0


def first_tensor(x) -> torch.Tensor | None:
    """The first tensor in ``x`` (a tensor, or nested tuples/lists), or None."""
    import torch

    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)):
        for item in x:
            found = first_tensor(item)
            if found is not None:
                return found
    return None


def flop_count_mode():
    """A torch dispatch mode whose ``flops`` sums torch's FLOP formulas over the aten ops run inside it.

    ``torch.utils.flop_counter.FlopCounterMode``'s total (its ``get_total_flops()``), counted the
    same way (each op decomposed first where it can be, then the formulas of
    ``torch.utils.flop_counter.flop_registry``, custom ones registered with
    ``register_flop_formula`` included), without its per-module tracking. FlopCounterMode's
    dispatch is wrapped in ``torch._disable_dynamo``, whose first call imports ``torch._dynamo``
    (~0.9 s of CPU in a fresh process, in every worker); this mode opts out of that wrapping.
    Higher-order operators (``torch.cond``, flex attention...) run uncounted.
    """
    import torch
    from torch._ops import HigherOrderOperator
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry

    device_op = torch.ops.prim.device.default

    class FlopCount(TorchDispatchMode):
        supports_higher_order_operators = True  # they run, uncounted

        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            return False  # no _disable_dynamo wrapper (torch >= 2.6): compiling is never asked for here

        def __init__(self) -> None:
            super().__init__()
            self.flops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if isinstance(func, HigherOrderOperator):
                return func(*args, **kwargs)
            if func is not device_op:  # FlopCounterMode's order: a composite op counts through its parts
                with self:
                    out = func.decompose(*args, **kwargs)
                if out is not NotImplemented:
                    return out
            out = func(*args, **kwargs)
            formula = flop_registry.get(func._overloadpacket)
            if formula is not None:
                self.flops += formula(*args, **kwargs, out_val=out)
            return out

    return FlopCount()


def describe(model: nn.Module, sample: torch.Tensor, model_name: str = "") -> ModelInfo:
    """Run ``model`` once on ``sample`` (batch >= 1) and describe it per sample."""
    import torch
    from torch import nn

    owners = [(name, mod) for name, mod in model.named_modules() if any(True for _ in mod.parameters(recurse=False))]
    owner_ids = {id(mod) for _, mod in owners}
    leaves = [(name, mod) for name, mod in model.named_modules() if not any(True for _ in mod.children())]
    seen: dict[int, tuple[int, str, nn.Module, int, int, int, int]] = {}
    calls: list[tuple[int, str, str, int, int, int]] = []  # order, name, kind, macs, in, out (per sample)
    io: dict[int, tuple] = {}  # module id -> (input, output) tensors (kept alive so ids stay unique)
    adds: list[tuple] = []  # the two tensor operands of each functional add
    order = [0]
    depth = [0]  # leaf modules running: a torch call at depth 0 is functional
    batch = sample.shape[0]

    def record(name: str, mod, args, out) -> None:
        if id(mod) in seen:
            return
        inp, o = first_tensor(args), first_tensor(out)
        in_n = inp.numel() // batch if inp is not None else 0
        out_n = o.numel() // batch if o is not None else 0
        kind = _kind(mod)
        macs = _macs(mod, kind, inp, o, batch) if (inp is not None and o is not None) else 0
        seen[id(mod)] = (order[0], name, mod, in_n, out_n, macs, o.shape[1] if o is not None and o.dim() > 1 else 1)
        io[id(mod)] = (inp, o)
        order[0] += 1

    def hook(name: str):
        def fn(mod, args, out):
            depth[0] -= 1
            record(name, mod, args, out)

        return fn

    # a leaf whose weights its parent passes to a functional call (Swin's attention calls
    # F.linear(x, self.qkv.weight, ...)) never runs its own forward: it is recorded at that call
    leaf_of = {id(p): (name, mod) for name, mod in leaves for p in mod.parameters(recurse=False)}

    def enter(_mod, _args):
        depth[0] += 1

    def pre_hook(name: str):
        def fn(mod, args):
            if id(mod) not in seen:  # non-leaf owners of direct params (e.g. a class token)
                n = sum(p.numel() for p in mod.parameters(recurse=False))
                seen[id(mod)] = (order[0], name, mod, n, n, 0, 1)
                order[0] += 1

        return fn

    from torch.overrides import TorchFunctionMode

    class Functional(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = getattr(func, "__name__", "")
            if depth[0] == 0 and name in _LEAF_OPS:  # the leaf's own op, called on its weights
                owner = next((leaf_of[id(a)] for a in args if id(a) in leaf_of), None)
                if owner is not None and id(owner[1]) not in seen and _kind(owner[1]) == _LEAF_OPS[name]:
                    record(*owner, args, out)
                    return out
            kind = _fn_kind(name) if depth[0] == 0 else None
            o = first_tensor(out) if kind else None
            if o is not None:
                i = first_tensor(args)
                pair = [a for a in args if isinstance(a, torch.Tensor)]
                if name in ("add", "__add__", "__radd__", "__iadd__") and len(pair) == 2:
                    adds.append((pair[0], pair[1]))
                macs = _matmul_macs(name, args, o) if kind == "matmul" else 0
                n_in = i.numel() if i is not None else 0
                calls.append((order[0], name, kind, macs // batch, n_in // batch, o.numel() // batch))
                order[0] += 1
                if name == "scaled_dot_product_attention" and i is not None:  # its softmax over the scores
                    k = first_tensor(args[1:])
                    scores = int(np.prod(i.shape[:-1])) * (k.shape[-2] if k is not None else i.shape[-2])
                    calls.append((order[0], "softmax", "softmax", 0, scores // batch, scores // batch))
                    order[0] += 1
            return out

    handles = []
    for name, mod in leaves:
        handles.append(mod.register_forward_pre_hook(enter))
        handles.append(mod.register_forward_hook(hook(name)))
    for name, mod in owners:
        if any(True for _ in mod.children()):
            handles.append(mod.register_forward_pre_hook(pre_hook(name)))
    was_training = model.training
    counter = flop_count_mode()
    try:
        model.eval()
        with torch.no_grad(), counter, Functional():
            model(sample)
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()

    names, roles, tlayer, numel, channels = [], [], [], [], []
    layers: list[LayerInfo] = []
    layer_io: list[tuple] = []
    ops_raw = []
    functional: list[FunctionalOp] = []
    call_at = {c[0]: c for c in calls}
    rows = sorted([*seen.values(), *((c[0], "", None, 0, 0, 0, 0) for c in calls)], key=lambda r: r[0])
    for at, name, mod, in_n, out_n, macs, out_ch in rows:
        if mod is None:
            _, fname, fkind, fmacs, fin, fout = call_at[at]
            functional.append(FunctionalOp(f"{fname}#{len(functional)}", fkind, fmacs, fin, fout, len(layers)))
            continue
        if id(mod) not in owner_ids:
            kind = "mask" if isinstance(mod, _module_types()[1]) else "saved"
            ops_raw.append((name, kind, in_n, out_n, len(layers), type(mod).__name__))
            continue
        kind = _kind(mod)
        idx = []
        for pname, p in mod.named_parameters(recurse=False):
            if kind == "norm":
                role = "norm_weight" if pname == "weight" else "norm_bias"
            elif kind in ("conv", "linear"):
                role = "bias" if pname == "bias" else "weight"
            else:
                role = "other"
            idx.append(len(names))
            names.append(f"{name}.{pname}" if name else pname)
            roles.append(role)
            tlayer.append(len(layers))
            numel.append(p.numel())
            channels.append(p.shape[0] if p.dim() > 0 else 1)
        groups = int(getattr(mod, "groups", 1)) if kind == "conv" else 1
        batch_stats = isinstance(mod, nn.modules.batchnorm._BatchNorm)
        layers.append(
            LayerInfo(
                name, kind, int(macs), int(in_n), int(out_n), int(out_ch), tuple(idx), groups, batch_stats,
                *_geometry(mod),
            )
        )  # fmt: skip
        layer_io.append(io.get(id(mod), (None, None)))
    missing = [n for n, p in model.named_parameters() if n not in set(names)]
    if missing:
        raise ValueError(f"parameters not reached by a forward pass: {missing[:5]}")
    ops = tuple(OpInfo(n, k, i, o, min(a, len(layers)), m) for n, k, i, o, a, m in ops_raw)
    fn_ops = tuple(replace(f, above=min(f.above, len(layers))) for f in functional)
    info = ModelInfo(
        model_name=model_name,
        layers=tuple(layers),
        ops=ops,
        tensor_names=tuple(names),
        tensor_roles=tuple(roles),
        tensor_layer=np.array(tlayer, dtype=np.int64),
        tensor_numel=np.array(numel, dtype=np.int64),
        tensor_channels=np.array(channels, dtype=np.int64),
        functional=fn_ops,
        parallel=_parallel_branches(layer_io, adds),
        flop_counter_macs=int(counter.flops) // 2 // batch,
    )
    if info.macs_coverage < MIN_MACS_COVERAGE:
        warnings.warn(
            f"describe({model_name or type(model).__name__}): the layers and functional ops seen hold "
            f"{info.macs_coverage:.0%} of the forward MACs torch's FLOP counter (FlopCounterMode) counts "
            f"({info.flop_counter_macs:,} per sample); the cost model does not price the rest",
            stacklevel=2,
        )
    return info


def _parallel_branches(layer_io: list[tuple], adds: list[tuple]) -> tuple[tuple[int, ...], ...]:
    """Per layer, the layers of the other branch of a residual add (see :attr:`ModelInfo.parallel`).

    For an add of the outputs of layers ``a < b``, the chain of layers ``s..a`` (each fed by the
    previous one's output) is a branch parallel to ``a+1..b`` when layer ``a+1`` reads the same tensor
    as layer ``s``: both branches fork from one tensor. A selection whose deepest tensor lies in
    ``s..a`` then needs no dX of ``a+1..b``. An identity shortcut (an operand no layer produced) and
    a chain that feeds the other branch give nothing.
    """
    producer = {id(o): li for li, (_, o) in enumerate(layer_io) if o is not None}
    parallel: list[tuple[int, ...]] = [() for _ in layer_io]
    for x, y in adds:
        if id(x) not in producer or id(y) not in producer:
            continue
        a, b = sorted((producer[id(x)], producer[id(y)]))
        if b <= a + 1:
            continue
        s = a
        while s > 0 and layer_io[s][0] is not None and layer_io[s][0] is layer_io[s - 1][1]:
            s -= 1
        fork = layer_io[s][0]
        if fork is None or layer_io[a + 1][0] is not fork:
            continue
        for li in range(s, a + 1):
            parallel[li] = tuple(range(a + 1, b + 1))
    return tuple(parallel) if any(parallel) else ()
