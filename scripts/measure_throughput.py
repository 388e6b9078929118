#!/usr/bin/env python3
"""Measure a RUNNING worker's decode speed: single-stream tok/s and aggregate tok/s at N streams.

Starts nothing. Sends streamed /v1/completions with ``ignore_eos`` (every request produces exactly
``--max-tokens`` tokens) and times token events on arrival:

- single-stream decode tok/s = (tokens - 1) / (last token time - first token time) of one
  request alone (decode only: the prefill and TTFT are excluded);
- aggregate tok/s at N streams = all tokens of N concurrent requests / wall time from the first
  send to the last token (includes prefills, as a client sees it).

Usage:  python scripts/measure_throughput.py --base-url http://127.0.0.1:8000 [--concurrency 16]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx


async def one(client: httpx.AsyncClient, base: str, model: str | None, prompt: str, max_tokens: int,
              seed: int) -> tuple[float, list[float]]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.7, "seed": seed,
            "ignore_eos": True, "stream": True}
    if model:
        body["model"] = model
    sent = time.perf_counter()
    times: list[float] = []
    async with client.stream("POST", base + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"HTTP {r.status_code}: {(await r.aread()).decode()[:500]}")
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                if json.loads(line[6:]).get("choices"):
                    times.append(time.perf_counter())
    return sent, times


async def main_async(a: argparse.Namespace) -> None:
    limits = httpx.Limits(max_connections=a.concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10), limits=limits) as client:
        models = (await client.get(a.base_url + "/v1/models")).json()["data"]
        model = models[0]["id"]
        prompt = "Write a long story about a lighthouse keeper and the sea. Once upon a time"
        await one(client, a.base_url, model, prompt, 4, 0)  # warm-up

        single = []
        for i in range(a.repeats):
            _, t = await one(client, a.base_url, model, prompt, a.max_tokens, 100 + i)
            single.append((len(t) - 1) / (t[-1] - t[0]))
        t0 = time.perf_counter()
        results = await asyncio.gather(*[one(client, a.base_url, model, f"{prompt} (story {i})",
                                             a.max_tokens, i) for i in range(a.concurrency)])
        wall = max(t[-1] for _, t in results) - t0
        total = sum(len(t) for _, t in results)
        per_stream = [(len(t) - 1) / (t[-1] - t[0]) for _, t in results]
    print(f"server: {a.base_url}  model: {model}  max_tokens: {a.max_tokens}")
    print(f"single-stream decode: {statistics.median(single):.1f} tok/s "
          f"(median of {a.repeats}; {', '.join(f'{x:.1f}' for x in single)})")
    print(f"{a.concurrency} concurrent streams: aggregate {total / wall:.1f} tok/s "
          f"({total} tokens in {wall:.1f} s), per-stream decode median {statistics.median(per_stream):.1f} tok/s")
    print(f"ratio aggregate / single-stream: {total / wall / statistics.median(single):.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
