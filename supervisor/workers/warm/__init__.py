"""Warm restarts: a standby per local rank, so the next attempt's worker skips start-up.

``pool`` acts on what ``core.warm`` decides (when, which ranks, from where), ``supply``
supplies a standby (forked or spawned, one protocol), ``standbyset`` holds and starts
them, ``firstattempt`` forks the first attempt's before its launch, ``store`` is rank
0's store as warm ranks wait for it, ``standby`` is one standby's handle,
``standby_main`` the program it runs, ``reports`` its one report, ``autolearn`` and
``autopreload`` what ``--preload auto`` learns, ``childpreload`` the preload both child
programs run. See docs/design.md ("Warm restarts").
"""
