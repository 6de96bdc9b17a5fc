"""The PNG of ``titan compare --plot``: one panel per metric, one line per run.

matplotlib draws it when it is installed; otherwise pillow (a dependency of torchvision and of
most Python environments, and of this machine's) draws the same panels with its default font.
"""

from __future__ import annotations

import math
from typing import Any

from titan_core.errors import UsageError

#: Line colours (matplotlib's tab10), one per run.
COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]


def _series(result: dict[str, Any], metric: str, run: int) -> list[tuple[int, float]]:
    points = []
    for row in result["steps"]:
        value = row[metric][run]
        if isinstance(value, (int, float)) and math.isfinite(value):
            points.append((row["step"], float(value)))
    return points


def plot_curves(result: dict[str, Any], path: str) -> str:
    if not path.lower().endswith(".png"):
        raise UsageError(f"--plot {path}: expected a .png file name")
    try:
        import matplotlib
    except ImportError:
        return _plot_pillow(result, path)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = result["metrics"]
    fig, axes = plt.subplots(len(metrics), 1, figsize=(9, 3.2 * len(metrics)), squeeze=False)
    for ax, metric in zip(axes[:, 0], metrics, strict=True):
        for i, label in enumerate(result["labels"]):
            points = _series(result, metric, i)
            if points:
                ax.plot(*zip(*points, strict=True), label=label, color=COLORS[i % len(COLORS)])
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
        ax.legend()
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _plot_pillow(result: dict[str, Any], path: str) -> str:
    from PIL import Image, ImageDraw, ImageFont

    metrics = result["metrics"]
    width, panel = 900, 300
    left, right, top, bottom = 80, 20, 30, 40
    image = Image.new("RGB", (width, panel * len(metrics)), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default()
    for m, metric in enumerate(metrics):
        y0 = m * panel
        series = [_series(result, metric, i) for i in range(len(result["labels"]))]
        xs = [x for s in series for x, _ in s]
        ys = [y for s in series for _, y in s]
        box = (left, y0 + top, width - right, y0 + panel - bottom)
        draw.rectangle(box, outline="#888888")
        draw.text((left, y0 + 8), metric, fill="black", font=font)
        if not xs:
            draw.text((left + 10, y0 + top + 10), "no finite values", fill="black", font=font)
            continue
        x_lo, x_hi = min(xs), max(xs)
        y_lo, y_hi = min(ys), max(ys)
        if y_hi == y_lo:
            y_lo, y_hi = y_lo - 0.5, y_hi + 0.5
        if x_hi == x_lo:
            x_hi = x_lo + 1

        def sx(x: float, b: tuple[int, ...] = box, lo: float = x_lo, hi: float = x_hi) -> float:
            return b[0] + (b[2] - b[0]) * (x - lo) / (hi - lo)

        def sy(y: float, b: tuple[int, ...] = box, lo: float = y_lo, hi: float = y_hi) -> float:
            return b[3] - (b[3] - b[1]) * (y - lo) / (hi - lo)

        for k in range(5):
            value = y_lo + (y_hi - y_lo) * k / 4
            y = sy(value)
            draw.line((box[0], y, box[2], y), fill="#eeeeee")
            draw.text((4, y - 6), f"{value:.4g}", fill="black", font=font)
        draw.text((box[0], box[3] + 6), str(x_lo), fill="black", font=font)
        draw.text((box[2] - 30, box[3] + 6), str(x_hi), fill="black", font=font)
        draw.text(((box[0] + box[2]) // 2 - 10, box[3] + 6), "step", fill="black", font=font)
        for i, points in enumerate(series):
            color = COLORS[i % len(COLORS)]
            coords = [(sx(x), sy(y)) for x, y in points]
            if len(coords) > 1:
                draw.line(coords, fill=color, width=2)
            for cx, cy in coords:
                draw.ellipse((cx - 2, cy - 2, cx + 2, cy + 2), fill=color)
            label_y = y0 + 8 + 12 * i
            draw.line((width - 200, label_y + 6, width - 180, label_y + 6), fill=color, width=2)
            draw.text((width - 175, label_y), result["labels"][i], fill="black", font=font)
    image.save(path, "PNG")
    return path
