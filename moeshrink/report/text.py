"""How the report writes a figure: sizes, rates with their intervals, points, p-values, tables."""
from __future__ import annotations

import pandas as pd
from markupsafe import Markup

from moeshrink.core import expert_formats

GB = 1e9


def decimal_size(size_bytes: float) -> str:
    """Decimal units, as the published report writes sizes (GB = 10**9 bytes)."""
    if size_bytes >= GB:
        return f"{size_bytes / GB:,.1f} GB"
    return f"{size_bytes / 1e6:,.2f} MB"


def pct(rate: float | None) -> str:
    return "-" if rate is None else f"{100 * rate:.1f}%"



def memory_checks_text(memory: dict) -> str:
    """'all N hold', or which checks failed: a figure that disagrees with its prediction is never
    printed without saying so."""
    failed = [name for name, ok in memory["checks"].items() if not ok]
    return f"all {len(memory['checks'])} hold" if not failed else "FAILED: " + ", ".join(failed)

def rate_text(figure: dict | None) -> str:
    if not figure:
        return "-"
    low, high = figure["ci95"]
    return f"{pct(figure['value'])} [{100 * low:.1f}, {100 * high:.1f}]"


def points(value: float | None, signed: bool = True) -> str:
    if value is None:
        return "-"
    value = round(value, 1) + 0.0  # no "-0.0"
    return f"{value:+.1f}" if signed and value else f"{value:.1f}"


def p_text(p_value: float | None) -> str:
    if p_value is None:
        return "-"
    return f"{p_value:.2g}" if p_value >= 1e-4 else f"{p_value:.1e}"


def ratio_text(build_bytes: int, reference_bytes: int) -> str:
    ratio = build_bytes / reference_bytes
    if abs(ratio - 1) < 5e-4:
        return "reference" if build_bytes == reference_bytes else "same size"
    if ratio < 1:
        return f"{100 * (1 - ratio):.0f}% smaller ({1 / ratio:.2f}x)"
    return f"{100 * (ratio - 1):.0f}% larger"


def html_table(frame: pd.DataFrame, per_build: bool = True) -> Markup:
    """A pandas table, every cell escaped; `per-build` tables have one row per build (the browser test
    checks it)."""
    classes = ["data", "per-build"] if per_build else ["data"]
    return Markup(frame.to_html(index=False, escape=True, border=0, classes=classes, na_rep="-"))


def made_by(build: dict) -> str:
    steps = []
    if build.get("prune"):
        steps.append(f"prune {build['prune']['method']}, keep {100 * build['prune']['keep_fraction']:g}% of experts")
    if build.get("quantize"):
        calibrated = expert_formats.calibrated_steps(build["quantize"])
        steps.append(f"quantize experts to {build['quantize']['format']}"
                     + (f" (output-aware on calibration text: {', '.join(calibrated)})" if calibrated else ""))
    return "; ".join(steps) or "as published"


def below(drop_points: float) -> str:
    if abs(drop_points) < 0.05:
        return "level with the original"
    return f"{abs(drop_points):.1f} points {'below' if drop_points > 0 else 'above'} the original"
