"""optuna-examples' ``pytorch/pytorch_checkpoint.py``, small and offline, for the retry tests
(run as a script, never imported by pytest).

    python tests/optuna_checkpoint_worker.py STORAGE_URL STUDY ARTIFACTS_DIR --trials N
        [--hang-at-epoch K --mark PATH]

As in the example: the storage records heartbeats and retries the trials its heartbeat check
fails (``RDBStorage(url, heartbeat_interval=1, failed_trial_callback=
RetryFailedTrialCallback())``); each epoch saves a checkpoint as an Optuna artifact
(``FileSystemArtifactStore``) and names it in the trial's ``artifact_id`` user attr; a trial
that is a retry looks through ``RetryFailedTrialCallback.retry_history`` of its trial for
the newest checkpoint of its chain, prints ``Loading checkpoint from trial N, epoch E.`` and goes
on from the next epoch. The model is a small MLP on a fixed synthetic data set (CPU), instead
of FashionMNIST. ``--hang-at-epoch K``: after saving epoch K's checkpoint the trial writes its
number to ``--mark`` and sleeps until killed, as a worker killed mid-trial.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

EPOCHS = 5


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("storage")
    parser.add_argument("study")
    parser.add_argument("artifacts")
    parser.add_argument("--trials", type=int, required=True)
    parser.add_argument("--hang-at-epoch", type=int, default=None)
    parser.add_argument("--mark", default=None)
    args = parser.parse_args()

    import optuna
    import torch
    from optuna.artifacts import FileSystemArtifactStore, download_artifact, upload_artifact
    from optuna.storages import RetryFailedTrialCallback
    from torch import nn

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    torch.manual_seed(0)
    inputs = torch.randn(256, 8)
    targets = (inputs[:, 0] > 0).long()
    artifact_store = FileSystemArtifactStore(base_path=args.artifacts)

    def objective(trial: optuna.Trial) -> float:
        units = trial.suggest_int("n_units", 4, 32)
        lr = trial.suggest_float("lr", 1e-3, 1e-1, log=True)
        model = nn.Sequential(nn.Linear(8, units), nn.ReLU(), nn.Linear(units, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)

        artifact_id = None
        retry_trial_number = None
        # The example passes ``trial``; Optuna 5 removed ``Trial.system_attrs`` (deprecated
        # since 3.1), which ``retry_history`` reads, so it gets the trial's FrozenTrial.
        frozen = trial.study.trials[trial.number]
        for trial_number in reversed(RetryFailedTrialCallback.retry_history(frozen)):
            artifact_id = trial.study.trials[trial_number].user_attrs.get("artifact_id")
            if artifact_id is not None:
                retry_trial_number = trial_number
                break

        with tempfile.TemporaryDirectory() as tmpdir:
            checkpoint_path = os.path.join(tmpdir, "checkpoint.pt")
            accuracy = 0.0
            if artifact_id is not None:
                download_artifact(
                    artifact_store=artifact_store,
                    file_path=checkpoint_path,
                    artifact_id=artifact_id,
                )
                checkpoint = torch.load(checkpoint_path)
                epoch_begin = checkpoint["epoch"] + 1
                print(
                    f"Loading checkpoint from trial {retry_trial_number}, "
                    f"epoch {checkpoint['epoch']}.",
                    flush=True,
                )
                model.load_state_dict(checkpoint["model_state_dict"])
                optimizer.load_state_dict(checkpoint["optimizer_state_dict"])
                accuracy = checkpoint["accuracy"]
            else:
                epoch_begin = 0

            for epoch in range(epoch_begin, EPOCHS):
                model.train()
                optimizer.zero_grad()
                loss = nn.functional.cross_entropy(model(inputs), targets)
                loss.backward()
                optimizer.step()
                with torch.no_grad():
                    accuracy = (model(inputs).argmax(dim=1) == targets).float().mean().item()
                trial.report(accuracy, epoch)
                print(f"Saving a checkpoint in epoch {epoch}.", flush=True)
                torch.save(
                    {
                        "epoch": epoch,
                        "model_state_dict": model.state_dict(),
                        "optimizer_state_dict": optimizer.state_dict(),
                        "accuracy": accuracy,
                    },
                    checkpoint_path,
                )
                artifact_id = upload_artifact(
                    artifact_store=artifact_store,
                    file_path=checkpoint_path,
                    study_or_trial=trial,
                )
                trial.set_user_attr("artifact_id", artifact_id)
                if epoch == args.hang_at_epoch:
                    tmp = Path(args.mark + ".tmp")
                    tmp.write_text(str(trial.number))
                    tmp.replace(args.mark)
                    while True:
                        time.sleep(60)
        return accuracy

    storage = optuna.storages.RDBStorage(
        args.storage,
        heartbeat_interval=1,
        failed_trial_callback=RetryFailedTrialCallback(),
    )
    study = optuna.load_study(study_name=args.study, storage=storage)
    study.optimize(objective, n_trials=args.trials)


if __name__ == "__main__":
    main()
