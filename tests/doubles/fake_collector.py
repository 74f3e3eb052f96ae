"""A stand-in for the gc module: records what the app asks of the garbage collector."""
from __future__ import annotations


class FakeCollector:
    def __init__(self, threshold: tuple[int, int, int] = (700, 10, 10)):
        self.threshold = threshold
        self.count = [0, 0, 0]          # what get_count() answers; a test sets it
        self.calls: list[str] = []      # "collect", "freeze", "unfreeze", in order

    def get_threshold(self) -> tuple[int, int, int]:
        return self.threshold

    def set_threshold(self, *threshold: int) -> None:
        self.threshold = threshold

    def get_count(self) -> tuple[int, int, int]:
        return tuple(self.count)

    def collect(self) -> int:
        self.calls.append("collect")
        self.count = [0, 0, 0]
        return 0

    def freeze(self) -> None:
        self.calls.append("freeze")

    def unfreeze(self) -> None:
        self.calls.append("unfreeze")
