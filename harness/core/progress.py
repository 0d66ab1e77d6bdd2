"""Progress bars for every long step: live on a terminal, a line every 10 s in logs and CI."""

from __future__ import annotations

import sys
from typing import Iterable, TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")


def progress(iterable: Iterable[T], desc: str, unit: str = "it", total: int | None = None
             ) -> Iterable[T]:
    interactive = sys.stderr.isatty()
    return tqdm(iterable, desc=desc, unit=unit, total=total, mininterval=0.5 if interactive else 10.0,
                dynamic_ncols=True, leave=interactive)
