"""What the management commands share in reading their arguments."""

from __future__ import annotations

from django.core.management.base import CommandError


def utf8_text(what: str, value: str) -> str:
    """`value` when it is text PostgreSQL can hold. A shell argument's bytes that are not UTF-8
    reach a command as lone surrogates, and `call_command` can pass a NUL, which the database
    driver refused with a traceback: one line naming `what` and the position instead."""
    if "\x00" in value:
        raise CommandError(
            f"{what} cannot hold a NUL character: {value!r} has one at position {value.index(chr(0))}"
        )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise CommandError(
            f"{what} must be UTF-8 text: {value!r} holds an undecodable byte at position {exc.start}"
        ) from None
    return value
