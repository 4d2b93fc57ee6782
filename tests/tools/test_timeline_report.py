"""bench/timeline_report.py on a hand-made `megamoe bench --timeline` file whose numbers are
worked out below: three SMs, two of them used; CTAs 0 and 2 share SM 0."""

import importlib.util
import json
import pathlib
import xml.etree.ElementTree as ET

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("timeline_report", ROOT / "bench" / "timeline_report.py")
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)


def item(kind, cta, sm, expert, index, start, wait, end, cycles, k_chunks):
    return {"kind": kind, "launch": "fused", "sm": sm, "cta": cta, "expert": expert, "item": index,
            "m_block": 0, "k_split": 0, "slots": 1, "k_chunks": k_chunks, "rows": 64,
            "weight_bytes": 64 * k_chunks * 36, "start_ns": start, "wait_ns": wait, "end_ns": end,
            "cycles": cycles}


def cta(index, sm, start, end, items):
    return {"kind": "cta", "launch": "fused", "sm": sm, "cta": index, "start_ns": start, "end_ns": end,
            "cycles": 0, "items": items}


# SM 0: CTA 0 runs A (L1, expert 0) then E (L2, expert 1); CTA 2 runs B (L1, expert 1).
# SM 1: CTA 1 runs C (L1, expert 0) then D (L2, expert 0), which waits 600 ns for A: D ends last.
# Every item at 1.8 cycles per ns; 16 K chunks of 64 rows = 36864 weight bytes per L1 item.
POINT = {
    "tokens": 1, "config": "fused decode16", "us": 2.5, "sm_clock_mhz": 1980.0,
    "events": [
        cta(0, 0, 0, 1500, 2), cta(1, 1, 0, 1600, 2), cta(2, 0, 0, 1200, 1),
        item("l1", 0, 0, 0, 0, 0, 0, 1000, 1800, 16),      # A
        item("l1", 2, 0, 1, 2, 0, 0, 1200, 2160, 16),      # B
        item("l1", 1, 1, 0, 1, 0, 0, 400, 720, 16),        # C
        item("l2", 1, 1, 0, 0, 400, 1000, 1600, 2160, 8),  # D
        item("l2", 0, 0, 1, 1, 1000, 1000, 1500, 900, 8),  # E
    ],
}
TIMELINE = {"device": "NVIDIA H200", "sms": 3,
            "layer": {"preset": "deepseek-v3", "H": 7168, "I": 2048, "E": 256, "top_k": 8, "shared_I": 2048},
            "l2_flush": "clean", "points": [POINT, {"tokens": 64, "skipped": "MoeTuning.fused: too many tokens"}]}


def test_percentile_is_linear_between_ranks():
    assert report.percentile([400, 1000, 1200], 50) == 1000
    assert report.percentile([400, 1000, 1200], 90) == pytest.approx(1160)
    assert report.percentile([5], 90) == 5
    assert report.percentile([], 50) is None


def test_summary_numbers():
    s = report.summarize(POINT, device_sms=3)
    assert s["span_ns"] == 1600
    assert s["timer_step_ns"] == 100
    assert s["launches"] == [{"launch": "fused", "start_ns": 0, "end_ns": 1600, "ctas": 3,
                              "ctas_per_sm": {1: 1, 2: 1}}]
    # SM 0 runs items over [0, 1500), SM 1 over [0, 1600), SM 2 never.
    assert s["sms_with_items"] == 2
    assert s["busy"]["min"] == 0.0
    assert s["busy"]["median"] == pytest.approx(1500 / 1600)
    assert s["busy"]["mean"] == pytest.approx((1500 / 1600 + 1.0) / 3)
    assert s["sm_clock_mhz"] == pytest.approx(1800.0)
    l1 = s["l1"]
    assert (l1["count"], l1["median_ns"], l1["p90_ns"]) == (3, 1000, pytest.approx(1160))
    # A and B share SM 0 (A: 2000 / 1000 ns of items on the SM; B: 2400 / 1200), C runs alone.
    alone, shared = l1["by_concurrency"]
    assert (alone["ctas"], alone["items"], alone["median_ns"]) == (1, 1, 400)
    assert alone["bytes_per_ns_per_cta"] == pytest.approx(36864 / 400)
    assert alone["bytes_per_ns_per_sm"] == pytest.approx(36864 / 400)
    assert (shared["ctas"], shared["items"], shared["median_ns"]) == (2, 2, 1100)
    assert shared["bytes_per_ns_per_cta"] == pytest.approx((36864 / 1000 + 36864 / 1200) / 2)
    assert shared["bytes_per_ns_per_sm"] == pytest.approx(36864 / 1000 + 36864 / 1200)
    l2 = s["l2"]
    assert (l2["count"], l2["wait_max_ns"]) == (2, 600)
    assert (l2["wait_median_ns"], l2["wait_p90_ns"]) == (300, pytest.approx(540))
    assert (l2["median_ns"], l2["p90_ns"]) == (550, pytest.approx(590))
    assert s["last_item"]["item"] == 0 and s["last_item"]["kind"] == "l2"
    assert s["gating_l1_item"]["item"] == 0 and s["gating_l1_item"]["kind"] == "l1"  # A
    # SM 0 runs out at 1500: 100 ns of tail; idle SM time after each SM's last item: 100 on SM 0,
    # 0 on SM 1, the whole span on SM 2.
    assert (s["tail_start_ns"], s["tail_ns"]) == (1500, 100)
    assert s["tail_idle_share"] == pytest.approx((100 + 0 + 1600) / (3 * 1600))


def test_report_and_svg(tmp_path, capsys):
    path = tmp_path / "timeline.json"
    path.write_text(json.dumps(TIMELINE))
    svg = tmp_path / "gantt.svg"
    report.main([str(path), "--svg", str(svg)])
    out = capsys.readouterr().out
    assert "NVIDIA H200, 3 SMs; layer deepseek-v3" in out
    assert "T=1: fused decode16" in out
    assert "1980 MHz over the timed replays (NVML), 1800 MHz in this run (cycles / ns)" in out
    assert "span: 1.60 us from the first item start to the last item end (the stamps are multiples of 100 ns)" in out
    assert "fused launch: 0.00 -> 1.60 us, 3 CTAs; CTAs per SM: 1 on 1 SMs, 2 on 1 SMs" in out
    assert "SMs with items: 2 of 3" in out
    assert "         1      1       0.40          92.2         92.2" in out
    assert "         2      2       1.10          33.8         67.6" in out
    assert "wait for inputs median 0.30 us, p90 0.54 us, max 0.60 us" in out
    assert "last item: L2 item 0 (expert 0, SM 1, CTA 1 of the fused launch) 0.40 -> 1.60 us" in out
    assert "waited 0.60 us for its expert's L1 tiles, the last of them L1 item 0" in out
    assert "idle tail: the first SM ran out of items at 1.50 us, 0.10 us before the end" in out
    assert "the SMs lose 35% of their time over the span" in out
    assert "T=64: skipped: MoeTuning.fused: too many tokens" in out
    # Two timed-or-skipped points, one timed: the chart keeps the given name. Five items, one wait.
    rects = ET.parse(svg).getroot().findall("{http://www.w3.org/2000/svg}rect")
    assert len(rects) == 6
