"""
tools/png.py: a PNG writer and a small rasterizer on a torch uint8 image (filled rectangles, lines, dots, a 5x7
bitmap font), and a scatter plot built from them: the project's pictures need no plotting library
(examples/compare.py draws docs/methods.png with `scatter`).

PNG (W3C PNG specification, sections 5 and 11): the 8-byte signature, then chunks, each length (4 bytes, big-endian)
| type | data | CRC-32 of type and data: IHDR (width, height, bit depth 8, colour type 2 = RGB, no interlace), IDAT
(the zlib stream of the rows, each led by its filter type, 0 = none) and IEND.
"""
import math
import struct
import zlib

import torch

# The font: one 8-character record per glyph, the character and then its 7 rows, top first, each a base-32 digit of
# 5 bits (the leftmost pixel is the highest bit). Capitals only: text is drawn upper-cased.
DIGITS = "0123456789ABCDEFGHIJKLMNOPQRSTUV"
FONT_TABLE = ("AEHHVHHHBUHHUHHUCEHGGGHEDUHHHHHUEVGGUGGVFVGGUGGGGEHGNHHFHHHHVHHHIE44444EJ72222ICKHIKOKIHLGGGGGGVMHRLLHHH"
              "NHHPLJHHOEHHHHHEPUHHUGGGQEHHHLIDRUHHUKIHSFGGE11UTV444444UHHHHHHEVHHHHHA4WHHHLLLAXHHA4AHHYHHA4444ZV1248GV"
              "0EHJLPHE14C4444E2EH1248V3U11E11U426AIV225VGU11HE6EGGUHHE7V1248888EHHEHHE9EHHF11E 0000000.00000CC,0000CC8"
              "-000E000+044V440/11248GG(2488842)8422248:0CC0CC0%PP248JJ=00V0V00_000000V'4400000<248G842>8421248*04LEL40"
              "?EH12404")
FONT = {FONT_TABLE[i]: torch.tensor([[DIGITS.index(d) >> (4 - b) & 1 for b in range(5)] for d in FONT_TABLE[i + 1:i + 8]],
                                    dtype=torch.bool) for i in range(0, len(FONT_TABLE), 8)}
SIGNATURE = b"\x89PNG\r\n\x1a\n"


def encode(rgb: torch.Tensor) -> bytes:
    """(H, W, 3) uint8 -> the bytes of a PNG file."""
    h, w, _ = rgb.shape
    rows = torch.cat([torch.zeros(h, 1, dtype=torch.uint8), rgb.reshape(h, w * 3)], 1)   # filter type 0 a row

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (SIGNATURE + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) +
            chunk(b"IDAT", zlib.compress(bytes(rows.flatten().tolist()), 9)) + chunk(b"IEND", b""))


class Canvas:
    """An RGB image, (0, 0) at the top left; drawing clips at the edges."""

    def __init__(self, width: int, height: int, background=(255, 255, 255)):
        self.px = torch.tensor(background, dtype=torch.uint8).expand(height, width, 3).clone()

    def rect(self, x0: int, y0: int, x1: int, y1: int, color):
        """Fill [x0, x1) x [y0, y1)."""
        h, w, _ = self.px.shape
        self.px[max(y0, 0):min(y1, h), max(x0, 0):min(x1, w)] = torch.tensor(color, dtype=torch.uint8)

    def line(self, x0, y0, x1, y1, color, width: int = 1):
        n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1       # one sample a pixel along the longer axis
        for x, y in zip(torch.linspace(x0, x1, n).round().int().tolist(), torch.linspace(y0, y1, n).round().int().tolist()):
            self.rect(x - width // 2, y - width // 2, x - width // 2 + width, y - width // 2 + width, color)

    def dot(self, x: int, y: int, color, r: int = 4):
        """A filled disc of radius r centred on (x, y)."""
        h, w, _ = self.px.shape
        ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        self.px[(xs - x) ** 2 + (ys - y) ** 2 <= r * r] = torch.tensor(color, dtype=torch.uint8)

    def text(self, x: int, y: int, s: str, color, scale: int = 1) -> int:
        """Draw s with its top left at (x, y) (6 x 8 pixels a character at scale 1); -> its width in pixels."""
        for i, ch in enumerate(s.upper()):
            glyph = FONT.get(ch, FONT["?"])
            for r, c in glyph.nonzero().tolist():
                self.rect(x + (6 * i + c) * scale, y + r * scale, x + (6 * i + c + 1) * scale, y + (r + 1) * scale, color)
        return 6 * len(s) * scale

    def save(self, path: str):
        with open(path, "wb") as f:
            f.write(encode(self.px))


def ticks(top: float, n: int = 6) -> list:
    """About n round tick values from 0 to at least top (steps of 1, 2 or 5 times a power of ten)."""
    raw = max(top, 1e-9) / n
    step = min((m * 10 ** e for e in range(-3, 6) for m in (1, 2, 5) if m * 10 ** e >= raw))
    return [i * step for i in range(int(-(-top // step)) + 1)]


def place(box_w: int, box_h: int, x: int, y: int, taken: list, frame) -> tuple:
    """Where a label box_w x box_h goes beside the dot at (x, y): the first spot, nearest first (right, left, above,
    below, then the diagonals, on rings further out), that overlaps no box of `taken` and stays inside `frame`
    (x0, y0, x1, y1) -> (left, top, whether it sits away from the dot: a leader line then shows whose it is)."""
    for ring, r in enumerate((9, 22, 38, 56, 78, 104, 134, 170)):
        for dx, dy in ((1, 0), (-1, 0), (0, -1), (0, 1), (1, -1), (1, 1), (-1, -1), (-1, 1)):
            cx = x + dx * (r + box_w // 2) if dx else x
            cy = y + dy * (r + box_h // 2) if dy else y
            x0, y0 = cx - box_w // 2, cy - box_h // 2
            inside = frame[0] <= x0 and x0 + box_w <= frame[2] and frame[1] <= y0 and y0 + box_h <= frame[3]
            if inside and not any(x0 < b[2] and b[0] < x0 + box_w and y0 < b[3] and b[1] < y0 + box_h for b in taken):
                return x0, y0, ring > 0
    return x + 9, y - box_h // 2, False


def scatter(points, path: str, title: str, xlabel: str, ylabel: str, key=(), log_x: bool = False,
            width: int = 1400, height: int = 760):
    """points: [(x, y, label, (r, g, b))], y in [0, 1] drawn as percent, x > 0 with log_x (ticks at powers of 2);
    each label (short: a number) sits beside its dot, clear of every dot and label (a line joins it to its dot when
    it had to move out). key: [(text, (r, g, b))], lines listed right of the plot (what each number is)."""
    cv, grey, black = Canvas(width, height), (225, 225, 225), (0, 0, 0)
    left, right, top, bottom = 100, width - (480 if key else 40), 90, height - 90
    top_x = max(p[0] for p in points)
    if log_x:
        xt = [2 ** i for i in range(max(1, math.ceil(math.log2(top_x))) + 1)]
        lo, hi = math.log(xt[0] / 1.25), math.log(xt[-1] * 1.25)
        X = lambda v: int(left + (right - left) * (math.log(v) - lo) / (hi - lo))   # noqa: E731
    else:
        xt = ticks(top_x * 1.05)
        X = lambda v: int(left + (right - left) * v / xt[-1])                         # noqa: E731
    Y = lambda v: int(bottom - (bottom - top) * v)                                    # noqa: E731
    for v in xt:
        cv.line(X(v), top, X(v), bottom, grey)
        cv.text(X(v) - 6 * len(f"{v:g}"), bottom + 10, f"{v:g}", black, 2)
    for v in (0, 0.2, 0.4, 0.6, 0.8, 1.0):
        cv.line(left, Y(v), right, Y(v), grey)
        cv.text(left - 12 - 12 * len(f"{v:.0%}"), Y(v) - 7, f"{v:.0%}", black, 2)
    cv.line(left, bottom, right, bottom, black, 2)
    cv.line(left, top, left, bottom, black, 2)
    cv.text(left, 16, title, black, 3)
    cv.text(left - 60, top - 34, ylabel, black, 2)
    cv.text((left + right) // 2 - 6 * len(xlabel), bottom + 40, xlabel, black, 2)
    for i, (text, color) in enumerate(key):
        cv.text(right + 40, top + 26 * i, text, color, 2)
    taken, labels = [(X(x) - 7, Y(y) - 7, X(x) + 8, Y(y) + 8) for x, y, _, _ in points], []
    for x, y, label, color in sorted(points, key=lambda p: (-p[1], p[0])):   # the top left first
        w, h = 12 * len(label), 14
        lx, ly, away = place(w, h, X(x), Y(y), taken, (left + 2, top - 30, right + 30, bottom - 2))
        taken.append((lx - 2, ly - 2, lx + w + 2, ly + h + 2))
        labels.append((lx, ly, label, color))
        if away:                                         # a line from the dot to the label's nearest edge
            cv.line(X(x), Y(y), min(max(X(x), lx), lx + w), min(max(Y(y), ly), ly + h), color)
    for x, y, _, color in points:
        cv.dot(X(x), Y(y), color, 6)
    for lx, ly, label, color in labels:
        cv.text(lx, ly, label, color, 2)
    cv.save(path)
