"""gpuwatchd: watch NVIDIA GPUs and the host, detect GPU-hour-wasting patterns, fix them.

Nothing happens at import time: importing this package opens no socket, installs no
signal handler and imports neither pynvml, psutil, torch nor optuna.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
