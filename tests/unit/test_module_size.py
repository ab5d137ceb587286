"""Module size follows concepts (issue [19] item 4; C++ sources and tests aside): one concept per module.
A module longer than 500 lines draws a warning (is it still one concept?); one longer than 800 lines fails
(it holds more than one: move a concept out, never cut one in two to meet a number)."""

from __future__ import annotations

import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("actors", "bus", "control", "gateway", "bench")
WARN_LINES = 500  # above: a warning naming the module
MAX_LINES = 800  # above: the test fails


def line_count(path: Path) -> int:
    """Lines of a text file (a last line without a newline counts)."""
    return len(path.read_text().splitlines())


def modules(root: Path = ROOT) -> list[Path]:
    """Every non-test ``.py`` file under the project's packages."""
    out = []
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if not any(p == "tests" or p.startswith("test_") for p in parts):
                out.append(path)
    return out


def oversized(paths: list[Path], root: Path = ROOT, limit: int = MAX_LINES) -> dict[str, int]:
    """``{path relative to root: lines}`` of the files longer than ``limit`` lines."""
    counts = {str(p.relative_to(root)): line_count(p) for p in paths}
    return {p: n for p, n in counts.items() if n > limit}


def _listing(sizes: dict[str, int]) -> str:
    return ", ".join(f"{p} ({n})" for p, n in sorted(sizes.items(), key=lambda kv: -kv[1]))


def test_no_module_is_over_800_lines_and_long_ones_warn():
    paths = modules()
    assert len(paths) > 50 and ROOT / "control" / "ops" / "supervisor.py" in paths
    too_long = oversized(paths)
    assert not too_long, f"modules over {MAX_LINES} lines (move a concept out): " + _listing(too_long)
    long = oversized(paths, limit=WARN_LINES)
    if long:
        warnings.warn(f"modules over {WARN_LINES} lines (one concept each?): " + _listing(long), stacklevel=1)


def test_the_check_sees_a_long_module(tmp_path):
    (tmp_path / "bus").mkdir()
    (tmp_path / "bus" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "bus" / "ok.py").write_text("x = 1\n" * MAX_LINES)
    (tmp_path / "bus" / "longish.py").write_text("x = 1\n" * (WARN_LINES + 1))
    (tmp_path / "bus" / "test_long.py").write_text("x = 1\n" * (MAX_LINES + 1))  # tests aside
    paths = modules(tmp_path)
    assert [p.name for p in paths] == ["long.py", "longish.py", "ok.py"]
    assert oversized(paths, tmp_path) == {"bus/long.py": MAX_LINES + 1}
    assert oversized(paths, tmp_path, WARN_LINES) == {"bus/long.py": MAX_LINES + 1, "bus/longish.py": WARN_LINES + 1,
                                                      "bus/ok.py": MAX_LINES}
