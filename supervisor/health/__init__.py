"""Health edge: the HTTP server, Prometheus metrics and the event-loop lag probe.

The verdicts themselves are pure and live in ``supervisor.core.health``.
"""

from __future__ import annotations
