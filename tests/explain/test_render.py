"""An ExplainResult rendered: the terminal table, JSON, the self-contained HTML page and the PNG."""

import json
import re

import pytest
from rich.console import Console

from rwkvx_cli.explain import ExplainResult, LayerRelevance
from rwkvx_cli.explain.render import relevance_table, to_html, write_html, write_json, write_png


@pytest.fixture
def result():
    return ExplainResult(
        text="a<b\nc",
        tokens=["a", "<", "b", "\n", "c"],
        token_ids=[98, 61, 99, 11, 100],
        target_id=101,
        target_token="d",
        position=4,
        logit=2.5,
        probability=0.25,
        epsilon=0.0,
        relevance=[1.0, -0.5, 0.25, 0.0, 0.5],
        bias=0.75,
        absorbed=0.0,
        layers=[LayerRelevance(0, "rwkv7", [0.1, -0.2, 0.3, 0.0, 0.4], None, 1.0)],
        checkpoint="runs/x/checkpoints/step_00000010",
        step=10,
    )


def test_table(result):
    console = Console(width=200, record=True)
    console.print(relevance_table(result))
    text = console.export_text()
    assert "'d'" in text and "+1.0000" in text and "-0.5000" in text and "b0 rwkv7" in text
    assert "44.4%" in text  # 1.0 of Σ|R| = 2.25
    assert "logit 2.5000 = tokens 1.2500 + norm biases 0.7500" in text
    assert "'\\n'" in text  # tokens shown as repr: a newline cannot break the table


def test_json(result, tmp_path):
    write_json(result, tmp_path / "r.json")
    back = json.loads((tmp_path / "r.json").read_text())
    assert back["relevance"] == result.relevance and back["layers"][0]["kind"] == "rwkv7"
    assert ExplainResult(**{**back, "layers": [LayerRelevance(**x) for x in back["layers"]]}) == result


def test_html(result, tmp_path):
    page = to_html(result)
    assert page.startswith("<!doctype html>") and page.rstrip().endswith("</html>")
    assert not re.search(r"(src|href)\s*=|https?://|<script|@import|url\(", page)  # self-contained
    spans = re.findall(
        r'<span style="background:rgba\((\d+),(\d+),(\d+),([\d.]+)\)" title="[^"]*">([^<]*)</span>', page
    )
    assert [s[4] for s in spans] == ["a", "&lt;", "b", "↵\n", "c"]  # escaped; newline shown and kept
    assert spans[0][:4] == ("214", "39", "40", "0.850")  # the largest positive: full red
    assert spans[1][:3] == ("31", "119", "180") and float(spans[1][3]) == pytest.approx(0.425)  # blue, half
    assert float(spans[3][3]) == 0.0
    assert "after block 0 (rwkv7)" in page and "runs/x/checkpoints/step_00000010 (step 10)" in page
    write_html(result, tmp_path / "r.html")
    assert (tmp_path / "r.html").read_text(encoding="utf-8") == page


def test_png(result, tmp_path):
    write_png(result, tmp_path / "out" / "r.png")
    data = (tmp_path / "out" / "r.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000
