"""Charts of the history, drawn on the server as inline SVG (no script, no style attribute).

Each chart is an ``<svg role="img">`` with a ``<title>`` and a ``<desc>`` (what a screen
reader says), a title, labelled axes with their units, a legend, and one ``<polyline>``
per series whose ``data-series`` names it and whose ``data-values`` carries every value,
oldest first. Every bucket is a point: a bucket with nothing in it is drawn at zero, not
left out. Texts are escaped: a queue's name is shown as written, never read as markup.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from html import escape

from markupsafe import Markup

from broker.ops.history import Figures, SeriesPoint

#: The drawing area of a chart, in SVG user units (it scales with the page's width).
WIDTH, HEIGHT = 640, 210
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 48, 40
#: The spacings the time axis labels at (seconds): the first that gives at most 7 labels.
TICK_STEPS_S = (60, 300, 600, 900, 1800, 3600, 7200, 10_800, 14_400, 21_600, 43_200, 86_400)
#: Series colours: throughput, failures, and the two percentiles.
COLOURS = {"done": "#1f7a3d", "failures": "#b3261e", "p50": "#2456a6", "p95": "#a36200"}


@dataclass(frozen=True)
class Line:
    """One series of a chart: ``key`` names it (``data-series``), ``label`` is its legend."""

    key: str
    label: str
    values: Sequence[float]
    colour: str


def _number(value: float) -> str:
    """A value as an axis or a tooltip shows it: whole when it is, else 3 significant digits."""
    if value == int(value):
        return f"{int(value):,}"
    return f"{value:,.3g}" if abs(value) < 100 else f"{value:,.0f}"


def nice_ceiling(value: float) -> tuple[float, float]:
    """The top of an axis that holds ``value`` and its step (1, 2 or 5 times a power of
    ten, four steps or fewer); an axis of nothing goes up to 1."""
    if value <= 0:
        return 1.0, 0.25
    raw = value / 4
    power = 10 ** math.floor(math.log10(raw))
    for factor in (1, 2, 5, 10):
        step = factor * power
        if step >= raw:
            break
    if step < 1 and value >= 1:
        step = 1.0
    return math.ceil(value / step) * step, step


def _clock(at: datetime, bucket_s: int) -> str:
    at = at.astimezone(timezone.utc)
    return at.strftime("%H:%M") if bucket_s < 86_400 else at.strftime("%m-%d")


def line_chart(*, chart_id: str, title: str, unit: str, starts: Sequence[datetime], bucket_s: int,
               lines: Sequence[Line], x_label: str) -> Markup:
    """An SVG line chart of ``lines`` over the buckets starting at ``starts`` (oldest
    first), the y axis in ``unit``."""
    n = len(starts)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    top, step = nice_ceiling(max((v for line in lines for v in line.values), default=0.0))

    def x(i: int) -> float:
        return LEFT + (plot_w * i / (n - 1) if n > 1 else plot_w / 2)

    def y(v: float) -> float:
        return TOP + plot_h - plot_h * (v / top)

    totals = ", ".join(f"{line.label}: peak {_number(max(line.values, default=0))} {unit}" for line in lines)
    span = (f"from {_clock(starts[0], bucket_s)} to {_clock(starts[-1], bucket_s)} UTC" if starts else "no bucket")
    desc = f"{title}, {n} buckets of {bucket_s // 60} min {span}; {totals}."
    out = [f'<svg class="chart" id="{escape(chart_id)}" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
           f'aria-labelledby="{escape(chart_id)}-title {escape(chart_id)}-desc" '
           f'data-bucket-s="{bucket_s}" data-unit="{escape(unit)}" xmlns="http://www.w3.org/2000/svg">',
           f'<title id="{escape(chart_id)}-title">{escape(title)}</title>',
           f'<desc id="{escape(chart_id)}-desc">{escape(desc)}</desc>',
           f'<text class="chart-title" x="{LEFT}" y="16" font-size="13" font-weight="600">{escape(title)}</text>']
    # the legend, under the title
    lx = LEFT
    for line in lines:
        label = f"{line.label} (peak {_number(max(line.values, default=0))})"
        out.append(f'<g class="legend-item" data-series="{escape(line.key)}">'
                   f'<rect x="{lx}" y="28" width="12" height="4" fill="{line.colour}"/>'
                   f'<text x="{lx + 16}" y="34" font-size="11">{escape(label)}</text></g>')
        lx += 7 * len(label) + 30
    # the y axis: gridlines at each step, the unit along it
    ticks = int(round(top / step))
    for k in range(ticks + 1):
        value = k * step
        yy = y(value)
        out.append(f'<line class="grid" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{yy:.1f}" y2="{yy:.1f}" '
                   f'stroke="#dde2e7" stroke-width="1"/>')
        out.append(f'<text class="tick y-tick" x="{LEFT - 6}" y="{yy + 4:.1f}" font-size="10" '
                   f'text-anchor="end">{escape(_number(value))}</text>')
    mid = TOP + plot_h / 2
    out.append(f'<text class="axis-label y-label" x="14" y="{mid:.1f}" font-size="11" text-anchor="middle" '
               f'transform="rotate(-90 14 {mid:.1f})">{escape(unit)}</text>')
    # the x axis: about six time labels, and what one point is
    out.append(f'<line class="axis" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{TOP + plot_h}" y2="{TOP + plot_h}" '
               f'stroke="#6b7580" stroke-width="1"/>')
    span_s = bucket_s * max(n - 1, 1)
    tick_s = next((t for t in TICK_STEPS_S if t >= bucket_s and span_s / t <= 6), TICK_STEPS_S[-1])
    for i in range(n):
        if int(starts[i].timestamp()) % tick_s:
            continue
        out.append(f'<text class="tick x-tick" x="{x(i):.1f}" y="{TOP + plot_h + 14}" font-size="10" '
                   f'text-anchor="middle">{escape(_clock(starts[i], bucket_s))}</text>')
    out.append(f'<text class="axis-label x-label" x="{LEFT + plot_w / 2:.1f}" y="{HEIGHT - 6}" font-size="11" '
               f'text-anchor="middle">{escape(x_label)}</text>')
    # the series: a line through every bucket, and a point with its value to hover
    for line in lines:
        points = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(line.values))
        values = ",".join(_number(v).replace(",", "") for v in line.values)
        out.append(f'<g class="series" data-series="{escape(line.key)}">'
                   f'<polyline class="line" data-series="{escape(line.key)}" data-values="{values}" '
                   f'points="{points}" fill="none" stroke="{line.colour}" stroke-width="1.8"/>')
        for i, v in enumerate(line.values):
            out.append(f'<circle cx="{x(i):.1f}" cy="{y(v):.1f}" r="{2.2 if v else 1.2}" fill="{line.colour}">'
                       f'<title>{escape(_clock(starts[i], bucket_s))} UTC: {escape(_number(v))} {escape(unit)} '
                       f'({escape(line.label)})</title></circle>')
        out.append("</g>")
    out.append("</svg>")
    return Markup("".join(out))


def _ms(value: float | None) -> float:
    return 0.0 if value is None else round(value, 1)


def _bucket_words(bucket_s: int) -> str:
    minutes = bucket_s // 60
    return "minute" if minutes == 1 else f"{minutes} min"


def history_charts(queue: str, points: Sequence[SeriesPoint], *, bucket_s: int, window: str,
                   chart_id: str) -> list[Markup]:
    """The four charts of a queue's history: throughput, failures, wait time, run time."""
    starts = [p.start for p in points]
    figures: list[Figures] = [p.figures for p in points]
    per = _bucket_words(bucket_s)
    x_label = f"time (UTC), one point per {per}"
    return [
        line_chart(chart_id=f"{chart_id}-throughput", title=f"Throughput of {queue}, last {window}",
                   unit=f"jobs done per {per}", starts=starts, bucket_s=bucket_s, x_label=x_label,
                   lines=[Line("done", "done", [f.done for f in figures], COLOURS["done"])]),
        line_chart(chart_id=f"{chart_id}-failures", title=f"Failures of {queue}, last {window}",
                   unit=f"runs per {per}", starts=starts, bucket_s=bucket_s, x_label=x_label,
                   lines=[Line("failures", "failed + rejected + crashed", [f.failures for f in figures],
                               COLOURS["failures"])]),
        line_chart(chart_id=f"{chart_id}-wait", title=f"Wait time of {queue} (due to start), last {window}",
                   unit="milliseconds", starts=starts, bucket_s=bucket_s, x_label=x_label,
                   lines=[Line("wait_p50", "p50", [_ms(f.wait_p50_ms) for f in figures], COLOURS["p50"]),
                          Line("wait_p95", "p95", [_ms(f.wait_p95_ms) for f in figures], COLOURS["p95"])]),
        line_chart(chart_id=f"{chart_id}-run", title=f"Run time of {queue} (start to end), last {window}",
                   unit="milliseconds", starts=starts, bucket_s=bucket_s, x_label=x_label,
                   lines=[Line("run_p50", "p50", [_ms(f.run_p50_ms) for f in figures], COLOURS["p50"]),
                          Line("run_p95", "p95", [_ms(f.run_p95_ms) for f in figures], COLOURS["p95"])]),
    ]


#: A sparkline's size, in SVG user units.
SPARK_WIDTH, SPARK_HEIGHT = 120, 24


def sparkline(queue: str, points: Sequence[SeriesPoint]) -> Markup:
    """A small chart of a queue's jobs done per minute (green) and failures (red), no axes:
    its ``<title>`` says what the line means and the totals."""
    done = [p.figures.done for p in points]
    failures = [p.figures.failures for p in points]
    top = max([*done, *failures, 1])
    n = len(points)

    def path(values: Sequence[int]) -> str:
        step = (SPARK_WIDTH - 2) / (n - 1) if n > 1 else 0
        return " ".join(f"{1 + i * step:.1f},{SPARK_HEIGHT - 2 - (SPARK_HEIGHT - 4) * v / top:.1f}"
                        for i, v in enumerate(values))

    label = (f"{queue}, last hour per minute: {sum(done)} done (peak {max(done, default=0)} a minute), "
             f"{sum(failures)} failures")
    return Markup(
        f'<svg class="sparkline" viewBox="0 0 {SPARK_WIDTH} {SPARK_HEIGHT}" width="{SPARK_WIDTH}" '
        f'height="{SPARK_HEIGHT}" role="img" aria-label="{escape(label)}" xmlns="http://www.w3.org/2000/svg">'
        f"<title>{escape(label)}</title>"
        f'<polyline data-series="done" data-values="{",".join(map(str, done))}" points="{path(done)}" '
        f'fill="none" stroke="{COLOURS["done"]}" stroke-width="1.5"/>'
        f'<polyline data-series="failures" data-values="{",".join(map(str, failures))}" '
        f'points="{path(failures)}" fill="none" stroke="{COLOURS["failures"]}" stroke-width="1.2"/>'
        "</svg>")
