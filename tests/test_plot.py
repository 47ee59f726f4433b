"""Timeline pictures as users make them: ``gpuwatchd replay TRACE --plot FILE`` on the
real 8-GPU H100 trace and ``gpuwatchctl events --plot FILE`` against a daemon replaying
it; the files are checked as a viewer would read them (PNG header and size, SVG as
XML with one panel per GPU, plotly HTML with one subplot per GPU)."""

from __future__ import annotations

import json
import re
import struct
import subprocess
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

from conftest import BIN, REPO, TRACES, RunningDaemon
from hpo_env import (
    TWO_EQUAL_GPUS,
    one_assert_job,
    wait_until_stopped,
)

H100 = TRACES / "h100x8_gpt350m_ckpt10_100ms.csv"
POLICIES = REPO / "policies" / "default.yaml"
SVG = "{http://www.w3.org/2000/svg}"


def replay_plot(out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            str(BIN / "gpuwatchd"),
            "replay",
            str(H100),
            "--policies",
            str(POLICIES),
            "--plot",
            str(out),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def svg_panels(path: Path) -> dict[int, list[str]]:
    """GPU index -> ids of what the panel ``<g id="gpuN">`` holds (findings, decisions)."""
    root = ET.parse(path).getroot()  # raises on a malformed file
    assert root.tag == f"{SVG}svg"
    panels: dict[int, list[str]] = {}
    for group in root.iter(f"{SVG}g"):
        match = re.fullmatch(r"gpu(\d+)", group.get("id", ""))
        if match:
            panels[int(match[1])] = [
                e.get("id", "") for e in group.iter() if e.get("id", "").startswith("gpu")
            ]
    return panels


def test_replay_plot_png_of_the_h100_trace(tmp_path: Path) -> None:
    out = tmp_path / "h100.png"
    result = replay_plot(out)
    assert result.returncode == 0, result.stderr
    assert "decisions" in result.stdout  # the usual report is still printed
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])  # IHDR
    # one panel per GPU: 8 panels stack taller than wide
    assert width > 600 and height > width * 0.75, (width, height)


def test_replay_plot_svg_has_a_panel_per_gpu_with_findings_and_decisions(
    tmp_path: Path,
) -> None:
    out = tmp_path / "h100.svg"
    result = replay_plot(out)
    assert result.returncode == 0, result.stderr
    panels = svg_panels(out)
    assert sorted(panels) == list(range(8))
    # The trace starts with ~105 s of every GPU idle: the default gpu-underused policy
    # holds a low_utilization finding and decides on every GPU.
    for gpu, ids in panels.items():
        assert any("-finding" in i and i.endswith("low_utilization") for i in ids), (gpu, ids)
        assert any("-decision" in i for i in ids), (gpu, ids)
    # GPU 0 (~10 % beside seven at ~97 %) is one sustained finding over the whole run (the
    # default gpu-underused uses the window mean with hysteresis); the seven others have
    # two: the idle start and the idle end.
    spans = {g: sum("-finding" in i for i in ids) for g, ids in panels.items()}
    assert spans == {0: 1, **{g: 2 for g in range(1, 8)}}, spans


def test_replay_plot_html_has_a_subplot_per_gpu(tmp_path: Path) -> None:
    out = tmp_path / "h100.html"
    result = replay_plot(out, "--gpus", "2")
    assert result.returncode == 0, result.stderr
    html = out.read_text()
    assert html.lower().startswith("<!doctype html>") and html.rstrip().endswith("</html>")
    assert "Plotly.newPlot" in html
    for gpu in range(2):
        assert f'"text":"GPU {gpu}"' in html  # subplot title
        assert f'"name":"GPU {gpu} utilization %"' in html
    assert '"text":"GPU 2"' not in html


def test_replay_plot_refuses_an_unknown_suffix_before_the_work(tmp_path: Path) -> None:
    result = replay_plot(tmp_path / "h100.jpg")
    assert result.returncode == 1
    assert ".png, .svg or .html" in result.stderr
    assert not (tmp_path / "h100.jpg").exists()


def test_events_plot_from_a_running_daemon(
    run_daemon: Callable[..., RunningDaemon], tmp_path: Path
) -> None:
    daemon = run_daemon(
        script={"devices": []},
        args=["--devices", f"replay:{H100}", "--replay-speed", "10", "--policies", str(POLICIES)],
    )

    def decided() -> bool:
        result = daemon.ctl("--json", "events")
        kinds = [json.loads(line)["kind"] for line in result.stdout.splitlines() if line]
        return "decision" in kinds

    daemon.wait_until(decided, timeout_s=60, what="a decision in the journal")
    out = tmp_path / "journal.svg"
    result = daemon.ctl("events", "--plot", str(out), "--since", "1h")
    assert result.returncode == 0, result.stderr
    assert "events drawn to" in result.stderr
    panels = svg_panels(out)
    assert sorted(panels) == list(range(8))
    for gpu, ids in panels.items():
        assert any(i.endswith("low_utilization") for i in ids), (gpu, ids)
    assert any("-decision" in i for ids in panels.values() for i in ids)
    html = tmp_path / "journal.html"
    result = daemon.ctl("events", "--plot", str(html))
    assert result.returncode == 0, result.stderr
    assert all(f'"text":"GPU {g}"' in html.read_text() for g in range(8))


def test_events_plot_names_the_job_and_trial_of_a_crash_decision(
    run_daemon: Callable[..., RunningDaemon], tmp_path: Path
) -> None:
    """A managed Optuna worker dies of a CUDA device-side assert; the restart_study
    decision names the job and the crashed trial, and the picture says so beside its line."""
    _, config = one_assert_job(tmp_path)
    policies = tmp_path / "policies.yaml"
    policies.write_text(
        "policies:\n  - name: crashed-trials-restart\n    when:\n"
        "      job_crashed: {kind: [cuda_assert]}\n    do:\n      - restart_study: {}\n"
    )
    daemon = run_daemon(
        script=TWO_EQUAL_GPUS, args=["--config", str(config), "--policies", str(policies)]
    )
    wait_until_stopped(daemon, "hpo")
    listed = daemon.ctl("--json", "events", "--since", "1h")
    restarts = [
        e
        for e in map(json.loads, listed.stdout.splitlines())
        if e["kind"] == "decision" and e["action"] == "restart_study"
    ]
    assert len(restarts) == 1, listed.stdout
    trial = restarts[0]["params"]["trial_number"]
    assert isinstance(trial, int)
    label = f"crashed-trials-restart/restart_study job hpo trial {trial}"
    svg = tmp_path / "journal.svg"
    result = daemon.ctl("events", "--plot", str(svg), "--since", "1h")
    assert result.returncode == 0, result.stderr
    # matplotlib writes each text's string as a comment in its <g id=...> group
    root = ET.parse(svg).getroot()
    labelled = [g.get("id", "") for g in root.iter(f"{SVG}g") if g.get("id", "").endswith("-label")]
    assert labelled, "no decision label drawn"
    assert f"<!-- {label}" in svg.read_text()
    html = tmp_path / "journal.html"
    assert daemon.ctl("events", "--plot", str(html), "--since", "1h").returncode == 0
    assert label.replace("/", "\\u002f") in html.read_text()  # plotly escapes "/" in its JSON
