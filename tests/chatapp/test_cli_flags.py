"""Every shared flag means the same in every command: for each flag and each command (chat, run,
bench, serve), the flag reaches the EngineConfig / SamplingParams (or the request) that command
builds, or, where the command has no use for it, is a usage error. The engine, the app, the
server and the load test are replaced by stand-ins that record what they are handed."""
from __future__ import annotations

import pytest

from pdchat.chatapp.backends.base import Settings
from pdchat.chatapp.cli.main import main
from pdchat.chatapp.backends.openai_client import Endpoint
from pdchat.chatapp.tui.store import Store
from pdchat.engine import EngineConfig, SamplingParams
from pdchat.engine import settings
from pdchat.engine.paths import data_dir

from ..setting_values import other_value, typed

# (the flag as typed, the field it sets, the value it sets): every flag of the settings
# declaration with a value that is not its default, plus the words that stand for values.
ENGINE_CASES = [(typed(s, other_value(s)), s.name, other_value(s))
                for s in settings.of(settings.ENGINE) if s.cli_flag] + [
    (["--chunk-size", "0"], "chunk_size", None),
    (["--chunk-size", "off"], "chunk_size", None),
    (["--kv-cache-mb", "24"], "kv_cache_mb", 24),
]
SAMPLING_CASES = [(typed(s, other_value(s)), s.name, other_value(s))
                  for s in settings.of(settings.SAMPLING) if s.cli_flag] + [
    (["--seed", str(2**64 - 1)], "seed", 2**64 - 1),
    (["--seed", str(-2**63)], "seed", -2**63),
]
SYSTEM = ["--system", "Be brief."]
# How each command is typed; the shared flags go after it, or (`before`) between `pdchat` and it.
LOCAL = {"chat": [], "run": ["run", "hi"], "bench": ["bench", "lab"], "serve": ["serve"]}
REMOTE = {"chat": ["--backend", "http://h:1"], "run": ["run", "hi", "--backend", "http://h:1"],
          "bench": ["bench", "serve", "--backend", "http://h:1"]}
# (command, flags before it): chat has no command word to put flags before
PLACES = [(command, before) for command in LOCAL for before in (False, True) if command != "chat" or not before]


def place_id(value: str | bool) -> str:
    return value if isinstance(value, str) else "before" if value else "after"


class Captured(Exception):
    """Ends a command once what it hands on has been recorded."""


@pytest.fixture
def seen(monkeypatch):
    """What the command handed on: config, params, system (local); body (remote); spec (bench serve)."""
    seen: dict = {}

    class FakeEngine:
        def __init__(self, config, **overrides):
            seen["config"] = config
            self.device = "cpu"

        def take_notices(self):
            return []

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def submit(self, prompt, params, system=None):
            seen["params"], seen["system"] = params, system
            raise Captured

        def close(self):
            pass

    class FakeApp:
        """Loads the backend and sends one message with the app's settings, as the UI would."""
        def __init__(self, backend, store, *, settings, toggles, **kw):
            self.backend, self.settings = backend, settings
            seen["toggles"] = toggles
            self.return_code = 0

        def run(self):
            self.backend.load(lambda line: None)
            self.backend.stream([{"role": "user", "content": "hi"}], self.settings)

    class FakeGeneration:
        def __init__(self, client, endpoint, body):
            seen["body"] = body
            raise Captured

    def fake_remote_load(self, progress):
        self.endpoint = Endpoint.parse(self.url)
        self.model = self.requested_model or "served"

    def fake_suite(name, config, **kw):
        seen["config"] = config
        raise Captured

    async def fake_load(spec, progress):
        seen["spec"] = spec
        raise Captured

    monkeypatch.setattr("pdchat.engine.Engine", FakeEngine)
    monkeypatch.setattr("pdchat.bench.run_suite", fake_suite)
    monkeypatch.setattr("pdchat.chatapp.serve.app.serve", lambda config, **kw: seen.update(config=config))
    monkeypatch.setattr("pdchat.chatapp.tui.app.PdchatApp", FakeApp)
    monkeypatch.setattr("pdchat.chatapp.backends.remote.RemoteBackend.load", fake_remote_load)
    monkeypatch.setattr("pdchat.chatapp.backends.remote.RemoteGeneration", FakeGeneration)
    monkeypatch.setattr("pdchat.chatapp.reporting.loadtest.run_load", fake_load)
    return seen


def invoke(argv: list[str]) -> int | None:
    """main(argv); None when it got as far as a stand-in."""
    try:
        return main(argv)
    except Captured:
        return None


def command_line(command: str, flags: list[str], before: bool, remote: bool = False) -> list[str]:
    words = (REMOTE if remote else LOCAL)[command]
    return flags + words if before else words + flags


def test_the_cli_and_the_app_have_the_engines_sampling_defaults():
    # The app's Settings stand in for SamplingParams where no flag is given: same defaults.
    params = SamplingParams()
    shared = {k: v for k, v in Settings().to_dict().items() if k != "system"}
    assert shared.keys() >= {"max_tokens", "temperature", "top_p", "top_k", "min_p", "seed"}
    assert {k: getattr(params, k) for k in shared} == shared


@pytest.mark.parametrize("command", list(LOCAL))
def test_no_flags_means_the_engines_defaults(command, seen):
    assert invoke(LOCAL[command]) in (None, 0)
    assert seen["config"] == EngineConfig()
    if command in ("chat", "run"):
        assert seen["params"] == SamplingParams() and seen["system"] is None


@pytest.mark.parametrize("command, before", PLACES, ids=place_id)
@pytest.mark.parametrize("flag, field, value", ENGINE_CASES, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_an_engine_flag_reaches_the_engine_config(command, flag, field, value, before, seen, capsys):
    code = invoke(command_line(command, flag, before))
    assert code in (None, 0), capsys.readouterr().err
    assert seen["config"] == EngineConfig(**{field: value})      # this field set, every other one the default


@pytest.mark.parametrize("command, before", [p for p in PLACES if p[0] in ("chat", "run")],
                         ids=place_id)
@pytest.mark.parametrize("flag, field, value", SAMPLING_CASES, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_a_sampling_flag_reaches_the_sampling_params(command, flag, field, value, before, seen, capsys):
    assert invoke(command_line(command, flag, before)) is None, capsys.readouterr().err
    assert seen["params"] == SamplingParams(**{field: value})
    assert seen["config"] == EngineConfig()


@pytest.mark.parametrize("command", ["chat", "run"])
def test_the_system_prompt_reaches_the_engine(command, seen):
    assert invoke(LOCAL[command] + SYSTEM) is None
    assert seen["system"] == "Be brief."


@pytest.mark.parametrize("command", ["chat", "run", "bench"])
@pytest.mark.parametrize("flag, field, value", SAMPLING_CASES, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_a_sampling_flag_reaches_the_server(command, flag, field, value, seen, capsys):
    assert invoke(command_line(command, flag, before=False, remote=True)) is None, capsys.readouterr().err
    if command == "bench":                     # bench serve: the load test's requests
        assert getattr(seen["spec"], field) == value
    else:
        assert seen["body"][field] == value


@pytest.mark.parametrize("command", ["chat", "run"])
def test_model_and_system_reach_the_server(command, seen):
    assert invoke(command_line(command, ["--model", "m2", *SYSTEM], before=False, remote=True)) is None
    assert seen["body"]["model"] == "m2"
    assert seen["body"]["messages"][0] == {"role": "system", "content": "Be brief."}


def test_model_reaches_the_load_test(seen):
    assert invoke(REMOTE["bench"] + ["--model", "m2"]) is None
    assert seen["spec"].model == "m2"


def unused(capsys, argv: list[str]) -> str:
    code = invoke(argv)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    return err


@pytest.mark.parametrize("command", ["serve", "bench"])
@pytest.mark.parametrize("flag", [case[0] for case in SAMPLING_CASES] + [SYSTEM], ids=lambda v: v[0])
def test_a_sampling_flag_where_nothing_samples_is_a_usage_error(command, flag, seen, capsys):
    err = unused(capsys, LOCAL[command] + flag)
    assert f"{flag[0]} does nothing here" in err and "config" not in seen


@pytest.mark.parametrize("command", list(REMOTE))
@pytest.mark.parametrize("flag", [case[0] for case in ENGINE_CASES if case[1] != "model"], ids=lambda v: v[0])
def test_an_engine_flag_with_a_remote_server_is_a_usage_error(command, flag, seen, capsys):
    err = unused(capsys, command_line(command, flag, before=False, remote=True))
    assert f"{flag[0]} does nothing here" in err and not seen


@pytest.mark.parametrize("command", ["models", "info", "pull"])
def test_flags_before_a_command_without_them_are_usage_errors(command, seen, capsys):
    err = unused(capsys, ["--threads", "1", "--temperature", "0", command])
    assert "--threads, --temperature do nothing here" in err


def test_model_before_pull_is_the_model_pulled(monkeypatch):
    pulled = []

    def resolve(spec):
        pulled.append(spec)
        raise Captured

    monkeypatch.setattr("pdchat.engine.model_source.resolve", resolve)
    assert invoke(["--model", "random:tiny", "pull"]) is None and pulled == ["random:tiny"]


def test_a_flag_beats_a_saved_toggle_and_a_saved_toggle_beats_the_default(seen):
    store = Store(data_dir() / "pdchat.db")
    store.set_setting("toggles", {"kv_cache": False, "prefix_cache": True, "chunk_size": 64, "spec": "ngram",
                                  "quant": "none", "neighbours": 0})
    store.close()
    assert invoke(["--spec", "off", "--chunk-size", "0"]) is None
    assert seen["config"] == EngineConfig(kv_cache=False, prefix_cache=True, chunk_size=None, spec="off", quant="none")
    t = seen["toggles"]
    assert (t.kv_cache, t.chunk_size, t.spec) == (False, None, "off")      # what the panel shows
