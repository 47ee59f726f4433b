"""Package layout for setuptools; the metadata is in pyproject.toml.

The shipped policies sit at the repository's top level (``policies/``) and install
as the package data directory ``gpuwatchd/policies/``; the systemd unit files
(``systemd/``) as ``gpuwatchd/unitfiles/``, read by ``gpuwatchd install-unit``.
"""

from setuptools import find_packages, setup

setup(
    packages=[
        *find_packages(include=["gpuwatchd", "gpuwatchd.*"]),
        "gpuwatchd.policies",
        "gpuwatchd.unitfiles",
    ],
    package_dir={"gpuwatchd.policies": "policies", "gpuwatchd.unitfiles": "systemd"},
)
