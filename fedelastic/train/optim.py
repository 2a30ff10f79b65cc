"""The local trainer's optimizers, SGD and SGDW, written out without ``torch.optim``.

``torch.optim.Optimizer`` imports ``torch._dynamo`` in its constructor and on every ``step``
(its ``_use_grad_for_differentiable`` wrapper marks graph breaks for ``torch.compile``): about
0.9 s of CPU in a fresh process, paid by every Ray worker and the driver on the start-up's
critical path, for a compiler fedelastic never uses. These classes take the same steps as
``torch.optim.SGD``'s single-tensor path (``foreach=False``, which torch picks for CPU tensors),
the same operations in the same order, so the numbers are the same bit for bit (tests check it
against ``torch.optim.SGD`` itself):

* coupled weight decay ``g = grad.add(p, alpha=weight_decay)`` when ``weight_decay != 0``;
* momentum: the buffer starts as a copy of ``g`` on a parameter's first step
  (``torch.clone(g).detach()``), then ``buf.mul_(momentum).add_(g)`` (no dampening) and ``g = buf``;
* ``p.add_(g, alpha=-lr)``.

Only what the trainer uses is kept: one parameter group, ``param_groups`` (a schedule writes
``group["lr"]``), ``state[p]["momentum_buffer"]``, ``zero_grad``, ``state_dict`` /
``load_state_dict`` (torch's layout) and step hooks (:func:`register_step_pre_hook`,
:func:`register_step_post_hook`; the emulated int8/fp16 numerics in :mod:`fedelastic.train.quant` use
them). No nesterov, dampening, maximize, foreach or fused variants, no tensor learning rates.

On a GPU, ``torch.optim.SGD`` by default takes its multi-tensor (``foreach``) path instead; the
operations are the same, but whether its CUDA kernels round exactly as the single-tensor ones do
is not checked (no GPU in the test runs), so a GPU run may differ in the last bits from one made
with ``torch.optim``.
"""

from __future__ import annotations

import copy
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

StepHook = Callable[[Any], None]  # hook(optimizer)

_PRE_HOOKS: OrderedDict[int, StepHook] = OrderedDict()
_POST_HOOKS: OrderedDict[int, StepHook] = OrderedDict()


def register_step_pre_hook(hook: StepHook) -> RemovableHandle:
    """``hook(optimizer)`` runs before every step of every :class:`SGD` (the gradients are final)."""
    handle = RemovableHandle(_PRE_HOOKS)
    _PRE_HOOKS[handle.id] = hook
    return handle


def register_step_post_hook(hook: StepHook) -> RemovableHandle:
    """``hook(optimizer)`` runs after every step of every :class:`SGD`."""
    handle = RemovableHandle(_POST_HOOKS)
    _POST_HOOKS[handle.id] = hook
    return handle


class SGD:
    """SGD with momentum and coupled (L2) weight decay: ``torch.optim.SGD(params, lr, momentum, weight_decay)``."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float, momentum: float = 0.0, weight_decay: float = 0.0):
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        params = list(params)
        if not params:
            raise ValueError("optimizer got an empty parameter list")
        if not all(isinstance(p, torch.Tensor) for p in params):
            raise TypeError("SGD takes an iterable of tensors (one parameter group)")
        self.defaults: dict[str, Any] = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay}
        self.param_groups: list[dict[str, Any]] = [{"params": params, **self.defaults}]
        self.state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)

    def __repr__(self) -> str:
        group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        return f"{type(self).__name__}({group})"

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``torch.optim.Optimizer.zero_grad`` (not foreach)."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        if p.grad.grad_fn is not None:
                            p.grad.detach_()
                        else:
                            p.grad.requires_grad_(False)
                        p.grad.zero_()

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One step over every parameter that has a gradient; returns ``closure()``'s loss (or None)."""
        for hook in tuple(_PRE_HOOKS.values()):
            hook(self)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            for group in self.param_groups:
                self._group_step(group)
        for hook in tuple(_POST_HOOKS.values()):
            hook(self)
        return loss

    def _group_step(self, group: dict[str, Any]) -> None:
        lr, momentum, weight_decay = group["lr"], group["momentum"], group["weight_decay"]
        decoupled = group.get("decoupled_weight_decay")  # SGDW's, applied before the step
        for p in group["params"]:
            grad = p.grad
            if grad is None:
                continue
            if decoupled is not None:
                p.mul_(1 - lr * decoupled)
            if weight_decay != 0:
                grad = grad.add(p, alpha=weight_decay)
            if momentum != 0:
                state = self.state[p]
                buf = state.get("momentum_buffer")
                if buf is None:
                    buf = state["momentum_buffer"] = torch.clone(grad).detach()
                else:
                    buf.mul_(momentum).add_(grad, alpha=1)  # torch's alpha=1 - dampening
                grad = buf
            p.add_(grad, alpha=-lr)

    def state_dict(self) -> dict[str, Any]:
        """torch's layout: parameters by index, the state's tensors not copied."""
        index = {id(p): i for i, p in enumerate(self.param_groups[0]["params"])}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(range(len(g["params"])))}
                  for g in self.param_groups]  # fmt: skip
        return {"state": {index[id(p)]: dict(s) for p, s in self.state.items()}, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads what :meth:`state_dict` gave (state tensors moved to each parameter's dtype and device)."""
        saved = copy.deepcopy(state_dict["param_groups"])
        if len(saved) != len(self.param_groups) or any(
            len(s["params"]) != len(g["params"]) for s, g in zip(saved, self.param_groups)
        ):
            raise ValueError("loaded state dict has a different number of parameters or groups")
        params = self.param_groups[0]["params"]
        self.state = defaultdict(dict)
        for i, s in state_dict["state"].items():
            p = params[int(i)]
            self.state[p] = {
                k: v.to(dtype=p.dtype, device=p.device) if isinstance(v, torch.Tensor) else v for k, v in s.items()
            }
        for group, s in zip(self.param_groups, saved):
            group.update({k: v for k, v in s.items() if k != "params"})


class SGDW(SGD):
    """SGD with decoupled weight decay (the artifact's ``tfa.optimizers.SGDW``).

    Each step first shrinks every parameter that has a gradient by ``lr * weight_decay`` (the
    decay follows the learning-rate schedule, as the artifact's ``lr * weight_decay`` cosine
    does), then takes a plain momentum-SGD step on the gradient alone.
    """

    def __init__(self, params: Iterable[torch.Tensor], lr: float, momentum: float, weight_decay: float):
        super().__init__(params, lr=lr, momentum=momentum, weight_decay=0.0)
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        for group in self.param_groups:
            group["decoupled_weight_decay"] = weight_decay
