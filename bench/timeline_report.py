#!/usr/bin/env python3
"""Summarize `megamoe bench --timeline` results: where the W4A16 kernels' time goes, per point.

Per point (token count T): the span of each launch; per SM, the share of the run it had an item
running and how many CTAs it held; L1 items' durations and weight rates per CTA against how many
CTAs ran on the same SM at the same time; L2 items' waits for their experts' L1 tiles (the fused
launch); the item that ended last and what it waited for; the idle tail. Times are %globaltimer
ns as the kernels recorded them; rates are weight bytes per ns (= GB/s).

usage: timeline_report.py TIMELINE.json [--svg OUT.svg]   (stdlib only)
"""
import argparse
import json
import math
import os
import statistics


def percentile(values, q):
    """The q-th percentile (0..100) of `values`, linear between the closest ranks (numpy's default)."""
    v = sorted(values)
    if not v:
        return None
    pos = (len(v) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def union_length(intervals):
    """Total length of the union of [start, end) intervals."""
    total, cur_start, cur_end = 0, None, None
    for s, e in sorted(intervals):
        if cur_end is None or s > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = s, e
        else:
            cur_end = max(cur_end, e)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def overlap(a_start, a_end, b_start, b_end):
    return max(0, min(a_end, b_end) - max(a_start, b_start))


def concurrency(item, same_sm):
    """Items running on the item's SM during it, itself included, weighted by time (rounded)."""
    length = item["end_ns"] - item["start_ns"]
    if length <= 0:
        return 1
    shared = sum(overlap(item["start_ns"], item["end_ns"], o["start_ns"], o["end_ns"]) for o in same_sm)
    return max(1, round(shared / length))


def summarize(point, device_sms=None):
    """The numbers the report prints for one point, times in ns (None where there is nothing to measure)."""
    events = point["events"]
    ctas = [e for e in events if e["kind"] == "cta"]
    items = [e for e in events if e["kind"] in ("l1", "l2")]
    s = {"tokens": point["tokens"], "config": point.get("config", ""), "items": len(items)}
    if not items:
        return s
    run_start = min(e["start_ns"] for e in items)
    run_end = max(e["end_ns"] for e in items)
    span = run_end - run_start
    s["span_ns"] = span

    launches = {}
    for e in events:
        launches.setdefault(e["launch"], []).append(e)
    s["launches"] = []
    for name, evs in sorted(launches.items(), key=lambda kv: min(e["start_ns"] for e in kv[1])):
        per_sm = {}
        for c in (e for e in evs if e["kind"] == "cta"):
            per_sm[c["sm"]] = per_sm.get(c["sm"], 0) + 1
        histogram = {}
        for n in per_sm.values():
            histogram[n] = histogram.get(n, 0) + 1
        s["launches"].append({"launch": name, "start_ns": min(e["start_ns"] for e in evs),
                              "end_ns": max(e["end_ns"] for e in evs),
                              "ctas": sum(1 for e in evs if e["kind"] == "cta"),
                              "ctas_per_sm": dict(sorted(histogram.items()))})

    by_sm = {}
    for e in items:
        by_sm.setdefault(e["sm"], []).append(e)
    # The device's SMs without items count as idle throughout.
    busy = [union_length([(e["start_ns"], e["end_ns"]) for e in evs]) / span if span else 1.0
            for evs in by_sm.values()]
    busy += [0.0] * max(0, (device_sms or 0) - len(by_sm))
    s["sms_with_items"] = len(by_sm)
    s["device_sms"] = device_sms
    s["busy"] = {"min": min(busy), "median": statistics.median(busy), "mean": statistics.fmean(busy)}

    # %globaltimer may advance in steps coarser than a ns (its resolution is the GPU's): every stamp
    # is then a multiple of the step. Durations in cycles do not depend on it.
    s["timer_step_ns"] = math.gcd(*(e[k] - run_start for e in items for k in ("start_ns", "wait_ns", "end_ns")))
    cycles = [(e["cycles"], e["end_ns"] - e["start_ns"]) for e in items if e["end_ns"] > e["start_ns"]]
    if cycles:
        s["sm_clock_mhz"] = 1000.0 * sum(c for c, _ in cycles) / sum(ns for _, ns in cycles)

    l1 = [e for e in items if e["kind"] == "l1"]
    if l1:
        durations = [e["end_ns"] - e["start_ns"] for e in l1]
        s["l1"] = {"count": len(l1), "median_ns": percentile(durations, 50), "p90_ns": percentile(durations, 90)}
        groups = {}
        for e in l1:
            n = concurrency(e, by_sm[e["sm"]])
            groups.setdefault(n, []).append(e)
        s["l1"]["by_concurrency"] = []
        for n, evs in sorted(groups.items()):
            rates = [e["weight_bytes"] / (e["end_ns"] - e["start_ns"]) for e in evs if e["end_ns"] > e["start_ns"]]
            s["l1"]["by_concurrency"].append({
                "ctas": n, "items": len(evs),
                "median_ns": percentile([e["end_ns"] - e["start_ns"] for e in evs], 50),
                "bytes_per_ns_per_cta": percentile(rates, 50) if rates else None,
                "bytes_per_ns_per_sm": n * percentile(rates, 50) if rates else None})

    l2 = [e for e in items if e["kind"] == "l2"]
    if l2:
        waits = [e["wait_ns"] - e["start_ns"] for e in l2]
        durations = [e["end_ns"] - e["wait_ns"] for e in l2]
        s["l2"] = {"count": len(l2), "wait_median_ns": percentile(waits, 50), "wait_p90_ns": percentile(waits, 90),
                   "wait_max_ns": max(waits), "median_ns": percentile(durations, 50),
                   "p90_ns": percentile(durations, 90)}

    last = max(items, key=lambda e: e["end_ns"])
    s["last_item"] = last
    if last["kind"] == "l2" and last["wait_ns"] > last["start_ns"]:
        gating = [e for e in l1 if e["expert"] == last["expert"]]
        if gating:
            s["gating_l1_item"] = max(gating, key=lambda e: e["end_ns"])

    # The idle tail: from the first SM to run its last item out to the end of the run.
    last_end = {sm: max(e["end_ns"] for e in evs) for sm, evs in by_sm.items()}
    s["tail_start_ns"] = min(last_end.values())
    s["tail_ns"] = run_end - s["tail_start_ns"]
    sms = device_sms if device_sms else len(by_sm)
    idle_in_tail = sum(run_end - t for t in last_end.values()) + (sms - len(by_sm)) * span
    s["tail_idle_share"] = idle_in_tail / (sms * span) if span else 0.0
    s["run_start_ns"] = run_start
    return s


def us(ns):
    return "-" if ns is None else f"{ns / 1000.0:.2f}"


def describe_item(e, t0):
    where = f'expert {e["expert"]}, SM {e["sm"]}, CTA {e["cta"]} of the {e["launch"]} launch'
    return f'{e["kind"].upper()} item {e["item"]} ({where}) {us(e["start_ns"] - t0)} -> {us(e["end_ns"] - t0)} us'


def format_point(point, s):
    """The report's lines for one point."""
    lines = [f'T={s["tokens"]}: {s["config"]}']
    clock = []
    if point.get("sm_clock_mhz") is not None:
        clock.append(f'{point["sm_clock_mhz"]:.0f} MHz over the timed replays (NVML)')
    if "sm_clock_mhz" in s:
        clock.append(f'{s["sm_clock_mhz"]:.0f} MHz in this run (cycles / ns)')
    if "us" in point:
        lines.append(f'  timed: {point["us"]:.2f} us (median replay); SM clock: {", ".join(clock) or "-"}')
    if not s["items"]:
        lines.append("  no items recorded")
        return lines
    t0 = s["run_start_ns"]
    lines.append(f'  span: {us(s["span_ns"])} us from the first item start to the last item end '
                 f'(the stamps are multiples of {s["timer_step_ns"]} ns)')
    for ln in s["launches"]:
        per_sm = ", ".join(f"{n} on {count} SMs" for n, count in ln["ctas_per_sm"].items())
        lines.append(f'  {ln["launch"]} launch: {us(ln["start_ns"] - t0)} -> {us(ln["end_ns"] - t0)} us, '
                     f'{ln["ctas"]} CTAs; CTAs per SM: {per_sm}')
    of = f' of {s["device_sms"]}' if s["device_sms"] else ""
    b = s["busy"]
    lines.append(f'  SMs with items: {s["sms_with_items"]}{of}; per SM, share of the span with an item running: '
                 f'min {b["min"]:.2f}, median {b["median"]:.2f}, mean {b["mean"]:.2f}')
    if "l1" in s:
        l1 = s["l1"]
        lines.append(f'  L1 items: {l1["count"]}, duration median {us(l1["median_ns"])} us, p90 {us(l1["p90_ns"])} us; '
                     "by CTAs running on the SM at the time:")
        lines.append("      CTAs  items  median us  B/ns per CTA  B/ns per SM")
        for g in l1["by_concurrency"]:
            per_cta = "-" if g["bytes_per_ns_per_cta"] is None else f'{g["bytes_per_ns_per_cta"]:.1f}'
            per_sm = "-" if g["bytes_per_ns_per_sm"] is None else f'{g["bytes_per_ns_per_sm"]:.1f}'
            lines.append(f'    {g["ctas"]:6d} {g["items"]:6d} {us(g["median_ns"]):>10} {per_cta:>13} {per_sm:>12}')
    if "l2" in s:
        l2 = s["l2"]
        lines.append(f'  L2 items: {l2["count"]}, wait for inputs median {us(l2["wait_median_ns"])} us, '
                     f'p90 {us(l2["wait_p90_ns"])} us, max {us(l2["wait_max_ns"])} us; after it, duration median '
                     f'{us(l2["median_ns"])} us, p90 {us(l2["p90_ns"])} us')
    last = s["last_item"]
    lines.append(f"  last item: {describe_item(last, t0)}")
    if "gating_l1_item" in s:
        lines.append(f'    waited {us(last["wait_ns"] - last["start_ns"])} us for its expert\'s L1 tiles, the last of '
                     f'them {describe_item(s["gating_l1_item"], t0)}')
    lines.append(f'  idle tail: the first SM ran out of items at {us(s["tail_start_ns"] - t0)} us, '
                 f'{us(s["tail_ns"])} us before the end; idle after their last items, the SMs lose '
                 f'{100.0 * s["tail_idle_share"]:.0f}% of their time over the span')
    return lines


def write_svg(point, path):
    """A Gantt chart of one point: a row per SM, a lane per CTA on it; L1 blue, L2 orange, waits grey."""
    items = [e for e in point["events"] if e["kind"] in ("l1", "l2")]
    if not items:
        return
    t0 = min(e["start_ns"] for e in items)
    t1 = max(e["end_ns"] for e in items)
    lanes = {}
    for e in point["events"]:
        if e["kind"] == "cta":
            lanes.setdefault(e["sm"], []).append((e["launch"], e["cta"]))
    for e in items:
        lanes.setdefault(e["sm"], [])
        if (e["launch"], e["cta"]) not in lanes[e["sm"]]:
            lanes[e["sm"]].append((e["launch"], e["cta"]))
    lane_h, left, width = 4, 60, 1200
    rows, y = {}, 20
    for sm in sorted(lanes):
        for i, key in enumerate(sorted(lanes[sm])):
            rows[(sm, key)] = y + i * lane_h
        y += max(1, len(lanes[sm])) * lane_h + 2
    scale = width / max(1, t1 - t0)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 10}" height="{y + 30}" '
           f'font-family="sans-serif" font-size="10">',
           f'<text x="{left}" y="12">T={point["tokens"]}: {point.get("config", "")}; '
           f'{(t1 - t0) / 1000.0:.1f} us, a row per SM (lanes: CTAs); L1 blue, L2 orange, wait grey</text>']
    for sm in sorted(lanes):
        ys = [rows[(sm, k)] for k in lanes[sm]] or [0]
        out.append(f'<text x="2" y="{min(ys) + lane_h}" font-size="6">SM {sm}</text>')
    for e in items:
        ry = rows[(e["sm"], (e["launch"], e["cta"]))]
        x0 = left + (e["start_ns"] - t0) * scale
        xw = left + (e["wait_ns"] - t0) * scale
        x1 = left + (e["end_ns"] - t0) * scale
        if xw > x0:
            out.append(f'<rect x="{x0:.2f}" y="{ry}" width="{xw - x0:.2f}" height="{lane_h - 1}" fill="#bbbbbb"/>')
        color = "#1f77b4" if e["kind"] == "l1" else "#ff7f0e"
        out.append(f'<rect x="{xw:.2f}" y="{ry}" width="{max(0.5, x1 - xw):.2f}" height="{lane_h - 1}" '
                   f'fill="{color}"><title>{e["kind"].upper()} item {e["item"]}, expert {e["expert"]}</title></rect>')
    out.append(f'<text x="{left}" y="{y + 20}">0 us</text>')
    out.append(f'<text x="{left + width - 60}" y="{y + 20}">{(t1 - t0) / 1000.0:.1f} us</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def svg_path(base, tokens, points):
    """OUT.svg for one point, OUT-T<tokens>.svg for each of several."""
    if points == 1:
        return base
    root, ext = os.path.splitext(base)
    return f"{root}-T{tokens}{ext or '.svg'}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("timeline", help="JSON written by `megamoe bench --timeline`")
    ap.add_argument("--svg", help="also draw each point's Gantt chart per SM here (OUT-T<tokens>.svg for several)")
    args = ap.parse_args(argv)
    with open(args.timeline) as f:
        r = json.load(f)
    layer = r["layer"]
    print(f'{r["device"]}, {r["sms"]} SMs; layer {layer["preset"]} (H={layer["H"]} I={layer["I"]} E={layer["E"]} '
          f'top-{layer["top_k"]}, shared I={layer["shared_I"]}); {r["l2_flush"]} L2 flush before each run')
    timed = [p for p in r["points"] if "skipped" not in p]
    for p in r["points"]:
        print()
        if "skipped" in p:
            print(f'T={p["tokens"]}: skipped: {p["skipped"]}')
            continue
        for line in format_point(p, summarize(p, r["sms"])):
            print(line)
        if args.svg:
            write_svg(p, svg_path(args.svg, p["tokens"], len(timed)))


if __name__ == "__main__":
    main()
