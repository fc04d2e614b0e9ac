"""`spotline` command line: run, validate, plan, submit, sweep, status, report, trace,
stacks.

Every way a command can fail ends in one line on stderr that says what happened and
what to do, and a non-zero exit: 2 for bad input (spec, URI, file, arguments), 1 for a
job that failed, 130 for Ctrl-C, 143 for SIGTERM. A job running in `spotline run` first
stops at its next step boundary with a commit (`spotline.interrupts`). A Python
traceback appears only with --debug (or SPOTLINE_DEBUG=1).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys

from spotline.checkpoint import CheckpointMismatchError, CorruptCheckpointError, StorageError
from spotline.config import SpecError
from spotline.config.redact import (
    install_log_redaction,
    join_secrets,
    masked_paths,
    read_secrets_package,
    register_secrets,
)
from spotline.config.redact import redact as _redact
from spotline.data import CorpusError
from spotline.interrupts import Interrupts
from spotline.job import JobFailed, StopTimedOut
from spotline.locate import read_trace, summary_source
from spotline.registry import user_code_error
from spotline.runtime.cluster import connect_ray

# Errors whose message is the whole story: bad input, found before anything ran.
USER_ERRORS = (
    SpecError,
    StorageError,
    CorpusError,
    CheckpointMismatchError,
    CorruptCheckpointError,
)


def _add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="YAML job spec, e.g. configs/quickstart.yaml")
    p.add_argument(
        "--config", dest="config_opt", metavar="CONFIG", help="same as the positional CONFIG"
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field, e.g. --set train.steps=50 (repeatable)",
    )
    p.add_argument("--spec-b64", help=argparse.SUPPRESS)
    p.add_argument("--secrets-module", help=argparse.SUPPRESS)


def _add_storage_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--endpoint-url", default=None, help="S3-compatible endpoint (MinIO, a test server)"
    )


def _add_overwrite_arg(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--overwrite", action="store_true", help=f"replace {what}")


def _job_from_args(args):
    from spotline.config import load_spec
    from spotline.config.loader import validate_dict
    from spotline.job import Job

    if args.spec_b64:
        try:
            raw = json.loads(base64.urlsafe_b64decode(args.spec_b64.encode()))
        except ValueError:
            raise SpecError("--spec-b64 is not a base64-encoded JSON job spec") from None
        if args.secrets_module:
            try:
                raw = join_secrets(raw, read_secrets_package(args.secrets_module))
            except ValueError as e:
                raise SpecError(str(e)) from None
        missing = masked_paths(raw)
        if missing:
            raise SpecError(
                f"{', '.join(missing)}: the submitted spec's secrets did not reach this job; "
                "submit with `spotline submit` or Job.submit, or give the cluster "
                "credentials of its own (instance role, environment)"
            )
        job = Job(validate_dict(raw, "--spec-b64"))
        return job.with_overrides(args.set) if args.set else job
    config = args.config or args.config_opt
    if not config:
        raise SpecError("give a config file, e.g. spotline run configs/quickstart.yaml")
    return Job(load_spec(config, args.set))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="spotline", description=__doc__)
    parser.add_argument(
        "--debug", action="store_true", help="show Python tracebacks (also SPOTLINE_DEBUG=1)"
    )
    sub = parser.add_subparsers(dest="cmd", required=True)

    run = sub.add_parser("run", help="run a job to completion in this driver")
    _add_spec_args(run)
    run.add_argument(
        "--address",
        default=None,
        help="Ray cluster address (default: RAY_ADDRESS or a new local cluster)",
    )
    run.add_argument("--json", metavar="PATH", help="also write the result as JSON")

    val = sub.add_parser(
        "validate", help="check a spec (and its storage and corpus) without running it"
    )
    _add_spec_args(val)
    val.add_argument("--offline", action="store_true", help="skip the storage and corpus checks")

    plan = sub.add_parser(
        "plan",
        help="predict memory, bubble, step time, checkpoint and cost before launch",
    )
    _add_spec_args(plan)
    plan.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="FLOP/s per device to plan at, in TFLOP/s (default: this machine's device)",
    )
    plan.add_argument(
        "--device-memory-gb",
        type=float,
        default=None,
        help="memory of one device (default: resources.device_memory_gb, else this machine)",
    )
    plan.add_argument("--json", metavar="PATH", help="also write the plan as JSON")

    submit = sub.add_parser("submit", help="submit through Ray's job submission API")
    _add_spec_args(submit)
    submit.add_argument(
        "--address", required=True, help="dashboard address, e.g. http://127.0.0.1:8265"
    )
    submit.add_argument("--working-dir", default=".")

    status = sub.add_parser(
        "status", help="a job's state, speed, bubbles, checkpoints and goodput, as a table"
    )
    status.add_argument(
        "job",
        nargs="?",
        help="a running job's name, or a checkpoint URI of any job (default: the one "
        "running job on the cluster)",
    )
    status.add_argument("--address", default="auto", help="Ray cluster (for a running job)")
    status.add_argument(
        "--watch", nargs="?", type=float, const=2.0, metavar="SECONDS", help="refresh until it ends"
    )
    status.add_argument("--json", action="store_true", help="print the raw summary as JSON")

    report = sub.add_parser("report", help="PNG plots: loss, step time, bubbles, goodput")
    report.add_argument("job", help="a running job's name, or a checkpoint URI")
    report.add_argument("--out", default="spotline-report", help="directory for the PNGs")
    report.add_argument("--address", default="auto", help="Ray cluster (for a running job)")

    trace = sub.add_parser(
        "trace", help="write a job's pipeline timeline as Chrome-trace JSON (Perfetto)"
    )
    trace.add_argument(
        "job", help="a running job's name, or a checkpoint URI (file://, s3://, a path)"
    )
    trace.add_argument("--out", default="spotline-trace.json", help="where to write the JSON")
    trace.add_argument("--address", default="auto", help="Ray cluster (for a running job)")

    stacks = sub.add_parser(
        "stacks", help="take the stacks of a running job's ranks now (py-spy, from each node)"
    )
    stacks.add_argument(
        "job", nargs="?", help="a running job's name (default: the one running job on the cluster)"
    )
    stacks.add_argument("--address", default="auto", help="Ray cluster the job runs on")
    stacks.add_argument("--out", metavar="PATH", help="also write every rank's threads as JSON")

    prep = sub.add_parser(
        "prepare", help="tokenize text, JSONL or Parquet into a sharded token dataset"
    )
    prep.add_argument("input", help="a file, directory, glob or fsspec URI of the raw data")
    prep.add_argument(
        "--tokenizer",
        required=True,
        help="'byte', or a tokenizer.json (or its directory or URI); never downloaded from a hub",
    )
    prep.add_argument("--out", required=True, help="where to write it (a path or fsspec URI)")
    prep.add_argument("--field", default="text", help="JSONL: the field holding the text")
    prep.add_argument("--column", default=None, help="Parquet: the column (default: --field)")
    prep.add_argument("--workers", type=int, default=None, help="processes (default: cores)")
    _add_overwrite_arg(prep, "a dataset (or other files) already at --out")
    _add_storage_args(prep)

    tok = sub.add_parser("tokenizer", help="tokenizer helpers")
    tok_sub = tok.add_subparsers(dest="tok_cmd", required=True)
    train_tok = tok_sub.add_parser(
        "train", help="train a byte-level BPE tokenizer with the `tokenizers` library"
    )
    train_tok.add_argument(
        "input", nargs="+", help="text files or directories ('stdlib': Python's sources)"
    )
    train_tok.add_argument("--vocab-size", type=int, default=8192)
    train_tok.add_argument("--out", required=True, help="directory for tokenizer.json & co")
    _add_overwrite_arg(train_tok, "files already in --out")

    sweep = sub.add_parser(
        "sweep", help="sweep job fields with Ray Tune (ASHA, PBT); every trial is a job"
    )
    sweep.add_argument("sweep_file", help="a sweep YAML (see configs/sweep.yaml)")
    sweep.add_argument(
        "--resume", action="store_true", help="continue the interrupted sweep of this file"
    )
    sweep.add_argument("--address", default=None, help="Ray cluster address (as for run)")
    sweep.add_argument("--json", metavar="PATH", help="also write the trials as JSON")

    export = sub.add_parser(
        "export", help="write a committed checkpoint as a Hugging Face model directory"
    )
    export.add_argument("checkpoint", help="the job's checkpoint URI (checkpoint.uri)")
    export.add_argument("--format", choices=["hf"], default="hf")
    export.add_argument("--out", required=True, help="a directory or fsspec URI")
    export.add_argument("--step", type=int, default=None, help="default: the latest commit")
    export.add_argument(
        "--signing-key-env", default=None, help="as checkpoint.signing_key_env of the job"
    )
    _add_overwrite_arg(export, "a model (or other files) already in --out")
    _add_storage_args(export)

    # Credentials in a URI argument (s3://KEY:SECRET@bucket) are masked wherever a
    # message, log line or library error echoes them, with or without their URI.
    register_secrets(list(sys.argv[1:] if argv is None else argv))
    args = parser.parse_args(argv)
    debug = args.debug or os.environ.get("SPOTLINE_DEBUG", "") not in ("", "0")
    install_log_redaction()
    _interrupts.install()
    try:
        return _dispatch(args)
    except Exception as e:
        if debug:
            raise
        code, line = _explain(e, args)
    except KeyboardInterrupt:
        if debug:
            raise
        code, line = _interrupts.code, _interrupts.ended_at_once()
    finally:
        _interrupts.restore()
    print(f"spotline: {_one_line(line)}", file=sys.stderr)
    return code


# SIGTERM (Kubernetes, `ray job stop`, a scheduler) and Ctrl-C: the first stops a job
# running in this driver at its next step boundary with a commit; see `interrupts`.
_interrupts = Interrupts()


def _explain(e: Exception, args: argparse.Namespace | None = None) -> tuple[int, str]:
    """(exit code, message) for an error that ends a command."""
    theirs = user_code_error(e)
    if theirs is not None:
        return 2, str(theirs)
    if isinstance(e, USER_ERRORS):
        return 2, str(e)
    if isinstance(e, JobFailed):
        print(e.result.summary(), file=sys.stderr)
        return 1, f"job failed: {e}"
    if isinstance(e, StopTimedOut):
        return _interrupts.code, str(e)
    if isinstance(e, ConnectionError) or type(e).__name__ in ("RaySystemError", "GetTimeoutError"):
        return 2, _no_cluster(e, args)
    if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError)):
        return 2, f"{e.filename or ''}: {e.strerror or e}; check the path".lstrip(": ")
    return 1, (
        f"unexpected error: {type(e).__name__}: {e}. This is a Spotline bug; rerun with "
        "--debug for the traceback"
    )


def _no_cluster(e: Exception, args: argparse.Namespace | None) -> str:
    """What to do when no Ray cluster answers; for a command that reads a running job,
    which job it looked for and how to point at its cluster."""
    why = f"{type(e).__name__}: {e}"
    cmd = getattr(args, "cmd", None)
    if cmd in ("status", "report", "trace", "stacks"):
        job = f"the running job {args.job!r}" if args.job else "the running job"
        where = os.environ.get("RAY_ADDRESS") or args.address
        return (
            f"cannot reach a Ray cluster at {where} to find {job} ({why}); point at the "
            "cluster the job runs on with --address HOST:PORT or RAY_ADDRESS (the address "
            f"`ray status` shows on its head node), or read the job from storage: spotline "
            f"{cmd} CHECKPOINT_URI (its checkpoint.uri)"
        )
    if cmd in ("run", "sweep"):
        where = os.environ.get("RAY_ADDRESS") or args.address
        return (
            f"cannot reach the Ray cluster at {where} ({why}); fix --address (or "
            "RAY_ADDRESS), or leave both unset to start a local cluster"
        )
    return (
        f"cannot reach a Ray cluster ({why}); start one with `ray start --head`, pass "
        "--address, or give a checkpoint URI to read a finished job"
    )


def _sweep(args) -> int:
    from pathlib import Path

    from spotline.config.sweep import load_sweep
    from spotline.job import Job
    from spotline.tune import Tuner, from_sweep_spec

    sweep, here = load_sweep(args.sweep_file)
    if isinstance(sweep.job, str):
        job = Job.from_yaml(here / sweep.job, sweep.overrides)
    else:
        job = Job.from_dict(sweep.job, sweep.overrides)
    tuner = from_sweep_spec(sweep, job)  # every check, before anything starts
    connect_ray(args.address)
    if args.resume:
        exp = Path(tuner.run_config.storage_path) / tuner.run_config.name
        tuner = Tuner.restore(exp, job, sweep.param_space)
    grid = tuner.fit()
    metric, mode = sweep.scheduler.metric, sweep.scheduler.mode
    rows = [_trial_row(r, metric) for r in grid]
    for row in rows:
        print(
            f"{row['trial']}: {row['state']} at step {row['step']}, {row['metric']} "
            f"{row['value']}, {row['config']}"
        )
    try:
        best = grid.get_best_result(metric, mode)
        print(f"best: {best.config} ({metric} {best.metrics.get(metric)}) at {best.path}")
    except RuntimeError:
        print("best: no trial reported a result")
    print(f"sweep state: {Path(tuner.run_config.storage_path) / tuner.run_config.name}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2, default=str)
    return 0 if not grid.errors else 1


def _stacks(args) -> int:
    """Every rank's stack from the running job's controller, which reads them from a task
    on each rank's node (a hung rank answers no call of its own)."""
    import ray

    from spotline import constants
    from spotline.locate import live_controller, running_job
    from spotline.report import stacks_lines

    controller = live_controller(args.job or running_job(args.address), args.address)
    wait = constants.SPOTLINE_STACKS_TIMEOUT_S + 30
    record = ray.get(controller.stacks.remote(), timeout=wait)
    if record.get("error"):
        raise SpecError(record["error"])
    for line in stacks_lines(record):
        print(line)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2, default=_text)
        print(f"wrote {args.out}")
    return 0


def _text(value) -> str:
    """JSON for what json cannot write itself (a flight record's bytes are JSON text)."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _trial_row(result, metric: str) -> dict:
    m = result.metrics or {}
    return {
        "trial": m.get("trial_id"),
        "state": "error" if result.error else ("finished" if m.get("finished") else "stopped"),
        "step": m.get("step"),
        "metric": metric,
        "value": m.get(metric),
        "config": result.config,
        "checkpoint_uri": m.get("checkpoint_uri"),
        "error": str(result.error) if result.error else None,
    }


def _one_line(text: str) -> str:
    return _redact(" ".join(str(text).split()))


def _check_uri_args(args) -> None:
    """The URI arguments of `prepare` and `export` in schemes Spotline reads and writes
    (the spec's URIs are checked as it loads)."""
    from spotline.config.urls import READ_SCHEMES, WRITE_SCHEMES, check_scheme

    named = {
        "prepare": [("INPUT", "input", READ_SCHEMES), ("--out", "out", WRITE_SCHEMES)],
        "export": [("--out", "out", WRITE_SCHEMES)],
    }.get(args.cmd, [])
    if args.cmd == "prepare" and args.tokenizer != "byte":
        named.append(("--tokenizer", "tokenizer", READ_SCHEMES))
    for name, attr, schemes in named:
        try:
            check_scheme(getattr(args, attr), name, schemes)
        except ValueError as e:
            raise SpecError(str(e)) from None


def _dispatch(args) -> int:
    _check_uri_args(args)
    if args.cmd == "run":
        job = _job_from_args(args)
        _interrupts.run = job.start(address=args.address)
        result = _interrupts.run.wait()
        print(result.summary())
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result.__dict__, f, indent=2, default=str)
        if result.state == "stopped":  # on this driver's SIGTERM or Ctrl-C
            print(f"spotline: {_one_line(_interrupts.stopped(result))}", file=sys.stderr)
            return _interrupts.code
        return 0
    if args.cmd == "validate":
        job = _job_from_args(args)
        from spotline.preflight import check_offline, preflight

        (check_offline if args.offline else preflight)(job.spec)
        print(f"{job.spec.name}: OK (spec hash {job.spec.spec_hash()})")
        from spotline.planning.plan import make_plan

        for warning in make_plan(job.spec).warnings:  # the checks `spotline plan` makes
            print(f"spotline: warning: {warning}", file=sys.stderr)
        return 0
    if args.cmd == "plan":
        job = _job_from_args(args)
        plan = job.plan(peak_tflops=args.peak_tflops, device_memory_gb=args.device_memory_gb)
        print(plan.render())
        if args.json:
            with open(args.json, "w") as f:
                json.dump(plan.to_dict(), f, indent=2)
        return 0
    if args.cmd == "submit":
        handle = _job_from_args(args).submit(args.address, args.working_dir)
        print(
            f"submitted {handle.submission_id}; follow with: ray job logs -f {handle.submission_id}"
        )
        return 0
    if args.cmd == "status":
        fetch = summary_source(args.job, args.address)
        if args.json:
            print(json.dumps(fetch(), indent=2, default=str))
            return 0
        from spotline.report import print_status

        print_status(fetch, watch=args.watch)
        return 0
    if args.cmd == "report":
        from pathlib import Path

        from spotline.report import write_report

        summary = summary_source(args.job, args.address)()
        trace = read_trace(args.job, args.address, required=False)
        for path in write_report(summary, trace, Path(args.out)):
            print(f"wrote {path}")
        return 0
    if args.cmd == "trace":
        trace = read_trace(args.job, args.address, required=True)
        with open(args.out, "w") as f:
            json.dump(trace, f)
        print(f"wrote {args.out}: open it at https://ui.perfetto.dev or chrome://tracing")
        return 0
    if args.cmd == "stacks":
        return _stacks(args)
    if args.cmd == "prepare":
        from spotline.data import load_tokenizer_at
        from spotline.data.prepare import prepare

        tokenizer = load_tokenizer_at(args.tokenizer, endpoint_url=args.endpoint_url)
        index = prepare(
            args.input,
            tokenizer,
            args.out,
            text_field=args.field,
            column=args.column,
            workers=args.workers,
            endpoint_url=args.endpoint_url,
            overwrite=args.overwrite,
        )
        print(
            _one_line(
                f"wrote {index['total_tokens']:,} tokens of {index['documents']:,} documents "
                f"in {len(index['shards'])} shard(s) to {args.out}; train on it with data: "
                f"{{kind: tokens, uri: {args.out}}}"
            )
        )
        return 0
    if args.cmd == "tokenizer":
        from spotline.data.tokenizer import train_bpe

        inputs = args.input[0] if args.input == ["stdlib"] else args.input
        path = train_bpe(inputs, args.out, vocab_size=args.vocab_size, overwrite=args.overwrite)
        print(f"wrote {path}; use it with tokenizer: {{kind: huggingface, path: {args.out}}}")
        return 0
    if args.cmd == "sweep":
        return _sweep(args)
    if args.cmd == "export":
        from spotline.checkpoint import CheckpointStore, StoreFields
        from spotline.hf_export import export_hf

        store = CheckpointStore(
            args.checkpoint,
            endpoint_url=args.endpoint_url,
            signing_key_env=args.signing_key_env,
            fields=StoreFields.argument("CHECKPOINT"),
        )
        step, out = export_hf(store, args.out, args.step, overwrite=args.overwrite)
        print(
            _one_line(
                f"exported step {step} of {store.uri} to {out}; load it with "
                f"transformers.AutoModelForCausalLM.from_pretrained({out!r})"
            )
        )
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
