"""The failure fields a worker's reply carries for a call that raised."""

from __future__ import annotations

from omni_trio.worker.replies import failure_fields


def _raise() -> None:
    raise KeyError("missing")


def test_failure_fields_name_the_error_and_carry_its_traceback() -> None:
    try:
        _raise()
    except KeyError as exc:
        fields = failure_fields(exc)
    assert fields["ok"] is False
    assert fields["error"] == "'missing'" and fields["error_type"] == "KeyError"
    assert "Traceback (most recent call last)" in fields["traceback"]
    assert "_raise" in fields["traceback"]


def test_an_error_without_a_message_is_described_by_its_repr() -> None:
    assert failure_fields(RuntimeError())["error"] == "RuntimeError()"
