"""Drafters: who proposes the tokens a speculative verify checks.

A drafter sees the requests that will decode in the next step and sets each one's
`draft_token_ids` (possibly empty); the scheduler verifies as many as fit, and the verify's
outcome comes back on the request as `last_verify = (drafts, accepted)`. Every emitted token is
the target model's own pick, so a drafter only changes how many tokens a step emits, never which.

    NgramDrafter         --ngram-speculative: the longest recent n-gram match in the context
    PromptLookupDrafter  --prompt-lookup-decoding: copies of earlier context, with an adaptive
                         window and a miss backoff (the operator reference's rules)

Both index a request's context incrementally: each position is added once, when the token
after it is known, so a proposal costs O(new tokens) however long the context is.
"""
from __future__ import annotations

from dataclasses import dataclass

from metrale.request import Request


class _NgramIndex:
    """Where each n-gram (n in `sizes`) of a request's context last ended: key -> the position
    just after its most recent occurrence, kept for occurrences that have a token after them.
    The index keeps its own copy of the context, appended to as the request's output grows
    (not rebuilt from Request.all_token_ids each round: O(new tokens) per step); a compaction
    (the context changed in the middle) starts it over."""

    __slots__ = ("sizes", "tables", "num_indexed", "tokens", "num_output", "num_dropped")

    def __init__(self, sizes: tuple[int, ...]):
        self.sizes = sizes
        self._reset()

    def _reset(self) -> None:
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self.num_indexed = 0            # occurrences ending before this position are indexed
        self.tokens: list[int] = []
        self.num_output = 0             # of the request's output tokens, in `tokens`
        self.num_dropped = 0

    def sync(self, req: Request) -> list[int]:
        """The request's context (this index's copy), every occurrence that ends before its
        last token indexed (its follower must be known)."""
        if req.num_dropped_tokens != self.num_dropped:
            self._reset()
            self.num_dropped = req.num_dropped_tokens
        if not self.tokens:
            self.tokens = req.all_token_ids
        else:
            self.tokens.extend(req.output_token_ids[self.num_output:])
        self.num_output = req.num_output_tokens
        context = self.tokens
        end = len(context) - 1
        for stop in range(max(self.num_indexed, 1), end + 1):
            for n in self.sizes:
                if stop >= n:
                    self.tables[n][tuple(context[stop - n: stop])] = stop
        self.num_indexed = max(self.num_indexed, end + 1)
        return context

    def follower(self, n: int) -> int | None:
        """Position after the most recent earlier occurrence of the context's last n tokens."""
        if len(self.tokens) < n + 1:
            return None
        return self.tables[n].get(tuple(self.tokens[-n:]))


class NgramDrafter:
    """--ngram-speculative: for n from `max_n` down to `min_n`, the most recent earlier
    occurrence of the context's last n tokens; the tokens that followed it are the drafts.
    CPU-side, any model, no weights."""

    name = "ngram"

    def __init__(self, min_n: int = 2, max_n: int = 4):
        self.sizes = tuple(range(max_n, min_n - 1, -1))
        self._index: dict[str, _NgramIndex] = {}

    def propose(self, requests: list[Request], limits: list[int]) -> None:
        for req, k in zip(requests, limits):
            req.draft_token_ids = self._drafts(req, k) if k > 0 else []

    def _drafts(self, req: Request, k: int) -> list[int]:
        index = self._index.get(req.request_id)
        if index is None:
            index = self._index[req.request_id] = _NgramIndex(self.sizes)
        context = index.sync(req)
        for n in self.sizes:
            start = index.follower(n)
            if start is not None:
                return context[start: start + k]
        return []

    def release(self, request_id: str) -> None:
        self._index.pop(request_id, None)


@dataclass
class _CopyState:
    index: _NgramIndex
    window: int                 # drafts the next copy may propose
    misses: int = 0             # copies in a row that kept nothing
    skip: int = 0               # rounds left without copying (the miss backoff)
    copied: int = 0             # drafts of the copy now being verified (0: none)


class PromptLookupDrafter:
    """--prompt-lookup-decoding (the operator reference's rules):

    - a sequence whose last `ngram` tokens occurred earlier in its prompt or output, in a match
      spanning at least `min_match` tokens back from its end, proposes the tokens that followed
      that occurrence;
    - the copy window starts at `max_drafts`, doubles after a fully accepted copy and halves
      after a broken one, within [1, max_drafts];
    - inside a batch (more than one sequence decoding) a copy is cut to 3 drafts;
    - after copies that kept nothing, copying is skipped for 1, 2, 4 ... rounds, at most
      `miss_backoff` (0 never skips); any accepted copied token clears the backoff;
    - only batches of at most `max_seqs` decoding sequences propose copies.
    A round without a copy leaves the sequence to `fallback` (the MTP drafter when there is
    one), else it decodes one token.
    """

    name = "prompt-lookup"
    BATCH_CUT = 3

    def __init__(self, ngram: int = 4, max_drafts: int = 8, min_match: int = 8,
                 miss_backoff: int = 16, max_seqs: int = 8, fallback=None):
        self.ngram = ngram
        self.max_drafts = max_drafts
        self.min_match = max(min_match, ngram)
        self.miss_backoff = miss_backoff
        self.max_seqs = max_seqs
        self.fallback = fallback
        self._state: dict[str, _CopyState] = {}

    def propose(self, requests: list[Request], limits: list[int]) -> None:
        copying = len(requests) <= self.max_seqs
        cut = self.max_drafts if len(requests) == 1 else min(self.max_drafts, self.BATCH_CUT)
        rest, rest_limits = [], []
        for req, k in zip(requests, limits):
            state = self._state_of(req)
            self._learn(state, req)
            drafts = self._copy(state, req, min(k, cut, state.window)) if copying and k > 0 else []
            state.copied = len(drafts)
            req.draft_token_ids = drafts
            if not drafts:
                rest.append(req)
                rest_limits.append(k)
        if self.fallback is not None and rest:
            self.fallback.propose(rest, rest_limits)

    def _state_of(self, req: Request) -> _CopyState:
        state = self._state.get(req.request_id)
        if state is None:
            state = self._state[req.request_id] = _CopyState(_NgramIndex((self.ngram,)),
                                                             window=self.max_drafts)
        return state

    def _learn(self, state: _CopyState, req: Request) -> None:
        """Adapt the window and the backoff to how the last copy fared."""
        if not state.copied:
            if state.skip:
                state.skip -= 1
            return
        state.copied = 0
        if req.last_verify is None:     # the scheduler verified none of it (no room)
            return
        drafts, accepted = req.last_verify
        if accepted >= drafts:
            state.window = min(state.window * 2, self.max_drafts)
        else:
            state.window = max(state.window // 2, 1)
        if accepted:
            state.misses = state.skip = 0
        else:
            state.misses += 1
            if self.miss_backoff:
                state.skip = min(2 ** (state.misses - 1), self.miss_backoff)

    def _copy(self, state: _CopyState, req: Request, k: int) -> list[int]:
        context = state.index.sync(req)
        if state.skip or k <= 0:
            return []
        start = state.index.follower(self.ngram)
        if start is None or _match_length(context, start, self.min_match) < self.min_match:
            return []
        return context[start: start + k]

    def release(self, request_id: str) -> None:
        self._state.pop(request_id, None)
        if self.fallback is not None:
            self.fallback.release(request_id)


def _match_length(context: list[int], start: int, enough: int) -> int:
    """Tokens the context's end and the occurrence ending at `start` have in common, counted
    back (the occurrence's own tokens only: it ends before the context does), up to `enough`
    (a copy of a long file would otherwise walk its whole match every round)."""
    n, end = 0, len(context)
    while n < enough and n < start and context[start - 1 - n] == context[end - 1 - n]:
        n += 1
    return n


class ReplayDrafter:
    """Benchmarks and tests only (no flag): drafts the target's own continuation, recorded in a
    first pass (`continuations[request_id]`: its output tokens), each draft kept with
    probability `p` and otherwise replaced by another token, so acceptance is controlled: a
    chain accepts a draft with probability p wherever the target reproduces the recording
    (greedy). A corrupted draft ends the useful chain, as a real drafter's first miss does."""

    name = "replay"

    def __init__(self, continuations: dict[str, list[int]], p: float, vocab_size: int,
                 seed: int = 0):
        import random

        self.continuations = continuations
        self.p = p
        self.vocab_size = vocab_size
        self._rng = random.Random(seed)

    def propose(self, requests: list[Request], limits: list[int]) -> None:
        for req, k in zip(requests, limits):
            done = req.num_output_tokens
            truth = self.continuations.get(req.request_id, [])[done: done + k]
            drafts = []
            for t in truth:
                if self._rng.random() >= self.p:
                    t = (t + 1 + self._rng.randrange(self.vocab_size - 1)) % self.vocab_size
                drafts.append(t)
            req.draft_token_ids = drafts

    def release(self, request_id: str) -> None:
        pass
