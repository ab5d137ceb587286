"""Entry of a tensor-parallel follower rank (actors/worker/engine/tp_group.py; docs/tensor-parallel.md):

    python -m actors.worker.tp_rank '<EngineConfig JSON with tp_rank and tp_init>'

Started by rank 0's engine, never by hand: it builds this rank's shard of the model and KV cache, then runs every
forward pass rank 0 broadcasts until told to stop (exit 0) or until rank 0 is gone (exit 0 as well: rank 0's
worker reports the loss)."""

from __future__ import annotations

import json
import logging
import os
import sys


def main(argv: list[str]) -> int:
    """Build the rank's engine from the JSON config in ``argv[0]`` and follow rank 0; the exit status."""
    import torch.distributed as dist

    from actors.worker.engine.engine import EngineConfig, LLMEngine
    from actors.worker.engine.tp_group import follow

    logging.basicConfig(level=logging.INFO, format="%(asctime)s tp-rank %(process)d %(levelname)s %(message)s")
    engine = LLMEngine(EngineConfig(**json.loads(argv[0])))
    try:
        follow(engine)
    except RuntimeError as e:  # rank 0 gone: its end of every connection closed
        logging.getLogger(__name__).info("tensor-parallel rank %d: leader gone (%s); exiting", engine.tp.rank, e)
        os._exit(0)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
