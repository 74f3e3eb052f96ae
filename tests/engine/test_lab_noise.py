"""The lab notes verdicts measured while other processes kept the machine busy."""
from __future__ import annotations

from pdchat.bench.lab_noise import BUSY_PCT, OthersLoad, mark_noisy


class Readings:
    def __init__(self, values):
        self.values = list(values)

    def __call__(self, interval=None):
        return self.values.pop(0)

    def cpu_percent(self, interval=None):         # as psutil.Process.cpu_percent
        return self.values.pop(0)


def test_others_load_is_the_machine_less_this_process_over_all_cpus():
    machine, own = Readings([0.0, 80.0, 20.0]), Readings([0.0, 100.0, 40.0])   # own: % of one core
    load = OthersLoad(process=own, cpu_percent=machine, cpus=2)
    assert load.since_last() == 30.0                 # 80% of the machine, pdchat 50% of it
    assert load.since_last() == 0.0                  # 20% of the machine, all pdchat's


def test_only_the_verdicts_timed_while_busy_are_marked():
    claims = [{"id": "prefill_linear"}, {"id": "kv_bytes"}, {"id": "prefill_vs_decode"}, {"id": "batching"}]
    busy = {"prefill": 5.0, "decode": BUSY_PCT + 10, "batching": None}
    marked = {c["id"]: c.get("noisy") for c in mark_noisy(claims, busy)}
    assert marked == {"prefill_linear": None, "kv_bytes": None, "batching": None,
                      "prefill_vs_decode": f"noisy: the machine was busy (other processes used {BUSY_PCT + 10:.0f}% of it)"}
