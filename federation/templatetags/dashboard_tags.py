"""Template filters for byte sizes and figures on dashboard pages."""

from __future__ import annotations

from django import template

register = template.Library()


@register.filter
def kb(value) -> str:
    """Bytes as kB (1 kB = 1,000 bytes, as the README's byte figures) with one decimal ("–" for
    none): 2048 -> "2.0 kB", 150528 -> "150.5 kB"."""
    if value is None or value == "":
        return "–"
    try:
        number = float(value)
    except (TypeError, ValueError):
        return "–"
    if number < 1000:
        return f"{number:.0f} B"
    return f"{number / 1000:.1f} kB"


@register.filter
def figure(value) -> str:
    """A statistic with 4 significant digits."""
    try:
        return f"{float(value):.4g}"
    except (TypeError, ValueError):
        return "–"
