"""The Hugging Face adapter with the real ``transformers`` Trainer: a tiny model built in
code on the CPU (nothing downloaded, ``HF_HUB_OFFLINE=1``), a daemon stand-in on a real
Unix socket (``FakeDaemon``)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing is downloaded: the model is built in code
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import transformers

from gpuwatchd.hook.transformers import GpuwatchTrainerCallback
from test_hook import FakeDaemon, set_knob, wait_until


class PidSamples(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """32 samples; ``pid`` says which process loaded each."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(index)
        return {
            "x": torch.randn(4, generator=generator),
            "labels": torch.tensor(index % 2),
            "pid": torch.tensor(os.getpid()),
        }


class Tiny(torch.nn.Module):
    """A Trainer-compatible model: ``forward(**batch) -> {"loss", "logits"}``."""

    def __init__(self, on_step: Callable[[set[int]], None]) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)
        self.on_step = on_step

    def forward(
        self, x: torch.Tensor, labels: torch.Tensor, pid: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        if self.training:
            self.on_step(set(pid.tolist()))
        logits = self.layer(x)
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


def train_args(out: Path, epochs: int, **overrides: Any) -> Any:
    kwargs: dict[str, Any] = {
        "output_dir": str(out),
        "per_device_train_batch_size": 8,
        "num_train_epochs": epochs,
        "use_cpu": True,
        "report_to": [],
        "save_strategy": "no",
        "logging_strategy": "no",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "remove_unused_columns": False,
    }
    kwargs.update(overrides)
    return transformers.TrainingArguments(**kwargs)


@pytest.fixture
def daemon() -> Iterator[FakeDaemon]:
    directory = tempfile.mkdtemp(prefix="gwhf-", dir="/tmp")
    fake = FakeDaemon(os.path.join(directory, "control.sock"))
    yield fake
    fake.stop()
    shutil.rmtree(directory, ignore_errors=True)


def test_trainer_knob_change_reaches_the_live_loader_at_the_next_epoch(
    daemon: FakeDaemon, tmp_path: Path
) -> None:
    callback = GpuwatchTrainerCallback(job="hf", socket=daemon.path)
    pids: list[set[int]] = []

    def on_step(step_pids: set[int]) -> None:
        pids.append(step_pids)
        if len(pids) == 2:
            daemon.wait_for(lambda m: m.get("op") == "hello")
            daemon.send(set_knob("d-1", "num_workers", 1))
            assert callback.watch is not None
            watch = callback.watch
            assert wait_until(lambda: watch.pending_knobs == {"num_workers": 1})

    trainer = transformers.Trainer(
        model=Tiny(on_step),
        args=train_args(tmp_path, epochs=2),
        train_dataset=PidSamples(),
        callbacks=[callback],
    )
    trainer.train()
    hello = daemon.wait_for(lambda m: m.get("op") == "hello")
    reply = daemon.reply_to("d-1")
    assert daemon.wait_closed(0, 2.0)  # detached at on_train_end
    reports = [m["report"] for m in daemon.requests("report")]
    assert hello["job"] == "hf"
    assert hello["knobs"] == {  # from the args; prefetch_factor declared with 0 workers too
        "num_workers": {"value": 0, "min": 0, "max": 64},
        "prefetch_factor": {"value": 2, "min": 1, "max": 64},
    }
    assert reply["result"] == {"knob": "num_workers", "value": 1, "previous": 0, "applied": True}
    assert len(pids) == 8
    assert set().union(*pids[:4]) == {os.getpid()}  # epoch 0: the main process
    assert os.getpid() not in set().union(*pids[4:])  # epoch 1: a worker process
    assert reports[-1]["steps"] == 8
    assert reports[-1]["knobs"] == {"num_workers": 1, "prefetch_factor": 2}


def test_trainer_stop_saves_a_checkpoint_acks_and_ends(daemon: FakeDaemon, tmp_path: Path) -> None:
    callback = GpuwatchTrainerCallback(job="hf", socket=daemon.path, knobs={"num_workers": 0})
    steps: list[int] = []

    def on_step(step_pids: set[int]) -> None:
        steps.append(1)
        if len(steps) == 3:
            daemon.wait_for(lambda m: m.get("op") == "hello")
            daemon.send({"id": "d-1", "op": "stop", "reason": "preempted"})
            assert callback.watch is not None
            watch = callback.watch
            assert wait_until(lambda: watch.stop_requested)

    trainer = transformers.Trainer(
        model=Tiny(on_step),
        args=train_args(tmp_path, epochs=5),
        train_dataset=PidSamples(),
        callbacks=[callback],
    )
    trainer.train()
    reply = daemon.reply_to("d-1")
    assert reply["result"] == {"stopped": True, "at": "step", "reason": "preempted"}
    assert trainer.state.global_step == 3
    assert (tmp_path / "checkpoint-3").is_dir()  # should_save: the Trainer saved a checkpoint


def test_trainer_drain_ends_after_the_epoch(daemon: FakeDaemon, tmp_path: Path) -> None:
    callback = GpuwatchTrainerCallback(job="hf", socket=daemon.path, knobs={"num_workers": 0})
    steps: list[int] = []

    def on_step(step_pids: set[int]) -> None:
        steps.append(1)
        if len(steps) == 2:
            daemon.wait_for(lambda m: m.get("op") == "hello")
            daemon.send({"id": "d-1", "op": "drain"})
            assert callback.watch is not None
            watch = callback.watch
            assert wait_until(lambda: watch.drain_requested)

    trainer = transformers.Trainer(
        model=Tiny(on_step),
        args=train_args(tmp_path, epochs=5, gradient_accumulation_steps=2),
        train_dataset=PidSamples(),
        callbacks=[callback],
    )
    trainer.train()
    reply = daemon.reply_to("d-1")
    assert reply["result"] == {"drained": True, "at": "epoch_end", "epoch": 0}
    assert len(steps) == 4 and trainer.state.global_step == 2  # one epoch, 2 optimizer steps
