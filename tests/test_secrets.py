"""Credentials never leave the process that was given them: URI userinfo typed on the
command line or written in a spec is masked in every message, and a custom model's
config is redacted in manifests and artifacts.

No Ray here (see test_secrets_ray.py for what actors are given).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spotline.cli import main
from spotline.config import SpecError, load_spec, redact
from spotline.config.redact import join_secrets, masked_paths, split_secrets

pytestmark = pytest.mark.unit

KEY = "AKIAEXAMPLEKEY"
SECRET = "verysecretvalue"
URI = f"s3://{KEY}:{SECRET}@bucket/x"


def _clean(text: str) -> None:
    assert KEY not in text and SECRET not in text, text


def test_redact_masks_uri_userinfo_in_free_text_and_its_later_echoes() -> None:
    user, password = "svc-tracker-user", "tracker-pass-8c1e"
    text = f"cannot reach https://{user}:{password}@mlflow.internal:5000/api (refused)"
    assert redact(text) == "cannot reach https://***@mlflow.internal:5000/api (refused)"
    # A client library that repeats the credentials without their URI, in the same
    # message or a later one.
    _clean(redact(f"{URI}: invalid bucket name '{KEY}:{SECRET}@bucket'"))
    _clean(redact(f"Invalid bucket name '{KEY}:{SECRET}@bucket'"))
    assert redact(f"password {password} rejected") == "password *** rejected"
    # Any scheme, a password with an unencoded '@', and URIs nested in data.
    assert redact("sftp://me:p@ss-w0rd@host/d") == "sftp://***@host/d"
    assert redact({"tracking_uri": "http://bob:hunter2@h:5000", "n": 3}) == {
        "tracking_uri": "http://***@h:5000",
        "n": 3,
    }
    # What is not userinfo stays as it is.
    plain = "s3://bucket/a@b file:///x/y@z mail ops@example.com s3://b/k?v=a@b"
    assert redact(plain) == plain


def test_uri_credentials_in_a_spec_travel_apart_on_submit(tmp_path: Path) -> None:
    raw = {"checkpoint": {"uri": f"file://{tmp_path}/ckpt"}, "data": {"uri": URI}}
    public, secrets = split_secrets(raw)
    _clean(json.dumps(public))
    assert public["data"]["uri"] == "s3://***@bucket/x"
    assert masked_paths(public) == ["data.uri"]  # the receiving side knows what is missing
    assert join_secrets(public, secrets) == raw


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    _clean(out + err)
    return code, err


@pytest.mark.parametrize(
    "argv, named",
    [
        (["export", URI, "--out", "{out}"], "the CHECKPOINT argument 's3://***@bucket/x'"),
        (["status", URI], "the JOB argument 's3://***@bucket/x'"),
        (["report", URI, "--out", "{out}"], "the JOB argument 's3://***@bucket/x'"),
        (["trace", URI, "--out", "{out}.json"], "the JOB argument 's3://***@bucket/x'"),
        (["prepare", URI, "--tokenizer", "byte", "--out", "{out}"], "input: "),
        (["prepare", "{text}", "--tokenizer", URI, "--out", "{out}"], "--tokenizer: "),
    ],
)
def test_cli_never_echoes_uri_credentials_and_names_the_argument(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], named: str
) -> None:
    (tmp_path / "in.txt").write_text("some text to tokenize\n")
    where = {"out": tmp_path / "out", "text": tmp_path / "in.txt"}
    code, err = _run(capsys, *(a.format(**where) for a in argv))
    assert code == 2 and err.startswith("spotline: ") and err.count("\n") == 1, err
    assert named in err
    assert "checkpoint.uri" not in err and "tokenizer.path" not in err


def test_cli_masks_credentials_of_an_endpoint_url(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    endpoint = f"http://{KEY}:{SECRET}@127.0.0.1:9"
    argv = ["export", str(tmp_path), "--endpoint-url", endpoint, "--out", str(tmp_path / "hf")]
    code, err = _run(capsys, *argv)
    assert code == 2 and "--endpoint-url ('http://***@127.0.0.1:9')" in err
    assert "the CHECKPOINT argument" in err


def test_prepare_keeps_uri_credentials_out_of_its_output_and_the_index(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import fsspec

    from spotline.data import ByteTokenizer
    from spotline.data.prepare import prepare

    source = f"memory://{KEY}:{SECRET}@bucket/in.txt"
    with fsspec.open(source, "w") as f:
        f.write("some text to tokenize\n")
    out = f"memory://{KEY}:{SECRET}@bucket/data"
    # The command refuses a scheme it does not write to, without echoing the userinfo.
    code, err = _run(capsys, "prepare", source, "--tokenizer", "byte", "--out", out)
    assert code == 2 and "memory://" in err
    # The library writes to any fsspec filesystem; its index records the input masked.
    prepare(source, ByteTokenizer(), out, workers=1, progress=False)
    fs = fsspec.filesystem("memory")
    index = json.loads(fs.cat_file(f"/{KEY}:{SECRET}@bucket/data/index.json"))
    _clean(json.dumps(index))
    assert index["inputs"][0]["uri"] == "memory://***@bucket/in.txt"


def test_a_spec_with_uri_credentials_registers_them(tmp_path: Path) -> None:
    load_spec(
        {
            "name": "sec",
            "checkpoint": {"uri": f"file://{tmp_path}/ckpt"},
            "data": {"kind": "tokens", "uri": "https://ops-user:0p5-s3cr3t!@h:1/data"},
        }
    )
    # A library error that echoes the password alone, without its URI.
    assert redact("401 for user ops-user with 0p5-s3cr3t!") == "401 for user *** with ***"
    # A refused field never echoes them either.
    bad = {"kind": "mlflow", "tracking_uri": "http://ops-user:an0ther-s3cr3t@h:1"}
    with pytest.raises(SpecError) as ei:
        load_spec({"name": "sec", "tracking": [bad]})
    assert "an0ther-s3cr3t" not in str(ei.value) and "tracking[0].tracking_uri" in str(ei.value)


def test_validating_a_spec_registers_nothing_and_loading_it_to_run_does(tmp_path: Path) -> None:
    import spotline
    from spotline.config import JobSpec, validate_dict

    def raw(password: str) -> dict:
        uri = f"https://ops-user:{password}@h:1/data"
        return {
            "checkpoint": {"uri": f"file://{tmp_path}/ckpt"},
            "data": {"kind": "tokens", "uri": uri},
        }

    checked, built = "only-validated-s3cr3t", "built-by-hand-s3cr3t"
    for _ in range(2):
        JobSpec.model_validate(raw(checked))
    assert redact(f"401 with {checked}") == f"401 with {checked}"
    validate_dict(raw(checked))  # a spec loaded to run
    assert redact(f"401 with {checked}") == "401 with ***"
    # A spec built with the SDK's models, then run as a job.
    spotline.Job(JobSpec.model_validate(raw(built)))
    assert redact(f"401 with {built}") == "401 with ***"


def test_manifests_record_a_custom_models_config_with_its_secrets_masked(tmp_path: Path) -> None:
    def spec(width: int):
        config = {"width": width, "depth": 2, "api_token": "hf_UserProviderToken123"}
        model = {"kind": "custom", "provider": "custom_model:PROVIDER", "config": config}
        return load_spec({"name": "c", "model": model, "checkpoint": {"uri": str(tmp_path)}})

    recorded = spec(16).recorded_fields()
    assert recorded["model.config.api_token"] == "***" and recorded["model.config.width"] == 16
    assert "hf_UserProviderToken123" not in json.dumps(recorded)
    # What a refused resume reports compares like with like, and never the token.
    assert spec(32).changed_fields(recorded) == ["model.config.width"]


def test_log_records_mask_uri_userinfo(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from spotline.config.redact import install_log_redaction

    install_log_redaction()
    with caplog.at_level(logging.INFO):
        logging.getLogger("s3fs.test").info("opening %s", URI)
    assert "s3://***@bucket/x" in caplog.text
    _clean(caplog.text)


@pytest.mark.unit
@pytest.mark.parametrize("field", ["data.endpoint_url", "checkpoint.endpoint_url"])
def test_an_endpoint_url_with_credentials_is_refused_without_echoing_them(field):
    with pytest.raises(SpecError) as e:
        load_spec(None, {field: "http://AKIAEXAMPLE:s3cr3tvalue@127.0.0.1:9000"})
    msg = str(e.value)
    assert f"{field}: must not hold a user or password" in msg
    assert "s3cr3tvalue" not in msg and "AKIAEXAMPLE" not in msg
    assert "AWS_ACCESS_KEY_ID" in msg  # where credentials go instead
