"""tools/png.py: the PNG it writes decodes (signature, chunk CRCs, IHDR, the pixels), read back here by hand."""
import struct
import zlib

import torch

from tools.png import Canvas, scatter


def read_png(data: bytes):
    """-> (width, height, (H, W, 3) uint8), checking what a decoder checks for a plain RGB PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    chunks, i = {}, 8
    while i < len(data):
        n, kind = struct.unpack(">I4s", data[i:i + 8])
        body, crc = data[i + 8:i + 8 + n], struct.unpack(">I", data[i + 8 + n:i + 12 + n])[0]
        assert crc == zlib.crc32(kind + body), kind
        chunks[kind] = chunks.get(kind, b"") + body
        i += 12 + n
    assert list(chunks)[0] == b"IHDR" and list(chunks)[-1] == b"IEND" and i == len(data)
    w, h, depth, colour, compression, filtering, interlace = struct.unpack(">IIBBBBB", chunks[b"IHDR"])
    assert (depth, colour, compression, filtering, interlace) == (8, 2, 0, 0, 0)
    rows = torch.tensor(list(zlib.decompress(chunks[b"IDAT"])), dtype=torch.uint8).view(h, 1 + 3 * w)
    assert (rows[:, 0] == 0).all()                         # filter type none on every row
    return w, h, rows[:, 1:].reshape(h, w, 3)


def test_written_png_decodes_with_its_pixels(tmp_path):
    cv = Canvas(7, 5)
    cv.rect(2, 1, 3, 2, (10, 200, 30))                     # the pixel at x 2, y 1
    cv.line(0, 4, 6, 4, (0, 0, 255))                       # the bottom row
    cv.save(tmp_path / "a.png")
    w, h, px = read_png((tmp_path / "a.png").read_bytes())
    assert (w, h) == (7, 5)
    assert px[1, 2].tolist() == [10, 200, 30] and px[0, 0].tolist() == [255, 255, 255]
    assert (px[4] == torch.tensor([0, 0, 255], dtype=torch.uint8)).all()


def test_text_draws_its_glyph():
    cv = Canvas(6, 8)
    cv.text(0, 0, "l", (0, 0, 0))                          # drawn as "L": the left column and the bottom row
    ink = (cv.px[..., 0] == 0)[:7, :5]
    assert ink[:, 0].all() and ink[6].all() and not ink[:6, 1:].any()


def test_scatter_writes_a_png(tmp_path):
    scatter([(4, 1.0, "a", (255, 0, 0)), (32, 0.5, "b", (0, 0, 255))], str(tmp_path / "p.png"), "t", "x", "y")
    w, h, px = read_png((tmp_path / "p.png").read_bytes())
    assert (w, h) == (960, 640) and ((px == torch.tensor([255, 0, 0], dtype=torch.uint8)).all(-1)).any()
