"""Plotly figures built in Python, rendered into a template div.

The figure travels as JSON in a `data-plotly` attribute; `static/dashboard/dashboard.js` draws every
such div with the plotly.js served from `static/vendor/` (no CDN, no inline script).
"""

from __future__ import annotations

import html
import math

import plotly.graph_objects as go
from django.utils.html import format_html
from django.utils.safestring import SafeString

# Plotly's validators look pandas up in sys.modules without the import lock, so a figure built
# while another thread is importing it (a gunicorn worker's router warm-up imports it through
# scikit-learn) met a half-imported module: AttributeError, a 500 on a chart page in a fresh
# worker's first seconds. Imported here, with the URLconf, before any such thread starts.
try:
    import pandas  # noqa: F401
except ImportError:  # plotly does without it
    pass

LAYOUT = {
    "template": "plotly_white",
    "margin": {"l": 60, "r": 20, "t": 50, "b": 50},
    "height": 360,
    "font": {"family": "system-ui, -apple-system, 'Segoe UI', sans-serif", "size": 13},
    # below the x axis title, whatever the plot height (legend rows push the bottom margin)
    "legend": {"orientation": "h", "y": -0.3, "yanchor": "top"},
}


def literal(text) -> str:
    """`text` (a client's or an organization's name) as plotly shows it, character for
    character: plotly.js reads its own markup (<a href>, <b>, <br>, <span style>) and entities in
    legend, hover, title and tick text, so a name would otherwise become a link or lose its "<"."""
    return html.escape(str(text), quote=False)  # plotly decodes &amp; &lt; &gt; back


def styled(fig: go.Figure, **layout) -> go.Figure:
    """Apply the dashboard's common layout to a figure (later keywords win)."""
    fig.update_layout(**{**LAYOUT, **layout})
    return fig


def count_axis(title: str, most: float) -> dict:
    """A y axis of counts (submissions) up to `most`: whole-number ticks from zero, about five of
    them (plotly's automatic ticks put a small count's at 0.5, 1.5: half a submission)."""
    return {"title": {"text": title}, "rangemode": "tozero", "tick0": 0,
            "dtick": max(1, math.ceil(most / 5)), "tickformat": "d"}


def right_axis(title: str) -> dict:
    """A second y axis on the right, over the first, starting at zero, with its own ticks
    (plotly.js 4 syncs an overlaying axis's ticks to the first one's by default, which puts them
    at values like 24.947)."""
    return {"title": {"text": title}, "overlaying": "y", "side": "right", "rangemode": "tozero",
            "showgrid": False, "tickformat": ".3~f", "tickmode": "auto"}


def render_figure(fig: go.Figure, *, div_id: str, label: str = "") -> SafeString:
    """A `<div>` that dashboard.js turns into the plotly chart of `fig`."""
    label = label or (fig.layout.title.text or "chart")
    return format_html(
        '<div id="{}" class="plot" role="img" aria-label="{}" data-plotly="{}"></div>',
        div_id,
        label,
        fig.to_json(),
    )
