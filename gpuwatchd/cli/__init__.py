"""Command-line entry points: ``gpuwatchd`` (:mod:`.daemon`) and ``gpuwatchctl`` (:mod:`.ctl`).

Each exposes ``main(argv) -> int``; the console scripts call ``entry()``, which exits
with that status. Only this package imports :mod:`gpuwatchd.daemon`.
"""
