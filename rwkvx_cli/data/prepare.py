"""`prepare`: text corpus -> tokenizer + train/val binidx + meta.json.

Inputs are read by `corpus.py` (.txt, .jsonl, .jsonl.gz/.zst, .parquet, directories and globs of those), streaming,
and tokenized in tasks of about `batch_bytes` of input (`encode.py`): in this process with one worker, else in worker
processes (`pool.py`), results written in task order, so the output does not depend on the number of workers. Every
document becomes its tokens followed by the tokenizer's end-of-document id (0 unless a loaded tokenizer.json sets
another). Long documents are cut only where their tokenizer's rule says the pieces encode as the whole (`cuts.py`).

Tokens go to a work directory `DIR/.prepare/` as they come (the token stream, the document sizes, a state file): memory
stays bounded whatever the corpus size. After each unit of input (a file, or a slice of a large JSONL; `shards.py`)
the state is synced, so `resume=True` continues after the last finished unit; the output is the same as a run never
interrupted. Validation holds out whole documents (chosen at random by `seed`, never more tokens than asked for) when
there are at least two; a single document is cut at the piece boundary after a line nearest to the asked-for size if
one is within SPLIT_TOLERANCE of it, else exactly at it (split "tokens"), the head for training and the tail for
validation (only the tail ends with the end-of-document id, since only it ends the document). `meta.json` is written
last: a directory with one is complete.

With `num_shards` K > 1, this prepares slice `shard_index` of K disjoint slices of the inputs (`shards.py`); a list of
the K prepared directories reads as the whole corpus (`prepared.open_prepared`).

A corpus with a JSONL file of conversations or prompt/response pairs (its first record's shape, whatever shard this
is) is rendered through a chat template (template.py), and every split gets its loss mask beside it (`masks.py`):
`.prepare/mask.u8` grows with the token stream, and the split copies it as it copies the tokens.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import numbers
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from glob import escape as glob_escape
from pathlib import Path

import numpy as np

from rwkvx_cli.config import MAX_SEED
from rwkvx_cli.data import corpus
from rwkvx_cli.data.binidx import _WRITE_CHUNK, binidx_paths, copy_range, dtype_for_vocab, replacing, write_index
from rwkvx_cli.data.cuts import rule_for
from rwkvx_cli.data.encode import (
    Encoder,
    EncoderSpec,
    LinesTask,
    Local,
    PiecesTask,
    RangeTask,
    ReadFailure,
    RowsTask,
    UnitEnd,
    count_line_starts,
    default_workers,
    unit_tasks,
)
from rwkvx_cli.data.errors import DataError
from rwkvx_cli.data.masks import count as count_loss
from rwkvx_cli.data.masks import mask_path, open_mask, replacing_mask
from rwkvx_cli.data.shards import UNIT_BYTES, Unit, corpus_id, plan_units
from rwkvx_cli.data.template import file_shape, load_template
from rwkvx_cli.data.tokenizer import NAMES, check_bpe_vocab_size, load_tokenizer, train_tokenizer
from rwkvx_cli.errors import UsageError
from rwkvx_cli.fsio import (
    DATA_MARKER,
    atomic_write_text,
    check_writable_dir,
    claim_dir,
    fsync_file,
    names_file,
    write_failure,
)

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no lock
    fcntl = None

META_FORMAT = "rwkvx-prepared"
META_VERSION = 1
STATE_FORMAT = "rwkvx-prepare-state"
WORK_DIR = ".prepare"
BATCH_BYTES = 1 << 22  # input handed to one task
SPLIT_TOLERANCE = 0.1  # a single document's line cut is taken within this share of the asked-for validation size
_IN_MEMORY_DOCS = 1 << 22  # more documents than this: the validation choice works on memory maps

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class PrepareProgress:
    """What `prepare` reports after each task: input bytes done of the total, documents and tokens so far."""

    bytes_done: int
    bytes_total: int
    documents: int
    tokens: int
    seconds: float  # since this run began tokenizing
    resumed_bytes: int = 0  # bytes a resumed run found done

    @property
    def mb_per_s(self) -> float:
        return (self.bytes_done - self.resumed_bytes) / 1e6 / max(self.seconds, 1e-9)

    @property
    def eta_seconds(self) -> float | None:
        rate = (self.bytes_done - self.resumed_bytes) / max(self.seconds, 1e-9)
        return (self.bytes_total - self.bytes_done) / rate if rate > 0 else None


@dataclass(frozen=True)
class PrepareStats:
    out_dir: Path
    tokenizer_kind: str  # "byte", "world", "bpe" (trained here) or "file" (loaded)
    vocab_size: int
    dtype: str
    documents: int
    bytes: int
    train_tokens: int
    val_tokens: int
    train_documents: int
    val_documents: int
    split: str  # "documents", "line" (one document cut after a line), "tokens" (cut at the asked-for size) or "none"
    tokenizer_seconds: float  # training or loading the tokenizer
    tokenize_seconds: float
    text_bytes: int = 0  # UTF-8 bytes of document text (`bytes` counts input files as on disk, compressed)
    skipped_records: int = 0  # bad records left out under skip_bad
    first_skipped: str | None = None  # the first one's "file:line: reason"
    eod_id: int = 0
    cut_rule: str = "line"  # the cut kinds safe for the tokenizer (cuts.py)
    forced_cuts: int = 0  # long documents cut where no safe point was (their ids may differ near the cut)
    workers: int = 1
    num_shards: int = 1
    shard_index: int = 0
    resumed_bytes: int = 0  # input bytes a resumed run found already tokenized
    resumed_text_bytes: int = 0
    template: str | None = None  # the chat template's name when the corpus holds conversations (masks written)
    train_loss_tokens: int | None = None  # tokens that carry loss (with masks)
    val_loss_tokens: int | None = None

    @property
    def mb_per_s(self) -> float:
        """Tokenization throughput in MB (1e6 bytes) of input files per second (of this run)."""
        return (self.bytes - self.resumed_bytes) / 1e6 / max(self.tokenize_seconds, 1e-9)

    @property
    def text_mb_per_s(self) -> float:
        """Tokenization throughput in MB of document text (UTF-8) per second (of this run)."""
        return (self.text_bytes - self.resumed_text_bytes) / 1e6 / max(self.tokenize_seconds, 1e-9)


def prepare(
    inputs: Sequence[str | os.PathLike],
    out_dir: Path,
    tokenizer_kind: str | os.PathLike = "byte",
    vocab_size: int | None = None,
    val_fraction: float | int = 0.05,
    seed: int = 0,
    progress: Progress | None = None,
    *,
    eod_id: int | None = None,
    text_field: str = "text",
    skip_bad: bool = False,
    workers: int | None = None,
    num_shards: int = 1,
    shard_index: int = 0,
    resume: bool = False,
    on_progress: Callable[[PrepareProgress], None] | None = None,
    batch_bytes: int = BATCH_BYTES,
    unit_bytes: int = UNIT_BYTES,
    template: str | os.PathLike | None = "g1",
) -> PrepareStats:
    """Tokenize `inputs` into `out_dir/{train,val}.{bin,idx}`, `out_dir/tokenizer.json` and `out_dir/meta.json`.

    `inputs` are files, directories or glob patterns (`corpus.expand_inputs`). `tokenizer_kind` is "byte", "world",
    "bpe" (trained on the inputs, `vocab_size` entries) or a tokenizer file's path (`eod_id`: its end-of-document
    id, default 0). `val_fraction` is a fraction of the tokens (float in [0, 1)) or a token count (int).
    `text_field` names the document text in JSONL records and parquet columns; a bad record stops with a DataError
    naming file and line, or with `skip_bad` is counted and left out. `progress(done, total)` is called with input
    bytes read so far, `on_progress(PrepareProgress)` with documents and tokens too.

    `workers` processes tokenize (default: the cores this process may use; 1: this process alone), in tasks of
    about `batch_bytes` of input, at most two per worker in flight. `num_shards` > 1 prepares slice `shard_index`
    only. `resume` continues a prepare of the same inputs and options that was interrupted, after its last
    finished unit (a file, or `unit_bytes` of a JSONL file). The files written are the same for any `workers`,
    `batch_bytes` or interruption. Bad data raises DataError, bad options UsageError.

    `template` (a name, `g1`, or a template file) renders JSONL conversations (`{"messages": [...]}`) and
    `{"prompt", "response"}` pairs; when any input file holds them, every split gets a loss mask (`masks.py`).
    None: no template (such records are bad records).
    """
    if not inputs:
        raise UsageError("prepare needs at least one input file")
    workers = default_workers() if workers is None else workers
    _check_options(workers, num_shards, shard_index, batch_bytes, unit_bytes, tokenizer_kind)
    _check_seed(seed)
    if tokenizer_kind == "bpe" and vocab_size is not None:
        check_bpe_vocab_size(vocab_size)  # before the corpus is read to train it
    inputs = corpus.expand_inputs(inputs)
    out_dir = check_writable_dir(out_dir, DATA_MARKER, _prepared_here, "data directory")
    sizes = [p.stat().st_size for p in inputs]
    _check_val_fraction(val_fraction)
    if not isinstance(text_field, str) or not text_field:
        raise UsageError(f"text_field must be a non-empty field name, got {text_field!r}")
    read_options = {"text_field": text_field, "skip_bad": skip_bad}
    tpl = load_template(template) if template is not None else None
    shapes = [file_shape(p, text_field) if tpl is not None else "text" for p in inputs]
    if tpl is None or all(shape == "text" for shape in shapes):
        tpl = None  # documents only: no masks, the files of a prepare without templates
    elif tokenizer_kind == "bpe":
        raise UsageError(
            "a BPE is trained on documents, not conversations: train it on text (prepare a text corpus with "
            "--tokenizer bpe) and pass its tokenizer.json"
        )
    units = plan_units(inputs, sizes, num_shards, shard_index, unit_bytes)
    if min(workers, math.ceil(sum(u.nbytes for u in units) / batch_bytes)) > 1:
        from rwkvx_cli.data.pool import start_forkserver

        start_forkserver()  # while the tokenizer loads

    work = out_dir / WORK_DIR
    job = {
        "inputs": [[str(p.resolve()), n, p.stat().st_mtime_ns] for p, n in zip(inputs, sizes, strict=True)],
        "tokenizer": _tokenizer_id(tokenizer_kind, vocab_size, eod_id),
        "text_field": text_field,
        "skip_bad": skip_bad,
        "num_shards": num_shards,
        "shard_index": shard_index,
        "unit_bytes": unit_bytes,
        "piece_chars": corpus.PIECE_CHARS,
        "max_chars": corpus._MAX_CARRY,
        "version": META_VERSION,
        "template": tpl.sha256 if tpl is not None else None,
    }

    # Nothing in out_dir changes until the tokenizer is made: a bad one leaves an earlier preparation intact.
    t0 = time.perf_counter()
    trained = work / "tokenizer.json"
    if resume and tokenizer_kind == "bpe" and _load_state(work, job) is not None:
        tok, kind, source = load_tokenizer(trained), "bpe", None  # the BPE trained before the interruption
    else:
        tok, kind, source = _make_tokenizer(tokenizer_kind, inputs, vocab_size, eod_id, read_options)
    tok.encode_arrays(["warm"])  # builds a lazy engine (World's vocab trie): load time, not tokenization
    rule = rule_for(tok)
    tokenizer_seconds = time.perf_counter() - t0
    dtype = dtype_for_vocab(tok.vocab_size)
    spec = EncoderSpec(
        kind=tok.kind,
        tokenizer_json=tok.to_json() if tok.kind == "bpe" else None,
        world_engine=getattr(tok, "engine", None),
        eod_id=tok.eod_id,
        dtype=dtype.name,
        text_field=text_field,
        skip_bad=skip_bad,
        rule=rule.name,
        piece_chars=corpus.PIECE_CHARS,
        max_chars=corpus._MAX_CARRY,
        world_table=tuple(tok.table) if tok.kind == "world" else None,
        template=tpl.to_json() if tpl is not None else None,
    )

    made = not out_dir.exists()  # a directory this call makes is removed again if bad input stops it
    try:
        claim_dir(out_dir, DATA_MARKER)
    except OSError as e:
        raise write_failure(e, out_dir, f"nothing of this preparation is in {out_dir}") or e from None
    with _hold(out_dir):
        state = _load_state(work, job) if resume else None  # a refusal here keeps the partial preparation
        if state is not None and (state["dtype"] != dtype.name or state["rule"] != rule.name):
            raise UsageError(f"cannot resume {out_dir}: its tokenizer now gives other tokens; run without resume")
        try:
            (out_dir / "meta.json").unlink(missing_ok=True)  # an older one must not vouch for a half-rewritten dir
            remove_stale_temps(out_dir)
            if state is None:
                shutil.rmtree(work, ignore_errors=True)
                work.mkdir()
                if kind == "bpe":
                    tok.save(trained)  # a resumed run must encode with this one, not train another
                state = _new_state(job, len(inputs), dtype.name, rule.name)
                _save_state(work, state)

            t0 = time.perf_counter()
            tz = _Tokenizing(work, state, dtype, tok, inputs, units, progress, on_progress, shapes, tpl is not None)
            n_workers = min(workers, max(1, math.ceil(tz.bytes_left / batch_bytes)))
            tz.run(spec, n_workers, batch_bytes)
            tokenize_seconds = time.perf_counter() - t0

            masked = tpl is not None
            split_result = _split(work, out_dir, state, dtype, val_fraction, seed, num_shards > 1, inputs, masked)
            if not masked:  # an earlier preparation's masks do not belong to these tokens
                for split in ("train", "val"):
                    mask_path(out_dir / split).unlink(missing_ok=True)
            tok.save(out_dir / "tokenizer.json")
            stats = _finish(
                out_dir, inputs, sizes, units, state, tok, kind, source, dtype, split_result, rule.name,
                tokenizer_seconds, tokenize_seconds, val_fraction, seed, text_field, n_workers,
                num_shards, shard_index, tz.resumed_bytes, tz.resumed_text_bytes, tpl,
            )
        except DataError:
            # Bad input: nothing worth resuming.
            shutil.rmtree(work, ignore_errors=True)
            if [p.name for p in out_dir.iterdir()] == [DATA_MARKER]:  # failed before writing anything
                (out_dir / DATA_MARKER).unlink()
                if made:
                    out_dir.rmdir()
            raise
        except OSError as e:  # a full disk: say where, and what a resume keeps
            kept = f"what was tokenized is kept in {work}: free space and run again with --resume"
            if not (work / "state.json").is_file():
                kept = "free space and run again"
            intact = f"{out_dir} holds no finished preparation (no meta.json); {kept}"
            raise write_failure(e, out_dir, intact) or e from None
    shutil.rmtree(work, ignore_errors=True)
    return stats


def _check_options(workers, num_shards, shard_index, batch_bytes, unit_bytes, tokenizer_kind) -> None:
    for name, value in (("workers", workers), ("num_shards", num_shards), ("batch_bytes", batch_bytes),
                        ("unit_bytes", unit_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"{name} must be a positive integer, got {value!r}")
    if isinstance(shard_index, bool) or not isinstance(shard_index, int) or not 0 <= shard_index < num_shards:
        raise UsageError(f"shard_index must be in 0..{num_shards - 1} (num_shards {num_shards}), got {shard_index!r}")
    if num_shards > 1 and tokenizer_kind == "bpe":
        raise UsageError(
            "each shard would train its own BPE: train it once (prepare a sample, or the whole corpus) and pass its "
            "tokenizer.json to every shard"
        )


@contextlib.contextmanager
def _hold(out_dir: Path) -> Iterator[None]:
    """One prepare at a time per directory: an advisory lock on its marker (released by the kernel if we die)."""
    if fcntl is None:  # pragma: no cover
        yield
        return
    fd = os.open(out_dir / DATA_MARKER, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise UsageError(f"{out_dir} is being prepared by another process; wait for it or stop it first") from None
        yield
    finally:
        os.close(fd)


def _tokenizer_id(kind, vocab_size, eod_id) -> dict:
    if isinstance(kind, str) and kind in (*NAMES, "bpe"):
        return {"kind": kind, "vocab_size": vocab_size, "eod_id": eod_id}
    path = Path(kind)
    digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
    return {"file": str(path.resolve()), "sha256": digest, "eod_id": eod_id}


# -- the work directory ----------------------------------------------------------------------------------------------


def _new_state(job: dict, n_inputs: int, dtype: str, rule: str) -> dict:
    return {
        "format": STATE_FORMAT,
        "job": job,
        "dtype": dtype,
        "rule": rule,
        "units_done": 0,
        "bytes_done": 0,
        "tokens": 0,
        "documents": 0,
        "cuts": 0,
        "open": 0,
        "text_bytes": 0,
        "skipped": 0,
        "first_skipped": None,
        "forced": 0,
        "source_docs": [0] * n_inputs,
    }


def _save_state(work: Path, state: dict) -> None:
    atomic_write_text(work / "state.json", json.dumps(state) + "\n")


def _load_state(work: Path, job: dict) -> dict | None:
    """The state of an interrupted prepare of the same job, or None (nothing to resume). A state of another job is
    an error: resuming it would mix two corpora."""
    try:
        state = json.loads((work / "state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        return None
    old = state.get("job", {})
    for key, value in job.items():
        if old.get(key) != value:
            what = {"inputs": "other inputs (or changed files)", "tokenizer": "another tokenizer",
                    "template": "another chat template (or none)"}.get(key, key)
            raise UsageError(
                f"cannot resume: {work.parent} holds a partial preparation with {what}; run without resume to start "
                "over"
            )
    return state


class _Tokenizing:
    """Tokenizes the remaining units into the work directory: tokens.bin (the stream), docs.i64 (document sizes),
    cuts.i64 (line cuts of the first document), state.json after each unit."""

    def __init__(self, work, state, dtype, tokenizer, inputs, units, progress, on_progress, shapes, masked=False):
        self.work, self.state, self.dtype, self.tokenizer = work, state, np.dtype(dtype), tokenizer
        self.shapes, self.masked = shapes, masked
        self.eod = np.array([tokenizer.eod_id], dtype=self.dtype.newbyteorder("<")).tobytes()
        self.inputs, self.units = inputs, units
        self.progress, self.on_progress = progress, on_progress
        self.total_bytes = sum(u.nbytes for u in units)
        self.resumed_bytes = state["bytes_done"]
        self.resumed_text_bytes = state["text_bytes"]
        self.bytes_left = self.total_bytes - self.resumed_bytes
        self._t0 = time.perf_counter()

    def run(self, spec: EncoderSpec, n_workers: int, batch_bytes: int) -> None:
        st = self.state
        files = {
            "tokens.bin": st["tokens"] * self.dtype.itemsize,
            "docs.i64": st["documents"] * 8,
            "cuts.i64": st["cuts"] * 8,
        }
        if self.masked:
            files["mask.u8"] = st["tokens"]  # a byte per token
        handles = {}
        syncer = None
        try:
            for name, size in files.items():
                f = open(self.work / name, "ab")
                f.truncate(size)  # a unit that was not finished is read again
                handles[name] = f
            syncer = _Syncer(self.work, [f.fileno() for f in handles.values()], [f.name for f in handles.values()])
            self._report()
            items = self._items(spec, batch_bytes, n_workers)
            with _one_core():  # this process tokenizes too: one core
                encoder = Encoder(spec, self.tokenizer)
                if n_workers <= 1:
                    results = ((task if isinstance(task, Local) else encoder.run(task), tag) for task, tag in items)
                    self._consume(results, handles, syncer)
                else:
                    from rwkvx_cli.data.pool import worker_pool

                    with worker_pool(n_workers - 1, spec) as pool:  # with this process, n_workers tokenize
                        self._consume(pool.imap(items, local=encoder.run), handles, syncer)
            syncer.close()  # the last unit's state is on disk before the split reads the stream
        finally:
            if syncer is not None:
                syncer.abandon()  # after an error: nothing more is written into the work directory
            for f in handles.values():
                f.close()

    def _items(self, spec: EncoderSpec, batch_bytes: int, processes: int) -> Iterator[tuple]:
        first = self.state["units_done"]
        for ui in range(first, len(self.units)):
            unit = self.units[ui]
            path = self.inputs[unit.source]
            edges = {"first": ui == first, "last": ui == len(self.units) - 1, "shape": self.shapes[unit.source]}
            for task, nbytes in unit_tasks(path, unit.start, unit.end, spec, batch_bytes, processes, **edges):
                yield task, (ui, nbytes, _kind(task))
                if isinstance(task, ReadFailure):
                    return
            yield UnitEnd(), (ui, 0, "end")

    def _consume(self, results, handles, syncer: _Syncer) -> None:
        st, item = self.state, self.dtype.itemsize
        tokens_f, docs_f, cuts_f = handles["tokens.bin"], handles["docs.i64"], handles["cuts.i64"]
        mask_f = handles.get("mask.u8")
        unit_lines = 0
        for result, (ui, nbytes, kind) in results:
            unit = self.units[ui]
            path = self.inputs[unit.source]
            if isinstance(result, ReadFailure):
                raise DataError(result.message)
            if isinstance(result, UnitEnd):
                for f in handles.values():
                    with names_file(f.name):
                        f.flush()
                st["units_done"] = ui + 1
                syncer.submit(st)
                unit_lines = 0
                continue
            if result.bad is not None:
                raise DataError(self._where(path, unit, unit_lines, kind, *result.bad))
            if result.first_skipped is not None and st["first_skipped"] is None:
                st["first_skipped"] = self._where(path, unit, unit_lines, kind, *result.first_skipped)
            st["skipped"] += result.skipped
            st["forced"] += result.forced
            st["text_bytes"] += result.text_bytes
            unit_lines += result.lines
            n = len(result.tokens) // item
            with names_file(tokens_f.name):
                tokens_f.write(result.tokens)
            if mask_f is not None:
                if len(result.mask) != n:
                    raise RuntimeError(f"a task returned {len(result.mask)} mask bytes for {n} tokens")
                with names_file(mask_f.name):
                    mask_f.write(result.mask)
            if st["documents"] == 0 and result.cuts:  # the first document's line cuts: where a lone one may split
                cuts_f.write((np.asarray(result.cuts, dtype="<i8") + st["tokens"]).tobytes())
                st["cuts"] += len(result.cuts)
            st["tokens"] += n
            if kind in ("text", "text-end"):  # a text document's pieces: it ends (with the eod) in its last task
                st["open"] += n
                if kind == "text-end":
                    if st["open"]:
                        tokens_f.write(self.eod)
                        if mask_f is not None:
                            mask_f.write(b"\x01")  # a document's end carries loss, as all of it
                        docs_f.write(np.array([st["open"] + 1], dtype="<i8").tobytes())
                        st["tokens"] += 1
                        st["documents"] += 1
                        st["source_docs"][unit.source] += 1
                    st["open"] = 0
            elif result.sizes:
                docs_f.write(result.sizes)
                count = len(result.sizes) // 8
                st["documents"] += count
                st["source_docs"][unit.source] += count
            st["bytes_done"] += nbytes
            self._report()

    def _where(self, path: Path, unit: Unit, unit_lines: int, kind: str, index: int, reason: str) -> str:
        if kind == "rows":
            return f"{path}: row {index}: {reason}"
        base = count_line_starts(path, unit.start) if unit.start else 0
        return f"{path}:{base + unit_lines + index + 1}: {reason}"

    def _report(self) -> None:
        st = self.state
        if self.progress is not None:
            self.progress(st["bytes_done"], self.total_bytes)
        if self.on_progress is not None:
            self.on_progress(
                PrepareProgress(
                    st["bytes_done"], self.total_bytes, st["documents"], st["tokens"],
                    time.perf_counter() - self._t0, self.resumed_bytes,
                )
            )


class _Syncer:
    """Makes each finished unit durable in a thread while this process tokenizes on: fsync the work files, then
    write state.json saying the unit is done (never before its tokens are on disk, so a resume never trusts tokens
    that a crash lost). Writing a unit's tokens to disk takes a while (a second per GB on a slow disk); only the
    newest state matters, so one not yet written is replaced by a newer one. An OSError is raised at the next submit
    or at close."""

    def __init__(self, work: Path, fds: list[int], names: list[str] | None = None):
        self._work, self._fds = work, fds
        self._names = names or [None] * len(fds)  # the files of `fds`, for an error's message
        self._cond = threading.Condition()
        self._pending: str | None = None  # state.json's text
        self._closing = False
        self._error: OSError | None = None
        self._thread = threading.Thread(target=self._run, name="sync-units", daemon=True)
        self._thread.start()

    def submit(self, state: dict) -> None:
        self._raise()
        with self._cond:
            self._pending = json.dumps(state) + "\n"  # as it is now: the caller goes on changing it
            self._cond.notify()

    def close(self) -> None:
        """Wait until the newest state is written."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join()
        self._raise()

    def abandon(self) -> None:
        """Stop without writing what waits (the sync under way, if any, finishes first)."""
        with self._cond:
            self._pending, self._closing = None, True
            self._cond.notify()
        self._thread.join()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error  # as a write here would have: a full disk is not bad input

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closing:
                    self._cond.wait()
                text, self._pending = self._pending, None
            if text is None:
                return
            try:
                for fd, name in zip(self._fds, self._names, strict=True):
                    with names_file(name) if name else contextlib.nullcontext():
                        os.fsync(fd)
                atomic_write_text(self._work / "state.json", text)
            except OSError as e:
                self._error = e
                return


def _kind(task) -> str:
    if isinstance(task, PiecesTask):
        return "text-end" if task.kinds[-1] == "end" else "text"
    if isinstance(task, RowsTask):
        return "rows"
    return "lines" if isinstance(task, (RangeTask, LinesTask)) else "other"


@contextlib.contextmanager
def _one_core() -> Iterator[None]:
    """One worker means one core: the HuggingFace tokenizers' thread pool stays off meanwhile."""
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous


# -- the split and the outputs ---------------------------------------------------------------------------------------


def _map_i64(path: Path, n: int) -> np.ndarray:
    return np.memmap(path, dtype="<i8", mode="r", shape=(n,)) if n else np.zeros(0, dtype="<i8")


def _split(
    work: Path, out_dir: Path, state: dict, dtype, val_fraction, seed: int, sharded: bool, inputs, masked: bool = False
) -> dict:
    """Write train/val from the work directory's stream (and their masks from its mask stream when `masked`);
    returns how (the split) and their sizes."""
    total, n_docs = state["tokens"], state["documents"]
    if total == 0 and not sharded:
        raise DataError(f"the corpus has no text ({', '.join(str(p) for p in inputs)})")
    n_val = _val_tokens(val_fraction, total) if total else 0
    sizes = _map_i64(work / "docs.i64", n_docs)
    stream = work / "tokens.bin"
    masks = work / "mask.u8" if masked else None
    if n_val == 0 or n_docs >= 2:
        split = "documents" if n_val else "none"
        is_val = _choose_val_docs(sizes, n_val, seed, work) if n_val else None
        train = _write_docs(out_dir / "train", stream, dtype, sizes, is_val, False, masks=masks)
        val = _write_docs(out_dir / "val", stream, dtype, sizes if n_val else sizes[:0], is_val, True, masks=masks)
    else:
        cut, split = _cut_single(total, n_val, _map_i64(work / "cuts.i64", state["cuts"]))
        train = _write_docs(out_dir / "train", stream, dtype, np.array([cut]), None, False, masks=masks)
        val = _write_docs(out_dir / "val", stream, dtype, np.array([total - cut]), None, False, skip=cut, masks=masks)
    return {"split": split, "train": train, "val": val, "val_requested": n_val}


def _write_docs(
    prefix: Path, stream: Path, dtype, sizes, mask, want: bool, skip: int = 0, masks: Path | None = None
) -> tuple[int, int, int | None]:
    """Write the documents of the token stream (sizes `sizes`, from token `skip`) for which `mask` is `want` (all
    when mask is None) as a binidx pair, under temporary names renamed when complete; with `masks` (the stream's
    loss mask, a byte per token), the same documents' bytes of it as PREFIX.mask. All of a stream is linked, not
    copied; a part is copied in the kernel. Returns (documents, tokens, tokens that carry loss or None)."""
    dtype, item = np.dtype(dtype), np.dtype(dtype).itemsize
    n = len(sizes)
    chunks = range(0, n, _WRITE_CHUNK)

    def keep(a: int) -> np.ndarray:
        part = np.asarray(sizes[a : a + _WRITE_CHUNK])
        return np.ones(len(part), bool) if mask is None else np.asarray(mask[a : a + _WRITE_CHUNK]) == want

    def kept(a: int) -> np.ndarray:
        return np.asarray(sizes[a : a + _WRITE_CHUNK])[keep(a)]

    def copy(src_path: Path, dst_path: Path, item: int) -> int:
        """The kept documents of `src_path` (`item` bytes a token) into `dst_path`; returns their tokens."""
        if mask is None and skip == 0 and n and int(np.sum(sizes)) * item == src_path.stat().st_size:
            dst_path.unlink(missing_ok=True)
            os.link(src_path, dst_path)
            return int(np.sum(sizes))
        tokens = 0
        with open(src_path, "rb") as src, open(dst_path, "wb") as dst:
            at = skip
            for a in chunks:
                part = np.asarray(sizes[a : a + _WRITE_CHUNK])
                ends = at + np.cumsum(part)
                starts = ends - part
                edges = np.flatnonzero(np.diff(np.concatenate([[False], keep(a), [False]]).astype(np.int8)))
                for r0, r1 in zip(edges[0::2].tolist(), edges[1::2].tolist(), strict=True):
                    length = int(ends[r1 - 1] - starts[r0])
                    copy_range(src.fileno(), dst.fileno(), int(starts[r0]) * item, length * item)
                    tokens += length
                at = int(ends[-1]) if len(part) else at
            fsync_file(dst)
        return tokens

    n_keep = sum(int(np.count_nonzero(keep(a))) for a in chunks)
    loss = None
    bin_path, idx_path = binidx_paths(prefix)
    with replacing(prefix) as (tmp_bin, tmp_idx):
        with names_file(bin_path):
            tokens = copy(stream, tmp_bin, item)
        if masks is not None:
            with replacing_mask(prefix) as tmp_mask, names_file(mask_path(prefix)):
                copy(masks, tmp_mask, 1)
                loss = count_loss(np.memmap(tmp_mask, np.uint8, "r") if tokens else np.zeros(0, np.uint8), tmp_mask)
        with names_file(idx_path):
            write_index(tmp_idx, dtype, n_keep, lambda: (kept(a) for a in chunks))
    return n_keep, tokens, loss


def _finish(
    out_dir, inputs, sizes, units, state, tok, kind, source, dtype, result, rule_name, tokenizer_seconds,
    tokenize_seconds, val_fraction, seed, text_field, n_workers, num_shards, shard_index, resumed_bytes,
    resumed_text_bytes, template=None,
) -> PrepareStats:
    (train_docs, train_tokens, train_loss), (val_docs, val_tokens, val_loss) = result["train"], result["val"]
    total_bytes = sum(u.nbytes for u in units)
    stats = PrepareStats(
        out_dir=out_dir,
        tokenizer_kind=kind,
        vocab_size=tok.vocab_size,
        dtype=dtype.name,
        documents=state["documents"],
        bytes=total_bytes,
        train_tokens=train_tokens,
        val_tokens=val_tokens,
        train_documents=train_docs,
        val_documents=val_docs,
        split=result["split"],
        tokenizer_seconds=tokenizer_seconds,
        tokenize_seconds=tokenize_seconds,
        text_bytes=state["text_bytes"],
        skipped_records=state["skipped"],
        first_skipped=state["first_skipped"],
        eod_id=tok.eod_id,
        cut_rule=rule_name,
        forced_cuts=state["forced"],
        workers=n_workers,
        num_shards=num_shards,
        shard_index=shard_index,
        resumed_bytes=resumed_bytes,
        resumed_text_bytes=resumed_text_bytes,
        template=template.name if template is not None else None,
        train_loss_tokens=train_loss,
        val_loss_tokens=val_loss,
    )
    if num_shards == 1:
        sources = [
            {"path": str(p.resolve()), "bytes": b, "documents": d}
            for p, b, d in zip(inputs, sizes, state["source_docs"], strict=True)
        ]
    else:
        sources = []
        for k in dict.fromkeys(u.source for u in units):
            mine = [u for u in units if u.source == k]
            entry = {"path": str(inputs[k].resolve()), "bytes": sizes[k], "documents": state["source_docs"][k]}
            if (mine[0].start, mine[-1].end) != (0, sizes[k]):
                entry["range"] = [mine[0].start, mine[-1].end]
            sources.append(entry)
    meta = {
        "format": META_FORMAT,
        "version": META_VERSION,
        "tokenizer": {"kind": kind, "source": source, "file": "tokenizer.json", "eod_id": tok.eod_id},
        "vocab_size": stats.vocab_size,
        "dtype": stats.dtype,
        "documents": stats.documents,
        "bytes": stats.bytes,
        "text_bytes": stats.text_bytes,
        "tokens": state["tokens"],
        "train": {"prefix": "train", "tokens": stats.train_tokens, "documents": stats.train_documents},
        "val": {"prefix": "val", "tokens": stats.val_tokens, "documents": stats.val_documents},
        "split": stats.split,
        "val_fraction": int(val_fraction) if isinstance(val_fraction, numbers.Integral) else float(val_fraction),
        "val_requested": result["val_requested"],
        "seed": seed,
        "text_field": text_field,
        "skipped_records": stats.skipped_records,
        "cuts": {"rule": rule_name, "forced": stats.forced_cuts},
        "sources": sources,
    }
    if template is not None:
        meta["train"]["loss_tokens"], meta["val"]["loss_tokens"] = train_loss, val_loss
        meta |= template_meta(template)
    if num_shards > 1:
        meta["shard"] = {"index": shard_index, "count": num_shards, "corpus": corpus_id(inputs, sizes)}
    # Written last: a directory with meta.json is complete.
    atomic_write_text(out_dir / "meta.json", json.dumps(meta, indent=2) + "\n")
    return stats


def template_meta(template) -> dict:
    """What meta.json says of a masked preparation: the template that rendered it (name, identity, the whole of
    it) and the mask files (a byte per token beside each split's .bin)."""
    return {
        "template": {"name": template.name, "sha256": template.sha256, "spec": template.as_dict()},
        "mask": {"suffix": ".mask", "dtype": "uint8"},
    }


def _prepared_here(out_dir: Path) -> bool:
    """A directory prepared by an rwkvx older than the marker file: its meta.json is ours, or it
    holds the token stream of a prepare that was killed."""
    if any(out_dir.glob(".tokens.tmp*")) or (out_dir / WORK_DIR).is_dir():
        return True
    try:
        meta = json.loads((out_dir / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(meta, dict) and meta.get("format") == META_FORMAT


def read_prepared_meta(data_dir: Path, tokenizer_vocab: int | None = None) -> dict:
    """A prepared directory's meta.json, checked against what the directory holds: a damaged or
    edited one (not JSON, wrong fields, a vocab_size or dtype the files or the tokenizer's
    `tokenizer_vocab` disagree with) is a DataError."""
    from rwkvx_cli.data.binidx import open_tokens

    path = Path(data_dir) / "meta.json"
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise DataError(f"{path} cannot be read: {e.strerror}") from None
    except (ValueError, RecursionError):
        raise DataError(f"{path} is not valid JSON (damaged?); prepare the data again") from None
    if not isinstance(meta, dict) or meta.get("format") != META_FORMAT:
        raise DataError(f"{path} is not an rwkvx prepared-data description; prepare the data again")
    vocab, dtype = meta.get("vocab_size"), meta.get("dtype")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 2:
        raise DataError(f"{path}: vocab_size {vocab!r} is not a vocabulary size")
    if dtype != dtype_for_vocab(vocab).name:
        raise DataError(f"{path}: dtype {dtype!r} does not fit vocab_size {vocab} ({dtype_for_vocab(vocab).name})")
    if tokenizer_vocab is not None and tokenizer_vocab != vocab:
        raise DataError(f"{path} says vocab_size {vocab}, its tokenizer.json has {tokenizer_vocab} (edited?)")
    for split in ("train", "val"):
        info = meta.get(split)
        tokens = info.get("tokens") if isinstance(info, dict) else None
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
            raise DataError(f"{path}: {split!r} does not give its token count")
        try:
            opened = open_tokens(Path(data_dir) / f"{split}.bin")
        except (DataError, OSError, ValueError) as e:
            raise DataError(f"{Path(data_dir) / split}.bin: {e}") from None
        if opened.dtype != np.dtype(dtype) or len(opened) != tokens:
            raise DataError(
                f"{path} says {split} holds {tokens} {dtype} tokens; the file holds {len(opened)} {opened.dtype} "
                "(edited or damaged?); prepare the data again"
            )
    if "mask" in meta:
        _check_masks(Path(data_dir), meta)
    return meta


def _check_masks(data_dir: Path, meta: dict) -> None:
    """A masked preparation's template and mask files against its meta.json: each split's mask a byte per
    token, as many 1s as its `loss_tokens` (reads the masks)."""
    path = data_dir / "meta.json"
    template = meta.get("template")
    if not isinstance(template, dict) or not isinstance(template.get("sha256"), str):
        raise DataError(f"{path} has loss masks but names no template (edited?); prepare the data again")
    for split in ("train", "val"):
        loss = meta[split].get("loss_tokens")
        if not isinstance(loss, int) or isinstance(loss, bool) or loss < 0:
            raise DataError(f"{path}: {split!r} does not give its count of loss tokens")
        found = count_loss(open_mask(data_dir / split, meta[split]["tokens"]), mask_path(data_dir / split))
        if found != loss:
            raise DataError(
                f"{mask_path(data_dir / split)} marks {found} tokens that carry loss, {path} says {loss} (edited or "
                "damaged?); prepare the data again"
            )


# The files of a prepared directory that only a holder of its lock (_hold: prepare, merge) writes.
_LOCKED_FILES = ("train.bin", "train.idx", "val.bin", "val.idx", "train.mask", "val.mask", "meta.json")
# Every file rwkvx writes there under a temporary name (fsio.temp_path: .NAME.tmpPID); "tokens": an older
# prepare's token stream.
_OWN_FILES = (*_LOCKED_FILES, "tokenizer.json", "source.json", DATA_MARKER, "tokens")


def remove_stale_temps(out_dir: Path) -> None:
    """Remove the temporary files an earlier rwkvx process left in `out_dir`, a directory rwkvx marked, when it was
    killed (kill -9 while writing train.bin leaves a second copy of it). Called with the directory's lock held
    (_hold): the temporary files of the locked outputs are then another process's that no longer holds it; any
    other of rwkvx's only when its pid is gone. Nothing else is touched."""
    mine = str(os.getpid())
    for name in _OWN_FILES:
        prefix = f".{name}.tmp"
        for p in out_dir.glob(f"{glob_escape(prefix)}*"):
            pid = p.name[len(prefix) :]
            if pid.isdigit() and pid != mine and (name in _LOCKED_FILES or not _alive(int(pid))):
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def _check_seed(seed) -> None:
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed <= MAX_SEED:
        raise UsageError(f"seed must be an integer from 0 to {MAX_SEED}, got {seed!r}")


def _check_val_fraction(val_fraction) -> None:
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, numbers.Real):
        raise UsageError(f"val_fraction must be a fraction in [0, 1) or a token count, got {val_fraction!r}")
    if isinstance(val_fraction, numbers.Integral):
        if val_fraction < 0:
            raise UsageError(f"the validation token count must be >= 0, got {val_fraction}")
    elif not 0.0 <= val_fraction < 1.0:
        raise UsageError(f"val_fraction must be in [0, 1) (or an integer token count), got {val_fraction}")


def _val_tokens(val_fraction: float | int, total: int) -> int:
    n = int(val_fraction) if isinstance(val_fraction, numbers.Integral) else round(float(val_fraction) * total)
    if n >= total:
        raise DataError(f"a validation split of {n} tokens leaves no training data: the corpus has {total} tokens")
    return n


def _make_tokenizer(kind, inputs: list[Path], vocab_size: int | None, eod_id: int | None, read_options: dict):
    if isinstance(kind, str) and kind in (*NAMES, "bpe"):
        if eod_id not in (None, 0):
            raise UsageError(f"eod_id applies to a loaded tokenizer.json; the {kind} tokenizer's is 0")
        return train_tokenizer(kind, inputs, vocab_size, **read_options), kind, None
    path = Path(kind)
    if not path.is_file():
        raise UsageError(
            f"tokenizer must be byte, world, bpe or the path of a tokenizer file; {path} is not a file"
        )
    tok = load_tokenizer(path, eod_id=eod_id)
    if vocab_size is not None and vocab_size != tok.vocab_size:
        raise UsageError(f"vocab_size {vocab_size} does not match the loaded tokenizer's {tok.vocab_size}")
    return tok, "file", str(path.resolve())


def _choose_val_docs(doc_sizes: np.ndarray, n_val: int, seed: int, scratch: Path) -> np.ndarray:
    """Documents in a seeded random order, each taken while the validation split stays within n_val tokens.

    The order is numpy's `permutation(n)` of that seed (the same as ever). Past _IN_MEMORY_DOCS documents it and
    the returned mask live in memory maps in `scratch`: file pages, not this process's memory."""
    n = len(doc_sizes)
    rng = np.random.default_rng(seed)
    if n <= _IN_MEMORY_DOCS:
        order, is_val = rng.permutation(n), np.zeros(n, dtype=bool)
    else:
        order = np.memmap(scratch / "order.i64", dtype=np.int64, mode="w+", shape=(n,))
        for a in range(0, n, _WRITE_CHUNK):
            order[a : a + _WRITE_CHUNK] = np.arange(a, min(n, a + _WRITE_CHUNK))
        rng.shuffle(order.view(np.ndarray))  # permutation(n) is this shuffle of arange(n)
        is_val = np.memmap(scratch / "is_val.u8", dtype=bool, mode="w+", shape=(n,))
    got = 0
    for start in range(0, n, 1 << 20):  # in chunks: no list of every document
        chunk = np.asarray(order[start : start + (1 << 20)])
        for i, size in zip(chunk.tolist(), np.asarray(doc_sizes[chunk]).tolist(), strict=True):
            if got + size <= n_val:
                is_val[i] = True
                got += size
                if got == n_val:
                    return is_val
    if got == 0:  # every document is larger than asked for: hold out the smallest one
        is_val[int(np.argmin(doc_sizes))] = True
    return is_val


def _cut_single(total: int, n_val: int, cuts: np.ndarray) -> tuple[int, str]:
    """The token offset that splits the only document: the line cut nearest to total - n_val if it is within
    SPLIT_TOLERANCE of n_val ("line"), else total - n_val exactly ("tokens")."""
    target = total - n_val
    inner = np.asarray(cuts[(cuts > 0) & (cuts < total - 1)])  # total - 1 is the end of the text, before the eod
    if inner.size:
        i = int(np.searchsorted(inner, target))
        near = [int(c) for c in inner[max(0, i - 1) : i + 1]]
        best = min(near, key=lambda c: abs(c - target))
        if abs(best - target) <= SPLIT_TOLERANCE * n_val:
            return best, "line"
    return target, "tokens"
