"""Chat templates: render a conversation into the prompt string the model was trained on.

`ChatTemplate` renders a model's jinja2 template with the semantics of transformers'
`apply_chat_template(..., tokenize=False)`: an `ImmutableSandboxedEnvironment` with
trim_blocks, lstrip_blocks and the loopcontrols extension; the variables `messages`, `tools`,
`documents`, `add_generation_prompt`, the named special tokens (`bos_token`, `eos_token`, ...)
and any `chat_template_kwargs` (e.g. `enable_thinking`); the globals `raise_exception` and
`strftime_now`; and a `tojson` filter that keeps non-ASCII text and HTML characters as they are.

`load_chat_template` picks the template to use for a model: an explicit one (the
`--chat-template` flag: a file's path or the template text), else a per-model override
`metrale/jinja-templates/<model_type>.jinja` (package data, so it ships in the wheel), else the
checkpoint's own. Overrides exist to fix upstream templates; see metrale/jinja-templates/README.md.

`normalize_messages` turns OpenAI-style messages into what templates expect.
"""
from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Template variables set by `render` itself; chat_template_kwargs may not set them.
RESERVED_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
# Marks the end of the final message when continuing it (the same tag as transformers).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
OVERRIDES_DIRNAME = "jinja-templates"
OVERRIDES_DIR = Path(__file__).resolve().parent / OVERRIDES_DIRNAME


class ChatTemplateError(ValueError):
    """A conversation that cannot be rendered: the template raised (the message is the
    template's own), failed to parse or to render, or the messages are malformed."""


def _raise_exception(message: str):
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' `tojson`: json.dumps without HTML escaping, keeping non-ASCII text."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _named_templates(template: str | Mapping[str, str] | Sequence[Mapping]) -> dict[str, str]:
    """A template source as found in tokenizer_config.json: one string, or a list of
    {"name", "template"} (e.g. "default" and "tool_use"), or a name -> template mapping."""
    if isinstance(template, str):
        return {"default": template}
    if isinstance(template, Mapping):
        return dict(template)
    try:
        return {entry["name"]: entry["template"] for entry in template}
    except (TypeError, KeyError) as exc:
        raise ChatTemplateError("a chat template must be a string or a list of "
                                f"{{'name', 'template'}} objects, got {template!r:.200}") from exc


def _iterates_content(ast: nodes.Template) -> bool:
    """Whether the template loops over `message.content` / `message['content']` (templates of
    multimodal models, which expect content as a list of parts)."""
    for loop in ast.find_all(nodes.For):
        target = loop.iter
        if isinstance(target, nodes.Getattr) and target.attr == "content":
            return True
        if (isinstance(target, nodes.Getitem) and isinstance(target.arg, nodes.Const)
                and target.arg.value == "content"):
            return True
    return False


class ChatTemplate:
    """One model's chat template(s), compiled once, rendered per request.

    `template` is the source (see `_named_templates`); `bos_token` / `eos_token` and the other
    `special_tokens` (name -> string, e.g. Tokenizer.special_tokens_map) become template
    variables; None values are left undefined, as transformers does. `origin` names where the
    template came from, for error messages.
    """

    def __init__(self, template: str | Mapping[str, str] | Sequence[Mapping],
                 bos_token: str | None = None, eos_token: str | None = None, *,
                 special_tokens: Mapping[str, str | None] | None = None, origin: str = "chat template"):
        self.origin = origin
        tokens = dict(special_tokens or {})
        tokens.update((k, v) for k, v in (("bos_token", bos_token), ("eos_token", eos_token)) if v)
        self.special_tokens = {k: v for k, v in tokens.items() if v is not None}
        env = _environment()
        self.sources = _named_templates(template)
        self._compiled = {name: self._compile(env, name, src) for name, src in self.sources.items()}
        default = self.sources.get("default") or next(iter(self.sources.values()), "")
        self.content_format = "openai" if _iterates_content(env.parse(default)) else "string"

    def _compile(self, env: ImmutableSandboxedEnvironment, name: str, source: str) -> jinja2.Template:
        try:
            return env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(
                f"{self.origin} ({name}): jinja syntax error on line {exc.lineno}: {exc.message}; "
                "fix the template, pass --chat-template, or add an override in "
                f"metrale/{OVERRIDES_DIRNAME}/") from exc

    def _pick(self, tools: Sequence | None, name: str | None) -> jinja2.Template:
        """transformers' choice among named templates: the one asked for, else `tool_use`
        when tools are given and it exists, else `default`."""
        if name is None:
            name = "tool_use" if tools and "tool_use" in self._compiled else "default"
        if name not in self._compiled:
            raise ChatTemplateError(f"{self.origin} has no template named {name!r}; it has "
                                    f"{sorted(self._compiled)}")
        return self._compiled[name]

    def render(self, messages: Sequence[Mapping], *, tools: Sequence[Mapping] | None = None,
               documents: Sequence[Mapping] | None = None, add_generation_prompt: bool = False,
               continue_final_message: bool = False,
               chat_template_kwargs: Mapping[str, Any] | None = None,
               template_name: str | None = None) -> str:
        """The prompt for `messages` (already normalized, see `normalize_messages`).

        `continue_final_message` renders the last message open-ended (no end-of-turn), for the
        model to continue it; it excludes `add_generation_prompt`.
        """
        kwargs = dict(chat_template_kwargs or {})
        if clash := RESERVED_VARIABLES & kwargs.keys():
            raise ChatTemplateError(f"chat_template_kwargs may not set {sorted(clash)}: pass them "
                                    "as the request's own fields")
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError("continue_final_message and add_generation_prompt exclude "
                                    "each other: continue the last message or start a new one")
        messages = _with_continue_tag(messages) if continue_final_message else messages
        variables = {**self.special_tokens, **kwargs, "messages": messages, "tools": tools,
                     "documents": documents, "add_generation_prompt": add_generation_prompt}
        text = self._render(self._pick(tools, template_name), variables)
        return _cut_at_continue_tag(text) if continue_final_message else text

    def _render(self, template: jinja2.Template, variables: dict) -> str:
        try:
            return template.render(**variables)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"{self.origin} failed to render: {exc}") from exc
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            raise ChatTemplateError(f"{self.origin} failed to render these messages "
                                    f"({type(exc).__name__}: {exc}); check the message "
                                    "fields the template expects") from exc


def _with_continue_tag(messages: Sequence[Mapping]) -> list[dict]:
    """A copy of messages whose last text ends in the continue tag (transformers' method)."""
    messages = copy.deepcopy(list(messages))
    if not messages:
        raise ChatTemplateError("continue_final_message needs at least one message")
    last = messages[-1]
    content = last.get("content")
    if isinstance(content, str):
        last["content"] = content + _CONTINUE_TAG
        return messages
    for part in reversed(content or []):
        if isinstance(part, dict) and "text" in part:
            part["text"] += _CONTINUE_TAG
            return messages
    raise ChatTemplateError("continue_final_message is set but the last message has no text")


def _cut_at_continue_tag(text: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if tag not in text:
        raise ChatTemplateError("continue_final_message: the template dropped the final "
                                "message's text, so it cannot be continued")
    at = text.rindex(tag)
    if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()


# ---- picking the template -----------------------------------------------------------------

def default_override_dirs() -> list[Path]:
    """Where per-model overrides live: `metrale/jinja-templates/`, package data next to this
    module (the same path in a source checkout and in an installed wheel)."""
    return [OVERRIDES_DIR] if OVERRIDES_DIR.is_dir() else []


def find_override(model_type: str, override_dirs: Sequence[Path] | None = None) -> Path | None:
    """The override file for `model_type`, or None."""
    if not model_type:
        return None
    for folder in default_override_dirs() if override_dirs is None else override_dirs:
        candidate = Path(folder) / f"{model_type}.jinja"
        if candidate.is_file():
            return candidate
    return None


def _explicit_template(value: str) -> tuple[str, str]:
    """--chat-template: (source, origin) of a path to a template file, or of the template text
    itself (anything with a jinja `{{` or `{%` that is not a file)."""
    path = Path(value).expanduser()
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8"), str(path)
        except (OSError, UnicodeDecodeError) as exc:
            raise ChatTemplateError(f"--chat-template {value!r}: cannot read the file ({exc})") from exc
    if "{{" in value or "{%" in value:
        return value, "--chat-template"
    raise ChatTemplateError(f"--chat-template {value!r}: no such file, and not a template "
                            "either (pass a path to a .jinja file or the template text)")


def load_chat_template(model_type: str, checkpoint_template: str | Sequence | None, *,
                       special_tokens: Mapping[str, str | None] | None = None,
                       explicit: str | None = None, override_dirs: Sequence[Path] | None = None,
                       disable_overrides: bool = False) -> ChatTemplate:
    """The template to serve `model_type` with: `explicit` (path or text) first, then
    `jinja-templates/<model_type>.jinja` unless `disable_overrides`, then the checkpoint's."""
    if explicit is not None:
        source, origin = _explicit_template(explicit)
    elif not disable_overrides and (override := find_override(model_type, override_dirs)):
        source, origin = override.read_text(encoding="utf-8"), str(override)
    elif checkpoint_template:
        source, origin = checkpoint_template, f"the {model_type or 'model'} checkpoint's chat template"
    else:
        raise ChatTemplateError(
            f"the {model_type or 'model'} checkpoint has no chat template: pass --chat-template "
            f"FILE, or add metrale/{OVERRIDES_DIRNAME}/{model_type or '<model_type>'}.jinja")
    return ChatTemplate(source, special_tokens=special_tokens, origin=origin)


# ---- messages -----------------------------------------------------------------------------

TEXT_PART_TYPES = ("text", "input_text", "output_text")


def _content_text_parts(content: Any, where: str) -> list[str]:
    """The texts of OpenAI content: a string, None, or a list of {type: text, text} parts."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, (list, tuple)):
        raise ChatTemplateError(f"{where}.content must be a string or a list of parts, "
                                f"got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, Mapping) and part.get("type") in TEXT_PART_TYPES:
            texts.append(str(part.get("text", "")))
        else:
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise ChatTemplateError(f"{where}.content[{j}] has type {kind!r}; this model takes "
                                    "text only (parts of type 'text')")
    return texts


def _normalize_tool_calls(tool_calls: Any, where: str) -> list[dict]:
    """Copies of tool calls whose `function.arguments` JSON strings are parsed into objects
    (as vLLM does: many templates render them with `| tojson`)."""
    if not isinstance(tool_calls, (list, tuple)):
        raise ChatTemplateError(f"{where}.tool_calls must be a list, got {type(tool_calls).__name__}")
    calls = []
    for j, call in enumerate(tool_calls):
        call = copy.deepcopy(dict(call))
        function = call.get("function")
        if isinstance(function, Mapping):
            function = call["function"] = dict(function)
            function["arguments"] = _parse_arguments(function.get("arguments"),
                                                     f"{where}.tool_calls[{j}].function.arguments")
        calls.append(call)
    return calls


def _parse_arguments(arguments: Any, where: str) -> Any:
    if arguments is None or arguments == "":
        return {}
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except json.JSONDecodeError as exc:
        raise ChatTemplateError(f"{where} is not valid JSON ({exc.msg} at char {exc.pos}); "
                                "send the arguments as a JSON object string") from exc


def normalize_messages(messages: Sequence[Mapping], content_format: str = "string") -> list[dict]:
    """OpenAI-style chat messages -> what chat templates expect.

    Content (a string, null, or a list of text parts) becomes one string (parts joined with
    "\\n") for `content_format="string"`, or a list of {"type": "text", "text"} parts for
    "openai" (templates that loop over content; see `ChatTemplate.content_format`). Tool-call
    arguments given as JSON strings become objects. Other fields pass through unchanged.
    """
    if content_format not in ("string", "openai"):
        raise ValueError(f"content_format must be 'string' or 'openai', got {content_format!r}")
    normalized = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ChatTemplateError(f"{where} must be an object with a string 'role'")
        out = dict(message)
        texts = _content_text_parts(message.get("content"), where)
        out["content"] = ("\n".join(texts) if content_format == "string"
                          else [{"type": "text", "text": t} for t in texts])
        if message.get("tool_calls") is not None:
            out["tool_calls"] = _normalize_tool_calls(message["tool_calls"], where)
        normalized.append(out)
    return normalized
