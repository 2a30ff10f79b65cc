"""Device training numerics: int8 (and fp16) training emulated on an fp32 host.

A client whose device profile trains in ``int8`` (MCUs) or ``fp16`` trains with that dtype's
numerics; ``fp32`` devices are untouched (bit-identical to no emulation). The host computes in
fp32 and emulates the dtype with fake quantisation and straight-through estimators (STE). The
int8 rules follow the simulation code of Lin et al., "On-Device Training Under 256KB Memory"
(NeurIPS 2022), mit-han-lab/tiny-training (commit 7bf8e05), ``algorithm/quantize/quantized_ops_diff.py`` (the
quantised conv and its backward), ``algorithm/quantize/quantize_helper.py`` (``get_weight_scales``)
and ``algorithm/core/optimizer/sgd_scale.py`` (QAS):

* **Weights**: symmetric int8 per output channel, ``s_W[c] = max|W[c]| / 127``, computed from the
  weights the client received at the start of its local training and then fixed (the paper's
  scales are fixed after post-training quantisation). The forward uses ``s_W * round(W / s_W)``
  (not saturated, as the paper's ``weight.round()``: the received weights lie in [-127, 127]
  steps, and a weight trained past them stays representable); the gradient passes straight
  through.
* **Activations**: the input of every conv/linear layer is int8 per tensor, asymmetric
  (a zero point, as the paper's ``zero_x``): ``s_x = (max(x, 0) - min(x, 0)) / 255``,
  ``z = -128 - round(min(x, 0) / s_x)``, calibrated on the first batch the layer sees in the
  local training and then fixed. Values outside the range clip; their gradient is zero (the
  paper's ``_TruncateActivationRange``), the others pass straight through.
* **Biases** of conv/linear layers are int32 in units of ``s_W * s_x`` (rounded in the forward).
* **The head** (the model's last conv/linear layer) keeps fp32 weights and gradients on int8
  input features, like the paper's default ``mcu_head_type: fp`` (``ScaledLinear``).
* **Updates and QAS.** The device trains the integer tensors ``W~ = W / s_W`` and
  ``b~ = b / (s_W s_x)``, so its gradients are ``G_W~ = s_W G_W`` and ``G_b~ = s_W s_x G_b``, and an
  SGD step moves the real weight by ``s_W * lr * G_W~ = lr * s_W^2 * G_W``. The host keeps real
  weights, so without QAS each gradient is multiplied, before the optimizer step, by ``s_W^2``
  (weights, per output channel) and ``(s_W s_x)^2`` (biases); weight decay and momentum then act
  as they would on ``W~``. QAS (``qas = true``) scales ``G_W~`` by ``s_W^-2`` and ``G_b~`` by
  ``(s_W s_x)^-2``, which cancels those factors: the host update is the fp32 one. A norm layer
  right after a quantised conv is folded into it on a device: its beta is that conv's int32 bias
  (scale ``s_Wf s_x`` with the folded weight scale ``s_Wf = s_W |gamma| / sqrt(running_var + eps)``)
  and its gamma lives in the conv's fixed float requantisation scale, which trains in float
  (the paper's ``train_scale``), so gamma's update is never scaled.
* **Quantised gradients** (``quantized_gradients = true``, the paper's ``quantize_gradient``):
  the weight gradient per output channel and the gradient of each layer's input per channel are
  rounded to int8 (``s = max|g| / 127``, no zero point).
* **Master weights**: ``fp32`` keeps an fp32 copy of the trained tensors, as the simulation code
  does (it rounds weights only in the forward); ``device`` stores them in the device dtype, so
  each updated weight is rounded back onto its int8 grid after every step (an update smaller than
  half a step is lost) and saturates at +-127 steps of its fixed scale, and biases are rounded
  onto their int32 grid.
* **fp16** rounds weights, layer inputs and gradients to fp16 (mixed precision; no QAS).

Not emulated: norm layers, activations functions, pooling and residual additions run in fp32 and
norm layers are not folded (a train-mode norm uses batch statistics, which a folded int8 graph
does not have); the output of each layer is not requantised (the next layer's input is);
transposed convolutions, attention and other layers run in fp32; the server and evaluation stay
fp32. Rounding is round-half-to-even (``torch.round``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ..modelinfo import ModelInfo
from . import optim

DTYPES = ("fp32", "fp16", "int8")
W_MAX = 127  # symmetric int8 weights: [-127, 127]
A_MIN, A_MAX = -128, 127  # asymmetric int8 activations
_EPS = 1e-12
_NORM_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


@dataclass(frozen=True)
class Numerics:
    """How one client's local training computes (see the module docstring)."""

    dtype: str = "fp32"  # fp32 | fp16 | int8
    qas: bool = True
    quantized_gradients: bool = False
    master_weights: str = "fp32"  # fp32 | device

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: one of {list(DTYPES)}")
        if self.master_weights not in ("fp32", "device"):
            raise ValueError("master_weights: 'fp32' or 'device'")


FP32 = Numerics()


def device_numerics(train: Any, train_dtype: str) -> Numerics:
    """A client's numerics: its profile's ``train_dtype`` under ``[train] numerics = "device"``, else fp32."""
    dtype = train_dtype if train.numerics == "device" else "fp32"
    return Numerics(dtype, train.qas, train.quantized_gradients, train.master_weights)


# ----------------------------------------------------------------------------- quantisers


def weight_scales(w: torch.Tensor) -> torch.Tensor:
    """Per-output-channel symmetric int8 scales ``max|w[c]| / 127`` (dim 0 is the output channel)."""
    return w.detach().abs().flatten(1).amax(1).clamp_min(_EPS) / W_MAX


def _per_channel(scales: torch.Tensor, like: torch.Tensor, dim: int = 0) -> torch.Tensor:
    shape = [1] * like.dim()
    shape[dim] = -1
    return scales.view(shape)


def quantize_weight(w: torch.Tensor, scales: torch.Tensor, saturate: bool = True) -> torch.Tensor:
    """The integer values (as floats) of ``w`` at per-output-channel ``scales``, saturated at +-127."""
    q = torch.round(w / _per_channel(scales, w))
    return q.clamp(-W_MAX, W_MAX) if saturate else q


def fake_quant_weight(w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``s * round(w / s)`` in the forward, identity gradient (STE). Not saturated, as the paper's
    forward (``weight.round()``): a weight that outgrows its fixed scale is still represented."""
    wq = quantize_weight(w.detach(), scales, saturate=False) * _per_channel(scales, w)
    return w + (wq - w).detach()


def activation_qparams(x: torch.Tensor) -> tuple[float, float]:
    """Per-tensor asymmetric int8 (scale, zero point) of ``x``'s range, which always includes 0."""
    lo, hi = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    scale = max((hi - lo) / (A_MAX - A_MIN), _EPS)
    return scale, float(A_MIN - round(lo / scale))


def quantize_per_channel(g: torch.Tensor, dim: int) -> torch.Tensor:
    """Symmetric int8 round trip of ``g`` with one scale ``max|g| / 127`` per index of ``dim``."""
    moved = g.transpose(0, dim) if dim else g
    scales = _per_channel(moved.abs().flatten(1).amax(1).clamp_min(_EPS) / W_MAX, g, dim)
    return torch.round(g / scales) * scales


class _ActQuant(torch.autograd.Function):
    """int8 fake quantisation of an activation; zero gradient where it clipped."""

    @staticmethod
    def forward(ctx, x, scale: float, zero: float, grad_quant: bool):
        q = torch.round(x / scale) + zero
        ctx.save_for_backward((q >= A_MIN) & (q <= A_MAX))
        ctx.grad_quant = grad_quant
        return (q.clamp(A_MIN, A_MAX) - zero) * scale

    @staticmethod
    def backward(ctx, grad):
        (inside,) = ctx.saved_tensors
        if ctx.grad_quant and grad.dim() > 1:  # the gradient of the layer's input, per channel (dim 1)
            grad = quantize_per_channel(grad, 1)
        return grad * inside, None, None, None


class _Fp16(torch.autograd.Function):
    """Rounds to fp16 in the forward and the gradient to fp16 in the backward."""

    @staticmethod
    def forward(ctx, x):
        return x.half().float()

    @staticmethod
    def backward(ctx, grad):
        return grad.half().float()


def fake_quant_activation(x: torch.Tensor, scale: float, zero: float, grad_quant: bool = False) -> torch.Tensor:
    return _ActQuant.apply(x, scale, zero, grad_quant)


# ----------------------------------------------------------------------------- the emulation


class _Layer:
    """One conv/linear layer's emulated forward and its quantisation state."""

    def __init__(self, module: nn.Module, numerics: Numerics, quantize_weight: bool):
        self.module, self.numerics, self.quant_w = module, numerics, quantize_weight
        self.int8 = numerics.dtype == "int8"
        self.w_scale = weight_scales(module.weight) if self.int8 and quantize_weight else None
        self.x_qparams: tuple[float, float] | None = None

    @property
    def bias_scale(self) -> torch.Tensor | None:
        """Per-channel scale of the int32 bias, ``s_W * s_x`` (None until the input is calibrated)."""
        if self.w_scale is None or self.x_qparams is None:
            return None
        return self.w_scale * self.x_qparams[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.module
        w, b = m.weight, m.bias
        if self.int8:
            if self.x_qparams is None:
                self.x_qparams = activation_qparams(x.detach())
            x = fake_quant_activation(x, *self.x_qparams, self.numerics.quantized_gradients)
            if self.w_scale is not None:
                w = fake_quant_weight(w, self.w_scale)
                bs = self.bias_scale
                if b is not None and bs is not None:
                    b = b + (torch.round(b.detach() / bs) * bs - b).detach()
        else:  # fp16
            x = _Fp16.apply(x)
            if self.quant_w:
                w = _Fp16.apply(w)
                b = _Fp16.apply(b) if b is not None else None
        if isinstance(m, nn.Linear):
            return F.linear(x, w, b)
        return m._conv_forward(x, w, b)


class Emulation:
    """Installed on a model by :func:`emulate`: patched layer forwards and optimizer hooks."""

    def __init__(self, model: nn.Module, info: ModelInfo, numerics: Numerics):
        self.model, self.numerics = model, numerics
        modules = dict(model.named_modules())
        compute = [layer for layer in info.layers if isinstance(modules[layer.name], (*_CONV_TYPES, nn.Linear))]
        head = compute[-1].name if compute else None
        self.layers = {
            layer.name: _Layer(modules[layer.name], numerics, layer.name != head or numerics.dtype == "fp16")
            for layer in compute
        }
        # norm layers folded into the quantised conv/linear right before them (forward order)
        self.folded: dict[str, tuple[nn.Module, _Layer]] = {}
        for prev, layer in zip(info.layers, info.layers[1:]):
            q = self.layers.get(prev.name)
            mod = modules[layer.name]
            if q is not None and q.w_scale is not None and isinstance(mod, _NORM_TYPES):
                if mod.num_features == q.w_scale.numel():
                    self.folded[layer.name] = (mod, q)
        self.params = {id(p) for p in model.parameters()}
        self._depth = 0  # a torch optimizer whose step calls its parent's step fires the hooks twice, nested

    # -- gradient and update rules, per parameter: (parameter, kind, per-channel scale or None)
    def _quantised_tensors(self) -> Iterator[tuple[nn.Parameter, str, torch.Tensor | None]]:
        for q in self.layers.values():
            m = q.module
            if q.w_scale is not None:
                yield m.weight, "weight", q.w_scale
                if m.bias is not None:
                    yield m.bias, "bias", q.bias_scale
        for norm, q in self.folded.values():
            if norm.affine and norm.running_var is not None and q.w_scale is not None and q.x_qparams is not None:
                s_wf = q.w_scale * norm.weight.detach().abs() / torch.sqrt(norm.running_var + norm.eps)
                yield norm.bias, "bias", s_wf.clamp_min(_EPS) * q.x_qparams[0]

    def _ours(self, optimizer: Any) -> bool:
        return any(id(p) in self.params for group in optimizer.param_groups for p in group["params"])

    @torch.no_grad()
    def before_step(self, optimizer: Any, *_: Any) -> None:
        if not self._ours(optimizer):
            return
        self._depth += 1
        if self._depth > 1:
            return
        if self.numerics.dtype == "fp16":
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.copy_(p.grad.half().float())
            return
        for p, kind, scale in self._quantised_tensors():
            if p.grad is None or scale is None:
                continue
            if self.numerics.quantized_gradients and kind == "weight":
                p.grad.copy_(quantize_per_channel(p.grad, 0))
            if not self.numerics.qas:  # the integer tensor's SGD step, seen in real units
                p.grad.mul_(_per_channel(scale, p.grad) ** 2)

    @torch.no_grad()
    def after_step(self, optimizer: Any, *_: Any) -> None:
        if not self._ours(optimizer):
            return
        self._depth -= 1
        if self._depth > 0:
            return
        device = self.numerics.master_weights == "device"
        if self.numerics.dtype == "fp16":
            for p in self.model.parameters():
                if device and p.grad is not None:
                    p.copy_(p.half().float())
            return
        if not device:
            return
        for p, kind, scale in self._quantised_tensors():
            if p.grad is None or scale is None:
                continue
            s = _per_channel(scale, p)  # int8 storage saturates at +-127 steps of the fixed scale
            p.copy_((quantize_weight(p, scale) if kind == "weight" else torch.round(p / s)) * s)

    def install(self) -> None:
        for q in self.layers.values():
            q.module.forward = q.forward  # an instance attribute: state_dict and hooks are unchanged

    def uninstall(self) -> None:
        for q in self.layers.values():
            q.module.__dict__.pop("forward", None)


@contextlib.contextmanager
def emulate(model: nn.Module, info: ModelInfo, numerics: Numerics | None) -> Iterator[Emulation | None]:
    """Train ``model`` with ``numerics`` inside the block; fp32 (or None) changes nothing."""
    if numerics is None or numerics.dtype == "fp32":
        yield None
        return
    em = Emulation(model, info, numerics)
    # the trainer's optimizers (fedelastic.train.optim) and torch.optim's each fire their own hooks
    handles = [
        optim.register_step_pre_hook(em.before_step),
        optim.register_step_post_hook(em.after_step),
        register_optimizer_step_pre_hook(em.before_step),
        register_optimizer_step_post_hook(em.after_step),
    ]
    em.install()
    try:
        yield em
    finally:
        for h in handles:
            h.remove()
        em.uninstall()


def with_numerics(train_local):
    """Adds the keyword ``numerics: Numerics | None`` to ``train_local(model, info, ...)``: the call
    runs inside :func:`emulate` (weight scales are taken from the weights it starts from)."""

    @functools.wraps(train_local)
    def wrapper(model, info, *args, numerics: Numerics | None = None, **kwargs):
        with emulate(model, info, numerics):
            return train_local(model, info, *args, **kwargs)

    return wrapper


class BatchedInt8:
    """int8 numerics for clients trained as one batched model (fedelastic/train/vectorized.py), per client
    what :class:`Emulation` gives one: the same forward, written without autograd Functions and
    with each client's activation quantisation as tensors, so that ``torch.func.vmap`` runs it.

    Covered: ``qas = true``, ``quantized_gradients = false``, ``master_weights = "fp32"`` (the
    defaults), where :class:`Emulation`'s optimizer hooks change nothing. All clients start from
    one model, so the weight scales are shared; each client's activation ranges are calibrated on
    the first batch its layers see (its valid samples only: a padded batch's padding is masked out).
    Inside the batched call (see :meth:`call`) the patched forwards read the call's per-client state.
    """

    def __init__(self, model: nn.Module, info: ModelInfo, n_clients: int):
        modules = dict(model.named_modules())
        compute = [layer.name for layer in info.layers if isinstance(modules[layer.name], (*_CONV_TYPES, nn.Linear))]
        self.modules = {name: modules[name] for name in compute}
        dev = next(model.parameters()).device
        # the head (last conv/linear layer) keeps fp32 weights on int8 inputs, as Emulation's
        self.w_scale = {name: weight_scales(modules[name].weight) for name in compute[:-1]}
        self.scale = {name: torch.ones(n_clients, device=dev) for name in compute}
        self.zero = {name: torch.zeros(n_clients, device=dev) for name in compute}
        self.calibrated = torch.zeros(n_clients, dtype=torch.bool, device=dev)
        self.on = False  # the current call's clients train in int8
        self.q: dict[str, Any] = {}  # inside a call: that client's state (batched under vmap)
        self.w: torch.Tensor | None = None  # inside a call: its samples' weights (0: padding)
        self.out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def state(self, sel: torch.Tensor) -> dict[str, Any]:
        """The per-client state of clients ``sel`` for a call (dim 0: the clients)."""
        if not self.on:
            return {}
        return {"cal": self.calibrated[sel], **{n: (self.scale[n][sel], self.zero[n][sel]) for n in self.modules}}

    def update(self, sel: torch.Tensor, out: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Keep the activation quantisation a call of clients ``sel`` used (calibrated now if not before)."""
        if not self.on:
            return
        for name, (s, z) in out.items():
            self.scale[name][sel], self.zero[name][sel] = s, z
        self.calibrated[sel] = True

    def call(self, q: dict[str, Any], w: torch.Tensor) -> None:
        """Inside the batched function, before the model's forward: one client's state and sample weights."""
        self.q, self.w, self.out = q, w, {}

    def _qparams(self, name: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`activation_qparams` of the valid samples of ``x`` (float64, as Python's floats),
        or the calibrated ones; as float32, what an op with a Python float computes with."""
        assert self.w is not None
        valid = (self.w > 0).view(-1, *([1] * (x.dim() - 1)))
        inf = torch.tensor(float("inf"), dtype=x.dtype, device=x.device)
        lo = torch.where(valid, x, inf).amin().double().clamp(max=0.0)
        hi = torch.where(valid, x, -inf).amax().double().clamp(min=0.0)
        scale = ((hi - lo) / (A_MAX - A_MIN)).clamp_min(_EPS)
        zero = A_MIN - torch.round(lo / scale)
        old_s, old_z = self.q[name]
        cal = self.q["cal"]
        return torch.where(cal, old_s, scale.to(x.dtype)), torch.where(cal, old_z, zero.to(x.dtype))

    def _forward(self, name: str, module: Any, x: torch.Tensor) -> torch.Tensor:
        if not self.on:
            return type(module).forward(module, x)
        s, z = self._qparams(name, x.detach())
        self.out[name] = (s, z)
        q = torch.round(x / s) + z
        inside = (q >= A_MIN) & (q <= A_MAX)
        x = ((q.clamp(A_MIN, A_MAX) - z) * s).detach() + (x - x.detach()) * inside  # _ActQuant's values and gradient
        w, b = module.weight, module.bias
        if name in self.w_scale:
            w = fake_quant_weight(w, self.w_scale[name])
            if b is not None:
                bs = self.w_scale[name] * s
                b = b + (torch.round(b.detach() / bs) * bs - b).detach()
        if isinstance(module, nn.Linear):
            return F.linear(x, w, b)
        return module._conv_forward(x, w, b)

    @contextlib.contextmanager
    def installed(self) -> Iterator[BatchedInt8]:
        """The patched forwards on the model inside the block (int8 only while :attr:`on`)."""
        for name, module in self.modules.items():
            module.forward = functools.partial(self._forward, name, module)
        try:
            yield self
        finally:
            for module in self.modules.values():
                module.__dict__.pop("forward", None)
