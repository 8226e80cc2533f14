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
from metrale.forward import ForwardBatch
from metrale.sampling import Sampler, make_generator
from metrale.thinking_budget import force_thinking_close


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


class ModelRunner:
    def __init__(self, model, ops, caches, block_size: int, seed: int = 0):
        self.model = model
        self.ops = ops
        self.caches = caches
        self.block_size = block_size
        self.sampler = Sampler()
        self._seed = seed
        self._num_generators_made = 0
        self._generators: dict[str, np.random.Generator] = {}
        self.swap = None            # metrale.cache.swap.SwapSpace when --swap-space-gb > 0
        self.graphs = None          # metrale.backends.cuda.graphs.DecodeGraphs on the CUDA backend
        self.step_graphs = None     # metrale.backends.cuda.graphs.StepGraphs (--prefill-graphs on)
        self.gpu_sampler = None     # metrale.backends.cuda.sampling.GpuSampler on CUDA
        self._sampler_slot: dict[str, int] = {}

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

    def execute(self, out, on_launch=None) -> dict[str, SampledToken]:
        """Run the forward for `out` and sample one token for every sequence that asks.

        `on_launch()`, when given, is called once per step at the point where host work best
        overlaps the GPU's: after a decode graph and the sampler are queued and before the wait
        for the chosen ids; before an eager forward (whose launches are host-bound themselves,
        so work deferred past them would only wait longer). The engine publishes the previous
        step's tokens there."""
        hook = on_launch if on_launch is not None else _nothing
        if self.swap is not None:   # before anything: blocks freed by a swap-out are reused now
            self.swap.execute(out, self.caches)
        for src, dst in out.state_copies:
            self.caches.copy_state(src, dst)
        seqs = out.seqs
        if not seqs:
            hook()
            return {}
        # a decode step replays its captured graph, packed straight from the ScheduledSeqs;
        # with --prefill-graphs any other step that fits a token bucket replays one too
        logits = self.graphs.run_decode(seqs) if self.graphs is not None else None
        if logits is None and self.step_graphs is not None:
            logits = self.step_graphs.run_step(seqs)
        if logits is not None:
            sampling = [s for s in seqs if s.sample]
            if len(sampling) != len(seqs):
                logits = logits[np.asarray([i for i, s in enumerate(seqs) if s.sample], dtype=np.intp)]
        else:
            hook()
            hook = _nothing
            batch = self.build_batch(out)
            logits = self.model.forward(self.ops.upload_batch(batch), self.caches)
            sampling = [s for s in seqs if s.sample]
        for src, dst in out.state_saves:
            self.caches.copy_state(src, dst)
        if not sampling:
            hook()
            return {}
        requests = [s.request for s in sampling]
        if self.gpu_sampler is not None:
            sampled = self._sample_gpu(logits, sampling, hook)
        else:
            hook()
            sampled = self._sample(self.ops.to_numpy(logits), requests)
        force_thinking_close(sampled, requests)     # --max-thinking-budget: close </think>
        return sampled

    def _sample_gpu(self, logits, seqs, before_wait=None) -> dict[str, SampledToken]:
        """Sample on the device (one device->host copy of the chosen ids); penalty counts live
        in the sampler's row of the sequence's slot."""
        params, steps, slots, fresh = sample_inputs(seqs, self._sampler_slot)
        for i in fresh:
            s = seqs[i]
            r = s.request
            if self._sampler_slot.get(r.request_id) != s.state_slot:
                self.gpu_sampler.begin(s.state_slot, r.prompt_token_ids)
                self._sampler_slot[r.request_id] = s.state_slot
        want_lp = any(p.logprobs is not None for p in params)
        res = self.gpu_sampler.sample(logits, params, steps, slots=slots, logprobs=want_lp,
                                      before_wait=before_wait)
        if not want_lp:
            return {s.request.request_id: SampledToken(t) for s, t in zip(seqs, res.tolist())}
        sampled = {}
        for i, s in enumerate(seqs):
            k = s.request.sampling_params.logprobs
            top = None if k is None else [
                (int(t), float(lp)) for t, lp in zip(res.top_ids[i][:k], res.top_logprobs[i][:k])]
            sampled[s.request.request_id] = SampledToken(
                int(res.tokens[i]), None if k is None else float(res.logprobs[i]), top)
        return sampled

    def _sample(self, logits: np.ndarray, requests) -> dict[str, SampledToken]:
        logits = np.asarray(logits, dtype=np.float32)
        result = self.sampler.sample(
            logits,
            [r.sampling_params for r in requests],
            [self._generator(r) for r in requests],
            [(r.prompt_token_ids, r.output_token_ids) for r in requests],
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
