"""Prometheus text from a live /metrics, parsed with prometheus_client's own parser."""

from __future__ import annotations

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def metric_samples(text: str) -> Samples:
    """Every sample of a /metrics text, by name and sorted labels."""
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


async def metrics_text(port: int) -> str:
    """GET /metrics of a health server on 127.0.0.1:``port``."""
    async with (aiohttp.ClientSession() as client,
                client.get(f"http://127.0.0.1:{port}/metrics") as resp):
        return await resp.text()
