"""A command line that explains itself, checked without Ray: every command has a
one-line description and help on every option with its default; `--json` means one
thing everywhere; an ended job is found by its name from where it last ran; Ray's
token-authentication mode is stated only where Spotline starts or finds a cluster."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from spotline import job_index
from spotline.cli import main, ray_auth_mode
from spotline.cli_args import build_parser, render_reference, subcommands
from spotline.config import JobSpec

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")


def _options(p: argparse.ArgumentParser):
    return [
        a
        for a in p._actions
        if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)
    ]


def test_every_command_is_listed_with_one_line_and_has_a_description():
    parser = build_parser()
    top = parser.format_help()
    commands = subcommands(parser)
    for name in ("run", "validate", "plan", "submit", "status", "report", "trace", "stacks",
                 "prepare", "tokenizer", "tokenizer train", "sweep", "export"):  # fmt: skip
        assert name in commands, name
        p = commands[name]
        assert p.description and p.description.strip().endswith("."), name
        if " " not in name:
            assert f"    {name} " in top or f"    {name}\n" in top, name


def test_every_option_has_help_and_says_its_default():
    for name, p in subcommands(build_parser()).items():
        for action in _options(p):
            if isinstance(action, argparse._SubParsersAction):
                continue
            assert action.help, f"spotline {name}: {action.dest} has no help"
            text = p.formatter_class(prog="x")._get_help_string(action)
            if action.option_strings and action.default not in (None, False, []):
                assert "default" in text, f"spotline {name} {action.option_strings[0]}"


def test_default_outputs_are_named_in_the_help():
    commands = subcommands(build_parser())
    assert "./spotline-report/" in commands["report"].format_help()
    assert "./spotline-trace.json" in commands["trace"].format_help()


def test_json_takes_a_path_on_every_command_that_has_it():
    commands = subcommands(build_parser())
    having = [
        n for n, p in commands.items() if any("--json" in a.option_strings for a in p._actions)
    ]
    assert set(having) >= {"run", "validate", "plan", "status", "stacks", "sweep", "submit"}
    for name in having:
        action = next(a for a in commands[name]._actions if "--json" in a.option_strings)
        assert action.metavar == "PATH" and action.nargs is None, name
        assert "'-': to stdout" in action.help, name
    # One name for one thing: stacks writes its JSON with --json, not --out.
    assert not any("--out" in a.option_strings for a in commands["stacks"]._actions)


def test_json_dash_puts_only_json_on_stdout(capsys):
    assert main(["validate", QUICKSTART, "--offline", "--json", "-"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out)["name"] == "quickstart"
    assert main(["plan", QUICKSTART, "--peak-tflops", "0.1", "--json", "-"]) == 0
    captured = capsys.readouterr()
    plan = json.loads(captured.out)
    assert plan["stages"] and "memory" not in captured.out.splitlines()[0]


def test_json_path_writes_a_file_beside_the_usual_output(tmp_path, capsys):
    out = tmp_path / "v.json"
    assert main(["validate", QUICKSTART, "--offline", "--json", str(out)]) == 0
    assert "quickstart: OK" in capsys.readouterr().out
    assert json.loads(out.read_text())["spec_hash"]


def test_status_watch_and_json_dash_are_refused_in_one_line(capsys):
    assert main(["status", "x", "--watch", "--json", "-"]) == 2
    assert "--watch" in capsys.readouterr().err


# --- an ended job by its name --------------------------------------------------------


def _ended_job(tmp_path: Path, name: str) -> str:
    from spotline.checkpoint import SUMMARY_ARTIFACT, CheckpointStore

    store = CheckpointStore(f"file://{tmp_path}/{name}/checkpoints")
    summary = {"name": name, "state": "finished", "step": 7}
    store.write_artifact(SUMMARY_ARTIFACT, json.dumps(summary).encode())
    return store.uri


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPOTLINE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def not_running(monkeypatch):
    """No running controller answers to any name (as when the job's cluster is gone)."""
    import spotline.locate as locate

    def none(name, address):
        raise ConnectionError("nothing answers at 127.0.0.1:6379 (Connection refused)")

    monkeypatch.setattr(locate, "live_controller", none)


def test_an_ended_job_is_found_by_name_where_it_last_ran(tmp_path, home, not_running, capsys):
    uri = _ended_job(tmp_path, "ended")
    job_index.record(JobSpec(name="ended"), uri)
    assert (home / "jobs" / "ended.json").is_file()
    assert main(["status", "ended", "--json", "-"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out) == {"name": "ended", "state": "finished", "step": 7}
    assert "ended is not running; reading it from where it last ran" in captured.err
    assert uri in captured.err


def test_the_last_run_of_a_name_wins_and_unknown_names_say_what_to_do(
    tmp_path, home, not_running, capsys
):
    first, second = _ended_job(tmp_path / "a", "twice"), _ended_job(tmp_path / "b", "twice")
    job_index.record(JobSpec(name="twice"), first)
    job_index.record(JobSpec(name="twice"), second)
    assert job_index.last_run("twice")["checkpoint_uri"] == second
    assert main(["status", "never-ran"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "CHECKPOINT_URI" in err


def test_no_secret_reaches_the_index(tmp_path, home):
    job_index.record(JobSpec(name="creds"), "s3://KEY:SECRET@bucket/ckpt")
    assert job_index.last_run("creds") is None
    assert not (home / "jobs" / "creds.json").exists()
    assert job_index.last_run("../escape") is None


def test_an_unwritable_home_never_fails_a_job(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("SPOTLINE_HOME", str(blocker))  # a file: no directory inside it
    job_index.record(JobSpec(name="x"), f"file://{tmp_path}/ckpt")
    assert job_index.last_run("x") is None


# --- Ray's token authentication --------------------------------------------------------


@pytest.mark.parametrize(
    ("cmd", "address", "job", "token", "mode"),
    [
        ("run", None, None, False, "token"),  # a new local cluster: Ray's default, stated
        ("sweep", None, None, True, "token"),
        ("run", "10.0.0.1:6379", None, True, None),  # another machine: Ray decides
        ("run", "127.0.0.1:6379", None, True, "token"),  # this machine's, a token
        ("status", "localhost:6379", "quickstart", True, "token"),
        ("status", "127.0.0.1:6379", "quickstart", False, None),
        ("run", "auto", None, True, "token"),  # a cluster found on this machine, a token
        ("run", "auto", None, False, None),
        ("status", "auto", "quickstart", True, "token"),  # this machine's clusters, a token
        ("status", "auto", "quickstart", False, None),  # no token: Ray would not turn it on
        ("status", "auto", "file:///tmp/ckpt", True, None),  # read from storage: no Ray
        ("stacks", "auto", None, True, "token"),
        ("validate", None, None, True, None),  # never touches Ray
        ("export", None, None, True, None),
    ],
)
def test_the_auth_mode_is_stated_only_where_spotline_starts_or_finds_a_cluster(
    cmd, address, job, token, mode
):
    args = argparse.Namespace(cmd=cmd, address=address, job=job)
    assert ray_auth_mode(args, ray_address=None, token_exists=lambda: token) == mode
    assert ray_auth_mode(args, ray_address="10.0.0.9:6379", token_exists=lambda: token) is None


def test_a_token_is_found_where_ray_looks_for_it(tmp_path, monkeypatch):
    from spotline.cli import _ray_token_exists

    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "token"))
    assert not _ray_token_exists()
    (tmp_path / "token").write_text("t")
    assert _ray_token_exists()
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "none"))
    monkeypatch.setenv("RAY_AUTH_TOKEN", "t")
    assert _ray_token_exists()


# --- the manual's reference ------------------------------------------------------------


def test_the_cli_reference_is_what_the_parser_prints():
    from spotline.cli_args import COMMAND

    committed = (ROOT / "docs" / "reference" / "cli.md").read_text()
    assert committed == render_reference(), (
        f"docs/reference/cli.md differs from the command line's help; regenerate it with "
        f"`{COMMAND}`"
    )
