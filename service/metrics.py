"""Prometheus metrics, read from Redis at scrape time.

Jobs end in worker processes and several API processes answer scrapes, so counters live in Redis
(``{p}stats``, incremented by the state-transition script) and every scrape reads them in one
pipeline: any API process gives the same, complete answer.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from ckptconv.core.job_records import DURATION_BUCKETS, STATES, TERMINAL

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


async def render(state: Any) -> bytes:
    keys = state.keys
    settings = state.settings
    queues = [settings.jobs_queue, settings.interactive_queue]
    pipe = state.redis.pipeline(transaction=False)
    for s in STATES:
        pipe.zcard(keys.global_state(s))
    for q in queues:
        pipe.llen(keys.queue(q))
    pipe.hgetall(keys.stats)
    out = await pipe.execute()
    counts = dict(zip(STATES, out[: len(STATES)], strict=True))
    depths = dict(zip(queues, out[len(STATES) : len(STATES) + len(queues)], strict=True))
    stats = out[-1]

    jobs = GaugeMetricFamily(
        "ckptconv_jobs", "Jobs by state (finished jobs within the retention period)", labels=["state"]
    )
    for s, n in counts.items():
        jobs.add_metric([s], n)
    finished = CounterMetricFamily("ckptconv_jobs_finished", "Jobs that reached a final state", labels=["state"])
    for s in sorted(TERMINAL):
        finished.add_metric([s], int(stats.get(f"finished:{s}", 0)))
    depth = GaugeMetricFamily("ckptconv_queue_depth", "Messages waiting in a queue", labels=["queue"])
    for q, n in depths.items():
        depth.add_metric([q], n)
    converted = CounterMetricFamily("ckptconv_bytes_converted", "Bytes of tensors converted by succeeded jobs")
    converted.add_metric([], int(stats.get("bytes_converted", 0)))
    buckets = [(str(float(b)), int(stats.get(f"duration_bucket:{b}", 0))) for b in DURATION_BUCKETS]
    buckets.append(("+Inf", int(stats.get("duration_bucket:+Inf", 0))))
    duration = HistogramMetricFamily(
        "ckptconv_job_duration_seconds",
        "Wall time of finished jobs, from first start to end",
        buckets=buckets,
        sum_value=float(stats.get("duration_sum", 0.0)),
    )

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed([jobs, finished, depth, converted, duration]))
    return generate_latest(registry)


class _Fixed:
    def __init__(self, families: list[Any]) -> None:
        self.families = families

    def collect(self) -> list[Any]:
        return self.families
