"""Parameterised domain shifts of image batches: rotation, colour (hue), blur, noise, background.

A :class:`Shift` is also a scenario table (``[data.shift]``, and each entry of a stream's
``domains``). Applied in that order; an all-zero shift returns the images unchanged. Random parts
(noise, background texture) are seeded by the ``seed`` passed in, so a shift of the same images
with the same seed is the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config import check, field


@dataclass(frozen=True)
class Shift:
    rotation: float = field(0.0, help="rotate every image by this many degrees (counter-clockwise)")
    hue: float = field(0.0, help="rotate colours about the grey axis by this many degrees (RGB images)")
    blur: float = field(0.0, help="Gaussian blur sigma in pixels")
    noise: float = field(0.0, help="std of added Gaussian pixel noise (images are in [0, 1])")
    background: float = field(0.0, help="share in [0, 1] of a random smooth clutter texture blended in")

    def __post_init__(self):
        check(self.blur >= 0, "blur", "a number >= 0")
        check(self.noise >= 0, "noise", "a number >= 0")
        check(0 <= self.background <= 1, "background", "a share in [0, 1]")

    @property
    def is_identity(self) -> bool:
        return not (self.rotation or self.hue or self.blur or self.noise or self.background)

    def label(self) -> str:
        parts = [
            f"{k}={getattr(self, k):g}" for k in ("rotation", "hue", "blur", "noise", "background") if getattr(self, k)
        ]
        return ",".join(parts) or "clean"


def gaussian_blur(images, sigma: np.ndarray):
    """Blur each image of a (N, C, H, W) float tensor with its own Gaussian sigma (pixels; ~0 leaves it)."""
    import torch
    import torch.nn.functional as F

    sig = np.maximum(np.broadcast_to(np.asarray(sigma, dtype=np.float64), (images.shape[0],)), 1e-3)
    radius = max(1, int(np.ceil(3 * sig.max())))
    offs = torch.arange(-radius, radius + 1, dtype=torch.float32)
    k = torch.exp(-0.5 * (offs[None] / torch.from_numpy(sig).float()[:, None]) ** 2)
    k = k / k.sum(1, keepdim=True)
    n, c, h, w = images.shape
    x = images.reshape(1, n * c, h, w)
    kk = k.repeat_interleave(c, 0)
    x = F.conv2d(F.pad(x, (radius, radius, 0, 0), mode="replicate"), kk[:, None, None, :], groups=n * c)
    x = F.conv2d(F.pad(x, (0, 0, radius, radius), mode="replicate"), kk[:, None, :, None], groups=n * c)
    return x.reshape(n, c, h, w)


def hue_matrix(degrees: float) -> np.ndarray:
    """3x3 rotation of RGB about the grey axis (1, 1, 1) by ``degrees``."""
    a = np.deg2rad(degrees)
    u = np.ones(3) / np.sqrt(3)
    cross = np.array([[0, -u[2], u[1]], [u[2], 0, -u[0]], [-u[1], u[0], 0]])
    return np.cos(a) * np.eye(3) + np.sin(a) * cross + (1 - np.cos(a)) * np.outer(u, u)


def apply_shift(x: np.ndarray, shift: Shift, seed: int | list[int] = 0, batch: int = 4096) -> np.ndarray:
    """``x`` (N, C, H, W) float32 in [0, 1] under ``shift``; a new array (``x`` itself if the shift is identity)."""
    if shift.is_identity or len(x) == 0:
        return x
    if shift.hue and x.shape[1] != 3:
        raise ValueError(f"a hue shift needs RGB images, got {x.shape[1]} channel(s)")
    import torch
    import torch.nn.functional as F

    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(int(rng.integers(2**62)))
    out = np.empty_like(x)
    for start in range(0, len(x), batch):
        t = torch.from_numpy(np.ascontiguousarray(x[start : start + batch]))
        n, c, h, w = t.shape
        if shift.rotation:
            a = np.deg2rad(shift.rotation)
            theta = torch.tensor([[np.cos(a), -np.sin(a), 0.0], [np.sin(a), np.cos(a), 0.0]], dtype=torch.float32)
            grid = F.affine_grid(theta.expand(n, 2, 3), [n, c, h, w], align_corners=False)
            t = F.grid_sample(t, grid, align_corners=False, padding_mode="border")
        if shift.hue:
            t = torch.einsum("ij,njhw->nihw", torch.from_numpy(hue_matrix(shift.hue)).float(), t)
        if shift.blur:
            t = gaussian_blur(t, np.full(n, shift.blur))
        if shift.noise:
            t = t + shift.noise * torch.randn(t.shape, generator=gen)
        if shift.background:
            tex = torch.rand(n, c, max(1, h // 4), max(1, w // 4), generator=gen)
            tex = F.interpolate(tex, size=(h, w), mode="bilinear", align_corners=False)
            t = (1 - shift.background) * t + shift.background * tex
        out[start : start + n] = t.clamp(0, 1).numpy()
    return out
