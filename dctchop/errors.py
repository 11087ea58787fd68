"""The one exception type users see: the CLI prints its message as one line and exits non-zero."""


class DctchopError(Exception):
    """A user-facing problem: bad input, impossible setting, damaged store."""


class CorruptChunkError(DctchopError):
    """An encoded chunk that cannot be decoded: wrong magic, bad header field, short payload."""


def first_line(exc: BaseException) -> str:
    """An exception's message cut to its first line, for a one-line error that quotes it (h5py, numpy and
    torch messages can run over many lines)."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def output_exists(output) -> DctchopError:
    """The refusal of compress and decompress to replace ``output`` unasked."""
    return DctchopError(f"output {output} exists; pass overwrite=True (--overwrite) to replace it")
