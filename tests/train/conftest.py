import pytest


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    lines = [f"line {i}: the quick brown fox {i % 7} jumps over the lazy dog {i % 5}." for i in range(400)]
    path.write_text("\n".join(lines) + "\n")
    return path
