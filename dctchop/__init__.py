"""dctchop: blockwise-DCT compression of tensors into Zarr stores."""

from dctchop._version import __version__

__all__ = ["__version__"]
