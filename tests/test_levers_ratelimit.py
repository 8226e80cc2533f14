"""Environment levers are declared once; rate-limit buckets hold under bursts and random keys."""
import pytest

from metrale import levers
from metrale.ratelimit import RateLimiter


def test_undeclared_lever_is_refused_with_the_declared_list():
    with pytest.raises(levers.UndeclaredLeverError, match="METRALE_MAX_BODY_BYTE\\b.*Declared"):
        levers.check_environment({"METRALE_MAX_BODY_BYTE": "1", "PATH": "/bin"})
    levers.check_environment({"METRALE_MAX_BODY_BYTES": "10", "OTHER": "x"})


def test_lever_values_parse_to_their_type():
    assert levers.get("METRALE_MAX_BODY_BYTES", {}) == 32 * 2**20
    assert levers.get("METRALE_RATE_LIMIT_RPM", {"METRALE_RATE_LIMIT_RPM": "60"}) == 60
    with pytest.raises(ValueError, match="METRALE_RATE_LIMIT_RPM"):
        levers.get("METRALE_RATE_LIMIT_RPM", {"METRALE_RATE_LIMIT_RPM": "sixty"})
    names = {row["name"] for row in levers.table()}
    assert names == set(levers.LEVERS)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_burst_then_refill():
    clock = Clock()
    rl = RateLimiter(rpm=60, burst_rpm=5, now=clock)
    results = [rl.check("k", 0) for _ in range(6)]
    assert [r["allowed"] for r in results] == [True] * 5 + [False]
    assert results[-1]["retry_after"] == pytest.approx(1.0)
    assert rl.check("other", 0)["allowed"]  # buckets are per key
    clock.t = 1.0
    assert rl.check("k", 0)["allowed"]
    assert not rl.check("k", 0)["allowed"]


def test_token_bucket_charges_tokens():
    rl = RateLimiter(tpm=1000, now=Clock())
    assert rl.check("k", 600)["allowed"]
    r = rl.check("k", 600)
    assert not r["allowed"] and r["remaining_tokens"] == 400 and r["retry_after"] > 0


def test_key_table_stays_bounded_under_random_keys():
    rl = RateLimiter(rpm=60, max_keys=1000, now=Clock())
    for i in range(100_000):
        rl.check(f"random-{i}", 0)
    assert len(rl.requests.buckets) == 1000


def test_disabled_limiter_allows_everything():
    rl = RateLimiter()
    assert not rl.enabled and rl.check("k", 10**9)["allowed"]
