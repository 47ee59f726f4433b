"""Knob changes survive new Trainers and daemon restarts (issue 10 item 6), with the REAL
daemon (``run_daemon``), the real Lightning and Hugging Face Trainers on the CPU, and the
real ``gpuwatchctl``: a new Trainer per trial, as HPO scripts write it, attaches again
with the script's original ``num_workers``; the daemon hands back the value the job
had, and ``status`` says where it came from. Also the operator's knob requests in the
journal (``gpuwatchctl events``) and one error code per refusal (item 10)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
from torch.utils.data import DataLoader

from conftest import RunningDaemon, restart_on_same_state
from gpuwatchd.hook.lightning import GpuwatchCallback
from test_hook_lightning import PidPoints, Tiny  # the same tiny Lightning job


def run_trial(
    daemon: RunningDaemon,
    tmp_path: Path,
    on_step: Callable[[int, int], None] = lambda epoch, index: None,
    knobs: dict[str, object] | None = None,
) -> tuple[Tiny, DataLoader[Any]]:
    """One trial as an HPO script writes it: a new model, loader, callback and Trainer,
    the loader built with the script's ``num_workers=0``."""
    callback = GpuwatchCallback(job="pl-hpo", socket=daemon.socket, knobs=knobs)
    model = Tiny(on_step)
    loader = DataLoader(PidPoints(), batch_size=8, num_workers=0)
    trainer = L.Trainer(
        max_epochs=2,
        accelerator="cpu",
        devices=1,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, train_dataloaders=loader)
    return model, loader


def job_knobs(daemon: RunningDaemon, job: str) -> dict[str, Any] | None:
    for entry in daemon.status()["jobs"]:
        if entry["name"] == job and entry.get("last_report"):
            return dict(entry["knobs"])
    return None


def events(daemon: RunningDaemon) -> list[dict[str, Any]]:
    result = daemon.ctl("--json", "events")
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


@pytest.mark.slow
def test_a_new_lightning_trainer_per_trial_starts_where_the_job_was(
    run_daemon: Callable[..., RunningDaemon], tmp_path: Path
) -> None:
    policy = tmp_path / "none.yaml"
    policy.write_text("policies: []\n")
    daemon = run_daemon(args=["--policies", str(policy)])
    main_pid = os.getpid()

    refusals: list[str] = []

    def operator_raises_workers(epoch: int, index: int) -> None:
        if (epoch, index) == (0, 0):
            # --wait 0: applied by the hook at the next epoch start
            asked = daemon.ctl("knob", "pl-hpo", "num_workers", "2", "--wait", "0")  # d-1
            assert asked.returncode == 0, asked.stderr
            too_many = daemon.ctl("knob", "pl-hpo", "prefetch_factor", "1000")  # d-2
            assert too_many.returncode == 1
            refusals.append(too_many.stderr.strip())
            # d-3 supersedes d-1 before the epoch ends
            asked = daemon.ctl("knob", "pl-hpo", "num_workers", "1", "--wait", "0")
            assert asked.returncode == 0, asked.stderr

    first, _ = run_trial(daemon, tmp_path, operator_raises_workers)
    assert first.pids[0] == {main_pid} and main_pid not in first.pids[1]
    assert refusals == [  # one error code, then the job's reason
        "gpuwatchctl: bad_request: knob 'prefetch_factor': 1000 is above its maximum 64 "
        "(bounds [1, 64])"
    ]

    seen: list[dict[str, Any] | None] = []
    shown: list[str] = []

    def look_at_status(epoch: int, index: int) -> None:
        if (epoch, index) == (1, 3):
            seen.append(
                daemon.wait_until(
                    lambda: (
                        (job_knobs(daemon, "pl-hpo") or {}).get("num_workers", {}).get("value") == 1
                        and job_knobs(daemon, "pl-hpo")
                    ),
                    what="the restored value in status",
                )
            )
            shown.append(daemon.ctl("jobs").stdout)

    second, second_loader = run_trial(daemon, tmp_path, look_at_status)
    # the new Trainer's loader was built with num_workers=0; epoch 0 already ran in a worker
    assert main_pid not in second.pids[0] and main_pid not in second.pids[1]
    assert second_loader.num_workers == 1
    assert seen[0] is not None
    assert seen[0]["num_workers"]["value"] == 1
    assert seen[0]["num_workers"]["source"] == "operator"
    assert seen[0]["prefetch_factor"]["source"] == "script"
    assert "num_workers=1 [0..64] from operator" in shown[0]  # gpuwatchctl jobs

    # the operator's requests are in the journal, with the command ids their outcomes
    # name: the superseded one names who superseded it, and d-3 is there, applied
    rows = [e for e in events(daemon) if e.get("policy") == "operator"]
    decisions = [e for e in rows if e["kind"] == "decision"]
    uid = {"hold_s": 1800.0, "by_uid": os.getuid()}  # --hold's default: 30 minutes
    assert [d["params"] for d in decisions] == [
        {"knob": "num_workers", "value": 2} | uid,
        {"knob": "prefetch_factor", "value": 1000} | uid,
        {"knob": "num_workers", "value": 1} | uid,
    ]
    assert all(d["action"] == "set_knob" and d["job"] == "pl-hpo" for d in decisions)
    outcomes = {e["decision_id"]: e for e in rows if e["kind"] == "outcome"}
    first_ask, refused_ask, applied_ask = (outcomes[d["decision_id"]] for d in decisions)
    assert (first_ask["outcome"], first_ask["detail"]) == (
        "refused",
        "request d-1: conflict: superseded by operator (num_workers=1) before it was applied",
    )
    assert (refused_ask["outcome"], refused_ask["detail"]) == (
        "refused",
        "request d-2: bad_request: knob 'prefetch_factor': 1000 is above its maximum 64 "
        "(bounds [1, 64])",
    )
    assert (applied_ask["outcome"], applied_ask["detail"]) == ("applied", "request d-3")

    # a daemon restart: the value comes back from the journal
    daemon.stop()
    later = restart_on_same_state(run_daemon, daemon, ["--policies", str(policy)])
    third, _ = run_trial(later, tmp_path)
    assert main_pid not in third.pids[0]

    # a value outside the bounds a new process declares is refused with the reason
    fourth, fourth_loader = run_trial(
        later, tmp_path, knobs={"num_workers": {"value": 0, "min": 0, "max": 0}}
    )
    assert fourth.pids[0] == {main_pid} and fourth_loader.num_workers == 0
    refused = [e for e in later.events() if e.get("event") == "control.knob_not_restored"]
    assert refused and "outside [0, 0]" in refused[0]["reason"]


@pytest.mark.slow
def test_a_new_hugging_face_trainer_per_trial_starts_where_the_job_was(
    run_daemon: Callable[..., RunningDaemon], tmp_path: Path
) -> None:
    import transformers

    from gpuwatchd.hook.transformers import GpuwatchTrainerCallback
    from test_hook_transformers import PidSamples, train_args
    from test_hook_transformers import Tiny as TinyHF

    policy = tmp_path / "none.yaml"
    policy.write_text("policies: []\n")
    daemon = run_daemon(args=["--policies", str(policy)])
    main_pid = os.getpid()

    def trial(number: int, on_step: Callable[[set[int]], None]) -> None:
        trainer = transformers.Trainer(  # a new Trainer per trial, the script's 0 workers
            model=TinyHF(on_step),
            args=train_args(tmp_path / f"trial-{number}", epochs=2),
            train_dataset=PidSamples(),
            callbacks=[GpuwatchTrainerCallback(job="hf-hpo", socket=daemon.socket)],
        )
        trainer.train()

    first: list[set[int]] = []

    def ask_once(pids: set[int]) -> None:
        first.append(pids)
        if len(first) == 1:
            asked = daemon.ctl("knob", "hf-hpo", "num_workers", "1", "--wait", "0")
            assert asked.returncode == 0, asked.stderr

    trial(0, ask_once)
    assert set().union(*first[:4]) == {main_pid} and main_pid not in set().union(*first[4:])
    second: list[set[int]] = []
    trial(1, second.append)
    assert len(second) == 8 and main_pid not in set().union(*second)  # from its first epoch


@pytest.mark.slow
def test_no_gpu_warning_for_workers_when_the_daemon_watches_no_gpus(
    run_daemon: Callable[..., RunningDaemon], tmp_path: Path
) -> None:
    policy = tmp_path / "none.yaml"
    policy.write_text("policies: []\n")
    config = tmp_path / "gpuwatchd.yaml"
    sleeper = {"command": [sys.executable, "-c", "import time; time.sleep(60)"], "workers": 1}
    config.write_text(json.dumps({"jobs": {"sleepy": sleeper}}))
    daemon = run_daemon(
        args=["--config", str(config), "--policies", str(policy), "--devices", "none"]
    )
    placed = daemon.wait_until(
        lambda: [e for e in daemon.events() if e.get("event") == "worker placed"],
        what="worker placed",
    )
    assert placed[0]["gpu"] is None
    warned = [e for e in daemon.events() if e.get("event", "").startswith("worker has no GPU")]
    assert warned == []  # --devices none: no GPU is what the operator asked for
