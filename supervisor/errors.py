"""Errors shared by modules that must not import each other (``config`` validates against
the backend registry, which raises config errors)."""

from __future__ import annotations


class ConfigError(Exception):
    """A bad setting: the message is one line naming the key and what is wrong."""
