"""The HTML report rendered by a real browser (Debian's chromium, headless, installed by
scripts/install_deps.sh): the GPT-3 175B plan and a 4-rank pipelined run of this machine with
its measured trace. Each page is screenshotted; the screenshot must not be blank and must show
the timeline's and the memory limit's colours; the page must hold one timeline row per
pipeline rank, one memory bar per rank class and the limit line. The measured bubble the
report states is recomputed here from the trace file itself."""

import json
import os
import re
import shutil
import struct
import subprocess
import tempfile
import zlib

import pytest

from torch_monarch import planner
from dist_harness import launch

GPT3_175B = dict(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200)
FORWARD_RGB = (0x4E, 0x79, 0xA7)   # report_html.cpp's forward colour
LIMIT_RGB = (0xD6, 0x27, 0x28)     # the memory limit line


def _chromium():
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    raise AssertionError("chromium is not installed: scripts/install_deps.sh installs it (make deps)")


def _browser(html_path, *args):
    profile = tempfile.mkdtemp(prefix="monarch-chromium-")
    try:
        # No network here: without the background-networking flags chromium keeps trying to
        # reach Google's hosts at every start.
        return subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                               "--disable-quic", "--no-first-run", "--disable-background-networking",
                               "--disable-component-update", "--disable-sync",
                               f"--user-data-dir={profile}", *args, "file://" + os.path.abspath(html_path)],
                              capture_output=True, timeout=180)
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def _screenshot(html_path, png_path, height):
    result = _browser(html_path, f"--window-size=1280,{height}", f"--screenshot={png_path}")
    assert os.path.exists(png_path), result.stderr.decode(errors="replace")[-2000:]


def _dom(html_path):
    result = _browser(html_path, "--dump-dom")
    assert result.returncode == 0, result.stderr.decode(errors="replace")[-2000:]
    return result.stdout.decode()


def _png_pixels(path):
    """(width, height, rows of RGB tuples) of an 8-bit, non-interlaced RGB or RGBA PNG (what
    chromium writes), decoded with zlib and the five PNG row filters."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height, depth, colour, _, _, interlace = header
    assert depth == 8 and colour in (2, 6) and interlace == 0, header
    channels = 3 if colour == 2 else 4
    raw = zlib.decompress(idat)
    stride = width * channels
    rows, previous = [], bytearray(stride)
    for y in range(height):
        kind = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - channels] if i >= channels else 0
            b = previous[i]
            c = previous[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + a) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + b) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + (a + b) // 2) & 0xFF
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        rows.append([tuple(line[x * channels:x * channels + 3]) for x in range(width)])
        previous = line
    return width, height, rows


def _check_rendered(png_path):
    width, height, rows = _png_pixels(png_path)
    colours, non_white = {}, 0
    for row in rows[::2]:
        for px in row[::2]:
            colours[px] = colours.get(px, 0) + 1
            non_white += px != (255, 255, 255)
    sampled = sum(colours.values())
    assert non_white > 0.02 * sampled, f"screenshot is (nearly) blank: {non_white} of {sampled} pixels drawn"
    assert len(colours) > 20, f"screenshot has only {len(colours)} colours"
    everything = {px for row in rows for px in row}
    assert FORWARD_RGB in everything, "no forward bar of the timeline on screen"
    assert LIMIT_RGB in everything, "no memory limit line on screen"


def _count(text, needle):
    return len(re.findall(re.escape(needle), text))


def test_gpt3_plan_report_renders(tmp_path):
    plan = planner.plan(planner.transformer(name="gpt3-175b", **GPT3_175B), planner.cluster("a100-80gb", 1024),
                        planner.training(1536))
    html = tmp_path / "gpt3.html"
    assert plan.report(html) == html
    dom = _dom(html)
    pp = plan.mesh.pp
    assert pp > 1
    assert _count(dom, 'class="timeline-row" data-kind="predicted"') == pp
    assert _count(dom, 'class="memory-bar"') == pp
    assert _count(dom, 'class="memory-limit"') == 1
    assert _count(dom, 'class="rank"') == 1024
    assert "gpt3-175b" in dom and plan.summary() in dom
    for alternative in plan.alternatives:
        assert alternative.summary in dom
    png = tmp_path / "gpt3.png"
    _screenshot(html, png, 2600)
    _check_rendered(png)
    # The text summary is still what report() without a path gives.
    assert "step time" in plan.report()


def _measured_bubble(trace, pp):
    """The last step on every pipeline rank: mean over ranks of idle / step span, from the raw
    trace events (the rank with dp = tp = 0 at each pipeline position)."""
    ranks = {r["rank"]: r for r in trace["otherData"]["ranks"]}
    at = {r["pp"]: r["rank"] for r in ranks.values() if r["dp"] == 0 and r["tp"] == 0}
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "pipeline"]
    steps = [{e["args"]["step"] for e in events if e["name"] == "step" and e["pid"] == at[p]} for p in range(pp)]
    step = max(set.intersection(*steps))
    spans = [e for e in events if e["name"] == "step" and e["args"]["step"] == step and e["pid"] in at.values()]
    begin = min(e["ts"] for e in spans)
    makespan = max(e["ts"] + e["dur"] for e in spans) - begin
    idle = 0.0
    for p in range(pp):
        busy = sum(e["dur"] for e in events if e["pid"] == at[p] and e["args"].get("step") == step
                   and e["name"] in ("forward", "backward", "backward_input", "backward_weight"))
        idle += (makespan - busy) / makespan
    return idle / pp, step


def test_pipelined_run_trace_drawn_under_the_prediction(tmp_path):
    r = launch(4, "run", worker="report_workers.py", timeout=300)
    assert r.ok, r.describe()
    trace_path = os.path.join(r.out_dir, "trace.json")
    plan = planner.load(os.path.join(r.out_dir, "plan.json"))
    assert plan.mesh.pp == 4 and plan.num_micro_batches == 8
    with open(trace_path) as f:
        trace = json.load(f)
    assert trace["otherData"]["format"] == "monarch-trace"
    assert sorted(x["rank"] for x in trace["otherData"]["ranks"]) == [0, 1, 2, 3]
    # Every rank ran 3 steps of 8 forwards and 8 backwards on its stage.
    for rank in range(4):
        mine = [e for e in trace["traceEvents"] if e.get("pid") == rank and e.get("cat") == "pipeline"]
        assert sum(e["name"] == "step" for e in mine) == 3
        assert sum(e["name"] == "forward" for e in mine) == 3 * 8
        assert sum(e["name"] == "backward" for e in mine) == 3 * 8
        assert {e["args"]["stage"] for e in mine if e["name"] == "forward"} == {rank}
    # Collectives are recorded with their group and bytes (the pipeline's sends and receives).
    sends = [e for e in trace["traceEvents"] if e.get("cat") == "collective" and e["name"] == "send"]
    assert sends and all(e["args"]["group"] == "pp" and e["args"]["bytes"] > 0 for e in sends)

    html = tmp_path / "run.html"
    plan.report(html, trace=trace_path)
    dom = _dom(html)
    assert _count(dom, 'class="timeline-row" data-kind="predicted"') == 4
    assert _count(dom, 'class="timeline-row" data-kind="measured"') == 4
    assert _count(dom, 'class="memory-bar"') == 4
    assert _count(dom, 'class="memory-limit"') == 1
    predicted = re.search(r'class="bubble-predicted">([0-9.]+)%', dom)
    measured = re.search(r'class="bubble-measured">([0-9.]+)%', dom)
    assert predicted and measured, "the report states the predicted and the measured bubble"
    expected, step = _measured_bubble(trace, 4)
    assert float(measured.group(1)) == pytest.approx(100 * expected, abs=0.051)
    assert f"step {step} of the trace" in dom
    # The predicted bubble is the simulator's on the plan's own stage times (1F1B, 4 ranks, 8
    # micro-batches; at least the uniform-stage closed form 3/11, more with transfer waits).
    sim = planner._P.simulate(planner.schedule("1f1b", 4, 8), list(plan.prediction.stages))
    assert float(predicted.group(1)) == pytest.approx(100 * sim.bubble_fraction, abs=0.051)
    assert sim.bubble_fraction >= 3 / 11 - 1e-9
    png = tmp_path / "run.png"
    _screenshot(html, png, 1800)
    _check_rendered(png)

    # The Python CLI writes the same page.
    from torch_monarch.cli import main
    again = tmp_path / "again.html"
    assert main(["report", os.path.join(r.out_dir, "plan.json"), "-o", str(again), "--trace", trace_path]) == 0
    assert again.read_text() == html.read_text()
