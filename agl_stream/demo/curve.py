"""The demo's reward curve (PNG) and summary."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from agl_stream.launch.run import StepPoint


def tenths(points: Sequence[StepPoint]) -> tuple[float, float]:
    """Mean reward of the first and of the last tenth of the steps (at least one step each)."""
    if not points:
        raise ValueError("no steps to summarise")
    n = max(1, len(points) // 10)
    first = sum(p.mean_reward for p in points[:n]) / n
    last = sum(p.mean_reward for p in points[-n:]) / n
    return first, last


def summary_rows(points: Sequence[StepPoint]) -> list[tuple[str, str]]:
    first, last = tenths(points)
    ratio = f"{last / first:.2f}x" if first > 0 else "n/a"
    return [
        ("steps", str(len(points))),
        ("samples", f"{sum(p.samples for p in points):,}"),
        ("mean reward, first tenth", f"{first:.3f}"),
        ("mean reward, last tenth", f"{last:.3f}"),
        ("last / first", ratio),
    ]


def plot_rewards(points: Sequence[StepPoint], path: Path, config: Any) -> Path:
    title = f"agl-stream demo {config.run_name}: GRPO on a tiny model, CPU"
    return plot_policies({"mean reward": points}, path, title, chance=0.2)


def plot_policies(
    curves: Mapping[str, Sequence[StepPoint]], path: Path, title: str, chance: float | None = None
) -> Path:
    """One mean-reward line per policy, by step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    figure, axes = plt.subplots(figsize=(7, 4), dpi=110)
    # Policies trained on the same rollouts share their rewards: their lines coincide, so
    # each gets a style of its own that shows through the others.
    styles = [("-", "o", 6), ("--", "x", 5), (":", "s", 3)]
    for i, (name, points) in enumerate(curves.items()):
        line, marker, size = styles[i % len(styles)]
        steps = [p.step for p in points]
        rewards = [p.mean_reward for p in points]
        axes.plot(
            steps, rewards, linestyle=line, marker=marker, markersize=size, linewidth=1.5,
            label=name, markerfacecolor="none",
        )  # fmt: skip
    if chance is not None:
        axes.axhline(chance, color="grey", linestyle=":", linewidth=1, label=f"chance ({chance})")
    axes.set_xlabel("step (policy version trained)")
    axes.set_ylabel("mean reward of the step's attempts")
    axes.set_ylim(0, 1.05)
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path


def plot_heldout(evals: Sequence[Any], points: Sequence[StepPoint], path: Path, model: str) -> Path:
    """Held-out accuracy (with its 95% interval) and the steps' mean reward, by step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    figure, axes = plt.subplots(figsize=(7, 4), dpi=110)
    if points:
        axes.plot(
            [p.step for p in points], [p.mean_reward for p in points], color="grey",
            linewidth=1, alpha=0.6, label="training reward (sampled, T=0.7)",
        )  # fmt: skip
    if evals:
        steps = [e.step for e in evals]
        accuracy = [e.accuracy for e in evals]
        low = [e.interval[0] for e in evals]
        high = [e.interval[1] for e in evals]
        axes.fill_between(steps, low, high, alpha=0.2, label="95% interval")
        axes.plot(steps, accuracy, marker="o", linewidth=2, label="held-out accuracy (greedy)")
    axes.set_xlabel("step (policy version)")
    axes.set_ylabel("fraction correct")
    axes.set_ylim(0, 1.0)
    axes.set_title(f"agl-stream demo: GRPO on {model}, CPU")
    axes.grid(alpha=0.3)
    axes.legend(loc="upper left")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path
