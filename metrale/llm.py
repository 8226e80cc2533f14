"""The offline Python API, in the spirit of vLLM's:

    llm = LLM("path/or/org/name")
    outs = llm.generate(["Hello", "The capital of France is"], SamplingParams(max_tokens=32))
    outs = llm.chat([{"role": "user", "content": "Hi"}])

Prompts of different lengths are submitted together and decode in the same batches.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from metrale.chat import load_chat_template, normalize_messages
from metrale.config import EngineConfig
from metrale.engine_core import EngineCore
from metrale.models.loader import load_checkpoint
from metrale.request import Request
from metrale.sampling import SamplingParams, apply_generation_defaults
from metrale.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError
from metrale.wire import TokenLogprob


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)   # per token, when asked
    num_cached_tokens: int = 0


class LLM:
    def __init__(self, model: str, *, cache_dir: str | None = None,
                 disable_template_overrides: bool = False, **engine_kwargs):
        self.checkpoint = load_checkpoint(model, cache_dir=cache_dir)
        self.tokenizer = self._tokenizer(self.checkpoint)
        self._disable_overrides = disable_template_overrides
        self._chat_template = None
        self.core = EngineCore(self.checkpoint, EngineConfig(**engine_kwargs))
        if self.tokenizer is not None:
            self.core.use_tokenizer(self.tokenizer)   # EOS ids, structured output grammars
        self._ids = itertools.count()

    @staticmethod
    def _tokenizer(ckpt) -> Tokenizer | None:
        """The checkpoint's tokenizer; None for tokenizer-less checkpoints (token-id prompts
        only, no text out), like vLLM's skip_tokenizer_init."""
        try:
            return Tokenizer.from_checkpoint(ckpt)
        except TokenizerError:
            return None

    @property
    def chat_template(self):
        if self._chat_template is None:
            self._chat_template = load_chat_template(
                self.checkpoint.model_type, self.checkpoint.chat_template,
                special_tokens=self.tokenizer.special_tokens_map if self.tokenizer else None,
                disable_overrides=self._disable_overrides)
        return self._chat_template

    def default_params(self, **overrides) -> SamplingParams:
        """Sampling parameters with the model's generation_config.json as defaults."""
        return apply_generation_defaults(overrides, self.checkpoint.generation_config)

    # -- public API -------------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[GenerationResult]:
        """Complete each prompt (text, or a list of token ids); results in prompt order."""
        single = isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
        prompts = [prompts] if single else list(prompts)
        params = sampling_params or self.default_params()
        params = params if isinstance(params, list) else [params] * len(prompts)
        token_lists = [p if not isinstance(p, str) else self.tokenizer.encode(p) for p in prompts]
        return self._run(token_lists, params)

    def chat(self, messages, sampling_params: SamplingParams | None = None, *, tools=None,
             chat_template_kwargs: dict | None = None) -> list[GenerationResult]:
        """Render one conversation (a list of messages) or several, then generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.render_chat(c, tools=tools, **(chat_template_kwargs or {})) for c in convs]
        return self.generate([self.tokenizer.encode(p, add_special_tokens=False) for p in prompts],
                             sampling_params)

    def render_chat(self, messages, tools=None, add_generation_prompt: bool = True, **kwargs) -> str:
        return self.chat_template.render(
            normalize_messages(messages, self.chat_template.content_format), tools=tools,
            add_generation_prompt=add_generation_prompt, chat_template_kwargs=kwargs)

    # -- the loop ---------------------------------------------------------------------------
    def _run(self, token_lists, params) -> list[GenerationResult]:
        results: dict[str, GenerationResult] = {}
        detoks: dict[str, IncrementalDetokenizer] = {}
        order = []
        for toks, p in zip(token_lists, params):
            for _ in range(p.n):       # EngineCore.add_request validates p
                rid = f"llm-{next(self._ids)}"
                self.core.add_request(Request(rid, toks, p))
                results[rid] = GenerationResult(prompt_token_ids=list(toks))
                if self.tokenizer is not None:
                    detoks[rid] = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=True)
                order.append(rid)
        while self.core.has_unfinished():
            for out in self.core.step():
                res = results.get(out.request_id)
                if res is None:
                    continue
                res.token_ids.extend(out.token_ids)
                res.logprobs.extend(out.logprobs)
                detok = detoks.get(out.request_id)
                if detok is not None:
                    res.text += detok.add(out.token_ids)
                res.num_cached_tokens = out.num_cached_tokens
                if out.finished:
                    res.finish_reason = out.finish_reason
                    if detok is not None:
                        res.text += detok.flush()
        return [results[rid] for rid in order]
