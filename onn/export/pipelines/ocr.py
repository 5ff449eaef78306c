"""TrOCR as the runtime uses it: an image encoder (one text line in, its features out) and an autoregressive
decoder whose self-attention keys and values of the tokens so far are explicit inputs and outputs
(past.N.key -> present.N.key), so each step computes one token. A page is cut into its lines first (`lines`:
rows of ink between blank rows) and each line is read greedily, until its end-of-text token or settings.max_new_tokens
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
    """Text lines of a page as (x0, y0, x1, y1): bands of rows holding ink (darker than the page's mid-grey
    between ink and paper), split at blank rows; the whole page when it has no such band."""
    height, width = gray.shape
    ink = gray < (float(gray.min()) + float(np.median(gray))) / 2
    rows = ink.mean(1) > 0.002
    bands, start = [], None
    for y, filled in enumerate([*rows, False]):
        if filled and start is None:
            start = y
        elif not filled and start is not None:
            if y - start >= 4:
                bands.append((start, y))
            start = None
    out = []
    for y0, y1 in bands:
        cols = np.nonzero(ink[y0:y1].any(0))[0]
        pad = max(2, (y1 - y0) // 4)
        out.append(
            (max(0, int(cols[0]) - pad), max(0, y0 - pad), min(width, int(cols[-1]) + pad + 1), min(height, y1 + pad))
        )
    return out or [(0, 0, width, height)]


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
        read = [_read(pieces_, page, box, doc["settings"], tokenizer) | {"page": number} for box in _lines(page)]
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


def _lines(page) -> list[tuple[int, int, int, int]]:
    return lines(np.asarray(page.convert("L"), np.float32))


def _read(pieces_: Pieces, page, box: tuple[int, int, int, int], s: dict, tokenizer) -> dict[str, Any]:
    """One line of a page read: its box, text and token ids, and whether settings.max_new_tokens cut it."""
    ids = read_line(pieces_, page.crop(box), s)
    known = [t for t in ids if tokenizer is None or t < tokenizer.get_vocab_size()]
    text = tokenizer.decode(known, skip_special_tokens=True) if tokenizer is not None else " ".join(map(str, ids))
    # no end-of-text token within the limit: the rest of the line is unread
    return {"box": list(box), "text": text, "token_ids": ids, "cut_at_max_new_tokens": len(ids) >= s["max_new_tokens"]}


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
