"""Tables (markdown + CSV), plots and progress lines for ``experiments.run``."""

from __future__ import annotations

import csv
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from typing import List, Sequence


def machine() -> str:
    """One line naming the machine, TensorFlow version and date."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    return (f"{os.cpu_count()} CPU cores, {platform.machine()}, Python {platform.python_version()}, "
            f"TensorFlow {tf.__version__}, {time.strftime('%Y-%m-%d')}")


def progress(experiment: str, message: str) -> None:
    """A progress line, flushed at once (long sweeps print one per step)."""
    print(f"[{experiment}] {message}", flush=True)


def fmt(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


@dataclass
class Table:
    """Rows under a header, written as ``name.md`` and ``name.csv``."""

    name: str
    title: str
    columns: Sequence[str]
    rows: List[list] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    def add(self, *values) -> None:
        if len(values) != len(self.columns):
            raise ValueError(f"{self.name}: {len(values)} values for {len(self.columns)} columns")
        self.rows.append(list(values))

    def markdown(self) -> str:
        lines = [f"### {self.title}", "", f"Machine: {machine()}", ""]
        lines.append("| " + " | ".join(self.columns) + " |")
        lines.append("|" + "---|" * len(self.columns))
        for row in self.rows:
            lines.append("| " + " | ".join(fmt(v) for v in row) + " |")
        if self.notes:
            lines.append("")
            lines.extend(self.notes)
        return "\n".join(lines) + "\n"

    def write_markdown(self, out_dir: str) -> str:
        """Write ``<name>.md`` into ``out_dir`` (created if missing); returns its path."""
        os.makedirs(out_dir, exist_ok=True)
        md = os.path.join(out_dir, f"{self.name}.md")
        with open(md, "w") as f:
            f.write(self.markdown())
        return md

    def write(self, out_dir: str) -> List[str]:
        md = self.write_markdown(out_dir)
        path = os.path.join(out_dir, f"{self.name}.csv")
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(self.columns)
            for row in self.rows:
                writer.writerow(["" if v is None else v for v in row])
        print(self.markdown(), file=sys.stdout, flush=True)
        return [md, path]


def plot_lines(path: str, title: str, xlabel: str, ylabel: str, series: dict) -> str:
    """``series``: label -> (xs, ys).  Saves a PNG and returns its path."""
    import matplotlib  # pylint: disable=import-outside-toplevel

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_bars(path: str, title: str, ylabel: str, groups: List[str], series: dict) -> str:
    """Grouped bars: ``series`` label -> one value per group (None = 0)."""
    import matplotlib  # pylint: disable=import-outside-toplevel

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    width = 0.8 / max(len(series), 1)
    for k, (label, values) in enumerate(series.items()):
        xs = np.arange(len(groups)) + k * width
        ax.bar(xs, [v or 0 for v in values], width, label=label)
    ax.set_xticks(np.arange(len(groups)) + 0.4 - width / 2)
    ax.set_xticklabels(groups)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
