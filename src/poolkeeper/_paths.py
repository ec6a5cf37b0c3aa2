"""The one check every file poolkeeper writes goes through (``bench``/``compare``/``replay --json``,
``report -o``, ``lab --write``, ``Snapshot.to_json`` / ``to_html`` / ``to_torch``)."""
from __future__ import annotations

import os
import stat
from typing import Any

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


__all__ = ["path_arg", "output_path", "is_special", "own_stream"]
