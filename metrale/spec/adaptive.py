"""Acceptance-adaptive draft counts: speculation that does not cost when drafts are rejected.

A verify with j drafts costs about 1 + c*j decode steps (c = METRALE_SPEC_DRAFT_COST, measured
on the H200: a 9B verify of 3 drafts at C=1 is 1.23x a decode step, so c ~ 0.08) and emits on
average (1 - a^(j+1)) / (1 - a) tokens when each draft is accepted with probability a given the
ones before it. Per request, `a` is estimated from its own verifies (accepted drafts over draft
positions decided: a drafts accepted of j decide min(a + 1, j) positions), exponentially
forgetting (DECAY per verify) from a prior of 1/2, and the request drafts the j <= its limit
that maximises tokens per cost. When that is 0 (drafting would cost more than it gains), it
skips drafting for 1, 2, 4 ... up to MAX_SKIP steps, each skip followed by one probe window at
the full limit, so a request whose drafts become good again is noticed. The emitted tokens do
not depend on any of this (a verify keeps the target's own samples); only the step count does.

Prompt lookup has its own rules (window doubling / halving, miss backoff: the operator
reference's) and is left to them; every other drafter goes through this.
"""
from __future__ import annotations

from metrale.request import Request

DECAY = 0.8
MAX_SKIP = 32
PRIOR = (1.0, 2.0)          # (accepted, decided): a = 1/2 before the first verify


def best_drafts(alpha: float, limit: int, cost: float) -> int:
    """The draft count j in 0..limit with the most expected tokens per unit of step cost."""
    best, best_rate = 0, 1.0
    tokens, term = 1.0, 1.0
    for j in range(1, limit + 1):
        term *= alpha
        tokens += term
        rate = tokens / (1.0 + cost * j)
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = j, rate
    return best


class _State:
    __slots__ = ("accepted", "decided", "skip", "backoff", "probe")

    def __init__(self):
        self.accepted, self.decided = PRIOR
        self.skip = 0           # steps left without drafts
        self.backoff = 1        # the next skip's length
        self.probe = False      # the skip ended: the next window drafts the full limit


class AdaptiveDrafts:
    def __init__(self, draft_cost: float):
        self.cost = max(0.0, float(draft_cost))
        self._states: dict[str, _State] = {}

    def limit(self, req: Request, limit: int) -> int:
        """The drafts `req` takes this step, at most `limit`. Reads the outcome of its last
        verify (`Request.last_verify`, set by the scheduler's commit of the step before)."""
        st = self._states.get(req.request_id)
        if st is None:
            st = self._states[req.request_id] = _State()
        if req.last_verify is not None:
            drafts, accepted = req.last_verify
            st.accepted = st.accepted * DECAY + accepted
            st.decided = st.decided * DECAY + min(accepted + 1, drafts)
        if limit <= 0:
            return 0
        if st.skip > 0:
            st.skip -= 1
            st.probe = st.skip == 0
            return 0
        if st.probe:
            st.probe = False
            return limit
        j = best_drafts(st.accepted / st.decided, limit, self.cost)
        if j == 0:
            st.skip = st.backoff
            st.backoff = min(2 * st.backoff, MAX_SKIP)
            st.skip -= 1
            st.probe = st.skip == 0
        else:
            st.backoff = 1
        return j

    def release(self, request_id: str) -> None:
        self._states.pop(request_id, None)
