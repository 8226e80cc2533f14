"""Token-bucket rate limiting per key (API key, or client address when auth is off).

Lives in the engine so every frontend of one engine shares the same buckets: frontends are
stateless and a client's requests may land on any worker. The key table is bounded
(`max_keys`): when full, the least recently used key is dropped, so random keys cannot grow
memory without limit; a dropped key simply starts again with a full bucket.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from metrale import levers

MAX_KEYS = 10_000


@dataclass
class _Bucket:
    tokens: float
    updated: float


class TokenBuckets:
    def __init__(self, per_minute: int, burst: int, max_keys: int = MAX_KEYS, now=time.monotonic):
        self.rate = per_minute / 60.0
        self.capacity = float(burst or per_minute)
        self.max_keys = max_keys
        self.now = now
        self.buckets: OrderedDict[str, _Bucket] = OrderedDict()

    def _bucket(self, key: str) -> _Bucket:
        b = self.buckets.get(key)
        t = self.now()
        if b is None:
            b = _Bucket(self.capacity, t)
            self.buckets[key] = b
            if len(self.buckets) > self.max_keys:
                self.buckets.popitem(last=False)
        else:
            self.buckets.move_to_end(key)
            b.tokens = min(self.capacity, b.tokens + (t - b.updated) * self.rate)
            b.updated = t
        return b

    def take(self, key: str, amount: float) -> tuple[bool, float, float]:
        """-> (allowed, remaining, seconds until `amount` would be available)."""
        b = self._bucket(key)
        if b.tokens >= amount:
            b.tokens -= amount
            return True, b.tokens, 0.0
        wait = (min(amount, self.capacity) - b.tokens) / self.rate if self.rate else float("inf")
        return False, b.tokens, wait


class RateLimiter:
    def __init__(self, rpm: int = 0, tpm: int = 0, burst_rpm: int = 0, burst_tpm: int = 0,
                 max_keys: int = MAX_KEYS, now=time.monotonic):
        self.requests = TokenBuckets(rpm, burst_rpm, max_keys, now) if rpm > 0 else None
        self.tokens = TokenBuckets(tpm, burst_tpm, max_keys, now) if tpm > 0 else None

    @classmethod
    def from_levers(cls) -> "RateLimiter":
        return cls(levers.get("METRALE_RATE_LIMIT_RPM"), levers.get("METRALE_RATE_LIMIT_TPM"),
                   levers.get("METRALE_RATE_LIMIT_BURST_RPM"),
                   levers.get("METRALE_RATE_LIMIT_BURST_TPM"),
                   levers.get("METRALE_RATE_LIMIT_MAX_KEYS"))

    @property
    def num_keys(self) -> int:
        """Keys tracked now (at most max_keys per bucket table)."""
        return max((len(b.buckets) for b in (self.requests, self.tokens) if b), default=0)

    @property
    def enabled(self) -> bool:
        return self.requests is not None or self.tokens is not None

    def check(self, key: str, num_tokens: int) -> dict:
        """Charge one request of `num_tokens`; the answer carries the x-ratelimit-* figures."""
        result = {"allowed": True, "retry_after": 0.0}
        for name, buckets, amount in (("requests", self.requests, 1),
                                      ("tokens", self.tokens, num_tokens)):
            if buckets is None:
                continue
            ok, remaining, wait = buckets.take(key, amount)
            result[f"limit_{name}"] = int(buckets.capacity)
            result[f"remaining_{name}"] = int(remaining)
            result[f"reset_{name}"] = (buckets.capacity - remaining) / buckets.rate
            if not ok:
                result["allowed"] = False
                result["retry_after"] = max(result["retry_after"], wait)
        return result
