"""`relayrl plot`: draw a run's reward and pass-rate curves (training and held-out eval) to PNG."""

from __future__ import annotations

from pathlib import Path

from relayrl.common.files import read_jsonl

PNG = "reward.png"  # a run's curves, in its folder: drawn at the end of the run and by `relayrl plot RUN_DIR`


def _series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if key in r]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_run(run_dirs: list[str | Path], out: str | Path, labels: list[str] | None = None) -> Path:
    """One figure, two panels: reward (train) and pass rate (train and eval), one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_p) = plt.subplots(1, 2, figsize=(11, 4))
    for i, run_dir in enumerate(run_dirs):
        path = Path(run_dir) / "metrics.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist: is {run_dir} a relayrl run folder?")
        rows = read_jsonl(path)
        name = labels[i] if labels else Path(run_dir).name
        ax_r.plot(*_series(rows, "rollout/reward_mean"), label=f"{name} train reward", alpha=0.8)
        ax_p.plot(*_series(rows, "rollout/pass_rate"), label=f"{name} train pass rate", alpha=0.6)
        ex, ey = _series(rows, "eval/pass@1")
        if ex:
            ax_p.plot(ex, ey, "o-", label=f"{name} held-out pass@1", linewidth=2)
    ax_r.set(xlabel="step", ylabel="mean reward", title="reward")
    ax_p.set(xlabel="step", ylabel="pass rate", title="pass rate", ylim=(0, 1))
    for ax in (ax_r, ax_p):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
