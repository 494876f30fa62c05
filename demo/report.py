"""The demo's HTML report: plain HTML with inline SVG plots, no dependencies."""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]
WIDTH, HEIGHT, PAD = 720, 260, 48


def _axes(x_max: float, y_max: float, x_label: str, y_label: str) -> list[str]:
    parts = [
        f'<line x1="{PAD}" y1="{HEIGHT - PAD}" x2="{WIDTH - 10}" y2="{HEIGHT - PAD}" stroke="#333"/>',
        f'<line x1="{PAD}" y1="10" x2="{PAD}" y2="{HEIGHT - PAD}" stroke="#333"/>',
        f'<text x="{WIDTH / 2}" y="{HEIGHT - 8}" text-anchor="middle" font-size="12">{html.escape(x_label)}</text>',
        f'<text x="12" y="{HEIGHT / 2}" font-size="12" transform="rotate(-90 12 {HEIGHT / 2})" '
        f'text-anchor="middle">{html.escape(y_label)}</text>',
    ]
    for fraction in (0, 0.5, 1):
        y = HEIGHT - PAD - fraction * (HEIGHT - PAD - 10)
        parts.append(f'<text x="{PAD - 4}" y="{y + 4}" text-anchor="end" font-size="10">{y_max * fraction:.0f}</text>')
        x = PAD + fraction * (WIDTH - PAD - 10)
        parts.append(f'<text x="{x}" y="{HEIGHT - PAD + 14}" text-anchor="middle" font-size="10">'
                     f'{x_max * fraction:.0f}</text>')
    return parts


def line_chart(series: dict[str, Sequence[tuple[float, float]]], x_label: str, y_label: str) -> str:
    points = [p for values in series.values() for p in values]
    x_max = max((p[0] for p in points), default=1) or 1
    y_max = max((p[1] for p in points), default=1) or 1
    parts = _axes(x_max, y_max, x_label, y_label)
    for index, (name, values) in enumerate(sorted(series.items())):
        color = COLORS[index % len(COLORS)]
        coords = " ".join(
            f"{PAD + x / x_max * (WIDTH - PAD - 10):.1f},{HEIGHT - PAD - y / y_max * (HEIGHT - PAD - 10):.1f}"
            for x, y in values
        )
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{coords}"/>')
        parts.append(f'<text x="{WIDTH - 150}" y="{20 + 14 * index}" font-size="11" fill="{color}">'
                     f'{html.escape(name)}</text>')
    return f'<svg width="{WIDTH}" height="{HEIGHT}" role="img">{"".join(parts)}</svg>'


def bar_chart(bars: Sequence[tuple[str, float]], unit: str) -> str:
    height = 28 * len(bars) + 20
    top = max((value for _, value in bars), default=1) or 1
    parts = []
    for index, (name, value) in enumerate(bars):
        y = 10 + 28 * index
        length = value / top * (WIDTH - 260)
        parts.append(f'<text x="180" y="{y + 15}" text-anchor="end" font-size="12">{html.escape(name)}</text>')
        parts.append(f'<rect x="190" y="{y}" width="{length:.1f}" height="20" fill="{COLORS[index % 8]}"/>')
        parts.append(f'<text x="{196 + length:.1f}" y="{y + 15}" font-size="12">{value:.1f} {unit}</text>')
    return f'<svg width="{WIDTH}" height="{height}" role="img">{"".join(parts)}</svg>'


def _table(rows: dict[str, Any]) -> str:
    cells = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>" for k, v in rows.items())
    return f"<table>{cells}</table>"


def _mirror(report: dict[str, Any]) -> dict[str, Any]:
    """The mirror's report, each table and the aggregate on a line of its own."""
    mirror = dict(report.get("mirror", {}))
    for table, seen in mirror.pop("tables", {}).items():
        mirror[f"{table} vs its source"] = f"{seen['source_rows']} rows, rows that differ: {seen['differ']}"
    aggregate = mirror.pop("aggregate", None)
    if aggregate:
        mirror[f"{aggregate['table']} vs GROUP BY {aggregate['group_by']}"] = (
            f"{aggregate['groups']} groups, rows that differ: {aggregate['differ']}")
    return mirror


def render(report: dict[str, Any]) -> str:
    """:param report: ``summary`` (the ledger's audit, dict), ``orders`` (the orders pipeline's
    audit and what it did during the ledger's recovery, dict), ``mirror`` (the mirror's
    comparison with its source, dict), ``lso_lag`` ({topic[partition]:
    [(seconds, lag)]}), ``throughput`` ({series: [(seconds, rows per second)]}),
    ``recovery_steps`` ([(task, seconds)]), ``runs`` ({dag: state}), ``spark`` ({"master": url,
    app id: what it was})."""
    verdict = "EXACTLY ONCE" if report.get("exact") else "MISMATCH"
    color = "#2ca02c" if report.get("exact") else "#d62728"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>airflow-provider-eos demo report</title>
<style>
body {{ font-family: sans-serif; margin: 24px; color: #222; max-width: 980px; }}
h1 {{ font-size: 22px; }} h2 {{ font-size: 17px; margin-top: 28px; }}
table {{ border-collapse: collapse; }} th, td {{ border: 1px solid #ccc; padding: 4px 10px; text-align: left; }}
.verdict {{ font-size: 20px; font-weight: bold; color: {color}; }}
</style></head><body>
<h1>Kafka &rarr; Spark &rarr; PostgreSQL, exactly once</h1>
<p class="verdict">{verdict}</p>
<h2>Final audit: ledger (crashed, hung, snapshotted, damaged, recovered)</h2>{_table(report.get("summary", {}))}
<h2>Final audit: orders (streamed the whole time, through the ledger's recovery)</h2>{_table(report.get("orders", {}))}
<h2>Final comparison: shop_mirror (a change stream; Connect and its driver SIGKILLed)</h2>{_table(_mirror(report))}
<h2>DAG runs</h2>{_table(report.get("runs", {}))}
<h2>Spark (master, and the applications a standalone master ran)</h2>{_table(report.get("spark", {}))}
<h2>LastStableOffsetLag per topic partition (records)</h2>
{line_chart(report.get("lso_lag", {}), "seconds since start", "HW - LSO")}
<h2>Stream throughput per pipeline</h2>
{line_chart(report.get("throughput", {}), "seconds since start", "rows per second")}
<h2>The ledger's recovery steps</h2>
{bar_chart(report.get("recovery_steps", []), "s")}
</body></html>
"""
