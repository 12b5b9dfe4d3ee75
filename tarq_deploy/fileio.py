"""Atomic writes: every output goes to a temporary name beside its target and is renamed only when complete, so an
interrupted or failed run never leaves a half-written file or directory under the real name.

The finished output gets the permissions any other tool's output gets (0666 / 0777 less the umask: 0644 / 0755
usually), not the private 0600 / 0700 that mkstemp and mkdtemp give their temporary names."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Callable, Iterator

from .errors import UserError

__all__ = ["atomic_directory", "atomic_file", "atomic_path", "default_file_mode", "exclusive_writer",
           "naming_os_errors", "replace_directory", "write_buffers", "write_bytes_atomic", "write_json_atomic",
           "write_text_atomic"]


_UMASK: int | None = None


def current_umask() -> int:
    """The process umask (read once: os.umask can only be read by setting it)."""
    global _UMASK
    if _UMASK is None:
        _UMASK = os.umask(0o022)
        os.umask(_UMASK)
    return _UMASK


def default_file_mode() -> int:
    return 0o666 & ~current_umask()


def default_dir_mode() -> int:
    return 0o777 & ~current_umask()


@contextmanager
def naming_os_errors(path: str | os.PathLike) -> Iterator[None]:
    """An OSError raised without a file name (a write on a full disk: ENOSPC) gets ``path``, the output being
    written, so the message says which output could not be written."""
    try:
        yield
    except OSError as e:
        if e.filename is None and e.errno is not None:
            raise OSError(e.errno, e.strerror or os.strerror(e.errno), str(path)) from e
        raise


@contextmanager
def atomic_path(path: str | os.PathLike, before_rename: Callable[[], None] | None = None) -> Iterator[Path]:
    """A path beside ``path`` that does not exist yet, for a writer that insists on opening the file itself (gguf-py's
    writer, shutil.copyfile, soundfile, a subprocess); the file it makes there is renamed to ``path`` with the usual
    permissions on a clean exit, removed otherwise (and a writer that made no file is an error, not an empty
    output). ``before_rename`` runs last, after the writer: an exception from it removes the file like any other.

    The path lies in a new private directory beside ``path`` (mkdtemp), under ``path``'s own name, so the writer
    creates the file instead of truncating an existing one (see atomic_file for what that costs on ext4)."""
    target = Path(path)
    with naming_os_errors(target):
        target.parent.mkdir(parents=True, exist_ok=True)
        holder = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"))
        try:
            tmp = holder / target.name
            yield tmp
            if not tmp.is_file():
                raise OSError(errno.ENOENT, "the writer made no file", str(target))
            if before_rename is not None:
                before_rename()
            os.chmod(tmp, default_file_mode())
            os.replace(tmp, target)
        finally:
            shutil.rmtree(holder, ignore_errors=True)


@contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "wb", before_rename: Callable[[], None] | None = None
                ) -> Iterator[IO]:
    """Open a temporary file beside ``path`` for writing; on a clean exit it gets the usual permissions and is
    renamed to ``path``, on any exception it is removed. The one way this package writes a file.

    The file is created here (O_EXCL), never opened over one that exists: opening an existing file with O_TRUNC
    ("wb") truncates it, and on ext4 a file truncated to zero is flushed to disk when it is closed (auto_da_alloc,
    its guard for programs that rewrite a file in place), which doubled the time to write a model file
    (bench/export)."""
    with atomic_path(path, before_rename) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, mode) as f:
            yield f


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> Path:
    with atomic_file(path) as f:
        f.write(data)
    return Path(path)


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    return write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: str | os.PathLike, obj: Any, indent: int | None = 2) -> Path:
    return write_text_atomic(path, json.dumps(obj, indent=indent) + "\n")


def set_default_modes(root: str | os.PathLike) -> None:
    """Give a finished output tree the usual permissions: mkdtemp makes its directory 0700, and safetensors and
    mkstemp write 0600 files. Files with other links (hard-linked inputs) are left as they are."""
    os.chmod(root, default_dir_mode())
    for directory, subdirs, files in os.walk(root):
        for name in subdirs:
            path = os.path.join(directory, name)
            if not os.path.islink(path):
                os.chmod(path, default_dir_mode())
        for name in files:
            path = os.path.join(directory, name)
            info = os.lstat(path)
            if not os.path.islink(path) and info.st_nlink == 1:
                os.chmod(path, default_file_mode())


def replace_directory(tmp: Path, out: Path) -> None:
    """Move the finished directory ``tmp`` to ``out``; an existing ``out`` is set aside first and removed only after
    the move (callers decide beforehand whether ``out`` may be replaced at all). ``tmp`` gets the usual permissions
    first (set_default_modes)."""
    set_default_modes(tmp)
    if not out.exists():
        os.replace(tmp, out)
        return
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def atomic_directory(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary directory beside ``path`` to fill; on a clean exit it replaces ``path`` (replace_directory: usual
    permissions, an existing ``path`` set aside and removed), on any exception it is removed."""
    target = Path(path)
    with naming_os_errors(target):
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            yield tmp
            replace_directory(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 16


def write_buffers(f: IO, buffers: list[bytes | memoryview]) -> int:
    """Write ``buffers`` to the open binary file ``f`` in order, handed to the kernel many at a time (os.writev): a
    model file is hundreds of small headers between large tensors, and a write call each cost more than the bytes.
    Returns the byte count."""
    f.flush()
    views = [memoryview(b).cast("B") for b in buffers]
    total = sum(v.nbytes for v in views)
    if not hasattr(os, "writev"):
        for v in views:
            f.write(v)
        return total
    fd, start = f.fileno(), 0
    while start < len(views):
        written = os.writev(fd, views[start:start + IOV_MAX])
        while written and written >= views[start].nbytes:  # drop what went out whole
            written -= views[start].nbytes
            start += 1
        if written:  # a short write ended inside this buffer
            views[start] = views[start][written:]
    return total


# ------------------------------------------------------------------------------------------------ one writer
class OutputLocked(UserError):
    """Another process is writing the same output; the message names the lock file and the holder's pid."""


@contextmanager
def exclusive_writer(lock_path: str | os.PathLike, option: str, output: str | os.PathLike) -> Iterator[Path]:
    """Hold an exclusive lock on ``lock_path`` (fcntl.flock, with this process's pid and host written in it) for
    the body; OutputLocked, naming ``option output``, the lock file and the holder, when another process holds it.

    flock, not a file that merely exists: the kernel releases the lock when its holder dies, however it dies, so an
    interrupted run leaves no lock behind that refuses the run resuming it; a stale file is simply locked again.
    The lock file is removed on the way out."""
    path = Path(lock_path)
    with naming_os_errors(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = _lock(path, option, output)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        yield path
    finally:
        # Unlinked while still held, then released: a process that opened the old file meanwhile finds it gone
        # once it gets the lock (_lock checks) and locks a fresh file, so two runs never both hold "the" lock.
        if _is_the_file_at(fd, path):
            path.unlink()
        os.close(fd)


def _lock(path: Path, option: str, output: str | os.PathLike) -> int:
    """A descriptor of the file at ``path`` holding its exclusive lock; OutputLocked when another process holds it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise OutputLocked(f"{option} {output}: another run is writing it ({holder} holds the lock {path}); wait "
                               f"for it to finish or choose another {option}") from None
        if _is_the_file_at(fd, path):
            return fd
        os.close(fd)  # its holder removed it between our open and our lock: lock the one there now


def _is_the_file_at(fd: int, path: Path) -> bool:
    try:
        found = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (found.st_dev, found.st_ino) == (mine.st_dev, mine.st_ino)


def _holder(fd: int) -> str:
    """'pid 1234 on node-a' from a lock file's contents (empty for an instant while its holder writes them)."""
    fields = os.pread(fd, 256, 0).decode("utf-8", "replace").split()
    if not fields or not fields[0].isdigit():
        return "a process whose pid it does not record yet"
    host = f" on {fields[1]}" if len(fields) > 1 and fields[1] != socket.gethostname() else ""
    return f"pid {fields[0]}{host}"
