"""``builtin:shapes``: the procedural shapes dataset, its judge, and the model's parts.

- :mod:`._dataset` -- 32x32 pictures of one flat shape (circle, square, triangle) in a named
  colour on white, filled or outlined, with captions; deterministic per seed.
- :mod:`._judge` -- which colour, shape and style a picture shows (foreground hue, template
  fit, the share of the shape without ink); what ``omni-trio bench quality`` scores with.
- :mod:`._architecture` -- the untrained pipeline ``scripts/train_shapes.py`` trains.
- :mod:`._vae` -- the identity VAE that lets a pixel-space UNet run in
  ``StableDiffusionPipeline``.
- ``pipeline/`` -- the trained pipeline, loaded as ``builtin:shapes``.
- ``loras/outline/`` -- a LoRA adapter for it that draws outlined shapes
  (``scripts/train_shapes_lora.py``), named ``builtin:shapes-outline``.

Importing this package imports numpy only; the model parts import torch and diffusers.
"""

from ._dataset import COLOURS as COLOURS
from ._dataset import IMAGE_SIZE as IMAGE_SIZE
from ._dataset import SHAPES as SHAPES
from ._dataset import SIZES as SIZES
from ._dataset import STYLES as STYLES
from ._dataset import Scene as Scene
from ._dataset import article as article
from ._dataset import caption as caption
from ._dataset import make_batch as make_batch
from ._dataset import outline_mask as outline_mask
from ._dataset import render_scene as render_scene
from ._dataset import sample_scene as sample_scene
from ._dataset import shape_mask as shape_mask
from ._judge import Verdict as Verdict
from ._judge import foreground_mask as foreground_mask
from ._judge import judge as judge

__all__ = [
    "COLOURS",
    "IMAGE_SIZE",
    "SHAPES",
    "SIZES",
    "STYLES",
    "Scene",
    "Verdict",
    "article",
    "caption",
    "foreground_mask",
    "judge",
    "make_batch",
    "outline_mask",
    "render_scene",
    "sample_scene",
    "shape_mask",
]
