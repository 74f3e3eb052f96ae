"""One `pdchat run` turn's two ends, shared by the local and the remote run: reading the prompt,
and reporting the finished reply (streamed text and a summary line, or one JSON object)."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

EXIT_ERROR = 1


def read_prompt(args: argparse.Namespace) -> str:
    from pdchat.engine.errors import InvalidRequest
    if args.prompt not in (None, "-"):
        prompt = args.prompt
    else:
        prompt = _read_stdin()
    if not prompt.strip():
        raise InvalidRequest("empty prompt")
    return prompt


def _read_stdin() -> str:
    from pdchat.engine.errors import InvalidRequest
    if sys.stdin is None or sys.stdin.isatty():
        raise InvalidRequest("no prompt: give one as an argument or pipe it on stdin")
    data = sys.stdin.buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequest(f"stdin is not valid UTF-8 (byte {e.start}: {data[e.start:e.start + 1]!r})") from None


def summary_line(m: dict[str, Any]) -> str:
    """The reply's one-line summary (the app's per-message line, plus the prefill rate)."""
    from pdchat.chatapp.format import summary
    return summary(m, prefill_rate=True)


def report_turn(args: argparse.Namespace, text: str, token_ids: list[int] | None, finish_reason: str,
                metrics: dict[str, Any], error: str | None) -> int:
    """How a finished `pdchat run` turn ends, local or remote: the JSON object, or a newline after
    the streamed text and the summary line; then the exit code."""
    if error:
        print(f"pdchat: error: {error}", file=sys.stderr)
    if args.json:
        print(json.dumps({"text": text, "token_ids": token_ids, "finish_reason": finish_reason,
                          "metrics": metrics}))
    else:
        sys.stdout.write("\n")
        print(summary_line(metrics), file=sys.stderr)
    return EXIT_ERROR if finish_reason == "error" else 0


