"""Native kernels: build failures are reported, and `auto` falls back with a warning."""

import warnings
from dataclasses import replace

import pytest
import torch

from rwkvx_cli import native as _native
from rwkvx_cli.ops import get_op, registry
from rwkvx_cli.ops.registry import resolve_backend


def test_missing_compiler_is_a_build_error(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("RWKVX_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "k.cpp"
    source.write_text('extern "C" int one() { return 1; }\n')
    with pytest.raises(_native.NativeBuildError, match="cannot run the compiler"):
        _native.load_library(source)
    with pytest.raises(_native.NativeBuildError):  # remembered, not retried
        _native.load_library(source)


def test_compile_error_names_the_file(monkeypatch, tmp_path):
    monkeypatch.setenv("RWKVX_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "broken.cpp"
    source.write_text("this is not C++\n")
    with pytest.raises(_native.NativeBuildError, match="compiling broken.cpp failed"):
        _native.load_library(source)
    assert not list((tmp_path / "cache" / "native").glob("*.so"))  # nothing half-written is left


def test_builds_once_and_caches(monkeypatch, tmp_path):
    monkeypatch.setenv("RWKVX_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "ok.cpp"
    source.write_text('extern "C" int answer() { return 42; }\n')
    assert _native.load_library(source).answer() == 42
    assert len(list((tmp_path / "cache" / "native").glob("ok-*.so"))) == 1


def test_auto_falls_back_with_one_warning(monkeypatch):
    spec = get_op("wkv7")
    broken = replace(spec.backends["cpu"], unavailable=lambda: "no compiler here")
    monkeypatch.setitem(spec.backends, "cpu", broken)
    monkeypatch.setattr(registry, "_WARNED", set())
    with pytest.warns(RuntimeWarning, match="'cpu' backend is unavailable \\(no compiler here\\); using 'recurrent'"):
        assert resolve_backend(spec, "auto", torch.device("cpu")).name == "recurrent"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_backend(spec, "auto", torch.device("cpu")).name == "recurrent"  # warned once only
