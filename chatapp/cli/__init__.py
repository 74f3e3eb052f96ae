"""The `pdchat` command (the console script calls main)."""
from pdchat.chatapp.cli.main import main

__all__ = ["main"]
