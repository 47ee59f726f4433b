"""A private single-node Slurm cluster for tests, from Debian's own packages.

:func:`slurm_cluster` starts ``munged -F`` (a private key and socket), ``slurmctld -D`` and
``slurmd -D -N localhost`` under :class:`subprocess.Popen`, all state, logs and sockets in
one private directory, ports free on 127.0.0.1 and bound there only
(``CommunicationParameters=NoCtldInAddrAny,NoInAddrAny``). The node declares 4 CPUs
(``SlurmdParameters=config_overrides``) so 4 array tasks run at once on a 2-core host;
``sched_interval=1`` and ``cred_expire=5`` make a requeued task start again in seconds;
``proctrack/linuxproc`` and ``task/none`` need no cgroup setup. Clients reach it with
``SLURM_CONF`` (:attr:`SlurmCluster.env`), which ``sbatch`` passes on to the tasks.

Teardown cancels every job, waits until ``squeue`` is empty, then stops slurmd, slurmctld
and munged in that order. Missing packages are a test *failure* naming them (``make slurm``
installs them), never a skip.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import pytest

from pg import free_port, stop_process

NODE = "localhost"
PARTITION = "debug"
CPUS = 4
INSTALL_HINT = (
    "install Debian's Slurm and munge: make slurm "
    "(apt-get install -y slurmctld slurmd slurm-client munge)"
)
_START_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 30.0

_CONF = """\
# A private single-node Slurm for gpuwatchd's tests (tests/slurm.py).
ClusterName=gwtest
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={base}/run/munge.sock,cred_expire=5
CredType=cred/munge
StateSaveLocation={base}/state/ctld
SlurmdSpoolDir={base}/state/d
SlurmctldPidFile={base}/run/slurmctld.pid
SlurmdPidFile={base}/run/slurmd.pid
SlurmctldLogFile={base}/log/slurmctld.log
SlurmdLogFile={base}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
JobRequeue=1
KillWait=2
MinJobAge=600
InactiveLimit=0
MailProg=/bin/true
SlurmdParameters=config_overrides
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=2000 State=UNKNOWN
PartitionName={partition} Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


@dataclass(frozen=True)
class SlurmCluster:
    """A running test cluster: its configuration file and how clients reach it."""

    base: Path
    conf: Path
    node: str = NODE
    partition: str = PARTITION

    @property
    def env(self) -> dict[str, str]:
        """The environment of a client (and, through ``sbatch``, of its tasks)."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(
        self, argv: Sequence[str], timeout_s: float = 30.0, env: Mapping[str, str] | None = None
    ) -> str:
        """Run a Slurm client command against this cluster (``env``: the caller's
        environment instead of this process's; ``sbatch`` passes it to the tasks); its
        stdout (fails the test on a non-zero exit)."""
        environ = self.env if env is None else {**env, "SLURM_CONF": str(self.conf)}
        done = subprocess.run(
            list(argv), env=environ, capture_output=True, text=True, timeout=timeout_s
        )
        if done.returncode != 0:
            _fail(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
        return done.stdout

    def submit(
        self, script: Path, text: str, array: str, env: Mapping[str, str] | None = None
    ) -> str:
        """Write ``text`` to ``script`` (executable) and ``sbatch --array=<array>`` it
        (``env``: the tasks' environment, as :meth:`run`); the array's job id. Task
        output goes to ``<script>.<task>.out``."""
        script.write_text(text)
        script.chmod(0o755)
        out = f"{script}.%a.out"
        argv = ["sbatch", "--parsable", f"--array={array}", "-o", out, str(script)]
        return self.run(argv, env=env).strip()

    def node_state(self) -> str:
        """``sinfo``'s long state of the node (``idle``, ``drained``, ``mixed``...)."""
        return self.run(["sinfo", "-h", "-N", "-n", self.node, "-o", "%T"]).strip()

    def running(self, job_id: str | None = None) -> list[str]:
        """Ids of the running jobs (array tasks as ``<array>_<task>``), of ``job_id`` only
        when given."""
        argv = ["squeue", "-h", "-t", "R", "-o", "%i"]
        if job_id is not None:
            argv += ["-j", job_id]
        return self.run(argv).split()

    def wait(self, what: str, ok: object, timeout_s: float = 60.0) -> None:
        """Poll ``ok()`` every 0.2 s until true; fail naming ``what`` (and the logs) else."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if ok():  # type: ignore[operator]
                return
            time.sleep(0.2)
        _fail(f"timed out waiting for {what}\n{self.logs()}")

    def wait_gone(self, job_id: str, what: str, timeout_s: float = 60.0) -> None:
        """:meth:`wait` until ``squeue`` lists nothing of ``job_id`` (a job, an array or
        one of its tasks): every task of it has ended, requeued runs included."""
        self.wait(what, lambda: not self.run(["squeue", "-h", "-j", job_id]).strip(), timeout_s)

    def logs(self) -> str:
        """The last lines of the daemons' logs, for failure messages."""
        parts = []
        for name in ("slurmctld.log", "slurmd.log", "munged.log"):
            path = self.base / "log" / name
            if path.exists():
                lines = path.read_text(errors="replace").splitlines()[-15:]
                parts.append(f"--- {name}\n" + "\n".join(lines))
        return "\n".join(parts)


def one_gpu(memory_used_gib: float) -> dict[str, Any]:
    """A FakeNvml script of one H100 (80 GiB) with ``memory_used_gib`` in use (the node's
    GPU for the daemons of the Slurm tests)."""
    return {
        "devices": [
            {
                "uuid": "GPU-00000000-0000-0000-0000-000000000000",
                "name": "NVIDIA H100 80GB HBM3",
                "memory_total_bytes": 80 * 2**30,
                "series": {
                    "utilization.gpu": [90.0],
                    "memory.used": [int(memory_used_gib * 2**30)],
                },
            }
        ]
    }


def daemon_args(
    directory: Path, cluster: SlurmCluster, slurm_section: Mapping[str, Any], policies: str
) -> list[str]:
    """``--config``/``--policies`` arguments of a daemon acting on ``cluster``: a config
    with the ``slurm:`` section (``conf`` and ``node`` of the cluster, then
    ``slurm_section``) and the ``policies`` YAML, written into ``directory``."""
    config, policy_file = directory / "gpuwatchd.yaml", directory / "policies.yaml"
    section = {"conf": str(cluster.conf), "node": cluster.node, **slurm_section}
    config.write_text(json.dumps({"slurm": section}))
    policy_file.write_text(policies)
    return ["--config", str(config), "--policies", str(policy_file)]


def _fail(message: str) -> NoReturn:
    pytest.fail(message, pytrace=False)


def _find(name: str) -> str:
    for directory in ("/usr/sbin", "/usr/bin"):
        path = Path(directory) / name
        if path.exists():
            return str(path)
    found = shutil.which(name)
    if found is None:
        _fail(f"{name} not found: {INSTALL_HINT}")
    return found


def _quiet(cluster: SlurmCluster, argv: Sequence[str]) -> str | None:
    """A client command's stdout, None when it failed (teardown goes on regardless)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(
            list(argv), env=cluster.env, capture_output=True, text=True, timeout=10
        )
        if done.returncode == 0:
            return done.stdout
    return None


@contextlib.contextmanager
def slurm_cluster(
    base: Path, extra_conf: Mapping[str, str] | None = None
) -> Iterator[SlurmCluster]:
    """Start a private single-node Slurm under ``base`` (a fresh directory every user may
    traverse; a Unix socket path must fit in 107 bytes); stop it at exit.
    ``extra_conf``: more ``Key=Value`` lines appended to slurm.conf."""
    munged, slurmctld, slurmd = _find("munged"), _find("slurmctld"), _find("slurmd")
    for sub in ("munge", "run", "log", "state/ctld", "state/d"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    os.chmod(base / "munge", 0o700)
    key = base / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    os.chmod(key, 0o400)
    conf = base / "slurm.conf"
    text = _CONF.format(
        base=base,
        node=NODE,
        partition=PARTITION,
        cpus=CPUS,
        ctld_port=free_port(),
        d_port=free_port(),
    )
    text += "".join(f"{k}={v}\n" for k, v in (extra_conf or {}).items())
    conf.write_text(text)
    cluster = SlurmCluster(base=base, conf=conf)
    procs: list[subprocess.Popen[bytes]] = []
    log = (base / "log" / "daemons.out").open("ab")
    try:
        procs.append(
            subprocess.Popen(
                [
                    munged, "-F",
                    f"--key-file={key}",
                    f"--socket={base}/run/munge.sock",
                    f"--pid-file={base}/run/munged.pid",
                    f"--log-file={base}/log/munged.log",
                    f"--seed-file={base}/munge/munged.seed",
                ],
                stdout=log, stderr=log, stdin=subprocess.DEVNULL,
            )
        )  # fmt: skip
        cluster.wait("munged's socket", (base / "run" / "munge.sock").exists, _START_TIMEOUT_S)
        env = cluster.env
        procs.append(
            subprocess.Popen(
                [slurmctld, "-D", "-c", "-f", str(conf)],
                stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=env,
            )
        )  # fmt: skip
        procs.append(
            subprocess.Popen(
                [slurmd, "-D", "-f", str(conf), "-N", NODE],
                stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=env,
            )
        )  # fmt: skip

        def idle() -> bool:
            for proc in procs:
                if proc.poll() is not None:
                    _fail(f"{proc.args[0]} exited ({proc.returncode})\n{cluster.logs()}")
            return _quiet(cluster, ["sinfo", "-h", "-o", "%T"]) == "idle\n"

        cluster.wait("the node to be idle", idle, _START_TIMEOUT_S)
        yield cluster
    finally:
        if len(procs) == 3 and procs[1].poll() is None:
            _quiet(cluster, ["scancel", "--full", "--quiet", "--user", str(os.getuid())])
            _quiet(cluster, ["scancel", "--quiet", "--user", str(os.getuid())])
            deadline = time.monotonic() + _STOP_TIMEOUT_S
            while time.monotonic() < deadline:
                left = _quiet(cluster, ["squeue", "-h", "-o", "%i"])
                if left is None or not left.strip():
                    break
                time.sleep(0.2)
        for proc in reversed(procs):  # slurmd, slurmctld, munged
            stop_process(proc)
        log.close()


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    """A private single-node Slurm, booted once per test module. Its directory is a fresh
    one under /tmp, mode 0755: munged refuses a socket in a directory that not everyone
    may traverse (pytest's tmp_path is 0700), and a socket path fits in 107 bytes."""
    base = Path(tempfile.mkdtemp(prefix="gw-slurm-", dir="/tmp"))
    try:
        os.chmod(base, 0o755)
        with slurm_cluster(base) as cluster:
            yield cluster
    finally:
        shutil.rmtree(base, ignore_errors=True)
