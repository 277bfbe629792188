"""One image file -> one (C, size, size) uint8 sample: Pillow's decode, crop and resize.

    decode(out, "cat.jpg", 224, train=True, rng=rng)      # random-resized-crop + flip
    decode(out, "cat.jpg", 224, train=False, rng=None, resize=eval_resize(224))   # resize + centre crop

  train  random-resized-crop (torchvision's RandomResizedCrop: area scale 0.08..1, aspect
         3/4..4/3, 10 tries then a centre crop) to size x size, bilinear, then a horizontal
         flip with probability 1/2;
  eval   resize the shorter side to `resize` (size / 0.875: 256 for 224), centre crop.
Crop and resize are one Pillow call (Image.resize with a box); for eval, JPEGs decode at a
reduced scale when that still covers the resize (draft). Grey and palette images become RGB
(or RGB grey for mode "L"); 16-bit grey images are scaled to 8 bits (`to_8_bit`), not clipped.
Pillow is an optional extra (pip install 'lowmem[images]'): `pil()` names it when missing.
The folders, the loader and the statistics that use this are lowmem/data/images.py.
"""
import numpy as np

EVAL_CROP_FRACTION = 0.875         # centre crop 224 of 256
RRC_SCALE = (0.08, 1.0)
RRC_RATIO = (3 / 4, 4 / 3)


def pil():
    """PIL.Image, or an ImportError naming the extra to install."""
    try:
        from PIL import Image
    except ImportError:
        raise ImportError("image folders need Pillow: pip install 'lowmem[images]'") from None
    return Image


def random_resized_crop_box(w, h, rng, scale=RRC_SCALE, ratio=RRC_RATIO):
    """(left, top, right, bottom) of a random crop of a w x h image, as torchvision's
    RandomResizedCrop.get_params: area fraction in `scale`, log-uniform aspect in `ratio`,
    10 tries, then the largest centre crop of aspect within `ratio`."""
    area = w * h
    log_ratio = np.log(ratio)
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = np.exp(rng.uniform(*log_ratio))
        cw = int(round(np.sqrt(target * aspect)))
        ch = int(round(np.sqrt(target / aspect)))
        if 0 < cw <= w and 0 < ch <= h:
            x0 = int(rng.integers(0, w - cw + 1))
            y0 = int(rng.integers(0, h - ch + 1))
            return x0, y0, x0 + cw, y0 + ch
    in_ratio = w / h
    if in_ratio < ratio[0]:
        cw, ch = w, int(round(w / ratio[0]))
    elif in_ratio > ratio[1]:
        cw, ch = int(round(h * ratio[1])), h
    else:
        cw, ch = w, h
    x0, y0 = (w - cw) // 2, (h - ch) // 2
    return x0, y0, x0 + cw, y0 + ch


def centre_crop_box(w, h, size, resize):
    """The box of the source image that `resize shorter side to resize, centre crop size`
    keeps, in source pixels (so one resize call does both)."""
    s = min(w, h) / resize                     # source pixels per resized pixel
    cw = ch = size * s
    x0, y0 = (w - cw) / 2, (h - ch) / 2
    return x0, y0, x0 + cw, y0 + ch


WIDE_INTEGER_MODES = ("I", "I;16", "I;16L", "I;16B", "I;16N")   # Pillow's 16- and 32-bit grey modes


def to_8_bit(im):
    """A 16-bit grey image (Pillow mode I;16*, or I holding 0..65535) as 8-bit grey "L":
    v -> round(v * 255 / 65535), values outside 0..65535 clipped. Pillow's own convert clips
    at 255 instead of scaling, which turns a 16-bit photo almost white. Allocates two
    image-sized temporaries (int64, then uint8): one decoded image, not a batch."""
    a = np.clip(np.asarray(im).astype(np.int64), 0, 65535)
    return pil().fromarray(((a * 255 + 32767) // 65535).astype(np.uint8), "L")


def eval_resize(size):
    """The shorter side the eval transform resizes to before its centre crop of `size` (256 for 224)."""
    return int(round(size / EVAL_CROP_FRACTION))


def decode(out, path, size, train, rng, mode="RGB", resize=None):
    """Decode one file into out (C, size, size) uint8: train or eval transform (module docstring)."""
    Image = pil()
    with Image.open(path) as im:
        if not train and im.format == "JPEG":
            w, h = im.size
            need = resize / min(w, h)          # the resize factor; draft keeps at least that much
            im.draft(mode, (int(np.ceil(w * need)), int(np.ceil(h * need))))
        if im.mode in WIDE_INTEGER_MODES:
            im = to_8_bit(im)
        im = im.convert(mode)
        w, h = im.size
        if train:
            box = random_resized_crop_box(w, h, rng)
            flip = rng.random() < 0.5
        else:
            box, flip = centre_crop_box(w, h, size, resize), False
        im = im.resize((size, size), Image.BILINEAR, box=box)
        if flip:
            im = im.transpose(Image.FLIP_LEFT_RIGHT)
        a = np.asarray(im)
    out[...] = a[None] if a.ndim == 2 else a.transpose(2, 0, 1)
