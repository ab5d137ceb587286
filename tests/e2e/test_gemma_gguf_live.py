"""Issue [22]: tiny Gemma 2 and Gemma 3 GGUF files (our writer, tests/family_models.py) registered live
through ``actorserve models register`` beside the default model, answering chat through the official ``openai``
client past the sliding window; ``actorserve status`` names them and does not say their soft-cap misses the
native kernel (their decode attention runs it)."""

from __future__ import annotations

import pytest

from tests.e2e.helpers import build_long, chat_full_and_streamed, register_all, tiny_deployment, until_served
from tests.e2e.test_byom_live import WORKER_ARGS

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow]
PROMPT = "Tell me a long story about a red fox, a blue bird and a green frog who walk to the sea together."


def test_gemma_ggufs_registered_live_answer(tmp_path, tiny_gguf):
    from tests import family_models as fm
    from tests.e2e.test_registry_live import cli

    models = {n: build_long(fm.GEMMA_GGUF_VARIANTS, fm.build, n, tmp_path, seed=5)["gguf"]
              for n in ("gemma2-gguf", "gemma3-gguf")}
    with tiny_deployment(tmp_path / "state", tiny_gguf, WORKER_ARGS) as sup:
        client = register_all(sup, tmp_path, models)
        for name in models:
            until_served(client, name)
            full = chat_full_and_streamed(client, name, [{"role": "user", "content": PROMPT}], 24)
            assert full.usage.prompt_tokens > fm.WINDOW, full.usage
        st = cli(sup, "status")
        print(st.stdout, st.stderr)
        assert st.returncode == 0, st.stderr
        for name in models:
            assert name in st.stdout, st.stdout
        # the decode attention (soft-cap, windows) runs the native kernel: status must not say the cap is not there
        assert "soft-capping and per-layer windows are not in the native kernels" not in st.stdout, st.stdout
        assert "decode attention" in st.stdout, st.stdout

