"""``CopyCompleted``: proof that one copy out of one staging buffer has finished.

A staging buffer is the *source* of a host-to-device copy. Handing it back to the pool while the
copy's DMA still reads it lets the next user overwrite bytes that have not reached the device yet:
silent corruption. So the only way back into the pool is ``staged.retire(witness)``, and a witness
exists only where poolkeeper's copy path has observed the copy complete.

How the witness is protected (threat model)
--------------------------------------------
Python cannot make forgery impossible against deliberate introspection: anyone can import private
names, call ``object.__new__`` or poke at private attributes. What this module guarantees is that
*accidental* misuse cannot reach a retire:

- ``CopyCompleted(...)`` raises :class:`~poolkeeper.errors.WitnessError`; subclassing raises
  ``TypeError``; ``copy.copy``, ``copy.deepcopy`` and pickling raise ``WitnessError``; its attributes
  are read-only.
- Minting (:func:`_mint`) takes the copy's job record and refuses unless that job has completed,
  so even poolkeeper's own code cannot mint early by mistake.
- Every witness carries a fresh, unguessable token that is also registered on the lease of the
  buffer it covers (``_lease.Lease`` owns that registry: one witness per copy). ``retire``
  accepts a witness only if it is of this exact type, covers *this* buffer (identity, not
  address: a recycled address is a different lease), is not yet consumed, and its token is still
  registered there; retiring removes the token and marks the witness consumed, and
  a lease that ends (retired, closed, collected) voids every witness still registered on it. A
  witness built with ``object.__new__`` has no registered token, and a field-by-field duplicate of a
  real witness shares its token, so it can be used at most once between them.
- ``retire`` also refuses while any *other* copy from the same buffer is still in flight, so a
  witness of copy 1 cannot release memory that copy 2 is still reading.
"""
from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING, Any, Optional

from poolkeeper.errors import WitnessError

if TYPE_CHECKING:  # pragma: no cover
    from poolkeeper.staging.buffer import StagingBuffer

_serials = itertools.count(1)


class CopyCompleted:
    """Proof that a copy from a staging buffer has completed; authorizes exactly one ``retire``.

    Only :func:`poolkeeper.staging.copy` (blocking) and :meth:`PendingCopy.wait` create one.
    Read-only attributes: ``nbytes`` (bytes copied), ``copy_seq`` (which copy of its buffer, from 1),
    ``consumed`` and ``serial`` (process-wide mint number, for logs).
    """

    __slots__ = ("_token", "_buffer_ref", "_seq", "_nbytes", "_serial", "_consumed")

    def __new__(cls, *args: Any, **kwargs: Any) -> "CopyCompleted":
        raise WitnessError(
            "CopyCompleted cannot be constructed: it is returned by poolkeeper.staging.copy() or "
            "PendingCopy.wait() once the copy has completed"
        )

    def __init_subclass__(cls, **kwargs: Any) -> None:
        raise TypeError("CopyCompleted cannot be subclassed")

    def __setattr__(self, name: str, value: Any) -> None:
        raise WitnessError("a CopyCompleted is read-only")

    def __delattr__(self, name: str) -> None:
        raise WitnessError("a CopyCompleted is read-only")

    def __copy__(self) -> "CopyCompleted":
        raise WitnessError("a CopyCompleted cannot be copied: it authorizes exactly one retire")

    def __deepcopy__(self, memo: Any) -> "CopyCompleted":
        raise WitnessError("a CopyCompleted cannot be copied: it authorizes exactly one retire")

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise WitnessError("a CopyCompleted cannot be pickled: it is only meaningful in this process")

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def copy_seq(self) -> int:
        return self._seq

    @property
    def serial(self) -> int:
        return self._serial

    @property
    def consumed(self) -> bool:
        return self._consumed

    def covers(self, buffer: "StagingBuffer") -> bool:
        """Whether this witness was minted for a copy out of ``buffer`` (this lease of it)."""
        return self._buffer_ref() is buffer

    def __repr__(self) -> str:
        buf = self._buffer_ref()
        where = f"buffer 0x{buf.ptr:x}" if buf is not None else "a buffer that no longer exists"
        state = "consumed" if self._consumed else "unused"
        return f"<CopyCompleted #{self._serial}: copy {self._seq} of {where}, {self._nbytes} bytes, {state}>"


# The package interface of this module: the lease (``_lease.Lease``) is its only caller. This
# module knows a witness's layout; the lease owns the registry of minted witnesses and decides.
def _mint(buffer: "StagingBuffer", job: Any) -> CopyCompleted:
    """Create the witness for ``job`` (a completed copy out of ``buffer``), with a fresh token.
    The caller (``Lease.mint``) registers it."""
    if not job.query():
        raise WitnessError("internal error: a witness was requested for a copy that has not completed")
    w = object.__new__(CopyCompleted)
    s = object.__setattr__
    s(w, "_token", object())
    s(w, "_buffer_ref", weakref.ref(buffer))
    s(w, "_seq", job.seq)
    s(w, "_nbytes", job.nbytes)
    s(w, "_serial", next(_serials))
    s(w, "_consumed", False)
    return w


def _fields(witness: Any, buffer: Any) -> tuple[object, int]:
    """``(token, copy seq)`` of ``witness`` if it is an unused witness covering ``buffer``;
    WitnessError if it is not a CopyCompleted, was not built by :func:`_mint`, was consumed, or
    covers another buffer. Whether its token is registered is the lease's check."""
    if type(witness) is not CopyCompleted:
        raise WitnessError(
            "retire() needs the CopyCompleted returned by copy() or PendingCopy.wait() for this "
            f"buffer; got {type(witness).__name__}"
        )
    try:
        token = witness._token
        ref = witness._buffer_ref
        consumed = witness._consumed
        seq = witness._seq
    except AttributeError:
        raise WitnessError("this CopyCompleted was not minted by poolkeeper's copy path") from None
    if consumed:
        raise WitnessError(f"this witness (copy {seq}) was already consumed by a retire")
    owner: Optional[Any] = ref() if callable(ref) else None
    if owner is not buffer:
        other = f"0x{owner.ptr:x}" if owner is not None else "a buffer that no longer exists"
        where = f"0x{buffer.ptr:x}" if buffer is not None else "a buffer that no longer exists"
        raise WitnessError(
            f"this witness covers copy {seq} of {other}, not this buffer ({where}); a "
            "witness can only retire the buffer its own copy read from"
        )
    return token, seq


def _token(witness: CopyCompleted) -> object:
    """The token of a witness :func:`_mint` built."""
    return witness._token


def _consume(witness: CopyCompleted) -> None:
    """Mark ``witness`` used (the lease has committed the retire it authorized)."""
    object.__setattr__(witness, "_consumed", True)


__all__ = ["CopyCompleted"]
