"""``/metrics``: the controller's Prometheus metrics, for a scraper or an admin.

A scraper shows ``RELAUNCH_METRICS_TOKEN``, a secret that reads the metrics and nothing
else; an admin's API token also reads them (to look with curl). Any other caller gets
401 (no token, or an unknown one) or 403 (a user who is not an admin, a node). The
metrics name no job, user or node (``service.metrics``), but the counts of jobs and
nodes are the whole cluster's, which a tenant does not see through the API.
"""

from __future__ import annotations

import hmac

from fastapi import APIRouter, Response
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from service.api.deps import (
    BearerDep,
    MetricsDep,
    ReadFactoryDep,
    SettingsDep,
    require_admin,
    user_from_database,
)

router = APIRouter(tags=["metrics"])


@router.get("/metrics", include_in_schema=False)
def scrape(
    settings: SettingsDep, factory: ReadFactoryDep, credentials: BearerDep, metrics: MetricsDep
) -> Response:
    scrape_token = settings.metrics_token
    shown = credentials.credentials if credentials is not None else None
    if not (
        scrape_token is not None
        and shown is not None
        and hmac.compare_digest(shown.encode(), scrape_token.get_secret_value().encode())
    ):
        require_admin(user_from_database(factory, credentials))  # raises 401 or 403
    return Response(metrics.exposition(), media_type=CONTENT_TYPE_PLAIN_0_0_4)
