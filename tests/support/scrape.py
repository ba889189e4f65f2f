"""Reading a /metrics page in tests: samples keyed by name and labels."""

from __future__ import annotations

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def scrape(url: str) -> Samples:
    """GET a /metrics page (it must answer 200, as text)."""
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        assert response.status == 200
        assert response.content_type == "text/plain"
        return parse(await response.text())


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def unlabelled(samples: Samples) -> dict[str, float]:
    """The samples without labels, by name."""
    return {name: v for (name, labels), v in samples.items() if not labels}
