#!/usr/bin/env python3
"""Plot `megamoe bench --json` results: time and % of floor against tokens.

usage: plot_bench.py RESULT.json [MORE.json ...] -o OUT.png
"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="JSON files written by `megamoe bench --json`")
    ap.add_argument("-o", "--output", required=True, help="PNG to write")
    args = ap.parse_args()

    fig, (ax_t, ax_p) = plt.subplots(1, 2, figsize=(12, 4.5))
    for path in args.results:
        with open(path) as f:
            r = json.load(f)
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
    ax_t.set(xscale="log", yscale="log", xlabel="tokens T", ylabel="µs (median, L2 flushed)",
             title="MoE layer time")
    ax_p.set(xscale="log", xlabel="tokens T", ylabel="% of floor", ylim=(0, 105),
             title="fraction of the floor reached")
    for ax in (ax_t, ax_p):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.output, dpi=120)


if __name__ == "__main__":
    main()
