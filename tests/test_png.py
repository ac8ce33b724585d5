"""tools/png.py: the PNG it writes decodes (signature, chunk CRCs, IHDR, the pixels), read back here by hand."""
import struct
import zlib

import torch

from tools.png import Canvas, place, scatter


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
    red, blue = (255, 0, 0), (0, 0, 255)
    scatter([(4, 1.0, "1", red), (32, 0.5, "2", blue)], str(tmp_path / "p.png"), "t", "x", "y",
            key=[("1 a", red), ("2 b", blue)], log_x=True)
    w, h, px = read_png((tmp_path / "p.png").read_bytes())
    assert (w, h) == (1400, 760)
    for color in (red, blue):
        assert ((px == torch.tensor(color, dtype=torch.uint8)).all(-1)).any()


def test_labels_go_where_nothing_is():
    """A label goes right of its dot when that is free, elsewhere when not, further out (with a leader line) when
    the ring around the dot is full, and never over a box already taken or outside the frame."""
    frame = (0, 0, 400, 400)
    dot = (193, 193, 208, 208)                             # the dot at (200, 200)
    assert place(24, 14, 200, 200, [dot], frame) == (209, 193, False)      # right of the dot
    taken = [dot, (205, 180, 260, 220)]                    # the right side taken
    x0, y0, away = place(24, 14, 200, 200, taken, frame)
    assert not away and x0 + 24 <= 205                     # on the left
    crowd = [(140, 140, 260, 260)]                         # everything near the dot
    x0, y0, away = place(24, 14, 200, 200, crowd, frame)
    assert away and not (x0 < 260 and 140 < x0 + 24 and y0 < 260 and 140 < y0 + 14)
    x0, y0, _ = place(24, 14, 395, 200, [], frame)         # at the frame's right edge: not past it
    assert x0 + 24 <= 400
