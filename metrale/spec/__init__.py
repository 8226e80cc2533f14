"""Speculative decoding: drafts proposed on the host, verified as extra rows of a step.

A verify is not a second engine (DESIGN.md §8): a decoding sequence with drafts d1..dk adds
the k + 1 rows [last token, d1 .. dk] to the step's ForwardBatch, every row projected to
logits. Row j is sampled from the target's own distribution given the context and d1..dj;
the drafts are accepted while each equals the sample of the row before it, and the first
sample that differs (or the one after the last draft) is emitted too. With a deterministic
drafter that is Leviathan et al.'s rejection sampling exactly (a draft d is accepted with
probability p(d); a rejection emits a sample of p restricted to the other tokens, renormalised),
so the output distribution is the target's, and greedy decoding keeps the target's argmax.

The rejected drafts' KV stays where it was written and is overwritten later (the sequence's
num_computed_tokens stops after the accepted ones); GDN layers keep the state after every
window token in rows of their own (`ForwardBatch.state_out`), and the runner copies back the
one of the accepted prefix.

    Speculation(config, model, on_cuda)   which drafter, how many drafts, the counters
      .propose(running)                   drafts for the requests that decode next step
      .record(out, sampled)               counters of a step's verifies
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from metrale import levers
from metrale.config import ConfigError
from metrale.request import Request
from metrale.spec.adaptive import AdaptiveDrafts
from metrale.spec.drafters import NgramDrafter, PromptLookupDrafter
from metrale.spec.mtp import MtpDrafter, check_quantization, default_drafts

log = logging.getLogger("metrale.spec")


def parse_k_ladder(text: str) -> list[tuple[int, int]]:
    """METRALE_MTP_K_LADDER "1:3,2:1,4:2": (batch size, drafts) pairs; a step of B decoding
    sequences uses the drafts of the largest listed batch size <= B. Sorted by batch size."""
    ladder = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        b, sep, k = item.partition(":")
        try:
            pair = (int(b), int(k))
        except ValueError:
            pair = None
        if not sep or pair is None or pair[0] < 1 or pair[1] < 0:
            raise ConfigError(f"METRALE_MTP_K_LADDER: {item!r} is not BATCH:DRAFTS (e.g. "
                              "1:3,2:1,4:2)")
        ladder.append(pair)
    return sorted(ladder)


@dataclass
class SpecStats:
    """Totals since start (the Prometheus series are set from them)."""
    verifies: dict[tuple[int, str], int] = field(default_factory=dict)   # (k, outcome) -> n
    position: dict[tuple[int, bool], int] = field(default_factory=dict)  # (j, accepted) -> n
    draft_tokens: int = 0
    accepted_tokens: int = 0
    num_verifies: int = 0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verify emits on average (accepted drafts + the target's own)."""
        return (self.accepted_tokens + self.num_verifies) / self.num_verifies if self.num_verifies else 0.0


class Speculation:
    """The configured speculative method (silent precedence ngram -> self-spec -> MTP, as the
    operator reference states) and the per-step draft limits:

    - no drafts when more than `max_batch` sequences decode (METRALE_SPEC_MAX_BATCH: above it a
      verify costs more than it gains);
    - `num_drafts` per sequence, or METRALE_MTP_K_LADDER's entry for the batch size;
    - never more than max_tokens leaves room for (the token after the drafts is emitted too);
    - none for requests the device's sampler cannot verify exactly (CUDA: repetition, presence
      or frequency penalties, whose counts would need the drafts) or under a thinking budget;
    - at most `verify_rows` drafts in one step (the GDN verify rows the state pool holds);
    - per request, the count its own acceptance pays for (metrale.spec.adaptive; not for
      prompt lookup, which has rules of its own; METRALE_SPEC_ADAPTIVE=0 turns it off).

    With the MTP drafter (`mtp`: alone, or prompt lookup's fallback), --num-drafts left at 1
    means the model's MTP default (metrale.spec.mtp.MTP_DEFAULT_DRAFTS: 3 for Qwen3.5 / 3.6);
    `num_drafts` is the value in force.
    """

    def __init__(self, config, model=None, on_cuda: bool = False):
        self.config = config
        self.on_cuda = on_cuda
        self.max_batch = max(1, min(int(levers.get("METRALE_SPEC_MAX_BATCH")),
                                    config.max_batch_size))
        self.ladder = parse_k_ladder(levers.get("METRALE_MTP_K_LADDER"))
        self.method, self.drafter = self._make_drafter(config, model)
        self.mtp = self.drafter if isinstance(self.drafter, MtpDrafter) else \
            getattr(self.drafter, "fallback", None)
        self.num_drafts = default_drafts(model, config.num_drafts) if self.mtp is not None \
            else config.num_drafts
        lone = config.prompt_lookup_max_drafts if config.prompt_lookup_decoding else 0
        batched = max([self.num_drafts, *(k for _, k in self.ladder)])
        if config.prompt_lookup_decoding:
            batched = max(batched, PromptLookupDrafter.BATCH_CUT)
        self.max_drafts = max(lone, batched)
        self.verify_rows = max(lone, batched * self.max_batch)
        if self.mtp is not None:
            self.mtp.size(self.max_batch, batched)
        # drafts per request from its own acceptance (prompt lookup keeps the reference's rules)
        self.adaptive = AdaptiveDrafts(float(levers.get("METRALE_SPEC_DRAFT_COST"))) \
            if levers.get("METRALE_SPEC_ADAPTIVE") and not self.method.startswith("prompt-lookup") \
            else None
        self.stats = SpecStats()
        self.enabled = True         # False: no drafts (benchmarks: the same engine without them)
        log.info("speculative decoding: %s, %d drafts per verify (%s), off above %d decoding "
                 "sequences", self.method, self.num_drafts,
                 "METRALE_MTP_K_LADDER " + ",".join(f"{b}:{k}" for b, k in self.ladder)
                 if self.ladder else "--num-drafts", self.max_batch)

    @staticmethod
    def _make_drafter(config, model):
        pl = dict(ngram=config.prompt_lookup_ngram, max_drafts=config.prompt_lookup_max_drafts,
                  min_match=config.prompt_lookup_min_match,
                  miss_backoff=config.prompt_lookup_miss_backoff,
                  max_seqs=config.prompt_lookup_max_seqs)
        if config.ngram_speculative:
            return "ngram", NgramDrafter()
        if config.self_speculative:
            from metrale.spec.self_spec import SelfSpecDrafter

            if model is None:
                raise ConfigError("--self-speculative drafts with the model itself")
            k = max([config.num_drafts, *(k for _, k in parse_k_ladder(
                levers.get("METRALE_MTP_K_LADDER")))])
            return "self-spec", SelfSpecDrafter(model, k)
        mtp = getattr(model, "mtp", None) if model is not None else None
        if mtp is None:
            if config.prompt_lookup_decoding:
                # no MTP weights: prompt lookup alone; rounds without a copy decode one token
                return "prompt-lookup", PromptLookupDrafter(**pl)
            raise ConfigError("--speculative drafts with the checkpoint's MTP head, and this "
                              "checkpoint has none (no mtp.* tensors): use --ngram-speculative, "
                              "or add --prompt-lookup-decoding to draft by copying context")
        check_quantization(mtp, config.mtp_quantization)
        drafter = MtpDrafter(config, mtp)
        if config.prompt_lookup_decoding:
            # copies first; a round without one drafts with the head
            return "prompt-lookup+mtp", PromptLookupDrafter(**pl, fallback=drafter)
        return "mtp", drafter

    # -- per step ----------------------------------------------------------------------------
    def drafts_for_batch(self, n: int) -> int:
        if n > self.max_batch:
            return 0
        k = self.num_drafts
        for b, dk in self.ladder:
            if b <= n:
                k = dk
        return k

    def eligible(self, req: Request) -> bool:
        p = req.sampling_params
        if p.thinking_budget is not None:
            return False
        if self.on_cuda and (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0
                             or p.frequency_penalty != 0.0):
            return False
        return True

    def propose(self, running: list[Request]) -> None:
        """Drafts for every running request that decodes in the next step (one uncomputed
        token); the others' drafts are cleared."""
        if not self.enabled or (len(running) > self.max_batch
                                and not self.config.prompt_lookup_decoding
                                and sum(r.num_uncomputed_tokens == 1 for r in running)
                                > self.max_batch):
            _clear(running)         # the wide-batch steady state: one pass, nothing drafted
            return
        decoding = []
        for r in running:
            if r.num_uncomputed_tokens == 1:
                decoding.append(r)
            elif r.draft_token_ids:
                r.draft_token_ids = []
        if not decoding:
            return
        k = self.drafts_for_batch(len(decoding))
        if k == 0 and not self.config.prompt_lookup_decoding:
            _clear(decoding)
            return
        share = self.verify_rows // len(decoding) if len(decoding) > 1 else self.verify_rows
        limits = []
        for r in decoding:
            room = r.sampling_params.max_tokens - r.num_output_tokens - 1
            limit = self.max_drafts if self.method.startswith("prompt-lookup") else k
            limits.append(max(0, min(limit, room, share)) if self.eligible(r) else 0)
        if len(decoding) > self.max_batch:
            limits = [0] * len(decoding)
        if self.adaptive is not None:
            limits = [self.adaptive.limit(r, n) for r, n in zip(decoding, limits)]
        if self.mtp is not None:    # prompt lookup's fallback gets its limits: cut to k
            self.mtp.cap = k
        self.drafter.propose(decoding, limits)

    def release(self, request_id: str) -> None:
        if self.adaptive is not None:
            self.adaptive.release(request_id)
        for d in self._drafters():
            d.release(request_id)

    # -- drafters with state on the device (the MTP head, self-speculation) ------------------
    def scratch_blocks_needed(self, block_size: int) -> int:
        """KV blocks past the pool's the drafter writes its chains' K/V in."""
        fn = getattr(self.drafter, "scratch_blocks_needed", None)
        return int(fn(self.max_batch, block_size)) if fn is not None else 0

    def give_scratch(self, blocks: range, state_rows: range) -> None:
        if getattr(self.drafter, "needs_scratch", False):
            self.drafter.scratch_blocks, self.drafter.state_rows = blocks, state_rows

    def bind(self, caches, ops) -> bool:
        """The engine's caches are allocated: a drafter that keeps caches of its own makes
        them now. True when the drafter reads the target's hidden states (the runner then
        keeps them: ModelRunner.last_forward)."""
        bound = False
        for d in self._drafters():
            bind = getattr(d, "bind", None)
            if bind is not None and bind(caches, ops):
                bound = True
        return bound

    def capture_graphs(self, main_graphs) -> None:
        """CUDA: a drafter with forwards of its own (the MTP head) captures them as graphs."""
        for d in self._drafters():
            capture = getattr(d, "capture_graphs", None)
            if capture is not None and getattr(d, "caches", None) is not None:
                capture(main_graphs)

    def kv_bytes_per_block(self, block_size: int, dtype) -> int:
        """KV bytes the drafter's own caches add per KV block of the main pool."""
        fns = [getattr(d, "kv_bytes_per_block", None) for d in self._drafters()]
        return sum(int(fn(block_size, dtype)) for fn in fns if fn is not None)

    def after_step(self, out, emitted, forward) -> None:
        """A step finished (the scheduler has committed `emitted`): a drafter that follows
        the target (the MTP head) catches up on the positions it computed. `forward` is the
        runner's (batch, hidden states) of the step, or None."""
        for d in self._drafters():
            observe = getattr(d, "observe", None)
            if observe is not None:
                observe(out, emitted, forward)

    def _drafters(self) -> list:
        """The drafter, and the MTP drafter when it is prompt lookup's fallback (the MTP head
        follows the target whoever drafts; tests may swap `drafter` for another)."""
        return [self.drafter] + ([self.mtp] if self.mtp is not None and self.mtp is not self.drafter
                                 else [])

    def record(self, out, sampled) -> None:
        """Count the verifies of a finished step (`sampled`: request id -> emitted tokens)."""
        st = self.stats
        for seq in out.seqs:
            k = seq.num_drafts
            if not k:
                continue
            emitted = sampled.get(seq.request.request_id)
            if emitted is None:
                continue
            accepted = len(emitted) - 1 if isinstance(emitted, list) else 0
            outcome = "all" if accepted == k else ("none" if accepted == 0 else "partial")
            st.verifies[(k, outcome)] = st.verifies.get((k, outcome), 0) + 1
            for j in range(k):
                key = (j, j < accepted)
                st.position[key] = st.position.get(key, 0) + 1
            st.draft_tokens += k
            st.accepted_tokens += accepted
            st.num_verifies += 1


def _clear(requests) -> None:
    for r in requests:
        if r.draft_token_ids:
            r.draft_token_ids = []


def make_speculation(config, model, on_cuda: bool) -> Speculation | None:
    """The engine's Speculation, or None when no speculative flag is on."""
    if not (config.speculative or config.ngram_speculative or config.self_speculative):
        return None
    return Speculation(config, model, on_cuda)
