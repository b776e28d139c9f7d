"""Pictures made canonical at admission: what a request starts from reaches the workers as a
loaded 8-bit ``RGB`` PIL image, and its mask as an ``L`` one.

Done in the engine's process before the request is admitted (:meth:`AsyncEngine.stream`), so
a picture that cannot be read or converted is the caller's :class:`InvalidRequestError`
(naming ``image`` or ``mask_image``) and never fails a forward it would share with other
requests.  What is converted how:

- a PIL image is loaded (a file opened lazily with ``Image.open`` is read now: a truncated
  one is refused); 16-bit greyscale is scaled to 8 bits; any transparency Pillow reports
  (``RGBA``, ``LA``, ``PA``, a transparent palette or colour key) is composited on white,
  so what a transparent pixel hid never reaches the model; every other mode Pillow converts
  to ``RGB`` is; 32-bit integer (``I``) and float (``F``) pictures are refused (their range
  is unknown);
- a ``uint8`` array ``(H, W)``, ``(H, W, 1)``, ``(H, W, 3)`` or ``(H, W, 4)`` becomes the
  matching image (``RGBA`` composited on white); any other array is left for
  :func:`~omni_trio._core.request.validate_request` to refuse with its message;
- a mask becomes ``L`` (its brightness: white repaints); an alpha channel is not read.

An ``RGB`` picture and an ``L`` mask that are already loaded are passed on as they are (no
copy).  Pure CPU work (no I/O but a lazily opened file's read), on the caller's thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._core.request import SamplingParams
from ..errors import InvalidRequestError

if TYPE_CHECKING:
    from PIL import Image

__all__ = ["canonical_pictures", "on_white"]

_SIXTEEN_BIT = frozenset({"I;16", "I;16B", "I;16L", "I;16N"})
_UNSCALED = frozenset({"I", "F"})


def canonical_pictures(sampling: SamplingParams) -> SamplingParams:
    """``sampling`` with its picture as loaded ``RGB`` and its mask as ``L`` (see the module
    docstring); unchanged without a picture.  Raises :class:`InvalidRequestError`."""
    if sampling.image is None:
        return sampling
    image = _canonical(sampling.image, "image", mask=False)
    mask = sampling.mask_image
    if mask is not None:
        mask = _canonical(mask, "mask_image", mask=True)
    if image is sampling.image and mask is sampling.mask_image:
        return sampling
    return sampling.replace(image=image, mask_image=mask)


def _canonical(value: Any, param: str, *, mask: bool) -> Any:
    import numpy as np
    from PIL import Image

    if isinstance(value, np.ndarray):
        picture = _from_array(value)
        if picture is None:
            return value  # not a picture: validate_request says why
    elif isinstance(value, Image.Image):
        picture = value
    else:
        raise InvalidRequestError(
            f"{param} must be a PIL image or a uint8 array, not {type(value).__name__}",
            param=param,
        )
    try:
        picture.load()
        return _to_mode(picture, "L" if mask else "RGB", param)
    except InvalidRequestError:
        raise
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        raise InvalidRequestError(
            f"{param} cannot be read as a picture: {type(exc).__name__}: {exc}", param=param
        ) from None


def _from_array(array: Any) -> Image.Image | None:
    import numpy as np
    from PIL import Image

    if array.dtype != np.uint8 or array.size == 0:
        return None
    if array.ndim == 3 and array.shape[2] == 1:
        array = array[:, :, 0]
    if array.ndim == 2:
        return Image.fromarray(np.ascontiguousarray(array), "L")
    if array.ndim == 3 and array.shape[2] in (3, 4):
        mode = "RGB" if array.shape[2] == 3 else "RGBA"
        return Image.fromarray(np.ascontiguousarray(array), mode)
    return None


def _to_mode(picture: Image.Image, mode: str, param: str) -> Image.Image:
    import numpy as np
    from PIL import Image

    if picture.mode == mode:
        return picture
    if picture.mode in _UNSCALED:
        raise InvalidRequestError(
            f"{param} is a {picture.mode!r} picture (32-bit integers or floats, whose range "
            "is unknown): convert it to 8 bits per channel first",
            param=param,
        )
    if picture.mode in _SIXTEEN_BIT:
        grey = np.asarray(picture, dtype=np.uint16) >> 8
        picture = Image.fromarray(grey.astype(np.uint8), "L")
        return picture if mode == "L" else picture.convert(mode)
    if mode == "RGB":
        return on_white(picture)
    return picture.convert(mode)


def on_white(picture: Image.Image) -> Image.Image:
    """``picture`` as ``RGB``, any transparency composited on white (so what a transparent
    pixel hid never reaches a model)."""
    from PIL import Image

    if not picture.has_transparency_data:
        return picture.convert("RGB")
    rgba = picture.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")
