"""bench/tls_bench.py without running a stack (the benchmark itself: `python -m bench.tls_bench`). < 1 s."""

from __future__ import annotations

import pytest

from bench import tls_bench


def test_options_are_checked():
    with pytest.raises(SystemExit) as e:
        tls_bench.main(["--rounds", "0"])
    assert e.value.code == 2


def test_up_command_lines(tmp_path):
    plain = tls_bench.UpProcess(tmp_path / "p", None, None, False)
    tls = tls_bench.UpProcess(tmp_path / "t", "/m.gguf", "tiny", True)
    assert plain.argv[3:5] == ["up", "--state-dir"] and "--tls" not in plain.argv and "--model-file" not in plain.argv
    assert tls.argv[-1] == "--tls" and tls.argv[tls.argv.index("--model-file") + 1] == "/m.gguf"
