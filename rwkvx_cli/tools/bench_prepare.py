"""Benchmark of `prepare` against its tokenizer alone, on a corpus it generates.

    python -m rwkvx_cli.tools.bench_prepare [--mb 300] [--tokenizers byte,bpe,world] [--workers 1,2]
                                            [--repeat 3] [--style prose|verse] [--json PATH] [--dir DIR] [--keep]

The corpus is JSONL of Shakespeare-derived documents (`data/tinyshakespeare.txt`, nothing downloaded): spans of
consecutive lines of log-normal length (median 2,500 characters, capped at 200,000), as verse (its own line
breaks) or as prose (each speech one paragraph, speeches one per line, as in web text). For each tokenizer (`bpe`:
byte-level BPE of 8,192 ids trained on the source text) it measures, in this run, the tokenizer alone on one core
(documents encoded one at a time, JSON parsing not timed; for BPE and the native World engine also in batches of
a thousand, the faster counts; for World also each other engine that runs here: `rust`, pyrwkv-tokenizer), then
`prepare` with each worker count, and reports MB/s of document text (over the whole tokenizing phase, and "steady":
from the first task's result to the last, without the workers' start-up), tokens/s and the ratios: workers 1
against the tokenizer alone, workers N against workers 1, and for each N > 1 the tokenizer alone in N processes at
once (each over the whole corpus) against one: the most N cores of this machine give for the work itself, with
caches, memory bandwidth and a shared host's clock shared, the ceiling of `--workers N`. Each prepare runs in a
fresh process, as `rwkvx data prepare` does; its anonymous memory (RssAnon: not the file pages of memory-mapped
outputs) and its workers' are sampled every 0.1 s. All of it runs in --repeat rounds; each ratio is taken within
a round (a slow spell of a shared machine hits both of its sides) and its median over the rounds is reported, each
rate as the run of median speed, and the load average is recorded before and after every run. Prints a table and,
with --json, writes every figure (an existing file only with --force). Everything it writes goes into a new directory
(bench-prepare-XXXXXXXX, inside --dir if given: nothing else there is touched), deleted at the end unless --keep.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from rwkvx_cli.entry import ArgumentParser, above_zero, at_least, input_text, run_main
from rwkvx_cli.errors import RwkvxError
from rwkvx_cli.fsio import check_output, write_json

SOURCE = Path(__file__).resolve().parents[2] / "data" / "tinyshakespeare.txt"


def generate(path: Path, megabytes: float, style: str, source: Path = SOURCE, seed: int = 0) -> dict:
    """Write the JSONL corpus; returns its size and document count."""
    import re

    lines = source.read_text(encoding="utf-8").splitlines(keepends=True)
    starts = np.cumsum([0] + [len(line) for line in lines])
    rng = np.random.default_rng(seed)
    target, size, docs = int(megabytes * 1e6), 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while size < target:
            length = int(min(rng.lognormal(np.log(2500), 1.0), 200_000))
            a = int(rng.integers(0, len(lines)))
            b = max(a + 1, int(np.searchsorted(starts, starts[a] + length)))
            text = "".join(lines[a:b])
            if style == "prose":
                speeches = (s.replace("\n", " ").strip() for s in re.split(r"\n\s*\n", text))
                text = "\n".join(s for s in speeches if s)
            record = json.dumps({"text": text, "id": docs}, ensure_ascii=False) + "\n"
            f.write(record)
            size += len(record.encode("utf-8"))
            docs += 1
    return {"bytes": size, "documents": docs, "style": style}


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _batches(path: Path, n: int = 1000):
    batch: list[str] = []
    with open(path, "rb") as f:
        for line in f:
            batch.append(json.loads(line)["text"])
            if len(batch) == n:
                yield batch
                batch = []
    if batch:
        yield batch


def tokenizer_alone(kind: str, tokenizer, corpus: Path) -> dict:
    """The tokenizer on one core, documents one at a time (and in batches where it has a batch call that stays on
    one core: BPE, the native World engine; the faster counts): text MB/s, tokens/s."""
    load_before = _load()
    seconds, tokens, text_bytes = {"one": 0.0, "batch": 0.0}, 0, 0
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core
    batch = None
    try:
        if kind == "byte":
            def one(t):
                return np.frombuffer(t.encode("utf-8"), np.uint8).astype(np.uint16) + 1
        elif kind == "bpe":
            hf = tokenizer._tok

            def one(t):
                return hf.encode(t, add_special_tokens=False).ids

            def batch(docs):
                hf.encode_batch_fast(docs, add_special_tokens=False)
        elif hasattr(tokenizer._engine, "encode_packed"):  # the native World engine: ids straight to uint16
            packed = tokenizer._engine.encode_packed

            def one(t):
                return packed([t])[0]

            batch = packed
        else:
            one = tokenizer._engine.encode
        for docs in _batches(corpus):
            text_bytes += sum(len(t.encode("utf-8")) for t in docs)
            t0 = time.perf_counter()
            for t in docs:
                tokens += len(one(t))
            seconds["one"] += time.perf_counter() - t0
            if batch is not None:
                t0 = time.perf_counter()
                batch(docs)
                seconds["batch"] += time.perf_counter() - t0
    finally:
        if previous is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous
    best = min(s for s in seconds.values() if s > 0)
    out = {
        "engine": getattr(tokenizer, "engine", None),
        "text_mb_per_s": text_bytes / 1e6 / best,
        "tokens_per_s": tokens / best,
        "seconds": best,
        "tokens": tokens,
        "text_bytes": text_bytes,
        "load_before": load_before,
        "load_after": _load(),
    }
    if batch is not None:
        out["one_at_a_time_mb_per_s"] = text_bytes / 1e6 / seconds["one"]
        out["batched_mb_per_s"] = text_bytes / 1e6 / seconds["batch"]
    return out


def _rss_anon(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _children(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == pid:
                kids.append(int(entry.name))
    return kids


class MemorySampler:
    """Peak RssAnon of a process and of its descendants (the forkserver and the workers), every 0.1 s."""

    def __init__(self, pid: int):
        self.pid = pid
        self.peak_main = 0
        self.peak_worker = 0
        self.peak_total = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            main = _rss_anon(self.pid) or 0
            todo, others = _children(self.pid), []
            while todo:
                p = todo.pop()
                others.append(p)
                todo += _children(p)
            workers = [_rss_anon(p) or 0 for p in others]
            self.peak_main = max(self.peak_main, main)
            self.peak_worker = max([self.peak_worker, *workers])
            self.peak_total = max(self.peak_total, main + sum(workers))

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


_CHILD = """
import json, sys, time
from rwkvx_cli.data import prepare
seen = []
t0 = time.perf_counter()
s = prepare([sys.argv[1]], sys.argv[2], sys.argv[3], workers=int(sys.argv[4]),
            on_progress=lambda p: seen.append((time.perf_counter(), p.bytes_done)))
done = [(t, b) for t, b in seen if b > 0]
steady = (done[-1][1] - done[0][1]) / (done[-1][0] - done[0][0]) if len(done) > 2 else None
print(json.dumps({"wall": time.perf_counter() - t0, "tokenize": s.tokenize_seconds, "load": s.tokenizer_seconds,
                  "text_bytes": s.text_bytes, "bytes": s.bytes, "tokens": s.train_tokens + s.val_tokens,
                  "documents": s.documents, "workers": s.workers, "cut_rule": s.cut_rule, "steady": steady}))
"""


_ALONE_CHILD = """
import json, sys
from pathlib import Path
from rwkvx_cli.data.tokenizer import load_tokenizer
from rwkvx_cli.tools.bench_prepare import tokenizer_alone
tok = load_tokenizer(sys.argv[2] if sys.argv[1] == "bpe" else sys.argv[1])
tok.encode_arrays(["warm"])
print(json.dumps(tokenizer_alone(sys.argv[1], tok, Path(sys.argv[3]))))
"""


def alone_at_once(kind: str, tokenizer: str | Path, corpus: Path, n: int) -> dict:
    """The tokenizer alone in `n` processes at once, each over the whole corpus: what n cores of this machine give
    for this work with nothing shared, the ceiling of `prepare --workers n` (caches, memory and a shared host's
    clock are shared all the same)."""
    import subprocess

    paths = [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    args = [sys.executable, "-c", _ALONE_CHILD, kind, str(tokenizer), str(corpus)]
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, text=True, env=env) for _ in range(n)]
    runs = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
    if any(p.returncode for p in procs):
        raise RwkvxError("a concurrent tokenizer run failed")
    return {"processes": n, "text_mb_per_s": sum(r["text_mb_per_s"] for r in runs), "each": runs}


def prepare_run(corpus: Path, out: Path, tokenizer: str | Path, workers: int) -> dict:
    """`prepare` in a fresh process (as `rwkvx data prepare` runs), its memory sampled from here."""
    import subprocess

    shutil.rmtree(out, ignore_errors=True)
    load_before = _load()
    paths = [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(corpus), str(out), str(tokenizer), str(workers)],
        stdout=subprocess.PIPE, text=True, env=env,
    )
    with MemorySampler(proc.pid) as sampler:
        stdout, _ = proc.communicate()
    if proc.returncode:
        raise RwkvxError(f"prepare failed (exit {proc.returncode})")
    r = json.loads(stdout.strip().splitlines()[-1])
    shutil.rmtree(out, ignore_errors=True)
    return {
        "workers": r["workers"],
        "text_mb_per_s": r["text_bytes"] / 1e6 / r["tokenize"],
        "input_mb_per_s": r["bytes"] / 1e6 / r["tokenize"],
        "tokens_per_s": r["tokens"] / r["tokenize"],
        # From the first task's result to the last: without starting the workers and loading their tokenizers.
        "steady_text_mb_per_s": r["steady"] * r["text_bytes"] / r["bytes"] / 1e6 if r["steady"] else None,
        "tokenize_seconds": r["tokenize"],
        "wall_seconds": r["wall"],
        "split_and_write_seconds": r["wall"] - r["tokenize"] - r["load"],
        "tokens": r["tokens"],
        "documents": r["documents"],
        "cut_rule": r["cut_rule"],
        "peak_rss_anon_mb": {
            "main": sampler.peak_main / 1e6,
            "largest_worker": sampler.peak_worker / 1e6,
            "all": sampler.peak_total / 1e6,
        },
        "load_before": load_before,
        "load_after": _load(),
    }


def measure(kind: str, tok, name: str | Path, corpus: Path, counts: list[int], others: dict, repeat: int,
            work: Path) -> dict:
    """`repeat` rounds of: the tokenizer alone (and each other engine in `others`), `prepare` with each worker count,
    the tokenizer alone in N processes at once. A ratio is taken within each round (a slow spell of a shared
    machine hits both of its sides) and its median over the rounds is reported; a rate, the run of median speed."""
    rounds = []
    for _ in range(repeat):
        rnd = {"alone": tokenizer_alone(kind, tok, corpus), "prepare": {}, "at_once": {}}
        rnd["others"] = {engine: tokenizer_alone(kind, other, corpus) for engine, other in others.items()}
        for n in counts:
            rnd["prepare"][n] = prepare_run(corpus, work / f"out-{kind}-{n}", name, n)
        for n in (c for c in counts if c > 1):
            rnd["at_once"][n] = alone_at_once(kind, name, corpus, n)
        rounds.append(rnd)
    entry: dict = {
        "alone": _median([r["alone"] for r in rounds]),
        "other_engines": {e: _median([r["others"][e] for r in rounds]) for e in others},
        "prepare": {str(n): _median([r["prepare"][n] for r in rounds]) for n in counts},
        "ratios_by_round": {},
    }

    def ratio(key: str, of) -> None:
        values = [of(r) for r in rounds]
        if all(v is not None for v in values):
            entry[key] = sorted(values)[len(values) // 2]
            entry["ratios_by_round"][key] = [round(v, 3) for v in values]

    def mb(r: dict, n: int, key: str = "text_mb_per_s") -> float | None:
        return r["prepare"][n].get(key)

    def steady(r: dict, n: int) -> float | None:
        a, b = mb(r, n, "steady_text_mb_per_s"), mb(r, 1, "steady_text_mb_per_s")
        return a / b if a and b else None

    for n in (c for c in counts if c > 1):
        entry[f"alone_{n}_at_once"] = _median([r["at_once"][n] for r in rounds])
        ratio(f"alone_{n}_at_once_vs_1", lambda r, n=n: r["at_once"][n]["text_mb_per_s"] / r["alone"]["text_mb_per_s"])
    if 1 in counts:
        ratio("workers_1_vs_alone", lambda r: mb(r, 1) / r["alone"]["text_mb_per_s"])
        for e in others:
            ratio(f"workers_1_vs_{e}_alone", lambda r, e=e: mb(r, 1) / r["others"][e]["text_mb_per_s"])
        for n in (c for c in counts if c > 1):
            ratio(f"workers_{n}_vs_1", lambda r, n=n: mb(r, n) / mb(r, 1))
            ratio(f"workers_{n}_vs_1_steady", lambda r, n=n: steady(r, n))
        w1 = entry["prepare"]["1"]["text_mb_per_s"]
        entry["hours_per_tb_by_cores"] = projection(w1, entry.get("workers_2_vs_1"))
    return entry


def _median(runs: list[dict]) -> dict:
    """The run of median text MB/s, with every run's rate beside it."""
    middle = sorted(runs, key=lambda r: r["text_mb_per_s"])[len(runs) // 2]
    return {**middle, "runs_text_mb_per_s": [round(r["text_mb_per_s"], 2) for r in runs]}


def machine() -> dict:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from rwkvx_cli.data.encode import default_workers

    cores = default_workers()
    return {"cpu": cpu, "cores_available": cores, "cpu_count": os.cpu_count(), "python": sys.version.split()[0]}


def projection(w1_text_mb_per_s: float, scaling: float | None) -> dict:
    """Hours for 1 TB of text: the single-worker rate times cores times the 2-worker efficiency measured here."""
    efficiency = min(1.0, scaling / 2) if scaling else 1.0
    return {
        str(c): round(1e12 / (w1_text_mb_per_s * 1e6 * (1 if c == 1 else c * efficiency)) / 3600, 1)
        for c in (1, 2, 8, 32, 64, 128)
    }


TOKENIZERS = ("byte", "bpe", "world")


def _tokenizers(text: str) -> list[str]:
    names = [t for t in text.split(",") if t]
    bad = [t for t in names if t not in TOKENIZERS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of {', '.join(TOKENIZERS)}")
    return names


def _counts(text: str) -> list[int]:
    return [at_least(1)(t) for t in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m rwkvx_cli.tools.bench_prepare", description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=above_zero, default=300.0, help="corpus size in MB (default 300)")
    ap.add_argument("--tokenizers", type=_tokenizers, default="byte,bpe,world")
    ap.add_argument("--workers", type=_counts, default="1,2", help="worker counts to time (default 1,2)")
    ap.add_argument("--style", choices=("prose", "verse"), default="prose")
    ap.add_argument("--json", type=Path, help="write every figure here")
    ap.add_argument("--force", action="store_true", help="replace --json if it exists")
    ap.add_argument("--dir", type=Path, help="where its own directory goes (default: the system's temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep what it wrote (the generated corpus)")
    ap.add_argument("--source", type=Path, default=SOURCE, help="the text the documents are drawn from")
    ap.add_argument(
        "--repeat", type=at_least(1), default=3, help="rounds of every measurement; medians count (default 3)"
    )
    args = ap.parse_args(argv)
    if args.dir is not None and args.dir.exists() and not args.dir.is_dir():
        ap.error(f"--dir {args.dir} is not a directory")
    if args.json is not None:
        check_output(args.json, args.force, "--json")  # before minutes of measuring
    input_text(args.source, "--source")
    from rwkvx_cli.data.tokenizer import BPETokenizer, load_tokenizer
    from rwkvx_cli.data.world import WorldTokenizer

    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-prepare-", dir=args.dir))
    corpus = work / f"corpus-{args.style}-{args.mb:g}MB.jsonl"
    command = " ".join(["python -m rwkvx_cli.tools.bench_prepare", *(sys.argv[1:] if argv is None else argv)])
    report: dict = {"machine": machine(), "command": command}
    try:
        t0 = time.perf_counter()
        report["corpus"] = generate(corpus, args.mb, args.style, args.source)
        report["corpus"]["generate_seconds"] = time.perf_counter() - t0
        report["tokenizers"] = {}
        for kind in args.tokenizers:
            if kind == "bpe":
                tok = BPETokenizer.train([args.source.read_text(encoding="utf-8")], 8192)
                tok.save(work / "bpe.json")
                name: str | Path = work / "bpe.json"
            else:
                tok, name = load_tokenizer(kind), kind
                tok.encode_arrays(["warm"])
            others = {}
            if kind == "world":  # every other World engine that runs here, alone, for comparison
                for engine in ("native", "rust"):
                    if engine != tok.engine:
                        with contextlib.suppress(Exception):  # not installed, no compiler
                            others[engine] = WorldTokenizer(engine)
                            others[engine].encode_arrays(["warm"])
            entry = measure(kind, tok, name, corpus, args.workers, others, args.repeat, work)
            report["tokenizers"][kind] = entry
            _print_entry(kind, entry)
    finally:
        if args.keep:
            print(f"kept {corpus}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    write_json(args.json, report, force=args.force)
    return 0


def _print_entry(kind: str, e: dict) -> None:
    for engine, a in [(e["alone"].get("engine"), e["alone"]), *e.get("other_engines", {}).items()]:
        name = f"{kind} ({engine})" if engine else kind
        print(f"{name}: tokenizer alone {a['text_mb_per_s']:.1f} MB/s, {a['tokens_per_s'] / 1e6:.2f}M tokens/s "
              f"(load {a['load_before']} -> {a['load_after']})")
    for n, r in e["prepare"].items():
        mem = r.get("peak_rss_anon_mb")
        extra = f", peak RssAnon main {mem['main']:.0f} MB, worker {mem['largest_worker']:.0f} MB" if mem else ""
        steady = f" (steady {r['steady_text_mb_per_s']:.1f})" if r.get("steady_text_mb_per_s") else ""
        each = r.get("runs_text_mb_per_s", [])
        runs = f" (runs {', '.join(map(str, each))})" if len(each) > 1 else ""
        print(f"  prepare --workers {n}: {r['text_mb_per_s']:.1f} MB/s{runs}{steady}, "
              f"{r['tokens_per_s'] / 1e6:.2f}M tokens/s, "
              f"split+write {r['split_and_write_seconds']:.1f} s (load {r['load_before']} -> {r['load_after']}){extra}")
    for key in sorted(k for k in e if k.startswith("alone_") and k.endswith("_at_once")):
        print(f"  tokenizer alone in {e[key]['processes']} processes at once: {e[key]['text_mb_per_s']:.1f} MB/s "
              f"in all ({e.get(key + '_vs_1', 0):.2f}x one: this machine's ceiling for that many workers)")
    for key in sorted(k for k in e if k.startswith("workers_")):
        rounds = e.get("ratios_by_round", {}).get(key, [])
        each = f" (rounds {', '.join(f'{v:.2f}' for v in rounds)})" if len(rounds) > 1 else ""
        print(f"  {key.replace('_', ' ')}: {e[key]:.2f}x{each}")
    if "hours_per_tb_by_cores" in e:
        hours = e["hours_per_tb_by_cores"]
        print("  1 TB of text, hours by cores: " + ", ".join(f"{c}: {h}" for c, h in hours.items()))


if __name__ == "__main__":
    run_main(main)
