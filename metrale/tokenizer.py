"""Tokenizers for the serving path: `Tokenizer` (encode / decode / special tokens) and
`IncrementalDetokenizer` (token ids in, printable text out, one step at a time).

`Tokenizer` wraps a HF `tokenizers.Tokenizer` built from a `tokenizer.json`, plus the
`tokenizer_config.json` dict (named special tokens, `add_bos_token`) and optionally the
`generation_config.json` dict (extra end-of-sequence ids). It reproduces what
`transformers.AutoTokenizer` produces for the same folder, with two deliberate choices:

- BOS/EOS: when `tokenizer.json` has a post-processor, it alone decides which special tokens
  `encode(..., add_special_tokens=True)` adds (transformers 5 does the same: it drops
  `add_bos_token` / `add_eos_token` from the config when a tokenizer.json exists). When it has
  none, `add_bos_token` / `add_eos_token` from the config are honoured (both default to False),
  as transformers 4's Llama tokenizers did; transformers 5 ignores them there, which silently
  loses the BOS of Llama-2-style tokenizers saved without a post-processor.
- Truncation and padding stored in tokenizer.json are switched off: a server must never cut a
  prompt silently; length limits are enforced (with an error) by the API layer.

`decode` never applies `clean_up_tokenization_spaces` (which rewrites " ." to "." and breaks code).
"""
from __future__ import annotations

import json
import numbers
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import processors

NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                        "cls_token", "mask_token")


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded or used: the message names the file or setting."""


def _token_content(value: Any) -> str | None:
    """A special token as written in tokenizer_config.json: a string, an AddedToken dict
    ({"content": ...}), or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError(f"tokenizer_config.json: cannot read special token {value!r} "
                         "(expected a string or an object with a 'content' string)")


def _as_id_list(value: Any) -> list[int]:
    """generation_config.json's eos_token_id: an int, a list of ints, or null."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
        return list(value)
    raise TokenizerError(f"generation_config.json: eos_token_id must be an int or a list of "
                         f"ints, got {value!r}")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise TokenizerError(f"{path}: not valid JSON ({exc})") from exc


class Tokenizer:
    """Encode and decode text for one model.

    `backend` is the `tokenizers.Tokenizer`; `tokenizer_config` the tokenizer_config.json dict;
    `generation_config` the generation_config.json dict (only `eos_token_id` and
    `bos_token_id` are read). The backend is modified in place (post-processor, truncation).
    """

    def __init__(self, backend: tokenizers.Tokenizer, tokenizer_config: Mapping | None = None,
                 generation_config: Mapping | None = None):
        self._backend = backend
        self.config = dict(tokenizer_config or {})
        self.generation_config = dict(generation_config or {})
        self.special_tokens_map = self._read_named_special_tokens()
        backend.no_truncation()
        backend.no_padding()
        if backend.post_processor is None:
            backend.post_processor = self._bos_eos_template()
        self.special_token_ids = frozenset(self._special_ids())
        self.eos_token_ids = tuple(self._eos_ids())

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_file(cls, tokenizer_json: str | Path, tokenizer_config: Mapping | None = None,
                  generation_config: Mapping | None = None) -> "Tokenizer":
        """Load from a tokenizer.json path and the config dicts."""
        path = Path(tokenizer_json)
        if not path.is_file():
            raise TokenizerError(f"{path}: no such tokenizer.json (the model folder needs one; "
                                 "GGUF checkpoints get theirs from the loader)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on a bad file
            raise TokenizerError(f"{path}: cannot load with the `tokenizers` library ({exc})") from exc
        return cls(backend, tokenizer_config, generation_config)

    @classmethod
    def from_dir(cls, folder: str | Path) -> "Tokenizer":
        """Load tokenizer.json, tokenizer_config.json and generation_config.json (the last two
        optional) from a model folder."""
        folder = Path(folder)
        configs = [folder / name for name in ("tokenizer_config.json", "generation_config.json")]
        tok_cfg, gen_cfg = (_read_json(p) if p.is_file() else {} for p in configs)
        return cls.from_file(folder / "tokenizer.json", tok_cfg, gen_cfg)

    @classmethod
    def from_checkpoint(cls, checkpoint) -> "Tokenizer":
        """Load from a `metrale.models.checkpoint.Checkpoint`."""
        if not checkpoint.tokenizer_json:
            raise TokenizerError(f"{checkpoint.path}: the checkpoint has no tokenizer.json; "
                                 "pass a model folder that includes one")
        return cls.from_file(checkpoint.tokenizer_json, checkpoint.tokenizer_config,
                             checkpoint.generation_config)

    def _read_named_special_tokens(self) -> dict[str, str]:
        """bos/eos/unk/... as strings, present ones only (HF's `special_tokens_map`)."""
        found = {name: _token_content(self.config.get(name)) for name in NAMED_SPECIAL_TOKENS}
        return {name: token for name, token in found.items() if token is not None}

    def _bos_eos_template(self) -> processors.TemplateProcessing:
        """The post-processor for a tokenizer.json that has none: BOS / EOS per the config."""
        pieces, added = ["$A:0"], []
        for flag, name in (("add_bos_token", "bos_token"), ("add_eos_token", "eos_token")):
            token = self.special_tokens_map.get(name)
            if not self.config.get(flag, False) or token is None:
                continue
            token_id = self._backend.token_to_id(token)
            if token_id is None:
                raise TokenizerError(f"tokenizer_config.json sets {flag} but {name} {token!r} "
                                     "is not in tokenizer.json's vocabulary")
            pieces.insert(0 if name == "bos_token" else len(pieces), f"{token}:0")
            added.append((token, token_id))
        return processors.TemplateProcessing(single=" ".join(pieces), special_tokens=added)

    def _special_ids(self) -> Iterable[int]:
        for token_id, added in self._backend.get_added_tokens_decoder().items():
            if added.special:
                yield token_id
        for token in self.special_tokens_map.values():
            token_id = self._backend.token_to_id(token)
            if token_id is not None:
                yield token_id

    def _eos_ids(self) -> list[int]:
        """EOS from tokenizer_config first, then generation_config's (int or list), deduplicated."""
        ids = []
        if (eos := self.special_tokens_map.get("eos_token")) is not None:
            ids += [i for i in [self._backend.token_to_id(eos)] if i is not None]
        ids += _as_id_list(self.generation_config.get("eos_token_id"))
        return list(dict.fromkeys(ids))

    # ---- the interface ------------------------------------------------------------------

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (max id + 1 for contiguous vocabularies).
        The model's embedding may have more rows (padded); those ids never decode."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        if (bos := self.special_tokens_map.get("bos_token")) is not None:
            return self._backend.token_to_id(bos)
        value = self.generation_config.get("bos_token_id")
        return value if isinstance(value, int) else None

    @property
    def eos_token_id(self) -> int | None:
        """The primary end-of-sequence id (see `eos_token_ids` for all of them)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def special_tokens(self) -> frozenset[str]:
        return frozenset(self._backend.id_to_token(i) for i in self.special_token_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        encodings = self._backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    @property
    def chat_template(self) -> str | list | None:
        """The chat template from tokenizer_config.json (a string or a list of named ones)."""
        return self.config.get("chat_template")


# How many prompt tokens seed the detokenizer's window (vLLM uses 5 as well): enough context
# for a sentencepiece tokenizer to render the first generated token's leading space.
PROMPT_CONTEXT_TOKENS = 5
# Drop consumed ids from the front once this many have piled up.
_TRIM_AT = 256


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text pieces.

    The approach of vLLM/SGLang: keep two offsets into the ids, `prefix_offset` (start of the
    window that is re-decoded for context) and `read_offset` (end of what was already emitted).
    Each step decodes ids[prefix_offset:read_offset] and ids[prefix_offset:]; the new text is the
    difference. Re-decoding a small window keeps sentencepiece spacing right (a "▁word" token
    renders its space only when it is not first) and byte tokens (byte-fallback `<0xE2>` or
    byte-level BPE) combine into characters. Text ending in U+FFFD is an incomplete UTF-8
    sequence: it is held back until a later token completes it, or until `flush()`.

    With `prompt_ids`, the last few prompt tokens seed the window so that the first generated
    token is rendered as it would be after the prompt.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True, keep_special: Iterable[int] = ()):
        self._tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # special tokens rendered although specials are skipped (a tool-call format's markers,
        # e.g. Mistral's [TOOL_CALLS]): the others are dropped by id before decoding
        keep = frozenset(keep_special)
        self._dropped = frozenset(tokenizer.special_token_ids) - keep if skip_special_tokens and keep else None
        self._ids: list[int] = [int(t) for t in prompt_ids[-PROMPT_CONTEXT_TOKENS:]] \
            if len(prompt_ids) else []
        self.prefix_offset = 0
        self.read_offset = len(self._ids)

    def add(self, token_ids: int | Iterable[int]) -> str:
        """Feed one id or several; returns the text that became final (possibly "")."""
        if isinstance(token_ids, numbers.Integral):  # numpy integers included
            token_ids = (int(token_ids),)
        return "".join(self._step(token_id) for token_id in token_ids)

    def flush(self) -> str:
        """The text still held back (an unfinished UTF-8 sequence renders as U+FFFD, exactly as
        a full decode does). Call once when the sequence ends."""
        prefix_text, new_text = self._decode_window()
        self.prefix_offset = self.read_offset = len(self._ids)
        return new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""

    def _step(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix_text, new_text = self._decode_window()
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self._ids)
        self._trim()
        return new_text[len(prefix_text):]

    def _decode_window(self) -> tuple[str, str]:
        decode = self._tokenizer.decode
        window = self._ids[self.prefix_offset:]
        prefix_len = self.read_offset - self.prefix_offset
        skip = self.skip_special_tokens
        if self._dropped is not None:
            prefix = [i for i in window[:prefix_len] if i not in self._dropped]
            return (decode(prefix, skip_special_tokens=False),
                    decode([i for i in window if i not in self._dropped], skip_special_tokens=False))
        return (decode(window[:prefix_len], skip_special_tokens=skip),
                decode(window, skip_special_tokens=skip))

    def _trim(self) -> None:
        if self.prefix_offset >= _TRIM_AT:
            del self._ids[:self.prefix_offset]
            self.read_offset -= self.prefix_offset
            self.prefix_offset = 0
