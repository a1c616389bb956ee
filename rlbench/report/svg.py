"""Charts as inline SVG, drawn here in Python: the page needs no script library and no network.

A series of any length is drawn with at most `MAX_POINTS` points: beyond that, each bucket of
consecutive steps keeps its first, minimum and maximum values, so a spike in a 10,000-step run stays
visible and the page stays small.
"""

from __future__ import annotations

import html
import math

MAX_POINTS = 600
WIDTH, HEIGHT, PAD = 470, 180, 56
COLORS = ("#1f6fb5", "#d9622b", "#2f9e44", "#8e44ad", "#b8860b", "#555555", "#c0392b")


def thin(points: list[tuple[int, float]], limit: int = MAX_POINTS) -> list[tuple[int, float]]:
    """At most about `limit` points of a step-ordered series, keeping each bucket's extremes."""
    points = [(s, v) for s, v in points if v is not None and math.isfinite(v)]
    if len(points) <= limit:
        return points
    size = math.ceil(len(points) / (limit // 3))
    out: list[tuple[int, float]] = []
    for i in range(0, len(points), size):
        bucket = points[i : i + size]
        keep = {bucket[0], min(bucket, key=lambda p: p[1]), max(bucket, key=lambda p: p[1])}
        out.extend(sorted(keep))
    return out


def _fmt(v: float) -> str:
    return f"{v:.3g}"


def line_chart(
    title: str,
    series: list[tuple[str, list[tuple[int, float]], str]],
    marks: list[int] = (),
    band: list[tuple[int, float, float]] = (),
) -> str:
    """One chart: each series (label, [(step, value)], dash pattern: "" solid), vertical marks at
    steps (failing steps, the first divergence), and a shaded band [(step, low, high)]."""
    drawn = [(label, thin(points), dash) for label, points, dash in series]
    values = [v for _, pts, _ in drawn for _, v in pts] + [
        x for _, lo, hi in band for x in (lo, hi) if math.isfinite(x)
    ]
    steps = [s for _, pts, _ in drawn for s, _ in pts] + [s for s, _, _ in band]
    if not values:
        return (
            f'<figure class="chart"><figcaption>{html.escape(title)}</figcaption>'
            '<p class="none">no finite values</p></figure>'
        )
    x0, x1 = min(steps), max(steps)
    y0, y1 = min(values), max(values)
    if y0 == y1:
        y0, y1 = y0 - 0.5, y1 + 0.5
    if x0 == x1:
        x0, x1 = x0 - 1, x1 + 1

    def x(s: float) -> float:
        return PAD + (s - x0) / (x1 - x0) * (WIDTH - PAD - 8)

    def y(v: float) -> float:
        return HEIGHT - 22 - (v - y0) / (y1 - y0) * (HEIGHT - 34)

    parts = [
        f'<svg viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" role="img">',
        f'<line x1="{PAD}" y1="{HEIGHT - 22}" x2="{WIDTH - 8}" y2="{HEIGHT - 22}" class="axis"/>',
        f'<text x="{PAD}" y="{HEIGHT - 6}" class="tick">{x0}</text>',
        f'<text x="{WIDTH - 8}" y="{HEIGHT - 6}" class="tick" text-anchor="end">{x1}</text>',
        f'<text x="{PAD - 4}" y="{y(y1) + 4:.1f}" class="tick" text-anchor="end">{_fmt(y1)}</text>',
        f'<text x="{PAD - 4}" y="{y(y0) + 4:.1f}" class="tick" text-anchor="end">{_fmt(y0)}</text>',
    ]
    if band:
        upper = " ".join(f"{x(s):.1f},{y(hi):.1f}" for s, _, hi in band if math.isfinite(hi))
        lower = " ".join(f"{x(s):.1f},{y(lo):.1f}" for s, lo, _ in reversed(band) if math.isfinite(lo))
        parts.append(f'<polygon points="{upper} {lower}" class="band"/>')
    for step in sorted(set(marks)):
        if x0 <= step <= x1:
            parts.append(
                f'<line x1="{x(step):.1f}" y1="8" x2="{x(step):.1f}" y2="{HEIGHT - 22}" class="mark">'
                f"<title>step {step}</title></line>"
            )
    for i, (label, points, dash) in enumerate(drawn):
        color = COLORS[i % len(COLORS)]
        coords = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in points)
        style = f' stroke-dasharray="{dash}"' if dash else ""
        parts.append(
            f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="1.5"{style}>'
            f"<title>{html.escape(label)}</title></polyline>"
        )
        if len(points) == 1:
            parts.append(f'<circle cx="{x(points[0][0]):.1f}" cy="{y(points[0][1]):.1f}" r="2.5" fill="{color}"/>')
    parts.append("</svg>")
    legend = "".join(
        f'<span class="key" style="--c:{COLORS[i % len(COLORS)]}">{html.escape(label)}</span>'
        for i, (label, _, _) in enumerate(drawn)
    )
    return f'<figure class="chart"><figcaption>{html.escape(title)} {legend}</figcaption>{"".join(parts)}</figure>'


def histogram(title: str, counts: list[int], labels: list[str]) -> str:
    """Bars of `counts`, one per label, heights on a log scale (a few large deltas stay visible)."""
    top = max(counts) if counts else 0
    width = (WIDTH - PAD - 8) / max(len(counts), 1)
    parts = [f'<svg viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" role="img">']
    for i, (count, label) in enumerate(zip(counts, labels)):
        h = 0 if count == 0 else (math.log10(count) + 1) / (math.log10(top) + 1) * (HEIGHT - 40)
        left = PAD + i * width
        parts.append(
            f'<rect x="{left:.1f}" y="{HEIGHT - 22 - h:.1f}" width="{max(width - 2, 1):.1f}" '
            f'height="{h:.1f}" class="bar"><title>{html.escape(label)}: {count} tokens</title></rect>'
        )
        if i % 2 == 0:
            parts.append(f'<text x="{left:.1f}" y="{HEIGHT - 6}" class="tick">{html.escape(label)}</text>')
    parts.append("</svg>")
    return f'<figure class="chart"><figcaption>{html.escape(title)}</figcaption>{"".join(parts)}</figure>'
