"""The `pdchat` command: chat (default), run, pull, models, info, bench, serve.

Engine errors become one readable line on stderr and exit code 1, never a traceback; usage errors
(a value out of range, a flag the command has no use for) one line and exit code 2.
The engine (and torch) is imported only by the commands that need it, so `pdchat --help` is quick.
"""
from __future__ import annotations

import os
import sys

from pdchat.chatapp.cli.commands import COMMANDS
from pdchat.chatapp.cli.flags import unused_flags
from pdchat.chatapp.cli.parser import EXIT_USAGE, build_parser
from pdchat.chatapp.cli.turn import EXIT_ERROR


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:                      # usage errors (2) and --help (0), as a return code
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    if why := unused_flags(args):
        print(f"pdchat: error: {why}", file=sys.stderr)
        return EXIT_USAGE
    from pdchat.chatapp.backends.openai_client import RemoteError
    from pdchat.engine.errors import EngineError
    try:
        return COMMANDS[args.command](args)
    except (EngineError, RemoteError) as e:
        print(f"pdchat: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("pdchat: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader left (`pdchat run ... | head`): stop quietly, and keep Python from failing
        # again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_ERROR
    except OSError as e:                         # the machine's doing (disk full, a path that is a file)
        print(f"pdchat: error: {e}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
