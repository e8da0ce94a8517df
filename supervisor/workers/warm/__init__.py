"""Warm restarts: standbys, the fork server that forks them, and what they preload."""
