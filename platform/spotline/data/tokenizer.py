"""Tokenizers: how text becomes token ids.

`byte` (every UTF-8 byte a token: 256 ids, nothing to read) and `huggingface` (a
tokenizer.json read with the `tokenizers` library, from a local path or any fsspec
URI; nothing is ever downloaded from a model hub). `train_bpe` trains a byte-level
BPE tokenizer with the library's own trainer and writes a directory that both
Spotline and `transformers.AutoTokenizer.from_pretrained` load.

A tokenizer's identity is `sha256`: "byte" for the byte tokenizer, else the sha256
of its tokenizer.json bytes. Prepared datasets record it, and a job refuses a
dataset prepared with another tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from spotline.config.model import TokenizerSpec
from spotline.config.redact import redact
from spotline.data.errors import DataError, storage_kwargs
from spotline.registry import TOKENIZERS
from spotline.storage.fs import explain_read_error, is_remote, local_path

if TYPE_CHECKING:
    from spotline.config.schema import JobSpec

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
TOKENIZER_FILES = (TOKENIZER_JSON, TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP)
"""What a Hugging Face tokenizer directory holds (only tokenizer.json is required)."""

EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst")
NO_LIMIT = int(1e30)  # transformers' "no maximum length" (VERY_LARGE_INTEGER)


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int
    """Ids are in [0, vocab_size)."""
    eos_id: int | None
    """The end-of-text token `spotline prepare` puts after each document (None: the
    byte tokenizer, whose documents end with b"\\n" instead)."""
    bos_id: int | None
    sha256: str
    """Identity: "byte", or the sha256 hex of the tokenizer.json bytes."""

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """Every UTF-8 byte is a token. Text round-trips, including bytes that are not
    UTF-8 when they were decoded with errors="surrogateescape"."""

    vocab_size = 256
    eos_id = None
    bos_id = None
    sha256 = "byte"
    newline_id = 10  # what ends a document in a byte-level corpus

    @classmethod
    def from_spec(cls, spec: TokenizerSpec, **_: Any) -> ByteTokenizer:
        return cls()

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8", errors="surrogateescape"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class HuggingFaceTokenizer:
    """A tokenizer.json read with the `tokenizers` library. End/begin-of-text tokens come
    from tokenizer_config.json (or special_tokens_map.json) beside it, else from the
    well-known names (<|endoftext|>, </s>, <eos>, <|end_of_text|>)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        source: str | None = None,
        field: str = "tokenizer.path",
    ):
        """`path`: a local tokenizer.json or the directory holding it; `source`: where it
        came from, for messages (a URI it was copied from); `field`: the spec field or
        argument that named it, for messages."""
        p = Path(path)
        where = source or str(p)
        if p.is_dir():
            p = p / TOKENIZER_JSON
        try:
            raw = p.read_bytes()
        except FileNotFoundError:
            raise DataError(
                f"{field}: {where} does not exist (or has no {TOKENIZER_JSON}); give a "
                f"directory holding {TOKENIZER_JSON}, the file, or its URI (`spotline "
                "tokenizer train` makes one)"
            ) from None
        except OSError as e:
            raise DataError(f"{field}: cannot read {where}: {e.strerror or e}") from None
        tok = _parse_tokenizer_json(raw, where, field)
        self.path = p
        self.source = where
        self.sha256 = hashlib.sha256(raw).hexdigest()
        self._tok = tok
        vocab = tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(tok.get_vocab_size(with_added_tokens=True), max(vocab.values()) + 1)
        config = _read_side_config(p.parent, where, field)
        self.eos_id = self._special(config.get("eos_token"), EOS_CANDIDATES)
        self.bos_id = self._special(config.get("bos_token"), BOS_CANDIDATES)
        self._fast = hasattr(tok, "encode_batch_fast")

    def _special(self, named: Any, candidates: tuple[str, ...]) -> int | None:
        text = _token_text(named)
        if text is not None:
            found = self._tok.token_to_id(text)
            if found is not None:
                return found
        for c in candidates:
            found = self._tok.token_to_id(c)
            if found is not None:
                return found
        return None

    @property
    def backend(self):
        """The `tokenizers.Tokenizer` itself."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        enc = self._tok.encode_batch_fast if self._fast else self._tok.encode_batch
        return [e.ids for e in enc(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HuggingFaceTokenizer({self.source!r}, vocab_size={self.vocab_size})"


def _import_tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise DataError(
            "tokenizer.kind 'huggingface' needs the `tokenizers` package, which is not "
            "installed; run: pip install tokenizers"
        ) from None
    return tokenizers


def _parse_tokenizer_json(raw: bytes, where: str, field: str):
    tokenizers = _import_tokenizers()
    try:
        return tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as e:  # noqa: BLE001 - the library's parse errors have no common type
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(
            f"{field}: not a tokenizer.json: {where} ({first[:200]}); point it at a "
            "Hugging Face tokenizer.json or the directory holding one"
        ) from None


def _read_side_config(folder: Path, where: str, field: str) -> dict:
    """tokenizer_config.json's keys over special_tokens_map.json's ({} if neither)."""
    out: dict = {}
    for name in (SPECIAL_TOKENS_MAP, TOKENIZER_CONFIG):
        f = folder / name
        if not f.is_file():
            continue
        try:
            data = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise DataError(
                f"{field}: {name} beside {where} is not readable JSON ({e}); fix or remove it"
            ) from None
        if isinstance(data, dict):
            out.update(data)
    return out


# --- loading -----------------------------------------------------------------------


def _fetch_remote(uri: str, opts: dict, cache_dir: str, field: str) -> Path:
    """Copy the tokenizer files at `uri` (a directory or its tokenizer.json) into
    cache_dir/tokenizers/<hash of uri>/ (temp names, then renamed); the local copy."""
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(uri, **opts)
        if fs.isdir(root):
            folder, main = root.rstrip("/"), root.rstrip("/") + "/" + TOKENIZER_JSON
        else:
            folder, main = root.rsplit("/", 1)[0] if "/" in root else "", root
        data = {TOKENIZER_JSON: fs.cat_file(main)}
        for name in (TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP):
            other = f"{folder}/{name}" if folder else name
            if fs.isfile(other):
                data[name] = fs.cat_file(other)
    except FileNotFoundError:
        raise DataError(
            f"{field}: {uri} does not exist (or has no {TOKENIZER_JSON}); check the URI"
        ) from None
    except Exception as e:  # noqa: BLE001 - any backend error means unreadable
        raise DataError(f"{field}: {redact(explain_read_error(uri, e))}") from None
    local = Path(cache_dir) / "tokenizers" / hashlib.sha256(uri.encode()).hexdigest()[:16]
    local.mkdir(parents=True, exist_ok=True)
    for name, blob in data.items():
        fd, tmp = tempfile.mkstemp(dir=local, prefix=f".{name}.")
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, local / name)
    for name in (TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP):  # a copy of an older version's
        if name not in data:
            (local / name).unlink(missing_ok=True)
    return local / TOKENIZER_JSON


def load_tokenizer(
    spec: TokenizerSpec,
    *,
    endpoint_url: str | None = None,
    storage_options: dict | None = None,
    cache_dir: str,
    field: str = "tokenizer.path",
) -> Tokenizer:
    """The tokenizer `spec` describes. tokenizer.path may be a directory holding
    tokenizer.json, the file itself, or an fsspec URI of either (copied into
    `cache_dir` first, read with `endpoint_url` and `storage_options`). A set
    tokenizer.sha256 must match. DataError naming `field` (where the path came from)
    otherwise."""
    if spec.kind == "byte":
        tok: Tokenizer = ByteTokenizer()
    elif spec.kind == "huggingface":
        path = str(spec.path)
        if is_remote(path):
            opts = storage_kwargs(path, endpoint_url=endpoint_url, storage_options=storage_options)
            local = _fetch_remote(path, opts, cache_dir, field)
            tok = HuggingFaceTokenizer(local, source=path, field=field)
        else:
            tok = HuggingFaceTokenizer(local_path(path), source=path, field=field)
    else:
        tok = _custom(spec, endpoint_url, storage_options, cache_dir)
    if spec.sha256 is not None and spec.kind != "byte" and tok.sha256 != spec.sha256:
        raise DataError(
            f"tokenizer.sha256 is {spec.sha256[:12]}... but {spec.path or spec.kind} hashes "
            f"to {tok.sha256[:12]}...: it is another tokenizer; point tokenizer.path at the "
            "right one, or drop tokenizer.sha256"
        )
    return tok


def _custom(spec, endpoint_url, storage_options, cache_dir) -> Tokenizer:
    """A 'package.module:attr' tokenizer: a class or callable with `from_spec(spec, **kw)`,
    or called as `obj(spec)`."""
    try:
        obj = TOKENIZERS.load(spec.kind, "tokenizer.kind")
    except ValueError as e:
        raise DataError(str(e)) from None
    make = getattr(obj, "from_spec", None)
    if make is not None:
        tok = make(
            spec, endpoint_url=endpoint_url, storage_options=storage_options, cache_dir=cache_dir
        )
    else:
        tok = obj(spec)
    missing = [a for a in ("vocab_size", "sha256", "encode", "encode_batch", "decode")
               if not hasattr(tok, a)]  # fmt: skip
    if missing:
        raise DataError(
            f"tokenizer.kind: {spec.kind!r} made {tok!r}, which has no {', '.join(missing)}; "
            "a tokenizer needs vocab_size, eos_id, bos_id, sha256, encode, encode_batch and "
            "decode (see spotline.data.tokenizer.Tokenizer)"
        )
    return tok


def job_tokenizer(spec: JobSpec) -> Tokenizer:
    """The job's tokenizer, read with data.endpoint_url / data.storage_options, remote
    files cached under data.cache_dir."""
    d = spec.data
    return load_tokenizer(
        spec.tokenizer,
        endpoint_url=d.endpoint_url,
        storage_options=d.storage_options,
        cache_dir=d.cache_dir,
    )


def load_tokenizer_at(
    path: str,
    *,
    endpoint_url: str | None = None,
    storage_options: dict | None = None,
    cache_dir: str | None = None,
) -> Tokenizer:
    """'byte', or a tokenizer.json / its directory / an fsspec URI of either (the CLI's
    --tokenizer)."""
    if path == "byte":
        return ByteTokenizer()
    spec = TokenizerSpec(kind="huggingface", path=path)
    cache = cache_dir or os.path.join(tempfile.gettempdir(), "spotline-data")
    return load_tokenizer(
        spec,
        endpoint_url=endpoint_url,
        storage_options=storage_options,
        cache_dir=cache,
        field="--tokenizer",
    )


def tokenizer_files(spec: JobSpec) -> dict[str, bytes]:
    """The job's tokenizer files by name (tokenizer.json and, when present,
    tokenizer_config.json and special_tokens_map.json); {} for the byte tokenizer or a
    custom kind without files."""
    tok = job_tokenizer(spec)
    path = getattr(tok, "path", None)
    if path is None:
        return {}
    folder = Path(path).parent
    out = {TOKENIZER_JSON: Path(path).read_bytes()}
    for name in (TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP):
        if (folder / name).is_file():
            out[name] = (folder / name).read_bytes()
    return out


# --- training ----------------------------------------------------------------------


def text_files(
    inputs: Sequence[str] | str, suffixes: tuple[str, ...] = TEXT_SUFFIXES
) -> list[Path]:
    """Local text files: each input a file, a directory (recursively, by suffix, sorted,
    skipping site-packages and __pycache__) or 'stdlib' (Python's own sources)."""
    from spotline.data.textfiles import local_files, stdlib_files

    items = [inputs] if isinstance(inputs, str) else list(inputs)
    out: list[Path] = []
    for item in items:
        if item == "stdlib":
            out.extend(stdlib_files(suffixes))
            continue
        root = local_path(item)
        if not root.exists():
            raise DataError(f"{item} does not exist; give text files, directories or 'stdlib'")
        out.extend(local_files(root, suffixes))
    if not out:
        raise DataError(f"no text files ({', '.join(suffixes)}) in {', '.join(map(str, items))}")
    return out


def _texts(files: list[Path], max_bytes: int | None) -> Iterator[str]:
    from spotline.data.textfiles import not_text, text_problem

    used = 0
    for f in files:
        raw = whole = f.read_bytes()
        if max_bytes is not None:
            raw = raw[: max_bytes - used]
        why = text_problem(raw, final=len(raw) == len(whole))
        if why is not None:
            raise DataError(not_text(str(f), why))
        used += len(raw)
        yield raw.decode("utf-8", errors="ignore")  # only a character cut at max_bytes
        if max_bytes is not None and used >= max_bytes:
            return


def train_bpe(
    inputs: list[str] | str,
    out_dir: str,
    *,
    vocab_size: int,
    min_frequency: int = 2,
    special_tokens: Sequence[str] = ("<|endoftext|>",),
    max_bytes: int | None = None,
    model_max_length: int = NO_LIMIT,
    overwrite: bool = False,
) -> Path:
    """Train a byte-level BPE tokenizer (the `tokenizers` library's BpeTrainer; byte-level
    pre-tokenizer and decoder, so any text round-trips) on `inputs` (files, directories,
    or 'stdlib'; at most `max_bytes` of them), and write `out_dir` with tokenizer.json,
    tokenizer_config.json and special_tokens_map.json. The first special token is the
    end-of-text (and begin-of-text) token. A non-empty `out_dir` is refused unless
    `overwrite`. Returns the tokenizer.json path."""
    import fsspec

    from spotline.storage import files_under, some_names

    found = files_under(fsspec.filesystem("file"), str(Path(out_dir).expanduser().resolve()))
    if found and not overwrite:
        there = "is a file" if found == [""] else f"is not empty (it holds {some_names(found)})"
        raise DataError(
            f"--out {out_dir} {there}; choose an empty or new directory, or pass --overwrite "
            f"to replace {TOKENIZER_JSON} and its config files there"
        )
    tokenizers = _import_tokenizers()
    from tokenizers import decoders, models, pre_tokenizers, trainers

    specials = list(special_tokens)
    if vocab_size < 256 + len(specials):
        raise DataError(
            f"vocab_size ({vocab_size}) must be at least {256 + len(specials)}: 256 byte "
            f"tokens and {len(specials)} special token(s)"
        )
    files = text_files(inputs)
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_texts(files, max_bytes), trainer=trainer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / TOKENIZER_JSON))
    eos = specials[0] if specials else None
    named = {"eos_token": eos, "bos_token": eos} if eos else {}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **named,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "add_prefix_space": False,
    }
    (out / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    (out / SPECIAL_TOKENS_MAP).write_text(json.dumps(named, indent=2) + "\n")
    return out / TOKENIZER_JSON
