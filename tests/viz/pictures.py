"""Reading pictures back in tests."""

from __future__ import annotations

from pathlib import Path


def bands(path: Path, *, min_rows: int = 4, min_share: float = 0.2) -> list[tuple[int, int]]:
    """Horizontal bands of ``path``'s pixel rows that are largely coloured (boxes, not lines).

    A pixel is coloured when its channels differ by more than 20 (grey idle
    shading, text and white are not); a row is in a band when more than
    ``min_share`` of its pixels are; a band is at least ``min_rows`` rows tall.
    """
    import numpy as np
    from PIL import Image

    with Image.open(path) as image:
        rgb = np.asarray(image.convert("RGB"), dtype=np.int16)
    coloured = rgb.max(axis=2) - rgb.min(axis=2) > 20
    rows = (coloured.mean(axis=1) > min_share).tolist()
    found, start = [], None
    for y, on in enumerate([*rows, False]):
        if on and start is None:
            start = y
        elif not on and start is not None:
            if y - start >= min_rows:
                found.append((start, y))
            start = None
    return found
