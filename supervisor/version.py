"""The package's version: a leaf any layer may import (the package root imports the API)."""

from __future__ import annotations

__version__ = "0.1.0"  # keep equal to pyproject.toml's
