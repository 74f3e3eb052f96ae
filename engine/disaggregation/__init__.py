"""Disaggregated prefill and decode (`--disaggregate`): prompts are prefilled in a second process on
cores of its own, and their K/V handed to the engine, which then only decodes.

Prefill is compute-bound and decode memory-bound; in one process a long prompt's prefill holds up
every stream (chunked prefill shortens the stall but cannot remove it). Split in two, a stream
never waits for a prefill, and a newcomer's TTFT pays the K/V transfer instead.

  cores.py           which cores each side gets, and pinning a process to them
  link.py            the hand-off: shared memory or a TCP socket, with a simulated bandwidth and latency
  prefill_worker.py  the prefill process: a model, a KV pool with prefix caching, one prompt at a time
  coordinator.py     the engine's side: starts and stops the worker, routes prompts to it, takes the
                     hand-offs into the engine's KV pool, and reports both workers
"""
