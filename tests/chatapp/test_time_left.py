"""The time left of a long run (the lab, a bench suite) at the pace so far."""
from __future__ import annotations

import io

from rich.console import Console

from pdchat.chatapp.format import time_left
from pdchat.chatapp.reporting.bench_report import progress_bar


def test_time_left_is_the_pace_so_far():
    assert time_left(10.0, 0.25) == "~30 s left"                 # 10 s for a quarter: 30 s more
    assert time_left(30.0, 0.2) == "~2 min 0 s left"
    assert time_left(4.0, 0.8) == "~1.0 s left"
    assert time_left(0.5, 0.5) == time_left(20.0, 0.0) == "estimating the time left"


def test_the_cli_progress_line_says_the_time_left():
    now = [100.0]
    console = Console(file=io.StringIO(), width=120, force_terminal=False)
    bar, update = progress_bar(console, clock=lambda: now[0])
    now[0] = 110.0
    update("prefill sweep · 1/8", 0.25)
    assert bar.tasks[0].fields["left"] == "~30 s left" and bar.tasks[0].description == "prefill sweep · 1/8"
