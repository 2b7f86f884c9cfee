#!/usr/bin/env python3
"""The reference server of bench/metrics_bench.py: the least an aiohttp process can do per
request, to set the daemon's scrape times against what this machine's scheduler alone costs.

    python bench/reference_http.py BYTES

Listens on 127.0.0.1 (a free port, printed as `port N` once listening) and answers `GET /metrics`
with BYTES bytes of fixed Prometheus-style text and `GET /healthz` with `ok`: the same framework,
interpreter and response size as gpupoold's /metrics, without building anything per request.
Runs until killed.
"""

from __future__ import annotations

import asyncio
import sys

from aiohttp import web


def main() -> int:
    size = int(sys.argv[1]) if len(sys.argv) > 1 else 11000
    line = b"gpupool_reference_sample_total 1\n"
    body = (line * (size // len(line) + 1))[:size]

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=body, content_type="text/plain")

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def run() -> None:
        app = web.Application()
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/healthz", healthz)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        print(f"port {runner.addresses[0][1]}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
