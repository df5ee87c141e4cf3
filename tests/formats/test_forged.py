"""Forged and damaged model files from elsewhere (issue 36): each is refused in one line naming the
file and the field, before anything is written, or read exactly as the format's own library reads
it. Every case here was a traceback or a silent acceptance before the checks (formats/checks.py,
tensors.safetensors_entries, hf.sizes_from_hf_config, tensors.hf_index)."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from typer.testing import CliRunner

from rwkvx_cli.cli import app
from rwkvx_cli.config import ModelConfig
from rwkvx_cli.errors import CheckpointError
from rwkvx_cli.formats import FormatError, export_hf, materialize
from rwkvx_cli.runs.weights import load_into, open_any
from tests.formats.forge import TINY, forge, join, split, tiny_state, write_tiny
from tests.train.helpers import one_line_error

runner = CliRunner()


def refused(path, *words) -> str:
    """The one-line FormatError that reading `path` (sizes, then every tensor) raises."""
    with pytest.raises(FormatError) as e:
        source, _ = open_any(path)
        with source:
            materialize(source)
    line = str(e.value)
    assert "\n" not in line and len(line) < 600, line
    for w in words:
        assert w in line, line
    return line


def init_from(tmp_path, corpus, weights):
    run = tmp_path / "run"
    args = [f"run_dir={run}", f"data.corpus=[{corpus}]", "train.ctx_len=32", "train.micro_batch=4"]
    return runner.invoke(app, ["init", *args, "--from", str(weights)]), run


@pytest.fixture
def tiny(tmp_path):
    return write_tiny(tmp_path / "model.safetensors")


def _first(header):
    return next(k for k in header if k != "__metadata__")


# -- safetensors headers -------------------------------------------------------------------------


def _entry_a_list(h):
    h[_first(h)] = [1, 2]
    return h


def _offsets(value):
    def edit(h):
        h[_first(h)]["data_offsets"] = value
        return h

    return edit


def _meta(value):
    def edit(h):
        h["__metadata__"] = value
        return h

    return edit


def _negative_absolute(h):
    name = _first(h)
    b, e = h[name]["data_offsets"]
    h[name]["data_offsets"] = [b - 10**6, e - 10**6]  # before the file's first byte
    return h


TRACEBACKS = {  # (edit, words the refusal names); each raised AttributeError, TypeError or ValueError
    "an entry that is a list": (_entry_a_list, ["is a list, not an object"]),
    "__metadata__ a list": (_meta([1]), ["__metadata__ is a list"]),
    "__metadata__ a string": (_meta("x"), ["__metadata__ is 'x'"]),
    "data_offsets an int": (_offsets(4), ["data_offsets is 4"]),
    "data_offsets strings": (_offsets(["0", "4"]), ["data_offsets is a list"]),
    "a negative absolute offset": (_negative_absolute, ["data_offsets is"]),
}


@pytest.mark.parametrize("case", TRACEBACKS)
def test_a_malformed_safetensors_header_is_one_line(case, tiny):
    edit, words = TRACEBACKS[case]
    forge(tiny, edit)
    refused(tiny, str(tiny), *words)


def _ranges(h):
    return {k: v["data_offsets"] for k, v in h.items() if k != "__metadata__"}


def test_duplicate_tensor_names_are_refused(tiny):
    """safetensors keeps the last of two entries of one name silently: two readers could read two tensors."""
    header, data = split(tiny)
    text = json.dumps(header)
    entry = json.dumps(header["ln_out.bias"])
    forged = text[:-1] + f', "ln_out.weight": {entry}}}'  # ln_out.weight again, on ln_out.bias's bytes
    tiny.write_bytes(join(forged, data))
    refused(tiny, str(tiny), "'ln_out.weight' twice")


def test_a_negative_offset_inside_the_file_is_refused(tiny):
    """[-256, 0] of the data is the header's last 256 bytes: read as weights before."""
    header, data = split(tiny)
    r = _ranges(header)["ln_out.bias"]
    header["ln_out.bias"]["data_offsets"] = [-(r[1] - r[0]), 0]
    tiny.write_bytes(join(header, data))
    refused(tiny, str(tiny), "'ln_out.bias'", "data_offsets is [-")


def test_overlapping_data_ranges_are_refused(tiny):
    """The last tensor moved 4 bytes back into the one before it (and the file 4 bytes shorter)."""
    header, data = split(tiny)
    last = max(_ranges(header), key=lambda k: _ranges(header)[k])
    header[last]["data_offsets"] = [x - 4 for x in header[last]["data_offsets"]]
    tiny.write_bytes(join(header, data[:-4]))
    refused(tiny, str(tiny), f"tensor '{last}'", "overlaps the tensor before it", "must be contiguous")


def test_a_gap_and_trailing_bytes_are_refused(tiny):
    header, data = split(tiny)
    for name in header:
        if name != "__metadata__":
            header[name]["data_offsets"] = [x + 4 for x in header[name]["data_offsets"]]
    tiny.write_bytes(join(header, b"\0" * 4 + data))
    refused(tiny, str(tiny), "gap of 4 bytes")
    header, data = split(write_tiny(tiny))
    tiny.write_bytes(join(header, data + b"\0\0"))
    refused(tiny, str(tiny), "2 bytes after")


def test_fp16_and_fp64_read_as_safetensors_reads_them_and_what_fp32_cannot_hold_is_refused(tmp_path):
    """fp16 / fp64 tensors: the values safe_open gives, cast into the model's fp32; an fp64 value past
    fp32's range is refused (it loaded as inf before), and an integer tensor is not a weight."""
    from rwkvx_cli.models import build_model

    state = tiny_state()
    for dtype in (torch.float16, torch.float64):
        path = tmp_path / f"{dtype}.safetensors"
        save_file({k: v.to(dtype).contiguous() for k, v in state.items()}, path)
        source, _ = open_any(path)
        with source, safe_open(path, "pt") as theirs:
            for name in source.names():
                assert source.dtype(name) == dtype and torch.equal(source.get(name), theirs.get_tensor(name)), name
            weights = materialize(source)
        model = build_model(TINY, 1)
        load_into(model, weights, str(path))
        assert torch.equal(model.state_dict()["emb.weight"], weights["emb.weight"].float())
    huge = {k: v.double() for k, v in state.items()}
    huge["emb.weight"][3, 5] = 1e300
    save_file(huge, tmp_path / "huge.safetensors")
    with pytest.raises(CheckpointError, match="emb.weight holds values too large for the model's float32"):
        load_into(build_model(TINY, 1), materialize(open_any(tmp_path / "huge.safetensors")[0]), "huge")
    ints = {k: (v * 100).long() if k == "emb.weight" else v for k, v in state.items()}
    with pytest.raises(CheckpointError, match="emb.weight is int64, not floating point"):
        load_into(build_model(TINY, 1), ints, "ints")


def test_a_forged_header_is_one_line_through_init_from_and_nothing_is_written(tiny, tmp_path, corpus):
    forge(tiny, _offsets(["0", "4"]))
    result, run = init_from(tmp_path, corpus, tiny)
    line = one_line_error(result, 1)
    assert str(tiny) in line and "data_offsets" in line
    assert not run.exists()
    header, data = split(write_tiny(tiny))
    header["emb.weight"] = header["emb.weight"] | {"dtype": "F64"}  # the bytes no longer fit the shape
    tiny.write_bytes(join(header, data))
    result, run = init_from(tmp_path, corpus, tiny)
    assert "'emb.weight'" in one_line_error(result, 1) and not run.exists()


def test_fp64_past_fp32_through_init_from_is_one_line(tmp_path, corpus):
    huge = {k: v.double() for k, v in tiny_state().items()}
    huge["emb.weight"][0, 0] = -1e300
    save_file(huge, tmp_path / "huge.safetensors")
    result, run = init_from(tmp_path, corpus, tmp_path / "huge.safetensors")
    assert "emb.weight holds values too large" in one_line_error(result, 1) and not run.exists()


# -- HF config.json and the shard index ----------------------------------------------------------


@pytest.fixture
def hf(tmp_path):
    out = tmp_path / "hf"
    export_hf(tiny_state(), out, max_shard_bytes=200_000)  # sharded: model.safetensors.index.json
    assert (out / "model.safetensors.index.json").is_file()
    return out


def _config(path, **edit):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(edit)
    (path / "config.json").write_text(json.dumps(cfg))




@pytest.mark.parametrize(
    "edit,words",
    [
        ({"head_dim": "64"}, ["head_dim is '64'"]),
        ({"head_dim": None, "num_heads": "1"}, ["num_heads is '1'"]),
        ({"intermediate_size": None, "hidden_ratio": [4]}, ["hidden_ratio is a list"]),
        ({"norm_eps": "1e-5"}, ["norm_eps is '1e-5'"]),
        ({"norm_eps": "tiny"}, ["norm_eps is 'tiny'"]),
        ({"norm_eps": [1e-5]}, ["norm_eps is a list"]),
        ({"norm_eps": None}, ["norm_eps is null"]),
        ({"norm_first": "yes"}, ["norm_first is 'yes'"]),
        ({"tie_word_embeddings": 1}, ["tie_word_embeddings is 1"]),
        ({"hidden_size": 64.0}, ["hidden_size is 64.0"]),
        ({"decay_low_rank_dim": -32}, ["decay_low_rank_dim is -32"]),
    ],
)
def test_a_malformed_hf_config_is_one_line(edit, words, hf):
    _config(hf, **edit)
    refused(hf, str(hf / "config.json"), *words)


@pytest.mark.parametrize("key", ["model_type", "value_dim", "norm_eps", "head_dim"])
@pytest.mark.parametrize("depth", [800, 50_000])
def test_hf_config_nested_deep_is_one_line(key, depth, hf):
    """Past Python's stack the parse fails; just under it the value parses, and printing it in an error
    (its repr) recursed past the stack."""
    cfg = json.loads((hf / "config.json").read_text())
    cfg[key] = "DEEP"
    (hf / "config.json").write_text(json.dumps(cfg).replace('"DEEP"', "[" * depth + "]" * depth))
    line = refused(hf, str(hf / "config.json"))
    assert f"{key} is a list" in line or f"{key} a list" in line or "nested too deeply" in line, line


def test_hf_config_duplicate_keys_are_refused(hf):
    (hf / "config.json").write_text('{"model_type": "rwkv7", "model_type": "rwkv6"}')
    refused(hf, "config.json", "'model_type' twice")


@pytest.mark.parametrize(
    "weight_map,words",
    [
        ({}, ["weight_map is empty"]),
        ({"model.embeddings.weight": 1}, ["is 1, not a shard file name"]),
        ({"model.embeddings.weight": None}, ["is null, not a shard file name"]),
        ({"model.embeddings.weight": "../model.safetensors"}, ["not a file in"]),
        ([], ["weight_map is a list"]),
    ],
)
def test_a_malformed_shard_index_is_one_line(weight_map, words, hf):
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    refused(hf, "model.safetensors.index.json", *words)


def test_an_index_that_lists_some_tensors_reads_every_tensor_of_its_shards(hf):
    """transformers loads every tensor of every shard the map names: so does rwkvx; but an entry the
    named shard does not hold is a damaged index."""
    index = hf / "model.safetensors.index.json"
    full = json.loads(index.read_text())
    whole, _ = open_any(hf)
    with whole:
        everything = materialize(whole)
    shards = sorted(set(full["weight_map"].values()))
    some = {}
    for shard in shards:  # one tensor of each shard
        some[next(k for k, v in full["weight_map"].items() if v == shard)] = shard
    index.write_text(json.dumps({"weight_map": some}))
    source, sizes = open_any(hf)
    with source:
        got = materialize(source)
    assert got.keys() == everything.keys() and all(torch.equal(got[k], everything[k]) for k in got)
    assert (sizes.n_layer, sizes.n_embd) == (1, 64)
    name = next(iter(some))
    wrong = next(s for s in shards if s != some[name])
    index.write_text(json.dumps({"weight_map": {**some, name: wrong}}))
    refused(hf, str(index), f"says '{wrong}', but that shard has no such tensor")


def test_an_hf_directory_without_config_json_takes_fla_defaults(tmp_path):
    """Sizes from the tensors; the group norm's eps is fla's: head_dim x its default norm_eps 1e-5."""
    cfg = ModelConfig(vocab_size=257, n_layer=1, n_embd=64, head_size=32, ln_x_eps=32e-5)
    export_hf(tiny_state(cfg), tmp_path / "hf", cfg=cfg)
    (tmp_path / "hf" / "config.json").unlink()
    source, sizes = open_any(tmp_path / "hf")
    source.close()
    assert (sizes.layout, sizes.head_size, sizes.n_embd) == ("hf", 32, 64)
    assert sizes.ln_x_eps == pytest.approx(32e-5, rel=1e-12)


def test_an_hf_export_never_follows_or_empties_what_is_planted_beside_its_output(tmp_path):
    """The directory an HF export fills before its rename is made new under an unpredictable name: a
    link planted at the name it once used (`.<out>.tmp<pid>`) is neither followed nor in the way."""
    import os

    cfg = ModelConfig(vocab_size=257, n_layer=1, n_embd=64, head_size=32, ln_x_eps=32e-5)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_text("mine\n")
    (tmp_path / f".hf.tmp{os.getpid()}").symlink_to(mine)
    export_hf(tiny_state(cfg), tmp_path / "hf", cfg=cfg)
    assert (tmp_path / "hf" / "config.json").is_file()
    assert [p.name for p in mine.iterdir()] == ["keep.txt"] and (mine / "keep.txt").read_text() == "mine\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".hf.tmp{os.getpid()}", "hf", "mine"]


def test_a_config_with_auto_map_never_runs_the_directory_s_code(hf, tmp_path, corpus):
    """auto_map names remote code: rwkvx reads config.json's fields and the tensors, never imports a file."""
    marker = tmp_path / "ran"
    (hf / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    _config(hf, auto_map={"AutoModelForCausalLM": "modeling_evil.Evil", "AutoConfig": "modeling_evil.Cfg"})
    result, run = init_from(tmp_path, corpus, hf)
    assert result.exit_code == 0, result.output
    assert not marker.exists() and "auto_map" in result.output and "never run" in result.output


# -- the tokenizer -------------------------------------------------------------------------------


@pytest.fixture
def bpe_run(tmp_path, corpus):
    """An rwkvx checkpoint of a model trained with a BPE tokenizer (300 tokens), its tokenizer.json in
    the run directory, and its HF export (the same tokenizer.json beside the weights)."""
    from rwkvx_cli.checkpoints.full import save_checkpoint
    from rwkvx_cli.config import Config, DataConfig, config_to_dict
    from rwkvx_cli.data.tokenizer import BPETokenizer
    from rwkvx_cli.models import build_model

    model_cfg = ModelConfig(vocab_size=300, n_layer=1, n_embd=64, head_size=64)
    cfg = Config(model=model_cfg, data=DataConfig(tokenizer="bpe"))
    run = tmp_path / "bpe-run"
    model = build_model(cfg.model, 0)
    save_checkpoint(run / "checkpoints", 1, model, None, {"config": config_to_dict(cfg)}, 3)
    tokenizer = BPETokenizer.train(corpus.read_text().splitlines(), 300)
    tokenizer.save(run / "tokenizer.json")
    export_hf(model.state_dict(), tmp_path / "bpe-hf", cfg=cfg.model, tokenizer=tokenizer)
    return run, tmp_path / "bpe-hf"


def test_a_bpe_model_given_to_a_byte_run_is_refused(bpe_run, tmp_path, corpus):
    """Its 300 embedding rows are BPE tokens; a byte run would read rows 1..256 as bytes."""
    for source in bpe_run:
        result, run = init_from(tmp_path, corpus, source)
        line = one_line_error(result, 1)
        assert f"train.init_from {source}" in line and "data.tokenizer is byte" in line, line
        assert "every embedding row would mean another token" in line and not run.exists()


def test_the_weights_own_tokenizer_file_is_accepted_and_a_pth_is_noted(bpe_run, tmp_path, corpus):
    run_dir, hf = bpe_run
    run = tmp_path / "run"
    args = [f"run_dir={run}", f"data.corpus=[{corpus}]", "train.ctx_len=32", "train.micro_batch=4"]
    own = f"data.tokenizer={run_dir / 'tokenizer.json'}"
    result = runner.invoke(app, ["init", *args, own, "--from", str(hf)])
    assert result.exit_code == 0, result.output
    pth = tmp_path / "model.pth"
    torch.save(tiny_state(), pth)
    result, run = init_from(tmp_path / "again", corpus, pth)
    assert result.exit_code == 0, result.output
    assert "the weights name no tokenizer" in result.output and "data.tokenizer: byte" in result.output


def test_a_huge_block_number_and_a_sparse_pth_are_one_line(tmp_path):
    """blocks.<10^12> once built a range to its number to list the gaps; a sparse tensor (weights_only
    unpickles one) is no weight."""
    state = tiny_state()
    state["blocks.1000000000000.ln1.weight"] = state["blocks.0.ln1.weight"].clone()
    save_file(state, tmp_path / "huge.safetensors")
    refused(tmp_path / "huge.safetensors", "the blocks are not numbered 0..n-1 (missing 1)")
    state = tiny_state()
    state["emb.weight"] = state["emb.weight"].to_sparse()
    torch.save(state, tmp_path / "sparse.pth")
    refused(tmp_path / "sparse.pth", str(tmp_path / "sparse.pth"), "'emb.weight' is not a plain dense tensor")


@pytest.mark.parametrize("shape", [[257 * 64], [1, 257 * 64], [257, 64, 1]])
def test_a_reshaped_hf_embedding_is_one_line(shape, tmp_path):
    """The same bytes under another shape: a 1-D embedding once indexed its missing second size."""
    export_hf(tiny_state(), tmp_path / "hf")
    emb = "model.embeddings.weight"
    forge(tmp_path / "hf" / "model.safetensors", lambda h: h | {emb: {**h[emb], "shape": shape}})
    refused(tmp_path / "hf")
