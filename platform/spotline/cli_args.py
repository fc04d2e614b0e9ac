"""The `spotline` command line's commands, options and help: what `spotline --help`,
`spotline COMMAND --help` and the manual's command-line reference print.

Every command has a one-line description; every option says what it does and its
default. `--json PATH` means the same on every command that has it: write the
command's result as JSON to PATH; `-` writes it to stdout in place of the usual
output, with progress and messages on stderr.

    python -m spotline.cli_args > docs/reference/cli.md

Builds parsers only: nothing here runs a command, touches Ray or reads a file.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import textwrap

COMMAND = "python -m spotline.cli_args > docs/reference/cli.md"

DESCRIPTION = (
    "Elastic LLM training on preemptible GPUs: DeepSpeed on Ray, with just-in-time "
    "checkpoints to object storage."
)

EPILOG = """\
Every command ends in one line on stderr when it fails, and a non-zero exit: 2 for bad
input (spec, URI, file, arguments), 1 for a job that failed, 130 for Ctrl-C, 143 for
SIGTERM; `spotline run` first stops its job at the next step boundary with a commit.
--debug (or SPOTLINE_DEBUG=1) shows the Python traceback.

--json PATH, on every command that has it, writes the command's result as JSON to PATH;
--json - writes it to stdout instead of the usual output (messages go to stderr).

A job is named by its name (a running job on this machine's Ray clusters, or an ended
one, read from where it last ran) or by its checkpoint URI (file://, s3://, a path).
The manual: docs/ (mkdocs serve); the spec: docs/reference/spec.md.
"""

_JSON_HELP = "write {what} as JSON to PATH ('-': to stdout, in place of {instead})"


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Help with each option's default, where it has one the help does not already say."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or default in (None, False, [], argparse.SUPPRESS)
            or not action.option_strings
        ):
            return text
        return f"{text} (default: %(default)s)"


def _add(sub, name: str, about: str, more: str = "") -> argparse.ArgumentParser:
    """A command with its one line in `spotline --help` and the same line (and `more`)
    at the top of its own --help page."""
    first = f"{about[0].upper()}{about[1:]}."
    return sub.add_parser(
        name,
        help=about,
        description="\n\n".join(textwrap.fill(t, 80) for t in (first, more) if t),
        formatter_class=_Formatter,
    )


def _json(p: argparse.ArgumentParser, what: str, instead: str) -> None:
    p.add_argument(
        "--json", metavar="PATH", default=None, help=_JSON_HELP.format(what=what, instead=instead)
    )


def _spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="YAML job spec, e.g. configs/quickstart.yaml")
    p.add_argument(
        "--config", dest="config_opt", metavar="CONFIG", help="the same as the positional CONFIG"
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field of the spec, e.g. --set train.steps=50 (repeatable)",
    )
    p.add_argument("--spec-b64", help=argparse.SUPPRESS)
    p.add_argument("--secrets-module", help=argparse.SUPPRESS)


def _job_arg(p: argparse.ArgumentParser, optional: bool = False, running: bool = False) -> None:
    if running:
        about = "a running job's name (default: the one job running on this machine's clusters)"
    else:
        about = (
            "a job's name (running, or ended: read from where it last ran) or its checkpoint URI"
        )
        if optional:
            about += " (default: the one job running on this machine's clusters)"
    p.add_argument("job", nargs="?" if optional else None, help=about)


def _address(p: argparse.ArgumentParser, for_what: str) -> None:
    p.add_argument(
        "--address",
        default="auto",
        help=f"the Ray cluster {for_what} (default: RAY_ADDRESS, else every Ray cluster "
        "on this machine)",
    )


def _storage(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--endpoint-url",
        default=None,
        help="endpoint of an S3-compatible service for s3:// URIs (MinIO, a test server)",
    )


def _overwrite(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--overwrite", action="store_true", help=f"replace {what}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spotline",
        description=textwrap.fill(DESCRIPTION, 80),
        epilog=EPILOG,
        formatter_class=_Formatter,
    )
    parser.add_argument(
        "--debug", action="store_true", help="show Python tracebacks (also SPOTLINE_DEBUG=1)"
    )
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    run = _add(
        sub,
        "run",
        "run a job to completion in this driver",
        "Runs the preflight, starts the job on a Ray cluster and prints its events and, at "
        "the end, its summary. Running it again resumes from the latest committed "
        "checkpoint. Ctrl-C or SIGTERM stops the job at its next step boundary with a "
        "commit; a second one ends it at once.",
    )
    _spec_args(run)
    run.add_argument(
        "--address",
        default=None,
        help="the Ray cluster to run on (default: RAY_ADDRESS, else a new local cluster "
        "on 127.0.0.1 that ends with the command)",
    )
    _json(run, "the job's result", "the summary")

    val = _add(
        sub,
        "validate",
        "check a spec, its storage and its data without running anything",
        "Prints the spec hash and the plan's warnings (a just-in-time checkpoint that "
        "cannot meet a notice, a large bubble).",
    )
    _spec_args(val)
    val.add_argument(
        "--offline",
        action="store_true",
        help="check the spec alone: read no storage, data or tokenizer (the vocabulary from "
        "model.vocab_size or the preset) and need no credentials; says what is unchecked",
    )
    _json(val, "the name, spec hash and warnings", "the OK line")

    plan = _add(
        sub,
        "plan",
        "predict memory, bubble, step time, checkpoint and cost before launch",
        "Starts nothing on a cluster. A stage that cannot fit its device is refused, "
        "naming the field to change.",
    )
    _spec_args(plan)
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
        help="memory of one device (default: resources.device_memory_gb, else this machine's)",
    )
    plan.add_argument(
        "--offline",
        action="store_true",
        help="read nothing (the tokenizer's vocabulary from model.vocab_size or the "
        "preset); without it, a tokenizer that cannot be read is assumed the same way",
    )
    plan.add_argument(
        "--storage-gbps-per-node",
        type=float,
        default=None,
        help="one node's bandwidth to the checkpoint storage, in Gbit/s, for the "
        "just-in-time save and the restore (default: each rank at "
        "SPOTLINE_ASSUMED_SAVE_MB_PER_S)",
    )
    plan.add_argument(
        "--network-gbps-per-node",
        type=float,
        default=None,
        help="one node's bandwidth to another, in Gbit/s, for a restore from peer memory "
        "(default 100)",
    )
    _json(plan, "the plan", "the table")

    submit = _add(
        sub,
        "submit",
        "submit a job to a running cluster through Ray's job submission API",
        "The spec travels in the entrypoint with its secrets masked; secrets travel in a "
        "one-use package that the job deletes. Follow it with `ray job logs -f ID`.",
    )
    _spec_args(submit)
    submit.add_argument(
        "--address", required=True, help="the cluster's dashboard, e.g. http://127.0.0.1:8265"
    )
    submit.add_argument(
        "--working-dir",
        default=".",
        help="the directory uploaded with the job, unless the spec sets runtime_env.working_dir",
    )
    _json(submit, "the submission id", "the follow-up line")

    status = _add(
        sub,
        "status",
        "show a job's state, speed, bubbles, checkpoints and goodput as a table",
        "A running job is read from its controller; an ended one from what it stored beside "
        "its checkpoints, found from the last place it ran on this machine (or give its "
        "checkpoint URI).",
    )
    _job_arg(status, optional=True)
    _address(status, "to look for a running job on")
    status.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=2.0,
        metavar="SECONDS",
        help="refresh the table every SECONDS (2 if not given) until the job ends",
    )
    _json(status, "the job's summary (the last one read, with --watch)", "the table")

    report = _add(
        sub,
        "report",
        "write PNG plots of a job: loss, step time, bubbles, goodput",
        "Also stacks.txt when the job hung. Given a `spotline chaos` report directory, "
        "draws its timeline and charts again.",
    )
    _job_arg(report)
    report.add_argument(
        "--out",
        default="spotline-report",
        help="the directory for the PNGs (default: ./spotline-report/)",
    )
    _address(report, "to look for a running job on")

    trace = _add(
        sub,
        "trace",
        "write a job's pipeline timeline as Chrome-trace JSON for Perfetto",
        "Open it at https://ui.perfetto.dev: one track per stage and replica, with the "
        "backfill units beside them, over the last recorded steps (or those of --steps). "
        "Pipelined jobs only.",
    )
    _job_arg(trace)
    trace.add_argument(
        "--out",
        default="spotline-trace.json",
        help="where to write the trace (default: ./spotline-trace.json)",
    )
    trace.add_argument(
        "--steps",
        default=None,
        metavar="A-B",
        help="only steps A to B, e.g. 120-130 (or one step: 125) (default: every step the job recorded: "
        "the last 32 of each rank)",
    )
    _address(trace, "to look for a running job on")

    chaos = _add(
        sub,
        "chaos",
        "rehearse a job against a spot trace on this machine, and judge how it survives",
        "Runs the job on a local cluster of simulated spot nodes (127.0.0.1, CPU compute) "
        "while a trace gives notices, losses and joins; then runs it uninterrupted from "
        "the same seed to the same step, and reports exact resume, lost work, notice -> "
        "commit, loss -> training again, goodput and what the job's settings cost, with a "
        "PASS/FAIL verdict (exit 0/1). Writes a report directory. Traces: gentle, stormy, "
        "aws-2min, gcp-30s, azure-30s, or a JSON trace file (docs/guide/chaos.md).",
    )
    _spec_args(chaos)
    chaos.add_argument(
        "--trace",
        default="gentle",
        help="a built-in trace (gentle, stormy, aws-2min, gcp-30s, azure-30s) or a JSON "
        "trace file (default: gentle)",
    )
    chaos.add_argument(
        "--duration",
        type=float,
        default=None,
        metavar="SECONDS",
        help="seconds the trace lasts from the job's first step (default: the trace's own: "
        "gentle 60, stormy 120, aws-2min 420, gcp-30s and azure-30s 150)",
    )
    chaos.add_argument(
        "--nodes",
        type=int,
        default=None,
        metavar="N",
        help="simulated spot nodes at the start, one replica each (default: the trace "
        "file's nodes, else elastic.max_replicas)",
    )
    chaos.add_argument(
        "--scale-model",
        action="store_true",
        help="shrink a gpt or llama model (and an outsized batch) to what trains on a few "
        "cores; the run says what it changed",
    )
    chaos.add_argument(
        "--min-goodput",
        type=float,
        default=None,
        metavar="FRACTION",
        help="also fail below this goodput, e.g. 0.8 (default: goodput is reported, not judged)",
    )
    chaos.add_argument(
        "--tolerance",
        type=float,
        default=1e-4,
        help="relative difference under which two losses count as equal",
    )
    chaos.add_argument(
        "--out",
        default="spotline-chaos",
        help="the report directory (default: ./spotline-chaos/)",
    )
    _overwrite(chaos, "a report already in --out")
    _json(chaos, "the verdict and every figure", "the verdict")

    stacks = _add(
        sub,
        "stacks",
        "print where every rank of a running job is now (py-spy, from each node)",
        "A frozen rank answers no call of its own, so a task on each rank's node reads it.",
    )
    _job_arg(stacks, optional=True, running=True)
    _address(stacks, "the job runs on")
    _json(stacks, "every rank's threads", "the stacks")

    prep = _add(
        sub,
        "prepare",
        "tokenize text, JSONL or Parquet into a sharded token dataset",
        "On every core, with a progress bar; an interrupted run resumes where it stopped. "
        "Train on the result with data: {kind: tokens, uri: OUT}.",
    )
    prep.add_argument("input", help="a file, directory, glob or fsspec URI of the raw data")
    prep.add_argument(
        "--tokenizer",
        required=True,
        help="'byte', or a tokenizer.json (or its directory or URI); never downloaded from a hub",
    )
    prep.add_argument("--out", required=True, help="where to write it (a path or fsspec URI)")
    prep.add_argument("--field", default="text", help="JSONL: the field holding the text")
    prep.add_argument(
        "--column", default=None, help="Parquet: the column holding the text (default: --field)"
    )
    prep.add_argument(
        "--workers", type=int, default=None, help="processes (default: this machine's cores)"
    )
    _overwrite(prep, "a dataset (or other files) already at --out")
    _storage(prep)

    tok = _add(sub, "tokenizer", "train a tokenizer (spotline tokenizer train)")
    tok_sub = tok.add_subparsers(dest="tok_cmd", required=True, metavar="COMMAND")
    train_tok = _add(
        tok_sub,
        "train",
        "train a byte-level BPE tokenizer with the `tokenizers` library",
        "Use the result with tokenizer: {kind: huggingface, path: OUT}.",
    )
    train_tok.add_argument(
        "input", nargs="+", help="text files or directories ('stdlib': Python's own sources)"
    )
    train_tok.add_argument("--vocab-size", type=int, default=8192, help="the vocabulary's size")
    train_tok.add_argument("--out", required=True, help="directory for tokenizer.json and co.")
    _overwrite(train_tok, "files already in --out")

    sweep = _add(
        sub,
        "sweep",
        "sweep job fields with Ray Tune (ASHA, PBT); every trial is a whole job",
    )
    sweep.add_argument("sweep_file", help="a sweep YAML (see configs/sweep.yaml)")
    sweep.add_argument(
        "--resume", action="store_true", help="continue the interrupted sweep of this file"
    )
    sweep.add_argument(
        "--address",
        default=None,
        help="the Ray cluster to run on (default: RAY_ADDRESS, else a new local cluster)",
    )
    _json(sweep, "every trial's row", "the trial lines")

    export = _add(
        sub,
        "export",
        "write a committed checkpoint as a Hugging Face model directory",
        "config.json, safetensors and the job's tokenizer files, after verifying every "
        "sha256. Load it with transformers.AutoModelForCausalLM.from_pretrained(OUT).",
    )
    export.add_argument("checkpoint", help="the job's checkpoint URI (its checkpoint.uri)")
    export.add_argument(
        "--format", choices=["hf"], default="hf", help="the layout to write: hf (Hugging Face)"
    )
    export.add_argument("--out", required=True, help="a directory or fsspec URI")
    export.add_argument(
        "--step", type=int, default=None, help="the committed step (default: the latest)"
    )
    export.add_argument(
        "--signing-key-env",
        default=None,
        help="the environment variable holding the key, as the job's checkpoint.signing_key_env",
    )
    _overwrite(export, "a model (or other files) already in --out")
    _storage(export)
    return parser


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Every command's parser by its full name ('run', 'tokenizer train', ...)."""
    found: dict[str, argparse.ArgumentParser] = {}

    def walk(p: argparse.ArgumentParser, prefix: str) -> None:
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    found[f"{prefix}{name}"] = child
                    walk(child, f"{prefix}{name} ")

    walk(parser, "")
    return found


def render_reference() -> str:
    """The manual's command-line reference: every --help page, at a fixed width."""
    with _columns(90):
        parser = build_parser()
        lines = [
            "# Command line",
            "",
            f"<!-- Generated from spotline.cli_args by `{COMMAND}`; do not edit by hand. -->",
            "",
            "What `spotline --help` and `spotline COMMAND --help` print.",
            "",
            "## spotline",
            "",
            "```text",
            parser.format_help().rstrip(),
            "```",
        ]
        for name, p in subcommands(parser).items():
            lines += ["", f"## spotline {name}", "", "```text", p.format_help().rstrip(), "```"]
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def _columns(width: int):
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(width)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = before


if __name__ == "__main__":
    sys.stdout.write(render_reference())
