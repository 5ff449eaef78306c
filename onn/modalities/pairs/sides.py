"""The two sides of a dual encoder, looked up in the modality registry: which modality a file is, and
each side's settings, reader and encoder.

A side is `REGISTRY[name].pair_side(config)` (base.PairSide): any classifier modality (image, mesh, audio,
video) brings its network, transform and reader that way with no code here. Its settings are the
modality's own data and model configs (conf/data/<its default_data>.yaml, conf/model/<its
default_model>.yaml) with the overrides under data.sides.<name> and model.sides.<name> on top.

Text is the exception: ONN's text modality trains causal language models on prompt/answer records,
while a pair's text is a short caption read here (a .txt file, or a metadata column) and encoded by
the zoo's small byte-level text encoder (onn/models/zoo/text_encoder.py).
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from onn.config import ONNConfig, typed
from onn.config.data import CaptionData
from onn.config.model import NetworkConfig
from onn.config.run import PairSideConfig, PathsConfig
from onn.errors import UserError
from onn.modalities.base import Modality, PairSide
from onn.modalities.registry import REGISTRY

log = logging.getLogger("onn")
TEXT = "text"
TEXT_SUFFIXES = (".txt",)
CONF = Path(__file__).resolve().parents[3] / "conf"
# never asked whether a file is theirs: pairs itself, and text (any UTF-8 file reads as text; captions are .txt)
NOT_SIDES = ("pairs", TEXT)


def registered(name: str) -> Modality:
    """The registered modality `name` that can be a side, or a UserError naming those that can."""
    if name in NOT_SIDES or name not in REGISTRY:
        known = ", ".join(sorted({TEXT, *REGISTRY} - {"pairs"}))
        raise UserError(f"data.modalities: {name} is not a modality a pair can have ({known}).")
    return REGISTRY[name]


def option_values(group: str, option: str, key: str) -> dict[str, Any]:
    """conf/<group>/<option>.yaml's values as a plain dict: the options of its group its defaults list names
    (conf/data/cifar10.yaml: image), then its own keys. The schema it names is applied by `typed`."""
    from omegaconf import OmegaConf

    path = CONF / group / f"{option}.yaml"
    if not path.is_file():
        raise UserError(
            f"{key}: there is no conf/{group}/{option}.yaml to take the side's settings from; "
            f"give them under {key} (a dict of that group's keys)."
        )
    own = OmegaConf.load(path)
    parents = [d for d in own.pop("defaults", None) or [] if isinstance(d, str) and d != "_self_" and "/" not in d]
    values = OmegaConf.merge(*(option_values(group, d, key) for d in parents), own) if parents else own
    return OmegaConf.to_container(values, resolve=True)


def side_config(name: str, config: ONNConfig) -> PairSideConfig:
    """The run config the side `name` works with: its modality's data and model configs, overridden by
    data.sides.<name> (a dict of keys) and model.sides.<name> (a conf/model option, or a dict of keys)."""
    data_over = config.data.sides.get(name) or {}
    model_over = config.model.sides.get(name) or {}
    if name == TEXT:
        data_schema, model_schema, data_base, model_option = CaptionData, NetworkConfig, {}, "text_encoder"
    else:
        modality = registered(name)
        data_schema, model_schema, model_option = (
            modality.data_schema,
            modality.model_schema,
            modality.default_model,
        )
        data_base = option_values("data", modality.default_data, f"data.sides.{name}")
    if isinstance(model_over, str):
        model_option, model_over = model_over, {}
    if not isinstance(data_over, dict) or not isinstance(model_over, dict):
        raise UserError(
            f"data.sides.{name} / model.sides.{name}: give a dict of that group's keys (model: or an option name)."
        )
    model = {**option_values("model", model_option, f"model.sides.{name}"), **model_over}
    return PairSideConfig(
        data=typed(data_schema, merged(data_base, data_over), f"data.sides.{name}"),
        model=typed(model_schema, model, f"model.sides.{name}"),
        seed=config.seed,
        paths=config.paths,
    )


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` on top of `base`, nested dicts key by key: data.sides.audio.features.normalize=... keeps the other
    features keys (a whole-dict replace failed as "missing mandatory value: n_mels")."""
    out = dict(base)
    for key, value in over.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = merged(out[key], value) if both else value
    return out


# a saved side's mark: its data.mean and data.std normalised its inputs (a side saved without it trained on the
# modality's neutral 0.5 whatever they said, and is read so)
STATS_USED = "stats_used"


def saved_side(name: str, saved: dict[str, Any], where: str) -> PairSideConfig:
    """A side's run config as a pairs checkpoint saved it (as_dict of side_config), typed again."""
    if name == TEXT:
        data_schema, model_schema = CaptionData, NetworkConfig
    else:
        data_schema, model_schema = registered(name).data_schema, registered(name).model_schema
    data = typed(data_schema, saved["data"], f"{where}: sides.{name}.data")
    if STATS_USED not in saved and {"mean", "std"} <= {f.name for f in fields(data)}:
        data = replace(data, mean="auto", std="auto")  # saved before a side's mean/std were used: it trained on 0.5
    return PairSideConfig(
        data=data,
        model=typed(model_schema, saved["model"], f"{where}: sides.{name}.model"),
        seed=int(saved["seed"]),
        paths=typed(PathsConfig, saved["paths"], f"{where}: sides.{name}.paths"),
    )


def build_side(name: str, side_cfg: PairSideConfig) -> PairSide:
    """The side for modality `name` from its run config (side_config, or saved_side of a checkpoint's)."""
    if name == TEXT:
        return TextSide(side_cfg)
    return registered(name).pair_side(side_cfg)


def modality_of(suffix: str, example: Path) -> str | None:
    """Which modality a file with this suffix holds, asked of the registered modalities' sniffers with one
    example file (the most specific first); .txt is a caption."""
    if suffix in TEXT_SUFFIXES:
        return TEXT
    for modality in sorted(REGISTRY.values(), key=lambda m: -m.sniff_priority):
        if modality.name in NOT_SIDES:
            continue
        try:
            if modality.sniff(example):
                return modality.name
        except (UserError, OSError, ValueError):
            continue
    return None


def modality_of_bytes(suffix: str, head: bytes) -> str | None:
    """modality_of for an archive member: its bytes are written to a temporary file of the same suffix."""
    if suffix in TEXT_SUFFIXES:
        return TEXT
    fd, name = tempfile.mkstemp(suffix=suffix, prefix="onn-sniff-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(head)
        return modality_of(suffix, Path(name))
    finally:
        os.unlink(name)


class TextSide:
    """Captions as one side of a pair: UTF-8 text (whitespace runs made one space), ONN's byte tokenizer
    (cut and padded to data.sides.text.max_length), the zoo's text encoder."""

    name = TEXT

    def __init__(self, config: PairSideConfig):
        self.config = config
        self.max_length = config.data.max_length
        self.cut_said = False  # the cut captions are said once per side (infer reads a gallery a chunk at a time)
        if isinstance(self.max_length, bool) or not isinstance(self.max_length, int) or self.max_length < 1:
            raise UserError(
                f"data.sides.text.max_length={self.max_length!r}: give the bytes kept of each text, 1 or more."
            )

    def read(self, items: list[Path | str]) -> tuple[Any, list[int], list[tuple[int, str]]]:
        import torch

        from onn.data.files import read_file

        texts, index, skipped = [], [], []
        for i, item in enumerate(items):
            if isinstance(item, Path):
                try:
                    text = read_file(item).decode("utf-8-sig")
                except UnicodeDecodeError:
                    skipped.append((i, "not UTF-8 text"))
                    continue
                except OSError as e:
                    skipped.append((i, f"cannot be read ({e.strerror or e})"))
                    continue
            else:
                text = str(item)
            text = " ".join(text.split())
            if not text:
                skipped.append((i, "empty text"))
                continue
            texts.append(text)
            index.append(i)
        self.say_cut(texts)
        tokenizer = self.tokenizer()
        ids = (
            tokenizer(
                texts, add_special_tokens=False, truncation=True, max_length=self.max_length, padding="max_length"
            )["input_ids"]
            if texts
            else []
        )
        return torch.tensor(ids, dtype=torch.long).reshape(len(texts), self.max_length), index, skipped

    def say_cut(self, texts: list[str]) -> None:
        """Warn of the texts the tokenizer cuts at max_length bytes: a caption's end ("... on the left") may be what
        tells it apart, and a cut one trains and ranks as its first max_length bytes without a word. Said for the
        first read that cuts any (a 100,000-caption gallery is read in a hundred chunks)."""
        sizes = [len(t.encode("utf-8")) for t in texts]
        cut = [i for i, size in enumerate(sizes) if size > self.max_length]
        if cut and not self.cut_said:
            self.cut_said = True
            longest = max(cut, key=lambda i: sizes[i])
            log.warning(
                "captions: %d of %d are longer than data.sides.text.max_length=%d bytes and are cut there (the "
                "longest, %d bytes: %r); a dual encoder trained with a larger max_length keeps them whole",
                len(cut),
                len(texts),
                self.max_length,
                sizes[longest],
                texts[longest][:80],
            )

    @staticmethod
    def tokenizer():
        from onn.models.tokenizer import byte_tokenizer

        return byte_tokenizer()

    def encoder(self, width: int):
        from onn.modalities.classification import SideEncoder
        from onn.models.zoo.registry import build_zoo

        model: NetworkConfig = self.config.model
        name = model.source.partition(":")[2]
        try:
            tokenizer = self.tokenizer()
            network = build_zoo(
                name,
                out_features=width,
                max_length=self.max_length,
                vocab_size=len(tokenizer),
                pad_id=tokenizer.pad_token_id,
                **model.kwargs,
            )
        except TypeError as e:
            raise UserError(f"model.sides.text.kwargs does not fit {model.source}: {e}; fix or remove that key.") from e
        return SideEncoder(None, network)

    def sample(self, batch: int):
        import torch

        return torch.zeros(batch, self.max_length, dtype=torch.long)
