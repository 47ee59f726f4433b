"""PyTorch's MNIST example (github.com/pytorch/examples, mnist/main.py) with the README's
few lines of hook added, on scikit-learn's bundled digits instead of MNIST (no download),
run with ``python`` from PATH against a real daemon.

The example reads ``len(train_loader.dataset)`` and ``len(test_loader.dataset)`` in its
progress lines, so ``watch.loader(...)`` must stand in for the DataLoader it wraps,
reading from the loader it holds now (after a knob change: the rebuilt one).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import RunningDaemon

MNIST_STYLE = """
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from sklearn.datasets import load_digits
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset

from gpuwatchd.hook import attach


class Net(nn.Module):
    def __init__(self):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, 1)
        self.conv2 = nn.Conv2d(16, 32, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(32 * 2 * 2, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = self.conv1(x)
        x = F.relu(x)
        x = self.conv2(x)
        x = F.relu(x)
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = self.fc1(x)
        x = F.relu(x)
        x = self.dropout2(x)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def train(args, model, device, train_loader, optimizer, epoch):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        if batch_idx % args.log_interval == 0:
            print('Train Epoch: {} [{}/{} ({:.0f}%)]\\tLoss: {:.6f}'.format(
                epoch, batch_idx * len(data), len(train_loader.dataset),
                100. * batch_idx / len(train_loader), loss.item()))
    print('loader: batch_size={} num_workers={} drop_last={} sampler={}'.format(
        train_loader.batch_size, train_loader.num_workers, train_loader.drop_last,
        type(train_loader.sampler).__name__))


def test(model, device, test_loader):
    model.eval()
    test_loss = 0
    correct = 0
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction='sum').item()
            pred = output.argmax(dim=1, keepdim=True)
            correct += pred.eq(target.view_as(pred)).sum().item()

    test_loss /= len(test_loader.dataset)

    print('\\nTest set: Average loss: {:.4f}, Accuracy: {}/{} ({:.0f}%)\\n'.format(
        test_loss, correct, len(test_loader.dataset),
        100. * correct / len(test_loader.dataset)))


def main():
    parser = argparse.ArgumentParser(description='PyTorch MNIST Example (on digits)')
    parser.add_argument('--batch-size', type=int, default=64)
    parser.add_argument('--test-batch-size', type=int, default=1000)
    parser.add_argument('--epochs', type=int, default=2)
    parser.add_argument('--lr', type=float, default=1.0)
    parser.add_argument('--gamma', type=float, default=0.7)
    parser.add_argument('--seed', type=int, default=1)
    parser.add_argument('--log-interval', type=int, default=10)
    parser.add_argument('--num-workers', type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    device = torch.device("cpu")

    digits = load_digits()
    images = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    labels = torch.tensor(digits.target, dtype=torch.long)
    dataset1 = TensorDataset(images[:1437], labels[:1437])
    dataset2 = TensorDataset(images[1437:], labels[1437:])

    with attach(job="mnist", knobs={"num_workers": args.num_workers}) as watch:
        train_loader = watch.loader(lambda k: DataLoader(
            dataset1, batch_size=args.batch_size, shuffle=True,
            num_workers=k["num_workers"]))
        test_loader = DataLoader(dataset2, batch_size=args.test_batch_size)

        model = Net().to(device)
        optimizer = optim.Adadelta(model.parameters(), lr=args.lr)

        scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
        for epoch in range(1, args.epochs + 1):
            train(args, model, device, train_loader, optimizer, epoch)
            test(model, device, test_loader)
            scheduler.step()


if __name__ == '__main__':
    main()
"""


def python_from_path() -> str:
    """``python`` as a user's shell finds it (the venv's bin first on PATH, as activated)."""
    found = shutil.which(
        "python",
        path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    )
    assert found is not None
    return found


def run_example(
    daemon: RunningDaemon, tmp_path: Path, *args: str
) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "main.py"
    script.write_text(MNIST_STYLE)
    env = dict(daemon.env, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    return subprocess.run(
        [python_from_path(), str(script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )


@pytest.mark.slow
def test_pytorch_mnist_example_runs_with_the_hook(
    run_daemon: Callable[..., RunningDaemon], tmp_path: Path
) -> None:
    policy = tmp_path / "none.yaml"
    policy.write_text("policies: []\n")
    daemon = run_daemon(args=["--policies", str(policy)])
    result = run_example(daemon, tmp_path, "--epochs", "2", "--num-workers", "1")
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    # The example's own progress lines, with len(train_loader.dataset) and len(train_loader)
    assert "Train Epoch: 1 [0/1437 (0%)]" in out, out
    assert "Train Epoch: 2 [640/1437 (43%)]" in out, out  # batch 10 of 23
    assert re.search(r"Test set: Average loss: \d+\.\d{4}, Accuracy: \d+/360 \(\d+%\)", out), out
    # what a DataLoader offers, read through the wrapper
    assert "loader: batch_size=64 num_workers=1 drop_last=False sampler=RandomSampler" in out
    attached = [e for e in daemon.events() if e.get("event") == "control.job_attached"]
    assert [e["job"] for e in attached] == ["mnist"]


@pytest.mark.slow
def test_the_wrapper_reads_the_rebuilt_loader_after_a_knob_change(
    run_daemon: Callable[..., RunningDaemon], tmp_path: Path
) -> None:
    import torch
    from torch.utils.data import DataLoader, SequentialSampler, TensorDataset

    from gpuwatchd.hook import attach

    policy = tmp_path / "none.yaml"
    policy.write_text("policies: []\n")
    daemon = run_daemon(args=["--policies", str(policy)])
    dataset = TensorDataset(torch.arange(40.0).unsqueeze(1), torch.zeros(40, dtype=torch.long))
    with attach(job="mnist", knobs={"num_workers": 0}, socket=daemon.socket) as watch:
        train_loader = watch.loader(
            lambda k: DataLoader(dataset, batch_size=8, num_workers=k["num_workers"])
        )
        assert len(train_loader.dataset) == 40 and len(train_loader) == 5
        assert train_loader.num_workers == 0 and train_loader.batch_size == 8
        assert isinstance(train_loader.sampler, SequentialSampler)
        assert train_loader.drop_last is False and train_loader.pin_memory is False
        assert train_loader.batch_sampler.batch_size == 8
        assert callable(train_loader.collate_fn)
        first = train_loader.loader
        daemon.wait_until(lambda: watch.connected, what="hello")
        pending = daemon.ctl("knob", "mnist", "num_workers", "1", "--wait", "0")
        assert pending.returncode == 0, pending.stderr
        daemon.wait_until(lambda: watch.pending_knobs == {"num_workers": 1}, what="set_knob")
        assert sum(len(x) for x, _ in train_loader) == 40  # this epoch rebuilds the loader
        assert train_loader.loader is not first
        assert train_loader.num_workers == 1  # from the new DataLoader
        assert train_loader.prefetch_factor == 2
        assert train_loader.dataset is dataset
        with pytest.raises(AttributeError):
            train_loader.no_such_attribute  # noqa: B018


@pytest.mark.slow
def test_a_new_process_of_the_job_starts_with_the_knob_the_job_had(
    run_daemon: Callable[..., RunningDaemon], tmp_path: Path
) -> None:
    # Issue 10 item 6: a restarted worker (here: the example run again under the same job
    # name, with the script's own --num-workers 0) starts where the job was, not where
    # its command line says, because the daemon hands back the applied value at hello.
    policy = tmp_path / "none.yaml"
    policy.write_text("policies: []\n")
    daemon = run_daemon(args=["--policies", str(policy)])
    script = tmp_path / "main.py"
    script.write_text(MNIST_STYLE)
    env = dict(daemon.env, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    first = subprocess.Popen(
        [python_from_path(), str(script), "--epochs", "6", "--num-workers", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
    )  # fmt: skip
    try:
        daemon.wait_until(
            lambda: any(e.get("event") == "control.job_attached" for e in daemon.events()),
            timeout_s=120,
            what="the first run attached",
        )
        asked = daemon.ctl("knob", "mnist", "num_workers", "1", "--wait", "60", timeout_s=90)
        assert asked.returncode == 0, asked.stderr
        out, err = first.communicate(timeout=300)
    finally:
        first.kill()
    assert first.returncode == 0, err[-3000:]
    assert "loader: batch_size=64 num_workers=1 " in out, out  # applied at an epoch start

    again = run_example(daemon, tmp_path, "--epochs", "1", "--num-workers", "0")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "loader: batch_size=64 num_workers=1 " in again.stdout, again.stdout
    assert "num_workers=0" not in again.stdout
