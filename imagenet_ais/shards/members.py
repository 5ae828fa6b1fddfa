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
from typing import BinaryIO, cast

from imagenet_ais.errors import DataError

MAX_MEMBER_BYTES = 64 * 2**20  # one sample's image: ImageNet's largest is under 20 MB
BLOCK = tarfile.BLOCKSIZE
MAX_EXTENDED = 1 << 20  # bytes of a PAX or GNU long-name header read: names and sizes, not data
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
    (default: every one), in stored order; folders are passed over. A compressed tar goes
    through tarfile's stream; a plain one is read header by header (``_plain``: tarfile's stream
    reads it at a third of the rate, the limit of an index on few cores)."""
    head = stream.read(BLOCK)
    if not _plain_start(head):  # (compressed: gzip, bzip2, xz; or no tar at all, as tarfile says)
        yield from _through_tarfile(cast(BinaryIO, _Prefixed(head, stream)), wanted)
        return
    for member in _plain(head, stream):
        if member.isdir():
            _skip(stream, member.size)
            continue
        _judge_kind(member)
        if wanted and not wanted(member.name):
            _skip(stream, member.size)  # passed over unread (its bytes still go by: a hash sees them)
            continue
        _judge_size(member)
        data = _exactly(stream, member.size)
        _exactly(stream, -member.size % BLOCK)
        yield member.name, data


def _plain(head: bytes, stream: BinaryIO) -> Iterator[tarfile.TarInfo]:
    """Each member's header (``head`` the first block), its name and size as the PAX or GNU
    headers before it give them; the stream is left at its bytes. Ends at the end-of-archive block."""
    extended: dict[str, str] = {}
    while len(head) == BLOCK and head.count(0) < BLOCK:
        try:
            member = tarfile.TarInfo.frombuf(head, "utf-8", "surrogateescape")
        except tarfile.HeaderError as e:
            raise tarfile.ReadError(f"invalid header ({e})") from None
        if member.size < 0:  # (a base-256 size field can say so)
            raise tarfile.ReadError(f"member {member.name!r} declares a size below 0")
        if member.type in (tarfile.XHDTYPE, tarfile.GNUTYPE_LONGNAME):  # what the next member is called, how large
            if member.size > MAX_EXTENDED:
                raise tarfile.ReadError(f"an extended header of {member.size:,} bytes, over the {MAX_EXTENDED:,} read")
            body = _exactly(stream, member.size + -member.size % BLOCK)[: member.size]
            extended |= _pax(body) if member.type == tarfile.XHDTYPE else {"path": _text(body.rstrip(b"\0"))}
        elif member.type in (tarfile.XGLTYPE, tarfile.GNUTYPE_LONGLINK):
            _skip(stream, member.size)  # (defaults for all, a link's target: nothing a sample takes)
        else:
            member.name = extended.get("path", member.name)
            member.size = _size(extended.get("size"), member.size)
            if any(k.startswith("GNU.sparse.") for k in extended):
                member.type = tarfile.GNUTYPE_SPARSE  # (a PAX sparse file: judged as GNU's)
            extended = {}
            yield member
        head = stream.read(BLOCK)
    if head and len(head) < BLOCK:
        raise tarfile.ReadError("unexpected end of data")


def _plain_start(head: bytes) -> bool:
    """Whether a stream starting with ``head`` is a plain tar: a whole block that is a header
    (its checksum right) or the end-of-archive block."""
    if len(head) < BLOCK:
        return False
    if head.count(0) == BLOCK:
        return True
    try:
        tarfile.TarInfo.frombuf(head, "utf-8", "surrogateescape")
    except tarfile.HeaderError:
        return False
    return True


def _pax(body: bytes) -> dict[str, str]:
    """A PAX header's records, ``LENGTH KEY=VALUE\\n`` each."""
    records, at = {}, 0
    try:
        while at < len(body) and body[at : at + 1] != b"\0":
            space = body.index(b" ", at)
            length = int(body[at:space])
            if length <= space - at:  # (0 would read the same record for ever)
                raise ValueError(length)
            key, _, value = body[space + 1 : at + length - 1].partition(b"=")
            records[key.decode("utf-8", "surrogateescape")] = _text(value)
            at += length
    except ValueError:
        raise tarfile.ReadError("invalid PAX header") from None
    return records


def _size(pax: str | None, header: int) -> int:
    """A member's size: its PAX header's, where it gives one (a ReadError where that is no size), else its own."""
    if pax is None:
        return header
    if not pax.isascii() or not pax.isdigit():
        raise tarfile.ReadError(f"PAX size {pax[:20]!r} is no size")
    return int(pax)


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


def _exactly(stream: BinaryIO, size: int) -> bytes:
    """The next ``size`` bytes of ``stream`` (a ReadError where it ends before)."""
    data = stream.read(size) if size else b""
    while len(data) < size:
        more = stream.read(size - len(data))
        if not more:
            raise tarfile.ReadError("unexpected end of data")
        data += more
    return data


def _skip(stream: BinaryIO, size: int) -> None:
    """Past a member's ``size`` bytes and their padding, a block of at most 1 MiB at a time."""
    left = size + -size % BLOCK
    while left:
        left -= len(_exactly(stream, min(left, 1 << 20)))


def _through_tarfile(stream: BinaryIO, wanted: Callable[[str], bool] | None) -> Iterator[tuple[str, bytes]]:
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


class _Prefixed:
    """``stream`` with ``head``, already read from it, put back in front."""

    def __init__(self, head: bytes, stream: BinaryIO) -> None:
        self.head, self.stream = head, stream

    def read(self, n: int = -1) -> bytes:
        if not self.head:
            return self.stream.read(n)
        if n < 0:
            data, self.head = self.head + self.stream.read(), b""
            return data
        data, self.head = self.head[:n], self.head[n:]
        return data


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
