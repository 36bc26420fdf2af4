"""What the management commands share in reading their arguments."""

from __future__ import annotations

from django.core.management.base import CommandError


def utf8_text(what: str, value: str) -> str:
    """`value` when it is text PostgreSQL can hold. A shell argument's bytes that are not UTF-8
    reach a command as lone surrogates, which the database driver refused with a
    UnicodeEncodeError traceback: one line naming `what` and the byte's position instead."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise CommandError(
            f"{what} must be UTF-8 text: {value!r} holds an undecodable byte at position {exc.start}"
        ) from None
    return value
