"""The one check every file poolkeeper writes goes through (``bench``/``compare``/``replay --json``,
``report -o``, ``lab --write``, ``Snapshot.to_json`` / ``to_html`` / ``to_torch``)."""
from __future__ import annotations

import os
import stat
from typing import Any

from poolkeeper.errors import InvalidArgumentError

_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISSOCK, "a socket"))


def path_arg(path: Any, what: str = "path") -> str:
    """``path`` as a ``str`` if it is a ``str`` or ``os.PathLike`` naming a file, else
    :class:`InvalidArgumentError`: an int is refused because ``open(3)`` would adopt a
    descriptor the program owns and close it when done (stdin for 0)."""
    if isinstance(path, (bool, int)) or not isinstance(path, (str, os.PathLike)):
        raise InvalidArgumentError(f"{what} must be a file path (str or os.PathLike), not {type(path).__name__} {path!r:.60}")
    p = os.fspath(path)
    if not isinstance(p, str):
        raise InvalidArgumentError(f"{what} must be a text path, not {type(p).__name__}")
    if not p or "\0" in p:
        raise InvalidArgumentError(f"{what} must be a non-empty path without NUL characters; got {p!r:.60}")
    return p


def output_path(path: Any, what: str = "output path") -> str:
    """``path`` as a ``str`` if poolkeeper may write a file there, else :class:`InvalidArgumentError`.

    Accepted: a ``str`` or ``os.PathLike`` naming a regular file or nothing yet. A symlink is
    followed: a link to a regular file is written through (the link stays, its target gets the
    data, as ``open(path, "w")`` does), a link to anything else is judged by what it points to.

    Refused before anything is opened:

    - what :func:`path_arg` refuses: an int (``open(3, "w")`` would adopt, write into and then
      close a descriptor the program owns), any other non-path, an empty path or one holding a NUL;
    - an existing directory, device, FIFO or socket: an atomic write renames a temporary file
      over the path, which replaces a device node (``--json /dev/null`` run as root would destroy
      ``/dev/null`` for the whole machine), and a FIFO blocks until someone reads it.

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
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
        raise InvalidArgumentError(f"{what} {p!r} is {kind}; poolkeeper writes only regular files")
    return p


__all__ = ["path_arg", "output_path"]
