"""TrOCR as the runtime uses it: an image encoder (one text line in, its features out) and an autoregressive
decoder whose self-attention keys and values of the tokens so far are explicit inputs and outputs
(past.N.key -> present.N.key), so each step computes one token. A page is cut into its lines first (`lines`:
its columns, then the rows of ink between blank rows; a blank page has none; a long line is read in parts cut at
word gaps, `line_parts`) and each line is read greedily, until its end-of-text token or settings.max_new_tokens
(pipeline.json); a line that reaches that limit is cut there, and the answer says so."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from onn.errors import UserError
from onn.export.pipelines import images
from onn.export.pipelines.registry import Piece, Pipeline, register
from onn.export.pipelines.runtime import Pieces, Request, finish
from onn.models.layers import discover

HALF = {"mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5]}  # TrOCR's image processor
MIN_CONTRAST = 16.0  # grey levels (of 255) ink lies off its paper at least, and NOISE_SPREAD times the page's noise
NOISE_SPREAD = 10.0  # (its median absolute deviation): a blank scan's noise lies closer
COLUMN_GAP = 1.5  # a blank stripe down a block this many letter heights wide is a gutter (a word's gap is some 0.5)
LONGEST_LINE = 10.0  # width : height a line is read at most; a longer one is read in parts cut at word gaps
SPECK = 0.002  # a row (column) of a part of the page with ink on less of it than this fraction is blank
MAX_NEW_TOKENS = 128  # tokens read per text line at most (a long printed line is some 60): pipeline.json records it

log = logging.getLogger("onn")


def _modules(layers: int):
    import torch
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    class Encoder(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, pixel_values):
            return {"line_features": self.model.encoder(pixel_values=pixel_values).last_hidden_state}

    class Decoder(torch.nn.Module):
        """input_ids [1, new tokens], the line's features and each layer's past keys and values [1, heads, past,
        head dim] (past 0 at the first step) -> logits and the present keys and values."""

        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids, encoder_hidden_states, *past):
            pairs = [(past[2 * i], past[2 * i + 1]) for i in range(layers)]
            cache = EncoderDecoderCache(DynamicCache(pairs), DynamicCache())  # cross-attention: from the features
            out = self.model.decoder(
                input_ids=input_ids, encoder_hidden_states=encoder_hidden_states, past_key_values=cache, use_cache=True
            )
            named = {"logits": out.logits}
            for i, layer in enumerate(out.past_key_values.self_attention_cache.layers):
                named[f"present.{i}.key"], named[f"present.{i}.value"] = layer.keys, layer.values
            return named

    return Encoder, Decoder


def _shape(model) -> tuple[int, int, int]:
    d = model.config.decoder
    return d.decoder_layers, d.decoder_attention_heads, d.d_model // d.decoder_attention_heads


def pieces(model, side: int | None = None) -> list[Piece]:
    import torch

    layers, heads, head_dim = _shape(model)
    Encoder, Decoder = _modules(layers)
    size = model.config.encoder.image_size
    encoder = Encoder(model).eval()
    pixels = torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        features = encoder(pixels)["line_features"]
    traced_past = 3
    past = {
        f"past.{i}.{kv}": torch.randn(1, heads, traced_past, head_dim) for i in range(layers) for kv in ("key", "value")
    }
    sample = {"input_ids": torch.tensor([[model.config.decoder_start_token_id, 5]]), "encoder_hidden_states": features}
    axes = {"input_ids": {1: "sequence"}} | {name: {2: "past"} for name in past}
    longest = model.config.decoder.max_position_embeddings - 2
    itemsize = next(model.parameters()).element_size()
    blocks = [f"model.decoder.model.decoder.layers.{i}" for i in range(layers)]
    encoder_blocks = [f"model.encoder.{path}" for path in discover(model.encoder).block_paths]
    return [
        Piece("encoder", encoder, {"pixel_values": pixels}, runs=[encoder_blocks], when="once per text line"),
        Piece(
            "decoder",
            Decoder(model).eval(),
            sample | past,
            axes=axes,
            # a step reads positions past + sequence: the .omny's reference shapes (the traced past, the sequence
            # at most its bound) stay within the position table
            bounds={"sequence": (1, longest - traced_past), "past": (1, longest)},
            runs=[blocks],
            kv_cache_bytes={b: 2 * heads * head_dim * itemsize for b in blocks},
            when="once per token",
        ),
    ]


def settings(model, side: int | None = None) -> dict[str, Any]:
    layers, heads, head_dim = _shape(model)
    return {
        "image_size": model.config.encoder.image_size,
        **HALF,
        "layers": layers,
        "heads": heads,
        "head_dim": head_dim,
        "start_token": model.config.decoder_start_token_id,
        "eos_token": model.config.decoder.eos_token_id,
        # the decoder's position table bounds a line: a step at position `longest` would read past it
        "max_new_tokens": min(MAX_NEW_TOKENS, model.config.decoder.max_position_embeddings - 2),
    }


def lines(gray: np.ndarray) -> list[tuple[int, int, int, int]]:
    """Text lines of a page as (x0, y0, x1, y1), in reading order. Ink is what is darker than the page's mid-grey
    between ink and paper; the page is cut at its widest blank stripes, then each part at its own (XY-cut): across
    anywhere (between paragraphs and lines), down only at a column's gutter, so a page of columns is read column
    after column and no line runs across a gutter (its two halves read as one line mixed two texts). A page with
    no line, blank or with specks of dust alone, has none: it was read whole, and TrOCR made up text."""
    height, width = gray.shape
    ink = _ink(gray)
    if ink is None:
        return []
    return [_padded(box, width, height) for box in _cut(ink, (0, 0, width, height), _text_height(ink))]


def line_parts(gray: np.ndarray, box: tuple[int, int, int, int]) -> list[tuple[int, int, int, int]]:
    """A line longer than LONGEST_LINE times its height cut at word gaps into parts about that long, left to right:
    the encoder reads a square, and a long line squeezed into it (a printed page's is some 40 times as long as
    high) left its letters a few pixels wide. The widest blank stripe in the second half of a part's stretch is
    its end: a word's gap, not a letter's. A line that is short enough, or has no gap, is one part."""
    x0, y0, x1, y1 = box
    longest = max(1, round(LONGEST_LINE * (y1 - y0)))
    ink = _ink(gray[y0:y1, x0:x1])
    if x1 - x0 <= longest or ink is None:
        return [box]
    gaps = _stripes(ink.any(0))
    parts, left = [], 0
    while x1 - x0 - left > longest:
        near = [
            (end - start, (start + end) // 2)
            for start, end in gaps
            if left + longest // 2 <= start and end <= left + longest
        ]
        if not near:
            break
        cut = max(near)[1]
        parts.append((x0 + left, y0, x0 + cut, y1))
        left = cut
    return [*parts, (x0 + left, y0, x1, y1)]


def _ink(gray: np.ndarray) -> np.ndarray | None:
    """The pixels past the mid-grey between the paper (the median) and the farthest pixel from it: darker, or
    lighter for light print on a dark ground (a sign, a dark-mode screenshot). None when nothing lies off the
    paper by MIN_CONTRAST and NOISE_SPREAD times its noise: a blank page, whose scanner noise is no text."""
    paper = float(np.median(gray))
    noise = float(np.median(np.abs(gray - paper)))
    darkest, lightest = float(gray.min()), float(gray.max())
    if max(paper - darkest, lightest - paper) < max(MIN_CONTRAST, NOISE_SPREAD * noise):
        return None
    if lightest - paper > paper - darkest:
        return gray > (lightest + paper) / 2
    return gray < (darkest + paper) / 2


def _text_height(ink: np.ndarray) -> float:
    """How tall the page's letters are: its long vertical runs of ink (letters' stems; bars and bowls make short
    runs), found down every column at once, whether the columns' lines line up or not."""
    edges = np.diff(ink.astype(np.int8), axis=0, prepend=0, append=0).T  # per column: +1 a run starts, -1 it ends
    runs = np.nonzero(edges == -1)[1] - np.nonzero(edges == 1)[1]
    return float(np.percentile(runs, 90)) if runs.size else float(ink.shape[0])


def _cut(ink: np.ndarray, box: tuple[int, int, int, int], letter: float) -> list[tuple[int, int, int, int]]:
    """The lines of the part `box` of the page, in reading order: cut at its widest blank stripes, across or down,
    whichever is wider (down only where COLUMN_GAP letters wide), and each piece cut again; a part with no such
    stripe is one line, or nothing when under 4 rows (a speck). Only the widest (within half a `letter` height, or
    a quarter, of the widest): a heading above two columns is cut off first, then the columns, then their lines
    (cutting at every blank row first read two columns' lines in turns). A part that is one line is not cut down
    (`_line`): its wide gap is a tab's or a table row's, and cut there the line was read as two. A part with no blank
    row yet over two letters high is several lines (two columns whose lines don't line up) and is cut down. A row or
    column of the part holds ink when more than SPECK of it does (dust is no line, nor blocks a gutter)."""
    x0, y0, x1, y1 = box
    region = ink[y0:y1, x0:x1]
    rows, cols = region.mean(1) > SPECK, region.mean(0) > SPECK
    across = _stripes(rows)
    inked = np.nonzero(rows)[0]
    tall = inked.size > 0 and inked[-1] + 1 - inked[0] > 2 * letter  # columns whose lines don't line up: no blank row
    # one line's wide gap (a tab's, a table row's) is no gutter, nor one in a tall line (a big heading, brackets)
    down = _gutters(cols, letter) if across else _columns_of_lines(region, _gutters(cols, letter)) if tall else []
    widest_across = max((end - start for start, end in across), default=0)
    widest_down = max((end - start for start, end in down), default=0)
    if not widest_across and not widest_down:
        return _line(region, cols, letter, x0, y0)
    widest = max(widest_down, widest_across)
    near = widest - max(letter / 2, widest / 4)  # the quarter: few levels of cuts, whatever the gaps
    if widest_down > widest_across:
        spans = _pieces(cols.size, [(start, end) for start, end in down if end - start >= near])
        pieces = [(x0 + start, y0, x0 + end, y1) for start, end in spans]
    else:
        spans = _pieces(rows.size, [(start, end) for start, end in across if end - start >= near])
        pieces = [(x0, y0 + start, x1, y0 + end) for start, end in spans]
    return [line for piece in pieces for line in _cut(ink, piece, letter)]


def _columns_of_lines(region: np.ndarray, gutters: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The gutters of a part with no blank row across it, where every column they part holds several lines (a blank
    row of its own): columns whose lines do not line up. None where a piece is one line: a heading in large type,
    or a line with brackets, is taller than two letters, and its word gaps were cut as gutters."""
    pieces = [region[:, start:end] for start, end in _pieces(region.shape[1], gutters)] if gutters else []
    return gutters if pieces and all(_stripes(piece.mean(1) > SPECK) for piece in pieces) else []


def _line(region: np.ndarray, cols: np.ndarray, letter: float, x0: int, y0: int) -> list[tuple[int, int, int, int]]:
    """The box of a part of the page that is one line (at x0, y0), or none: its pieces between blank stripes
    COLUMN_GAP letters wide (a tab's gap, a table row's) joined, less those under 4 rows high (specks of dust
    beside it, or the whole part: a speck is no line)."""
    wide = [(start, end) for start, end in _stripes(cols) if end - start >= COLUMN_GAP * letter]
    boxes = []
    for start, end in _pieces(cols.size, wide):
        piece = region[:, start:end]
        filled = np.nonzero(piece.mean(1) > SPECK)[0]
        if len(filled) == 0 or filled[-1] + 1 - filled[0] < 4:
            continue
        top, bottom = int(filled[0]), int(filled[-1]) + 1
        inked = np.nonzero(piece[top:bottom].any(0))[0]
        boxes.append((x0 + start + int(inked[0]), y0 + top, x0 + start + int(inked[-1]) + 1, y0 + bottom))
    if not boxes:
        return []
    return [(min(b[0] for b in boxes), min(b[1] for b in boxes), max(b[2] for b in boxes), max(b[3] for b in boxes))]


def _gutters(cols: np.ndarray, letter: float) -> list[tuple[int, int]]:
    """The blank stripes down a part of the page that are column gutters: COLUMN_GAP letters wide, with text
    wider than the stripe on each side (a column of print is wider than its gutter). A table's wide gap between
    short cells is none: cut down there, its rows were read cell column after cell column, and a short heading
    above the table went with the cells under it (one over the right cells was read after the left's). A stripe
    beside a speck of dust is none either, and the speck then lies within the column beside it."""
    wide = [(start, end) for start, end in _stripes(cols) if end - start >= COLUMN_GAP * letter]
    filled = np.nonzero(cols)[0]
    while wide:
        spans = [filled[(filled >= a) & (filled < b)] for a, b in _pieces(cols.size, wide)]
        widths = [int(inked[-1]) + 1 - int(inked[0]) for inked in spans]
        kept = [(a, b) for (a, b), left, right in zip(wide, widths, widths[1:]) if min(left, right) > b - a]
        if kept == wide:
            break
        wide = kept
    return wide


def _stripes(filled: np.ndarray) -> list[tuple[int, int]]:
    """The blank runs (start, end) between the first and the last filled entry."""
    at = np.nonzero(filled)[0]
    if len(at) == 0:
        return []
    blank = np.diff(at) > 1
    return [(int(a) + 1, int(b)) for a, b in zip(at[:-1][blank], at[1:][blank])]


def _pieces(size: int, stripes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """0..size split at the stripes: the spans between them."""
    bounds = [0, *(edge for stripe in stripes for edge in stripe), size]
    return list(zip(bounds[::2], bounds[1::2]))


def _padded(box: tuple[int, int, int, int], width: int, height: int) -> tuple[int, int, int, int]:
    """A line's box with a margin of a quarter of its height (2 pixels at least), within the page."""
    x0, y0, x1, y1 = box
    pad = max(2, (y1 - y0) // 4)
    return (max(0, x0 - pad), max(0, y0 - pad), min(width, x1 + pad), min(height, y1 + pad))


def read_line(pieces_: Pieces, crop, s: dict) -> list[int]:
    """Greedy decoding: the line encoded once, then one token a step with the keys and values carried over. The
    line's features and the keys and values stay where the sessions compute them (a GPU under CUDA): what a step
    reads back to the host is its logits, which the next token is chosen from."""
    pixels = images.normalised(crop, (s["image_size"],) * 2, s["mean"], s["std"])
    features = pieces_.run("encoder", {"pixel_values": pixels}, keep={"line_features"})["line_features"]
    presents = [f"present.{i}.{kv}" for i in range(s["layers"]) for kv in ("key", "value")]
    past = {
        f"past.{name[len('present.') :]}": np.zeros((1, s["heads"], 0, s["head_dim"]), np.float32) for name in presents
    }
    token, tokens = s["start_token"], []
    for _ in range(s["max_new_tokens"]):
        ids = np.asarray([[token]], np.int64)
        out = pieces_.run("decoder", {"input_ids": ids, "encoder_hidden_states": features, **past}, keep=presents)
        token = int(out["logits"][0, -1].argmax())
        if token == s["eos_token"]:
            break
        tokens.append(token)
        past = {f"past.{name[len('present.') :]}": out[name] for name in presents}
    return tokens


def run(doc: dict[str, Any], pieces_: Pieces, request: Request) -> dict[str, Any]:
    """Every page's lines, top to bottom, page after page (a multi-page TIFF is a scanned document); the picture
    is the pages one below the other with their lines boxed."""
    limit = _max_new_tokens(doc["settings"])
    pages = images.load_pages(request.image)
    tokenizer = pieces_.tokenizer()
    found, pictures = [], []
    for number, page in enumerate(pages, 1):
        gray = np.asarray(page.convert("L"), np.float32)
        parts = [line_parts(gray, box) for box in lines(gray)]  # a blank page: none
        read = [_read(pieces_, page, boxes, doc["settings"], tokenizer) | {"page": number} for boxes in parts]
        labels = [f["text"][:40] or f"(no text: ids {' '.join(map(str, f['token_ids'][:4]))} ...)" for f in read]
        pictures.append(images.annotate(page, boxes=[(f["box"], label) for f, label in zip(read, labels)]))
        found += read
    if cut_lines := [str(i + 1) for i, f in enumerate(found) if f["cut_at_max_new_tokens"]]:
        log.warning(
            "OCR: line(s) %s reached settings.max_new_tokens=%d (pipeline.json) and are cut there; raise it in that "
            "file to read longer lines.",
            ", ".join(cut_lines),
            limit,
        )
    findings = {"pages": len(pages), "lines": found, "text": "\n".join(f["text"] for f in found)}
    result = finish(request, images.stacked(pictures), findings)
    print(result["text"])
    return result


def _read(pieces_: Pieces, page, parts: list[tuple[int, int, int, int]], s: dict, tokenizer) -> dict[str, Any]:
    """One line of a page read, part by part (line_parts), the parts' texts joined by a space: its box, the boxes
    of its parts, its text and token ids, and whether settings.max_new_tokens cut a part."""
    ids = [read_line(pieces_, page.crop(part), s) for part in parts]
    texts = [_text(part_ids, tokenizer) for part_ids in ids]
    box = [parts[0][0], parts[0][1], parts[-1][2], parts[-1][3]]
    return {
        "box": box,
        "parts": [list(part) for part in parts],
        "text": " ".join(text for text in texts if text),
        "token_ids": [token for part_ids in ids for token in part_ids],
        # no end-of-text token within the limit: the rest of the part is unread
        "cut_at_max_new_tokens": any(len(part_ids) >= s["max_new_tokens"] for part_ids in ids),
    }


def _text(ids: list[int], tokenizer) -> str:
    """A part's tokens as text (those the tokenizer knows), or as their ids when the pipeline has no tokenizer."""
    if tokenizer is None:
        return " ".join(map(str, ids))
    return tokenizer.decode([t for t in ids if t < tokenizer.get_vocab_size()], skip_special_tokens=True)


def _max_new_tokens(settings: dict[str, Any]) -> int:
    """settings.max_new_tokens as a count of tokens: a value edited into pipeline.json that is not one is one
    sentence, not a line read to no length (0) or onnxruntime's error (a string)."""
    value = settings["max_new_tokens"]
    if type(value) is not int or value < 1:
        raise UserError(f"pipeline.json: settings.max_new_tokens={value!r}: give a whole number, 1 or more.")
    return value


PIPELINE = register(
    Pipeline(
        "trocr",
        "VisionEncoderDecoderModel",
        pieces,
        [("encoder.line_features", "decoder.encoder_hidden_states", "")],
        run,
        settings=settings,
        names=("encoder", "decoder"),
        needs=(
            "image_size",
            "mean",
            "std",
            "layers",
            "heads",
            "head_dim",
            "start_token",
            "eos_token",
            "max_new_tokens",
        ),
    )
)
