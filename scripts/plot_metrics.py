"""Plot loss (and the held-out eval_loss), tokens/s and grad norm against step, for one or several runs.

    python scripts/plot_metrics.py runs/debug_llama                  # writes runs/debug_llama/metrics.png
    python scripts/plot_metrics.py runs/straight runs/resumed --out resume.png

Each RUN_DIR is a run directory of pretrain_fsdp.py or finetune_moe_ep_fsdp.py: its metrics.jsonl holds
one JSON record per logged step. Needs matplotlib (pip install matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

PANELS = (("loss", "loss"), ("tokens_per_s", "tokens/s"), ("grad_norm", "grad norm"))


def fail(message: str) -> None:
    print(f"plot_metrics: {message}", file=sys.stderr)
    sys.exit(2)


def read_steps(run_dir: str) -> tuple[list[dict], list[dict]]:
    """The per-step records of a run and its evaluations; one line and exit 2 if there are no steps."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        fail(f"{run_dir!r} has no metrics.jsonl; give a run directory (its checkpoint.dir)")
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    steps = [r for r in records if "step" in r and "event" not in r]
    if not steps:
        fail(f"{path} holds no step records yet; plot it after the first logged step")
    return steps, [r for r in records if r.get("event") == "eval"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    parser.add_argument("--out", help="the PNG to write (default: RUN_DIR/metrics.png of the first run)")
    args = parser.parse_args(argv)
    runs = {run_dir: read_steps(run_dir) for run_dir in args.run_dirs}
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        fail("matplotlib is not installed; pip install matplotlib")

    figure, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 3.6), constrained_layout=True)
    for run_dir, (steps, evals) in runs.items():
        for ax, (key, _) in zip(axes, PANELS):
            points = [(r["step"], r[key]) for r in steps if r.get(key) is not None]
            if points:
                ax.plot(*zip(*points), marker=".", label=os.path.normpath(run_dir))
        if evals:  # on the loss panel, in the same colour as the run's training loss
            color = axes[0].get_lines()[-1].get_color()
            label = f"{os.path.normpath(run_dir)} eval_loss"
            axes[0].plot(
                [r["step"] for r in evals], [r["eval_loss"] for r in evals], "--o", color=color, label=label
            )
    for ax, (_, title) in zip(axes, PANELS):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    out = args.out or os.path.join(args.run_dirs[0], "metrics.png")
    figure.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
