"""``multipart/form-data`` request bodies (RFC 7578 over RFC 2046), parsed strictly and within
bounds: what ``POST /v1/images/edits`` and ``/v1/images/variations`` receive.

Pure and synchronous (no trio, no I/O), and deliberately small: the whole body is already in
memory (the app caps it at ``max_body_bytes``), so :func:`parse_form` is one linear pass over
it with ``bytes.find``, and nothing it allocates outgrows the body.

:func:`boundary_of` takes the request's ``Content-Type`` header and returns its boundary;
:func:`parse_form` splits the body into :class:`Part` s, in the order sent; :func:`fields`
decodes the text fields (the parts without a ``filename``) to a ``{name: value}`` dict.

Bounds (each a :class:`MultipartError` with the code in brackets when exceeded):

- ``max_parts`` parts in all [``too_many_parts``];
- :data:`MAX_HEADER_BYTES` (8 KiB) for the header block of one part [``headers_too_large``];
- ``max_field_bytes`` for the value of a text field, ``max_file_bytes`` for the content of a
  file part (one that has a ``filename``, even ``filename=""``) [``part_too_large``, ``param``
  names the part];
- a boundary of 1..70 characters of RFC 2046's ``bchars``, not ending in a space
  [``missing_boundary`` when there is none, ``invalid_boundary`` when it is malformed].

What is accepted: delimiter lines ``--boundary`` each preceded by CRLF (except at the very
start of the body), optionally followed by spaces or tabs (transport padding) and CRLF; the
close delimiter ``--boundary--``; header lines ending in CRLF, then an empty line.  Every part
needs ``Content-Disposition: form-data; name="..."``: a quoted string (``\\`` escapes the next
character) or a token.  ``filename`` is optional; ``filename*`` (RFC 5987) is refused, as RFC
7578 forbids it.  Names are kept exactly as sent (``image[]`` stays ``image[]``); the
percent-escapes that browsers and httpx write for ``"``, CR and LF in a name are *not*
decoded (they are ambiguous: ``%`` itself is not escaped).  ``Content-Type`` is kept as sent;
``Content-Transfer-Encoding`` other than ``7bit``, ``8bit`` or ``binary`` is refused (nothing
is decoded); other part headers are ignored.  The preamble before the first delimiter and the
epilogue after the close delimiter are ignored.  This is what httpx (and so the ``openai``
SDK), curl and browsers send.

What is refused [``invalid_multipart`` unless said otherwise]: a body with no delimiter, or
whose last part has no closing delimiter (truncated); a delimiter followed by anything but
padding and CRLF; a header line that is not ``name: value`` (obs-fold included), has a
control character or is not UTF-8; a duplicate ``Content-Disposition`` or ``Content-Type``; a
disposition other than ``form-data`` [``invalid_disposition``]; a part without a
``Content-Disposition`` or a (non-empty) ``name`` [``missing_name``].  :func:`fields` refuses
a text field that is not UTF-8 [``invalid_encoding``] or a name sent twice as a text field
[``duplicate_field``].

``param`` of a :class:`MultipartError` names the part when the error is about one part whose
name is known, else it is ``None``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "MAX_BOUNDARY_CHARS",
    "MAX_HEADER_BYTES",
    "MultipartError",
    "Part",
    "boundary_of",
    "fields",
    "parse_form",
]

MAX_HEADER_BYTES = 8 * 1024
MAX_BOUNDARY_CHARS = 70
_CRLF = b"\r\n"
# RFC 2046 5.1.1: bchars := bcharsnospace / " "; the last character is not a space.
_BOUNDARY = re.compile(r"[0-9A-Za-z'()+_,\-./:=? ]{0,69}[0-9A-Za-z'()+_,\-./:=?]")
# RFC 9110 5.6.2 token; 5.6.4 quoted-string (qdtext may be any non-control text, UTF-8 too).
_TOKEN_CHARS = r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_TOKEN = re.compile(_TOKEN_CHARS)
_QUOTED = r'"((?:[^"\\\x00-\x08\x0a-\x1f\x7f]|\\[^\x00-\x08\x0a-\x1f\x7f])*)"'
# One parameter ``; name=value`` with value a token or a quoted string (RFC 9110 5.6.6).
_PARAM = re.compile(rf"[ \t]*;[ \t]*({_TOKEN_CHARS})[ \t]*=[ \t]*(?:({_TOKEN_CHARS})|{_QUOTED})")
_QUOTED_PAIR = re.compile(r"\\(.)")
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
_IDENTITY_ENCODINGS = frozenset({"7bit", "8bit", "binary"})


class MultipartError(ValueError):
    """A body that is not acceptable ``multipart/form-data``; answered as a 400.

    ``code`` is a short machine-readable reason (see the module docstring); ``param`` names
    the offending part when there is one, else ``None``.
    """

    def __init__(self, message: str, *, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param


@dataclass(frozen=True, slots=True)
class Part:
    """One part of a form, as sent.

    ``filename`` is ``None`` for a text field and a string (maybe empty: a file input with no
    file chosen) for a file part; ``content_type`` is the part's ``Content-Type`` header as
    sent, or ``None``.
    """

    name: str
    data: bytes
    filename: str | None
    content_type: str | None

    @property
    def is_file(self) -> bool:
        return self.filename is not None


def boundary_of(content_type_header: str) -> str:
    """The boundary of a ``multipart/form-data`` ``Content-Type`` header value.

    Raises :class:`MultipartError`: ``unsupported_media_type`` for another media type (or a
    malformed header), ``missing_boundary`` when it has no boundary, ``invalid_boundary``
    when the boundary breaks RFC 2046 (1..70 characters of ``bchars``).
    """
    media_type, sep, rest = content_type_header.partition(";")
    if media_type.strip(" \t").lower() != "multipart/form-data":
        raise MultipartError(
            "Content-Type must be multipart/form-data", code="unsupported_media_type"
        )
    try:
        params = _parse_params(sep + rest)
    except ValueError:
        raise MultipartError(
            "malformed Content-Type parameters", code="unsupported_media_type"
        ) from None
    boundary = params.get("boundary")
    if boundary is None:
        raise MultipartError("multipart/form-data without a boundary", code="missing_boundary")
    _check_boundary(boundary)
    return boundary


def parse_form(
    body: bytes,
    boundary: str,
    *,
    max_parts: int = 64,
    max_field_bytes: int = 64 * 1024,
    max_file_bytes: int,
) -> list[Part]:
    """The parts of a ``multipart/form-data`` body, in the order sent.

    ``boundary`` is the one :func:`boundary_of` returned (it is checked again here).  Raises
    :class:`MultipartError` for anything the module docstring lists as refused, and as soon
    as a bound is exceeded.  A body whose first delimiter is the close delimiter is an empty
    form (``[]``).
    """
    _check_boundary(boundary)
    dash_boundary = b"--" + boundary.encode("ascii")
    delimiter = _CRLF + dash_boundary
    if body.startswith(dash_boundary):
        pos = len(dash_boundary)
    else:
        found = body.find(delimiter)
        if found < 0:
            raise MultipartError("no multipart delimiter in the body", code="invalid_multipart")
        pos = found + len(delimiter)
    parts: list[Part] = []
    while True:
        # ``pos`` is just past a delimiter ("--boundary").
        if body.startswith(b"--", pos):
            return parts  # the close delimiter; the epilogue is ignored
        pos = _skip_padding(body, pos)
        if len(parts) == max_parts:
            raise MultipartError(f"more than {max_parts} parts in the form", code="too_many_parts")
        headers, pos = _read_headers(body, pos)
        name, filename, content_type = _interpret_headers(headers)
        end = body.find(delimiter, pos)
        if end < 0:
            raise MultipartError(
                f"part {name!r} has no closing delimiter (truncated body?)",
                code="invalid_multipart",
                param=name,
            )
        limit = max_field_bytes if filename is None else max_file_bytes
        if end - pos > limit:
            kind = "field" if filename is None else "file"
            raise MultipartError(
                f"{kind} {name!r} is larger than {limit} bytes", code="part_too_large", param=name
            )
        parts.append(Part(name, body[pos:end], filename, content_type))
        pos = end + len(delimiter)


def fields(parts: Iterable[Part]) -> dict[str, str]:
    """The text fields (parts without a ``filename``) by name, decoded as UTF-8.

    File parts are left out.  Raises :class:`MultipartError` ``invalid_encoding`` for a value
    that is not UTF-8 and ``duplicate_field`` for a name sent twice as a text field (both
    with ``param`` the field's name).
    """
    out: dict[str, str] = {}
    for part in parts:
        if part.filename is not None:
            continue
        if part.name in out:
            raise MultipartError(
                f"field {part.name!r} is sent more than once",
                code="duplicate_field",
                param=part.name,
            )
        try:
            out[part.name] = part.data.decode("utf-8")
        except UnicodeDecodeError:
            raise MultipartError(
                f"field {part.name!r} is not UTF-8 text", code="invalid_encoding", param=part.name
            ) from None
    return out


def _check_boundary(boundary: str) -> None:
    if not boundary:
        raise MultipartError("multipart/form-data without a boundary", code="missing_boundary")
    if len(boundary) > MAX_BOUNDARY_CHARS or _BOUNDARY.fullmatch(boundary) is None:
        raise MultipartError(
            f"invalid multipart boundary (RFC 2046: 1..{MAX_BOUNDARY_CHARS} characters of "
            "letters, digits and '()+_,-./:=? , not ending in a space)",
            code="invalid_boundary",
        )


def _skip_padding(body: bytes, pos: int) -> int:
    """Past the transport padding and CRLF that end a delimiter line."""
    end = pos
    while end < len(body) and end - pos <= MAX_HEADER_BYTES and body[end] in b" \t":
        end += 1
    if not body.startswith(_CRLF, end):
        if end >= len(body):
            raise MultipartError(
                "body ends after a delimiter (truncated?)", code="invalid_multipart"
            )
        raise MultipartError("malformed multipart delimiter line", code="invalid_multipart")
    return end + 2


def _read_headers(body: bytes, pos: int) -> tuple[list[tuple[str, str]], int]:
    """The header lines of the part starting at ``pos``, and where its content starts."""
    if body.startswith(_CRLF, pos):
        return [], pos + 2
    window_end = pos + MAX_HEADER_BYTES + 4
    end = body.find(b"\r\n\r\n", pos, window_end)
    if end < 0:
        if window_end >= len(body):
            raise MultipartError(
                "part headers never end (truncated body?)", code="invalid_multipart"
            )
        raise MultipartError(
            f"part headers longer than {MAX_HEADER_BYTES} bytes", code="headers_too_large"
        )
    try:
        block = body[pos:end].decode("utf-8")
    except UnicodeDecodeError:
        raise MultipartError("part headers are not UTF-8", code="invalid_multipart") from None
    headers = []
    for line in block.split("\r\n"):
        name, colon, value = line.partition(":")
        if not colon or _TOKEN.fullmatch(name) is None:
            raise MultipartError(
                f"malformed part header line {line[:80]!r}", code="invalid_multipart"
            )
        value = value.strip(" \t")
        if _CONTROL.search(value):
            raise MultipartError(
                f"control character in part header {name!r}", code="invalid_multipart"
            )
        headers.append((name.lower(), value))
    return headers, end + 4


def _interpret_headers(headers: list[tuple[str, str]]) -> tuple[str, str | None, str | None]:
    """``(name, filename, content_type)`` from a part's headers."""
    disposition: str | None = None
    content_type: str | None = None
    for key, value in headers:
        if key == "content-disposition":
            if disposition is not None:
                raise MultipartError("duplicate Content-Disposition", code="invalid_multipart")
            disposition = value
        elif key == "content-type":
            if content_type is not None:
                raise MultipartError("duplicate Content-Type in a part", code="invalid_multipart")
            content_type = value
        elif key == "content-transfer-encoding" and value.lower() not in _IDENTITY_ENCODINGS:
            raise MultipartError(
                f"Content-Transfer-Encoding {value!r} is not supported", code="invalid_multipart"
            )
    if disposition is None:
        raise MultipartError("a part has no Content-Disposition", code="missing_name")
    kind, sep, rest = disposition.partition(";")
    if kind.strip(" \t").lower() != "form-data":
        raise MultipartError(
            f"part disposition must be form-data, not {kind.strip()[:40]!r}",
            code="invalid_disposition",
        )
    try:
        params = _parse_params(sep + rest)
    except ValueError:
        raise MultipartError("malformed Content-Disposition", code="invalid_multipart") from None
    if "filename*" in params:
        raise MultipartError(
            "filename* is not allowed in multipart/form-data (RFC 7578)",
            code="invalid_multipart",
            param=params.get("name") or None,
        )
    name = params.get("name")
    if not name:
        raise MultipartError("a part has no name", code="missing_name")
    return name, params.get("filename"), content_type


def _parse_params(text: str) -> dict[str, str]:
    """``; key=value`` parameters (keys lowercased); ``ValueError`` if malformed or repeated."""
    params: dict[str, str] = {}
    pos = 0
    while pos < len(text):
        match = _PARAM.match(text, pos)
        if match is None:
            if text[pos:].strip(" \t") in ("", ";"):
                break  # trailing whitespace or a trailing semicolon
            raise ValueError(f"malformed parameters at {text[pos : pos + 40]!r}")
        key = match.group(1).lower()
        if key in params:
            raise ValueError(f"parameter {key!r} repeated")
        token, quoted = match.group(2), match.group(3)
        params[key] = token if token is not None else _QUOTED_PAIR.sub(r"\1", quoted)
        pos = match.end()
    return params
