"""SynthDigits: cluttered 32x32 RGB digits rendered from the DejaVu fonts that matplotlib ships.

In the manner of the SynthDigits domain-adaptation benchmark (Ganin & Lempitsky, 2015): each image
is one digit glyph (0-9) in a random DejaVu face, under a random affine map (rotation, scale,
shear, shift), in a random colour on a random background (two-colour gradient plus smoothed
texture), flanked by parts of two distractor digits as house numbers are, then blurred and
noised. No download: the fonts are inside matplotlib.

Generation is seeded per block of :data:`BLOCK` images, so the first ``n`` images of a set are
the same whatever ``n`` is, and it runs batched in torch (about 60,000 images in well under 30 s
on two cores). Sets are cached as uint8 ``.npz`` under ``$FEDELASTIC_CACHE/datasets``.
"""

from __future__ import annotations

import hashlib
import os
from functools import lru_cache
from pathlib import Path

import numpy as np

from .arrays import ArrayDataset

VERSION = 1  # bump when the generator changes: cached sets are keyed by it
BLOCK = 2_000
GLYPH = 64  # glyphs are rendered into GLYPH x GLYPH masks, then sampled down to SIZE x SIZE
SIZE = 32
DEFAULT_SAMPLES = 60_000


def _cache_root() -> Path:
    return Path(os.environ.get("FEDELASTIC_CACHE", Path.home() / ".cache" / "fedelastic")) / "datasets"


def font_files() -> list[Path]:
    """The DejaVu faces matplotlib ships (sorted, so the set is stable)."""
    import matplotlib

    folder = Path(matplotlib.get_data_path()) / "fonts" / "ttf"
    fonts = sorted(p for p in folder.glob("DejaVu*.ttf") if "Display" not in p.name)  # Display faces lack digits
    if not fonts:
        raise RuntimeError(f"no DejaVu fonts under {folder}")
    return fonts


@lru_cache(maxsize=1)
def glyph_masks() -> np.ndarray:
    """(fonts, 10, GLYPH, GLYPH) float32 coverage masks, each glyph centred with its height ~ 0.7 GLYPH."""
    from matplotlib.ft2font import FT2Font

    masks = np.zeros((len(font_files()), 10, GLYPH, GLYPH), dtype=np.float32)
    for f, path in enumerate(font_files()):
        font = FT2Font(str(path))
        for d in range(10):
            font.set_size(40, 72)
            font.set_text(str(d))
            font.draw_glyphs_to_bitmap(antialiased=True)
            img = np.asarray(font.get_image(), dtype=np.float32) / 255.0
            rows, cols = np.flatnonzero(img.sum(1) > 0), np.flatnonzero(img.sum(0) > 0)
            img = img[rows[0] : rows[-1] + 1, cols[0] : cols[-1] + 1]
            h, w = img.shape
            scale = 0.7 * GLYPH / max(h, w)
            # nearest-free resize by area sampling: map target pixels back into the glyph
            th, tw = max(1, round(h * scale)), max(1, round(w * scale))
            yi = np.minimum((np.arange(th) + 0.5) / scale, h - 1).astype(int)
            xi = np.minimum((np.arange(tw) + 0.5) / scale, w - 1).astype(int)
            small = img[np.ix_(yi, xi)]
            top, left = (GLYPH - th) // 2, (GLYPH - tw) // 2
            masks[f, d, top : top + th, left : left + tw] = small
    return masks


@lru_cache(maxsize=1)
def stroke_masks() -> np.ndarray:
    """(fonts * 3, 10, GLYPH, GLYPH): each face thinned, as is, and emboldened by two pixels."""
    import torch
    import torch.nn.functional as F

    m = torch.from_numpy(glyph_masks())
    thin = -F.max_pool2d(-m, 3, 1, 1)
    bold = F.max_pool2d(m, 5, 1, 2)
    return torch.cat([thin, m, bold]).numpy()


def _affine(
    rng: np.random.Generator, n: int, rotation_deg: float, scale: tuple[float, float], shear: float, shift: float
):
    """(n, 2, 3) inverse affine matrices for torch's affine_grid (output -> input coordinates)."""
    theta = np.deg2rad(rng.uniform(-rotation_deg, rotation_deg, n))
    s = rng.uniform(*scale, n) * rng.uniform(0.85, 1.15, (2, n))  # x and y scale differ a little
    sh = rng.uniform(-shear, shear, n)
    t = rng.uniform(-shift, shift, (2, n))
    cos, sin = np.cos(theta), np.sin(theta)
    # forward map A = R @ Shear @ S; grid needs A^-1
    a = np.empty((n, 2, 2))
    a[:, 0, 0], a[:, 0, 1] = cos * s[0], (cos * sh - sin) * s[1]
    a[:, 1, 0], a[:, 1, 1] = sin * s[0], (sin * sh + cos) * s[1]
    inv = np.linalg.inv(a)
    out = np.empty((n, 2, 3))
    out[:, :, :2] = inv
    out[:, :, 2] = -np.einsum("nij,jn->ni", inv, t)
    return out


def _render_block(seed: int, block: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    import torch
    import torch.nn.functional as F

    from .shifts import gaussian_blur

    rng = np.random.default_rng([seed, VERSION, block])
    gen = torch.Generator().manual_seed(int(rng.integers(2**62)))
    masks = torch.from_numpy(stroke_masks())
    nf = masks.shape[0]
    labels = rng.integers(0, 10, n)
    fonts = rng.choice(nf, n, p=np.repeat([0.2, 0.6, 0.2], nf // 3) / (nf // 3))  # faces x stroke: thin, as is, bold
    out = SIZE

    def place(digits, faces, theta):
        glyph = masks[faces, digits][:, None]
        grid = F.affine_grid(torch.from_numpy(theta).float(), [n, 1, out, out], align_corners=False)
        return F.grid_sample(glyph, grid, align_corners=False, padding_mode="zeros")

    main = place(labels, fonts, _affine(rng, n, 20.0, (0.75, 1.1), 0.3, 0.12))
    # distractor digits at the left and right edges (house numbers have neighbours)
    clutter = torch.zeros_like(main)
    for side in (-1, 1):
        theta = _affine(rng, n, 15.0, (0.7, 1.0), 0.2, 0.08)
        theta[:, 0, 2] += side * rng.uniform(1.0, 1.4, n) * theta[:, 0, 0]
        present = torch.from_numpy(rng.random(n) < 0.7).float()[:, None, None, None]
        clutter = torch.maximum(clutter, present * place(rng.integers(0, 10, n), rng.integers(0, nf, n), theta))
    # colours: background gradient between two colours, foreground far enough in luminance
    lum = np.array([0.299, 0.587, 0.114])
    bg_a, bg_b = rng.random((n, 3)), rng.random((n, 3))
    bg_b = 0.6 * bg_a + 0.4 * bg_b
    fg = rng.random((n, 3))
    gap = fg @ lum - 0.5 * (bg_a + bg_b) @ lum
    flip = np.abs(gap) < 0.3
    fg[flip] = np.clip(fg[flip] + np.where(gap[flip] >= 0, 1, -1)[:, None] * 0.45, 0, 1)
    cl = rng.random((n, 3))
    angle = rng.uniform(0, 2 * np.pi, n)
    coords = torch.linspace(-1, 1, out)
    yy, xx = torch.meshgrid(coords, coords, indexing="ij")
    ramp = (
        torch.from_numpy(np.cos(angle)).float()[:, None, None] * xx
        + torch.from_numpy(np.sin(angle)).float()[:, None, None] * yy
        + 1
    ) / 2
    t = lambda a: torch.from_numpy(a).float()[:, :, None, None]  # noqa: E731
    background = t(bg_a) * (1 - ramp[:, None]) + t(bg_b) * ramp[:, None]
    texture = torch.rand(n, 1, out // 4, out // 4, generator=gen)
    texture = F.interpolate(texture, size=(out, out), mode="bilinear", align_corners=False) - 0.5
    background = background + t(rng.uniform(0.0, 0.35, (n, 1))) * texture
    image = background * (1 - clutter) + t(cl) * clutter
    image = image * (1 - main) + t(fg) * main
    # blur some, then noise
    sigma = rng.uniform(0.0, 1.0, n)
    image = gaussian_blur(image, sigma)
    image = image + torch.randn(image.shape, generator=gen) * t(rng.uniform(0.0, 0.08, (n, 1)))
    image = (image.clamp(0, 1) * 255).round().to(torch.uint8).numpy()
    return image, labels.astype(np.int64)


def generate(num_samples: int = DEFAULT_SAMPLES, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 (N, 3, 32, 32), labels int64 (N,)), seeded per block (uncached)."""
    xs, ys = [], []
    for block in range(-(-num_samples // BLOCK)):
        n = min(BLOCK, num_samples - block * BLOCK)
        x, y = _render_block(seed, block, BLOCK)  # whole blocks, so a prefix never depends on num_samples
        xs.append(x[:n])
        ys.append(y[:n])
    return np.concatenate(xs), np.concatenate(ys)


def load(num_samples: int = DEFAULT_SAMPLES, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The cached set: generated once, then read from ``$FEDELASTIC_CACHE/datasets``."""
    fonts = ",".join(p.name for p in font_files())
    key = hashlib.sha256(f"{VERSION}|{fonts}".encode()).hexdigest()[:10]
    path = _cache_root() / f"synth_digits-v{VERSION}-{key}-s{seed}-n{num_samples}.npz"
    if path.exists():
        with np.load(path) as f:
            return f["x"], f["y"]
    x, y = generate(num_samples, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp.npz")
    np.savez(tmp, x=x, y=y)
    os.replace(tmp, path)
    return x, y


def synth_digits(size: int = 0):
    """The ``synth_digits`` dataset entry: ``size`` samples of :func:`load` (0: :data:`DEFAULT_SAMPLES`),
    scaled to [0, 1]."""
    x, y = load(size or DEFAULT_SAMPLES)
    return ArrayDataset(x.astype(np.float32) / np.float32(255.0), y)
