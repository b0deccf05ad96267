"""PNG plots of benchmark figures (matplotlib, drawn off-screen)."""

from __future__ import annotations

import math

from brisk.bench.load import LoadReport


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    return plt


def plot_sweep(series: dict[str, list[LoadReport]], path: str, title: str) -> None:
    """Latency against load: per series (a server, a configuration), TTFT, TPOT and end-to-end
    p50 and p99, and output throughput, each against the request rate actually served."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = [("ttft", "TTFT (ms)"), ("tpot", "TPOT (ms)"), ("e2el", "end-to-end latency (ms)")]
    share = None  # the goodput axis, made when a series has targets
    for name, reports in series.items():
        x = [r.request_throughput for r in reports]
        for ax, (metric, label) in zip(axes.flat, panels):
            for q, style in (("p50", "-o"), ("p99", "--x")):
                y = [getattr(r.latency_ms[metric], q) if r.latency_ms[metric] else math.nan for r in reports]
                ax.plot(x, y, style, label=f"{name} {q}")
            ax.set_ylabel(label)
        axes.flat[3].plot(x, [r.output_throughput for r in reports], "-o", label=f"{name} output tok/s")
        if any(r.goodput is not None for r in reports):
            share = share or axes.flat[3].twinx()
            share.plot(x, [100 * (r.goodput or 0) / max(r.request_throughput, 1e-9) for r in reports], ":s",
                       color="gray", label=f"{name}: % of requests within targets")
    axes.flat[3].set_ylabel("output tokens/s")
    if share is not None:
        share.set_ylabel("% within the goodput targets")
        share.set_ylim(0, 105)
        share.legend(fontsize=7, loc="lower right")
    for ax in axes.flat:
        ax.set_xlabel("requests/s served")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_bars(rows: list[tuple[str, dict[str, float]]], path: str, title: str) -> None:
    """One bar chart per metric, a bar per named row (a technique-impact table, drawn)."""
    plt = _pyplot()
    metrics = list(rows[0][1]) if rows else []
    fig, axes = plt.subplots(1, max(1, len(metrics)), figsize=(4.2 * max(1, len(metrics)), 4.8), squeeze=False)
    names = [name for name, _ in rows]
    for ax, metric in zip(axes[0], metrics):
        ax.barh(names, [values[metric] for _, values in rows])
        ax.set_title(metric, fontsize=9)
        ax.tick_params(axis="y", labelsize=7)
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
