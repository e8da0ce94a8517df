"""Warm restarts: a standby per local rank, so the next attempt's worker skips start-up.

``pool`` decides which ranks get one and when, ``standby`` is one standby's handle,
``standby_main`` the program it runs, ``reports`` its one report, ``autopreload`` what
``--preload auto`` learns. See docs/design.md ("Warm restarts").
"""
