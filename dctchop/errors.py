"""The one exception type users see: the CLI prints its message as one line and exits non-zero."""


class DctchopError(Exception):
    """A user-facing problem: bad input, impossible setting, damaged store."""


class CorruptChunkError(DctchopError):
    """An encoded chunk that cannot be decoded: wrong magic, bad header field, short payload."""
