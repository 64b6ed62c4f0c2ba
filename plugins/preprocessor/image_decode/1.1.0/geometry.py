"""Where an image of a given size goes: the size it is resized to, and where it lands on
the model's canvas (letterboxed or centre-cropped). Pure arithmetic on sizes, the same for
Pillow and OpenCV, so the bound on a request (``max_pixels``) is read off an image's header
before anything is decoded."""

from __future__ import annotations

from dataclasses import dataclass

RESIZES = ("stretch", "letterbox", "height", "width", "shorter", "longer")
"""``stretch`` and ``letterbox`` take ``size = [width, height]``; the others one side's
length, the other side following the image's aspect."""
ROUNDINGS = ("round", "floor", "int")
"""How a side that follows the aspect is made whole: ``round`` (Python's ``round(side *
scale)``), ``floor`` (the whole number below ``side * target / reference``, as
torchvision's ``Resize(int)``), ``int`` (``int(side * scale)`` in double precision, as
``int(w * r)`` in many libraries' Python: one pixel less than ``floor`` for some sizes)."""
ANCHORS = ("center", "top_left")


@dataclass(frozen=True)
class Plan:
    """One image's way to the model: resized to ``resized`` (``None``: kept as it is),
    then, when ``canvas`` is set, laid on a canvas of that size filled with ``fill`` with
    its top-left corner at ``offset`` (negative where it is cropped). ``scale`` is the
    nominal factor a postprocessor divides by to map a point back, after subtracting
    ``offset``."""

    resized: tuple[int, int] | None
    canvas: tuple[int, int] | None
    offset: tuple[int, int]
    scale: float

    def output(self, width: int, height: int) -> tuple[int, int]:
        """The size of what reaches the model from a ``width`` x ``height`` image."""
        return self.canvas or self.resized or (width, height)

    def pixels(self, width: int, height: int) -> int:
        """The most pixels any step holds: the resized image or the canvas."""
        resized = self.resized or (width, height)
        canvas = self.canvas or (0, 0)
        return max(resized[0] * resized[1], canvas[0] * canvas[1])


@dataclass(frozen=True)
class Geometry:
    """The resize and placement options: ``resize`` (one of :data:`RESIZES`), ``size``
    (``(width, height)`` for stretch and letterbox, ``(n, n)`` for the others, ``None``
    to keep each image's size), ``rounding``, the letterbox ``anchor`` and a centre
    ``crop`` (``(width, height)`` or ``None``)."""

    resize: str
    size: tuple[int, int] | None
    rounding: str = "round"
    anchor: str = "center"
    crop: tuple[int, int] | None = None

    def plan(self, width: int, height: int) -> Plan:
        resized, scale = self._resized(width, height)
        if self.resize == "letterbox" and self.size is not None and resized is not None:
            return Plan(resized, self.size, self._anchored(resized), scale)
        if self.crop is not None:
            have = resized or (width, height)
            offset = (_centred(have[0], self.crop[0]), _centred(have[1], self.crop[1]))
            return Plan(resized, self.crop, offset, scale)
        return Plan(resized, None, (0, 0), scale)

    def most_pixels(self, width: int, height: int) -> tuple[int, tuple[int, int]]:
        """The most pixels a ``width`` x ``height`` image (as its header says) can become,
        turned or not by its EXIF orientation, and the size that holds them."""
        best = (0, (0, 0))
        for w, h in ((width, height), (height, width)):
            plan = self.plan(w, h)
            best = max(best, (plan.pixels(w, h), plan.output(w, h)))
        return best

    def _resized(self, width: int, height: int) -> tuple[tuple[int, int] | None, float]:
        if self.size is None:
            return None, 1.0
        target_w, target_h = self.size
        if self.resize == "stretch":
            return (target_w, target_h), 1.0
        if self.resize == "letterbox":  # both sides follow the smaller scale
            if target_w * height <= target_h * width:
                reference, target = width, target_w
            else:
                reference, target = height, target_h
            sides = self._side(width, target, reference), self._side(height, target, reference)
            return sides, min(target_w / width, target_h / height)
        by_width, target = self._given(width, height)
        if by_width:
            return (target, self._side(height, target, width)), target / width
        return (self._side(width, target, height), target), target / height

    def _given(self, width: int, height: int) -> tuple[bool, int]:
        """Whether the width is the side given its length (else the height), and that
        length."""
        assert self.size is not None
        if self.resize == "height":
            return False, self.size[1]
        if self.resize == "width":
            return True, self.size[0]
        if self.resize == "shorter":
            return width <= height, self.size[0]
        return width > height, self.size[0]  # longer

    def _side(self, side: int, target: int, reference: int) -> int:
        """``side`` scaled by ``target / reference``, made whole by ``rounding``; at
        least 1."""
        if self.rounding == "floor":
            whole = side * target // reference
        elif self.rounding == "int":
            whole = int(side * (target / reference))
        else:
            whole = round(side * (target / reference))
        return max(1, whole)

    def _anchored(self, resized: tuple[int, int]) -> tuple[int, int]:
        assert self.size is not None
        if self.anchor == "top_left":
            return 0, 0
        return (self.size[0] - resized[0]) // 2, (self.size[1] - resized[1]) // 2


def _centred(have: int, want: int) -> int:
    """Where an image ``have`` long lands in a centre crop ``want`` long, as torchvision's
    ``CenterCrop`` places it: cut by ``round((have - want) / 2)`` (half to even), or, when
    shorter, padded by ``(want - have) // 2`` before it."""
    if have >= want:
        return -round((have - want) / 2)
    return (want - have) // 2
