"""`spotline` command line: run, validate, plan, submit, status, report, trace, chaos,
stacks, prepare, tokenizer, sweep, export. The commands, their options and help live in
`spotline.cli_args`; this module carries them out.

Every way a command can fail ends in one line on stderr that says what happened and
what to do, and a non-zero exit: 2 for bad input (spec, URI, file, arguments), 1 for a
job that failed, 130 for Ctrl-C, 143 for SIGTERM. A job running in `spotline run` first
stops at its next step boundary with a commit (`spotline.interrupts`). A Python
traceback appears only with --debug (or SPOTLINE_DEBUG=1).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import sys
from pathlib import Path

from spotline.checkpoint import CheckpointMismatchError, CorruptCheckpointError, StorageError
from spotline.cli_args import build_parser
from spotline.config import SpecError
from spotline.config.redact import (
    install_log_redaction,
    join_secrets,
    masked_paths,
    register_secrets,
)
from spotline.config.redact import redact as _redact
from spotline.data import CorpusError
from spotline.interrupts import Interrupts
from spotline.job_outcome import JobFailed, StopTimedOut
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
            from spotline.runtime.sealed import take_secrets_package

            try:
                raw = join_secrets(raw, take_secrets_package(args.secrets_module))
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
    # First: a signal at any moment from here ends in a commit or in a line saying that
    # nothing was committed.
    _interrupts.install()
    debug = os.environ.get("SPOTLINE_DEBUG", "") not in ("", "0")
    args = None
    try:
        parser = build_parser()
        # Credentials in a URI argument (s3://KEY:SECRET@bucket) are masked wherever a
        # message, log line or library error echoes them, with or without their URI.
        register_secrets(list(sys.argv[1:] if argv is None else argv))
        args = parser.parse_args(argv)
        debug = debug or args.debug
        install_log_redaction()
        state_ray_auth_mode(args)
        with _json_on_stdout(args):
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

# Commands that read a running job from this machine's clusters when given a name.
_READERS = ("status", "report", "trace", "stacks")


def state_ray_auth_mode(args: argparse.Namespace) -> None:
    """Tell Ray the token-authentication mode it would choose itself, before it is
    imported, so that it does not announce its choice on every command (Ray reads
    RAY_AUTH_MODE once, at import). A mode the user set is left alone."""
    if os.environ.get("RAY_AUTH_MODE") or "ray" in sys.modules:
        return
    mode = ray_auth_mode(args, os.environ.get("RAY_ADDRESS"), _ray_token_exists)
    if mode:
        os.environ["RAY_AUTH_MODE"] = mode


def ray_auth_mode(args: argparse.Namespace, ray_address: str | None, token_exists) -> str | None:
    """The mode Ray would turn on for this command, where Ray would announce it: a new
    local cluster turns token mode on; attaching to a cluster found on this machine
    turns it on when a token exists, an explicit loopback address included (a cluster
    `spotline run` started, named by its address: Ray itself would send no token, and
    fail). None: an explicit address of another machine (Ray decides silently, and this
    machine's token is not offered to it), or a command that never touches Ray."""
    address = ray_address or getattr(args, "address", None)
    if address not in (None, "auto") and _is_loopback(address):
        address = "auto"
    if args.cmd == "chaos":
        return "token"  # it always starts a local cluster of its own
    starts = args.cmd in ("run", "sweep")
    if starts and not address:
        return "token"
    if (starts and address == "auto") or (
        args.cmd in _READERS and address in (None, "auto") and not _reads_storage(args)
    ):
        return "token" if token_exists() else None
    return None


def _is_loopback(address: str) -> bool:
    """Whether a Ray address (HOST:PORT, optionally ray://) names this machine's loopback."""
    import ipaddress

    host = address.removeprefix("ray://").partition("/")[0].rpartition(":")[0].strip("[]")
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return False


def _reads_storage(args: argparse.Namespace) -> bool:
    from spotline.locate import is_uri

    return args.cmd != "stacks" and bool(args.job) and is_uri(args.job)


def _ray_token_exists() -> bool:
    """Whether Ray would find a token: RAY_AUTH_TOKEN, or the file at RAY_AUTH_TOKEN_PATH
    or ~/.ray/auth_token."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return True
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or str(Path.home() / ".ray" / "auth_token")
    return Path(path).expanduser().is_file()


@contextlib.contextmanager
def _json_on_stdout(args: argparse.Namespace):
    """With `--json -`, stdout carries the JSON alone: everything else the command
    prints goes to stderr while it runs."""
    if getattr(args, "json", None) != "-":
        yield
        return
    args.json_stdout = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):
        yield


def _shown(args: argparse.Namespace) -> bool:
    """Whether the command prints its usual output: not when `--json -` replaces it."""
    return getattr(args, "json", None) != "-"


def _write_json(args: argparse.Namespace, payload, default=str) -> None:
    """The command's result as JSON to `--json PATH` ('-': stdout), if given."""
    path = getattr(args, "json", None)
    if not path:
        return
    text = json.dumps(payload, indent=2, default=default)
    if path == "-":
        print(text, file=getattr(args, "json_stdout", None) or sys.stdout, flush=True)
    else:
        Path(path).write_text(text + "\n")


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
    for row in rows if _shown(args) else ():
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
    _write_json(args, rows)
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
    for line in stacks_lines(record) if _shown(args) else ():
        print(line)
    _write_json(args, record, default=_text)
    return 0


def _status(args) -> int:
    if args.watch and args.json == "-":
        raise SpecError(
            "status: --watch refreshes the table that --json - replaces; drop --watch, or "
            "give --json a file to write the last summary to"
        )
    fetch = summary_source(args.job, args.address)
    last: list[dict] = []

    def fetched() -> dict:
        last[:] = [fetch()]
        return last[0]

    if _shown(args):
        from spotline.report import print_status

        print_status(fetched, watch=args.watch)
    else:
        fetched()
    _write_json(args, last[0] if last else None)
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


def _cut_steps(trace: dict, steps: str) -> dict:
    """The trace cut to --steps A-B (or one step)."""
    from spotline.bubbles.trace import cut_steps

    first, _, last = steps.partition("-")
    try:
        a, b = int(first), int(last or first)
    except ValueError:
        raise SpecError(f"--steps {steps!r}: give A-B, e.g. 120-130, or one step") from None
    if a < 1 or b < a:
        raise SpecError(f"--steps {steps!r}: give A-B with 1 <= A <= B")
    try:
        return cut_steps(trace, a, b)
    except ValueError as e:
        raise SpecError(str(e)) from None


def _chaos(args) -> int:
    """Rehearse the job against the trace; exit 0 on PASS, 1 on FAIL."""
    from spotline.chaos.report import VERDICT, render_verdict
    from spotline.chaos.run import run_chaos

    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise SpecError(
            f"--out {out}: it already holds files (a report of an earlier rehearsal?); give "
            "another --out, or --overwrite to replace it"
        )
    job = _job_from_args(args)
    figures = run_chaos(
        job.spec,
        args.trace,
        out,
        duration_s=args.duration,
        nodes=args.nodes,
        scale_model=args.scale_model,
        min_goodput=args.min_goodput,
        tolerance=args.tolerance,
    )
    if _shown(args):
        print()
        print(render_verdict(figures))
    print(f"wrote {out}/ ({VERDICT}, timeline.png, events.log, chaos.json and the job's charts)")
    _write_json(args, {k: v for k, v in figures.items() if k not in _CHAOS_BULK})
    return 0 if figures["verdict"] == "PASS" else 1


# What chaos.json keeps for redrawing its report, and --json leaves out.
_CHAOS_BULK = ("samples", "log", "summary", "node_log", "losses", "reference_losses")


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
        _interrupts.for_job = True
        job = _job_from_args(args)
        run = job.start(address=args.address, signals=_interrupts)
        result = run.wait()  # events on stderr with --json -
        if _shown(args):
            print(result.summary())
        _write_json(args, result.__dict__)
        if result.state == "stopped":  # on this driver's SIGTERM or Ctrl-C
            print(f"spotline: {_one_line(_interrupts.stopped(result))}", file=sys.stderr)
            return _interrupts.code
        return 0
    if args.cmd == "validate":
        job = _job_from_args(args)
        from spotline.preflight import check_offline, preflight

        unchecked: list[str] = []
        if args.offline:
            check_offline(job.spec, unchecked=unchecked, read_tokenizer=False)
        else:
            preflight(job.spec)
        if _shown(args):
            print(f"{job.spec.name}: OK (spec hash {job.spec.spec_hash()})")
        from spotline.planning.plan import make_plan

        warnings = make_plan(job.spec).warnings  # the checks `spotline plan` makes
        for note in unchecked:
            print(f"spotline: unchecked: {note}", file=sys.stderr)
        for warning in warnings:
            print(f"spotline: warning: {warning}", file=sys.stderr)
        spec_hash = job.spec.spec_hash()
        doc = {"name": job.spec.name, "spec_hash": spec_hash, "warnings": warnings}
        _write_json(args, doc | {"unchecked": unchecked})
        return 0
    if args.cmd == "plan":
        job = _job_from_args(args)
        plan = job.plan(
            peak_tflops=args.peak_tflops,
            device_memory_gb=args.device_memory_gb,
            offline=args.offline,
            storage_gbps_per_node=args.storage_gbps_per_node,
            network_gbps_per_node=args.network_gbps_per_node,
        )
        if _shown(args):
            print(plan.render())
        _write_json(args, plan.to_dict())
        return 0
    if args.cmd == "submit":
        handle = _job_from_args(args).submit(args.address, args.working_dir)
        if _shown(args):
            sid = handle.submission_id
            print(f"submitted {sid}; follow with: ray job logs -f {sid}")
        _write_json(args, {"submission_id": handle.submission_id, "address": args.address})
        return 0
    if args.cmd == "status":
        return _status(args)
    if args.cmd == "report":
        from spotline.chaos.report import is_chaos_report, redraw
        from spotline.report import write_report

        if is_chaos_report(args.job):  # a `spotline chaos` report directory
            for path in redraw(Path(args.job)):
                print(f"wrote {path}")
            return 0
        summary = summary_source(args.job, args.address)()
        trace = read_trace(args.job, args.address, required=False)
        for path in write_report(summary, trace, Path(args.out)):
            print(f"wrote {path}")
        return 0
    if args.cmd == "trace":
        trace = read_trace(args.job, args.address, required=True)
        if args.steps:
            trace = _cut_steps(trace, args.steps)
        with open(args.out, "w") as f:
            json.dump(trace, f)
        print(f"wrote {args.out}: open it at https://ui.perfetto.dev or chrome://tracing")
        return 0
    if args.cmd == "chaos":
        return _chaos(args)
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
