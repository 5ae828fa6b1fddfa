"""A shard's members, each judged by its tar header before a byte of it is read.

A header can declare anything: a GNU sparse member of 3 GiB stored in 30 KB (tarfile fills its
holes with zeros as it reads: a worker held 3.6 GB for one draw), a link, a device. Only regular
files of at most ``MAX_MEMBER_BYTES``, named in printable UTF-8 of at most ``MAX_NAME``
characters, are read; any other member is a
``BadMember`` error, and the shard is unreadable from there on, for training and ``verify`` alike.
"""

from __future__ import annotations

import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from imagenet_ais.errors import DataError

MAX_MEMBER_BYTES = 64 * 2**20  # one sample's image: ImageNet's largest is under 20 MB
MAX_NAME = 1024  # characters of a member's name: a sample's key is one line of --log-keys, of metrics
_KINDS = {
    tarfile.GNUTYPE_SPARSE: "a sparse file",
    tarfile.SYMTYPE: "a symbolic link",
    tarfile.LNKTYPE: "a hard link",
    tarfile.CHRTYPE: "a character device",
    tarfile.BLKTYPE: "a block device",
    tarfile.FIFOTYPE: "a pipe",
    tarfile.CONTTYPE: "a contiguous file",
}


class BadMember(DataError):
    """A member that is not a plain file a sample could hold."""


def members(stream: BinaryIO, wanted: Callable[[str], bool] | None = None) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of each regular member of the tar ``stream`` whose name is ``wanted``
    (default: every one), in stored order; folders are passed over."""
    with tarfile.open(fileobj=stream, mode="r|*") as tar:
        for member in tar:
            if member.isdir():
                continue
            _judge_kind(member)
            if wanted and not wanted(member.name):
                continue  # passed over unread (a stream skips its stored bytes)
            _judge_size(member)
            data = tar.extractfile(member)
            yield member.name, data.read() if data else b""


def check_headers(path: Path) -> None:
    """Every member of the tar file at ``path`` judged by its header alone (its bytes are sought
    past, never read), as ``members`` would judge it: for a copy that nothing reads yet."""
    with tarfile.open(path, mode="r:") as tar:
        for member in tar:
            if not member.isdir():
                _judge_kind(member)
                _judge_size(member)


def _judge_kind(member: tarfile.TarInfo) -> None:
    """BadMember where ``member`` is no regular file, or is not named in printable UTF-8 of at most MAX_NAME."""
    if member.type not in (tarfile.REGTYPE, tarfile.AREGTYPE):
        kind = _KINDS.get(member.type, f"of tar type {member.type!r}")
        raise BadMember(f"member {member.name!r} is {kind}, not a regular file")
    if not member.name.isascii() and not _utf8(member.name):  # tarfile keeps other bytes as surrogates
        raw = member.name.encode("utf-8", "surrogateescape")
        raise BadMember(f"member name {raw!r} is not UTF-8, as sample keys must be: rename it")
    if not member.name.isprintable() or len(member.name) > MAX_NAME:  # a newline made a key two lines
        shown = member.name if len(member.name) <= 80 else member.name[:80] + "…"
        raise BadMember(f"member name {shown!r} holds control characters or is over {MAX_NAME} characters: rename it")


def _judge_size(member: tarfile.TarInfo) -> None:
    """BadMember where ``member`` declares more than a sample may hold."""
    if member.size > MAX_MEMBER_BYTES:
        raise BadMember(
            f"member {member.name!r} declares {member.size:,} bytes, over the {MAX_MEMBER_BYTES:,} one sample may hold"
        )


def _utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
