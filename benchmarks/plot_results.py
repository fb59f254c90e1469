"""Plot a bench_module.py result: time per call against T, log-log, one panel per workload.

    python benchmarks/plot_results.py benchmarks/results/bench_module.json --out benchmarks/results/bench_module.png

Solid lines: CUDA-graphed columns; dashed: the same compiles called without graphs; black: the floor.
Needs matplotlib (not a dependency of the package).
"""

from __future__ import annotations

import argparse
import json

GRAPHED = {
    "ind_graph": "torch.compile",
    "frz_graph": "Inductor freezing",
    "sglang_graph": "SGLang form",
    "fxf_graph": "fx_fusion",
    "fxf_frz_graph": "fx_fusion + freezing",
}
UNCAPTURED = {"inductor": "torch.compile, no graph", "fxf": "fx_fusion, no graph"}
COLORS = {"torch.compile": "tab:blue", "Inductor freezing": "tab:orange", "SGLang form": "tab:green",
          "fx_fusion": "tab:red", "fx_fusion + freezing": "tab:purple"}  # fmt: skip


def series(rows: dict, column: str) -> tuple[list[int], list[float]]:
    """(T values, median us) of one column, T ascending, cells that ran and matched eager only."""
    points = []
    for seq_len, row in rows.items():
        cell = row.get(column, {})
        us = cell.get("floor_us", cell.get("us")) if column == "floor" else cell.get("us")
        if us is not None and (column == "floor" or cell.get("ok", False)):
            points.append((int(seq_len), float(us)))
    points.sort()
    return [t for t, _ in points], [us for _, us in points]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", help="bench_module.json")
    parser.add_argument("--out", required=True, help="PNG path")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(args.results) as f:
        data = json.load(f)
    workloads = data["results"]
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.5 * len(workloads), 4.5), squeeze=False)
    for ax, (workload, rows) in zip(axes[0], workloads.items()):
        for column, label in GRAPHED.items():
            ts, us = series(rows, column)
            if ts:
                ax.plot(ts, us, marker="o", label=label, color=COLORS[label])
        for column, label in UNCAPTURED.items():
            ts, us = series(rows, column)
            if ts:
                color = COLORS["fx_fusion" if column == "fxf" else "torch.compile"]
                ax.plot(ts, us, linestyle="--", marker=".", label=label, color=color, alpha=0.6)
        ts, us = series(rows, "floor")
        ax.plot(ts, us, color="black", linewidth=1, label="floor (bytes or FLOPs)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(workload)
        ax.set_xlabel("T (context tokens)")
        ax.set_ylabel("us per call (median)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    meta = data.get("meta", {})
    fig.suptitle(f"{meta.get('device_name', '')}, {meta.get('dtype', '')}, torch {meta.get('torch', '')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
