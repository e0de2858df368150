"""Presenting a study's results: tables, plots, the files of a results folder and the report (the tuned picks they
show are :mod:`asgd_jax.studies.picks`')."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import pathlib
import shutil
import textwrap
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from asgd_jax import checkpoint as checkpoint_lib
from asgd_jax import errors, provenance
from asgd_jax import metrics as metrics_lib
from asgd_jax.studies.language import METRICS, Study
from asgd_jax.studies.picks import best_tuned, cell_of, grid_edges, time_budgets, within_budgets
from asgd_jax.studies.runner import ARMS, RESULTS, StudyResult, as_json

# --------------------------------------------------------------------------------------------------------------------
# Tables, plots, files.
# --------------------------------------------------------------------------------------------------------------------


def _ordered(values) -> list:
    values = list(dict.fromkeys(values))
    return sorted(values) if all(isinstance(v, int | float) for v in values) else values


def _metric_value(metric: str, r: dict[str, Any]) -> float:
    if metric == "test_error":
        return 100 * r["test_error"]
    if metric == "perplexity":  # (a diverged run's is NaN or inf: its cell shows "—")
        value = r.get("test_perplexity", math.nan)
        return value if math.isfinite(value) else math.nan
    return r["time_to_target"]


def _describe(study: Study, metric: str) -> str:
    """What a table or plot calls ``metric`` (:data:`METRICS`), in the words of the study's :attr:`Study.measure`."""
    return METRICS[metric].replace("training error", _measure(study))


def _measure(study: Study) -> str:
    """The name of a run's training measure: the study's own, or the classification training error."""
    return study.measure or "training error"


def _cell_values(study: Study, runs: list[dict[str, Any]], metric: str | None = None) -> dict[tuple, tuple]:
    """``{(facet, row, column): (mean, std)}`` of ``metric`` (default: the study's) over the seeds."""
    metric = metric or study.table.metric
    groups: dict[tuple, list[float]] = {}
    for r in runs:
        groups.setdefault(cell_of(study, r), []).append(_metric_value(metric, r))
    cells = {k: tuple(float(x) for x in metrics_lib.mean_std(np.asarray(v))) for k, v in groups.items()}
    if metric == "speedup":
        base_runs = [r for r in runs if all(r.get(k) == v for k, v in (study.table.baseline or {}).items())]
        base = float(np.mean([r["time_to_target"] for r in base_runs])) if base_runs else math.nan
        cells = {k: (base / mean if mean > 0 else math.nan, 0.0) for k, (mean, _) in cells.items()}
    return cells


def _layout(study: Study, cells) -> tuple[list, list, list]:
    """The facet values, rows and columns of a study's tables, in order."""
    facets = _ordered(f for f, _, _ in cells)
    rows = _ordered(r for _, r, _ in cells)
    cols = list(dict.fromkeys(c for _, _, c in cells))
    order = study.table.column_order
    if order:
        cols = sorted(cols, key=lambda c: order.index(c) if c in order else len(cols))
    return facets, rows, cols


def _grid(study: Study, cells: dict[tuple, Any], text: Callable[[Any], str]) -> list[str]:
    """Markdown table(s), one per facet value, of ``text(cell)``."""
    facets, rows, cols = _layout(study, cells)
    lines: list[str] = []
    for facet in facets:
        if study.table.facet:
            lines += ["", f"{study.table.facet} = {facet}", ""]
        lines.append(f"| {study.table.rows} | " + " | ".join(map(str, cols)) + " |")
        lines.append("|---" * (len(cols) + 1) + "|")
        for row in rows:
            if any((facet, row, col) in cells for col in cols):
                lines.append(f"| {row} | " + " | ".join(text(cells.get((facet, row, col))) for col in cols) + " |")
    return lines


def format_table(study: Study, runs: list[dict[str, Any]], num_seeds: int) -> str:
    """The study's Markdown table(s) (mean ± std over seeds): one per facet value and metric, the tuned picks, and the
    paper's numbers beside ours when given."""
    budgets = time_budgets(study, runs)
    runs = within_budgets(study, runs)
    kept, picks = best_tuned(study, runs)
    lines: list[str] = []
    for metric in (study.table.metric, *study.table.also):
        cells = _cell_values(study, kept, metric)
        what = _describe(study, metric)
        if metric == "speedup":
            what += f" (baseline {', '.join(f'{k}={v}' for k, v in (study.table.baseline or {}).items())})"
        over = "ratio of mean times" if metric == "speedup" else "mean ± std"
        by = _measure(study) if study.tuning.by == "train_error" else "time to target"
        tuned = f"; each cell the best of its {', '.join(study.tuning.over)} grid by {by}" if study.tuning.over else ""

        def text(cell, metric=metric):
            if cell is None or math.isnan(cell[0]):
                return "—"
            if metric == "speedup":
                return f"{cell[0]:.2f}x"
            if abs(cell[0]) >= 1e5:  # (a perplexity that blew up but stayed finite: its digits say nothing)
                return f"{cell[0]:.1e} ± {cell[1]:.1e}"
            return f"{cell[0]:.2f} ± {cell[1]:.2f}"

        lines += ([""] if lines else []) + [f"{what}, {over} over {num_seeds} seed(s){tuned}"]
        lines += ([] if study.table.facet else [""]) + _grid(study, cells, text)
        if metric == "perplexity" and any(math.isnan(m) for m, _ in cells.values()):
            lines += ["", "—: the run diverged (in at least one seed)."]
        elif metric != "test_error" and any(math.isnan(m) for m, _ in cells.values()):
            lines += ["", "—: the target was not reached within the budget (in at least one seed)."]
        if metric in ("time_to_target", "speedup") and budgets:
            lines += ["", "The budget of each column (virtual time, the same for every rule there: when its earliest"]
            lines += ["run ended its epochs)"]
            per_column = {(facet, "budget", column): t for (facet, column), t in budgets.items()}
            lines += ([] if study.table.facet else [""]) + _grid(study, per_column, lambda t: f"{t:.1f}" if t else "")
    if picks:
        edges = grid_edges(study, runs, picks)
        by = _measure(study) if study.tuning.by == "train_error" else "time to target"
        lines += ["", f"The tuned settings picked (lowest {by} over {', '.join(study.tuning.over)})"]
        marked = {
            cell: ", ".join(f"{k} {v:g}{'*' if k in edges[cell] else ''}" for k, v in p.items())
            for cell, p in picks.items()
        }
        lines += ([] if study.table.facet else [""]) + _grid(study, marked, str)
        if any(edges.values()):
            lines += ["", "*: the edge of its grid (of 3 or more values): a wider grid may do better."]
    diverged = sum(not math.isfinite(r.get("train_error", 0.0)) for r in runs)
    if diverged:
        lines += [
            "",
            f"{diverged:,} of {len(runs):,} runs diverged (their {_measure(study)} turned NaN or Inf)",
        ]
        lines[-1] += ": a tuned cell counts such a setting as its worst." if study.tuning.over else "."
    if study.paper.numbers:
        pcols = list(dict.fromkeys(c for v in study.paper.numbers.values() for c in v))
        lines += [
            "",
            f"Paper{': ' + study.paper.note if study.paper.note else ''}",
            "",
            f"| {study.table.rows} | " + " | ".join(pcols) + " |",
            "|---" * (len(pcols) + 1) + "|",
        ]
        for row, values in study.paper.numbers.items():
            lines.append(f"| {row} | " + " | ".join(f"{values[c]:.2f}" if c in values else "" for c in pcols) + " |")
    return "\n".join(lines)


def _final_axes(
    ax, study: Study, cells: dict[tuple, tuple], facet, rows: list, cols: list, labels: bool, log: bool = False
) -> bool:
    """One panel of the final metric: lines against numeric rows, grouped bars over named ones (rules), an x where a
    bar has no value (the target not reached, or diverged); ``log``: a logarithmic axis from 1 (a perplexity, whose
    worst runs are orders of magnitude above the best). Returns whether it drew an x."""
    numeric = all(isinstance(r, int | float) for r in rows)
    width, missing = 0.8 / max(len(cols), 1), False
    for j, col in enumerate(cols):
        pts = [(r, *cells[(facet, r, col)]) for r in rows if (facet, r, col) in cells]
        if numeric:
            x = [p[0] for p in pts]
            ax.errorbar(x, [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o", capsize=3, label=str(col))
        else:
            x = [rows.index(p[0]) + (j - (len(cols) - 1) / 2) * width for p in pts]
            bars = ax.bar(
                x,
                [p[1] for p in pts],
                width,
                yerr=[p[2] for p in pts],
                capsize=2,
                label=str(col) if study.table.columns == "label" else f"{study.table.columns} {col}",
            )
            none = [xi for xi, p in zip(x, pts, strict=True) if not math.isfinite(p[1])]
            if none:  # (an empty line drawn unclipped would stretch the panel's layout box to the figure's origin)
                ax.plot(
                    none,
                    [1.0 if log else 0.0] * len(none),
                    "x",
                    color=bars.patches[0].get_facecolor(),
                    ms=6,
                    mew=1.5,
                    clip_on=False,
                )
                missing = True
    if numeric and len(rows) > 2 and min(rows) > 0 and max(rows) / min(rows) >= 8:
        ax.set_xscale("log", base=2)
    if log:
        ax.set_yscale("log")
        ax.set_ylim(bottom=1.0)
    if not numeric:
        ax.set_xticks(range(len(rows)), [str(r) for r in rows] if labels else [], rotation=35, ha="right", fontsize=8)
    else:
        ax.set_xlabel(study.table.rows)
    ax.grid(alpha=0.3, axis="y" if not numeric else "both")
    return missing


def _reference_line(ax, cells: dict[tuple, tuple], facet, rows: list, label: str, curve: Mapping) -> None:
    """A theory's curve, known up to a constant: scaled by the median ratio of the best measured value at each row to
    it, drawn dashed."""
    best = {
        r: min(
            (v[0] for (f, row, _), v in cells.items() if f == facet and row == r and np.isfinite(v[0])),
            default=math.nan,
        )
        for r in rows
    }
    ratios = [best[r] / curve[r] for r in rows if r in curve and np.isfinite(best[r]) and curve[r] > 0]
    if not ratios:
        return
    scale = float(np.median(ratios))
    xs = [r for r in rows if r in curve]
    ax.plot(xs, [scale * curve[r] for r in xs], "k--", lw=1.2, label=f"{label} (scaled)")


def _final_figure(study: Study, cells: dict[tuple, tuple], metric: str, reference=None):
    """The figure of one metric: line panels side by side over numeric rows; bar panels (a group per rule) stacked,
    so that a README page shows them at a readable size."""
    import matplotlib.pyplot as plt

    facets, rows, cols = _layout(study, cells)
    numeric = all(isinstance(r, int | float) for r in rows)
    width = max(4.5, (1.0 if numeric else 0.5 + 0.12 * len(cols)) * len(rows))
    shape, size = ((1, len(facets)), (width * len(facets) ** 0.8, 4.2))
    if not numeric:
        shape, size = ((len(facets), 1), (width, max(4.2, 1.2 + 2.6 * len(facets))))
    fig, axes = plt.subplots(*shape, figsize=size, squeeze=False, sharey=True, layout="constrained")
    axes, missing = list(axes.flat), False
    for ax, facet in zip(axes, facets, strict=True):
        log = metric == "perplexity"
        missing |= _final_axes(ax, study, cells, facet, rows, cols, labels=numeric or ax is axes[-1], log=log)
        if reference is not None and numeric and metric == study.table.metric:
            _reference_line(ax, cells, facet, rows, *reference)
        if study.table.facet:
            ax.set_title(f"{study.table.facet} = {facet}", fontsize=9)
    axes[0 if numeric else len(axes) // 2].set_ylabel("speed-up" if metric == "speedup" else _describe(study, metric))
    axes[-1 if numeric else 0].legend(fontsize=7, ncol=len(cols) if len(axes) > 1 and not numeric else 1)
    tuned = f" (best of each {'/'.join(study.tuning.over)} grid)" if study.tuning.over else ""
    budgeted = study.table.equal_time and metric in ("time_to_target", "speedup")
    within = " within its column's time budget" if budgeted else ""
    note = f"x: no value (the target not reached{within} in some seed, or diverged)" if missing else ""
    title = study.title if metric == study.table.metric else f"{study.title.split(':')[0]}: {_describe(study, metric)}"
    chars = min(64 if numeric and len(facets) == 1 else 110, int(11 * size[0]))  # (about 11 characters an inch)
    fig.suptitle("\n".join(textwrap.fill(t, chars) for t in (f"{title}{tuned}", note) if t), fontsize=10)
    return fig


def plot(result: StudyResult, folder: str | os.PathLike) -> list[str]:
    """``final.png`` (the table's metric against its rows, one line or bar group per column, one panel per facet
    value), ``final_<metric>.png`` for :attr:`Table.also`, and ``curves_<x>.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    study, paths = result.study, []
    runs, _ = best_tuned(study, within_budgets(study, result.runs))
    for metric in (study.table.metric, *study.table.also):
        cells = _cell_values(study, runs, metric)
        rows = _ordered(r for _, r, _ in cells)
        reference = None if study.paper.prediction is None else study.paper.prediction(result.settings, rows)
        fig = _final_figure(study, cells, metric, reference)
        paths.append(os.path.join(folder, "final.png" if metric == study.table.metric else f"final_{metric}.png"))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    for x in study.table.curves_x:
        fig = curves_figure(result, x)
        paths.append(os.path.join(folder, f"curves_{x}.png"))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


PANELS_OVER = 10
"""A curve plot of more curves than this draws one panel per row value (and facet value), not one crowded axes."""


def _drawn_curves(study: Study, curves: Mapping[str, dict], picks: dict[tuple, dict[str, Any]]) -> dict[str, dict]:
    """The curves a plot draws: each cell's tuned pick only, in a tuned study (not every setting of its grid, nor the
    diverged ones); every curve otherwise."""
    if not study.tuning.over:
        return dict(curves)

    def picked(c: dict) -> bool:
        pick = picks.get(cell_of(study, c["coords"]))
        return pick is not None and all(c["coords"].get(k) == v for k, v in pick.items())

    return {name: c for name, c in curves.items() if picked(c)}


def curves_figure(result: StudyResult, x: str = "epoch"):
    """The training curves of a study's result against ``x`` (``"epoch"``, ``"update"`` or ``"time"``), as a matplotlib
    figure (what :func:`plot` writes as ``curves_<x>.png``): each cell's tuned pick in a tuned study, every curve
    otherwise; one axes, or one panel per (facet, row) value when there are more than :data:`PANELS_OVER` curves, a
    colour per column value. The training error in %; a study's own :attr:`Study.measure` as it is, on a log axis. A
    diverged stretch (NaN or Inf) is left out, not drawn to the sky."""
    import matplotlib.pyplot as plt

    errors.choice("x", x, ("epoch", "update", "time"))
    study, window = result.study, result.settings.window
    curves = _drawn_curves(study, result.curves, best_tuned(study, within_budgets(study, result.runs))[1])

    cells = {name: cell_of(study, c["coords"]) for name, c in curves.items()}
    present = {cell[:2] for cell in cells.values()}
    facets, rows = _ordered(f for f, _, _ in cells.values()), _ordered(r for _, r, _ in cells.values())
    panels = [(f, r) for f in facets for r in rows if (f, r) in present]
    split = len(curves) > PANELS_OVER and len(panels) > 1
    if not split:
        panels = [None]
    ncols = min(4, len(panels))
    nrows = -(-len(panels) // ncols)
    size = (6.5, 4.0) if not split else (3.4 * ncols, 2.8 * nrows + 0.9)
    fig, axes = plt.subplots(nrows, ncols, figsize=size, squeeze=False, sharex=True, sharey=True, layout="constrained")
    columns = list(dict.fromkeys(cell[2] for cell in cells.values()))
    palette = plt.cm.tab10.colors if len(columns) <= 10 else plt.cm.tab20.colors
    colors = {col: palette[i % len(palette)] for i, col in enumerate(columns)}
    percent = study.measure is None
    for ax, panel in zip(axes.flat, panels, strict=False):
        mine = [n for n in curves if panel is None or cells[n][:2] == panel]
        by_column = [cells[n][2] for n in mine]
        for name in mine:
            y = np.asarray(curves[name]["train_error"], np.float64) * (100.0 if percent else 1.0)
            y[~np.isfinite(y)] = np.nan
            col = cells[name][2]
            label = str(col) if split and by_column.count(col) == 1 else name
            ax.plot(curves[name][x], y, label=label, lw=1, color=colors[col] if split else None)
        if split and len(set(by_column)) < len(by_column):  # several curves of one column here: named here
            ax.legend(fontsize=6)
        if panel is not None:
            facet, row = panel
            t = study.table
            ax.set_title(f"{t.facet} = {facet}, " * bool(t.facet) + f"{t.rows} = {row}", fontsize=8)
        ax.grid(alpha=0.3)
        if not percent:
            ax.set_yscale("log")
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    what = "training error (%)" if percent else study.measure
    what += f", smoothed over {window} minibatches" if window > 1 else ""
    label_x = {"epoch": "effective epochs", "update": "server updates", "time": "virtual wall-clock time"}[x]
    for ax in axes.flat[: len(panels)]:
        ax.set_xlabel(label_x, fontsize=8 if split else None)
    if split:
        fig.supylabel(what, fontsize=9)
        handles = {h.get_label(): h for ax in axes.flat for h in ax.get_lines() if h.get_label() in map(str, columns)}
        fig.legend(handles.values(), handles.keys(), loc="outside lower center", ncol=min(5, len(handles)), fontsize=7)
    else:
        axes[0][0].set_ylabel(what, fontsize=9)
        axes[0][0].legend(fontsize=6 if len(curves) > 6 else 8)
    tuned = f" (each cell's pick of its {'/'.join(study.tuning.over)} grid)" if study.tuning.over else ""
    fig.suptitle(textwrap.fill(f"{study.title}{tuned}", 64 if not split else 110), fontsize=10)
    return fig


def plot_panels(result: StudyResult, path: str | os.PathLike) -> str:
    """One panel per row value (e.g. per worker count M): smoothed training error (thin) and test error (markers) of
    every series against effective epochs, mean over seeds; what ``asgd-jax ablate`` writes as ``curves.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    study = result.study
    rows = _ordered(c["coords"].get(study.table.rows) for c in result.curves.values())
    fig, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 4), squeeze=False, sharey=True)
    labels = list(dict.fromkeys(c["coords"]["label"] for c in result.curves.values()))
    colors = {label: f"C{i}" for i, label in enumerate(labels)}
    for ax, row in zip(axes[0], rows, strict=True):
        for c in result.curves.values():
            if c["coords"].get(study.table.rows) != row:
                continue
            label = c["coords"]["label"]
            ax.plot(c["epoch"], 100 * np.asarray(c["train_error"]), color=colors[label], lw=0.8, alpha=0.6)
            ax.plot(c["eval_epoch"], 100 * np.asarray(c["test_error"]), "o-", color=colors[label], ms=3, label=label)
        ax.set_title(f"{study.table.rows} = {row}")
        ax.set_xlabel("effective epochs")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("error %")
    fig.text(
        0.5,
        0.01,
        f"markers: test error; thin lines: training error smoothed over {result.settings.window} "
        "minibatches; mean over seeds",
        ha="center",
        fontsize=8,
    )
    tops = [100 * np.asarray(c["test_error"])[len(c["test_error"]) // 4 :].max() for c in result.curves.values()]
    axes[0][0].set_ylim(0, min(100, 1.5 * max(tops) + 1))
    fig.suptitle(f"{study.title}: {result.settings.dataset} / {result.settings.model}")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return os.fspath(path)


def save(
    result: StudyResult,
    folder: str | os.PathLike,
    *,
    plots: tuple[str, ...] = ("final", "curves"),
    tensorboard: bool = False,
) -> dict[str, str]:
    """Writes ``results.json``, ``results.csv``, ``table.md`` and the plots into ``folder``: ``"final"`` and
    ``"curves"`` (:func:`plot`: ``final.png``, ``curves_<x>.png``), ``"panels"`` (:func:`plot_panels`:
    ``curves.png``); with ``tensorboard``, every curve as TensorBoard event files in ``folder/tensorboard/<series>``
    (training error by update, test error at its evaluations; :mod:`asgd_jax.writers`). It replaces what ``folder``
    holds (:func:`run` with ``out`` refuses, before its work, a folder holding results it did not make). A write
    that fails (a full disk) raises :class:`~asgd_jax.errors.RunStopped`; a study's finished arms in ``folder``
    (``run(out=folder)``) are cleared only once everything is written, so that a resume writes the results again."""
    folder = os.fspath(folder)
    try:
        paths = _write_results(result, folder, plots, tensorboard)
    except OSError as e:
        arms = os.path.join(folder, ARMS)
        then = (
            f"the study's finished arms are kept in {arms}: free some space, then run the same study again with "
            "resume=True (--resume) to write its results"
            if os.path.isfile(os.path.join(arms, "study.json"))
            else "free some space and save the results again"
        )
        raise errors.RunStopped(
            f"{errors.write_failure(e)}: the results could not be written into {folder}; {then}"
        ) from e
    shutil.rmtree(os.path.join(folder, ARMS), ignore_errors=True)  # finished: nothing left to resume
    return paths


def _write_results(result: StudyResult, folder: str, plots: tuple[str, ...], tensorboard: bool) -> dict[str, str]:
    os.makedirs(folder, exist_ok=True)
    study, s = result.study, result.settings
    table = format_table(study, result.runs, len(s.seeds))
    payload = {
        "study": study.name,
        "title": study.title,
        "reproduces": study.reproduces,
        "quick": result.quick,
        "settings": dataclasses.asdict(s),
        "seconds": result.seconds,
        "runs": result.runs,
        "curves": result.curves,
        "table": table,
        "environment": provenance.environment(),  # what produced it (asgd_jax's version and commit, JAX, devices)
    }
    paths = {
        "json": os.path.join(folder, RESULTS),
        "csv": os.path.join(folder, "results.csv"),
        "table": os.path.join(folder, "table.md"),
    }
    # Atomically (a full disk leaves the results.json before whole), as a resume compares it (runner.check_replace).
    checkpoint_lib.write_json(paths["json"], as_json(payload))
    keys = list(dict.fromkeys(k for r in result.runs for k in r))
    with open(paths["csv"], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(result.runs)
    with open(paths["table"], "w") as f:
        f.write(f"# {study.title}\n\n{table}\n")
    if "final" in plots or "curves" in plots:
        for p in plot(result, folder):
            paths[os.path.basename(p)] = p
    if "panels" in plots:
        paths["plot"] = plot_panels(result, os.path.join(folder, "curves.png"))
    if tensorboard:
        paths["tensorboard"] = _write_tensorboard(result.curves, os.path.join(folder, "tensorboard"))
    return paths


def _write_tensorboard(curves: dict[str, dict[str, Any]], folder: str) -> str:
    """Each series' mean curves as event files of its own (one line per series in TensorBoard)."""
    from asgd_jax import writers

    for name, curve in curves.items():
        board = writers.TensorBoard(os.path.join(folder, writers.folder_name(name)))
        try:
            for update, error in zip(curve["update"], curve["train_error"], strict=True):
                board({"kind": "train", "update": update, "error": error})
            at = np.searchsorted(np.asarray(curve["epoch"]), np.asarray(curve["eval_epoch"]) - 1e-9) + 1
            for update, error in zip(at.tolist(), curve["test_error"], strict=True):
                board({"kind": "eval", "update": update, "error": error})
        finally:
            board.close()
    return folder


REPORT_TITLE = "# asgd_jax reproduction report"


def report(
    folder: str | os.PathLike, out: str | os.PathLike | None = None, *, header: str = "", overwrite: bool = False
) -> str:
    """Turns a results folder (one study, or subfolders of several) into ``report.md`` with tables and plots. It
    replaces a report of its own at ``out``; any other file there (a study's results, a Markdown file of yours) is
    refused unless ``overwrite``, and a results file it reads always is."""
    folder = pathlib.Path(folder)
    found = sorted(folder.rglob(RESULTS))
    if not found:
        raise errors.ConfigError(
            f"no results.json under {folder}: run `asgd-jax run <study> --out {folder}/<study>` first."
        )
    parts = [REPORT_TITLE, ""] + ([header, ""] if header else [])
    out = pathlib.Path(out) if out is not None else folder / "report.md"
    _check_report_path(out, found, overwrite)
    for path in found:
        payload = _read_results(path)
        s = payload["settings"]
        form = "quick" if payload["quick"] else "full"
        parts += [
            f"## {payload['title']} (`{payload['study']}`, {form} form)",
            "",
            payload["reproduces"].strip(),
            "",
            f"{s['dataset']} / {s['model']}, {len(s['seeds'])} seed(s), {s['epochs']:g} effective epochs, "
            f"batch {s['batch_size']} per worker, lr {s['learning_rate']} ({s['schedule']}); "
            f"{payload['seconds']:.0f} s. Produced by {provenance.describe(payload.get('environment'))}.",
            "",
            payload["table"],
            "",
        ]
        for png in sorted(path.parent.glob("*.png")):
            parts.append(f"![{payload['study']} {png.stem}]({os.path.relpath(png, out.parent)})")
        parts.append("")
    out.write_text("\n".join(parts))
    return str(out)


def _check_report_path(out: pathlib.Path, found: list[pathlib.Path], overwrite: bool) -> None:
    """``out`` may take the report: not a folder, not one of the results it reads, and either new, a report of
    :func:`report`'s own, or ``overwrite``; its folder exists or can be made."""
    if out.is_dir():
        raise errors.ConfigError(f"out={str(out)!r} (--out) is a folder: give the report's file, e.g. {out}/report.md.")
    if out.exists() and any(out.samefile(path) for path in found):
        raise errors.ConfigError(
            f"out={str(out)!r} (--out) is a study's results that the report reads: give another --out, e.g. "
            f"{out.parent}/report.md."
        )
    if out.exists() and not overwrite:
        try:
            with open(out, "rb") as f:
                ours = f.read(len(REPORT_TITLE.encode())) == REPORT_TITLE.encode()
        except OSError:
            ours = False
        if not ours:
            raise errors.ConfigError(
                f"out={str(out)!r} (--out) exists and is not a report of asgd-jax: give another --out, or "
                "overwrite=True (--overwrite) to replace it."
            )
    errors.output_folder("out", out.parent, "--out")


# What report() reads of a results.json, and of its settings.
_RESULT_KEYS = ("settings", "quick", "title", "study", "reproduces", "seconds", "table")
_SETTINGS_KEYS = ("dataset", "model", "seeds", "epochs", "batch_size", "learning_rate", "schedule")


def _read_results(path: pathlib.Path) -> dict[str, Any]:
    """A study's ``results.json``, or a :class:`~asgd_jax.errors.ConfigError` saying what is wrong with it (cut short,
    not JSON, not a study's results)."""
    try:
        payload = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise errors.ConfigError(
            f"{path} is not a readable results file ({type(e).__name__}: {e}): run the study again into its folder."
        ) from None
    missing = [k for k in _RESULT_KEYS if not isinstance(payload, dict) or k not in payload]
    if not missing and isinstance(payload["settings"], dict):
        missing = [f"settings.{k}" for k in _SETTINGS_KEYS if k not in payload["settings"]]
    if missing or not isinstance(payload.get("settings"), dict):
        raise errors.ConfigError(
            f"{path} is not a study's results (it lacks {', '.join(missing) or 'settings'}): run the study again "
            "into its folder."
        )
    return payload
