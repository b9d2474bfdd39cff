"""Line charts of a run's `metrics.jsonl`, drawn by the server as SVG (no charting library, no
script): reward, evaluation accuracy with its interval, loss and KL, each against the step.

A chart draws the series of its spec that the rows have; rows are those of RL (`reward/mean`,
`eval/success_rate` with `eval/success_low`/`_high`, `train/loss:sum`, `kl_*`) and SFT
(`train_loss`, `val_loss`) runs. The reward's band is one standard error of each step's batch
mean, from `reward/std` and `episodes`, as in the run's own `reward.png` (`rl/metrics.py`): a
min-max band spans 0 to 1 at almost every step of a 0/1 reward, and says nothing. The SVG says
how many points its first series has (`data-points`), which is what a test watches grow.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from html import escape
from typing import Any

WIDTH, HEIGHT = 560, 220
LEFT, RIGHT, TOP, BOTTOM = 58, 14, 12, 30
MAX_DRAWN = 400  # points per polyline; longer series are thinned (the last point kept)
MAX_MARKERS = 150  # points marked with a dot (and a tooltip) while a series is this short
_KL = re.compile(r"(^|/)kl([_/]|$)")


Band = Callable[[dict[str, Any]], "tuple[float, float] | None"]


@dataclass(frozen=True)
class ChartSpec:
    key: str
    title: str
    series: tuple[str, ...]  # metric keys, drawn when present; () for `kl` (found in the rows)
    band: Band | None = None  # a row's (low, high) around the first series, or None
    band_label: str = ""
    empty: str = ""  # what the chart says while it has nothing to draw


def mean_standard_error(row: dict[str, Any]) -> float | None:
    """std / sqrt(n) of one step's rewards, the sample std made from the logged population one
    (`reward/std` over `episodes` answers); None when the row lacks them (older logs)."""
    std, n = _number(row.get("reward/std")), _number(row.get("episodes"))
    if std is None or n is None or n < 2:
        return None
    return std * math.sqrt(n / (n - 1)) / math.sqrt(n)


def _reward_band(row: dict[str, Any]) -> tuple[float, float] | None:
    mean, se = _number(row.get("reward/mean")), mean_standard_error(row)
    return None if mean is None or se is None else (mean - se, mean + se)


def _keys_band(low: str, high: str) -> Band:
    def band(row: dict[str, Any]) -> tuple[float, float] | None:
        lo, hi = _number(row.get(low)), _number(row.get(high))
        return None if lo is None or hi is None else (lo, hi)

    return band


SPECS = (
    ChartSpec("reward", "Reward (training batches)", ("reward/mean",),
              _reward_band, "± 1 s.e. of the batch mean",
              "No reward yet: RL runs log reward/mean for every step."),
    ChartSpec("eval", "Evaluation accuracy", ("eval/success_rate", "eval/correct"),
              _keys_band("eval/success_low", "eval/success_high"), "interval",
              "No evaluation yet: RL runs evaluate every eval_every steps."),
    ChartSpec("loss", "Loss", ("train_loss", "val_loss", "train/loss:sum", "value/loss"),
              empty="No loss yet: SFT logs train_loss and val_loss, RL train/loss:sum "
              "for every update."),
    ChartSpec("kl", "KL", (), empty="No KL yet: RL logs kl_* for every policy update."),
)


@dataclass(frozen=True)
class Series:
    key: str
    points: list[tuple[float, float]]


@dataclass(frozen=True)
class Chart:
    key: str
    title: str
    series: list[Series]
    band_label: str
    svg: str  # "" when there is nothing to draw
    empty: str

    @property
    def points(self) -> int:
        return len(self.series[0].points) if self.series else 0


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _points(rows: list[dict[str, Any]], key: str) -> list[tuple[float, float]]:
    found = []
    for row in rows:
        step, value = _number(row.get("step")), _number(row.get(key))
        if step is not None and value is not None:
            found.append((step, value))
    return found


def _band(rows: list[dict[str, Any]], band: Band) -> list[tuple[float, float, float]]:
    found = []
    for row in rows:
        step, bounds = _number(row.get("step")), band(row)
        if step is not None and bounds is not None:
            found.append((step, *bounds))
    return found


def _kl_keys(rows: list[dict[str, Any]]) -> tuple[str, ...]:
    keys: dict[str, None] = {}
    for row in rows:
        for key in row:
            if _KL.search(key):
                keys[key] = None
    return tuple(sorted(keys))[:6]


def _nice_step(span: float, ticks: int = 4) -> float:
    raw = span / ticks
    power = 10 ** math.floor(math.log10(raw))
    for factor in (1, 2, 2.5, 5, 10):
        if raw <= factor * power:
            return factor * power
    return 10 * power


def _range(values: list[float]) -> tuple[float, float]:
    low, high = min(values), max(values)
    if high - low < 1e-12:
        pad = abs(high) * 0.1 or 0.5
        return low - pad, high + pad
    pad = (high - low) * 0.05
    return low - pad, high + pad


def _label(value: float) -> str:
    return f"{value:.4g}"


def _thin(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    if len(points) <= MAX_DRAWN:
        return points
    every = math.ceil(len(points) / MAX_DRAWN)
    return points[::every] + ([points[-1]] if (len(points) - 1) % every else [])


def _svg(spec: ChartSpec, series: list[Series], band: list[tuple[float, float, float]]) -> str:
    xs = [x for s in series for x, _ in s.points] + [b[0] for b in band]
    ys = [y for s in series for _, y in s.points] + [v for b in band for v in b[1:]]
    x0, x1 = (min(xs), max(xs)) if max(xs) > min(xs) else (min(xs) - 1, max(xs) + 1)
    y0, y1 = _range(ys)
    inner_w, inner_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def px(x: float) -> float:
        return LEFT + (x - x0) / (x1 - x0) * inner_w

    def py(y: float) -> float:
        return TOP + (1 - (y - y0) / (y1 - y0)) * inner_h

    parts = [
        (
            f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
            f'aria-label="{escape(spec.title)}" data-chart="{spec.key}" '
            f'data-points="{len(series[0].points)}">'
        )
    ]
    step = _nice_step(y1 - y0)
    tick = math.ceil(y0 / step) * step
    while tick <= y1:
        y = py(tick)
        parts.append(f'<line class="grid" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}"/>')
        parts.append(f'<text class="tick" x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">'
                     f"{_label(tick)}</text>")
        tick += step
    xstep = max(1.0, _nice_step(x1 - x0, 5))
    tick = math.ceil(x0 / xstep) * xstep
    while tick <= x1:
        x = px(tick)
        parts.append(f'<text class="tick" x="{x:.1f}" y="{HEIGHT - 10}" text-anchor="middle">'
                     f"{_label(tick)}</text>")
        tick += xstep
    parts.append(f'<text class="axis" x="{WIDTH - RIGHT}" y="{HEIGHT - 1}" '
                 'text-anchor="end">step</text>')
    parts.append(f'<rect class="frame" x="{LEFT}" y="{TOP}" width="{inner_w}" height="{inner_h}"/>')
    if band:
        upper = " ".join(f"{px(s):.1f},{py(hi):.1f}" for s, _, hi in band)
        lower = " ".join(f"{px(s):.1f},{py(lo):.1f}" for s, lo, _ in reversed(band))
        parts.append(f'<polygon class="band" points="{upper} {lower}"/>')
    for i, s in enumerate(series):
        drawn = _thin(s.points)
        line = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in drawn)
        parts.append(f'<polyline class="series s{i}" points="{line}"/>')
        if len(s.points) <= MAX_MARKERS:
            for x, y in s.points:
                parts.append(
                    f'<circle class="point s{i}" cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.6">'
                    f"<title>{escape(s.key)} at step {_label(x)}: {_label(y)}</title></circle>"
                )
    parts.append("</svg>")
    return "".join(parts)


def chart(spec: ChartSpec, rows: list[dict[str, Any]]) -> Chart:
    keys = spec.series or _kl_keys(rows)
    series = [Series(k, pts) for k in keys if (pts := _points(rows, k))]
    if spec.key == "eval" and series:
        series = series[:1]  # the success rate when there is one, else the verifier's mean
    band = []
    if spec.band and series and series[0].key == spec.series[0]:
        band = _band(rows, spec.band)
    svg = _svg(spec, series, band) if series else ""
    return Chart(spec.key, spec.title, series, spec.band_label if band else "", svg, spec.empty)


def charts(rows: list[dict[str, Any]]) -> list[Chart]:
    return [chart(spec, rows) for spec in SPECS]
