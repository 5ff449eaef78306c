"""SAM2 as the runtime uses it: an image encoder run once per image, and a prompt decoder run once per prompt
(points, or a box as its two corners with labels 2 and 3) on the image's embeddings."""

from __future__ import annotations

from typing import Any

import numpy as np

from onn.export.pipelines import images
from onn.export.pipelines.registry import Piece, Pipeline, register
from onn.export.pipelines.runtime import Pieces, Request, check_points, finish

IMAGENET = {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}
FEATURES = ("high_res_feats_0", "high_res_feats_1", "image_embeddings")
NAMES = ("image_encoder", "prompt_decoder")
NEEDS = ("image_size", "mean", "std")  # settings() and what segment() reads


def _modules():
    import torch

    class ImageEncoder(torch.nn.Module):
        """pixel_values -> the two high-resolution feature maps and the image embedding the decoder reads."""

        def __init__(self, sam):
            super().__init__()
            self.model = sam

        def forward(self, pixel_values):
            # Sam2Model.get_image_embeddings, without its no_grad: under it the exporter drops the module scopes
            # the cut points are found by
            sam = self.model
            maps = sam.get_image_features(pixel_values, return_dict=True).fpn_hidden_states
            maps[-1] = maps[-1] + sam.no_memory_embedding
            shaped = [m.permute(1, 2, 0).view(1, -1, *size) for m, size in zip(maps, sam.backbone_feature_sizes)]
            return dict(zip(FEATURES, shaped))

    class PromptDecoder(torch.nn.Module):
        """An image's features and prompts (points [1, prompts, points, 2] in the encoder's pixels, labels 1
        object, 0 background, 2 and 3 a box's corners, -10 padding) -> low-resolution masks and IoU scores."""

        def __init__(self, sam):
            super().__init__()
            self.model = sam

        def forward(self, high_res_feats_0, high_res_feats_1, image_embeddings, input_points, input_labels):
            out = self.model(
                image_embeddings=[high_res_feats_0, high_res_feats_1, image_embeddings],
                input_points=input_points,
                input_labels=input_labels,
                multimask_output=True,
            )
            return {"pred_masks": out.pred_masks, "iou_scores": out.iou_scores}

    return ImageEncoder, PromptDecoder


def pieces(sam, side: int | None = None) -> list[Piece]:
    """SAM2's two pieces at its own image size (`side` is the detector's: SAM2's prompt encoder fixes its own)."""
    import torch

    ImageEncoder, PromptDecoder = _modules()
    side = sam.config.prompt_encoder_config.image_size
    encoder = ImageEncoder(sam).eval()
    pixels = torch.randn(1, 3, side, side, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        features = encoder(pixels)
    blocks = [f"model.vision_encoder.backbone.blocks.{i}" for i in range(len(sam.vision_encoder.backbone.blocks))]
    layers = [f"model.mask_decoder.transformer.layers.{i}" for i in range(len(sam.mask_decoder.transformer.layers))]
    points = torch.tensor(
        [[[[side * 0.25, side * 0.5], [side * 0.6, side * 0.4]], [[side * 0.1, side * 0.1], [side * 0.8, side * 0.9]]]]
    )
    labels = torch.tensor([[[1, 0], [2, 3]]])  # a point with a background point; a box
    prompts = {"input_points": {1: "prompts", 2: "points"}, "input_labels": {1: "prompts", 2: "points"}}
    return [
        Piece("image_encoder", encoder, {"pixel_values": pixels}, runs=[blocks], when="once per image"),
        Piece(
            "prompt_decoder",
            PromptDecoder(sam).eval(),
            {**features, "input_points": points, "input_labels": labels},
            axes=prompts,
            runs=[layers],
            when="once per prompt batch",
        ),
    ]


def settings(sam, side: int | None = None) -> dict[str, Any]:
    return {"image_size": sam.config.prompt_encoder_config.image_size, **IMAGENET}


def segment(pieces_: Pieces, image, prompts: list[list[tuple[float, float, int]]], s: dict):
    """Masks (image-sized booleans) and scores for prompts given in the image's pixels: one list of (x, y,
    label) per object. The image is encoded once; every prompt goes to the decoder in one batch. The image's
    features stay where the encoder computed them (a GPU under CUDA), the decoder's input as they are."""
    side = s["image_size"]
    pixels = images.normalised(image, (side, side), **_ms(s))
    features = pieces_.run("image_encoder", {"pixel_values": pixels}, keep=FEATURES)
    width, height = image.size
    longest = max(len(p) for p in prompts)
    points = np.zeros((1, len(prompts), longest, 2), np.float32)
    labels = np.full((1, len(prompts), longest), -10, np.int64)  # -10: padding, ignored
    for k, prompt in enumerate(prompts):
        for j, (x, y, label) in enumerate(prompt):
            points[0, k, j] = (x * side / width, y * side / height)
            labels[0, k, j] = label
    feeds = {name: features[name] for name in FEATURES} | {"input_points": points, "input_labels": labels}
    out = pieces_.run("prompt_decoder", feeds)
    best = out["iou_scores"][0].argmax(-1)
    masks = [images.upsampled(out["pred_masks"][0, k, best[k]], (width, height)) for k in range(len(prompts))]
    return masks, [float(out["iou_scores"][0, k, best[k]]) for k in range(len(prompts))]


def _ms(s: dict) -> dict:
    return {"mean": s["mean"], "std": s["std"]}


def run(doc: dict[str, Any], pieces_: Pieces, request: Request) -> dict[str, Any]:
    image = images.load_rgb(request.image)
    points = request.points or [(image.width / 2, image.height / 2)]
    check_points(points, image.size)
    masks, scores = segment(pieces_, image, [[(x, y, 1)] for x, y in points], doc["settings"])
    picture = images.annotate(images.overlay(image, masks), points=points)
    found = [
        {"point": list(p), "score": round(s, 4), **images.describe_mask(m)} for p, s, m in zip(points, scores, masks)
    ]
    return finish(request, picture, {"size": list(image.size), "masks": found})


PIPELINE = register(
    Pipeline(
        kind="sam2",
        model_class="Sam2Model",
        pieces=pieces,
        connections=[(f"image_encoder.{f}", f"prompt_decoder.{f}", "") for f in FEATURES],
        run=run,
        settings=settings,
        names=NAMES,
        needs=NEEDS,
        takes=frozenset({"points"}),
    )
)
