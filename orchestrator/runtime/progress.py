"""Progress bars for work a person sits and waits for (the default model's first conversion,
`weir replay`): tqdm on stderr, and nothing at all when stderr is not a terminal, so logs,
pipes, CI and tests stay quiet."""

from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm


def progress_bar(total: int | None, desc: str, unit: str) -> tqdm[Any]:
    # sys.stderr is looked up per call, so a redirected stderr is the one asked; disable=None
    # is tqdm's "off unless the file is a TTY".
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=None, dynamic_ncols=True)
