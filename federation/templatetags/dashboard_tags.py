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
    """A statistic with 4 significant digits, without an exponent from 0.001 to 10 million
    (14,800 rather than 1.48e+04, so that a column of them reads at a glance)."""
    try:
        number = float(f"{float(value):.4g}")
    except (TypeError, ValueError):
        return "–"
    if number == 0 or not 1e-3 <= abs(number) < 1e7:
        return f"{number:.4g}"
    return f"{number:,f}".rstrip("0").rstrip(".")
