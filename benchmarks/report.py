"""Turn a run's samples into medians, ratios and target verdicts; print them as a table and
write them as JSON (with environment metadata), Markdown and a PNG plot of the ratios.

    Results --summarize--> [Row: workload x metric] --table()/markdown()--> text
                                                    --to_json()---------> results-*.json
                                                    --plot()------------> results-*.png

Ratios are always oriented so that above 1 means mprs_plus is better: throughput of
mprs_plus over the other's, time of the other over mprs_plus's. Bandwidths are also given
as a fraction of the single-core memcpy bandwidth measured in the same run.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .harness import (
    CONTENDERS,
    FAILED,
    MEMCPY,
    MPRS_PLUS,
    NOT_APPLICABLE,
    Metric,
    Results,
    Target,
    Workload,
    settings_dict,
)

OTHERS = tuple(c for c in CONTENDERS if c != MPRS_PLUS)
COMPARISONS = (*OTHERS, MEMCPY)


@dataclass(frozen=True)
class Verdict:
    target: Target
    threshold: float
    value: float | None  # the ratio (or, for an absolute target, the value) measured

    @property
    def passed(self) -> bool | None:
        if self.value is None:
            return None
        return self.value >= self.threshold if self.target.against is not None else self.value <= self.threshold

    @property
    def word(self) -> str:
        return {True: "PASS", False: "MISS", None: "NO DATA"}[self.passed]

    def label(self, metric: Metric) -> str:
        if self.target.against is None:
            sign = "≥" if metric.higher_is_better else "≤"
            return f"{sign}{_number(self.threshold)} {metric.unit}"
        return f"≥{_number(self.threshold)}× {self.target.against}"


@dataclass(frozen=True)
class Row:
    workload: Workload
    metric: Metric
    medians: dict[str, float | None]  # contender -> median; None when failed or not applicable
    ratios: dict[str, float | None]  # contender or MEMCPY -> ratio of mprs_plus against it
    verdicts: tuple[Verdict, ...]


def ratio(metric: Metric, mine: float | None, theirs: float | None) -> float | None:
    if not mine or not theirs:
        return None
    return mine / theirs if metric.higher_is_better else theirs / mine


def summarize(results: Results) -> list[Row]:
    memcpy = results.memcpy_median()
    rows = []
    for workload in results.workloads:
        cells = results.cells[workload.name]
        for metric in workload.metrics:
            medians = {c: cells[c].median(metric.key) for c in CONTENDERS}
            mine = medians[MPRS_PLUS]
            ratios = {c: ratio(metric, mine, medians[c]) for c in OTHERS}
            ratios[MEMCPY] = ratio(metric, mine, memcpy) if metric.unit == "GB/s" else None
            verdicts = tuple(
                Verdict(t, t.resolve(results.settings), mine if t.against is None else ratios[t.against])
                for t in workload.targets
                if t.metric == metric.key
            )
            rows.append(Row(workload, metric, medians, ratios, verdicts))
    return rows


# -- text ------------------------------------------------------------------------------------


def _number(value: float) -> str:
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}".rstrip("0").rstrip(".")
    return f"{value:.2f}".rstrip("0").rstrip(".")


def format_value(value: float | None, unit: str) -> str:
    if value is None:
        return "—"
    if unit == "items/s":
        for scale, suffix in ((1e6, "M"), (1e3, "k")):
            if value >= scale:
                return f"{value / scale:.3g}{suffix}"
        return f"{value:.3g}"
    if unit == "s":
        return f"{value * 1e3:.3g} ms" if value < 1 else f"{value:.3g} s"
    return f"{value:.3g}"


def format_ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.3g}×"


def _cell_text(results: Results, row: Row, contender: str) -> str:
    cell = results.cells[row.workload.name][contender]
    if cell.status == FAILED:
        return "failed"
    if cell.status == NOT_APPLICABLE:
        return "n/a"
    return format_value(row.medians[contender], row.metric.unit)


def _display_unit(unit: str) -> str:
    return "ms" if unit == "s" else unit


def _grid(results: Results, rows: list[Row]) -> tuple[list[str], list[list[str]]]:
    header = ["workload", "metric", "unit", *CONTENDERS, *(f"vs {c}" for c in COMPARISONS), "targets"]
    body = []
    for row in rows:
        targets = ", ".join(f"{v.label(row.metric)} {v.word}" for v in row.verdicts)
        body.append(
            [
                row.workload.title,
                row.metric.key,
                _display_unit(row.metric.unit),
                *(_cell_text(results, row, c).replace(" ms", "") for c in CONTENDERS),
                *(format_ratio(row.ratios[c]) for c in COMPARISONS),
                targets,
            ]
        )
    return header, body


def _failures(results: Results) -> list[str]:
    lines = []
    for workload in results.workloads:
        for contender, cell in results.cells[workload.name].items():
            for error in dict.fromkeys(cell.errors):
                lines.append(f"{workload.name} / {contender}: {error.splitlines()[0]}")
            if cell.killed_pids:
                lines.append(f"{workload.name} / {contender}: left {len(cell.killed_pids)} process(es) running; killed")
    return lines


def _notes(results: Results) -> list[str]:
    lines = []
    for workload in results.workloads:
        for contender, cell in results.cells[workload.name].items():
            if cell.note:
                lines.append(f"{workload.name} / {contender}: {cell.note}")
    return lines


def _verdict_counts(rows: list[Row]) -> dict[str, int]:
    counts = {"PASS": 0, "MISS": 0, "NO DATA": 0}
    for row in rows:
        for verdict in row.verdicts:
            counts[verdict.word] += 1
    return counts


def _headline(results: Results) -> str:
    s, env = results.settings, results.environment
    memcpy = results.memcpy_median()
    memcpy_text = f"{memcpy:.2f} GB/s" if memcpy else "—"
    loads = results.load_averages
    load_text = f"; load average {min(loads):.1f}–{max(loads):.1f}" if loads else ""
    return (
        f"{s.num_workers} workers, {s.context}, {'quick, ' if s.quick else ''}median of "
        f"{s.repetitions} repetition(s); {env['cpu_model']}, {env['usable_cores']} usable cores"
        f"{load_text}; single-core memcpy {memcpy_text}"
        + (f"; mprs_plus transport {env['transport']}" if env.get("transport") else "")
    )


def table(results: Results, rows: list[Row]) -> str:
    header, body = _grid(results, rows)
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    numeric = set(range(3, len(header) - 1))

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    out = [_headline(results), "", line(header), line(["-" * w for w in widths])]
    out += [line(r) for r in body]
    counts = _verdict_counts(rows)
    out += ["", f"targets: {counts['PASS']} PASS, {counts['MISS']} MISS, {counts['NO DATA']} without data"]
    out += [f"  note  {n}" for n in _notes(results)]
    out += [f"  error {f}" for f in _failures(results)]
    return "\n".join(out)


def markdown(results: Results, rows: list[Row]) -> str:
    header, body = _grid(results, rows)
    out = [f"_{_headline(results)}_", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(cells) + " |" for cells in body]
    return "\n".join(out) + "\n"


# -- JSON ------------------------------------------------------------------------------------


def to_json(results: Results, rows: list[Row]) -> dict[str, Any]:
    workloads: dict[str, Any] = {}
    for workload in results.workloads:
        workloads[workload.name] = {
            "title": workload.title,
            "description": workload.description,
            "metrics": [{"key": m.key, "unit": m.unit, "higher_is_better": m.higher_is_better} for m in workload.metrics],
            "contenders": {
                contender: {
                    "status": cell.status,
                    "note": cell.note,
                    "median": {m.key: cell.median(m.key) for m in workload.metrics},
                    "samples": cell.samples,
                    "details": cell.details,
                    "errors": cell.errors,
                    "killed_pids": cell.killed_pids,
                }
                for contender, cell in results.cells[workload.name].items()
            },
            "ratios": {},
            "targets": [],
        }
    for row in rows:
        entry = workloads[row.workload.name]
        entry["ratios"][row.metric.key] = row.ratios
        entry["targets"] += [
            {
                "metric": row.metric.key,
                "against": v.target.against,
                "threshold": v.threshold,
                "value": v.value,
                "verdict": v.word,
            }
            for v in row.verdicts
        ]
    return {
        "suite": "mprs_plus benchmarks",
        "schema": 1,
        "environment": results.environment,
        "settings": settings_dict(results.settings),
        "wall_s": results.wall_s,
        "memcpy": {"samples_gbps": results.memcpy_gbps, "median_gbps": results.memcpy_median()},
        "load_averages": results.load_averages,
        "contenders": list(CONTENDERS),
        "workloads": workloads,
        "summary": _verdict_counts(rows),
    }


# -- plot ------------------------------------------------------------------------------------


def plot(results: Results, rows: list[Row], path: Path) -> None:
    """The ratios as horizontal bars, one group per workload and metric, drawn 8 inches
    (1,040 px) wide whatever the number of rows, so that a docs page shows it near its
    drawn size and its labels stay readable; more rows make it taller, not wider."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    shown = [r for r in rows if any(r.ratios[c] for c in COMPARISONS)]
    height = 0.8 / len(COMPARISONS)
    fig, ax = plt.subplots(figsize=(8.0, 0.55 * len(shown) + 1.6))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for j, against in enumerate(COMPARISONS):
        offset = (j - (len(COMPARISONS) - 1) / 2) * height
        for i, row in enumerate(shown):
            value = row.ratios[against]
            if not value:
                continue
            y = i + offset
            ax.barh(y, value, height, color=colors[j % len(colors)])
            ax.annotate(f"{value:.3g}", (value, y), ha="left", va="center", fontsize=6,
                        xytext=(2, 0), textcoords="offset points")
            for verdict in row.verdicts:
                if verdict.target.against == against:
                    ax.plot([verdict.threshold] * 2, [y - height / 2, y + height / 2], color="black", linewidth=2)
    ax.set_xscale("log")
    ax.axvline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_yticks(range(len(shown)))
    ax.set_yticklabels([f"{r.workload.title}\n{r.metric.key.replace('_', ' ')}" for r in shown], fontsize=8)
    ax.invert_yaxis()  # the table's order, top to bottom
    ax.set_xlabel("mprs_plus ÷ other (right of 1: mprs_plus better)")
    ax.set_title(f"mprs_plus benchmarks: {_headline(results)}", fontsize=7, wrap=True)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[j % len(colors)]) for j in range(len(COMPARISONS))]
    handles.append(Line2D([], [], color="black", linewidth=2))
    labels = [f"vs {c}" for c in COMPARISONS] + ["target"]
    ax.legend(handles, labels, fontsize=7, loc="lower center", bbox_to_anchor=(0.5, 1.0 + 0.6 / fig.get_figheight()),
              ncol=len(labels), frameon=False)
    ax.margins(x=0.15)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def write(results: Results, rows: list[Row], out_dir: Path, stem: str) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"{stem}.json", "markdown": out_dir / f"{stem}.md", "plot": out_dir / f"{stem}.png"}
    paths["json"].write_text(json.dumps(to_json(results, rows), indent=2, default=str) + "\n")
    paths["markdown"].write_text(markdown(results, rows))
    try:
        plot(results, rows, paths.pop("plot"))
    except ImportError as exc:  # the figures are in the JSON already; the plot is extra
        print(f"no plot: {exc}; 'pip install matplotlib' (or the 'bench' extra) brings it", file=sys.stderr)
    else:
        paths["plot"] = out_dir / f"{stem}.png"
    return paths


# -- workers sweep ---------------------------------------------------------------------------


def _sweep_series(runs: list[Results]) -> list[tuple[Workload, Metric, dict[str, list[float | None]]]]:
    """Per workload and metric, each contender's medians in the order of the runs."""
    series = []
    for workload in runs[0].workloads:
        for metric in workload.metrics:
            by_contender = {
                c: [run.cells[workload.name][c].median(metric.key) for run in runs] for c in CONTENDERS
            }
            if any(v is not None for values in by_contender.values() for v in values):
                series.append((workload, metric, by_contender))
    return series


def sweep_table(runs: list[Results]) -> str:
    """Every metric against the worker count, one line per workload, metric and contender."""
    counts = [run.settings.num_workers for run in runs]
    header = ["workload", "metric", "contender", *(f"{n} workers" for n in counts)]
    body = []
    for workload, metric, by_contender in _sweep_series(runs):
        for contender, values in by_contender.items():
            if any(v is not None for v in values):
                unit = _display_unit(metric.unit)
                cells = [format_value(v, metric.unit).replace(" ms", "") for v in values]
                body.append([workload.title, f"{metric.key} ({unit})", contender, *cells])
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i >= 3 else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([f"workers sweep: {runs[0].settings.context}", line(header), line(["-" * w for w in widths])] + [line(r) for r in body])


def sweep_plot(runs: list[Results], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = _sweep_series(runs)
    counts = [run.settings.num_workers for run in runs]
    # Two panels a row, 8 inches (880 px) wide in all: a docs page shows it near its drawn
    # size, so its labels stay readable; more series make it taller, not wider.
    columns = min(2, len(series))
    rows = -(-len(series) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.0 * columns, 3.0 * rows), squeeze=False)
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    # One colour per contender in every panel, whichever contenders a panel has.
    color = {c: palette[i % len(palette)] for i, c in enumerate(CONTENDERS)}
    for ax, (workload, metric, by_contender) in zip(axes.flat, series):
        scale = 1e3 if metric.unit == "s" else 1.0  # times are shown in ms
        for contender, values in by_contender.items():
            points = [(n, v * scale) for n, v in zip(counts, values) if v is not None]
            if points:
                ax.plot(*zip(*points), marker="o", label=contender, color=color.get(contender))
        # Contenders differ by orders of magnitude (in-process against transports, a
        # shutdown that waits out a join against one that does not): log scales.
        ax.set_yscale("log")
        ax.set_title(f"{workload.title}: {metric.key.replace('_', ' ')}", fontsize=8)
        ax.set_xlabel("workers", fontsize=7)
        ax.set_ylabel(_display_unit(metric.unit), fontsize=7)
        ax.set_xticks(counts)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(series):]:
        ax.set_visible(False)
    fig.suptitle(f"mprs_plus workers sweep ({runs[0].settings.context}, {runs[0].environment['usable_cores']} usable cores)", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.3 / fig.get_figheight()))  # room for the title above the panels
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_sweep(runs: list[Results], out_dir: Path, stem: str) -> dict[str, Path]:
    """The sweep as JSON (medians per worker count, each run's own file holds the rest) and a plot."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"{stem}.json"}
    data = {
        "suite": "mprs_plus benchmarks: workers sweep",
        "environment": runs[0].environment,
        "workers": [run.settings.num_workers for run in runs],
        "series": [
            {"workload": w.name, "metric": m.key, "unit": m.unit, "medians": values}
            for w, m, values in _sweep_series(runs)
        ],
    }
    paths["json"].write_text(json.dumps(data, indent=2, default=str) + "\n")
    try:
        sweep_plot(runs, out_dir / f"{stem}.png")
    except ImportError as exc:
        print(f"no plot: {exc}; 'pip install matplotlib' (or the 'bench' extra) brings it", file=sys.stderr)
    else:
        paths["plot"] = out_dir / f"{stem}.png"
    return paths
