"""The charts, drawn on the server as SVG: no script, nothing loaded from elsewhere.

Every piece of text in them (job names, owners, errors, reasons) is escaped
with :func:`markupsafe.escape` before it is placed, in element text and in
attributes alike; the results are :class:`markupsafe.Markup`, so the
templates insert them as they are. Colours come from the page's style sheet
(classes named by outcome: ``success``, ``failure``, ``lost``, ``cancelled``,
``running``), except in the badge, a document of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime, timedelta, timezone

from markupsafe import Markup, escape

from ledger.web.display import clock, duration
from ledger.web.pages import SPARK_RUNS, JobPage
from ledger.web.reads import RunBar

Href = Callable[[int], str]  # a run's page, from its id

# The timeline's and the duration chart's drawing area (viewBox units; the SVG scales to the page's width).
WIDTH = 1000
LEFT = 48
RIGHT = 12


def _e(text: object) -> str:
    return str(escape(str(text)))


def _n(value: float) -> str:
    return f"{value:.1f}"


def _run_title(run: RunBar) -> str:
    ended = clock(run.completed_at) if run.completed_at else "running"
    words = [f"run {run.run_id}", run.outcome if run.failure_reason is None else f"failure ({run.failure_reason})",
             f"token {run.token}", f"owner {run.owner}", f"{clock(run.started_at)} to {ended} UTC",
             duration(run.seconds)]
    if run.slot is not None:
        words.append(f"slot {clock(run.slot)}")
    if run.error:
        words.append(run.error)
    return " · ".join(words)


def sparkline(runs: Sequence[RunBar], href: Href) -> Markup:
    """The newest runs as bars, oldest left, height by duration, colour by outcome; each links to its run."""
    width, height, slot = 4 * SPARK_RUNS + 2, 24, 4
    longest = max((run.seconds for run in runs), default=0.0) or 1.0
    parts = [f'<svg class="spark" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
             f'role="img" aria-label="{len(runs)} newest runs">']
    start = width - 1 - slot * len(runs)
    for index, run in enumerate(runs):
        bar = max(3.0, (height - 2) * run.seconds / longest)
        parts.append(f'<a href="{_e(href(run.run_id))}"><rect class="bar {_e(run.outcome)}" '
                     f'x="{_n(start + index * slot)}" y="{_n(height - 1 - bar)}" width="3" height="{_n(bar)}">'
                     f'<title>{_e(_short_title(run))}</title></rect></a>')
    parts.append("</svg>")
    return Markup("".join(parts))


def _short_title(run: RunBar) -> str:
    return f"run {run.run_id} {run.outcome} {duration(run.seconds)}, {clock(run.started_at)}"


def _ticks(since: datetime, until: datetime) -> list[datetime]:
    span = until - since
    for step in (timedelta(minutes=10), timedelta(minutes=30), timedelta(hours=1), timedelta(hours=3),
                 timedelta(hours=6), timedelta(days=1), timedelta(days=5)):
        if span / step <= 8:
            break
    first = datetime.fromtimestamp(-(-since.timestamp() // step.total_seconds()) * step.total_seconds(),
                                   tz=timezone.utc)
    ticks = []
    while first <= until:
        ticks.append(first)
        first += step
    return ticks


class _Scale:
    """Instants to x in the drawing area."""

    def __init__(self, since: datetime, until: datetime) -> None:
        self.since, self.until = since, until
        self._span = max((until - since).total_seconds(), 1e-6)

    def __call__(self, when: datetime) -> float:
        clamped = min(max(when, self.since), self.until)
        return LEFT + (WIDTH - LEFT - RIGHT) * (clamped - self.since).total_seconds() / self._span


def _axis(scale: _Scale, y: float, now: datetime) -> list[str]:
    parts = [f'<line class="axis" x1="{LEFT}" y1="{_n(y)}" x2="{WIDTH - RIGHT}" y2="{_n(y)}"/>']
    daily = scale.until - scale.since > timedelta(days=2)
    for tick in _ticks(scale.since, scale.until):
        x = scale(tick)
        label = tick.strftime("%m-%d") if daily else tick.strftime("%H:%M")
        parts.append(f'<line class="tick" x1="{_n(x)}" y1="{_n(y)}" x2="{_n(x)}" y2="{_n(y + 4)}"/>'
                     f'<text class="label" x="{_n(x)}" y="{_n(y + 15)}" text-anchor="middle">{_e(label)}</text>')
    parts.append(f'<text class="label" x="{WIDTH - RIGHT}" y="{_n(y - 4)}" text-anchor="end">now</text>')
    return parts


def timeline(page: JobPage, href: Href) -> Markup:
    """The window's runs as bars from start to end, skipped ranges shaded, slots marked; UTC axis."""
    scale = _Scale(page.since, page.until)
    height = 112
    parts = [f'<svg class="timeline" viewBox="0 0 {WIDTH} {height}" role="img" '
             f'aria-label="timeline of runs of {_e(page.job)}">',
             f'<text class="label" x="4" y="14">slots</text><text class="label" x="4" y="52">runs</text>']
    for skipped in page.skipped:
        x0, x1 = scale(skipped.first_slot), scale(skipped.last_slot)
        title = (f"skipped {skipped.slot_count} slot{'s' if skipped.slot_count != 1 else ''} "
                 f"({skipped.reason}): {clock(skipped.first_slot)} to {clock(skipped.last_slot)} UTC, "
                 f"recorded {clock(skipped.recorded_at)}")
        parts.append(f'<rect class="skipped" x="{_n(x0 - 1.5)}" y="20" width="{_n(max(3.0, x1 - x0 + 3))}" '
                     f'height="60"><title>{_e(title)}</title></rect>')
    for slot in page.slot_marks:
        x = scale(slot)
        parts.append(f'<line class="slot" x1="{_n(x)}" y1="6" x2="{_n(x)}" y2="18">'
                     f'<title>{_e("slot " + clock(slot) + " UTC")}</title></line>')
    for run in page.runs:
        x0 = scale(run.started_at)
        x1 = scale(run.completed_at or page.now)
        parts.append(f'<a href="{_e(href(run.run_id))}"><rect class="run {_e(run.outcome)}" x="{_n(x0)}" y="30" '
                     f'width="{_n(max(2.0, x1 - x0))}" height="40"><title>{_e(_run_title(run))}</title></rect></a>')
    parts += _axis(scale, 86, page.now)
    parts.append("</svg>")
    return Markup("".join(parts))


def durations(page: JobPage, href: Href) -> Markup:
    """The window's runs by start time and duration, with the ttl and the ttl_advice range drawn in."""
    scale = _Scale(page.since, page.until)
    top, bottom, height = 12.0, 150.0, 182
    advice = page.advice
    ttl = page.status.ttl
    longest = max([run.seconds for run in page.runs]
                  + [value.total_seconds() for value in (ttl, advice and advice.recommended_max) if value])
    ceiling = (longest or 1.0) * 1.15

    def y(seconds: float) -> float:
        return bottom - (bottom - top) * min(seconds, ceiling) / ceiling

    parts = [f'<svg class="durations" viewBox="0 0 {WIDTH} {height}" role="img" '
             f'aria-label="durations of runs of {_e(page.job)}">']
    if advice is not None and advice.recommended_min is not None and advice.recommended_max is not None:
        low, high = advice.recommended_min.total_seconds(), advice.recommended_max.total_seconds()
        label = f"ttl advice {duration(advice.recommended_min)} to {duration(advice.recommended_max)}"
        parts.append(f'<rect class="advice" x="{LEFT}" y="{_n(y(high))}" width="{WIDTH - LEFT - RIGHT}" '
                     f'height="{_n(max(1.0, y(low) - y(high)))}"><title>{_e(label)} (1.5 to 2 times the '
                     f'longest successful run, {_e(duration(advice.longest_run))})</title></rect>'
                     f'<text class="label advice-label" x="{LEFT + 4}" y="{_n(y(high) - 3)}">{_e(label)}</text>')
    if ttl is not None:
        parts.append(f'<line class="ttl" x1="{LEFT}" y1="{_n(y(ttl.total_seconds()))}" x2="{WIDTH - RIGHT}" '
                     f'y2="{_n(y(ttl.total_seconds()))}"><title>{_e("ttl " + duration(ttl))}</title></line>'
                     f'<text class="label ttl-label" x="{WIDTH - RIGHT - 4}" y="{_n(y(ttl.total_seconds()) - 3)}" '
                     f'text-anchor="end">{_e("ttl " + duration(ttl))}</text>')
    for fraction in (0.0, 0.5, 1.0):
        seconds = ceiling * fraction / 1.15 if fraction else 0.0
        parts.append(f'<text class="label" x="{LEFT - 4}" y="{_n(y(seconds) + 4)}" text-anchor="end">'
                     f'{_e(duration(seconds) or "0s")}</text>'
                     f'<line class="grid" x1="{LEFT}" y1="{_n(y(seconds))}" x2="{WIDTH - RIGHT}" y2="{_n(y(seconds))}"/>')
    for run in page.runs:
        parts.append(f'<a href="{_e(href(run.run_id))}"><circle class="point {_e(run.outcome)}" '
                     f'cx="{_n(scale(run.started_at))}" cy="{_n(y(run.seconds))}" r="3">'
                     f'<title>{_e(_run_title(run))}</title></circle></a>')
    parts += _axis(scale, bottom + 6, page.now)
    parts.append("</svg>")
    return Markup("".join(parts))




def _text_width(text: str) -> float:
    """About how wide 11px Verdana writes ``text`` (shields.io's sizes, on average)."""
    return 6.6 * len(text) + 10


def badge(label: str, message: str, colour: str) -> str:
    """A status badge, ``label | message``, as a standalone SVG document."""
    left, right = _text_width(label), _text_width(message)
    total = left + right
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_n(total)}" height="20" role="img" '
        f'aria-label="{_e(label)}: {_e(message)}"><title>{_e(label)}: {_e(message)}</title>'
        f'<rect width="{_n(left)}" height="20" fill="#555"/>'
        f'<rect x="{_n(left)}" width="{_n(right)}" height="20" fill="{_e(colour)}"/>'
        f'<g fill="#fff" text-anchor="middle" font-family="Verdana,DejaVu Sans,sans-serif" font-size="11">'
        f'<text x="{_n(left / 2)}" y="14">{_e(label)}</text>'
        f'<text x="{_n(left + right / 2)}" y="14">{_e(message)}</text></g></svg>')
