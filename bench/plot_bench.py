#!/usr/bin/env python3
"""Plot `megamoe bench --json` results: time and % of floor against tokens.

Single-GPU results against T; expert-parallel ones (`megamoe bench --ep N --json`, "mode": "ep")
against tokens per rank, with the slowest rank's time, the floor, the unfused baseline (a) whole
and compute-only, and the single-GPU layer on all tokens (b) where it ran.

usage: plot_bench.py RESULT.json [MORE.json ...] -o OUT.png
"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_ep(r, ax_t, ax_p):
    """One `bench --ep` result: x = tokens per rank."""
    pts = r["points"]
    t = [p["tokens_per_rank"] for p in pts]
    shared = " +shared" if r["layer"].get("shared_I", 0) > 0 else ""
    label = f'{r["layer"]["preset"]}{shared}, EP{r["ep"]["world_size"]} on {r["device"]}'
    ax_t.plot(t, [p["us"] for p in pts], "o-", label=f"megamoe EP (slowest rank): {label}")
    ax_t.plot(t, [p["floor_us"] for p in pts], "k--", label="EP floor (max over ranks)")
    with_a = [p for p in pts if "unfused" in p]
    if with_a:
        ta = [p["tokens_per_rank"] for p in with_a]
        ax_t.plot(ta, [p["unfused"]["us"] for p in with_a], "s:", label="(a) NCCL all-to-all + single-GPU layer")
        ax_t.plot(ta, [p["unfused"]["compute_us"] for p in with_a], "^:", label="(a) compute only")
    with_b = [p for p in pts if p.get("single_gpu", {}).get("ran")]
    if with_b:
        ax_t.plot([p["tokens_per_rank"] for p in with_b], [p["single_gpu"]["us"] for p in with_b], "d-.",
                  label="(b) single GPU, all R*T_r tokens")
    ax_p.plot(t, [p["pct_floor"] for p in pts], "o-", label=label)
    failed = [(p["tokens_per_rank"], p["us"]) for p in pts if p.get("check_pass") is False]
    if failed:
        ax_t.plot(*zip(*failed), "rx", markersize=12, label="output check failed")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="JSON files written by `megamoe bench --json`")
    ap.add_argument("-o", "--output", required=True, help="PNG to write")
    args = ap.parse_args()

    fig, (ax_t, ax_p) = plt.subplots(1, 2, figsize=(12, 4.5))
    any_ep = False
    for path in args.results:
        with open(path) as f:
            r = json.load(f)
        if r.get("mode") == "ep":
            plot_ep(r, ax_t, ax_p)
            any_ep = True
            continue
        # Points a MoeTuning override could not run are recorded with "skipped" and no timing.
        pts = [p for p in r["points"] if "skipped" not in p]
        t = [p["tokens"] for p in pts]
        shared = " +shared" if r["layer"].get("shared_I", 0) > 0 else ""
        label = f'{r["layer"]["preset"]}{shared} on {r["device"]}'
        ax_t.plot(t, [p["us"] for p in pts], "o-", label=f"megamoe W4A16: {label}")
        ax_t.plot(t, [p["floor_us"] for p in pts], "k--", label="floor")
        if any(p["bf16_us"] > 0 for p in pts):
            ax_t.plot(t, [p["bf16_us"] for p in pts], "s:", label="bf16 cuBLAS baseline")
        ax_p.plot(t, [p["pct_floor"] for p in pts], "o-", label=label)
        # Points whose timed output failed its check against the CPU reference (bench rel_err).
        failed = [(p["tokens"], p["us"]) for p in pts if p.get("check_pass") is False]
        if failed:
            ax_t.plot(*zip(*failed), "rx", markersize=12, label="output check failed")
    xlabel = "tokens T (per rank for EP)" if any_ep else "tokens T"
    ax_t.set(xscale="log", yscale="log", xlabel=xlabel, ylabel="µs (median, L2 flushed)",
             title="MoE layer time")
    ax_p.set(xscale="log", xlabel=xlabel, ylabel="% of floor", ylim=(0, 105),
             title="fraction of the floor reached")
    for ax in (ax_t, ax_p):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.output, dpi=120)


if __name__ == "__main__":
    main()
