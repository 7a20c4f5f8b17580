"""metadata.json documents in tests, read and written as docs/format.md describes them (not with reshard's
own encoder), so that a test can change a document and write it back as a valid one.

From format version 3 a document ends with its own checksum member, ``"metadata_crc32c"``: the CRC-32C of
every byte of the document before its 8 hexadecimal digits (docs/format.md section 6). :func:`write_doc`
seals what it writes when the document's version is 3 or later, as a writer (or a forger who knows the
format) would; :func:`read_doc` returns the members without the checksum.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import crc32c

CHECKSUM_MEMBER = "metadata_crc32c"
SEALED_VERSION = 3


def seal(body: bytes) -> bytes:
    """``body`` (a JSON object's text without the checksum member) with the member added at its end."""
    text = body.rstrip()
    assert text.endswith(b"}"), text[-20:]
    head = text[:-1] + b',"' + CHECKSUM_MEMBER.encode() + b'":"'
    return head + f"{crc32c.crc32c(head):08x}".encode() + b'"}'


def unseal(raw: bytes) -> bytes:
    """A sealed document's text without its checksum member (ending with ``}``), to edit and seal again."""
    member = b',"' + CHECKSUM_MEMBER.encode() + b'":"'
    at = raw.rfind(member)
    assert at > 0 and raw.endswith(b'"}') and len(raw) - at == len(member) + 10, raw[-60:]
    return raw[:at] + b"}"


def dumps(doc: dict[str, Any], **json_kwargs: Any) -> bytes:
    """The text of ``doc`` (its checksum member, if any, dropped and recomputed for versions >= 3)."""
    body = {k: v for k, v in doc.items() if k != CHECKSUM_MEMBER}
    kwargs = json_kwargs or {"separators": (",", ":")}
    raw = json.dumps(body, **kwargs).encode()
    version = doc.get("version")
    return seal(raw) if isinstance(version, int) and version >= SEALED_VERSION else raw


def write_doc(path: Path, doc: dict[str, Any], **json_kwargs: Any) -> bytes:
    """Write ``doc`` as the ``metadata.json`` at ``path`` (a file, or a checkpoint directory)."""
    target = path / "metadata.json" if path.is_dir() else path
    raw = dumps(doc, **json_kwargs)
    target.write_bytes(raw)
    return raw


def read_doc(path: Path) -> dict[str, Any]:
    """The members of the ``metadata.json`` at ``path`` (a file or a checkpoint directory), without the
    checksum member."""
    target = path / "metadata.json" if path.is_dir() else path
    doc = json.loads(target.read_bytes())
    doc.pop(CHECKSUM_MEMBER, None)
    return doc
