"""multipart/form-data parsing: what httpx and the openai SDK send, and a hostile corpus."""

from __future__ import annotations

from typing import Any

import httpx
import httpx2
import openai
import pytest

from omni_trio.serve.multipart import (
    MAX_HEADER_BYTES,
    MultipartError,
    Part,
    boundary_of,
    fields,
    parse_form,
)

B = "b0undary"
PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) + b"\r\n--b0undar\r\n--\r\n"  # CRLFs, dashes
MAX_FILE = 1 << 20


def body(*parts: tuple[list[str], bytes], boundary: str = B, close: bool = True) -> bytes:
    """A form as RFC 7578 writes it: each part's header lines, then its content."""
    out = b""
    for headers, content in parts:
        out += b"--" + boundary.encode() + b"\r\n"
        out += b"".join(h.encode() + b"\r\n" for h in headers) + b"\r\n"
        out += content + b"\r\n"
    if close:
        out += b"--" + boundary.encode() + b"--\r\n"
    return out


def text(name: str, value: bytes) -> tuple[list[str], bytes]:
    return [f'Content-Disposition: form-data; name="{name}"'], value


def upload(name: str, content: bytes, filename: str = "a.png") -> tuple[list[str], bytes]:
    disposition = f'Content-Disposition: form-data; name="{name}"; filename="{filename}"'
    return [disposition, "Content-Type: image/png"], content


def parse(data: bytes, **limits: Any) -> list[Part]:
    limits.setdefault("max_file_bytes", MAX_FILE)
    return parse_form(data, B, **limits)


def parse_request(request: httpx.Request | httpx2.Request, **limits: Any) -> list[Part]:
    limits.setdefault("max_file_bytes", MAX_FILE)
    return parse_form(request.read(), boundary_of(request.headers["content-type"]), **limits)


def reason(data: bytes, **limits: Any) -> tuple[str, str | None]:
    with pytest.raises(MultipartError) as info:
        parse(data, **limits)
    return info.value.code, info.value.param


# -- what real clients send ---------------------------------------------------------------


def test_what_httpx_sends_for_fields_and_a_file() -> None:
    request = httpx.Request(
        "POST",
        "http://x/",
        files={"image": ("a.png", PNG, "image/png")},
        data={"prompt": "p", "n": "1"},
    )
    parts = parse_request(request)
    assert parts == [
        Part("prompt", b"p", None, None),
        Part("n", b"1", None, None),
        Part("image", PNG, "a.png", "image/png"),
    ]
    assert fields(parts) == {"prompt": "p", "n": "1"}


def test_what_httpx_sends_for_repeated_files() -> None:
    request = httpx.Request(
        "POST",
        "http://x/",
        files=[("image[]", ("a.png", PNG, "image/png")), ("image[]", ("b.jpg", b"JPG", None))],
    )
    parts = parse_request(request)
    assert [(p.name, p.filename, p.data) for p in parts] == [
        ("image[]", "a.png", PNG),
        ("image[]", "b.jpg", b"JPG"),
    ]
    assert parts[1].content_type == "image/jpeg"  # guessed by httpx from the filename
    assert fields(parts) == {}


def test_what_the_openai_sdk_sends_for_an_edit() -> None:
    sent: list[httpx2.Request] = []

    def answer(request: httpx2.Request) -> httpx2.Response:
        sent.append(request)
        return httpx2.Response(200, json={"created": 1, "data": [{"b64_json": "AA=="}]})

    transport = httpx2.MockTransport(answer)
    with openai.OpenAI(
        api_key="k",
        base_url="http://x/v1",
        http_client=httpx2.Client(transport=transport),
        max_retries=0,
    ) as client:
        client.images.edit(
            image=[("a.png", PNG, "image/png"), ("b.png", b"second")],
            mask=("m.png", b"mask"),
            prompt='a "quoted" \\ prompt\nover two lines',
            n=2,
            size="64x64",
        )
    (request,) = sent
    assert request.url.path == "/v1/images/edits"
    parts = parse_request(request)
    assert fields(parts) == {
        "prompt": 'a "quoted" \\ prompt\nover two lines',
        "n": "2",
        "size": "64x64",
    }
    files = [(p.name, p.filename, p.content_type, p.data) for p in parts if p.is_file]
    assert files == [
        ("image[]", "a.png", "image/png", PNG),
        ("image[]", "b.png", "image/png", b"second"),
        ("mask", "m.png", "image/png", b"mask"),
    ]


def test_names_are_kept_as_sent_and_percent_escapes_are_not_decoded() -> None:
    # httpx (as browsers) writes '"' in a name as %22: ambiguous, so it stays as sent.
    request = httpx.Request("POST", "http://x/", data={'x"y\\z': "v"}, files={"f": b"1"})
    assert fields(parse_request(request)) == {"x%22y\\z": "v"}


def test_quoted_strings_with_escapes_tokens_and_case() -> None:
    data = body(
        (['content-disposition: Form-Data; name="a\\"b\\\\c"'], b"1"),
        (["CONTENT-DISPOSITION: form-data ; NAME=token_name"], b"2"),
        (['Content-Disposition: form-data; filename="x\\"y.png"; name="f"'], b"3"),
        (['Content-Disposition: form-data; name="caf\u00e9"; filename="\u00e9t\u00e9.png"'], b"4"),
    )
    parts = parse(data)
    assert [(p.name, p.filename) for p in parts] == [
        ('a"b\\c', None),
        ("token_name", None),
        ("f", 'x"y.png'),
        ("caf\u00e9", "\u00e9t\u00e9.png"),
    ]


def test_content_that_looks_like_a_delimiter_is_kept() -> None:
    tricky = b"--" + B.encode() + b"x\r\n--" + B[:-1].encode() + b"\r\n\r\n--"
    parts = parse(body(upload("image", tricky), text("prompt", b"")))
    assert parts[0].data == tricky
    assert parts[1].data == b""


def test_preamble_epilogue_and_transport_padding() -> None:
    inner = body(text("a", b"1"), text("b", b"2"))
    padded = inner.replace(B.encode() + b"\r\n", B.encode() + b" \t \r\n", 1)
    data = b"a preamble\r\n\r\n" + padded + b"an epilogue, even --" + B.encode() + b"\r\n"
    assert [(p.name, p.data) for p in parse(data)] == [("a", b"1"), ("b", b"2")]


def test_an_empty_form() -> None:
    assert parse(b"--" + B.encode() + b"--\r\n") == []


def test_identity_transfer_encoding_and_unknown_headers_are_accepted() -> None:
    headers = ['Content-Disposition: form-data; name="a"', "Content-Transfer-Encoding: binary"]
    parts = parse(body(([*headers, "X-Whatever: 1"], b"v")))
    assert parts == [Part("a", b"v", None, None)]


def test_an_empty_filename_is_still_a_file() -> None:
    (part,) = parse(body(upload("image", b"", filename="")))
    assert part.filename == "" and part.is_file
    assert fields([part]) == {}


# -- limits ---------------------------------------------------------------------------------


def test_field_and_file_limits_are_inclusive() -> None:
    assert parse(body(text("prompt", b"x" * 10)), max_field_bytes=10)[0].data == b"x" * 10
    assert reason(body(text("prompt", b"x" * 11)), max_field_bytes=10) == (
        "part_too_large",
        "prompt",
    )
    assert parse(body(upload("image", b"x" * 10)), max_file_bytes=10)[0].data == b"x" * 10
    assert reason(body(upload("image", b"x" * 11)), max_file_bytes=10) == (
        "part_too_large",
        "image",
    )
    # a file is held to max_file_bytes, not to the (smaller) field limit, and vice versa
    assert parse(body(upload("image", b"x" * 100)), max_field_bytes=10, max_file_bytes=100)
    assert reason(body(text("p", b"x" * 100)), max_field_bytes=10, max_file_bytes=100) == (
        "part_too_large",
        "p",
    )


def test_default_field_limit_is_64_kib() -> None:
    assert parse(body(text("prompt", b"x" * 65536)))
    assert reason(body(text("prompt", b"x" * 65537))) == ("part_too_large", "prompt")


def test_too_many_parts() -> None:
    three = body(text("a", b""), text("b", b""), text("c", b""))
    assert len(parse(three, max_parts=3)) == 3
    assert reason(three, max_parts=2) == ("too_many_parts", None)


def test_headers_too_long() -> None:
    long = ['Content-Disposition: form-data; name="a"', "X-Pad: " + "p" * MAX_HEADER_BYTES]
    assert reason(body((long, b"v"))) == ("headers_too_large", None)
    fits = ['Content-Disposition: form-data; name="a"', "X-Pad: " + "p" * 8000]
    assert parse(body((fits, b"v")))[0].data == b"v"


# -- a hostile corpus -----------------------------------------------------------------------

DISPOSITION = 'Content-Disposition: form-data; name="a"'
HOSTILE = {
    "garbage": (b"\x00\xffnot a form at all", "invalid_multipart"),
    "empty body": (b"", "invalid_multipart"),
    "another boundary": (body(text("a", b"1"), boundary="other"), "invalid_multipart"),
    "no closing delimiter": (body(text("a", b"1"), close=False), "invalid_multipart"),
    "LF line endings": (body(text("a", b"1")).replace(b"\r\n", b"\n"), "invalid_multipart"),
    "LF after a delimiter": (
        body(text("a", b"1")).replace(B.encode() + b"\r\n", B.encode() + b"\n", 1),
        "invalid_multipart",
    ),
    "junk after a delimiter": (
        body(text("a", b"1")).replace(B.encode() + b"\r\n", B.encode() + b"junk\r\n", 1),
        "invalid_multipart",
    ),
    "no Content-Disposition": (body((["Content-Type: text/plain"], b"1")), "missing_name"),
    "no headers at all": (body(([], b"1")), "missing_name"),
    "no name": (body((['Content-Disposition: form-data; filename="a"'], b"1")), "missing_name"),
    "empty name": (body((['Content-Disposition: form-data; name=""'], b"1")), "missing_name"),
    "not form-data": (
        body((['Content-Disposition: attachment; name="a"'], b"1")),
        "invalid_disposition",
    ),
    "unterminated quote": (
        body((['Content-Disposition: form-data; name="a'], b"1")),
        "invalid_multipart",
    ),
    "two-word token": (
        body((["Content-Disposition: form-data; name=a b"], b"1")),
        "invalid_multipart",
    ),
    "repeated parameter": (
        body((['Content-Disposition: form-data; name="a"; name="b"'], b"1")),
        "invalid_multipart",
    ),
    "filename*": (
        body(([DISPOSITION + "; filename*=UTF-8''x.png"], b"1")),
        "invalid_multipart",
    ),
    "header without a colon": (body(([DISPOSITION, "nonsense"], b"1")), "invalid_multipart"),
    "folded header": (body(([DISPOSITION, "X-A: 1", " folded"], b"1")), "invalid_multipart"),
    "control character": (body(([DISPOSITION, "X-A: a\x00b"], b"1")), "invalid_multipart"),
    "two dispositions": (body(([DISPOSITION, DISPOSITION], b"1")), "invalid_multipart"),
    "two content types": (
        body(([DISPOSITION, "Content-Type: a/b", "Content-Type: c/d"], b"1")),
        "invalid_multipart",
    ),
    "base64 transfer encoding": (
        body(([DISPOSITION, "Content-Transfer-Encoding: base64"], b"MQ==")),
        "invalid_multipart",
    ),
    "non-UTF-8 headers": (
        b"--" + B.encode() + b'\r\nContent-Disposition: form-data; name="\xff"\r\n\r\n1\r\n'
        b"--" + B.encode() + b"--\r\n",
        "invalid_multipart",
    ),
    "headers never end": (
        b"--" + B.encode() + b"\r\n" + DISPOSITION.encode() + b"\r\n",
        "invalid_multipart",
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_bodies_are_refused(case: str) -> None:
    data, code = HOSTILE[case]
    assert reason(data)[0] == code


def test_every_truncation_is_refused() -> None:
    request = httpx.Request(
        "POST", "http://x/", files={"image": ("a.png", PNG, "image/png")}, data={"prompt": "p"}
    )
    data = request.read()
    boundary = boundary_of(request.headers["content-type"])
    whole = parse_form(data, boundary, max_file_bytes=MAX_FILE)
    end = len(data) - len(b"\r\n")  # the CRLF after the close delimiter is the epilogue
    for cut in range(end):
        with pytest.raises(MultipartError):
            parse_form(data[:cut], boundary, max_file_bytes=MAX_FILE)
    assert parse_form(data[:end], boundary, max_file_bytes=MAX_FILE) == whole


def test_parse_form_checks_the_boundary_too() -> None:
    with pytest.raises(MultipartError) as info:
        parse_form(body(text("a", b"1")), "x" * 71, max_file_bytes=MAX_FILE)
    assert info.value.code == "invalid_boundary"


# -- text fields ----------------------------------------------------------------------------


def test_fields_refuses_a_non_utf8_text_field() -> None:
    parts = parse(body(text("prompt", b"caf\xe9")))
    with pytest.raises(MultipartError) as info:
        fields(parts)
    assert (info.value.code, info.value.param) == ("invalid_encoding", "prompt")
    # the same bytes in a file part are no text field
    assert fields(parse(body(upload("prompt", b"caf\xe9")))) == {}


def test_fields_refuses_a_duplicate_text_field() -> None:
    parts = parse(body(text("n", b"1"), upload("image", b"x"), text("n", b"2")))
    with pytest.raises(MultipartError) as info:
        fields(parts)
    assert (info.value.code, info.value.param) == ("duplicate_field", "n")


# -- boundary_of ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "boundary"),
    [
        ("multipart/form-data; boundary=abc", "abc"),
        ("Multipart/Form-Data;BOUNDARY=abc", "abc"),
        ('multipart/form-data; charset="a;b"; boundary="a b:c=d?"', "a b:c=d?"),
        ("multipart/form-data; boundary=" + "z" * 70, "z" * 70),
        ("multipart/form-data; boundary=abc;", "abc"),
    ],
)
def test_boundary_of(header: str, boundary: str) -> None:
    assert boundary_of(header) == boundary


@pytest.mark.parametrize(
    ("header", "code"),
    [
        ("application/json", "unsupported_media_type"),
        ("multipart/mixed; boundary=abc", "unsupported_media_type"),
        ("multipart/form-data-x; boundary=abc", "unsupported_media_type"),
        ("multipart/form-data", "missing_boundary"),
        ("multipart/form-data; charset=utf-8", "missing_boundary"),
        ('multipart/form-data; boundary=""', "missing_boundary"),
        ("multipart/form-data; boundary=" + "z" * 71, "invalid_boundary"),
        ('multipart/form-data; boundary="ends in space "', "invalid_boundary"),
        ('multipart/form-data; boundary="a@b"', "invalid_boundary"),
        ("multipart/form-data; boundary=a@b", "unsupported_media_type"),  # not a token
        ('multipart/form-data; boundary="a"; boundary="b"', "unsupported_media_type"),
        ("multipart/form-data; boundary", "unsupported_media_type"),
    ],
)
def test_boundary_of_refuses(header: str, code: str) -> None:
    with pytest.raises(MultipartError) as info:
        boundary_of(header)
    assert info.value.code == code
    assert info.value.param is None
