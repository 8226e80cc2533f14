"""Prometheus series, kept by the engine (the one place that sees every request) and served by
every frontend at GET /metrics through the control socket. prometheus_client does the text
exposition format and histogram buckets, which we would otherwise hand-roll."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_MASK_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class EngineMetrics:
    def __init__(self, model: str):
        self.model = model
        r = self.registry = CollectorRegistry()
        self.requests_total = Counter("metrale_requests", "requests admitted", registry=r)
        self.request_timeouts = Counter(
            "metrale_request_timeouts", "requests ended by --request-timeout (finish reason "
            "\"timeout\")", registry=r)
        self.requests_active = Gauge("metrale_requests_active", "requests in flight", registry=r)
        self.ttft = Histogram("metrale_time_to_first_token_seconds", "time to first token",
                              ["model"], buckets=_TTFT_BUCKETS, registry=r)
        self.prompt_tokens = Counter("metrale_prompt_tokens", "prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("metrale_generation_tokens", "tokens generated",
                                         registry=r)
        self.decoded_tokens = Counter("metrale_decoded_tokens", "tokens decoded", registry=r)
        self.prefix_hits = Counter("metrale_prefix_cache_hits", "prefix cache hits", registry=r)
        self.prefix_misses = Counter("metrale_prefix_cache_misses", "prefix cache misses",
                                     registry=r)
        self.prefix_hit_rate = Gauge("metrale_prefix_cache_hit_rate",
                                     "prefix cache hits / lookups", registry=r)
        self.waiting = Gauge("metrale_requests_waiting", "requests queued", registry=r)
        self.kv_usage = Gauge("metrale_kv_cache_usage_ratio", "KV blocks in use / total",
                              registry=r)
        self.spec_verifies = Counter(
            "metrale_spec_decode_verify", "speculative verifies by drafts verified (k) and outcome "
            "(all: every draft accepted, partial, none)", ["k", "outcome"], registry=r)
        self.spec_position = Counter(
            "metrale_spec_decode_draft_position", "drafts verified at each position of a chain "
            "(0 = first), accepted or not", ["position", "accepted"], registry=r)
        self.spec_draft_tokens = Counter("metrale_spec_decode_draft_tokens", "drafts verified",
                                         registry=r)
        self.spec_accepted_tokens = Counter("metrale_spec_decode_accepted_tokens",
                                            "drafts accepted", registry=r)
        self.spec_mean_accepted = Gauge(
            "metrale_spec_decode_mean_accepted_length", "tokens a verify emits on average "
            "(accepted drafts + the target's own), since start", registry=r)
        self.grammar_mask = Histogram(
            "metrale_grammar_mask_seconds", "time to compute one step's grammar token masks "
            "(structured output), on a worker thread while the forward runs",
            buckets=_MASK_BUCKETS, registry=r)
        self.grammar_wait = Counter(
            "metrale_grammar_mask_wait_seconds", "time the sampler waited for grammar masks "
            "after the forward (the part of the mask cost on the critical path)", registry=r)
        self.constrained = Counter("metrale_constrained_requests",
                                   "requests admitted with a grammar (structured output)",
                                   registry=r)
        self.stored_responses = Gauge("metrale_stored_responses",
                                      "responses in the store (/v1/responses)", registry=r)
        self.stored_conversations = Gauge("metrale_stored_conversations",
                                          "conversations in the store", registry=r)
        self.stored_conversation_items = Gauge("metrale_stored_conversation_items",
                                               "items of every stored conversation", registry=r)
        self.store_evictions = Counter("metrale_store_evictions",
                                       "stored objects evicted by --store-max-items / --store-ttl",
                                       registry=r)
        self._active = 0

    def admitted(self, num_prompt_tokens: int) -> None:
        self.requests_total.inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        self._active += 1
        self.requests_active.set(self._active)

    def first_token(self, seconds: float) -> None:
        self.ttft.labels(model=self.model).observe(seconds)

    def generated(self, n: int) -> None:
        self.generation_tokens.inc(n)
        self.decoded_tokens.inc(n)

    def finished(self, finish_reason: str | None = None) -> None:
        if finish_reason == "timeout":
            self.request_timeouts.inc()
        self._active -= 1
        self.requests_active.set(self._active)

    def set_gauges(self, core) -> None:
        sched = core.scheduler
        self.waiting.set(getattr(sched, "num_waiting", 0))
        cache = sched.prefix_cache
        if cache is not None:
            self.prefix_hits._value.set(cache.num_hits)
            self.prefix_misses._value.set(cache.num_misses)
            lookups = cache.num_hits + cache.num_misses
            self.prefix_hit_rate.set(cache.num_hits / lookups if lookups else 0.0)
        pool = sched.block_pool
        self.kv_usage.set(1.0 - pool.num_free_blocks / max(1, pool.num_blocks))
        spec = getattr(core, "speculation", None)
        if spec is not None:
            self._set_spec(spec.stats)
        grammars = getattr(core, "grammars", None)
        if grammars is not None:
            self._set_grammar(grammars.stats)

    def _set_grammar(self, st) -> None:
        """The per-step mask times since the last scrape into the histogram; totals as set."""
        while st.mask_seconds:
            self.grammar_mask.observe(st.mask_seconds.popleft())
        self.grammar_wait._value.set(st.wait_seconds)
        self.constrained._value.set(st.num_constrained)

    def set_store(self, counts: dict) -> None:
        self.stored_responses.set(counts["responses"])
        self.stored_conversations.set(counts["conversations"])
        self.stored_conversation_items.set(counts["conversation_items"])
        self.store_evictions._value.set(counts["evicted"])

    def _set_spec(self, st) -> None:
        """Counters follow the engine's totals (the scrape is the only reader)."""
        for (k, outcome), n in st.verifies.items():
            self.spec_verifies.labels(k=str(k), outcome=outcome)._value.set(n)
        for (j, accepted), n in st.position.items():
            self.spec_position.labels(position=str(j), accepted=str(accepted).lower())._value.set(n)
        self.spec_draft_tokens._value.set(st.draft_tokens)
        self.spec_accepted_tokens._value.set(st.accepted_tokens)
        self.spec_mean_accepted.set(st.mean_accepted_length)

    def render(self) -> str:
        return generate_latest(self.registry).decode()
