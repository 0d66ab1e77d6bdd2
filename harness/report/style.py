"""One colour and marker per method, the same in every figure of every report (and on W&B).

The methods shipped today have a fixed style (distinct colour x marker pairs, method families
in neighbouring hues); a method added later gets one derived from a hash of its name, so it too
keeps its style from report to report without an edit here. The reference (`full`) is black and
drawn on top.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

# Colour-blind-friendly qualitative colours (Tableau 10 + a darker ten), then markers.
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf", "#0b3d91", "#b35806", "#1b7837", "#8e0152",
           "#542788", "#5c3c10", "#c51b7d", "#35978f", "#7a7a00", "#01665e")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "h")
LINESTYLES = ("-", "--", ":", "-.")  # variants of one method, in the order they sort

# (colour index, marker index) of the methods shipped today; unique pairs.
_FIXED = {
    "h2o": (0, 0), "tova": (1, 1), "scissorhands": (2, 2), "keydiff": (3, 3),
    "snapkv": (4, 4), "pyramidkv": (5, 5), "kvmerger": (6, 6), "squeezeattention": (7, 7),
    "streaming_llm": (8, 8), "minicache": (9, 9), "kivi": (10, 0), "kvquant": (11, 1),
    "oracle_topk": (12, 2), "infinigen": (13, 3), "full_offload": (14, 4), "quest": (15, 5),
    "shadowkv": (16, 6), "duo_attention": (17, 7), "razor_attention": (18, 8),
    "tailorkv": (19, 9),
}


@dataclass(frozen=True)
class Style:
    colour: str
    marker: str
    reference: bool = False

    def kwargs(self) -> dict:
        """matplotlib keyword arguments for a line or points of this method."""
        if self.reference:
            return {"color": "black", "marker": "*", "markersize": 11, "linewidth": 2.4,
                    "zorder": 5}
        return {"color": self.colour, "marker": self.marker, "markersize": 6, "linewidth": 1.4,
                "zorder": 3}


def method_style(method: str, reference: str = "full") -> Style:
    if method == reference:
        return Style("#000000", "*", reference=True)
    if method in _FIXED:
        c, m = _FIXED[method]
    else:  # a pair no shipped method has, from the name alone
        digest = int.from_bytes(hashlib.sha256(method.encode()).digest()[:8], "big")
        c, m = _FREE[digest % len(_FREE)]
    return Style(COLOURS[c], MARKERS[m])


_FREE = [(c, m) for m in range(len(MARKERS)) for c in range(len(COLOURS))
         if (c, m) not in set(_FIXED.values())]


def variant_tags(rows: list[dict]) -> dict[tuple[str, str], str]:
    """(method, variant knobs) -> its legend label: the method's name, plus the knobs that differ
    between its variants when the rows hold more than one variant of it ("kivi k_bits=4")."""
    by_method: dict[str, dict[str, dict]] = {}
    for r in rows:
        by_method.setdefault(r["method"], {})[r["variant"]] = r["_variant"]
    out = {}
    for method, split in by_method.items():
        keys = {k for knobs in split.values() for k in knobs}
        differ = sorted(k for k in keys if len({knobs.get(k) for knobs in split.values()}) > 1)
        for v, knobs in split.items():
            tag = " ".join(f"{k}={knobs[k]}" for k in differ if k in knobs)
            out[method, v] = f"{method} {tag}" if tag else method
    return out


def linestyle(rows: list[dict], method: str, variant: str) -> str:
    """Variants of one method share its colour and marker and differ by line style."""
    variants = sorted({r["variant"] for r in rows if r["method"] == method})
    return LINESTYLES[variants.index(variant) % len(LINESTYLES)] if variant in variants else "-"
