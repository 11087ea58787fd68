"""Which axes of an array are transformed, inferred for the common layouts.

=================  =========================  ==============================================
shape              layout                     transformed axes
=================  =========================  ==============================================
(H, W)             single image or 2-D field  (0, 1)
(H, W, C), C<=4    single image, channels     (0, 1)
(N, H, W)          image stack                (1, 2)  when N > 2 * max(H, W) or integer dtype
(Z, Y, X)          3-D field                  (0, 1, 2)  otherwise (float, similar extents)
(N, H, W, C), C<=4 NHWC image stack           (1, 2)
(N, C, H, W), C<=4 NCHW image stack           (2, 3)
(N, Z, Y, X)       stack of 3-D fields        (1, 2, 3)
(N, C, Z, Y, X)    channels-first 3-D fields  (2, 3, 4)
(N, Z, Y, X, C)    channels-last 3-D fields   (1, 2, 3)
=================  =========================  ==============================================

Anything else needs explicit axes. Axis 0 is the sample axis whenever it is not transformed.

Colour. In the 3-channel layouts (HWC, NHWC, NCHW with 3 channels) the channel axis is transformed too, as
one block of length 3: the orthonormal DCT of length 3 turns RGB into a luma and two colour-difference
channels (rows proportional to [1, 1, 1], [1, 0, -1], [1, -2, 1]), which decorrelates natural colour the way
YCbCr does while keeping the transform orthonormal, so the error model stays exact. Measured on the bundled
images at 35-40 dB it stores 13-20% fewer bytes. ``--axes`` opts out.
"""

from __future__ import annotations

import operator

import numpy as np

from dctchop.errors import DctchopError

MAX_CHANNELS = 4
COLOUR_CHANNELS = 3
CHANNEL_AXIS = {"HWC": 2, "NHWC": 3, "NCHW": 1}


def colour_axis(shape: tuple[int, ...], layout: str) -> int | None:
    """The channel axis to decorrelate, for 3-channel image layouts; None otherwise."""
    axis = CHANNEL_AXIS.get(layout)
    return axis if axis is not None and shape[axis] == COLOUR_CHANNELS else None


def infer_axes(shape: tuple[int, ...], dtype) -> tuple[tuple[int, ...], str]:
    """(axes, layout name) for an array of ``shape`` and ``dtype``; raises when no rule applies."""
    ndim = len(shape)
    small = lambda n: n <= MAX_CHANNELS
    if ndim == 2:
        return (0, 1), "HW"
    if ndim == 3:
        if small(shape[2]) and not small(shape[1]):
            return (0, 1), "HWC"
        if np.dtype(dtype).kind in "iu" or shape[0] > 2 * max(shape[1], shape[2]):
            return (1, 2), "NHW"
        return (0, 1, 2), "ZYX"
    if ndim == 4:
        if small(shape[3]) and not small(shape[2]):
            return (1, 2), "NHWC"
        if small(shape[1]) and not small(shape[2]):
            return (2, 3), "NCHW"
        return (1, 2, 3), "NZYX"
    if ndim == 5:
        if small(shape[4]) and not small(shape[3]):
            return (1, 2, 3), "NZYXC"
        if small(shape[1]):
            return (2, 3, 4), "NCZYX"
    if ndim == 0:
        raise DctchopError("a 0-d array (a single value) has no axis to transform; a store needs an array it can "
                           "compress (an HDF5 file's scalars are copied beside it, with --lossless if named)")
    raise DctchopError(f"cannot infer which axes to transform for shape {list(shape)}; pass --axes")


def parse_axes(text: str, ndim: int) -> tuple[int, ...]:
    """``"1,2"`` -> (1, 2); negative axes count from the end."""
    try:
        given = [int(a) for a in text.split(",") if a.strip()]
    except ValueError:
        raise DctchopError(f"--axes must be comma-separated integers, got {text!r}") from None
    return check_axes(given, ndim, f"--axes {text}".rstrip())


def check_axes(given, ndim: int, what: str) -> tuple[int, ...]:
    """Axes of an ``ndim``-d array as sorted indices from 0 (negative ones count from the end); a
    DctchopError that starts with ``what`` for anything else (library callers pass tuples, the CLI text)."""
    try:
        given = [operator.index(a) for a in given]
    except TypeError:
        raise DctchopError(f"{what}: axes must be integers") from None
    if not given:
        raise DctchopError(f"{what} names no axis")
    bad = [a for a in given if not -ndim <= a < ndim]
    if bad:
        raise DctchopError(f"{what}: axis {bad[0]} is out of range for a {ndim}-d array")
    axes = tuple(sorted(a % ndim for a in given))
    if len(set(axes)) != len(axes):
        raise DctchopError(f"{what} names an axis twice (of a {ndim}-d array)")
    return axes
