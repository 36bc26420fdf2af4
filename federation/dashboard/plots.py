"""Plotly figures built in Python, rendered into a template div.

The figure travels as JSON in a `data-plotly` attribute; `static/dashboard/dashboard.js` draws every
such div with the plotly.js served from `static/vendor/` (no CDN, no inline script).
"""

from __future__ import annotations

import html
import math
import re

import plotly.graph_objects as go
import plotly.io as pio
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
    # at the chart's bottom edge, below the x axis title: its rows push the plot up. (At a
    # fraction of the plot's height below it, a legend of several rows on a phone, or one left
    # after the window was narrowed and widened again, covered the axis's ticks and title.)
    "legend": {"orientation": "h", "yref": "container", "y": 0, "yanchor": "bottom"},
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


ERROR_BARS = "error bars"  # the `meta` of a companion trace that only draws another's bars


def add_with_error_bars(fig: go.Figure, trace: go.Scatter,
                        errors: list[float | None] | None = None,
                        below: list[float | None] | None = None) -> go.Figure:
    """Add `trace` with an error bar of `errors[i]` on its i-th point; None where the point has
    no spread to draw (one seed measured it). With `below`, the bars are asymmetric: `errors[i]`
    above the point and `below[i]` under it (a range from the least to the most), None in both
    where the point has none.

    Plotly draws a null error as "± 0", as if the seeds had agreed to the digit, and a trace's bars
    are all or none. So a trace whose points all have a spread carries its bars, one whose points
    have none carries none, and one that mixes them (a round that one seed of a multi-seed run
    measured, under drift) draws its bars from an unlisted, unhovered companion trace of the
    points that have one, in its colour and legend group (hiding the trace hides its bars).
    Plotly colours a trace by its place among all traces, companions counted: so every trace
    added here gets the colour its place among the others would give it, set."""
    errors = list(errors or [None] * len(trace.y or ()))
    colorway = pio.templates[LAYOUT["template"]].layout.colorway
    place = sum(1 for t in fig.data if t.meta != ERROR_BARS)
    color = trace.line.color or trace.marker.color or colorway[place % len(colorway)]
    trace.line.color = color
    if all(e is None for e in errors):
        return fig.add_trace(trace)
    def bars(points: list[int]) -> dict:
        out = {"type": "data", "array": [errors[i] for i in points]}
        if below is not None:
            out.update(symmetric=False, arrayminus=[below[i] for i in points])
        return out

    if all(e is not None for e in errors):
        trace.error_y = bars(list(range(len(errors))))
        return fig.add_trace(trace)
    trace.legendgroup = group = trace.legendgroup or f"trace {place}"
    fig.add_trace(trace)
    measured = [i for i, e in enumerate(errors) if e is not None]
    return fig.add_trace(go.Scatter(
        x=[trace.x[i] for i in measured], y=[trace.y[i] for i in measured], mode="markers",
        marker={"color": color, "opacity": 0},
        error_y={**bars(measured), "color": color},
        legendgroup=group, showlegend=False, hoverinfo="skip", meta=ERROR_BARS,
    ))


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


MARKUP = re.compile(r"<[^>]*>")
POINTS_DESCRIBED = 40  # a trace's points listed in its description, then how many more


def plain(text) -> str:
    """Plotly text (`literal` names, <br> and <b> markup) as a screen reader should say it."""
    return " ".join(html.unescape(MARKUP.sub(" ", str(text or ""))).split())


def _value(value) -> str:
    if value is None:
        return "no value"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return plain(value)
    if isinstance(value, float) and not math.isfinite(value):
        return "no value"
    if float(value).is_integer():
        return f"{int(value):,}"
    return f"{value:,.3f}".rstrip("0").rstrip(".") if abs(value) >= 0.001 else f"{value:.3g}"


def _axis_title(layout, name: str) -> str:
    axis = layout[name] if name in layout else None
    return plain(axis.title.text) if axis is not None and axis.title.text else ""


KINDS = {"bar": "bars", "scatter": "points"}


def describe_figure(fig: go.Figure) -> str:
    """The data of `fig` in words, the text alternative of the chart: its axes, then each trace's
    name and points ("round 1: 3, round 2: 4"), and the lines marked on it (a budget cap).
    Companion traces that only draw another's error bars are left out."""
    layout = fig.layout
    x_title = _axis_title(layout, "xaxis")
    parts = []
    axes = [f"horizontal axis: {x_title}"] if x_title else []
    axes += [
        f"{'right' if name == 'yaxis2' else 'vertical'} axis: {title}"
        for name in ("yaxis", "yaxis2") if (title := _axis_title(layout, name))
    ]
    if axes:
        text = "; ".join(axes)
        parts.append(text[0].upper() + text[1:] + ".")
    for trace in fig.data:
        if trace.meta == ERROR_BARS:
            continue
        xs, ys = list(trace.x or ()), list(trace.y or ())
        if getattr(trace, "orientation", None) == "h":
            xs, ys = ys, xs
        kind = KINDS.get(trace.type, trace.type)
        if trace.type == "scatter" and "lines" in (trace.mode or "lines"):
            kind = "line"
        if trace.type in ("scatter", "bar") and getattr(trace, "yaxis", None) == "y2":
            kind += f", right axis ({_axis_title(layout, 'yaxis2')})"
        name = plain(trace.name) or "series"
        points = [
            f"{x_title + ' ' if x_title else ''}{_value(x)}: {_value(y)}"
            for x, y in zip(xs, ys, strict=False)
        ]
        more = len(points) - POINTS_DESCRIBED
        shown = ", ".join(points[:POINTS_DESCRIBED]) + (f", and {more} more" if more > 0 else "")
        parts.append(f"{name} ({kind}): {shown or 'no points'}.")
    marks = [plain(a.text) for a in layout.annotations if a.text]
    if marks:
        parts.append("Marked: " + "; ".join(marks) + ".")
    return " ".join(parts)


def render_figure(fig: go.Figure, *, div_id: str, label: str = "") -> SafeString:
    """A `<div>` that dashboard.js turns into the plotly chart of `fig`: a figure named by
    `label` (by default the chart's title) and described by its data in words (a hidden
    paragraph, read as the figure's description), for a screen reader, to which dashboard.js
    hides the drawing itself."""
    label = plain(label or fig.layout.title.text) or "chart"
    return format_html(
        '<div id="{}" class="plot" role="figure" aria-label="{}" aria-describedby="{}-data"'
        ' data-plotly="{}"></div><p id="{}-data" hidden>{}</p>',
        div_id,
        label,
        div_id,
        fig.to_json(),
        div_id,
        describe_figure(fig),
    )
