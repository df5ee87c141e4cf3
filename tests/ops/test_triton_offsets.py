"""The Triton kernels' 64-bit offsets (issue 13): the largest buffers a 1.5B model at ctx 4096
passes overflow int32, so every kernel widens its base offsets to int64 and each wrapper
refuses, with a one-line ValueError, a size it still cannot index.

Cheap by design: the offset arithmetic is checked on the dims alone, the refusal on stride-0
views (no memory), and the int64 address arithmetic on two kernels' TTIR compiled ahead of
time for sm_90 (no GPU)."""

import re

import pytest
import torch

triton = pytest.importorskip("triton")

from rwkvx_cli.ops._triton import I32_LIMIT, I64_LIMIT, check_offsets, max_offset  # noqa: E402
from rwkvx_cli.ops.delta import fused_triton as delta_ft  # noqa: E402
from rwkvx_cli.ops.rwkv8 import fused_triton as rwkv8_ft  # noqa: E402
from rwkvx_cli.ops.wkv4 import fused_triton as wkv4_ft  # noqa: E402
from rwkvx_cli.ops.wkv7 import chunked_triton as wkv7_ct  # noqa: E402
from rwkvx_cli.ops.wkv7 import fused_triton as wkv7_ft  # noqa: E402

# One worker runs this module (`make test`: xdist --dist loadgroup), so its module fixture `ttir`
# (the kernels compiled to TTIR in a subprocess) is built once, not on each worker taking a test.
pytestmark = pytest.mark.xdist_group("triton-offsets")

# The largest launches of a 1.5B-class model at ctx 4096 (B, T, H, N).
PRODUCTION = [(32, 4096, 32, 128), (64, 4096, 64, 64), (64, 4096, 32, 128)]


def test_max_offset():
    assert max_offset((32, 32, 256, 128, 128)) == 2**32 - 1
    assert max_offset(()) == 0
    assert max_offset((0, 5)) == 0


@pytest.mark.parametrize("dims", PRODUCTION)
@pytest.mark.parametrize("module", [wkv7_ft, wkv7_ct, delta_ft], ids=["wkv7", "wkv7_chunked", "gdn_kda"])
def test_state_kernels_need_and_get_int64(module, dims):
    offsets = module.index_offsets(*dims)
    # the case that overflowed: the snapshot buffer passes int32 at these sizes ...
    assert offsets["state snapshots"] >= I32_LIMIT
    # ... and every buffer fits the int64 the kernels now index with
    assert max(offsets.values()) < I64_LIMIT


@pytest.mark.parametrize("E", [2048, 4096, 8192])
def test_rwkv8_shared_value_head_offsets(E):
    # the shared value head: E = the model width; L = 64 latent rows per head
    offsets = rwkv8_ft.index_offsets(32, 4096, 32, 64, E)
    assert offsets["state snapshots"] >= I32_LIMIT
    assert max(offsets.values()) < I64_LIMIT


def test_wkv4_channels_offsets():
    offsets = wkv4_ft.index_offsets(128, 4096, 8192)  # B, T, C: k, v, y pass int32
    assert offsets["k, v, y"] >= I32_LIMIT
    assert max(offsets.values()) < I64_LIMIT


def test_check_offsets_refuses_in_one_line():
    with pytest.raises(ValueError, match="int64") as e:
        check_offsets("k", {"snapshots": (2**32, 2**32)})
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="int32"):
        check_offsets("k", {"x": (4,)}, tile=I32_LIMIT)


def _huge(*shape):
    return torch.zeros(()).expand(*shape)  # stride 0: no memory


# No torch tensor has 2^63 elements, so the int64 refusal is reached here by lowering the
# limit: it proves each wrapper checks before copying, allocating or launching anything.
def _production_inputs(B=32, T=4096, H=32, N=128):
    x = _huge(B, T, H, N)
    return B, T, H, N, x


def test_wrappers_check_before_launching(monkeypatch):
    import rwkvx_cli.ops._triton as tr

    monkeypatch.setattr(tr, "I64_LIMIT", 2**31)  # what the kernels indexed before (int32)
    B, T, H, N, x = _production_inputs()
    for fn in (wkv7_ft.wkv7_triton, wkv7_ct.wkv7_triton_chunked):
        with pytest.raises(ValueError, match="state snapshots"):
            fn(x, x, x, x, x, x, _huge(B, H, N, N))
    with pytest.raises(ValueError, match="state snapshots"):
        delta_ft.delta_triton(x, x, x, _huge(B, T, H, 1), _huge(B, T, H), _huge(B, H, N, N), 1.0)
    with pytest.raises(ValueError, match="k, v, y"):
        x4 = _huge(128, T, 64, 128)
        wkv4_ft.wkv4_triton(_huge(64, 128), _huge(64, 128), x4, x4, (_huge(128, 64, 128),) * 3)
    with pytest.raises(ValueError, match="state snapshots"):
        q = _huge(B, T, H, 64)
        rwkv8_ft.rwkv8_triton(q, _huge(B, T, 1, 4096), _huge(H, 64), (_huge(B, H, 64, 4096), _huge(B, H, 64)))


def test_rwkv8_refuses_a_value_width_its_tile_cannot_index():
    # the per-program tile offsets stay int32: the state tile's L * E reaches 2^31 at L = 32, E = 2^26
    q, E = _huge(1, 16, 1, 32), 2**26
    with pytest.raises(ValueError, match="int32"):
        rwkv8_ft.rwkv8_triton(q, _huge(1, 16, 1, E), _huge(1, 32), (_huge(1, 1, 32, E), _huge(1, 1, 32)))


def test_chunked_refuses_a_grid_cuda_cannot_launch():
    B, T, H, N = 2**9, 16, 2**8, 16  # B * H = 2^17 > 65535 on the grid's y axis
    x = _huge(B, T, H, N)
    with pytest.raises(ValueError, match="grid"):
        wkv7_ct.wkv7_triton_chunked(x, x, x, x, x, x, _huge(B, H, N, N))


# Compiled in a child process: the suite runs with TRITON_INTERPRET=1, under which a kernel
# is an interpreted function the compiler cannot take.
_COMPILE = """
import json, sys
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from rwkvx_cli.ops.wkv4 import fused_triton as wkv4
from rwkvx_cli.ops.wkv7 import fused_triton as wkv7

def ttir(kernel, pointers, ints, constexprs):
    sig = {**dict.fromkeys(pointers.split(), "*fp32"), **dict.fromkeys(ints.split(), "i32")}
    sig |= dict.fromkeys(constexprs, "constexpr")
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ttir"]

out = {
    "wkv7": ttir(wkv7._fwd_kernel, "r w k v a b s0 y s_out snaps", "T H NC",
                 {"N": 64, "BK": 64, "BV": 32, "CHUNK": 16, "DT": tl.float32}),
    "wkv4": ttir(wkv4._fwd_kernel, "w u k v aa0 bb0 pp0 starts y aaT bbT ppT snaps", "T C NC",
                 {"BC": 64, "CHUNK": 16, "HAS_STARTS": True, "DT": tl.float32}),
}
json.dump(out, open(sys.argv[1], "w"))
"""


@pytest.fixture(scope="module")
def ttir(tmp_path_factory):
    import json
    import os
    import subprocess
    import sys

    path = tmp_path_factory.mktemp("ttir") / "ttir.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE, str(path)], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(path.read_text())


def _base_is_i64(ttir: str, ptr: str) -> bool:
    """The scalar base offset added to pointer argument `ptr` is an i64."""
    adds = re.findall(rf"tt\.addptr %{ptr}, %\S+ : !tt\.ptr<f32>, (i\d+)", ttir)
    return bool(adds) and all(w == "i64" for w in adds)


def test_wkv7_fwd_snapshot_base_is_int64(ttir):
    for ptr in ("snaps", "s0", "s_out", "r", "y"):
        assert _base_is_i64(ttir["wkv7"], ptr), ptr


def test_wkv4_fwd_channel_base_is_int64(ttir):
    assert _base_is_i64(ttir["wkv4"], "snaps")
    # k's offsets (b * T + t) * C + cols are one tensor: it must be i64
    assert re.search(r"tt\.addptr %kt\S*, %base\S* : tensor<64x!tt\.ptr<f32>>, tensor<64xi64>", ttir["wkv4"])
