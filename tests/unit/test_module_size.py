"""No non-test Python module of the project is longer than 500 lines (issue 14 item 5; C++ sources and
tests aside): a module that grows past it is split along a real seam."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("actors", "bus", "control", "gateway", "bench")
MAX_LINES = 500


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


def test_every_module_is_at_most_500_lines():
    paths = modules()
    assert len(paths) > 50 and ROOT / "control" / "ops" / "supervisor.py" in paths
    too_long = oversized(paths)
    assert not too_long, f"modules over {MAX_LINES} lines (split them): " + ", ".join(
        f"{p} ({n})" for p, n in sorted(too_long.items(), key=lambda kv: -kv[1]))


def test_the_check_sees_a_long_module(tmp_path):
    (tmp_path / "bus").mkdir()
    (tmp_path / "bus" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "bus" / "ok.py").write_text("x = 1\n" * MAX_LINES)
    (tmp_path / "bus" / "test_long.py").write_text("x = 1\n" * (MAX_LINES + 1))  # tests aside
    paths = modules(tmp_path)
    assert [p.name for p in paths] == ["long.py", "ok.py"]
    assert oversized(paths, tmp_path) == {"bus/long.py": MAX_LINES + 1}
