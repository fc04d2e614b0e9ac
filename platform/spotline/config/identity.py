"""A job spec's identity and the rules of resuming it: which fields make up the spec
hash, which of them a resumed job may change, and whether (and why not) a job may
resume or write over checkpoints another spec wrote.

`SpecIdentity` is mixed into `JobSpec`. The module functions compare a spec with
what a manifest, a receipt or a job summary recorded of theirs; the checkpoint
store and the commit coordinator read those records and call them, so the rules
live here, with the spec, and not in storage. Pure: nothing here reads or writes.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

from spotline.config.redact import split_secrets
from spotline.config.sections import DataSpec, ElasticSpec, TrainSpec

RETUNABLE_FIELDS = frozenset(
    {
        "train.lr",
        "train.min_lr_ratio",
        "train.warmup_steps",
        "train.weight_decay",
        "train.grad_clip",
    }
)
"""Optimizer hyperparameters a resumed job may change (Population Based Training mutates
them). Each is applied from the spec, never from the checkpoint: the peak lr and the
schedule's shape, AdamW's weight decay and the gradient clip. The model, tokenizer, data,
batch and seed must stay the same."""


class SpecIdentity:
    """The spec hash and the resume rules of a `JobSpec` (mixed into it)."""

    if TYPE_CHECKING:  # what it reads, declared by JobSpec
        name: str
        data: DataSpec
        elastic: ElasticSpec
        train: TrainSpec

        def model_dump(self, **kwargs: Any) -> dict[str, Any]: ...

    def hashed_fields(self) -> dict[str, Any]:
        """Everything that changes the training math (not where it runs, logs, or which
        credentials read its data), flattened to dotted keys."""
        return flatten_dotted(self._hashed_tree())

    def recorded_fields(self) -> dict[str, Any]:
        """`hashed_fields` with every secret masked (a custom model's `config` may hold
        an API token): what manifests record, so a refused resume can say which fields
        differ, and what they are compared with."""
        return flatten_dotted(split_secrets(self._hashed_tree())[0])

    def _hashed_tree(self) -> dict[str, Any]:
        data_where = {"endpoint_url", "storage_options", "cache_dir", "prefetch", "uri"}
        fields = self.model_dump(
            mode="json",
            include={
                "model": True,
                "tokenizer": {"kind", "sha256"},  # what it is, not where it lies
                "data": True,
                "train": True,
                "parallel": {"precision"},
            },
            exclude={
                "train": {"log_every", "steps", "batch_schedule", "adaptive"},
                "data": data_where,
            },
        )
        if self.train.batch_schedule == "adaptive":  # fixed jobs keep their old hash
            fields["train"]["batch_schedule"] = "adaptive"
            fields["train"]["adaptive"] = self.train.adaptive.model_dump(mode="json")
        # A dataset is its index (contents, tokenizer); where it lies may change.
        fields["data"]["sources"] = [
            {"weight": s.weight, "index_sha256": s.index_sha256} for s in self.data.token_sources()
        ]
        fields["elastic"] = {"batch_policy": self.elastic.batch_policy}
        if self.elastic.batch_policy == "scaled":  # the reference size of batch and lr
            fields["elastic"]["max_replicas"] = self.elastic.max_replicas
        return fields

    def retuned_fields(self, their_hash: str | None, theirs: Any) -> list[str] | None:
        """How this spec differs from the one a checkpoint was written with (`theirs`: the
        manifest's recorded `hashed_fields`): [] when the hashes match, "field: old ->
        new" for each changed field when only `RETUNABLE_FIELDS` changed, None when the
        checkpoint must not be resumed by this spec."""
        if their_hash == self.spec_hash():
            return []
        if not isinstance(theirs, dict):
            return None
        changed = self.changed_fields(theirs)
        if not changed or any(k not in RETUNABLE_FIELDS for k in changed):
            return None
        ours = self.recorded_fields()
        return [f"{k}: {theirs.get(k)!r} -> {ours.get(k)!r}" for k in changed]

    def changed_fields(self, theirs: dict[str, Any]) -> list[str]:
        """The `recorded_fields` keys whose value differs from `theirs` (a manifest's
        record of the spec it was written with), sorted."""
        ours = self.recorded_fields()
        return [k for k in sorted(set(theirs) | set(ours)) if theirs.get(k) != ours.get(k)]

    def spec_hash(self) -> str:
        """Hash of `hashed_fields`. A checkpoint is only resumed by a job with the same
        hash, so a resumed run cannot silently train a different model."""
        blob = json.dumps(self.hashed_fields(), sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def flatten_dotted(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}: the spec hash's fields, and a tracker's params."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten_dotted(v, key + "."))
        else:
            out[key] = v
    return out


def foreign_job(spec: SpecIdentity, job: str | None) -> bool:
    """True when `job` (the name a manifest, receipt or job summary records) is another
    job's than `spec`'s; an unrecorded name is not."""
    return job is not None and job != spec.name


def resumable_by(spec: SpecIdentity, job: str | None, their_hash: str | None, theirs: Any) -> bool:
    """True when `spec` may resume, and write over, a checkpoint that `job` wrote with
    spec hash `their_hash` (`theirs`: its recorded fields): the same job, differing at
    most in `RETUNABLE_FIELDS`."""
    return job == spec.name and spec.retuned_fields(their_hash, theirs) is not None


def written_by_this(
    spec: SpecIdentity, job: str | None, their_hash: str | None, theirs: Any
) -> bool:
    """True when what `job` wrote with `their_hash` is exactly `spec`'s: the same job
    and the same spec hash. Receipts commit only then (a retuned field refuses them)."""
    return job == spec.name and their_hash == spec.spec_hash()


def mismatch_reason(
    spec: SpecIdentity, job: str | None, their_hash: str | None, theirs: Any
) -> str:
    """Why what `job` wrote with `their_hash` (`theirs`: its recorded fields) is not
    `spec`'s: another job's, or another spec's, with the fields that differ."""
    if foreign_job(spec, job):
        why = f"belongs to job {job!r}, and this job is {spec.name!r}"
    else:
        why = f"was written with spec hash {their_hash}, and this job has {spec.spec_hash()}"
    return why + spec_differences(spec, theirs)


def spec_differences(spec: SpecIdentity, theirs: Any) -> str:
    """' (field: theirs there, ours here; ...)' for each hashed field in which `spec`
    differs from `theirs` (the `hashed_fields` a manifest or receipt recorded), or ''."""
    if not isinstance(theirs, dict):
        return ""
    ours = spec.recorded_fields()
    diff = [
        f"{k}: {theirs.get(k, '(unset)')!r} there, {ours.get(k, '(unset)')!r} here"
        for k in spec.changed_fields(theirs)
    ]
    if not diff:
        return ""
    return " (" + "; ".join(diff[:6]) + ("; ..." if len(diff) > 6 else "") + ")"
