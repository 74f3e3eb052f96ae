"""Every setting pdchat has, declared once: its name, type, default, allowed values, whether it can
change while the engine runs, and one line that explains it to people.

Everything else is derived from this table: EngineConfig and SamplingParams (their fields,
defaults and checks), the CLI flags and `pdchat --help`, Engine.update()'s list, the chat app's
per-conversation settings and its toggles panel (which shows the explanations), and the HTTP
server's bounds. tests/test_settings.py walks every setting through every surface it names.

No torch here: the CLI and the chat UI import this module without loading the engine.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, make_dataclass
from typing import Any, Callable

from .errors import InvalidRequest

ENGINE = "engine"        # EngineConfig: fixed at start-up unless `runtime`
SAMPLING = "sampling"    # SamplingParams: per request
CHAT = "chat"            # the chat app only (its conversations and its panel)

# torch.Generator takes 64-bit seeds, signed or not (it folds negative ones).
SEED_RANGE = (-(2**63), 2**64)


@dataclass(frozen=True)
class Setting:
    name: str                      # the field it sets, and the flag's name unless `flag` says otherwise
    scope: str                     # ENGINE | SAMPLING | CHAT
    kind: type                     # bool | int | float | str | list
    default: Any
    help: str                      # one line for people: --help, the toggles panel, the docs
    group: str = ""                # the --help section
    choices: tuple[str, ...] = ()
    low: float | None = None       # bounds of a number (inclusive unless *_open)
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    words: tuple[tuple[str, Any], ...] = ()   # words accepted for special values, e.g. ("off", None)
    nullable: bool = False         # None is a value (its meaning is in `help`)
    rule: Callable[[Any], str | None] | None = None   # an extra check: the problem, or None
    runtime: bool = False          # Engine.update() changes it while requests run
    toggle: bool = False           # a control in the chat app's toggles panel
    flag: str | None = ""          # "" = --<name>; None = no flag (why: `no_flag`)
    no_flag: str = ""
    metavar: str | None = None
    label: str = ""                # short name for the panel; default: the name in words
    chat: bool = True              # a SAMPLING setting the chat app keeps per conversation
    gpu_only: bool = False         # a GPU's alone: the toggles panel leaves it out where it cannot apply

    @property
    def title(self) -> str:
        return self.label or self.name.replace("_", " ")

    @property
    def cli_flag(self) -> str | None:
        if self.flag is None:
            return None
        if self.flag:
            return self.flag
        if self.kind is bool and self.default is True:
            return "--no-" + self.name.replace("_", "-")
        return "--" + self.name.replace("_", "-")

    def bounds_text(self) -> str:
        lo = "" if self.low is None else f"{'more than' if self.low_open else 'at least'} {_num(self.low)}"
        hi = "" if self.high is None else f"{'less than' if self.high_open else 'at most'} {_num(self.high)}"
        return " and ".join(p for p in (lo, hi) if p)

    def problem(self, value: Any) -> str | None:
        """Why `value` is not allowed (a phrase), or None when it is."""
        if value is None:
            return None if self.nullable else "must be given"
        if any(value == v and type(value) is type(v) for _, v in self.words):
            return None
        if self.kind is bool:
            return None if isinstance(value, bool) else "must be true or false"
        if self.kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            return "must be a whole number"
        if self.kind is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                return "must be a number"
            if not math.isfinite(value):
                return "must be " + (self.bounds_text() or "a finite number")
        if self.kind is str and not isinstance(value, str):
            return "must be text"
        if self.kind is str and (bad := _lone_surrogate(value)) is not None:
            # What bytes that are not UTF-8 become on a command line: no tokenizer takes them.
            return f"is not valid UTF-8 (character {bad + 1})"
        if self.kind is list and not (isinstance(value, list) and all(isinstance(x, str) for x in value)):
            return "must be a list of strings"
        if self.choices and value not in self.choices:
            return f"must be one of {', '.join(self.choices)}"
        if self.kind in (int, float) and not self._in_bounds(value):
            return "must be " + self.bounds_text()
        return self.rule(value) if self.rule else None

    def _in_bounds(self, v: float) -> bool:
        if self.low is not None and (v <= self.low if self.low_open else v < self.low):
            return False
        return self.high is None or (v < self.high if self.high_open else v <= self.high)

    def check(self, value: Any) -> Any:
        """The value, or InvalidRequest naming the setting, the rule and the value."""
        why = self.problem(value)
        if why:
            raise InvalidRequest(f"{self.title} {why}, got {value!r}")
        return value

    def read(self, text: str) -> Any:
        """A value from text (a flag, a box in the UI): one of the words, else the setting's type.
        Raises ValueError with a phrase for people ("must be at least 1, got 0")."""
        word = dict(self.words).get(text.strip().lower(), _NOT_A_WORD)
        if word is not _NOT_A_WORD:
            return word
        value: Any = text
        if self.kind in (int, float):
            try:
                value = self.kind(text.strip())
            except ValueError:
                options = ["a whole number" if self.kind is int else "a number"]
                options += [w for w, _ in self.words if w != "0"]
                expected = options[0] if len(options) == 1 else f"{', '.join(options[:-1])} or {options[-1]}"
                raise ValueError(f"expected {expected}, got {text!r}") from None
        why = self.problem(value)
        if why:
            # Text is not echoed: it may hold what cannot be printed (the reason says where).
            raise ValueError(why if self.kind is str else f"{why}, got {text}")
        return value

    def describe(self) -> str:
        """The help line with its default, as --help shows it."""
        default = next((w for w, v in self.words if v == self.default and type(v) is type(self.default)),
                       self.default)
        if self.kind is bool or default is None:
            return self.help
        return f"{self.help} [default: {default}]"


_NOT_A_WORD = object()


def _lone_surrogate(text: str) -> int | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def _num(x: float) -> str:
    if isinstance(x, int) and abs(x) >= 2**32 and (abs(x) & (abs(x) - 1)) == 0:
        return f"{'-' if x < 0 else ''}2**{abs(x).bit_length() - 1}"     # seeds: 64-bit bounds
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _power_of_two(n: int) -> str | None:
    return None if n & (n - 1) == 0 else "must be a power of two"


DEFAULT_MODEL = "smollm2-135m"
_CPUS = os.cpu_count() or 1

SETTINGS: tuple[Setting, ...] = (
    # ---- the engine (EngineConfig): fixed at start-up unless runtime=True -----------------
    Setting("model", ENGINE, str, DEFAULT_MODEL, group="model and device",
            help="smollm2-135m, a hub id, a folder, a .gguf file, or random:<preset>"),
    Setting("device", ENGINE, str, "auto", group="model and device", help="auto, cpu, cuda or cuda:N"),
    Setting("dtype", ENGINE, str, "auto", group="model and device",
            choices=("auto", "float32", "bfloat16", "float16"),
            help="weights and KV precision; auto = float32 on CPU, bfloat16 on CUDA (float16 on GPUs without it)"),
    Setting("block_size", ENGINE, int, 16, low=1, rule=_power_of_two, metavar="N", group="optimizations",
            help="tokens per KV block (a power of two)"),
    Setting("kv_cache_mb", ENGINE, float, None, nullable=True, low=0, low_open=True, metavar="MB",
            group="optimizations",
            help="KV pool size in MB (default on CPU: 16K tokens of the model, at most a quarter of "
                 "free memory; on GPU: a share of free memory)"),
    Setting("num_kv_blocks", ENGINE, int, None, nullable=True, low=1, flag=None,
            no_flag="an exact pool size for tests and demos; people size the pool in MB (--kv-cache-mb)",
            help="exact KV pool size in blocks (overrides kv_cache_mb)"),
    Setting("gpu_memory_fraction", ENGINE, float, 0.85, low=0, high=1, low_open=True, metavar="F",
            group="optimizations", help="share of the GPU memory free after loading that the KV pool takes"),
    Setting("max_model_len", ENGINE, int, None, nullable=True, low=1, metavar="N", group="model and device",
            help="longest context in tokens (default: the model's own)"),
    Setting("max_num_seqs", ENGINE, int, 64, low=1, runtime=True, flag="--max-batch", metavar="N",
            group="optimizations", label="max batch", help="most requests in one step (batch size)"),
    Setting("kv_cache", ENGINE, bool, True, runtime=True, toggle=True, group="optimizations", label="KV cache",
            help="keep each token's keys and values; off = naive mode, every step recomputes the whole text"),
    Setting("prefix_cache", ENGINE, bool, True, runtime=True, toggle=True, group="optimizations",
            help="reuse the KV blocks of a prompt prefix seen before (same system prompt, earlier turns)"),
    Setting("chunk_size", ENGINE, int, "auto", nullable=True, low=1, runtime=True, toggle=True,
            words=(("auto", "auto"), ("off", None), ("0", None), ("none", None)), metavar="N",
            group="optimizations", label="prefill chunk",
            help="prompt tokens per step while others decode, so their streams stay smooth; "
                 "auto = as many as fit the step budget (from measured step times), off = whole prompts"),
    Setting("step_budget", ENGINE, float, 3.0, low=1, low_open=True, high=1000, runtime=True, metavar="X",
            group="optimizations", label="step budget",
            help="with prefill chunk auto: how long a step that prefills beside running streams may take, "
                 "in decode steps; higher = newcomers start sooner, streams stall longer"),
    Setting("quant", ENGINE, str, "none", choices=("none", "int8", "int4"), runtime=True, toggle=True,
            group="optimizations", label="quantization",
            help="weight-only int8 or int4 (groups of 32): about 1/4 or 1/6 of fp32's bytes per token; "
                 "none keeps weights that are Q4_1 or Q8_0 blocks read as fp32 (the default model's) "
                 "in those blocks, the same numbers"),
    Setting("spec", ENGINE, str, "off", choices=("off", "ngram", "draft"), runtime=True, toggle=True,
            group="optimizations", label="speculative",
            help="guess tokens cheaply, check them in one forward: ngram = copy from the context, "
                 "draft = a small model (or int8 self)"),
    Setting("spec_always", ENGINE, bool, False, runtime=True, group="optimizations",
            label="keep speculation",
            help="keep speculative decoding on where it measurably slows decoding (to measure or demo "
                 "it); by default a method that does not pay here turns itself off with a notice"),
    Setting("spec_tokens", ENGINE, int, 4, low=1, runtime=True, metavar="K", group="optimizations",
            label="draft tokens", help="initial draft length k (each request then adapts its own)"),
    Setting("draft_model", ENGINE, str, None, nullable=True, group="optimizations", metavar="MODEL",
            help="draft for --spec draft: a model with the same tokenizer, or 'self' = the target in int8"),
    Setting("kernels", ENGINE, str, "auto", group="model and device", choices=("auto", "torch", "triton", "cpu"),
            help="kernel backend: auto = the Triton kernels on CUDA, the C kernels for float32 on CPU; "
                 "torch = plain PyTorch ops"),
    Setting("cuda_graphs", ENGINE, bool, True, runtime=True, toggle=True, gpu_only=True, group="optimizations",
            label="CUDA graphs",
            help="replay each decode step from a captured CUDA graph: one launch instead of hundreds "
                 "(GPU with the Triton kernels; off = launch every kernel from Python)"),
    Setting("disaggregate", ENGINE, bool, False, runtime=True, toggle=True, group="disaggregation",
            label="disaggregate",
            help="prefill prompts in a second process on cores of its own and hand their KV cache to this "
                 "one, which only decodes: streams never wait for a prefill, a newcomer's TTFT pays the transfer"),
    Setting("prefill_cores", ENGINE, int, None, nullable=True, low=1, high=_CPUS, metavar="N",
            group="disaggregation",
            help="with --disaggregate: cores of the prefill worker (default: half, at least 1); "
                 "decoding keeps the rest"),
    Setting("kv_link", ENGINE, str, "shm", choices=("shm", "socket"), group="disaggregation",
            label="KV link",
            help="how the prefill worker hands KV over: shm = shared memory, socket = a TCP connection "
                 "(a network hop, see --kv-link-gbps and --kv-link-ms)"),
    Setting("kv_link_gbps", ENGINE, float, None, nullable=True, low=0, low_open=True, runtime=True,
            words=(("off", None),), metavar="GB/S", group="disaggregation", label="KV link GB/s",
            help="simulated bandwidth of the KV hand-off in GB per second (off = as fast as the link)"),
    Setting("kv_link_ms", ENGINE, float, 0.0, low=0, high=10_000, runtime=True, metavar="MS",
            group="disaggregation", label="KV link latency",
            help="simulated latency added to each KV hand-off, in milliseconds"),
    # More threads than CPUs only slows torch down, and enough of them abort the process (libgomp).
    Setting("threads", ENGINE, int, None, nullable=True, low=1, high=_CPUS, metavar="N", group="model and device",
            help="CPU threads for torch (default: torch's choice)"),
    Setting("seed", ENGINE, int, 0, low=SEED_RANGE[0], high=SEED_RANGE[1], high_open=True, flag=None,
            no_flag="only random: models use it (tests build them from it)",
            help="seed of a random: model's weights"),
    Setting("telemetry", ENGINE, bool, True, flag=None,
            no_flag="the app and the CLI always show telemetry; scripts and tests turn it off",
            help="sample device utilization on a side thread"),
    # ---- sampling (per request) -----------------------------------------------------------
    Setting("max_tokens", SAMPLING, int, 256, low=1, metavar="N", group="sampling", help="most tokens to generate"),
    Setting("temperature", SAMPLING, float, 0.7, low=0, high=2, metavar="T", group="sampling",
            help="randomness: 0 = greedy (always the likeliest token), up to 2"),
    Setting("top_p", SAMPLING, float, 1.0, low=0, high=1, low_open=True, metavar="P", group="sampling",
            help="nucleus sampling: the smallest set of tokens holding this much probability (1 = off)"),
    Setting("top_k", SAMPLING, int, 0, low=0, metavar="K", group="sampling",
            help="sample from the K likeliest tokens (0 = off)"),
    Setting("min_p", SAMPLING, float, 0.0, low=0, high=1, high_open=True, metavar="P", group="sampling",
            help="drop tokens less likely than this share of the likeliest one (0 = off)"),
    Setting("seed", SAMPLING, int, None, nullable=True, low=SEED_RANGE[0], high=SEED_RANGE[1], high_open=True,
            group="sampling", help="for reproducible sampling (default: random)"),
    Setting("stop", SAMPLING, list, [], flag=None, chat=False,
            no_flag="stop strings come with each API request", help="end the reply at any of these strings"),
    Setting("ignore_eos", SAMPLING, bool, False, flag=None, chat=False,
            no_flag="for load tests through the API (pdchat bench serve --ignore-eos)",
            help="keep generating past the end-of-text token"),
    # ---- the chat app ---------------------------------------------------------------------
    Setting("system", CHAT, str, None, nullable=True, group="sampling", help="system prompt"),
    Setting("neighbours", CHAT, int, 0, low=0, high=16, toggle=True, flag=None,
            no_flag="a live demo control of the chat app's panel",
            help="synthetic users who chat beside you, so you see batching share the machine"),
)


def of(scope: str) -> tuple[Setting, ...]:
    return tuple(s for s in SETTINGS if s.scope == scope)


def get(name: str, scope: str | None = None) -> Setting:
    """The setting called `name` (in `scope` when two scopes use the name: seed)."""
    found = [s for s in SETTINGS if s.name == name and scope in (None, s.scope)]
    if len(found) != 1:
        raise KeyError(f"{len(found)} settings named {name!r} in scope {scope}")
    return found[0]


RUNTIME = tuple(s.name for s in of(ENGINE) if s.runtime)          # Engine.update()
TOGGLES = tuple(s for s in SETTINGS if s.toggle)                  # the chat app's panel


def fields_of(settings: tuple[Setting, ...], class_name: str) -> type:
    """A dataclass with one field per setting, its declared default; the checks are in check_all."""
    def one(s: Setting) -> tuple[str, Any, Any]:
        kind = s.kind | None if s.nullable else s.kind
        if s.words:
            kind = kind | str
        if isinstance(s.default, list):
            return s.name, kind, field(default_factory=list)
        return s.name, kind, field(default=s.default)
    return make_dataclass(class_name, [one(s) for s in settings])


def check_all(obj: Any, settings: tuple[Setting, ...]) -> None:
    for s in settings:
        s.check(getattr(obj, s.name))
