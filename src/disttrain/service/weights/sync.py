"""A weight sync's driver handle (`WeightSync`: `await service.weight_sync(...)`): it opens the ranks' publishers,
pushes each version through them and gathers their reports."""

from __future__ import annotations

import time
from typing import Any

from disttrain.service.weights.pieces import WeightSyncError, endpoint, parse_dtype


class WeightSync:
    """A TrainingService's weight sync (`await service.weight_sync(...)`): `endpoint` for the engines, `push()`."""

    def __init__(self, service, addresses: list[str], token: str, consumers: int, dtype: str | None,
                 bucket_mb: float, timeout_s: float, delta: bool):
        self.service, self.addresses, self.token = service, addresses, token
        self.consumers, self.dtype, self.timeout_s, self.delta = consumers, dtype, timeout_s, delta
        self.bucket_bytes = max(1, int(bucket_mb * (1 << 20)))
        self.endpoint = endpoint(addresses, token)
        self.version = 0
        self.reports: list[dict[str, Any]] = []

    @classmethod
    async def open(cls, service, consumers: int, dtype: str | None, bucket_mb: float, timeout_s: float, delta: bool,
                   host: str) -> WeightSync:
        import secrets

        from disttrain.errors import ConfigError

        if consumers < 1:
            raise ConfigError(f"weight_sync(consumers={consumers}): need at least 1 consumer")
        if timeout_s <= 0 or bucket_mb <= 0:
            raise ConfigError(f"weight_sync(timeout_s={timeout_s:g}, bucket_mb={bucket_mb:g}): both must be > 0")
        try:
            parse_dtype(dtype)
        except ValueError as exc:
            raise ConfigError(f"weight_sync: {exc}") from None
        token = secrets.token_hex(16)
        message = {"op": "weights_open", "host": host, "token": token, "delta": delta}
        replies = await service._run(lambda: service._every_rank(message))
        return cls(service, [r["address"] for r, _ in replies], token, consumers, dtype, bucket_mb, timeout_s, delta)

    async def push(self, delta: bool | None = None, timeout_s: float | None = None) -> dict[str, Any]:
        """Send the next version to every consumer; a report (version, bytes, seconds, per rank). Raises a
        `WeightSyncError` naming each consumer that did not take it (it is dropped; the others have it, and the
        service stays usable); a consumer that connects later gets a full version."""
        delta = self.delta if delta is None else delta
        if delta and not self.delta:
            raise ValueError("push(delta=True) on a sync opened with delta=False (it keeps no copy to compare)")
        version = self.version + 1
        message = {"op": "weights_push", "version": version, "dtype": self.dtype, "bucket_bytes": self.bucket_bytes,
                   "delta": delta, "wait_for": self.consumers, "timeout_s": timeout_s or self.timeout_s}
        start = time.perf_counter()
        replies = await self.service._run(lambda: self.service._every_rank(message))
        self.version = version
        ranks = [r["report"] for r, _ in replies]
        errors = list(dict.fromkeys(e for r in ranks for e in r["errors"]))
        report = {"version": version, "seconds": time.perf_counter() - start, "bytes": sum(r["bytes"] for r in ranks),
                  "full_bytes": sum(r["full_bytes"] for r in ranks),
                  "delta": delta, "ranks": ranks, "errors": errors}
        self.reports.append(report)
        if errors:
            raise WeightSyncError(f"weight sync version {version}: " + "; ".join(errors))
        return report

    async def close(self) -> None:
        await self.service._run(lambda: self.service._every_rank({"op": "weights_close"}))
