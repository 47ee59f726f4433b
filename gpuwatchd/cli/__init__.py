"""Command-line entry points: ``gpuwatchd`` (:mod:`.main`; one module per command in
:mod:`.daemon_commands`) and ``gpuwatchctl`` (:mod:`.ctl`; one per command in :mod:`.commands`).

Each exposes ``main(argv) -> int``; the console scripts call ``entry()``, which exits
with that status. Only this package imports :mod:`gpuwatchd.daemon`.
"""
