"""Grounding DINO (boxes for the phrases of a text prompt) and Grounded SAM2 (those boxes segmented by SAM2).

The detector piece takes the tokenizer's output as explicit inputs: the ids, attention mask and token types,
and the per-phrase text attention mask and position ids that transformers computes from the ids with cummax
(which ONNX lacks): `text_masks` computes them in numpy, as transformers does in torch.

Its queries start from the encoder's best-scored proposals (torch.topk of 900 of some 13,000 scores, the
two-stage selection). Those scores meet ties (the proposals at the feature maps' borders all score alike) and
near-ties closer than fp32's differences between PyTorch and onnxruntime, which the two may order otherwise,
so the piece also returns the proposals it chose, and its export check makes PyTorch take onnxruntime's
(`Detector.choosing`) once it has checked that they are a top-k of PyTorch's own scores too.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

import numpy as np

from onn.errors import UserError
from onn.export.pipelines import images, sam2
from onn.export.pipelines.registry import Piece, Pipeline, register
from onn.export.pipelines.runtime import Pieces, Request, finish

SPECIAL_IDS = [101, 102, 1012, 1029]  # [CLS] [SEP] . ? in BERT's vocabulary: phrases lie between them
CHOICE_RTOL = 1e-3  # how far below PyTorch's k-th best score a proposal onnxruntime chose may score (x largest)
_SWIN_BLOCK = re.compile(r"encoder\.layers\.\d+\.blocks\.\d+$")  # a block of one of Swin's stages
SIDE = 800  # the detector's square canvas when export.sample.image_size gives none (its processor's shorter edge)
INPUTS = (
    "pixel_values",
    "pixel_mask",
    "input_ids",
    "attention_mask",
    "token_type_ids",
    "text_self_attention_masks",
    "position_ids",
)


@contextlib.contextmanager
def _given_text_masks(masks, positions):
    """transformers' forward computes the text masks from the ids; while tracing, it takes the given ones."""
    from transformers.models.grounding_dino import modeling_grounding_dino as gd

    made = gd.generate_masks_with_special_tokens_and_transfer_map
    gd.generate_masks_with_special_tokens_and_transfer_map = lambda *args, **kwargs: (masks, positions)
    try:
        yield
    finally:
        gd.generate_masks_with_special_tokens_and_transfer_map = made


@contextlib.contextmanager
def _proposals(chosen: list, given=None):
    """Grounding DINO's query selection (its one torch.topk) records the proposals it takes in `chosen`, or takes
    the `given` ones (_check_choice)."""
    import torch

    topk = torch.topk

    def select(scores, k, dim=-1, *args, **kwargs):
        values, indices = topk(scores, k, dim, *args, **kwargs)
        if given is not None:
            indices = given.to(scores.device)
            _check_choice(scores, values, indices, dim)
            values = scores.gather(dim, indices)
        chosen.append(indices)
        return values, indices

    torch.topk = select
    try:
        yield
    finally:
        torch.topk = topk


def _check_choice(scores, best, given, dim: int) -> None:
    """`given` must be as many distinct proposals per image as PyTorch's own top-k (`best`), each scored at most
    CHOICE_RTOL x the largest finite score (at least 1) below PyTorch's k-th best: a top-k up to rounding."""
    if given.shape != best.shape or not given.sort(dim).values.diff(dim=dim).ne(0).all():
        raise UserError(
            f"the detector was given proposals of shape {tuple(given.shape)} with repeats or another shape; "
            f"it takes {tuple(best.shape)}, distinct in each image."
        )
    finite = scores[scores.isfinite()]
    scale = max(1.0, float(finite.abs().max())) if finite.numel() else 1.0
    short = float((best.amin(dim, keepdim=True) - scores.gather(dim, given)).max())
    if not short <= CHOICE_RTOL * scale:
        raise UserError(
            f"onnxruntime's detector chose proposals that PyTorch scores {short:.3g} below its own top "
            f"{best.shape[dim]}: the exported encoder computes other scores."
        )


def _detector():
    import torch

    class Detector(torch.nn.Module):
        """An image (letterboxed, with its pixel mask) and the tokenizer's output -> per-query token logits, boxes
        ([cx, cy, w, h], 0-1 of the picture) and the encoder proposal each query started from."""

        def __init__(self, model):
            super().__init__()
            self.model = model
            self.given = None  # proposals to take instead of the best-scored (choosing)

        @contextlib.contextmanager
        def choosing(self, outputs: dict[str, np.ndarray]):
            """forward takes the proposals in `outputs` (onnxruntime's, to compare the rest with them)."""
            self.given = torch.as_tensor(outputs["proposals"])
            try:
                yield
            finally:
                self.given = None

        def forward(
            self,
            pixel_values,
            pixel_mask,
            input_ids,
            attention_mask,
            token_type_ids,
            text_self_attention_masks,
            position_ids,
        ):
            chosen = []
            with _given_text_masks(text_self_attention_masks, position_ids), _proposals(chosen, self.given):
                out = self.model(
                    pixel_values=pixel_values,
                    pixel_mask=pixel_mask,
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    token_type_ids=token_type_ids,
                )
            return {"logits": out.logits, "pred_boxes": out.pred_boxes, "proposals": chosen[0]}

    return Detector


def text_masks(ids: np.ndarray, special: list[int] = SPECIAL_IDS) -> tuple[np.ndarray, np.ndarray]:
    """transformers' generate_masks_with_special_tokens_and_transfer_map in numpy: tokens attend within their
    phrase (up to the next special token), and count their positions from the phrase's start."""
    batch, length = ids.shape
    is_special = np.isin(ids, special)
    index = np.broadcast_to(np.arange(length), (batch, length))
    previous = np.maximum.accumulate(np.where(is_special, index, -1), axis=1)
    previous = np.concatenate([np.full((batch, 1), -1), previous[:, :-1]], axis=1)
    following = np.flip(np.minimum.accumulate(np.flip(np.where(is_special, index, length), 1), axis=1), 1)
    valid = (following != 0) & (following != length - 1) & (following != length)
    masks = (following[:, :, None] == following[:, None, :]) & valid[:, None, :]
    masks |= np.eye(length, dtype=bool)[None]
    positions = np.where(valid, index - previous - 1, 0).clip(min=0).astype(np.int64)
    return masks, positions


def pieces(model, segmenter=None, side: int | None = None) -> list[Piece]:
    import torch

    model.set_attn_implementation("eager")  # Swin's sdpa path reshapes a view the exporter cannot
    side = side or SIDE
    ids = torch.tensor([[101, 1037, 4937, 1012, 1037, 3899, 1012, 102]]).clamp(
        max=model.config.text_config.vocab_size - 1
    )
    masks, positions = (torch.from_numpy(a) for a in text_masks(ids.numpy()))
    sample = {
        "pixel_values": torch.randn(1, 3, side, side, generator=torch.Generator().manual_seed(0)),
        "pixel_mask": torch.ones(1, side, side, dtype=torch.long),
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "token_type_ids": torch.zeros_like(ids),
        "text_self_attention_masks": masks,
        "position_ids": positions,
    }
    text = {n: {1: "sequence"} for n in ("input_ids", "attention_mask", "token_type_ids", "position_ids")}
    text["text_self_attention_masks"] = {1: "sequence", 2: "sequence"}
    # in the order forward runs them: BERT's layers (two thirds of Grounding DINO-T's weights), Swin's blocks,
    # then the fusion encoder's and the decoder's layers
    bert = [f"model.model.text_backbone.encoder.layer.{i}" for i in range(len(model.model.text_backbone.encoder.layer))]
    swin = [
        f"model.model.backbone.{name}" for name, _ in model.model.backbone.named_modules() if _SWIN_BLOCK.search(name)
    ]
    fusion = [
        [f"model.model.{part}.layers.{i}" for i in range(len(getattr(model.model, part).layers))]
        for part in ("encoder", "decoder")
    ]
    runs = [bert, swin, *fusion]
    module = _detector()(model).eval()
    detector = Piece(
        "detector",
        module,
        sample,
        axes=text,
        bounds={"sequence": (2, model.config.max_text_len - 1)},
        runs=runs,
        when="once per image and prompt",
        follow=module.choosing,
    )
    return [detector] + (sam2.pieces(segmenter) if segmenter is not None else [])


def settings(model, segmenter=None, side: int | None = None) -> dict[str, Any]:
    detector = {
        "image_size": side or SIDE,
        **sam2.IMAGENET,
        "max_text_len": model.config.max_text_len,
        "special_ids": SPECIAL_IDS,
        "box_threshold": 0.35,
        "text_threshold": 0.25,
        "max_boxes": 5,
    }
    return {"detector": detector, **({"segmenter": sam2.settings(segmenter)} if segmenter is not None else {})}


def detect(pieces_: Pieces, image, text: str | None, s: dict, tokenizer) -> list[dict[str, Any]]:
    """Boxes (x0, y0, x1, y1 in the image's pixels), their scores and phrases, best first."""
    text = (text or "").strip().lower()
    if not text:
        raise UserError(
            '--text is empty: Grounding DINO finds the phrases of a text prompt; give one, e.g. --text "a cat."'
        )
    text = text if text.endswith((".", "?")) else text + "."
    ids = np.asarray([tokenizer.encode(text).ids], np.int64)
    if np.isin(ids, s["special_ids"]).all():  # "   ." : [CLS] . [SEP], no phrase between them
        raise UserError(
            f'--text "{text}" holds no phrase, only punctuation: give the words to find, e.g. --text "a cat."'
        )
    if ids.shape[1] > s["max_text_len"] - 1:
        raise UserError(f"--text is {ids.shape[1]} tokens long; the detector reads at most {s['max_text_len'] - 1}.")
    masks, positions = text_masks(ids, s["special_ids"])
    pixels, pixel_mask = images.letterboxed(image, s["image_size"], s["mean"], s["std"])
    feeds = dict(zip(INPUTS, (pixels, pixel_mask, ids, np.ones_like(ids), np.zeros_like(ids), masks, positions)))
    out = pieces_.run("detector", feeds)
    probs = 1 / (1 + np.exp(-out["logits"][0, :, : ids.shape[1]]))
    scores = probs.max(-1)
    # nothing above box_threshold is nothing found (as transformers' post-processing says), not the best guess
    order = [q for q in np.argsort(-scores) if scores[q] > s["box_threshold"]][: s["max_boxes"]]
    found = []
    for q in order:
        cx, cy, w, h = out["pred_boxes"][0, q]
        box = [
            float(v)
            for v in (
                (cx - w / 2) * image.width,
                (cy - h / 2) * image.height,
                (cx + w / 2) * image.width,
                (cy + h / 2) * image.height,
            )
        ]
        words = [int(t) for t, p in zip(ids[0], probs[q]) if p > s["text_threshold"] and t not in s["special_ids"]]
        found.append(
            {"box": [round(v, 1) for v in box], "score": round(float(scores[q]), 4), "phrase": tokenizer.decode(words)}
        )
    return found


def _tokenizer(pieces_: Pieces):
    tokenizer = pieces_.tokenizer()
    if tokenizer is None:
        raise UserError("the pipeline has no tokenizer.json; re-export it with a model that has a tokenizer.")
    return tokenizer


def run_detector(doc: dict[str, Any], pieces_: Pieces, request: Request) -> dict[str, Any]:
    image = images.load_rgb(request.image)
    found = detect(pieces_, image, request.text, doc["settings"]["detector"], _tokenizer(pieces_))
    picture = images.annotate(image, boxes=[(f["box"], f"{f['phrase']} {f['score']:.2f}") for f in found])
    return finish(request, picture, {"text": request.text, "boxes": found})


def run_grounded(doc: dict[str, Any], pieces_: Pieces, request: Request) -> dict[str, Any]:
    image = images.load_rgb(request.image)
    found = detect(pieces_, image, request.text, doc["settings"]["detector"], _tokenizer(pieces_))
    prompts = [[(f["box"][0], f["box"][1], 2), (f["box"][2], f["box"][3], 3)] for f in found]
    clipped = [
        [(min(max(x, 0), image.width - 1), min(max(y, 0), image.height - 1), k) for x, y, k in p] for p in prompts
    ]
    # no box found: nothing for SAM2 to segment (its decoder takes one prompt at least)
    masks, scores = sam2.segment(pieces_, image, clipped, doc["settings"]["segmenter"]) if clipped else ([], [])
    boxes = [(f["box"], f"{f['phrase']} {f['score']:.2f}") for f in found]
    picture = images.annotate(images.overlay(image, masks), boxes=boxes)
    for f, m, s in zip(found, masks, scores):
        f["mask"] = {"score": round(s, 4), **images.describe_mask(m)}
    return finish(request, picture, {"text": request.text, "objects": found})


DETECTOR_NEEDS = tuple(
    f"detector.{k}"
    for k in (
        "image_size",
        "mean",
        "std",
        "max_text_len",
        "special_ids",
        "box_threshold",
        "text_threshold",
        "max_boxes",
    )
)
DETECTOR = register(
    Pipeline(
        "grounding_dino",
        "GroundingDinoForObjectDetection",
        pieces,
        [],
        run_detector,
        settings=settings,
        names=("detector",),
        needs=DETECTOR_NEEDS,
        takes=frozenset({"text"}),
        canvas=True,
    )
)
GROUNDED = register(
    Pipeline(
        "grounded_sam2",
        "GroundingDinoForObjectDetection",
        pieces,
        [("detector.pred_boxes", "prompt_decoder.input_points", "boxes_to_prompts")]
        + [(f"image_encoder.{f}", f"prompt_decoder.{f}", "") for f in sam2.FEATURES],
        run_grounded,
        settings=settings,
        models=2,
        names=("detector", *sam2.NAMES),
        needs=DETECTOR_NEEDS + tuple(f"segmenter.{k}" for k in sam2.NEEDS),
        takes=frozenset({"text"}),
        canvas=True,
    )
)
