"""The real Claude Code CLI against `met serve`, in print mode, through one tool round trip.

Claude Code is installed from npm (`@anthropic-ai/claude-code`, pinned to CLAUDE_CODE_VERSION:
2.1.332, the release whose first request used to fail with `messages.1.role: must be 'user' or
'assistant'`; it sends system turns inside `messages`, adaptive thinking, context_management,
output_config and 12 tools) into the repo's gitignored .cache/, once; reruns reuse it. No npm,
no test: it fails, it does not skip (CI has npm).

A tiny random model never calls a tool, so the server runs the scripted test model
(tests.scripted_model) with --tool-call-parser hermes: asked to read the file it answers with
a Read call on it; once the tool_result holding the file's text is in the prompt it answers
with a sentence that only that turn can produce. Claude Code runs the Read tool itself
(--allowedTools Read) and posts the result back, so the final answer proves the server read the
tool_result turn. HOME is a tmp dir, telemetry and nonessential traffic are off, every process
has a timeout: the CLI never reaches (or waits for) the internet.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from tests.scripted_model import SERVE_ENV, make_scripted_model, write_scripted_checkpoint
from tests.serving import REPO, Server

CLAUDE_CODE_VERSION = "2.1.332"
INSTALL_DIR = REPO / ".cache" / f"claude-code-{CLAUDE_CODE_VERSION}"
MODEL = "scripted"
NOTE_TEXT = "ZQX-CONTENT-7781"
ANSWER = "The note holds the magic word."

pytestmark = pytest.mark.slow


def _claude() -> str:
    """The pinned CLI, installed with npm into .cache/ when it is not there yet."""
    binary = INSTALL_DIR / "node_modules" / ".bin" / "claude"
    if not binary.exists():
        npm = shutil.which("npm")
        assert npm, "npm is needed to install Claude Code (CI has it)"
        out = subprocess.run([npm, "install", "--prefix", str(INSTALL_DIR), "--no-audit",
                              "--no-fund", f"@anthropic-ai/claude-code@{CLAUDE_CODE_VERSION}"],
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, f"npm install failed:\n{out.stdout}\n{out.stderr}"
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True,
                             timeout=60)
    assert version.stdout.startswith(CLAUDE_CODE_VERSION), version.stdout + version.stderr
    return str(binary)


def _hermes(name: str, args: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


@pytest.fixture(scope="module")
def claude():
    return _claude()


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("claude_code")
    (root / "work").mkdir()
    (root / "home").mkdir()
    note = root / "work" / "zqx-note.txt"
    note.write_text(NOTE_TEXT + "\n")
    # Claude Code asks for adaptive thinking: the template opens <think> in the prompt
    think = "<think>\nLet me see.\n</think>\n\n"
    scripts = [{"when": "zqx-note.txt", "reply": think + _hermes("Read", {"file_path": str(note)})},
               {"when": NOTE_TEXT, "reply": think + ANSWER}]
    model = make_scripted_model(root / "model", scripts)
    # Claude Code's system prompt and tools are ~50k byte-level tokens
    write_scripted_checkpoint(model, model, scripts, max_position_embeddings=131072)
    return root


@pytest.fixture(scope="module")
def server(work):
    with Server(["serve", str(work / "model"), "--model-name", MODEL, "--frontends", "1",
                 "--max-seq-len", "131072", "--no-event-log", "--tool-call-parser", "hermes"],
                work / "serve.log", env=SERVE_ENV).serving(180) as srv:
        yield srv


def _env(server, home) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE"))}
    env.update(HOME=str(home), ANTHROPIC_BASE_URL=server.url, ANTHROPIC_API_KEY="sk-local",
               ANTHROPIC_DEFAULT_HAIKU_MODEL=MODEL, ANTHROPIC_SMALL_FAST_MODEL=MODEL,
               DISABLE_TELEMETRY="1", CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
               DISABLE_AUTOUPDATER="1", DISABLE_ERROR_REPORTING="1",
               CLAUDE_CODE_MAX_OUTPUT_TOKENS="2048", API_TIMEOUT_MS="300000")
    return env


def test_claude_code_print_mode_with_a_tool_round_trip(claude, server, work):
    out = subprocess.run(
        [claude, "-p", "Please read zqx-note.txt and tell me what it says.",
         "--output-format", "json", "--model", MODEL, "--allowedTools", "Read",
         "--max-turns", "4"],
        cwd=work / "work", env=_env(server, work / "home"), stdin=subprocess.DEVNULL,
        capture_output=True, text=True, timeout=420)
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr}\n{server.tail()}"
    result = json.loads(out.stdout)
    assert result["is_error"] is False, result
    assert result.get("api_error_status") is None, result
    assert result["num_turns"] >= 2, result          # the Read call, then the answer
    assert result["result"] == ANSWER, result        # only the tool_result turn leads here
    assert "POST /v1/messages 400" not in server.tail(100000)
