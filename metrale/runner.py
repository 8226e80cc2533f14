"""ModelRunner: executes one SchedulerOutput on the model and returns the sampled tokens.

The three-call step of the engine reads: `out = scheduler.schedule()` ->
`sampled = runner.execute(out)` -> `scheduler.update_from_output(out, sampled)`.
The runner owns the model, its caches (paged KV + GDN state pool), the sampler and the
per-request random generators; it knows nothing about queues or admission.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from metrale._hot.pack import pack_batch, sample_inputs
from metrale.backends.base import EngineGraphs
from metrale.forward import ForwardBatch
from metrale.sampling import Sampler, make_generator
from metrale.thinking_budget import force_thinking_close


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    # a speculative verify: the accepted drafts, emitted before this token (None: no verify)
    accepted: list["SampledToken"] | None = None

    @property
    def token_ids(self) -> int | list[int]:
        """What the scheduler appends: this token, or the accepted drafts then it."""
        if self.accepted is None:
            return self.token_id
        return [*(t.token_id for t in self.accepted), self.token_id]


class ModelRunner:
    """Built with every collaborator it uses (EngineCore._new_runner); nothing is set later.
    `swap`: metrale.cache.swap.SwapSpace when --swap-space-gb > 0; `graphs`: the captured
    forwards it replays (base.EngineGraphs: decode, step, verify; CUDA only); `gpu_sampler`: the
    device's sampler (metrale.backends.cuda.sampling.GpuSampler; None samples on the host);
    `keep_hidden`: a drafter reads the target's hidden states (the MTP head)."""

    def __init__(self, model, ops, caches, block_size: int, seed: int = 0,
                 verify_rows: range = range(0), *, swap=None, graphs: EngineGraphs | None = None,
                 gpu_sampler=None, keep_hidden: bool = False):
        graphs = graphs if graphs is not None else EngineGraphs()
        self.model = model
        self.ops = ops
        self.caches = caches
        self.block_size = block_size
        self.sampler = Sampler()
        self._seed = seed
        self._num_generators_made = 0
        self._generators: dict[str, np.random.Generator] = {}
        self.swap = swap
        self.graphs = graphs.decode         # metrale.backends.cuda.graphs.DecodeGraphs
        self.step_graphs = graphs.step      # StepGraphs (--prefill-graphs on)
        self.verify_graphs = graphs.verify  # StepGraphs(verify=True): speculative verify steps
        self.gpu_sampler = gpu_sampler
        self._sampler_slot: dict[str, int] = {}
        # GDN state-pool rows a verify step keeps its window's states in (metrale.spec)
        self.verify_rows = verify_rows
        self.hybrid = caches is not None and bool(caches.spec.gdn_layers)
        # a drafter that reads the target's hidden states (the MTP head): every forward leaves
        # (host batch, hidden [T, H]) here (a replayed graph's hidden rows, or an eager
        # model.forward_with_hidden's)
        self.keep_hidden = keep_hidden
        self.last_forward = None

    # -- per-request state ----------------------------------------------------------------
    def admit(self, request) -> None:
        """Set up a new request's random generator (raises ValueError for a seed it cannot
        take): from its own seed, else from (engine seed, admission counter)."""
        self._num_generators_made += 1
        self._generators[request.request_id] = make_generator(
            request.sampling_params.seed, (self._seed, self._num_generators_made))

    def _generator(self, request) -> np.random.Generator:
        gen = self._generators.get(request.request_id)
        if gen is None:     # a request that bypassed EngineCore.add_request
            self.admit(request)
            gen = self._generators[request.request_id]
        return gen

    def seed_state(self):
        """Where the streams that seed unseeded requests stand (rewind with restore_seed_state)."""
        sampler = self.gpu_sampler
        return (self._num_generators_made,
                None if sampler is None else sampler.seed_stream_state)

    def restore_seed_state(self, state) -> None:
        self._num_generators_made, rng_state = state
        if self.gpu_sampler is not None:
            self.gpu_sampler.seed_stream_state = rng_state

    def release(self, request_id: str) -> None:
        """Forget a finished or aborted request's sampler state."""
        self._generators.pop(request_id, None)
        self._sampler_slot.pop(request_id, None)

    # -- the step ---------------------------------------------------------------------------
    def build_batch(self, out) -> ForwardBatch:
        """Flatten the scheduled sequences into a ForwardBatch (packing runs in metrale._hot)."""
        ids, positions, qsl, seq_lens, tables, slots, state_slots, logits_indices = pack_batch(
            out.seqs, self.block_size)
        return ForwardBatch(
            input_ids=ids,
            positions=positions,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_tables=tables,
            slot_mapping=slots,
            state_slots=state_slots,
            logits_indices=logits_indices,
            block_size=self.block_size,
        )

    def execute(self, out, on_launch=None, masks=None) -> dict[str, SampledToken]:
        """Run the forward for `out` and sample one token for every sequence that asks.

        `on_launch()`, when given, is called once per step at the point where host work best
        overlaps the GPU's: after a decode graph and the sampler are queued and before the wait
        for the chosen ids; before an eager forward (whose launches are host-bound themselves,
        so work deferred past them would only wait longer). The engine publishes the previous
        step's tokens there. `masks`: the step's grammar masks (metrale.grammar.StepMasks),
        being computed while the forward runs; the sampler joins them."""
        hook = on_launch if on_launch is not None else _nothing
        if self.swap is not None:   # before anything: blocks freed by a swap-out are reused now
            self.swap.execute(out, self.caches)
        for src, dst in out.state_copies:
            self.caches.copy_state(src, dst)
        seqs = out.seqs
        if not seqs:
            hook()
            return {}
        self.last_forward = None
        if out.num_drafts:
            return self._execute_verify(out, hook, masks)
        # a decode step replays its captured graph, packed straight from the ScheduledSeqs;
        # with --prefill-graphs any other step that fits a token bucket replays one too
        graphs = None
        logits = self.graphs.run_decode(seqs) if self.graphs is not None else None
        if logits is not None:
            graphs = self.graphs
        elif self.step_graphs is not None:
            logits = self.step_graphs.run_step(seqs)
            graphs = self.step_graphs if logits is not None else None
        if logits is not None:
            self._keep_graph_hidden(out, graphs)
            sampling = [s for s in seqs if s.sample]
            if len(sampling) != len(seqs):
                logits = logits[np.asarray([i for i, s in enumerate(seqs) if s.sample], dtype=np.intp)]
        else:
            hook()
            hook = _nothing
            batch = self.build_batch(out)
            logits = self._forward(batch)
            sampling = [s for s in seqs if s.sample]
        for src, dst in out.state_saves:
            self.caches.copy_state(src, dst)
        if not sampling:
            hook()
            return {}
        requests = [s.request for s in sampling]
        if self.gpu_sampler is not None:
            sampled = self._sample_gpu(logits, sampling, hook, masks)
        else:
            hook()
            sampled = self._sample(self.ops.to_numpy(logits), requests, masks)
        force_thinking_close(sampled, requests)     # --max-thinking-budget: close </think>
        return sampled

    # -- speculative verify ------------------------------------------------------------------
    def _execute_verify(self, out, hook, masks=None) -> dict[str, SampledToken]:
        """A step with drafts (metrale.spec): eager forward with every row of a verifying
        sequence projected to logits and its window's GDN states kept; each row sampled as the
        target would sample it there; the accepted prefix's state restored."""
        seqs = out.seqs
        state_out, windows = self._state_out(seqs) if self.hybrid else (None, {})
        logits = None
        if self.verify_graphs is not None:
            logits = self.verify_graphs.run_step(seqs, state_out)
            if logits is not None:
                self._keep_graph_hidden(out, self.verify_graphs)
        if logits is None:
            hook()
            hook = _nothing
            batch = self.build_batch(out)
            batch.state_out = state_out
            logits = self._forward(batch)
        sampling = [s for s in seqs if s.sample]
        rows = _verify_rows(sampling)
        if self.gpu_sampler is not None:
            picks = self._sample_rows_gpu(logits, sampling, rows, hook, masks)
        else:
            hook()
            picks = self._sample_rows(self.ops.to_numpy(logits), rows, masks)
        sampled, partial, restores = {}, set(), []
        at = 0
        for s in sampling:
            n = 1 + s.num_drafts
            mine, at = picks[at: at + n], at + n
            if not s.num_drafts:
                sampled[s.request.request_id] = mine[0]
                continue
            a = self.accepted(s.request.draft_token_ids, s.num_drafts, mine)
            sampled[s.request.request_id] = SampledToken(
                mine[a].token_id, mine[a].logprob, mine[a].top_logprobs, accepted=mine[:a])
            if a < s.num_drafts and s.state_slot in windows:
                # the working row ran to the window's end: back to after the accepted tokens
                restores.append((windows[s.state_slot] + a, s.state_slot))
                partial.add(s.state_slot)
        self.caches.copy_states(restores)   # every sequence and layer in one launch (CUDA)
        for src, dst in out.state_saves:    # a snapshot is of a window's end: kept whole only
            if src not in partial:
                self.caches.copy_state(src, dst)
        force_thinking_close(sampled, [s.request for s in sampling])
        return sampled

    @staticmethod
    def accepted(drafts, num_drafts: int, picks) -> int:
        """Drafts kept: while each equals the sample of the row before it (perf/spec_bench.py
        replaces this on its runner to force an acceptance rate)."""
        a = 0
        while a < num_drafts and picks[a].token_id == drafts[a]:
            a += 1
        return a

    def _keep_graph_hidden(self, out, graphs) -> None:
        """keep_hidden after a replayed graph: the step's host batch and the hidden states of
        its token rows (the graph's own buffer: valid until its next replay, after the
        drafter's observe of this step)."""
        if self.keep_hidden:
            batch = self.build_batch(out)
            self.last_forward = (batch, graphs.last_hidden[: batch.num_tokens])

    def _forward(self, batch):
        """The eager forward of a host batch: logits, and with keep_hidden the hidden states
        of every new token too (ModelRunner.last_forward)."""
        dev = self.ops.upload_batch(batch)
        if not self.keep_hidden:
            return self.model.forward(dev, self.caches)
        logits, hidden = self.model.forward_with_hidden(dev, self.caches)
        self.last_forward = (batch, hidden)
        return logits

    def _state_out(self, seqs) -> tuple[np.ndarray, dict[int, int]]:
        """ForwardBatch.state_out of a verify step: the states after a verifying sequence's
        rows but its last go to consecutive verify rows. Returns it and {working slot: the
        sequence's first verify row}."""
        total = sum(s.num_new_tokens + s.num_drafts for s in seqs)
        state_out = np.full(total, -1, dtype=np.int32)
        windows = {}
        row = self.verify_rows.start
        end = 0
        for s in seqs:
            end += s.num_new_tokens + s.num_drafts
            if not s.num_drafts:
                continue
            if row + s.num_drafts > self.verify_rows.stop:
                raise RuntimeError(f"a verify step of {sum(x.num_drafts for x in seqs)} drafts "
                                   f"needs more than the {len(self.verify_rows)} verify rows of "
                                   "the state pool")
            state_out[end - 1 - s.num_drafts: end - 1] = np.arange(row, row + s.num_drafts)
            windows[s.state_slot] = row
            row += s.num_drafts
        return state_out, windows

    def _sample_rows(self, logits: np.ndarray, rows, masks=None) -> list[SampledToken]:
        """Host sampler over verify rows: (request, tokens before the row) each (a constrained
        request takes no drafts: its one row is masked)."""
        logits = np.asarray(logits, dtype=np.float32)
        result = self.sampler.sample(
            logits, [r.sampling_params for r, _ in rows], [self._generator(r) for r, _ in rows],
            [(r.prompt_token_ids, r.output_token_ids + extra if extra else r.output_token_ids)
             for r, extra in rows], _select(masks, [r for r, _ in rows]))
        picks = []
        for i in range(len(rows)):
            lp = result.logprobs[i] if result.logprobs is not None else None
            picks.append(SampledToken(int(result.token_ids[i]), None if lp is None else lp[0],
                                      None if lp is None else lp[1]))
        return picks

    def _sample_rows_gpu(self, logits, seqs, rows, before_wait, masks=None) -> list[SampledToken]:
        """The device sampler over verify rows: row j of a sequence samples at step
        (output tokens + j) in the sequence's slot, so its Philox draw is the one decoding
        would have made there. Verified requests have no penalties (metrale.spec), so the
        slot's counts are not read."""
        params, steps, slots = self._gpu_inputs(seqs)
        counts = np.array([1 + s.num_drafts for s in seqs])
        offsets = np.arange(len(rows)) - np.repeat(np.cumsum(counts) - counts, counts)
        return self._gpu_sample(logits, [r.sampling_params for r, _ in rows],
                                np.repeat(steps, counts) + offsets, np.repeat(slots, counts),
                                before_wait, _select(masks, [r for r, _ in rows]))

    def _sample_gpu(self, logits, seqs, before_wait=None, masks=None) -> dict[str, SampledToken]:
        """Sample on the device (one device->host copy of the chosen ids); penalty counts live
        in the sampler's row of the sequence's slot."""
        params, steps, slots = self._gpu_inputs(seqs)
        picks = self._gpu_sample(logits, params, steps, slots, before_wait,
                                 _select(masks, [s.request for s in seqs]))
        return {s.request.request_id: t for s, t in zip(seqs, picks)}

    def _gpu_inputs(self, seqs):
        """(params, steps, slots) of the sampling sequences; a request new to its slot begins
        there first (its penalty counts and seed)."""
        params, steps, slots, fresh = sample_inputs(seqs, self._sampler_slot)
        for i in fresh:
            s = seqs[i]
            r = s.request
            if self._sampler_slot.get(r.request_id) != s.state_slot:
                self.gpu_sampler.begin(s.state_slot, r.prompt_token_ids)
                self._sampler_slot[r.request_id] = s.state_slot
        return params, steps, slots

    def _gpu_sample(self, logits, params, steps, slots, before_wait,
                    grammar_masks=None) -> list[SampledToken]:
        want_lp = any(p.logprobs is not None for p in params)
        masked = {} if grammar_masks is None else {"grammar_masks": grammar_masks}
        res = self.gpu_sampler.sample(logits, params, steps, slots=slots, logprobs=want_lp,
                                      before_wait=before_wait, **masked)
        if not want_lp:
            return [SampledToken(t) for t in res.tolist()]
        picks = []
        for i, p in enumerate(params):
            k = p.logprobs
            top = None if k is None else [
                (int(t), float(lp)) for t, lp in zip(res.top_ids[i][:k], res.top_logprobs[i][:k])]
            picks.append(SampledToken(int(res.tokens[i]),
                                      None if k is None else float(res.logprobs[i]), top))
        return picks

    def _sample(self, logits: np.ndarray, requests, masks=None) -> dict[str, SampledToken]:
        logits = np.asarray(logits, dtype=np.float32)
        result = self.sampler.sample(
            logits,
            [r.sampling_params for r in requests],
            [self._generator(r) for r in requests],
            [(r.prompt_token_ids, r.output_token_ids) for r in requests],
            _select(masks, requests),
        )
        sampled = {}
        for i, r in enumerate(requests):
            lp = result.logprobs[i] if result.logprobs is not None else None
            sampled[r.request_id] = SampledToken(
                token_id=int(result.token_ids[i]),
                logprob=None if lp is None else lp[0],
                top_logprobs=None if lp is None else lp[1],
            )
        return sampled


def _nothing() -> None:
    pass


def _select(masks, requests):
    """The grammar masks of these sampler rows (joins their worker), or None."""
    return None if masks is None else masks.select(requests)


def _verify_rows(seqs) -> list[tuple]:
    """(request, the drafts before the row) of every logits row of a verify step, in order:
    one row per sampling sequence, 1 + drafts for a verifying one."""
    rows = []
    for s in seqs:
        r = s.request
        rows.append((r, []))
        drafts = r.draft_token_ids
        for j in range(1, s.num_drafts + 1):
            rows.append((r, drafts[:j]))
    return rows
