"""Who runs a process, from its cgroup path: the systemd unit and the Kubernetes pod.

Parsing only (the text of ``/proc/<pid>/cgroup``; reading it is :mod:`gpuwatchd.jobs.procfs`'s
job). The Slurm job of a cgroup path is :func:`gpuwatchd.jobs.procfs.slurm_job_of_cgroup`.
The path shapes: docs/slurm.md, "Who else runs a process".
"""

from __future__ import annotations

import re
from typing import Final

from gpuwatchd.model import CgroupIdentity

__all__ = [
    "CGROUP_LINES_MAX",
    "KUBERNETES_POD_PATTERN",
    "SYSTEMD_UNIT_PATTERN",
    "cgroup_identity",
    "cgroup_paths",
    "kubernetes_pod_uid",
    "systemd_unit",
]

CGROUP_LINES_MAX: Final = 64
"""Lines of ``/proc/<pid>/cgroup`` looked at (cgroup v1 has one per hierarchy, about 13;
v2 one)."""
SYSTEMD_UNIT_PATTERN: Final = re.compile(
    r"[A-Za-z0-9:_.\\-]+(?:@[A-Za-z0-9:_.\\-]*)?\.(?:service|scope)"
)
"""A unit that holds processes (a service or a scope; slices hold none): systemd.unit(5)'s
characters (ASCII letters, digits, ``:``, ``-``, ``_``, ``.``, ``\\``), an optional
``@instance``, at most 255 characters (``UNIT_NAME_MAX``)."""
_USER_MANAGER: Final = re.compile(r"user@([0-9]{1,10})\.service")
_UID: Final = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"
KUBERNETES_POD_PATTERN: Final = re.compile(
    rf"(?:kubepods(?:-[a-z]+)*-)?pod({_UID}|[0-9a-f]{{32}})(?:\.slice)?"
)
"""A pod's cgroup as the kubelet makes it, one path component below a ``kubepods``
component, group 1 its uid: the cgroupfs driver's ``/kubepods/burstable/pod<uid>/<container>``
(``/kubepods/pod<uid>`` for a Guaranteed pod) and the systemd driver's
``/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid with _ for ->.slice/
cri-containerd-<id>.scope``, cgroup v1 or v2; a static pod's uid is its manifest's 32-hex
hash."""
_COMPONENT_MAX: Final = 255
"""The longest path component read (``NAME_MAX``); a longer one names nothing here."""


def cgroup_paths(text: str) -> list[tuple[str, str]]:
    """``(controllers, path)`` of each ``<id>:<controllers>:<path>`` line of
    ``/proc/<pid>/cgroup``'s ``text`` (cgroups(7)), the first :data:`CGROUP_LINES_MAX`
    lines; malformed lines (no absolute path) left out."""
    out = []
    for line in text.splitlines()[:CGROUP_LINES_MAX]:
        parts = line.split(":", 2)
        if len(parts) == 3 and parts[2].startswith("/"):
            out.append((parts[1], parts[2]))
    return out


def systemd_unit(text: str) -> tuple[str, int | None] | None:
    """The innermost service or scope in ``/proc/<pid>/cgroup``'s ``text`` and the uid of
    the user manager holding it (None: the system manager), or None when no path names one
    (a process in a slice only, in a cgroup namespace's ``/``).

    The path read: the unified hierarchy's (``0::``, cgroup v2), else the ``name=systemd``
    hierarchy's (v1), else none. ``/system.slice/slurmd.service`` is ``("slurmd.service",
    None)``; ``/user.slice/user-1000.slice/user@1000.service/app.slice/x.service`` is
    ``("x.service", 1000)``.
    """
    chosen: str | None = None
    for controllers, path in cgroup_paths(text):
        if controllers == "":
            chosen = path
            break
        if controllers == "name=systemd" and chosen is None:
            chosen = path
    if chosen is None:
        return None
    unit: str | None = None
    user: int | None = None
    for part in chosen.split("/"):
        if len(part) > _COMPONENT_MAX or not SYSTEMD_UNIT_PATTERN.fullmatch(part):
            continue
        manager = _USER_MANAGER.fullmatch(part)
        if manager is not None:
            user = int(manager.group(1))
        unit = part
    if unit is None:
        return None
    return unit, (None if unit == f"user@{user}.service" else user)


def kubernetes_pod_uid(text: str) -> str | None:
    """The uid of the Kubernetes pod in ``/proc/<pid>/cgroup``'s ``text`` (the first path
    with a component matching :data:`KUBERNETES_POD_PATTERN` below one that starts with
    ``kubepods``), lower-case with dashes, None outside a pod. Linear in ``text``."""
    for _, path in cgroup_paths(text):
        under_kubepods = False
        for part in path.split("/"):
            if len(part) > _COMPONENT_MAX:
                break
            if under_kubepods:
                found = KUBERNETES_POD_PATTERN.fullmatch(part)
                if found:
                    return found.group(1).replace("_", "-")
            under_kubepods = under_kubepods or part.startswith("kubepods")
    return None


def cgroup_identity(text: str) -> CgroupIdentity:
    """:func:`systemd_unit` and :func:`kubernetes_pod_uid` of ``text`` together."""
    unit = systemd_unit(text)
    return CgroupIdentity(
        systemd_unit=None if unit is None else unit[0],
        systemd_user=None if unit is None else unit[1],
        kubernetes_pod_uid=kubernetes_pod_uid(text),
    )
