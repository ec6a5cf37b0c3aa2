"""The one check every file poolkeeper writes goes through (``bench``/``compare``/``replay --json``,
``report -o``, ``lab --write``, ``Snapshot.to_json`` / ``to_html`` / ``to_torch``), and the one
way they are written (:func:`write_output`: whole or not at all)."""
from __future__ import annotations

import errno
import os
import secrets
import stat
from typing import Any, Iterable, Union

from poolkeeper.errors import InvalidArgumentError, brief

_REFUSED = ((stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def path_arg(path: Any, what: str = "path") -> str:
    """``path`` as a ``str`` if it is a ``str`` or ``os.PathLike`` naming a file, else
    :class:`InvalidArgumentError`: an int is refused because ``open(3)`` would adopt a
    descriptor the program owns and close it when done (stdin for 0)."""
    if isinstance(path, (bool, int)) or not isinstance(path, (str, os.PathLike)):
        raise InvalidArgumentError(f"{what} must be a file path (str or os.PathLike), not {brief(path)}")
    p = os.fspath(path)
    if not isinstance(p, str):
        raise InvalidArgumentError(f"{what} must be a text path, not {type(p).__name__}")
    if not p or "\0" in p:
        raise InvalidArgumentError(f"{what} must be a non-empty path without NUL characters; got {brief(p)}")
    return p


def output_path(path: Any, what: str = "output path") -> str:
    """``path`` as a ``str`` if poolkeeper may write there, else :class:`InvalidArgumentError`.

    Accepted: a ``str`` or ``os.PathLike`` naming a regular file or nothing yet, and an existing
    character device or FIFO (``--json /dev/stdout``, ``/dev/null``, a pipe a reader waits on),
    which is written straight, as a shell redirection writes it -- never replaced (see
    :func:`is_special`). A symlink is followed: a link to a regular file is written through (the
    link stays, its target gets the data, as ``open(path, "w")`` does), a link to anything else is
    judged by what it points to.

    Refused before anything is opened:

    - what :func:`path_arg` refuses: an int (``open(3, "w")`` would adopt, write into and then
      close a descriptor the program owns), any other non-path, an empty path or one holding a NUL;
    - an existing directory, block device (a disk: a mistyped path must not overwrite it) or socket.

    A path that cannot be examined (permission, a component that is not a directory) passes, so
    that the write itself reports the ``OSError``.
    """
    p = path_arg(path, what)
    try:
        mode = os.stat(p).st_mode
    except (OSError, ValueError):
        return p
    if stat.S_ISDIR(mode):
        raise InvalidArgumentError(f"{what} {p!r} is a directory")
    for test, name in _REFUSED:
        if test(mode):
            raise InvalidArgumentError(f"{what} {p!r} is {name}; poolkeeper writes regular files, character devices and FIFOs")
    return p


def is_special(path: str) -> bool:
    """True if ``path`` must be written straight rather than atomically (a temporary file renamed
    over it): it exists and is not a regular file (a character device or a FIFO, once
    :func:`output_path` accepted it: the rename replaced the device node itself, and ``bench
    --json /dev/null`` run as root destroyed ``/dev/null`` for the whole machine), or it reaches a
    descriptor of this process (``/dev/stdout``, ``/dev/fd/N``, ``/proc/self/fd/N``: on a pipe
    the resolved name ``pipe:[N]`` does not exist, and on a file the rename cut the program's own
    output off)."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return False
    if not stat.S_ISREG(st.st_mode) or _own_stream(st) is not None:
        return True
    return os.path.realpath(path).startswith("/proc/")


def own_stream(path: str) -> Any:
    """``sys.stdout`` or ``sys.stderr`` if ``path`` is the same file as this process's standard
    output or error (``/dev/stdout`` with the output redirected to a file), else None: writing
    there through the open stream keeps what the program printed before, where reopening the path
    would truncate it."""
    try:
        return _own_stream(os.stat(path))
    except (OSError, ValueError):
        return None


def _own_stream(st: os.stat_result) -> Any:
    import sys

    for fd, stream in ((1, sys.stdout), (2, sys.stderr)):
        try:
            if os.path.samestat(st, os.fstat(fd)):
                return stream
        except OSError:
            continue
    return None


def check_not_input(out: str, inputs: Iterable[Any], what: str = "output path") -> None:
    """:class:`InvalidArgumentError` if ``out`` names an existing regular file that is also one of
    ``inputs`` (the same file by device and inode: through a symlink, a hard link or another
    spelling of the path). ``report snap.html`` (the default output of ``X.html`` is ``X.html``)
    and ``replay LOG --json LOG`` replaced the file they had read. A character device or FIFO is
    written straight, never replaced, so reading and writing ``/dev/tty`` stays allowed."""
    try:
        st = os.stat(out)
    except (OSError, ValueError):
        return
    if not stat.S_ISREG(st.st_mode):
        return
    for src in inputs:
        try:
            same = os.path.samestat(st, os.stat(src))
        except (OSError, ValueError, TypeError):
            continue
        if same:
            raise InvalidArgumentError(
                f"{what} {out!r} is the input file {os.fspath(src)!r}: writing there would replace what is being read; "
                "choose another output path")


# fsync's answers from a file system that cannot sync (some FUSE and network mounts): the data is
# written all the same, so they are no failure of the write.
_CANNOT_SYNC = {errno.EINVAL, errno.ENOTSUP, getattr(errno, "EOPNOTSUPP", errno.ENOTSUP)}


def _sync(fd: int) -> None:
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in _CANNOT_SYNC:
            raise


def _fill(fd: int, data: bytes) -> None:
    """Write ``data`` to the new file ``fd``, flush it to the disk and close it. Without the
    ``fsync`` the rename could reach the disk before the data (ext4, XFS): a power cut then left an
    empty file under the target's name."""
    with open(fd, "wb") as f:
        f.write(data)
        f.flush()
        _sync(f.fileno())


def _sync_folder(folder: str) -> None:
    """Flush the rename itself (the folder's entry), where the platform can open a folder; a
    failure here loses no data of the new file, so it is not reported."""
    flags = getattr(os, "O_DIRECTORY", None)
    if flags is None:  # Windows: folders cannot be opened, and NTFS orders its metadata itself
        return
    try:
        fd = os.open(folder, os.O_RDONLY | flags | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_output(path: Any, data: Union[bytes, str], what: str = "output path", inputs: Iterable[Any] = ()) -> str:
    """Write ``data`` to ``path`` whole or not at all; return the path as given (a ``str``).

    ``path`` is checked by :func:`output_path` and :func:`check_not_input`. A regular file (or
    nothing yet) is replaced atomically: the data goes to a new file beside it (``.NAME.XXXX.tmp``),
    which is renamed over the target only once written, flushed to the disk (``fsync``) and
    closed, so a full disk, a refused write, a Ctrl-C or a power cut leaves the old file (or none)
    and no temporary file, never a half-written or empty one; the folder is synced after the
    rename where the platform allows. A symlink is written through (the link stays, its target is replaced); a new file gets
    the permissions ``open()`` would give it, a replaced one keeps its mode. A character device
    or FIFO (``/dev/stdout``, ``/dev/null``, a pipe) is written straight, never renamed over (see
    :func:`is_special`). ``str`` data is encoded as UTF-8, a lone surrogate written escaped
    (``\\ud800``), before anything is opened."""
    p = output_path(path, what)
    check_not_input(p, inputs, what)
    if isinstance(data, str):
        data = data.encode("utf-8", errors="backslashreplace")
    if is_special(p):
        stream = own_stream(p)
        if stream is not None:  # our own stdout/stderr: keep what was printed before
            stream.flush()
            buf = getattr(stream, "buffer", None)
            if buf is not None:
                buf.write(data)
                buf.flush()
            else:
                stream.write(data.decode("utf-8", errors="replace"))
            stream.flush()
            return p
        with open(p, "wb") as f:
            f.write(data)
        return p
    try:
        os.stat(p)
    except OSError as e:
        if e.errno == errno.ELOOP:  # a loop of links: open() refuses it; renaming would replace a link
            raise OSError(e.errno, e.strerror, p) from None
    except ValueError:
        pass
    target = os.path.realpath(p)
    folder, name = os.path.split(target)
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode)
    except (OSError, ValueError):
        mode = None
    if len(os.fsencode(name)) > 200:  # room for the temporary's prefix and suffix within NAME_MAX
        name = "poolkeeper-output"
    while True:
        tmp = os.path.join(folder, f".{name}.{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
            break
        except FileExistsError:
            continue
        except OSError as e:  # no such folder, no permission: said of the path asked for, not of the temporary
            raise OSError(e.errno, e.strerror, p) from None
    try:
        _fill(fd, data)
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException as e:
        try:
            os.remove(tmp)
        except OSError:
            pass
        if isinstance(e, OSError) and e.errno is not None:
            raise OSError(e.errno, e.strerror, p) from None
        raise
    _sync_folder(folder)
    return p


__all__ = ["path_arg", "output_path", "is_special", "own_stream", "check_not_input", "write_output"]
