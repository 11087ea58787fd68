#!/usr/bin/env python
"""Generate the bundled, fully synthetic sample data for dctchop.

Nothing is downloaded: every byte is produced here from fixed seeds, so running

    python sample_data/make_sample_data.py

reproduces ``images.h5`` and ``field.npy`` bit-for-bit (for a given numpy version).

* ``images.h5``  -- 1280 RGB 32x32 uint8 images (NHWC) in 10 procedural scene
  classes, with ``labels``.  Built to have natural-image statistics (smooth
  regions, soft edges, 1/f^2 textures, correlated colour channels, optical blur,
  sensor noise) so that rate-distortion comparisons against JPEG are meaningful,
  and so that the label is learnable by a small CNN.
* ``field.npy``  -- a 64^3 float32 Gaussian random field with a Kolmogorov
  k^(-11/3) power spectrum: one turbulent velocity component in m/s.
"""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np

OUT_DIR = Path(__file__).resolve().parent
SEED = 20240531

IMG = 32  # image side (pixels); scene coordinates run over [-1, 1], so one pixel = 2 / IMG
EDGE = 0.3 * 2 / IMG  # tanh scale of object edges (0.3 px): near-hard edges, anti-aliased by the camera blur
N_PER_CLASS = 128  # 10 classes -> N = 1280 (noisy 8-bit pixels barely gzip; keeps sample_data/ < 5 MB)
CLASS_NAMES = [
    "sphere",       # 0 Lambert-shaded ball on a gradient background
    "box",          # 1 rotated rectangle, lit with a linear gradient
    "grating",      # 2 oriented sinusoidal stripes
    "texture",      # 3 colour-correlated 1/f^beta (pink/brown) noise
    "landscape",    # 4 sky gradient + ridge-line horizon + textured ground
    "blobs",        # 5 alpha-composited soft Gaussian blobs
    "checker",      # 6 rotated, softly lit checkerboard
    "rings",        # 7 concentric radial rings
    "dead_leaves",  # 8 occluding discs, power-law radii (dead-leaves model)
    "bars",         # 9 a few straight opaque bars over a textured background
]

FIELD_N = 64
FIELD_BOX_M = 1.0  # physical box side (m)
FIELD_URMS = 1.5  # target rms velocity (m/s)
FIELD_ETA_M = 1.5 / (np.pi * FIELD_N / FIELD_BOX_M)  # Kolmogorov scale (m): k_max * eta = 1.5, the usual DNS resolution


# --------------------------------------------------------------------------
# small vectorised helpers (all arrays are batched over the leading axis n)
# --------------------------------------------------------------------------

def _grid():
    """Pixel-centre coordinates in [-1, 1], shape (1, H, W) each."""
    c = (np.arange(IMG) + 0.5) / IMG * 2.0 - 1.0
    y, x = np.meshgrid(c, c, indexing="ij")
    return x[None], y[None]


def _col(v):
    """Reshape a per-image (n,) or (n, 3) parameter for broadcasting to (n, H, W, 3)."""
    v = np.asarray(v, dtype=np.float64)
    return v.reshape(v.shape[0], 1, 1, -1) if v.ndim == 2 else v.reshape(-1, 1, 1)


def _soft(d, width):
    """Anti-aliased step: 0 -> 1 as the signed distance d crosses 0 (about `width` wide)."""
    return 0.5 * (1.0 + np.tanh(d / width))


def _colours(rng, n):
    """Random colours with natural correlation: a shared luminance plus a small chroma offset.

    Real scenes rarely contain saturated primaries; channels move together.
    """
    lum = rng.uniform(0.12, 0.88, (n, 1))
    chroma = rng.normal(0.0, 0.13, (n, 3))
    chroma -= chroma.mean(axis=1, keepdims=True)
    return np.clip(lum + chroma, 0.02, 0.98)


def _colour_pair(rng, n, min_dl=0.2):
    """Two colours whose luminances differ by at least `min_dl`, so patterns stay visible."""
    c0, c1 = _colours(rng, n), _colours(rng, n)
    dl = c1.mean(1) - c0.mean(1)
    sign = np.where(dl >= 0, 1.0, -1.0)
    shift = (sign * np.maximum(min_dl - np.abs(dl), 0))[:, None] / 2
    return np.clip(c0 - shift, 0.02, 0.98), np.clip(c1 + shift, 0.02, 0.98)


def _gradient_bg(rng, n):
    """Two-colour linear gradient in a random direction: smooth 'out of focus' background."""
    x, y = _grid()
    th = rng.uniform(0, 2 * np.pi, n)
    t = 0.5 + 0.5 * (x * _col(np.cos(th)) + y * _col(np.sin(th))) / np.sqrt(2)
    c0, c1 = _colours(rng, n), _colours(rng, n)
    return _col(c0) * (1 - t[..., None]) + _col(c1) * t[..., None]


def _power_noise(rng, n, beta, channels=1, size=IMG):
    """Zero-mean, unit-std Gaussian noise with power spectrum ~ 1/f^beta.

    beta ~ 2 is the classic natural-image spectrum.  Generated on a 2x larger
    periodic grid and cropped so the result does not tile.  beta may be per-image.
    """
    big = 2 * size
    f = np.fft.fftfreq(big)
    fy, fx = np.meshgrid(f, f, indexing="ij")
    fr = np.sqrt(fx**2 + fy**2)
    fr[0, 0] = 1.0
    beta = np.broadcast_to(np.asarray(beta, dtype=np.float64), (n,)).reshape(n, 1, 1, 1)
    amp = fr[None, :, :, None] ** (-beta / 2.0)
    amp[:, 0, 0, :] = 0.0
    white = rng.normal(size=(n, big, big, channels))
    field = np.fft.ifft2(np.fft.fft2(white, axes=(1, 2)) * amp, axes=(1, 2)).real
    field = field[:, :size, :size, :]
    field -= field.mean(axis=(1, 2), keepdims=True)
    field /= field.std(axis=(1, 2), keepdims=True) + 1e-12
    return field


def _colour_texture(rng, n, beta=2.0, chroma=0.3):
    """1/f^beta texture whose channels are correlated: luminance field + weaker chroma fields."""
    lum = _power_noise(rng, n, beta, 1)
    chrom = _power_noise(rng, n, np.asarray(beta) + 0.5, 3) * chroma  # chroma is smoother than luminance
    chrom -= chrom.mean(axis=3, keepdims=True)
    return lum + chrom  # (n, H, W, 3), roughly unit std


# --------------------------------------------------------------------------
# scene families: each returns float images in ~[0, 1], shape (n, H, W, 3)
# --------------------------------------------------------------------------

def _sphere(rng, n):
    """Lambert + Phong shaded ball: smooth shading and one curved occluding edge."""
    x, y = _grid()
    img = _gradient_bg(rng, n)
    cx, cy = _col(rng.uniform(-0.45, 0.45, n)), _col(rng.uniform(-0.45, 0.45, n))
    r = _col(rng.uniform(0.3, 0.65, n))
    dx, dy = (x - cx) / r, (y - cy) / r
    rho2 = dx**2 + dy**2
    nz = np.sqrt(np.clip(1 - rho2, 0, 1))
    th = rng.uniform(0, 2 * np.pi, n)
    el = rng.uniform(0.3, 1.0, n)
    lx, ly, lz = np.cos(th) * np.cos(el), np.sin(th) * np.cos(el), np.sin(el)
    ndotl = np.clip(dx * _col(lx) + dy * _col(ly) + nz * _col(lz), 0, 1)
    spec = np.clip(2 * ndotl * nz - _col(lz), 0, 1) ** 12  # (R.V)^k with viewer on +z
    shade = 0.2 + 0.8 * ndotl
    ball = _col(_colours(rng, n)) * shade[..., None] + 0.35 * _col(rng.uniform(0, 1, n))[..., None] * spec[..., None]
    # soft contact shadow under the ball
    shadow = 1 - 0.35 * np.exp(-(((x - cx) / (1.2 * r)) ** 2 + ((y - cy - 0.8 * r) / (0.4 * r)) ** 2))
    img = img * shadow[..., None]
    a = _soft(1 - np.sqrt(rho2), EDGE / r)[..., None]
    return img * (1 - a) + ball * a


def _box(rng, n):
    """Rotated rectangle with a linear lighting ramp and a darker bevel: straight edges + corners."""
    x, y = _grid()
    img = _gradient_bg(rng, n)
    cx, cy = _col(rng.uniform(-0.35, 0.35, n)), _col(rng.uniform(-0.35, 0.35, n))
    hw, hh = _col(rng.uniform(0.2, 0.55, n)), _col(rng.uniform(0.2, 0.55, n))
    th = rng.uniform(0, np.pi, n)
    c, s = _col(np.cos(th)), _col(np.sin(th))
    u = (x - cx) * c + (y - cy) * s
    v = -(x - cx) * s + (y - cy) * c
    d = np.minimum(hw - np.abs(u), hh - np.abs(v))  # signed distance to the box edge (inside > 0)
    ramp = 0.75 + 0.25 * (u / hw) * _col(rng.uniform(-1, 1, n)) + 0.25 * (v / hh) * _col(rng.uniform(-1, 1, n))
    bevel = 1 - 0.3 * np.exp(-d / 0.06) * (d > 0)
    face = _col(_colours(rng, n)) * (ramp * bevel)[..., None]
    a = _soft(d, EDGE)[..., None]
    return img * (1 - a) + face * a


def _grating(rng, n):
    """Sinusoidal stripes, random orientation/frequency/phase, slightly warped: periodic texture."""
    x, y = _grid()
    th = rng.uniform(0, np.pi, n)
    freq = rng.uniform(1.5, 5.5, n)  # cycles across the image
    warp = _col(rng.uniform(0.0, 0.06, n)) * _power_noise(rng, n, 4.0)[..., 0]
    u = x * _col(np.cos(th)) + y * _col(np.sin(th)) + warp
    sharp = _col(rng.uniform(0.5, 3.0, n))  # sine -> near-square wave
    w = np.tanh(sharp * np.sin(np.pi * _col(freq) * u + _col(rng.uniform(0, 2 * np.pi, n)))) / np.tanh(sharp)
    t = (0.5 + 0.5 * w)[..., None]
    c0, c1 = map(_col, _colour_pair(rng, n))
    return c0 * (1 - t) + c1 * t


def _texture(rng, n):
    """Colour-correlated 1/f^beta noise (beta in [2, 3]): foliage/rock/cloud-like texture."""
    beta = rng.uniform(2.0, 3.0, n)
    tex = _colour_texture(rng, n, beta, chroma=rng.uniform(0.1, 0.3))
    return _col(_colours(rng, n)) + _col(rng.uniform(0.08, 0.2, n))[..., None] * tex


def _landscape(rng, n):
    """Sky gradient, ridge-line horizon (1-D 1/f^2 profile) and textured ground darkening toward the viewer."""
    x, y = _grid()
    horizon = _col(rng.uniform(-0.35, 0.35, n)) + x * _col(rng.uniform(-0.2, 0.2, n))
    ridge = _power_noise(rng, n, 3.0)[:, :1, :, 0]  # one row of a 2-D 1/f^3 field -> 1-D ridge profile
    horizon = horizon - _col(rng.uniform(0.03, 0.15, n)) * ridge
    # sky: blue-ish at the top, paler near the horizon, with faint clouds
    zen = np.stack([rng.uniform(0.15, 0.45, n), rng.uniform(0.35, 0.65, n), rng.uniform(0.65, 0.95, n)], 1)
    haze = np.clip(zen + rng.uniform(0.15, 0.4, (n, 1)), 0, 1)
    ts = np.clip((y + 1) / (horizon + 1 + 1e-6), 0, 1)[..., None]
    sky = _col(zen) * (1 - ts) + _col(haze) * ts
    sky = sky + _col(rng.uniform(0, 0.12, n))[..., None] * np.maximum(_power_noise(rng, n, 2.6), 0)
    # ground: green/brown/ochre with texture whose contrast grows toward the bottom
    g = np.stack([rng.uniform(0.2, 0.55, n), rng.uniform(0.3, 0.55, n), rng.uniform(0.05, 0.25, n)], 1)
    depth = np.clip((y - horizon) / (1 - horizon + 1e-6), 0, 1)[..., None]
    ground = _col(g) * (0.75 + 0.35 * depth) + (0.04 + 0.1 * depth) * _colour_texture(rng, n, 2.0, 0.25)
    a = _soft(y - horizon, EDGE)[..., None]
    return sky * (1 - a) + ground * a


def _blobs(rng, n):
    """3-7 alpha-composited Gaussian blobs of random size/colour: smooth, low-frequency content."""
    x, y = _grid()
    img = _gradient_bg(rng, n)
    k = rng.integers(3, 8, n)
    for i in range(7):
        on = _col(i < k)
        cx, cy = _col(rng.uniform(-0.9, 0.9, n)), _col(rng.uniform(-0.9, 0.9, n))
        sx, sy = _col(rng.uniform(0.1, 0.45, n)), _col(rng.uniform(0.1, 0.45, n))
        a = on * rng.uniform(0.6, 1.0) * np.exp(-0.5 * (((x - cx) / sx) ** 2 + ((y - cy) / sy) ** 2))
        img = img * (1 - a[..., None]) + _col(_colours(rng, n)) * a[..., None]
    return img


def _checker(rng, n):
    """Rotated checkerboard under a smooth illumination gradient: many straight edges and corners."""
    x, y = _grid()
    th = rng.uniform(0, np.pi / 2, n)
    sq = _col(rng.uniform(0.18, 0.5, n))  # square side (image = 2 units)
    u = (x * _col(np.cos(th)) + y * _col(np.sin(th))) / sq + _col(rng.uniform(0, 1, n))
    v = (-x * _col(np.sin(th)) + y * _col(np.cos(th))) / sq + _col(rng.uniform(0, 1, n))
    w = EDGE / sq  # edge softness in (u, v) units
    su = np.tanh(np.sin(np.pi * u) / (np.pi * w))
    sv = np.tanh(np.sin(np.pi * v) / (np.pi * w))
    t = (0.5 + 0.5 * su * sv)[..., None]
    c0, c1 = map(_col, _colour_pair(rng, n))
    light = 0.8 + 0.2 * (x * _col(rng.uniform(-1, 1, n)) + y * _col(rng.uniform(-1, 1, n)))
    return (c0 * (1 - t) + c1 * t) * light[..., None]


def _rings(rng, n):
    """Concentric rings about a random centre (tree-rings/ripples): curved periodic edges."""
    x, y = _grid()
    cx, cy = _col(rng.uniform(-0.6, 0.6, n)), _col(rng.uniform(-0.6, 0.6, n))
    r = np.sqrt((x - cx) ** 2 + ((y - cy) * _col(rng.uniform(0.8, 1.25, n))) ** 2)
    freq = _col(rng.uniform(2.0, 5.0, n))
    sharp = _col(rng.uniform(0.7, 3.0, n))
    w = np.tanh(sharp * np.cos(np.pi * freq * r + _col(rng.uniform(0, 2 * np.pi, n)))) / np.tanh(sharp)
    decay = np.exp(-r / _col(rng.uniform(1.0, 3.0, n)))
    t = (0.5 + 0.5 * w * decay)[..., None]
    c0, c1 = map(_col, _colour_pair(rng, n))
    return c0 * (1 - t) + c1 * t


def _dead_leaves(rng, n, n_leaves=80):
    """Dead-leaves model: opaque discs with p(r) ~ r^-3 stacked front-to-back.

    It is the standard stochastic model reproducing natural-image occlusion
    statistics (scale invariance, 1/f^2 spectrum).  Each leaf has slight shading.
    """
    x, y = _grid()
    img = _col(_colours(rng, n)) * np.ones((1, IMG, IMG, 1))
    rmin, rmax = 0.1, 1.2
    for _ in range(n_leaves):
        # inverse-CDF sampling of p(r) ~ r^-3 on [rmin, rmax]
        u = rng.uniform(0, 1, n)
        r = _col((rmin**-2 - u * (rmin**-2 - rmax**-2)) ** -0.5)
        cx, cy = _col(rng.uniform(-1.2, 1.2, n)), _col(rng.uniform(-1.2, 1.2, n))
        d = r - np.sqrt((x - cx) ** 2 + (y - cy) ** 2)
        shade = 1 + 0.15 * ((x - cx) * _col(rng.uniform(-1, 1, n)) + (y - cy) * _col(rng.uniform(-1, 1, n))) / r
        a = _soft(d, EDGE)[..., None]
        img = img * (1 - a) + _col(_colours(rng, n)) * shade[..., None] * a
    return img


def _bars(rng, n):
    """2-4 long straight opaque bars (poles/branches) over a weak 1/f^2 textured background."""
    x, y = _grid()
    img = _gradient_bg(rng, n) + 0.06 * _colour_texture(rng, n, 2.2, 0.3)
    k = rng.integers(2, 5, n)
    for i in range(4):
        th = rng.uniform(0, np.pi, n)
        off = rng.uniform(-0.7, 0.7, n)
        half = _col(rng.uniform(0.04, 0.16, n))
        dist = x * _col(np.cos(th)) + y * _col(np.sin(th)) - _col(off)
        shade = 0.8 + 0.2 * dist / half  # cylindrical-ish shading across the bar
        a = (_col(i < k) * _soft(half - np.abs(dist), EDGE))[..., None]
        img = img * (1 - a) + _col(_colours(rng, n)) * shade[..., None] * a
    return img


SCENES = [_sphere, _box, _grating, _texture, _landscape, _blobs, _checker, _rings, _dead_leaves, _bars]
assert len(SCENES) == len(CLASS_NAMES)


# --------------------------------------------------------------------------
# camera model applied to every class
# --------------------------------------------------------------------------

def _camera(rng, img):
    """Simulate capture: white balance/exposure jitter, vignetting, optical blur, sensor noise, 8-bit quantisation.

    Blur (Gaussian PSF, sigma 0.25-0.7 px per image) is applied in the Fourier
    domain on a reflect-padded copy so per-image sigmas stay vectorised.
    Noise is signal dependent (shot + read noise), about 1-2.5 DN at mid grey.
    """
    n = img.shape[0]
    x, y = _grid()
    img = img * _col(rng.normal(1.0, 0.04, (n, 3))) * _col(rng.uniform(0.85, 1.1, n))[..., None]
    vig = 1 - _col(rng.uniform(0.0, 0.25, n)) * (x**2 + y**2) / 2
    img = img * vig[..., None]

    pad = 8
    big = np.pad(img, ((0, 0), (pad, pad), (pad, pad), (0, 0)), mode="reflect")
    f = np.fft.fftfreq(IMG + 2 * pad)
    f2 = f[:, None] ** 2 + f[None, :] ** 2
    sigma = rng.uniform(0.25, 0.7, n).reshape(n, 1, 1, 1)
    otf = np.exp(-2 * np.pi**2 * sigma**2 * f2[None, :, :, None])
    big = np.fft.ifft2(np.fft.fft2(big, axes=(1, 2)) * otf, axes=(1, 2)).real
    img = np.clip(big[:, pad:-pad, pad:-pad, :], 0, 1)

    shot = rng.uniform(0.5e-4, 1.5e-4, n).reshape(n, 1, 1, 1)  # variance per unit signal
    read = (rng.uniform(0.5, 1.2, n) / 255.0).reshape(n, 1, 1, 1)
    img = img + rng.normal(size=img.shape) * np.sqrt(shot * img + read**2)
    return np.clip(np.rint(img * 255.0), 0, 255).astype(np.uint8)


# --------------------------------------------------------------------------
# datasets
# --------------------------------------------------------------------------

def make_images(seed: int = SEED, n_per_class: int = N_PER_CLASS):
    """Return (images uint8 (N, 32, 32, 3), labels int64 (N,)), classes interleaved in a fixed random order.

    Each class gets its own child seed, so editing one generator does not change the others.
    """
    seqs = np.random.SeedSequence(seed).spawn(len(SCENES) + 1)
    imgs, labels = [], []
    for cls, (scene, ss) in enumerate(zip(SCENES, seqs)):
        rng = np.random.default_rng(ss)
        imgs.append(_camera(rng, np.clip(scene(rng, n_per_class), 0, 1)))
        labels.append(np.full(n_per_class, cls, dtype=np.int64))
    images, labels = np.concatenate(imgs), np.concatenate(labels)
    order = np.random.default_rng(seqs[-1]).permutation(len(labels))
    return images[order], labels[order]


def make_field(seed: int = SEED + 1, n: int = FIELD_N):
    """Gaussian random field with Kolmogorov spectrum: one velocity component of homogeneous turbulence.

    3-D spectral density P(k) ~ k^(-11/3) (i.e. energy spectrum E(k) ~ k^(-5/3)),
    with a Gaussian dissipation roll-off exp(-(k*eta)^2) and the k=0 mode removed,
    on a periodic box of side FIELD_BOX_M.  Scaled to rms FIELD_URMS m/s.  Unlike real
    turbulence it is Gaussian (no intermittency), but its multiscale smoothness is
    what matters for testing transform coding of scientific volumes.
    """
    rng = np.random.default_rng(seed)
    k1 = 2 * np.pi * np.fft.fftfreq(n, d=FIELD_BOX_M / n)  # rad/m
    k1r = 2 * np.pi * np.fft.rfftfreq(n, d=FIELD_BOX_M / n)
    kx, ky, kz = np.meshgrid(k1, k1, k1r, indexing="ij")
    k = np.sqrt(kx**2 + ky**2 + kz**2)
    k[0, 0, 0] = 1.0
    amp = k ** (-11.0 / 6.0) * np.exp(-0.5 * (k * FIELD_ETA_M) ** 2)  # sqrt(P(k))
    amp[0, 0, 0] = 0.0
    white = rng.normal(size=(n, n, n))
    u = np.fft.irfftn(np.fft.rfftn(white) * amp, s=(n, n, n), axes=(0, 1, 2))
    u *= FIELD_URMS / u.std()
    return u.astype(np.float32)


def write_images(path: Path, images, labels):
    """Write HDF5 with gzip (h5py built-in, no plugins) and self-describing JSON-able attributes."""
    with h5py.File(path, "w") as f:
        f.attrs["title"] = "dctchop synthetic natural-image-like sample set"
        f.attrs["description"] = (
            "Procedurally generated RGB 32x32 images in 10 scene classes (shapes with soft shading, "
            "1/f^beta colour textures, gratings, landscapes, dead-leaves, ...) passed through a camera "
            "model (white balance jitter, vignetting, Gaussian blur, shot+read noise, 8-bit quantisation). "
            "Synthetic: produced by sample_data/make_sample_data.py, nothing downloaded."
        )
        f.attrs["generator"] = "sample_data/make_sample_data.py"
        f.attrs["seed"] = SEED
        f.attrs["class_names"] = json.dumps(CLASS_NAMES)
        f.attrs["num_classes"] = len(CLASS_NAMES)
        f.attrs["layout"] = "NHWC"
        d = f.create_dataset("images", data=images, chunks=(128, IMG, IMG, 3),
                             compression="gzip", compression_opts=9)
        d.attrs["description"] = "RGB images, uint8 0..255, sRGB-like display values"
        d.attrs["layout"] = "NHWC"
        d.attrs["shape"] = json.dumps(list(images.shape))
        d = f.create_dataset("labels", data=labels, compression="gzip", compression_opts=9)
        d.attrs["description"] = "class id 0..9, index into the file attribute class_names"
        d.attrs["class_names"] = json.dumps(CLASS_NAMES)


def main():
    images, labels = make_images()
    write_images(OUT_DIR / "images.h5", images, labels)
    field = make_field()
    np.save(OUT_DIR / "field.npy", field, allow_pickle=False)
    print(f"images.h5: images {images.shape} {images.dtype}, labels {labels.shape} {labels.dtype}")
    print(f"field.npy: {field.shape} {field.dtype}, mean {field.mean():.3f} m/s, rms {field.std():.3f} m/s")


if __name__ == "__main__":
    main()
