"""Where a store lives: a local directory, or any fsspec URL (``s3://bucket/x.zarr``, ``gs://``, ``file://``...).

The store is written chunk file by chunk file, possibly by Dask workers on other machines, so every place
that touches a store's files goes through a :class:`Location`: a local path uses the operating system
(directory renames are atomic there), a URL uses fsspec (installed with the ``dask`` extra; object stores need
their own package, e.g. ``s3fs``). Credentials and endpoints come from fsspec's usual sources (environment
variables such as ``FSSPEC_S3_ENDPOINT_URL``, ``~/.config/fsspec``, the cloud SDK's own configuration).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import stat
from functools import cached_property
from pathlib import Path

import zarr

from dctchop.errors import DctchopError


def absolute_path(path: str | os.PathLike) -> str:
    """``path`` made absolute as the operating system resolves it. ``os.path.abspath`` drops ``link/..`` by
    its text, which names another directory when ``link`` is a symbolic link (``L/../in.h5`` read an
    unrelated ``./in.h5``)."""
    return os.fspath(Path(path).absolute())


def is_url(target: str | bytes | os.PathLike) -> bool:
    return "://" in os.fsdecode(target)


def store_holding(path: Path) -> Path | None:
    """The Zarr store (a directory with a zarr.json) that ``path`` would be written inside, or None. A file
    put there would become part of that store: its groups, its sizes, what --overwrite replaces."""
    return next((p for p in Path(path).resolve().parents if (p / "zarr.json").is_file()), None)


def refuse_special_file(path: Path, output) -> None:
    """Refuse to replace an output ``path`` that is a device, FIFO or socket: only a file, a link or a store is
    ever replaced (run as root, ``--overwrite`` once turned ``/dev/null`` into a directory). Refuse a path
    that cannot even be looked at (a name over 255 bytes failed later, as an internal error)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as e:  # a name too long, a parent that is a file: nothing could be written there
        raise DctchopError(f"output {output}: {e.strerror}") from None
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
        raise DctchopError(f"output {output} is a device, FIFO or socket, not a file; refusing to replace it")


def check_output_file(out: str | os.PathLike, suffixes: tuple[str, ...]) -> Path:
    """A local output file ``out``: named with one of ``suffixes``, in an existing directory, outside any Zarr
    store, and not a directory, device, FIFO or socket. Whether it may be replaced is the caller's to say."""
    names = suffixes[0] if len(suffixes) == 1 else f"{', '.join(suffixes[:-1])} or {suffixes[-1]}"
    if is_url(out):
        raise DctchopError(f"output {out} is a URL; name a local file ending in {names}")
    if os.fspath(out).endswith(("/", os.sep)):
        raise DctchopError(f"output {out} names a directory; name a file ending in {names}")
    out = Path(out)
    if out.suffix.lower() not in suffixes:
        raise DctchopError(f"output {out} must end in {names}")
    refuse_special_file(out, out)
    if out.is_dir():
        raise DctchopError(f"output {out} is a directory; name a file ending in {names}")
    if not out.parent.is_dir():  # as the system resolves it: "sub/.." needs sub, which resolve() does not
        raise DctchopError(f"output directory {out.parent} does not exist")
    holder = store_holding(out)
    if holder is not None:
        raise DctchopError(f"output {out} must not be inside the Zarr store {holder}")
    return out


# renameat2's "relative to the working directory", and its flags: fail if the target exists, swap the two
AT_FDCWD, RENAME_NOREPLACE, RENAME_EXCHANGE = -100, 1, 2


def _renameat2(a: Path, b: Path, flags: int) -> bool:
    """Linux's renameat2 of ``a`` to ``b`` with ``flags``; False, with nothing done, where the system or the file
    system has no such call or flag."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # not Linux, or a C library without it
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), flags) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # a kernel or file system that cannot do it
        return False
    raise OSError(code, os.strerror(code), os.fspath(b))


def exchange(a: Path, b: Path) -> bool:
    """Swap what two local paths name in one atomic step (RENAME_EXCHANGE); False, with nothing done, where
    the system or the file system has no such call."""
    return _renameat2(a, b, RENAME_EXCHANGE)


def rename_new(a: Path, b: Path) -> None:
    """Rename ``a`` to ``b`` where nothing is (FileExistsError otherwise): never over an output another run put
    there meanwhile. In one step where Linux allows (RENAME_NOREPLACE), else a look, then a rename."""
    if _renameat2(a, b, RENAME_NOREPLACE):
        return
    if os.path.lexists(b):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), os.fspath(b))
    os.rename(a, b)


class Location:
    """A store's root. Keys are ``/``-separated paths below it (``images/c.0.0.0``).

    Pickles as its target string, so Dask tasks carry it and make their own filesystem in the worker.
    """

    def __init__(self, target: str | bytes | os.PathLike) -> None:
        self.target = os.fsdecode(target)  # bytes too, as open() takes them
        self.is_url = is_url(self.target)

    def __reduce__(self):
        return (Location, (self.target,))

    def __str__(self) -> str:
        return self.target

    @cached_property
    def _fs(self):
        """(filesystem, root path) for a URL."""
        try:
            import fsspec
        except ImportError:
            raise DctchopError(f"{self.target}: writing to or reading from a URL needs fsspec: "
                               "pip install 'dctchop[dask]'") from None
        try:
            return fsspec.core.url_to_fs(self.target, **self.storage_options)
        except (ImportError, ValueError) as e:
            raise DctchopError(f"{self.target}: {e}") from None

    @property
    def storage_options(self) -> dict:
        """Options for fsspec and for zarr's fsspec store: local ``file://`` paths create parent directories
        as object stores do implicitly."""
        return {"auto_mkdir": True} if self.target.startswith(("file://", "local://")) else {}

    def absolute(self) -> Location:
        """This location with a local path made absolute, for processes whose working directory may differ
        (a Dask cluster's workers)."""
        return self if self.is_url else Location(absolute_path(self.target))

    @property
    def path(self) -> Path:
        """The local directory (local locations only)."""
        assert not self.is_url
        return Path(self.target)

    @property
    def local_path(self) -> Path | None:
        """The local path this location names, URL or not (``file:///x`` is ``/x``); None for a remote one.
        Checks that protect local files (is the output the input?) compare this, never the target text."""
        if not self.is_url:
            return self.path
        fs, root = self._fs  # first: it says so when fsspec is missing
        from fsspec.implementations.local import LocalFileSystem

        return Path(root) if isinstance(fs, LocalFileSystem) else None

    def identity(self) -> tuple[int, int, int] | None:
        """What tells the store now here from one put in its place later (``compress --overwrite`` renames a
        new one in): its directory's device, inode and status-change time, for a local store; None when
        nothing is here, and for a remote one (nothing cheap tells there). The time too, because a file
        system hands a freed inode to the next new directory (ext4 at once: a store removed and another
        renamed in had the old one's number), while a rename sets the time of what it moves."""
        path = self.local_path
        try:
            st = os.stat(path) if path is not None else None
        except OSError:
            return None
        return (st.st_dev, st.st_ino, st.st_ctime_ns) if st is not None else None

    @property
    def in_process(self) -> bool:
        """Whether the location lives in this process's memory (fsspec's ``memory://``), which other processes
        (Dask's workers) do not see."""
        if not self.is_url:
            return False
        from fsspec.implementations.memory import MemoryFileSystem

        return isinstance(self._fs[0], MemoryFileSystem)

    @property
    def name(self) -> str:
        return self.target.rstrip("/").rsplit("/", 1)[-1]

    def sibling(self, name: str) -> Location:
        """Another location in the same parent directory (or prefix)."""
        return Location(self.target.rstrip("/").rsplit("/", 1)[0] + "/" + name if self.is_url
                        else self.path.with_name(name))

    def _key_path(self, key: str) -> str:
        root = self._fs[1] if self.is_url else self.target
        return f"{root.rstrip('/')}/{key}" if key else root

    # ------------------------------------------------------------------------------------------ reading

    def exists(self, key: str = "") -> bool:
        """Whether anything is there: a symbolic link too, even one to nothing (which a rename must replace)."""
        if self.is_url:
            return self._fs[0].exists(self._key_path(key))
        return os.path.lexists(self._key_path(key))

    def is_dir(self) -> bool:
        if self.is_url:
            return self._fs[0].isdir(self._fs[1])
        return self.path.is_dir()

    def is_file(self, key: str) -> bool:
        if self.is_url:
            return self._fs[0].isfile(self._key_path(key))
        return os.path.isfile(self._key_path(key))

    def walk(self):
        """``(key, directories, files)`` of every directory at or below the root, top down (``key`` is ""
        for the root); emptying ``directories`` skips what lies below, as with :func:`os.walk`."""
        fs, root = self._fs if self.is_url else (None, self.target)
        for path, directories, files in (fs.walk(root, topdown=True) if fs else os.walk(root)):
            yield path[len(root):].strip("/"), directories, files

    def read(self, key: str) -> bytes:
        """The bytes of one file; FileNotFoundError when it is missing."""
        if self.is_url:
            return self._fs[0].cat_file(self._key_path(key))
        with open(self._key_path(key), "rb", buffering=0) as f:  # no pathlib, no buffer: read once per chunk
            return f.readall()

    def size(self, key: str = "") -> int:
        """Bytes of every file at or below ``key`` (0 when there is none). Locally, a directory that cannot be
        listed or a file that cannot be looked at (a damaged store's) counts nothing: reading them is where
        the damage is reported."""
        if self.is_url:
            fs, path = self._fs[0], self._key_path(key)
            return sum(int(info["size"]) for info in fs.find(path, detail=True).values()) if fs.exists(path) else 0
        total = 0
        for directory, _, files in os.walk(self._key_path(key)):
            for name in files:
                with contextlib.suppress(OSError):
                    st = os.stat(os.path.join(directory, name))
                    total += st.st_size if stat.S_ISREG(st.st_mode) else 0
        return total

    def open_group(self, mode: str, **kwargs) -> zarr.Group:
        if self.is_url and self.storage_options:
            kwargs["storage_options"] = self.storage_options
        return zarr.open_group(self.target, mode=mode, **kwargs)

    # ------------------------------------------------------------------------------------------ writing

    def write_files(self, files: dict[str, bytes]) -> None:
        """Write whole files (key -> bytes), never recreating the store itself: an interrupted run removes it
        while tasks may still be finishing, and their late chunks must not bring it back. On a URL the files
        go up together (fsspec sends them concurrently on object stores)."""
        if not self.exists("zarr.json"):
            raise DctchopError(f"{self.target} was removed while chunks were being written")
        paths = {self._key_path(key): data for key, data in files.items()}
        if self.is_url:
            fs = self._fs[0]
            for parent in {path.rsplit("/", 1)[0] for path in paths}:
                fs.makedirs(parent, exist_ok=True)  # a no-op on object stores
            fs.pipe(paths)
        else:
            for path, data in paths.items():
                parent = os.path.dirname(path)
                if not os.path.isdir(parent):  # a stat, where a mkdir that fails costs as much as one that works
                    os.makedirs(parent, exist_ok=True)
                Path(path).write_bytes(data)

    def remove(self, check: bool = False) -> None:
        """Remove the whole store (or a file), whichever it is; nothing when absent. A removal goes as far as it
        can (threads of an interrupted run may still be adding files), and with ``check`` then raises the error
        that stopped it. A ``file://`` URL is removed as its local path."""
        local = self.local_path
        if local is None:
            fs, path = self._fs
            try:
                if fs.exists(path):
                    fs.rm(path, recursive=True)
            except OSError:
                if check:
                    raise
        elif local.is_dir() and not local.is_symlink():
            shutil.rmtree(local, ignore_errors=True)
            if check and os.path.lexists(local):
                shutil.rmtree(local)  # only what is left: raises the error that kept it
        else:
            local.unlink(missing_ok=True)

    def rename(self, to: Location) -> None:
        """Move the store to ``to``, where nothing may be (FileExistsError): for a local directory (a ``file://``
        URL's too) in one step; on object stores a server-side copy of each file and a delete (readers may see a
        partial store while it runs), after a look that the place is free."""
        here, there = self.local_path, to.local_path
        if here is not None and there is not None:
            rename_new(here, there)
            return
        fs, path = self._fs
        if fs.exists(to._key_path("")):  # fsspec's mv would move the store into what is there
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), to.target)
        fs.mv(path, to._key_path(""), recursive=True)
