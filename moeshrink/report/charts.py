"""The report's charts as inline SVG (no script, no external file). Every label is escaped: build
labels come from config."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from markupsafe import Markup, escape

FONT = 'font-family="system-ui, sans-serif" font-size="11"'
COLOURS = ["#1f5fa8", "#c2571a", "#2e8b57", "#8e44ad", "#b8860b", "#555555"]


@dataclass
class Axis:
    low: float
    high: float
    start_px: float
    end_px: float

    def __call__(self, value: float) -> float:
        span = self.high - self.low or 1.0
        return self.start_px + (value - self.low) / span * (self.end_px - self.start_px)


def _padded(values: Sequence[float], include: Sequence[float] = (),
            bounds: tuple[float, float] = (float("-inf"), float("inf"))) -> tuple[float, float]:
    points = [*values, *include]
    low, high = min(points), max(points)
    pad = (high - low) * 0.08 or max(abs(high), 1.0) * 0.1
    return max(bounds[0], low - pad), min(bounds[1], high + pad)


def _text(x: float, y: float, text: str, anchor: str = "start", extra: str = "") -> str:
    return f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" {FONT} {extra}>{escape(text)}</text>'


def _svg(width: int, height: int, title: str, body: list[str]) -> Markup:
    return Markup(f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
                  f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}">'
                  f'<title>{escape(title)}</title>{"".join(body)}</svg>')


def _ticks(axis: Axis, count: int = 5) -> list[float]:
    step = (axis.high - axis.low) / count
    return [axis.low + step * i for i in range(count + 1)]


def size_against_drop(points: list[dict], pass_mark_points: float, measure: str) -> Markup:
    """x: weights (decimal GB, MB for small models); y: points below the reference (up = worse), a dot
    at the drop and a bar up to its at-worst bound; a dashed line at the pass mark. points: label,
    bytes, drop, at_worst."""
    width, height, left, right, top, bottom = 600, 320, 60, 20, 20, 45
    unit, scale = ("GB", 1e9) if max(p["bytes"] for p in points) >= 1e9 else ("MB", 1e6)
    xs = [p["bytes"] / scale for p in points]
    ys = [p["drop"] for p in points] + [p["at_worst"] for p in points if p["at_worst"] is not None]
    x_axis = Axis(*_padded(xs), left, width - right)
    y_axis = Axis(*_padded(ys, include=[0.0, pass_mark_points]), height - bottom, top)
    body = [f'<rect x="{left}" y="{top}" width="{width - left - right}" height="{height - top - bottom}" '
            f'fill="none" stroke="#ccc"/>']
    for tick in _ticks(y_axis):
        body.append(_text(left - 6, y_axis(tick) + 4, f"{tick:.1f}", "end"))
    for tick in _ticks(x_axis, 4):
        body.append(_text(x_axis(tick), height - bottom + 15, _size_tick(tick), "middle"))
    body.append(f'<line x1="{left}" x2="{width - right}" y1="{y_axis(0):.1f}" y2="{y_axis(0):.1f}" stroke="#999"/>')
    mark_y = y_axis(pass_mark_points)
    body.append(f'<line x1="{left}" x2="{width - right}" y1="{mark_y:.1f}" y2="{mark_y:.1f}" stroke="#aa1111" '
                f'stroke-dasharray="5,4"/>')
    body.append(_text(width - right - 4, mark_y - 4,
                      f"pass mark: {pass_mark_points:g} point{'' if pass_mark_points == 1 else 's'} below", "end",
                      'fill="#aa1111"'))
    for index, (point, size) in enumerate(zip(points, xs)):
        colour = COLOURS[index % len(COLOURS)]
        x, y = x_axis(size), y_axis(point["drop"])
        if point["at_worst"] is not None:
            body.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{y:.1f}" y2="{y_axis(point["at_worst"]):.1f}" '
                        f'stroke="{colour}" stroke-width="2"/>')
            body.append(f'<line x1="{x - 5:.1f}" x2="{x + 5:.1f}" y1="{y_axis(point["at_worst"]):.1f}" '
                        f'y2="{y_axis(point["at_worst"]):.1f}" stroke="{colour}" stroke-width="2"/>')
        body.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="5" fill="{colour}"/>')
        body.append(_text(x + 8, y + 4, point["label"], extra=f'fill="{colour}"'))
    body.append(_text((left + width - right) / 2, height - 8, f"weights (decimal {unit})", "middle"))
    body.append(_text(14, (top + height - bottom) / 2, f"{measure}: points below the original", "middle",
                      f'transform="rotate(-90 14 {(top + height - bottom) / 2:.1f})"'))
    return _svg(width, height, f"Size against {measure} drop, with the at-worst bound and the pass mark", body)


def _size_tick(size: float) -> str:
    return f"{size:,.0f}" if size >= 10 else f"{size:.3g}"


def stacked_memory(rows: list[dict]) -> Markup:
    """One horizontal bar per build: weights then KV-cache room on one card (GiB). rows: label,
    weights_gib, kv_cache_gib, kv_cache_tokens."""
    bar, gap, left, right, top = 22, 14, 110, 300, 28
    width = 760
    height = top + len(rows) * (bar + gap) + 30
    total = max(r["weights_gib"] + r["kv_cache_gib"] for r in rows) or 1.0
    axis = Axis(0.0, total, left, width - right)
    body = [f'<rect x="{left}" y="6" width="12" height="10" fill="{COLOURS[0]}"/>',
            _text(left + 16, 15, "weights"),
            f'<rect x="{left + 80}" y="6" width="12" height="10" fill="{COLOURS[2]}"/>',
            _text(left + 96, 15, "room for the KV cache")]
    for index, row in enumerate(rows):
        y = top + index * (bar + gap)
        weights_end = axis(row["weights_gib"])
        body.append(_text(left - 6, y + bar / 2 + 4, row["label"], "end"))
        body.append(f'<rect x="{left}" y="{y}" width="{weights_end - left:.1f}" height="{bar}" fill="{COLOURS[0]}"/>')
        kv_end = axis(row["weights_gib"] + row["kv_cache_gib"])
        body.append(f'<rect x="{weights_end:.1f}" y="{y}" width="{kv_end - weights_end:.1f}" '
                    f'height="{bar}" fill="{COLOURS[2]}"/>')
        body.append(_text(axis(row["weights_gib"] + row["kv_cache_gib"]) + 6, y + bar / 2 + 4,
                          f'{row["weights_gib"]:.3g} + {row["kv_cache_gib"]:.3g} GiB, {row["kv_cache_tokens"]:,} tokens'))
    body.append(_text((left + width - right) / 2, height - 6, "GiB per card", "middle"))
    return _svg(width, height, "Memory per card: weights and KV-cache room", body)


def interval_dots(rows: list[dict], unit: str, title: str, fmt: str = "{:.3g}",
                  bounds: tuple[float, float] = (float("-inf"), float("inf"))) -> Markup:
    """A dot per build at its value, whiskers over its 95% interval, the axis kept within `bounds`.
    rows: label, value, low, high."""
    row_height, left, right, top = 26, 110, 120, 10
    width = 560
    height = top + len(rows) * row_height + 30
    values = [v for r in rows for v in (r["value"], r["low"], r["high"])]
    axis = Axis(*_padded(values, bounds=bounds), left, width - right)
    body = [f'<line x1="{left}" x2="{width - right}" y1="{height - 26}" y2="{height - 26}" stroke="#ccc"/>']
    for tick in _ticks(axis, 4):
        body.append(_text(axis(tick), height - 12, fmt.format(tick), "middle"))
    for index, row in enumerate(rows):
        y = top + index * row_height + row_height / 2
        colour = COLOURS[index % len(COLOURS)]
        body.append(_text(left - 6, y + 4, row["label"], "end"))
        body.append(f'<line x1="{axis(row["low"]):.1f}" x2="{axis(row["high"]):.1f}" y1="{y:.1f}" y2="{y:.1f}" '
                    f'stroke="{colour}" stroke-width="2"/>')
        body.append(f'<circle cx="{axis(row["value"]):.1f}" cy="{y:.1f}" r="4.5" fill="{colour}"/>')
        body.append(_text(width - right + 8, y + 4, fmt.format(row["value"]) + unit))
    return _svg(width, height, title, body)


SHAPES = {"reference": "diamond", "quantize": "circle", "prune": "square", "prune+quantize": "triangle"}


def _mark(shape: str, x: float, y: float, colour: str, size: float = 5.5) -> str:
    if shape == "circle":
        return f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{size:.1f}" fill="{colour}"/>'
    if shape == "square":
        return (f'<rect x="{x - size:.1f}" y="{y - size:.1f}" width="{2 * size:.1f}" height="{2 * size:.1f}" '
                f'fill="{colour}"/>')
    if shape == "triangle":
        corners = [(x, y - size - 1), (x + size + 1, y + size), (x - size - 1, y + size)]
    else:  # a diamond
        corners = [(x, y - size - 1), (x + size + 1, y), (x, y + size + 1), (x - size - 1, y)]
    points = " ".join(f"{a:.1f},{b:.1f}" for a, b in corners)
    return f'<polygon points="{points}" fill="{colour}"/>'


def _name_rows(names: list[str], width: float) -> list[list[tuple[int, str]]]:
    """The numbered names laid out in rows that fit `width` px (about 6.3 px a character at FONT's size)."""
    rows: list[list[tuple[int, str]]] = [[]]
    used = 0.0
    for number, name in enumerate(names, 1):
        needed = 6.3 * (len(name) + len(str(number)) + 1) + 18
        if rows[-1] and used + needed > width:
            rows.append([])
            used = 0.0
        rows[-1].append((number, name))
        used += needed
    return rows


def frontier(points: list[dict], pareto: list[str], x_title: str, y_title: str, title: str,
             y_fmt: str = "{:.3g}", y_bounds: tuple[float, float] = (float("-inf"), float("inf")),
             mark_line: tuple[float, str] | None = None) -> Markup:
    """One mark per build at (x, y), whiskers from low to high where given; its shape says how it was made
    (SHAPES: reference, quantize, prune, both), its colour the format or method (`group`); the `pareto` builds
    joined by a line in x order, numbered beside their marks and named below the plot in `pareto`'s order.
    points: build, label, x, y, low, high, kind, group. mark_line: (y, text), a dashed line such as the pass
    mark. Every mark carries its build's name as a tooltip."""
    width, left, right, top, plot_height = 720, 70, 20, 46, 290
    by_build = {p["build"]: p for p in points}
    named = [b for b in pareto if b in by_build]
    name_rows = _name_rows([by_build[b]["label"] for b in named], width - left - right)
    height = top + plot_height + 40 + 16 * len(name_rows)
    bottom_px = top + plot_height
    groups = list(dict.fromkeys(p["group"] for p in points))
    colour_of = {group: COLOURS[i % len(COLOURS)] for i, group in enumerate(groups)}
    xs = [p["x"] for p in points]
    ys = [v for p in points for v in (p["y"], p.get("low"), p.get("high")) if v is not None]
    x_axis = Axis(*_padded(xs), left, width - right)
    y_axis = Axis(*_padded(ys, include=[mark_line[0]] if mark_line else [], bounds=y_bounds), bottom_px, top)
    body = [f'<rect x="{left}" y="{top}" width="{width - left - right}" height="{plot_height}" fill="none" '
            f'stroke="#ccc"/>']
    legend_x = left
    for group in groups:
        kinds = {p["kind"] for p in points if p["group"] == group}
        shape = SHAPES[next(iter(kinds))] if len(kinds) == 1 else "circle"
        body.append(_mark(shape, legend_x + 6, 14, colour_of[group], 4.5))
        body.append(_text(legend_x + 14, 18, group))
        legend_x += 24 + 7 * len(group)
    body.append(_text(left, 36, "numbered and joined: the frontier; every mark's name shows on hover",
                      extra='fill="#666"'))
    for tick in _ticks(y_axis):
        body.append(_text(left - 6, y_axis(tick) + 4, y_fmt.format(tick), "end"))
    for tick in _ticks(x_axis, 4):
        body.append(_text(x_axis(tick), bottom_px + 15, _size_tick(tick), "middle"))
    if mark_line:
        line_y = y_axis(mark_line[0])
        body.append(f'<line x1="{left}" x2="{width - right}" y1="{line_y:.1f}" y2="{line_y:.1f}" stroke="#aa1111" '
                    f'stroke-dasharray="5,4"/>')
        body.append(_text(width - right - 4, line_y - 4, mark_line[1], "end", 'fill="#aa1111"'))
    on_frontier = sorted((by_build[b] for b in named), key=lambda p: p["x"])
    if len(on_frontier) > 1:
        path = " ".join(f"{x_axis(p['x']):.1f},{y_axis(p['y']):.1f}" for p in on_frontier)
        body.append(f'<polyline class="pareto" points="{path}" fill="none" stroke="#333" stroke-width="1.5"/>')
    for point in points:
        colour = colour_of[point["group"]]
        x, y = x_axis(point["x"]), y_axis(point["y"])
        mark = [f'<g class="mark" data-build="{escape(point["build"])}"><title>{escape(point["label"])}</title>']
        if point.get("low") is not None and point.get("high") is not None:
            mark.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{y_axis(point["low"]):.1f}" '
                        f'y2="{y_axis(point["high"]):.1f}" stroke="{colour}" stroke-width="1.5"/>')
        mark.append(_mark(SHAPES[point["kind"]], x, y, colour) + "</g>")
        body.append("".join(mark))
    for number, build in enumerate(named, 1):
        point = by_build[build]
        body.append(_text(x_axis(point["x"]) + 7, y_axis(point["y"]) - 7, str(number),
                          extra=f'class="pareto-number" font-weight="bold" fill="{colour_of[point["group"]]}"'))
    body.append(_text((left + width - right) / 2, bottom_px + 32, x_title, "middle"))
    for row_index, row in enumerate(name_rows):
        x = left
        for number, name in row:
            colour = colour_of[by_build[named[number - 1]]["group"]]
            body.append(_text(x, bottom_px + 52 + 16 * row_index, f"{number}", extra=f'font-weight="bold" fill="{colour}"'))
            body.append(_text(x + 6.3 * len(str(number)) + 4, bottom_px + 52 + 16 * row_index, name,
                              extra=f'class="pareto-name" fill="{colour}"'))
            x += 6.3 * (len(name) + len(str(number)) + 1) + 18
    body.append(_text(14, (top + bottom_px) / 2, y_title, "middle",
                      f'transform="rotate(-90 14 {(top + bottom_px) / 2:.1f})"'))
    return _svg(width, height, title, body)
