"""Structured output: JSON schemas and tool-call formats compiled to token-level grammars
(llguidance), and the per-request matchers that constrain the engine's sampling.

Frontend half (no tokenizer): the API's request fields become one llguidance grammar string,
carried to the engine in `SamplingParams.grammar`:

    grammar_for_response_format(fmt)      OpenAI `response_format` (chat, completions, and the
                                          Responses API's `text.format` translated to it)
    grammar_for_schema(schema, param)     one JSON schema (Anthropic output_format)
    tool_call_grammar(tools, parser, ...) tool-call arguments in the model's call format

Refusals raise `GrammarError` (a ValueError naming the offending feature and `param`); the
routes answer 400 invalid_request_error with it.

JSON is generated without free whitespace: items separated by ", " and keys by ": " (what
json.dumps writes), so a model cannot loop on newlines inside an object (xgrammar's
`any_whitespace=False`, vLLM's `disable_any_whitespace`), and properties come in the schema's
order. Unsupported keywords (llguidance's list: docs/json_schema.md) are refused, not ignored.

Engine half: `Grammars` owns one `GrammarState` (an LLMatcher) per constrained request, built
at admission from the engine's tokenizer. Each step:

    masks = grammars.start_masks(out)     # a worker thread fills the packed bitmask rows of
                                          # the step's constrained rows (llguidance drops the
                                          # GIL) while the forward runs
    ...forward...; sampler(..., masks.select(requests))   # joins; -inf where a bit is 0
    stopped = grammars.commit(out, sampled)   # matchers advanced with the sampled tokens;
                                              # ids whose grammar ended (finish "stop")

EOS is allowed exactly where the grammar accepts (llguidance sets the EOS bits then); when the
grammar can take no more tokens the request stops with the token that ended it.

Reasoning is left free: a request whose prompt opened a think block (`starts_in_thinking`)
is unconstrained until the model emits `think_end_id`; one whose template lets the model open
its own block (`think_start_id` set) may start with `think_start_id` (then it is free until the
close) or with what the grammar allows. Tokens the thinking budget forces are ordinary think
tokens here. (vLLM #48228 / #50948: a grammar applied inside <think>, or never after it.)

Speculative decoding: constrained requests take no drafts (metrale.scheduler `_num_drafts`),
so every constrained row is one row of its step with one mask.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

log = logging.getLogger("metrale.grammar")

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT = {"type": "object"}
QWEN3_XML_FORMATS = ("qwen3_coder", "qwen3_xml")
GRAMMAR_TOOL_FORMATS = ("hermes", "poolside_v1", *QWEN3_XML_FORMATS)
"""Tool-call parsers whose format tool_call_grammar writes (hermes' JSON body, Qwen3-Coder's
XML parameters); other formats (mistral, gemma4, minimax_xml, bare_json) are not constrained."""
TOOL_GRAMMAR_MODES = ("auto", "on", "off")
PARALLEL_MASK_ROWS = 8
"""Steps with at least this many constrained rows compute their masks on llguidance's thread
pool; fewer run on the mask worker thread alone."""


class GrammarError(ValueError):
    """A schema or grammar that cannot be enforced: the message names the feature."""

    def __init__(self, message: str, param: str = "response_format"):
        super().__init__(message)
        self.param = param


def _llg():
    import llguidance

    return llguidance


# ---- frontend: request fields -> grammar string ---------------------------------------------

def grammar_for_response_format(fmt: object, param: str = "response_format",
                                leading_space: bool = False) -> str | None:
    """The grammar for an OpenAI `response_format` dict: None for {"type": "text"} (or None),
    any JSON object for "json_object", the schema for "json_schema" ({"name", "schema",
    "strict", "description"}; a missing schema means any object). `leading_space`: up to two
    spaces or newlines may come first (what a model writes after `</think>`)."""
    if fmt is None:
        return None
    if not isinstance(fmt, Mapping):
        raise GrammarError(f"'{param}' must be an object such as {{\"type\": \"json_object\"}}",
                           param)
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return grammar_for_schema(ANY_OBJECT, param, leading_space)
    if kind != "json_schema":
        raise GrammarError(f"'{param}.type' must be 'text', 'json_object' or 'json_schema', "
                           f"got {kind!r}", f"{param}.type")
    spec = fmt.get("json_schema")
    if not isinstance(spec, Mapping):
        raise GrammarError(f"'{param}.json_schema' must be an object with 'name' and 'schema'",
                           f"{param}.json_schema")
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise GrammarError(f"'{param}.json_schema.name' must be a string", f"{param}.json_schema.name")
    if spec.get("strict") is not None and not isinstance(spec.get("strict"), bool):
        raise GrammarError(f"'{param}.json_schema.strict' must be a boolean",
                           f"{param}.json_schema.strict")
    schema = spec.get("schema", ANY_OBJECT)
    return grammar_for_schema(schema, f"{param}.json_schema.schema", leading_space)


def grammar_for_schema(schema: object, param: str, leading_space: bool = False) -> str:
    """A JSON schema (dict, or a bool) checked against its metaschema and compiled; raises
    GrammarError naming what is invalid or unsupported."""
    schema = check_schema(schema, param)
    llg = _llg()
    try:
        if leading_space:
            grammar = llg.LLMatcher.grammar_from_lark(
                f"start: /[ \\n]{{0,2}}/ body\nbody: %json {_json_with_options(schema)}")
        else:
            grammar = llg.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    except ValueError as e:
        raise GrammarError(f"'{param}' is not a JSON schema: {e}", param) from None
    return validated(grammar, param)


def check_schema(schema: object, param: str):
    """`schema` if it is valid JSON Schema (by its own $schema's draft, else 2020-12)."""
    import jsonschema

    if isinstance(schema, bool):
        return schema
    if not isinstance(schema, Mapping):
        raise GrammarError(f"'{param}' must be a JSON schema object, got {type(schema).__name__}",
                           param)
    try:
        jsonschema.validators.validator_for(schema, jsonschema.Draft202012Validator) \
            .check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise GrammarError(f"'{param}' is not valid JSON Schema at {where}: {e.message}",
                           param) from None
    return dict(schema)


def validated(grammar: str, param: str) -> str:
    """`grammar` if llguidance can build it; else GrammarError with its reason (for a JSON
    schema: "unsupported JSON Schema feature: not", "Unsatisfiable schema: ...")."""
    llg = _llg()
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar)
    if not is_error:
        return grammar
    message = messages[0] if messages else "the grammar could not be built"
    if message.startswith("Unimplemented keys:"):
        keys = message.split(":", 1)[1].strip()
        raise GrammarError(f"'{param}' uses JSON Schema keywords structured output does not "
                           f"support: {keys}; remove them or relax the schema", param)
    raise GrammarError(f"'{param}' cannot be enforced: {message}", param)


# ---- frontend: tool calls --------------------------------------------------------------------

@dataclass(frozen=True)
class ToolGrammarPlan:
    """How a chat request's tool calls are constrained: `forced` None (the model may answer in
    text or call), "any" (a call must follow the prefill `<tool_call>\\n`) or a tool name (the
    prefill opened its arguments)."""
    forced: str | None
    parallel: bool = True


def wants_tool_grammar(mode: str, tools: Sequence[Mapping] | None, parser: str | None,
                       forced: bool = False) -> bool:
    """--tool-grammar: on = every request with tools in a format we constrain; auto = those whose
    tools are declared strict (OpenAI `function.strict`, Anthropic `strict`) or that force a
    call (tool_choice required / named, Anthropic any / tool); off = never."""
    if not tools or mode == "off" or parser not in GRAMMAR_TOOL_FORMATS:
        return False
    return mode == "on" or forced or any(_is_strict(t) for t in tools)


def _is_strict(tool: Mapping) -> bool:
    fn = tool.get("function") if isinstance(tool.get("function"), Mapping) else tool
    return fn.get("strict") is True


def _tool_schema(tool: Mapping) -> tuple[str, dict]:
    fn = tool.get("function") if isinstance(tool.get("function"), Mapping) else tool
    params = fn.get("parameters", fn.get("input_schema")) or {"type": "object"}
    return fn["name"], params


def tool_call_grammar(tools: Sequence[Mapping], plan: ToolGrammarPlan, fmt: str = "hermes",
                      open_tag: str = '"<tool_call>"', close_tag: str = '"</tool_call>"') -> str:
    """A Lark grammar (llguidance) over the output that follows the prompt's prefill, in the
    tool-call format `fmt` (GRAMMAR_TOOL_FORMATS), each call's arguments valid against its
    tool's parameters:

        hermes, poolside_v1   <tool_call>\n{"name": NAME, "arguments": ARGS}\n</tool_call>
        qwen3_coder, _xml     <tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n
                              ...</function>\n</tool_call>   (parameters in schema order,
                              the required ones always; a string VALUE is raw text, up to
                              maxLength, an enum one of its values; others JSON)

    `open_tag` / `close_tag`: how the grammar names the tags, `<tool_call>` when the vocabulary
    holds them as tokens, else the quoted text."""
    names, rules = [], []
    for i, tool in enumerate(tools):
        name, params = _tool_schema(tool)
        check_schema(params, f"tools[{i}].parameters")
        names.append(name)
        rules += _qwen3_function(i, name, params) if fmt in QWEN3_XML_FORMATS else \
            [f"call_{i}: %json {_json_with_options(_call_schema(name, params))}"]
    one_call = " | ".join(f"call_{i}" for i in range(len(tools)))
    call = f'call: {open_tag} "\\n" body "\\n" {close_tag}\nbody: {one_call}'
    more = '("\\n" call)*' if plan.parallel else ""
    if plan.forced is None:
        start = f"start: TEXT | TEXT? call {more}\n" \
                'TEXT: /(?s:.+)/ & ~/(?s:.*<tool_call>.*)/'
    elif plan.forced == "any":
        start = f'start: body "\\n" {close_tag} {more}'
    elif fmt in QWEN3_XML_FORMATS:      # the prefill opened <function=NAME>
        start = f'start: args_{names.index(plan.forced)} "</function>\\n" {close_tag}'
    else:                               # the prefill opened "arguments": 
        params = _tool_schema(tools[names.index(plan.forced)])[1]
        start = f'start: args "}}\\n" {close_tag}\nargs: %json {_json_with_options(params)}'
    lark = "\n".join([start, call, *rules])
    try:
        grammar = _llg().LLMatcher.grammar_from_lark(lark)
    except ValueError as e:
        raise GrammarError(f"the tools' schemas cannot be enforced: {e}", "tools") from None
    return validated(grammar, "tools")


def _qwen3_function(i: int, name: str, params: Mapping) -> list[str]:
    """The Lark rules of tool i in the qwen3_coder format: call_i (the whole <function=...>
    block) and args_i (its parameters, what follows a named prefill)."""
    props = params.get("properties") or {} if isinstance(params, Mapping) else {}
    required = set(params.get("required") or ()) if isinstance(params, Mapping) else set()
    parts, rules = [], []
    for j, (pname, prop) in enumerate(props.items()):
        rules.append(f'p_{i}_{j}: {json.dumps(f"<parameter={pname}>" + chr(10))} v_{i}_{j}')
        rules += _qwen3_value(f"v_{i}_{j}", prop if isinstance(prop, Mapping) else {})
        parts.append(f"p_{i}_{j}" + ("" if pname in required else "?"))
    rules.insert(0, f'args_{i}: {" ".join(parts) or chr(34) * 2}')
    rules.insert(0, f'call_{i}: {json.dumps(f"<function={name}>" + chr(10))} args_{i} '
                    '"</function>"')
    return rules


def _qwen3_value(rule: str, prop: Mapping) -> list[str]:
    """A qwen3_coder parameter value and its closing tag: raw text for a string (up to
    maxLength; the close tag ends it), one of the values of a string enum, else JSON."""
    close = '"\\n</parameter>\\n"'
    if prop.get("type") == "string" and isinstance(prop.get("enum"), list):
        return [f"{rule}: (" + " | ".join(json.dumps(str(v)) for v in prop["enum"]) + f") {close}"]
    if prop.get("type") == "string":
        most = prop.get("maxLength")
        span = f"{{1,{int(most)}}}" if isinstance(most, int) and most > 0 else "+"
        term = rule.upper()     # one lexeme: the text, then the first close tag
        return [f"{rule}: {term}", f"{term}: /(?s:.{span})\\n<\\/parameter>\\n/ & "
                f"~/(?s:.+\\n<\\/parameter>\\n.+)/"]
    return [f"{rule}: %json {_json_with_options(prop)} {close}"]


def _call_schema(name: str, params: dict) -> dict:
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def _json_with_options(schema) -> str:
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    return json.dumps({**schema, "x-guidance": JSON_OPTIONS})


# ---- engine: matchers and masks -------------------------------------------------------------

class GrammarState:
    """One constrained request's matcher and where it stands with respect to reasoning."""

    __slots__ = ("matcher", "active", "may_open_think", "think_start_id", "think_end_id")

    def __init__(self, matcher, params):
        self.matcher = matcher
        self.think_start_id = params.think_start_id
        self.think_end_id = params.think_end_id
        thinking = params.think_end_id is not None
        self.active = not (thinking and params.starts_in_thinking)
        self.may_open_think = thinking and not params.starts_in_thinking \
            and params.think_start_id is not None

    def advance(self, token: int) -> bool:
        """Take the sampled token; True when the grammar has ended (or broke)."""
        if not self.active:
            if token == self.think_end_id:
                self.active = True
            return False
        if self.may_open_think:
            self.may_open_think = False
            if token == self.think_start_id:
                self.active = False
                return False
        m = self.matcher
        if not m.consume_token(int(token)):
            log.warning("grammar: token %d was refused (%s); the request stops", token,
                        m.get_error())
            return True
        return m.is_stopped()


@dataclass
class GrammarStats:
    num_constrained: int = 0
    mask_seconds: deque = None       # per step, since the last scrape (bounded)
    wait_seconds: float = 0.0        # time the sampler waited for masks (the critical path)

    def __post_init__(self):
        self.mask_seconds = deque(maxlen=10000)


class StepMasks:
    """The packed token bitmasks of one step's constrained rows, being filled by a worker
    thread; `select` joins it."""

    def __init__(self, bits: np.ndarray, row_of: dict[str, int], thread, stats: GrammarStats):
        self.bits = bits
        self.row_of = row_of
        self._thread = thread
        self._stats = stats
        self.error: BaseException | None = None     # set by the worker when it failed

    def join(self) -> None:
        if self._thread is not None:
            t0 = time.perf_counter()
            self._thread.join()
            self._thread = None
            self._stats.wait_seconds += time.perf_counter() - t0
        if self.error is not None:
            raise RuntimeError(f"computing the grammar masks failed: {self.error}")

    def select(self, requests: Sequence) -> tuple[np.ndarray, np.ndarray] | None:
        """(rows, bits [len(rows), W]) for the rows of `requests` (one per request, the order
        of the sampler's rows) that are constrained this step, or None."""
        self.join()
        rows, src = [], []
        for i, r in enumerate(requests):
            j = self.row_of.get(r.request_id)
            if j is not None:
                rows.append(i)
                src.append(j)
        if not rows:
            return None
        return np.asarray(rows, dtype=np.int64), self.bits[src]


class Grammars:
    """The engine's matchers: one per constrained request, built from the engine's tokenizer
    (the same one the frontend encodes with) at admission."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
        llg = _llg()
        self.vocab_size = int(vocab_size)
        self.words = (self.vocab_size + 31) // 32
        self.tokenizer = llg.LLTokenizer(tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                         eos_token=sorted(int(t) for t in eos_token_ids) or None)
        self.executor = llg.LLExecutor()
        self.states: dict[str, GrammarState] = {}
        self.stats = GrammarStats()
        self._bits = np.zeros((0, self.words), dtype=np.int32)
        self._pending: StepMasks | None = None      # the last step's masks (joined at commit)

    def admit(self, request) -> None:
        """Build `request`'s matcher; ValueError when its grammar cannot be built."""
        grammar = request.sampling_params.grammar
        if grammar is None:
            return
        matcher = _llg().LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"the request's grammar cannot be built: {matcher.get_error()}")
        self.states[request.request_id] = GrammarState(matcher, request.sampling_params)
        self.stats.num_constrained += 1

    def release(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def start_masks(self, out) -> StepMasks | None:
        """Start filling the masks of `out`'s sampling rows whose grammar applies now."""
        if not self.states:
            return None
        work = []
        row_of: dict[str, int] = {}
        for s in out.seqs:
            st = self.states.get(s.request.request_id) if s.sample else None
            if st is not None and st.active:
                row_of[s.request.request_id] = len(work)
                work.append(st)
        if not work:
            return None
        if self._bits.shape[0] < len(work):
            self._bits = np.zeros((max(len(work), 2 * self._bits.shape[0]), self.words), np.int32)
        bits = self._bits[:len(work)]
        masks = StepMasks(bits, row_of, None, self.stats)
        masks._thread = threading.Thread(target=self._fill, args=(work, bits, masks), daemon=True)
        masks._thread.start()
        self._pending = masks
        return masks

    def _fill(self, work: list[GrammarState], bits: np.ndarray, masks: StepMasks) -> None:
        try:
            self._fill_rows(work, bits)
        except BaseException as e:      # reported by StepMasks.select, on the engine's thread
            masks.error = e

    def _fill_rows(self, work: list[GrammarState], bits: np.ndarray) -> None:
        t0 = time.perf_counter()
        if len(work) >= PARALLEL_MASK_ROWS:     # llguidance's thread pool, across the rows
            self.executor.unsafe_compute_mask_ptr([(st.matcher, i) for i, st in enumerate(work)],
                                                  bits.ctypes.data, self.words * 4, len(work))
        else:       # a few rows: on this thread (the pool's idle spinning costs more)
            for i, st in enumerate(work):
                st.matcher.unsafe_compute_mask_ptr(bits[i].ctypes.data, self.words * 4)
        for i, st in enumerate(work):
            if st.may_open_think:       # the model may choose to think first
                t = st.think_start_id
                bits.view(np.uint32)[i, t >> 5] |= np.uint32(1 << (t & 31))
        self.stats.mask_seconds.append(time.perf_counter() - t0)

    def commit(self, sampled: Mapping[str, object]) -> set[str]:
        """Advance the matchers with the step's sampled tokens (`sampled[id].token_ids`);
        the ids whose grammar ended with them."""
        if self._pending is not None:   # a step that sampled nothing still owns the buffer
            self._pending.join()
            self._pending = None
        stopped = set()
        for rid, tok in sampled.items():
            st = self.states.get(rid)
            if st is None:
                continue
            ids = tok.token_ids
            for t in (ids if isinstance(ids, list) else [ids]):
                if st.advance(t):
                    stopped.add(rid)
                    break
        return stopped


def apply_token_bitmask(x: np.ndarray, masks: tuple[np.ndarray, np.ndarray] | None) -> None:
    """logits x [B, V] -> -inf where row rows[i]'s bit of bits[i] is 0, in place (bit v of a
    row is bit v % 32 of int32 word v // 32, llguidance's layout)."""
    if masks is None:
        return
    rows, bits = masks
    V = x.shape[1]
    words = np.ascontiguousarray(bits).view(np.uint8)
    if words.shape[1] * 8 < V:          # ids past the mask's width are not allowed
        words = np.pad(words, ((0, 0), (0, -(-V // 8) - words.shape[1])))
    forbidden = np.unpackbits(words, axis=1, count=V, bitorder="little") == 0
    for i, r in enumerate(np.asarray(rows).tolist()):
        np.copyto(x[r], -np.inf, where=forbidden[i])
