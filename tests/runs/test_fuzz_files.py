"""A bounded fuzz run (issue 36, `make test-slow`, about 90 s): `rwkvx init --from`, `export` and
`eval` on mutated model files (safetensors bytes and headers, HF config.json and shard index,
`.pth` archives, a checkpoint's weights under a meta.json without checksums, as a forger writes it).
Each command either succeeds or fails in one `error:` line with exit 1 or 2: never a traceback;
nothing is written outside its output (the run directory, --out), a failed command leaves no file
behind, and the input files are never changed."""

import hashlib
import json
import os
import random
import shutil
import struct
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from rwkvx_cli.checkpoints.full import save_checkpoint
from rwkvx_cli.cli import app
from rwkvx_cli.config import Config, config_to_dict
from rwkvx_cli.data import ByteTokenizer
from rwkvx_cli.formats import export_hf
from rwkvx_cli.models import build_model
from tests.formats.forge import TINY, join, split, tiny_state, write_tiny
from tests.train.helpers import one_line_error

runner = CliRunner()
BUDGET_S = float(os.environ.get("RWKVX_FUZZ_SECONDS", 90))  # a longer run, another seed: RWKVX_FUZZ_SEED
JUNK = [None, True, -1, 0, 2**64, 1.5, "x", "", "F32", [], [0], [0, 1, 2], ["0", "4"], {}, {"a": 1}, [-8, 0]]


def _tree(root: Path) -> dict[str, str]:
    """Every file under root and its SHA-256 (directories as such)."""
    out = {}
    for p in sorted(root.rglob("*")):
        out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
    return out


def _mutate_bytes(raw: bytes, rng: random.Random) -> bytes:
    raw = bytearray(raw)
    how = rng.choice(["flip", "flip-header", "truncate", "append", "length"])
    if how == "flip" and raw:
        for _ in range(rng.randint(1, 8)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
    elif how == "flip-header" and len(raw) > 8:
        n = min(struct.unpack("<Q", raw[:8])[0] + 8, len(raw)) if len(raw) >= 8 else len(raw)
        for _ in range(rng.randint(1, 4)):
            raw[rng.randrange(min(n, len(raw)))] = rng.choice(b'{}[]",:0123456789-eE. \\x\x00\xff')
    elif how == "truncate":
        raw = raw[: rng.randrange(len(raw) + 1)]
    elif how == "append":
        raw += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    else:
        raw[:8] = struct.pack("<Q", rng.choice([0, 1, len(raw), 2**63, rng.randrange(2**20)]))
    return bytes(raw)


def _mutate_json(value, rng: random.Random, depth: int = 0):
    """One random edit somewhere in a JSON value: a value replaced, a key removed or added."""
    if isinstance(value, dict) and value and depth < 3 and rng.random() < 0.7:
        key = rng.choice(sorted(value))
        how = rng.random()
        if how < 0.15:
            del value[key]
        elif how < 0.25:
            value[rng.choice(["zz", key + "x", "__metadata__"])] = rng.choice(JUNK)
        else:
            value[key] = _mutate_json(value[key], rng, depth + 1)
        return value
    if isinstance(value, list) and value and rng.random() < 0.5:
        i = rng.randrange(len(value))
        value[i] = _mutate_json(value[i], rng, depth + 1)
        return value
    if isinstance(value, int) and not isinstance(value, bool) and rng.random() < 0.5:
        return value + rng.choice([-(10**6), -8, -1, 1, 8, 2**40])
    return rng.choice(JUNK)


def _mutate_safetensors(path: Path, rng: random.Random) -> None:
    if rng.random() < 0.4:
        path.write_bytes(_mutate_bytes(path.read_bytes(), rng))
        return
    header, data = split(path)
    names = [k for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]
    if names and rng.random() < 0.3:  # another shape of the same size: the bytes still fit
        entry = header[rng.choice(names)]
        n = 1
        for d in entry["shape"]:
            n *= d
        entry["shape"] = rng.choice([[n], [1, n], [n, 1], [], list(reversed(entry["shape"])), [*entry["shape"], 1]])
        if entry["shape"] == [] and n != 1:
            entry["shape"] = [n, 1, 1]
        path.write_bytes(join(header, data))
        return
    header = _mutate_json(header, rng)
    text = json.dumps(header)
    if rng.random() < 0.15 and isinstance(header, dict) and len(header) > 1 and text.endswith("}"):
        name = rng.choice(sorted(header))
        text = text[:-1] + f", {json.dumps(name)}: {json.dumps(header[rng.choice(sorted(header))])}}}"
    path.write_bytes(join(text, data))


def _mutate_state(path: Path, rng: random.Random) -> None:
    """A .pth whose state dict is edited: a tensor renamed (into another layout's names too), reshaped,
    recast, dropped, or one added."""
    state = torch.load(path, weights_only=True)
    for _ in range(rng.randint(1, 3)):
        name = rng.choice(sorted(state))
        how = rng.choice(["rename", "reshape", "dtype", "drop", "add"])
        if how == "rename":
            new = rng.choice(["rwkv." + name, "model.layers.0.attn.r_k", "moba.0.ln1.weight", "blocks.7." + name,
                              name.replace("blocks.0", "blocks.99999999999"), "emb.weight", ""])
            state[new] = state.pop(name)
        elif how == "reshape":
            state[name] = state[name].reshape(rng.choice([[-1], [1, -1], [-1, 1], [*state[name].shape, 1]]))
        elif how == "dtype":
            state[name] = state[name].to(rng.choice([torch.float16, torch.float64, torch.int64, torch.bool,
                                                     torch.complex64, torch.bfloat16, torch.uint8]))
        elif how == "drop":
            del state[name]
        else:
            state[rng.choice(["x", "blocks.0.att.extra", "head.bias"])] = torch.zeros(rng.randint(0, 3))
    torch.save(state, path)


def _mutate_file_json(path: Path, rng: random.Random) -> None:
    if rng.random() < 0.2:
        path.write_bytes(_mutate_bytes(path.read_bytes(), rng))
    else:
        path.write_text(json.dumps(_mutate_json(json.loads(path.read_text()), rng)))


@pytest.fixture(scope="module")
def originals(tmp_path_factory, corpus):
    """The valid files every mutation starts from."""
    root = tmp_path_factory.mktemp("originals")
    write_tiny(root / "model.safetensors")
    torch.save(tiny_state(), root / "model.pth")
    export_hf(tiny_state(), root / "hf", max_shard_bytes=200_000, tokenizer=ByteTokenizer())
    cfg = Config(model=TINY)
    run = root / "run"
    save_checkpoint(run / "checkpoints", 1, build_model(TINY, 0), None, {"config": config_to_dict(cfg)}, 3)
    ByteTokenizer().save(run / "tokenizer.json")
    result = runner.invoke(app, ["data", "prepare", str(corpus), "--out", str(run / "data")])  # for eval
    assert result.exit_code == 0, result.output
    return root


def _forged_input(originals: Path, work: Path, rng: random.Random, mutate: bool) -> tuple[str, Path]:
    """(kind, path) of a freshly mutated copy of one of the originals, under work/in (`mutate` False:
    the copy as it is, which every command must take)."""
    kind = rng.choice(["safetensors", "pth", "hf-config", "hf-index", "hf-shard", "run"])
    src = work / "in"
    if kind == "safetensors":
        path = src / "model.safetensors"
        shutil.copy(originals / "model.safetensors", path)
        target = lambda: _mutate_safetensors(path, rng)  # noqa: E731
    elif kind == "pth":
        path = src / "model.pth"
        shutil.copy(originals / "model.pth", path)
        if rng.random() < 0.5:
            target = lambda: path.write_bytes(_mutate_bytes(path.read_bytes(), rng))  # noqa: E731
        else:
            target = lambda: _mutate_state(path, rng)  # noqa: E731
    elif kind.startswith("hf"):
        path = src / "hf"
        shutil.copytree(originals / "hf", path)
        if kind == "hf-config":
            target = lambda: _mutate_file_json(path / "config.json", rng)  # noqa: E731
        elif kind == "hf-index":
            target = lambda: _mutate_file_json(path / "model.safetensors.index.json", rng)  # noqa: E731
        else:
            target = lambda: _mutate_safetensors(rng.choice(sorted(path.glob("*.safetensors"))), rng)  # noqa: E731
    else:
        path = src / "run"
        shutil.copytree(originals / "run", path)
        ckpt = next((path / "checkpoints").glob("step_*"))
        meta = json.loads((ckpt / "meta.json").read_text())
        meta.pop("files", None)  # a forger drops the checksums (an older checkpoint has none)
        meta.pop("meta_sha256", None)
        (ckpt / "meta.json").write_text(json.dumps(meta))
        target = lambda: _mutate_safetensors(ckpt / "model.safetensors", rng)  # noqa: E731
    if mutate:
        target()
    return kind, path


def _command(kind: str, path: Path, work: Path, corpus: Path, rng: random.Random) -> tuple[list[str], Path | None]:
    """(CLI arguments, the output they may write) for one command on the forged input."""
    if kind == "run" and rng.random() < 0.6:
        if rng.random() < 0.5:
            fmt = rng.choice(["rwkv-lm", "safetensors", "hf", "rwkv-x"])
            out = work / "out" / ("hf" if fmt == "hf" else f"model.{'safetensors' if fmt == 'safetensors' else 'pth'}")
            return ["export", "--checkpoint", str(path), "--format", fmt, "--out", str(out)], out
        return ["eval", "--checkpoint", str(path), "--generate", "ab", "--tokens", "2"], None
    run = work / "out" / "run"
    args = [f"run_dir={run}", f"data.corpus=[{corpus}]", f"data.prepared_dir={work / 'data'}"]
    return ["init", *args, "train.ctx_len=32", "train.micro_batch=4", "--from", str(path)], run


@pytest.mark.slow
def test_mutated_model_files_never_give_a_traceback_or_leave_files(originals, tmp_path, corpus):
    rng = random.Random(int(os.environ.get("RWKVX_FUZZ_SEED", 36)))
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    seen: dict[tuple[str, int], int] = {}
    deadline = time.monotonic() + BUDGET_S
    while time.monotonic() < deadline:
        for sub in ("in", "out"):
            shutil.rmtree(work / sub, ignore_errors=True)
            (work / sub).mkdir()
        mutate = rng.random() > 0.1
        kind, path = _forged_input(originals, work, rng, mutate)
        args, out = _command(kind, path, work, corpus, rng)
        inputs = _tree(work / "in")
        result = runner.invoke(app, args)
        what = f"{args[0]} on {kind} ({' '.join(args)})"
        assert result.exception is None or isinstance(result.exception, SystemExit), (what, result.exception)
        assert "Traceback" not in result.output, (what, result.output)
        assert result.exit_code in (0, 1, 2), (what, result.output)
        assert _tree(work / "in") == inputs, what  # the inputs are never changed
        written = {p.name for p in (work / "out").iterdir()}
        assert mutate or result.exit_code == 0, (what, result.output)  # the valid files: not refused
        if result.exit_code:
            one_line_error(result, result.exit_code)
            assert not written, (what, result.output, written)  # nothing left behind
        else:
            assert written <= ({out.name} if out is not None else set()), (what, written)
        key = (f"{args[0]} {kind}", result.exit_code)
        seen[key] = seen.get(key, 0) + 1
    assert sum(seen.values()) >= 30, seen
    refused, taken = {k for (k, rc) in seen if rc}, {k for (k, rc) in seen if not rc}
    assert {"init safetensors", "init hf-config", "init pth", "export run", "eval run"} <= refused, seen
    assert {"init safetensors", "init hf-config", "init pth"} <= taken, seen
