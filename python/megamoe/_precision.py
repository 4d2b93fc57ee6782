"""The precision names every API takes (megamoe/precision.h), without the extension: "w4a16" is
the exact path and the default. Which of them a build runs on the GPU: README "Precision"."""

PRECISIONS = ("w4a16", "w4a8", "auto")


def check_precision(precision, where: str) -> str:
    """``precision`` if it is one of :data:`PRECISIONS`, else ValueError naming the allowed ones."""
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"{where}: precision {precision!r} is not supported; allowed: "
                         f"{', '.join(repr(p) for p in PRECISIONS)} (w4a16, the exact path, is the "
                         "default)")
    return precision
