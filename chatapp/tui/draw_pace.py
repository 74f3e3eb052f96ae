"""How often a streaming reply's new text is drawn, so that drawing leaves the model its cores.

On a CPU the app and the model share the cores, and each piece of text moved into the Markdown
view costs the UI thread a relayout and a render of the whole screen: the more messages a chat
holds, the more widgets, the dearer each one. Drawn every 80 ms, a chat's second and third
300-token replies decoded at a TPOT of 34-38 ms (2-core AMD EPYC, 2026-11-27, two runs; 20-25 ms
headless at those lengths). So the text is drawn at most every MIN_S (the pump's period), and less
often while the UI thread's CPU time since the last draw says the UI is taking more than SHARE of
a core; never less often than every MAX_S, so the text keeps moving on a machine too slow for the
share. The same replies then took 27-33 ms (three runs), their text drawn every 0.16-0.24 s
(median). The pace holds whatever the backend: a GPU or remote model needs no core of this
machine, but a UI thread that busy redraws faster than anyone reads.
"""
from __future__ import annotations

from typing import Callable

MIN_S = 0.08        # the most often text is drawn (smooth enough to read as it comes)
MAX_S = 0.5         # the least often, whatever drawing costs
SHARE = 0.2         # of one core: what the UI thread may spend between draws, per second


class DrawPace:
    """Decides at each tick of the text pump whether new text is drawn now. `clock` is wall time,
    `cpu_clock` the CPU time of the thread that draws (the UI's, where the pump runs: the app's
    `cpu_clock`, time.thread_time)."""

    def __init__(self, clock: Callable[[], float], cpu_clock: Callable[[], float]):
        self.clock, self.cpu_clock = clock, cpu_clock
        self._wall: float | None = None       # when the last draw began, on each clock
        self._cpu = 0.0

    def due(self) -> bool:
        """Whether to draw now (asked every MIN_S): the first time, and then once the UI thread's
        CPU time since the last draw is within SHARE of the wall time since, or MAX_S has passed."""
        if self._wall is None:
            return True
        wall = self.clock() - self._wall
        return wall >= MAX_S or self.cpu_clock() - self._cpu <= SHARE * wall

    def drawing(self) -> None:
        """A draw begins: what it and the renders after it cost counts against the next one."""
        self._wall, self._cpu = self.clock(), self.cpu_clock()

    def reset(self) -> None:
        """No reply streams: the next one's first text is drawn at once."""
        self._wall = None
