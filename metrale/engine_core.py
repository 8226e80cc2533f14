"""EngineCore: one model on one device, stepping all admitted requests together.

    out     = scheduler.schedule()              # what to run (CPU only)
    sampled = runner.execute(out)               # the forward pass + sampling
    done    = scheduler.update_from_output(...)  # commit tokens, stop checks, free

The serving engine process (metrale.engine_server) and the offline API (metrale.llm) both drive it;
neither touches the scheduler or the runner directly.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

from metrale.backends import make_ops
from metrale.backends.profiling import ProfiledOps
from metrale.cache.kv import ModelCaches
from metrale.cache.kv_dtypes import plan_kv_layers
from metrale.cache.swap import SwapSpace
from metrale.config import ConfigError, EngineConfig, ssm_pool_dtype
from metrale.grammar import Grammars
from metrale.models.checkpoint import Checkpoint
from metrale.models.registry import build_model
from metrale.request import Request
from metrale.runner import ModelRunner, SampledToken
from metrale.sampling import pick_engine_seed
from metrale.scheduler import Scheduler
from metrale.spec import make_speculation
from metrale.wire import TokenDelta, TokenLogprob

log = logging.getLogger("metrale.engine_core")

_CPU_KV_BUDGET_MB = 1024  # default KV pool on the CPU backend when no size is given
PROFILE_REPORT_STEPS = 256  # --profile logs the per-op times this often


@dataclass
class StepStats:
    num_seqs: int
    num_tokens: int
    seconds: float


def weight_bytes(model) -> int:
    """Bytes of the arrays a built model holds (each array once: tied embeddings count once),
    found by walking its attributes; the backend and the config are not the model's."""
    seen: set[int] = set()
    total = 0
    stack = [model]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
            continue
        seen.add(id(obj))
        if hasattr(obj, "nbytes") and hasattr(obj, "shape") and hasattr(obj, "dtype"):
            total += int(obj.nbytes)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__"):
            stack.extend(v for k, v in vars(obj).items() if k not in ("ops", "config"))
    return total


class EngineCore:
    def __init__(self, ckpt: Checkpoint, config: EngineConfig | None = None):
        self.config = (config or EngineConfig()).validate()
        self.seed = pick_engine_seed(self.config.seed)   # unseeded requests draw from it
        self.ops = make_ops(self.config)
        self.config.check_backend(self.ops.name)
        if self.config.profile:     # --profile: every op timed (CUDA graphs stay off)
            self.ops = ProfiledOps(self.ops)
        # The engine's kernels run on one stream of their own (graphs cannot be captured on
        # the legacy default stream); a no-op on the host.
        self.device = self.ops.device
        self.stream = self.device.new_stream()
        self.stream.use()
        self.model = build_model(ckpt, self.ops, mtp=_mtp_mode(self.config))
        spec = self._kv_spec(self.model.cache_spec())
        self.hybrid = bool(spec.gdn_layers)
        self.speculation = make_speculation(self.config, self.model, self.device.accelerator)
        self.ssm_dtype = ssm_pool_dtype(self.config.ssm_h_dtype)
        num_slots = max(1, Scheduler.num_state_slots_needed(self.config, self.hybrid))
        # past the scheduler's rows: one spare (padding rows of captured decode graphs write
        # there), then the GDN verify rows of speculative decoding
        num_verify = self.speculation.verify_rows if self.speculation and self.hybrid else 0
        num_blocks = self._num_kv_blocks(spec, num_slots + num_verify)
        # past the spare block: the KV blocks a self-speculative drafter writes its chains in
        num_scratch = self.speculation.scratch_blocks_needed(self.config.block_size) \
            if self.speculation else 0
        self.caches = ModelCaches(spec, self.ops, num_blocks=num_blocks + 1 + num_scratch,
                                  block_size=self.config.block_size,
                                  num_state_slots=num_slots + 1 + num_verify,
                                  ssm_dtype=self.ssm_dtype,
                                  kv_calibration_tokens=self.config.fp8_kv_calibration_tokens)
        self.swap = SwapSpace.for_caches(self.caches, self.config.swap_space_gb)
        self._num_blocks, self._num_slots = num_blocks, num_slots
        self.scheduler = self._new_scheduler()
        self.runner = self._new_runner(num_blocks, num_slots, num_verify, num_scratch)
        self.eos_token_ids: frozenset[int] = frozenset()
        self.grammars: Grammars | None = None   # structured output: set by use_tokenizer
        self._grammar_problem: str | None = None   # why use_tokenizer left it unset
        self.last_step: StepStats | None = None
        self.num_steps = 0
        if self.config.warmup == "on" or (self.config.warmup == "auto" and self.device.accelerator):
            self._warm_up()
        log.info("engine seed %d (%s)", self.seed,
                 "--seed" if self.config.seed is not None else "from the OS; --seed N repeats a run")
        log.info("engine ready: %s on %s; weights %.1f MiB, KV pool %d blocks x %d tokens "
                 "(%.1f MiB), state pool %d rows (%.1f MiB)", ckpt.model_type, self.ops.name,
                 weight_bytes(self.model) / 2**20, num_blocks, self.config.block_size,
                 num_blocks * spec.kv_bytes_per_block(self.config.block_size, self.ops.dtype) / 2**20,
                 num_slots, num_slots * spec.state_bytes_per_slot(self.ops.dtype, self.ssm_dtype) / 2**20)

    def _kv_spec(self, spec):
        """The model's cache spec with each attention layer's KV dtype (--kv-cache-dtype,
        --kv-high-precision-layers), logged per layer group."""
        cfg = self.config
        plan = plan_kv_layers(cfg.kv_cache_dtype, cfg.kv_high_precision_layers, spec.attention_layers)
        try:
            spec = spec.with_kv_dtypes(plan)
            spec.kv_bytes_per_block(cfg.block_size, self.ops.dtype)     # the layouts exist
        except ValueError as exc:
            raise ConfigError(f"--kv-cache-dtype {cfg.kv_cache_dtype}: {exc}") from exc
        if cfg.fp8_kv_calibration_tokens and not any("fp8" in f for f in plan.values()):
            log.warning("--fp8-kv-calibration-tokens %d: no layer stores fp8 KV (--kv-cache-dtype "
                        "%s): ignored", cfg.fp8_kv_calibration_tokens, cfg.kv_cache_dtype)
        log.info("KV cache %s: %s", cfg.kv_cache_dtype, spec.describe_kv(cfg.block_size, self.ops.dtype))
        return spec

    def _new_runner(self, num_blocks: int, num_slots: int, num_verify: int,
                    num_scratch: int) -> ModelRunner:
        """The runner with every collaborator it uses: the swap space, the drafter's binding,
        the device's sampler and captured graphs (none on the CPU backend)."""
        cfg = self.config
        verify_rows = range(num_slots + 1, num_slots + 1 + num_verify)
        keep_hidden = False
        if self.speculation is not None:
            # a drafter with caches of its own (the MTP head's KV) sizes them like the main pool;
            # one that reads the target's hidden states has the runner keep them
            self.speculation.give_scratch(range(num_blocks + 1, num_blocks + 1 + num_scratch),
                                          verify_rows)
            keep_hidden = self.speculation.bind(self.caches, self.ops)
        sampler = self.ops.device_sampler(
            self.model.vocab_size, max_batch=cfg.max_batch_size + num_verify,
            num_slots=max(cfg.max_batch_size, num_slots), seed=self.seed)
        graphs = self.ops.capture_graphs(self.model, self.caches, cfg, spare_block=num_blocks,
                                         spare_slot=num_slots, speculation=self.speculation)
        return ModelRunner(self.model, self.ops, self.caches, cfg.block_size, seed=self.seed,
                           verify_rows=verify_rows, swap=self.swap, graphs=graphs,
                           gpu_sampler=sampler, keep_hidden=keep_hidden)

    def _new_scheduler(self) -> Scheduler:
        return Scheduler(self.config, num_kv_blocks=self._num_blocks,
                         num_state_slots=self._num_slots, hybrid=self.hybrid, swap=self.swap)

    def _warm_up(self) -> None:
        """Run, before any client does, what a server's first steps would otherwise pay for:
        kernel modules loaded (and compiled on a cold cache), CuPy's own kernels (the gather
        and scatter of a multi-sequence step, the sampler's prompt marks) compiled, and the
        activation pool grown to its peak, a prefill of --max-prefill-tokens tokens. Measured
        on the H200 without it (SmolLM2-135M): the first request took 1.9 s to its first token,
        the first 3-sequence prefill 126 ms (an NVRTC compile), and each first step of a new
        token count 15 ms more than the next ones (cudaMalloc as the pool grew).

        Steps: the prefill budget split over a few sequences (one of them sampling with every
        option: top-k/p, min-p, penalties, a seed, logprobs), then one mixed step (their decodes
        and a new short prompt). The scheduler is then rebuilt (empty queue, free blocks, empty
        prefix cache) and the sampler's seed stream rewound, so serving starts as if this had
        not run. Running out of memory here is the activations not fitting: the error names the
        flags to change."""
        from metrale.sampling import SamplingParams

        cfg = self.config
        device = self.device
        grown_from = device.pool_bytes()
        t0 = time.perf_counter()
        seeds = self.runner.seed_state()
        vocab = int(self.model.vocab_size)
        room = max(1, min(cfg.max_batch_size, cfg.max_num_seqs))
        per_seq = max(1, min(cfg.max_seq_len - 3, cfg.max_prefill_tokens))
        budget = max(1, min(cfg.max_prefill_tokens, (self._num_blocks // 2) * cfg.block_size))
        nseq = min(max(2, -(-budget // per_seq)), max(1, room - 1))
        lengths = [max(1, min(per_seq, budget // nseq))] * nseq
        greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True).validate()
        full = SamplingParams(max_tokens=2, temperature=0.8, top_k=20, top_p=0.9, min_p=0.01,
                              repetition_penalty=1.1, presence_penalty=0.1, frequency_penalty=0.1,
                              seed=0, logprobs=2, ignore_eos=True).validate()
        try:
            self._warm_up_steps(lengths, vocab, mixed=room > nseq, greedy=greedy, full=full)
            self.stream.synchronize()
        except device.out_of_memory as e:
            raise MemoryError(
                f"the activations of a {cfg.max_prefill_tokens}-token prefill step do not fit on "
                f"the GPU next to the KV pool ({e}): lower --max-prefill-tokens or "
                f"--gpu-memory-utilization, or raise --oom-guard-mb") from None
        self.scheduler = self._new_scheduler()
        self.runner.restore_seed_state(seeds)
        if self.config.profile:
            self.ops.reset()
        self.last_step, self.num_steps = None, 0
        pool_now = device.pool_bytes()
        log.info("warm-up: %d prefill tokens in %d sequences and a mixed step, %.2f s; "
                 "activation pool %.1f MiB (grew %.1f MiB)", sum(lengths), len(lengths),
                 time.perf_counter() - t0, pool_now / 2**20, (pool_now - grown_from) / 2**20)

    def _warm_up_steps(self, lengths: list[int], vocab: int, mixed: bool, greedy, full) -> None:
        """The warm-up's prefills (one sequence per length; the second samples with `full`),
        then, when `mixed`, one step of their decodes beside a new prompt; run to the end."""
        sched = self.scheduler
        for i, n in enumerate(lengths):
            ids = [(7 + 31 * j + i) % vocab for j in range(n)]
            self.add_request(Request(f"__warmup-{i}", ids, full if i == 1 else greedy))
        while sched.waiting or any(not r.output_token_ids for r in sched.running):
            self.step()
        if self.has_unfinished() and mixed:     # their decodes + a new prompt
            self.add_request(Request("__warmup-mixed", [(11 + j) % vocab for j in range(17)],
                                     greedy))
        while self.has_unfinished():
            self.step()

    def _num_kv_blocks(self, spec, num_slots: int) -> int:
        cfg = self.config
        if not spec.attention_layers:
            return 2
        if cfg.num_kv_blocks:
            return cfg.num_kv_blocks
        per_block = max(1, spec.kv_bytes_per_block(cfg.block_size, self.ops.dtype))
        if self.speculation is not None:    # a drafter's own KV per block (the MTP head's)
            per_block += self.speculation.kv_bytes_per_block(cfg.block_size, self.ops.dtype)
        wanted = cfg.max_batch_size * -(-cfg.max_seq_len // cfg.block_size)
        memory = self.device.memory_info()
        if memory is None:      # the host: a fixed budget
            budget = (cfg.kv_cache_memory_mb or _CPU_KV_BUDGET_MB) * 2**20
        else:
            budget = self._gpu_kv_budget(spec, num_slots, memory)
        return max(2, min(wanted, budget // per_block))

    def _gpu_kv_budget(self, spec, num_slots: int, memory: tuple[int, int]) -> int:
        """Bytes left for the KV pool: --gpu-memory-utilization of the card, less what the
        weights already hold, the GDN state pool and --oom-guard-mb (activations, graphs,
        sampler)."""
        cfg = self.config
        free, total = memory
        state = (num_slots + 1) * spec.state_bytes_per_slot(self.ops.dtype, self.ssm_dtype)
        # (num_slots counts the verify rows of speculative decoding too)
        budget = int(total * cfg.gpu_memory_utilization) - (total - free) - state \
            - cfg.oom_guard_mb * 2**20
        log.info("GPU memory: %.1f GiB total, %.1f GiB in use (weights), state pool %.1f MiB, "
                 "guard %d MiB, KV budget %.1f GiB", total / 2**30, (total - free) / 2**30,
                 state / 2**20, cfg.oom_guard_mb, budget / 2**30)
        if budget <= 0:
            raise MemoryError(
                f"no GPU memory left for the KV cache ({budget / 2**20:.0f} MiB): raise "
                f"--gpu-memory-utilization, lower --oom-guard-mb, --max-batch-size or "
                f"--ssm-cache-slots, or use a smaller model")
        return budget

    def close(self) -> None:
        """Release host resources (swap files) and the CUDA ops' cuBLAS / cuBLASLt handles (a
        hot swap builds new ops; the old handles would leak)."""
        if self.swap is not None:
            self.swap.close()
        self.ops.close()

    def use_tokenizer(self, tokenizer) -> None:
        """The serving tokenizer: its EOS ids end requests, and constrained requests' grammars
        (metrale.grammar) are matched against its tokens."""
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids)
        try:
            self.grammars = Grammars(tokenizer, self.model.vocab_size, self.eos_token_ids)
        except (ValueError, ImportError) as e:
            # a tokenizer the grammar library cannot read (WordPiece, ...) serves everything
            # but structured output, which such requests are then refused with this reason
            # the record gets the reason's text, never `e`: a handler that keeps records
            # (pytest's log capture, a memory handler) would keep e's traceback, whose frames
            # hold this engine, so a released model's GPU memory stayed in use
            self.grammars, self._grammar_problem = None, str(e)
            log.warning("structured output is off for this model: the grammar library cannot "
                        "use its tokenizer (%s)", self._grammar_problem)

    # -- requests ---------------------------------------------------------------------------
    def can_admit(self) -> bool:
        return self.scheduler.can_admit()

    def add_request(self, req: Request) -> None:
        """Queue a request; raises ValueError when it can never run (too long, bad params).
        Its sampling parameters are validated here, for every caller (the server's Submits, the
        offline API), and its sampler state (random generator) set up, so a request that cannot
        have one is refused alone instead of failing a step."""
        req.sampling_params.validate()
        if not req.eos_token_ids and self.eos_token_ids:
            req.eos_token_ids = self.eos_token_ids
        self.runner.admit(req)
        try:
            if req.sampling_params.grammar is not None:
                if self.grammars is None:
                    raise ValueError("structured output is not available for this model: "
                                     + (self._grammar_problem or "the engine has no tokenizer "
                                        "(EngineCore.use_tokenizer)"))
                self.grammars.admit(req)
            self.scheduler.add_request(req)
        except BaseException:
            self._release(req.request_id)
            raise

    def abort_request(self, request_id: str) -> TokenDelta | None:
        req = self.scheduler.abort_request(request_id)
        if req is None:
            return None
        self._release(request_id)
        return self._output(req, None)

    def _release(self, request_id: str) -> None:
        """Forget a finished or aborted request's per-request state (sampler, drafter, grammar)."""
        self.runner.release(request_id)
        if self.speculation is not None:
            self.speculation.release(request_id)
        if self.grammars is not None:
            self.grammars.release(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ---------------------------------------------------------------------------
    def step(self, on_launch=None) -> list[TokenDelta]:
        """One step. `on_launch()`, when given, runs once inside it while the GPU works on the
        step (see ModelRunner.execute): the serving loop publishes the previous step's tokens
        there, so that host work overlaps the device's instead of following it."""
        with self.stream:
            return self._step(on_launch)

    def _step(self, on_launch=None) -> list[TokenDelta]:
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        grammars = self.grammars if self.grammars is not None and self.grammars.states else None
        masks = grammars.start_masks(out) if grammars is not None else None   # during the forward
        sampled = self.runner.execute(out, on_launch, masks)
        stopped = grammars.commit(sampled) if grammars is not None else ()
        emitted = {rid: s.token_ids for rid, s in sampled.items()}
        before = {s.request.request_id: s.request.num_output_tokens for s in out.seqs} \
            if out.num_drafts else None
        finished = self.scheduler.update_from_output(out, emitted, stopped)
        if self.speculation is not None:
            if out.num_drafts:
                self.speculation.record(out, emitted)
            self.speculation.after_step(out, emitted, self.runner.last_forward)
            self.speculation.propose(self.scheduler.running)
        seconds = time.perf_counter() - t0
        num_tokens = out.num_new_tokens
        self.last_step = StepStats(len(out.seqs), num_tokens, seconds)
        self.num_steps += 1
        if self.config.profile and self.num_steps % PROFILE_REPORT_STEPS == 0:
            log.info("op times over the last %d steps:\n%s", PROFILE_REPORT_STEPS,
                     self.ops.report())
            self.ops.reset()
        if out.seqs:
            self.scheduler.observe_step_time(num_tokens, seconds)
        outputs = {}
        for s in out.seqs:
            rid = s.request.request_id
            tok = sampled.get(rid)
            if tok is not None:
                outputs[rid] = self._output(
                    s.request, tok, None if before is None else
                    s.request.num_output_tokens - before[rid])
        for req in itertools.chain(finished, out.finished):
            self._release(req.request_id)
            if req.request_id not in outputs:
                outputs[req.request_id] = self._output(req, None)
        return list(outputs.values())

    @staticmethod
    def _output(req: Request, tok: SampledToken | None, num_new: int | None = None) -> TokenDelta:
        """What the step produced for `req` (the wire's TokenDelta, published as is).
        `num_new`: tokens the step appended (a verify emits several; a stop among them cuts the
        rest); None = `tok` alone."""
        if tok is None:
            ids, lps = (), ()
        elif tok.accepted is None:      # the common case, without building sequences
            ids = (tok.token_id,)
            lps = () if tok.logprob is None else \
                (TokenLogprob(tok.logprob, tuple(tok.top_logprobs or ())),)
        else:
            toks = [*tok.accepted, tok][:num_new]
            ids = tuple(t.token_id for t in toks)
            lps = tuple(TokenLogprob(t.logprob, tuple(t.top_logprobs or ()))
                        for t in toks if t.logprob is not None)
        return TokenDelta(
            req.request_id,
            ids,
            req.finish_reason if req.is_finished else None,
            req.num_prompt_tokens,
            len(req.output_token_ids),
            req.num_cached_tokens,
            lps,
            None,
            0,
            req.num_verifies,
            req.num_draft_tokens,
            req.num_accepted_tokens,
        )


def _mtp_mode(config: EngineConfig) -> str:
    """build_model's `mtp`: the checkpoint's MTP head is read only when --speculative may draft
    with it (ngram and self-speculation take precedence over MTP)."""
    if config.speculative and not (config.ngram_speculative or config.self_speculative):
        return "auto"
    return "off"
