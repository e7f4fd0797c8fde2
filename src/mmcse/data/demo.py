"""The offline demo world: procedurally drawn scenes with true object–phrase pairs.

Each image is a plain background with 2–4 objects placed in distinct cells of a
3×3 grid. An object has a shape, a colour and a size. Captions are built from a
small grammar over the scene (lists, spatial relations, positions), so every
phrase naming an object ("a small red circle") has a known character span and a
known box and mask. The same grammar writes the text-only corpus (the Wiki1M
stand-in) and the graded sentence-pair sets, whose gold similarity is computed
from the meaning the generator put into each sentence, not from any model.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

SHAPES: dict[str, tuple[str, ...]] = {
    "circle": ("circle", "disc", "ball"),
    "square": ("square", "box", "block"),
    "triangle": ("triangle", "wedge"),
    "diamond": ("diamond", "rhombus"),
    "hexagon": ("hexagon",),
}
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (215, 38, 38),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (240, 215, 40),
    "purple": (140, 50, 170),
    "orange": (245, 135, 30),
    "white": (250, 250, 250),
    "black": (20, 20, 20),
}
SIZES: dict[str, tuple[str, ...]] = {"small": ("small", "little", "tiny"), "large": ("large", "big")}
BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "grey": (128, 128, 128),
    "brown": (120, 85, 60),
    "teal": (40, 120, 120),
    "pink": (225, 170, 185),
}
ROWS = ("top", "middle", "bottom")
COLS = ("left", "centre", "right")


@dataclass(frozen=True)
class SceneObject:
    shape: str
    colour: str
    size: str
    row: int
    col: int

    def attributes(self) -> tuple[str, str, str]:
        return (self.shape, self.colour, self.size)


@dataclass(frozen=True)
class Scene:
    background: str
    objects: tuple[SceneObject, ...]


@dataclass(frozen=True)
class Phrase:
    object_index: int
    start: int
    end: int


@dataclass(frozen=True)
class Caption:
    text: str
    phrases: tuple[Phrase, ...]

    def mentioned(self, scene: Scene) -> list[SceneObject]:
        return [scene.objects[p.object_index] for p in self.phrases]


def sample_scene(rng: random.Random, min_objects: int, max_objects: int) -> Scene:
    count = rng.randint(min_objects, max_objects)
    cells = rng.sample([(r, c) for r in range(3) for c in range(3)], count)
    objects = tuple(
        SceneObject(
            shape=rng.choice(sorted(SHAPES)),
            colour=rng.choice(sorted(COLOURS)),
            size=rng.choice(sorted(SIZES)),
            row=r,
            col=c,
        )
        for r, c in cells
    )
    return Scene(background=rng.choice(sorted(BACKGROUNDS)), objects=objects)


# --------------------------------------------------------------------------- rendering


def _shape_points(shape: str, cx: float, cy: float, radius: float) -> list[tuple[float, float]]:
    if shape == "square":
        r = radius * 0.85
        return [(cx - r, cy - r), (cx + r, cy - r), (cx + r, cy + r), (cx - r, cy + r)]
    if shape == "triangle":
        return [(cx, cy - radius), (cx + radius, cy + radius * 0.8), (cx - radius, cy + radius * 0.8)]
    if shape == "diamond":
        return [(cx, cy - radius), (cx + radius, cy), (cx, cy + radius), (cx - radius, cy)]
    if shape == "hexagon":
        angles = np.linspace(0, 2 * np.pi, 7)[:-1]
        return [(cx + radius * np.cos(a), cy + radius * np.sin(a)) for a in angles]
    raise ValueError(f"no polygon for shape {shape!r}")


def render_scene(
    scene: Scene, size: int, rng: random.Random
) -> tuple[Image.Image, np.ndarray, list[tuple[int, int, int, int]]]:
    """Draw ``scene``; return the RGB image, a label mask (0 = background, k = object k-1)
    and each object's box ``(x0, y0, x1, y1)`` (exclusive right/bottom)."""
    base = np.array(BACKGROUNDS[scene.background], dtype=np.int16)
    noise = np.random.default_rng(rng.getrandbits(32)).integers(-12, 13, (size, size, 3))
    canvas = Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8), "RGB")
    labels = np.zeros((size, size), dtype=np.uint8)
    boxes = []
    cell = size / 3
    for k, obj in enumerate(scene.objects):
        radius = cell * (0.22 if obj.size == "small" else 0.42)
        cx = (obj.col + 0.5) * cell + rng.uniform(-0.05, 0.05) * cell
        cy = (obj.row + 0.5) * cell + rng.uniform(-0.05, 0.05) * cell
        mask_img = Image.new("L", (size, size), 0)
        draw = ImageDraw.Draw(mask_img)
        if obj.shape == "circle":
            draw.ellipse([cx - radius, cy - radius, cx + radius, cy + radius], fill=255)
        else:
            draw.polygon(_shape_points(obj.shape, cx, cy, radius), fill=255)
        mask = np.array(mask_img) > 0
        canvas.paste(COLOURS[obj.colour], mask=mask_img)
        labels[mask] = k + 1
        ys, xs = np.nonzero(mask)
        boxes.append((int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1))
    return canvas, labels, boxes


# --------------------------------------------------------------------------- language


def _phrase(obj: SceneObject, rng: random.Random, with_size: bool) -> str:
    words = ["a"]
    if with_size:
        words.append(rng.choice(SIZES[obj.size]))
    words.append(obj.colour)
    words.append(rng.choice(SHAPES[obj.shape]))
    return " ".join(words)


def _position(obj: SceneObject) -> str:
    if obj.row == 1 and obj.col == 1:
        return "the centre"
    if obj.row == 1:
        return f"the {COLS[obj.col]}"
    if obj.col == 1:
        return f"the {ROWS[obj.row]}"
    return f"the {ROWS[obj.row]} {COLS[obj.col]} corner"


class _Builder:
    """Concatenates text pieces and records the span of each object phrase."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.length = 0
        self.phrases: list[Phrase] = []

    def text(self, piece: str) -> None:
        self.parts.append(piece)
        self.length += len(piece)

    def obj(self, index: int, phrase: str) -> None:
        self.phrases.append(Phrase(index, self.length, self.length + len(phrase)))
        self.text(phrase)

    def listing(
        self, scene: Scene, mention: Sequence[int], rng: random.Random, with_size: bool, where: bool = False
    ) -> None:
        """"A, B and C" over the mentioned objects, each optionally followed by its position."""
        for pos, idx in enumerate(mention):
            if pos:
                self.text(" and " if pos == len(mention) - 1 else ", ")
            self.obj(idx, _phrase(scene.objects[idx], rng, with_size))
            if where:
                self.text(f" in {_position(scene.objects[idx])}")

    def build(self) -> Caption:
        return Caption("".join(self.parts), tuple(self.phrases))


def describe(scene: Scene, rng: random.Random, mention: Sequence[int] | None = None) -> Caption:
    """One caption of ``scene`` mentioning the objects in ``mention`` (default: a random
    non-empty subset), drawn from several templates."""
    n = len(scene.objects)
    if mention is None:
        k = rng.randint(min(2, n), n)
        mention = rng.sample(range(n), k)
    mention = list(mention)
    with_size = rng.random() < 0.8
    b = _Builder()
    objs = scene.objects
    template = rng.randrange(5)
    if len(mention) == 1 or template == 0:
        # "there is a red circle in the top left corner and a blue square in the centre"
        b.text(rng.choice(["there is ", "we see ", "the picture shows "]))
        b.listing(scene, mention, rng, with_size, where=True)
    elif template == 1 and len(mention) >= 2:
        # spatial relation between the first two mentioned objects
        a, c = mention[0], mention[1]
        oa, oc = objs[a], objs[c]
        if oa.col != oc.col:
            rel = "to the left of" if oa.col < oc.col else "to the right of"
        else:
            rel = "above" if oa.row < oc.row else "below"
        b.obj(a, _phrase(oa, rng, with_size))
        b.text(f" {rel} ")
        b.obj(c, _phrase(oc, rng, with_size))
        for idx in mention[2:]:
            b.text(" and ")
            b.obj(idx, _phrase(objs[idx], rng, with_size))
    elif template == 2:
        b.text(rng.choice(["a picture of ", "an image with ", "a drawing of "]))
        b.listing(scene, mention, rng, with_size)
        b.text(f" on a {scene.background} background")
    elif template == 3:
        b.listing(scene, mention, rng, with_size)
        b.text(rng.choice([" next to each other", " placed apart", " shown together"]))
    else:
        b.listing(scene, mention, rng, with_size)
    return b.build()


# --------------------------------------------------------------------------- graded similarity


def object_similarity(a: SceneObject, b: SceneObject) -> float:
    """Meaning overlap of two objects: shape matters most, then colour, then size."""
    return 0.5 * (a.shape == b.shape) + 0.35 * (a.colour == b.colour) + 0.15 * (a.size == b.size)


def meaning_similarity(a: Sequence[SceneObject], b: Sequence[SceneObject]) -> float:
    """Symmetric best-match similarity of two object lists in [0, 1]."""

    def directed(x: Sequence[SceneObject], y: Sequence[SceneObject]) -> float:
        return float(np.mean([max(object_similarity(o, p) for p in y) for o in x]))

    return 0.5 * (directed(a, b) + directed(b, a))


def _perturb(obj: SceneObject, rng: random.Random, n_changes: int) -> SceneObject:
    fields = rng.sample(["shape", "colour", "size"], n_changes)
    changes = {}
    for name in fields:
        pool = {"shape": sorted(SHAPES), "colour": sorted(COLOURS), "size": sorted(SIZES)}[name]
        current = getattr(obj, name)
        changes[name] = rng.choice([v for v in pool if v != current])
    return dataclasses.replace(obj, **changes)


def sts_pair(rng: random.Random, min_objects: int, max_objects: int) -> tuple[str, str, float]:
    """A sentence pair with a gold score in [0, 5] from the generator's meaning."""
    scene_a = sample_scene(rng, min_objects, max_objects)
    cap_a = describe(scene_a, rng)
    level = rng.randrange(4)
    if level == 0:  # paraphrase: same objects, another template and wording
        scene_b = scene_a
        mention = [p.object_index for p in cap_a.phrases]
        rng.shuffle(mention)
        cap_b = describe(scene_b, rng, mention)
    elif level in (1, 2):  # the same scene with `level` attribute changes per object changed
        mention = [p.object_index for p in cap_a.phrases]
        objects = list(scene_a.objects)
        for idx in rng.sample(mention, rng.randint(1, len(mention))):
            objects[idx] = _perturb(objects[idx], rng, level)
        scene_b = dataclasses.replace(scene_a, objects=tuple(objects))
        cap_b = describe(scene_b, rng, mention)
    else:  # an unrelated scene
        scene_b = sample_scene(rng, min_objects, max_objects)
        cap_b = describe(scene_b, rng)
    gold = 5.0 * meaning_similarity(cap_a.mentioned(scene_a), cap_b.mentioned(scene_b))
    return cap_a.text, cap_b.text, round(gold, 4)
