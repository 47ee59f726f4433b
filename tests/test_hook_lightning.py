"""The Lightning adapter with the real ``lightning`` package: a tiny model on the CPU,
a real DataLoader, a daemon stand-in on a real Unix socket (``FakeDaemon``)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from gpuwatchd.hook.lightning import GpuwatchCallback
from test_hook import FakeDaemon, set_knob, wait_until

Message = dict[str, Any]


class PidPoints(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """32 samples of 4 features; the target is the pid of the process that loaded it."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(index)
        return torch.randn(4, generator=generator), torch.tensor(os.getpid())


class Tiny(L.LightningModule):
    def __init__(self, on_step: Callable[[int, int], None]) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.on_step = on_step
        self.pids: list[set[int]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, pids = batch
        while len(self.pids) <= self.current_epoch:
            self.pids.append(set())
        self.pids[self.current_epoch] |= set(pids.tolist())
        self.on_step(self.current_epoch, batch_idx)
        return self.layer(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def trainer(callback: GpuwatchCallback, tmp_path: Path, epochs: int) -> L.Trainer:
    return L.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )


@pytest.fixture
def daemon() -> Iterator[FakeDaemon]:
    import shutil
    import tempfile

    directory = tempfile.mkdtemp(prefix="gwpl-", dir="/tmp")
    fake = FakeDaemon(os.path.join(directory, "control.sock"))
    yield fake
    fake.stop()
    shutil.rmtree(directory, ignore_errors=True)


def test_lightning_knob_change_reaches_the_live_loader_at_the_next_epoch(
    daemon: FakeDaemon, tmp_path: Path
) -> None:
    callback = GpuwatchCallback(job="pl", socket=daemon.path)
    acked_early: list[bool] = []

    def on_step(epoch: int, index: int) -> None:
        if (epoch, index) == (0, 1):
            daemon.wait_for(lambda m: m.get("op") == "hello")
            daemon.send(set_knob("d-1", "num_workers", 1))
            assert callback.watch is not None
            watch = callback.watch
            assert wait_until(lambda: watch.pending_knobs == {"num_workers": 1})
        if (epoch, index) == (0, 3):
            acked_early.append(daemon.has_reply("d-1"))

    model = Tiny(on_step)
    loader = DataLoader(PidPoints(), batch_size=8, num_workers=0)
    trainer(callback, tmp_path, epochs=2).fit(model, train_dataloaders=loader)
    hello = daemon.wait_for(lambda m: m.get("op") == "hello")
    reply = daemon.reply_to("d-1")
    assert daemon.wait_closed(0, 2.0)  # detached at teardown
    reports = [m["report"] for m in daemon.requests("report")]
    assert hello["job"] == "pl"
    assert hello["knobs"]["num_workers"] == {"value": 0, "min": 0, "max": 64}  # from the loader
    assert acked_early == [False]
    assert reply["result"] == {"knob": "num_workers", "value": 1, "previous": 0, "applied": True}
    assert model.pids[0] == {os.getpid()}  # epoch 0 loaded in the main process
    assert os.getpid() not in model.pids[1]  # epoch 1 by the new worker process
    assert loader.num_workers == 1
    assert reports and reports[-1]["steps"] == 8  # 2 epochs x 4 batches, timed by the callback
    assert all(0 <= r["data_wait_fraction"] <= 1 and r["samples_per_s"] > 0 for r in reports)


def test_lightning_stop_saves_a_checkpoint_acks_and_ends_training(
    daemon: FakeDaemon, tmp_path: Path
) -> None:
    checkpoint = tmp_path / "stop.ckpt"
    reasons: list[str | None] = []
    callback = GpuwatchCallback(
        job="pl", socket=daemon.path, checkpoint_path=checkpoint, on_stop=reasons.append
    )

    def on_step(epoch: int, index: int) -> None:
        if (epoch, index) == (1, 0):
            daemon.wait_for(lambda m: m.get("op") == "hello")
            daemon.send({"id": "d-1", "op": "stop", "reason": "preempted"})
            assert callback.watch is not None
            watch = callback.watch
            assert wait_until(lambda: watch.stop_requested)
            assert not checkpoint.exists()

    model = Tiny(on_step)
    fit = trainer(callback, tmp_path, epochs=5)
    fit.fit(model, train_dataloaders=DataLoader(PidPoints(), batch_size=8))
    reply = daemon.reply_to("d-1")
    assert reply["result"] == {"stopped": True, "at": "step", "reason": "preempted"}
    assert checkpoint.exists()  # saved by on_stop, before the acknowledgement
    assert reasons == ["preempted"]
    assert fit.current_epoch <= 2 and fit.global_step == 5  # 4 + the step that saw the stop


def test_lightning_drain_ends_after_the_epoch(daemon: FakeDaemon, tmp_path: Path) -> None:
    callback = GpuwatchCallback(job="pl", socket=daemon.path, knobs={"num_workers": 0})

    def on_step(epoch: int, index: int) -> None:
        if (epoch, index) == (0, 1):
            daemon.wait_for(lambda m: m.get("op") == "hello")
            daemon.send({"id": "d-1", "op": "drain"})
            assert callback.watch is not None
            watch = callback.watch
            assert wait_until(lambda: watch.drain_requested)

    fit = trainer(callback, tmp_path, epochs=5)
    fit.fit(Tiny(on_step), train_dataloaders=DataLoader(PidPoints(), batch_size=8))
    reply = daemon.reply_to("d-1")
    assert reply["result"] == {"drained": True, "at": "epoch_end", "epoch": 0}
    assert fit.global_step == 4  # epoch 0 finished, no epoch after it


def test_prefetch_factor_is_declared_with_0_workers_and_set_once_workers_are_raised(
    daemon: FakeDaemon, tmp_path: Path
) -> None:
    callback = GpuwatchCallback(job="pl", socket=daemon.path)

    def on_step(epoch: int, index: int) -> None:
        if (epoch, index) == (0, 1):
            daemon.wait_for(lambda m: m.get("op") == "hello")
            daemon.send(set_knob("d-1", "prefetch_factor", 4))
            daemon.send(set_knob("d-2", "num_workers", 2))
            assert callback.watch is not None
            watch = callback.watch
            assert wait_until(lambda: len(watch.pending_knobs) == 2)

    model = Tiny(on_step)
    loader = DataLoader(PidPoints(), batch_size=8, num_workers=0)
    trainer(callback, tmp_path, epochs=2).fit(model, train_dataloaders=loader)
    hello = daemon.wait_for(lambda m: m.get("op") == "hello")
    assert hello["knobs"]["prefetch_factor"] == {"value": 2, "min": 1, "max": 64}
    assert daemon.reply_to("d-1")["ok"] and daemon.reply_to("d-2")["ok"]
    assert (loader.num_workers, loader.prefetch_factor) == (2, 4)
    assert os.getpid() not in model.pids[1]
