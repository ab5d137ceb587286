"""What every ``actorserve bench ...`` entry shares: writing its ``--json`` report and running it as
``python -m bench.<name>``. No torch, no nats: cheap to import from the CLI."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence


def write_json(result: dict, path: str | None) -> None:
    """Write ``result`` to ``path`` (indented, keys sorted) and say so; nothing when ``path`` is empty.
    Raises OSError when the file cannot be written."""
    if not path:
        return
    with open(path, "w") as f:
        json.dump(result, f, indent=2, sort_keys=True)
    print(f"wrote {path}")


def standalone(prog: str, doc: str | None, add_arguments: Callable[[argparse.ArgumentParser], None],
               entry: Callable[[argparse.Namespace], int], argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` with the bench's own options (``add_arguments``) and run ``entry``; its exit status.
    ``doc``: the module docstring, whose first line is the description."""
    p = argparse.ArgumentParser(prog=prog, description=(doc or "").split("\n")[0])
    add_arguments(p)
    return entry(p.parse_args(argv))
