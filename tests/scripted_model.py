"""A test fixture: a scripted "model" that makes greedy (and any sane sampling) decoding emit a fixed
reply, so tool calling, reasoning, stop sequences and cut-offs can be driven end to end through
the real engine, frontends and SDKs. A tiny random model never calls a tool.

It runs on the CPU backend like any model. Its checkpoint is an HF folder whose config.json is

    {"model_type": "llama", "metrale_test_only": true, "vocab_size": V,
     "eos_token_id": ID, "reply_after": "<|im_start|>assistant\\n",
     "scripts": [{"when": "weather in Paris", "reply": "<tool_call>\\n{...}\\n</tool_call>"}, ...]}

plus a tokenizer.json and one (placeholder) safetensors file. It is a `llama` as far as the
loader goes (whose list of model types is fixed). Importing this module registers it: the
registry's llama builder is wrapped by `scripted_or`, which builds this model ONLY when
config.json says `"metrale_test_only": true` (no real checkpoint does), and the real llama
otherwise. The production registry knows nothing of it; a `met serve` under test loads it with
the lever METRALE_MODEL_PLUGINS=tests.scripted_model (`SERVE_ENV`), which the engine process
imports before it loads the model.

How a step picks the next token. The model keeps the token id of every KV slot it has seen
(its "KV cache" is the token ids themselves), so it can read each sequence's whole context;
it decodes it (special tokens kept) and:
  * the reply starts after the LAST `reply_after` in the context (the generation prompt; a
    list: the last of any of them, e.g. Mistral's [/INST] and [/TOOL_RESULTS]); text
    after it (a prefill such as `<tool_call>\\n`, then the generated tokens) is `generated`;
  * the script is the one whose `when` occurs LAST in the text before that point;
  * if `generated` is a prefix of the reply, the next token is the first token of the rest;
    if the engine forced a `</think>` (thinking budget), the text after the last `</think>` is
    matched against the reply after its `</think>` instead;
  * otherwise (nothing matches, reply exhausted) it emits `eos_token_id`.
The chosen token gets logit 100, every other 0: greedy picks it, and so does sampling at T=1.

    write_scripted_checkpoint(path, tokenizer_dir, scripts, ...) -> path
    make_scripted_model(path, scripts) -> path   (with its own byte-level tokenizer whose
        `<think>`, `</think>`, `<tool_call>`, `</tool_call>` (and DeepSeek V3's tool markers) are
        single tokens, as in Qwen's, and a Qwen-style ChatML template that renders tools, tool calls, tool results and
        reasoning, and opens `<think>` when enable_thinking is true)
"""
from __future__ import annotations

import json
import os
import struct

import numpy as np

from metrale.cache.kv import AttentionSpec, CacheSpec
from metrale.models import registry
from metrale.models.checkpoint import Checkpoint, CheckpointError

MODEL_TYPE = "llama"
TEST_FLAG = "metrale_test_only"
THINK_END = "</think>"
SERVE_ENV = {"METRALE_MODEL_PLUGINS": __name__}
"""The environment a `met serve` of a scripted checkpoint needs (tests.serving.Server(env=...))."""


class ScriptedLM:
    def __init__(self, config: dict, tokenizer, ops):
        self.config, self.ops, self.tok = config, ops, tokenizer
        self.vocab_size = int(config["vocab_size"])
        self.eos = int(config["eos_token_id"])
        self.reply_after = config.get("reply_after", "<|im_start|>assistant\n")
        self.scripts = list(config.get("scripts", []))
        self._ids: np.ndarray | None = None   # token id per KV slot

    def cache_spec(self) -> CacheSpec:
        return CacheSpec((AttentionSpec(1, 1),))

    def forward(self, batch, caches):
        b = self.ops.to_numpy
        ids, slots = np.asarray(b(batch.input_ids)), np.asarray(b(batch.slot_mapping))
        if self._ids is None:
            self._ids = np.zeros(caches.num_blocks * caches.block_size, np.int64)
        self._ids[slots] = ids
        qsl, positions = np.asarray(b(batch.query_start_loc)), np.asarray(b(batch.positions))
        tables, bs = np.asarray(b(batch.block_tables)), batch.block_size
        rows = np.asarray(b(batch.logits_indices))
        logits = np.zeros((len(rows), self.vocab_size), np.float32)
        for j, row in enumerate(rows):
            seq = int(np.searchsorted(qsl, row, side="right")) - 1
            pos = np.arange(int(positions[row]) + 1)
            context = self._ids[tables[seq, pos // bs] * bs + pos % bs]
            logits[j, self.next_token(context.tolist())] = 100.0
        return logits

    def next_token(self, context: list[int]) -> int:
        text = self.tok.decode(context, skip_special_tokens=False)
        markers = [self.reply_after] if isinstance(self.reply_after, str) else self.reply_after
        at, marker = max((text.rfind(m), m) for m in markers)
        if at < 0:
            return self.eos
        before, generated = text[:at], text[at + len(marker):]
        best, reply = -1, None
        for s in self.scripts:
            hit = before.rfind(s["when"])
            if hit > best:
                best, reply = hit, s["reply"]
        if reply is None:
            return self.eos
        rest = _rest(reply, generated)
        if not rest:
            return self.eos
        return self.tok.encode(rest, add_special_tokens=False).ids[0]


def _rest(reply: str, generated: str) -> str | None:
    if reply.startswith(generated):
        return reply[len(generated):]
    if THINK_END in generated and THINK_END in reply:
        tail = generated[generated.rindex(THINK_END) + len(THINK_END):]
        after = reply[reply.index(THINK_END) + len(THINK_END):]
        if after.startswith(tail):
            return after[len(tail):]
    return None


def scripted_or(builder):
    """`builder`, except for checkpoints flagged `"metrale_test_only": true`."""
    def build(ckpt: Checkpoint, ops):
        if ckpt.config.get(TEST_FLAG) is True:
            return build_scripted(ckpt, ops)
        return builder(ckpt, ops)
    return build


def build_scripted(ckpt: Checkpoint, ops) -> ScriptedLM:
    if ckpt.config.get(TEST_FLAG) is not True:
        raise CheckpointError(f"{ckpt.path}: the scripted model is a test fixture; its "
                              f"config.json must say \"{TEST_FLAG}\": true")
    import tokenizers

    if not ckpt.tokenizer_json:
        raise CheckpointError(f"{ckpt.path}: the scripted test model needs a tokenizer.json")
    return ScriptedLM(ckpt.config, tokenizers.Tokenizer.from_file(ckpt.tokenizer_json), ops)


def write_scripted_checkpoint(path, tokenizer_dir, scripts: list[dict], *,
                              eos_token: str = "<|im_end|>",
                              reply_after: str | list[str] = "<|im_start|>assistant\n",
                              max_position_embeddings: int = 4096) -> str:
    """A scripted checkpoint in `path`, reusing tokenizer.json / tokenizer_config.json from
    `tokenizer_dir`."""
    import tokenizers

    os.makedirs(path, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if os.path.abspath(tokenizer_dir) == os.path.abspath(path):
            break
        with open(os.path.join(tokenizer_dir, name), "rb") as src, \
                open(os.path.join(path, name), "wb") as dst:
            dst.write(src.read())
    tok = tokenizers.Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    config = {"model_type": MODEL_TYPE, TEST_FLAG: True,
              "vocab_size": tok.get_vocab_size(), "eos_token_id": tok.token_to_id(eos_token),
              "max_position_embeddings": max_position_embeddings,
              "reply_after": reply_after, "scripts": scripts}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    _write_placeholder_safetensors(os.path.join(path, "model.safetensors"))
    return str(path)


def _write_placeholder_safetensors(file: str) -> None:
    header = json.dumps({"placeholder": {"dtype": "F32", "shape": [1],
                                         "data_offsets": [0, 4]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + np.zeros(1, np.float32).tobytes())


SCRIPTED_TEMPLATE = """
{%- if messages[0].role == 'system' or tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}
{% endif %}{% if tools %}# Tools
<tools>
{% for t in tools %}{{ t | tojson }}
{% endfor %}</tools>
{% endif %}<|im_end|>
{% endif %}
{%- for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}
{%- if m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{% if m.reasoning_content %}<think>
{{ m.reasoning_content }}
</think>

{% endif %}{{ m.content or '' }}{% for c in m.tool_calls or [] %}
<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking %}<think>
{% endif %}{% endif %}"""

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TAG_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>",
              # DeepSeek V3's tool-call markers, single tokens as in its tokenizer (byte pieces of
              # their multi-byte characters would decode to U+FFFD mid-reply)
              "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
              "<｜tool▁call▁end｜>", "<｜tool▁sep｜>")


def make_scripted_model(path, scripts: list[dict], template: str = SCRIPTED_TEMPLATE) -> str:
    """A scripted checkpoint with its own tokenizer and chat template (see the docstring)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    os.makedirs(path, exist_ok=True)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(sorted(alphabet))},
                               merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in TAG_TOKENS])
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "bos_token": None,
                   "chat_template": template.strip("\n")}, f)
    return write_scripted_checkpoint(path, path, scripts)


registry.register(MODEL_TYPE, scripted_or(registry.builder(MODEL_TYPE)))
