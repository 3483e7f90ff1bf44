"""Load: 500 requests from 32 concurrent clients with dynamic batching; nothing lost, no 5xx, RSS flat."""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx
import psutil


async def _drive(base_url: str, num_requests: int, concurrency: int) -> Counter:
    statuses: Counter = Counter()
    counter = iter(range(num_requests))
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:

        async def worker() -> None:
            for i in counter:
                body = {"prompt": f"load {i % 7}", "seed": i, "size": "32x32", "num_inference_steps": 1}
                response = await client.post("/v1/images/generations", json=body)
                if response.status_code == 200:
                    assert len(response.json()["data"]) == 1
                statuses[response.status_code] += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return statuses


def test_500_requests_32_clients_no_loss_flat_rss(dynamic_server):
    process = psutil.Process(dynamic_server.proc.pid)
    warm = asyncio.run(_drive(dynamic_server.base_url, 96, 32))
    assert warm == Counter({200: 96})
    rss_after_warmup = process.memory_info().rss
    statuses = asyncio.run(_drive(dynamic_server.base_url, 500, 32))
    rss_after_run = process.memory_info().rss
    assert sum(statuses.values()) == 500, statuses
    assert statuses == Counter({200: 500}), statuses
    growth = (rss_after_run - rss_after_warmup) / rss_after_warmup
    assert growth <= 0.10, f"RSS grew {growth:.1%} ({rss_after_warmup >> 20} -> {rss_after_run >> 20} MiB)"
