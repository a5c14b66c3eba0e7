"""GET /metrics: the service's Prometheus exposition (what it holds: `metrics.py`).

Behind the API key like every route but the health check: a scraper sends it as `X-API-Key` or, as
Prometheus' scrape config does, as `Authorization: Bearer KEY` (auth.py `BEARER_PATHS`).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from inflight.api.metrics import ServiceMetrics

router = APIRouter()


@router.get("/metrics", include_in_schema=False)
def metrics(request: Request) -> Response:
    # The app's own (create_app), not the lifespan's: request latencies count from the app's creation.
    registry: ServiceMetrics = request.app.state.metrics
    body, content_type = registry.render(request.headers.get("accept"))
    return Response(content=body, headers={"Content-Type": content_type})
