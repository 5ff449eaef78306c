"""What a modality is: the one interface app and the tasks talk to, whatever the data.

A modality (text, image, ...) is a package under onn/modalities/: its `modality.py` subclasses `Modality`
and its `__init__.py` registers an instance (onn/modalities/registry.py). It brings:

  sniff      does a file or folder hold its kind of data (for `data=auto`)? a reason, or None
  check      its config keys, checked before anything heavy starts
  plan       the model sized on the meta device and the settings for this hardware
  train, evaluate, infer, export
             the tasks, run on a `Job`
  pair_side  the modality as one side of a dual encoder (onn/modalities/pairs), when it can be one

`default_data` and `default_model` name the conf/data and conf/model options `data=auto` picks; an explicit
data config with no model named (command line or recipe) takes `default_model` too (app.compose_chosen).
The hooks import their implementation (and with it torch, Lightning, transformers) when called,
so that composing a config, `--help` and `task=plan` stay fast.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from onn.config import DataConfig, ModelConfig, ONNConfig
from onn.config.model import NetworkConfig
from onn.config.run import PairSideConfig
from onn.errors import UserError
from onn.hardware.cluster import compute_device
from onn.hardware.profile import Profile
from onn.planning.plan import Plan

if TYPE_CHECKING:
    import torch
    from torch import nn

    from onn.hardware.profile import Profile
    from onn.planning.plan import Plan
    from onn.planning.spec import ModelSpec

# What a classifier's hooks read: a run's config, or one side's of a dual encoder (its data, model, seed, paths)
RunConfig = ONNConfig | PairSideConfig


@dataclass
class Job:
    """Everything a task works on: the resolved config, where it writes, and what was planned."""

    config: ONNConfig
    run_dir: Path
    modality: Modality
    hardware: Profile | None = None
    plan: Plan | None = None
    spec: ModelSpec | None = None
    ckpt: Path | None = None  # the checkpoint to resume or to evaluate, infer with and export

    @property
    def device(self) -> str:
        """The compute device the plan runs on (`cuda:N` on a GPU: this process's own)."""
        return compute_device(self.plan.hardware["accelerator"] if self.plan else "cpu")


class Modality:
    """A kind of data and the models that learn from it. Subclass, fill in the hooks, `register`."""

    name: str = ""
    default_data: str = ""  # the conf/data option `data=auto` switches to
    default_model: str = ""  # the conf/model option used when the command line names none
    description: str = ""  # one line for messages ("prompt/answer text", "image classification")
    data_schema: type[DataConfig] = DataConfig  # its conf/data options' type (onn/config/data.py)
    model_schema: type[ModelConfig] = ModelConfig  # the type of the models it trains (onn/config/model.py)
    # export=onnx's graphs: one (False: a DIR/NAME.onnx file), several (True: the folder DIR/NAME/), or None where
    # only the built model tells (a language model may be a pipeline); app checks export.output by it before training
    several_graphs: bool | None = None
    sniff_priority: int = 0  # data=auto asks higher first: specific modalities before text, which reads any UTF-8
    builtins: tuple[
        str, ...
    ] = ()  # its generated datasets, data.source=builtin:NAME (data=auto picks the modality by name)

    def reader_version(self) -> int:
        """The version of what its reader decodes from a file, raised when the same file decodes otherwise: a cache
        of decoded items keyed by it (the pairs modality's, of every side) is not read after such a change."""
        return 1

    def sniff(self, path: Path) -> str | None:
        """Why `path` holds this modality's data (a short reason), or None. Reads little, and only regular files."""
        return None

    def check(self, config: ONNConfig) -> None:
        """Raise UserError for a setting that cannot work, before anything is loaded or written."""

    # The plan and the tasks live in the module `implementation` names, imported when first used (it brings
    # torch and Lightning, which composing a config, --help and task=plan never import for other modalities):
    # plan(modality, config, hardware, use_tuned) -> (plan, ModelSpec), and train, evaluate, infer, export and
    # serving (what task=serve answers with), each of a Job.
    implementation: str = ""

    def _implementation(self, name: str, task: str | None = None):
        """The implementation's function `name` (task=`task` is not available without one)."""
        import importlib

        module = importlib.import_module(self.implementation) if self.implementation else None
        if module is None or not hasattr(module, name):
            self._unsupported(task or name)
        return getattr(module, name)

    def plan(self, config: ONNConfig, hardware: Profile, use_tuned: bool = True):
        """(plan, ModelSpec) for this config on this hardware."""
        return self._implementation("plan")(self, config, hardware, use_tuned)

    def train(self, job: Job) -> dict[str, Any]:
        return self._implementation("train")(job)

    def evaluate(self, job: Job) -> dict[str, Any]:
        return self._implementation("evaluate", "eval")(job)

    def infer(self, job: Job) -> dict[str, Any]:
        return self._implementation("infer")(job)

    def export(self, job: Job) -> dict[str, Any]:
        return self._implementation("export")(job)

    def serving(self, job: Job) -> Any:
        """What task=serve answers requests with (onn/tasks/serve): a text modality's LanguageModel
        (onn/modalities/text/generate.py), a classifier's Predictor (onn/modalities/classification.py)."""
        return self._implementation("serving", "serve")(job)

    def pair_side(self, config: PairSideConfig) -> PairSide:
        """This modality as one side of a dual encoder (onn/modalities/pairs). `config` is the side's run config
        (its modality's data and model configs holding the side's settings, the seed, paths)."""
        raise UserError(f"{self.name} data ({self.description}) cannot be one side of a pair.")

    def _unsupported(self, task: str) -> dict[str, Any]:
        raise UserError(f"task={task} is not available for {self.name} data.")

    def __repr__(self) -> str:
        return f"<modality {self.name}>"


class PairSide(Protocol):
    """One modality as one side of a dual encoder: what the pairs modality asks of it (Modality.pair_side).

    Items are stored as the modality stores them (uint8 pixels, float points, token ids); the encoder
    turns a batch of them into features, augmenting while it is in training mode."""

    name: str  # the modality's name
    config: PairSideConfig  # the side's run config (data, model, seed, paths): saved (as_dict), it rebuilds the side

    def read(self, items: list[Path | str]) -> tuple[torch.Tensor, list[int], list[tuple[int, str]]]:
        """Files (or, for text, the strings themselves) as one stored tensor [n, ...] of the items that could
        be read, their positions in `items`, and (position, reason) for each one that could not."""
        ...

    def encoder(self, width: int) -> nn.Module:
        """A module from a stored batch to features [batch, width] (its `network` is what is sized and exported,
        `prepare(x, train)` the batch transform in front of it)."""
        ...

    def sample(self, batch: int) -> torch.Tensor:
        """A stored batch of zeros of the side's shape and dtype, to size and trace the encoder."""
        ...


class ClassifierModality(Modality):
    """A modality whose models put one input in one of N classes (images, sounds, clips, shapes).

    Subclasses fill in the hooks; planning, training, evaluation, inference and export are shared
    (onn/modalities/classification.py, imported when a classifier first runs: it brings Lightning)."""

    model_schema = NetworkConfig
    several_graphs = False  # one network, one graph
    stored_dtype: str = "float32"  # the dtype its datasets hold inputs in (uint8 pixels, float16 samples, ...)

    def datamodule(self, config: ONNConfig, device: str):
        """The data config's dataset, a ClassificationData (not set up yet)."""
        raise NotImplementedError

    def network(self, model_cfg: NetworkConfig, inputs: dict[str, Any]):
        """The model config's nn.Module for `inputs` (input_shape, classes)."""
        raise NotImplementedError

    def transform(self, config: RunConfig, inputs: dict[str, Any]):
        """Stored batch -> network input, called as transform(x, train=...); None: x.float()."""
        return None

    def input_stats(self, config: ONNConfig, dm) -> dict[str, Any]:
        """What the transform needs from the training data (e.g. mean/std); saved in `inputs`."""
        return {}

    def neutral_stats(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """Stand-ins for input_stats where no data has been read (task=plan, export without a checkpoint)."""
        return {}

    def planned_inputs(self, config: RunConfig) -> dict[str, Any]:
        """`inputs` from the config alone: input_shape and classes."""
        raise NotImplementedError

    def read_inputs(self, source: Path, inputs: dict[str, Any], config: RunConfig) -> dict[str, Any]:
        """task.input (a file, a folder, an archive) as {split: Decoded}, decoded as the training data was."""
        raise NotImplementedError

    def picture(
        self, samples, predicted: list[str], true: list[str | None], path: Path, inputs: dict[str, Any]
    ) -> None:
        """A PNG of inputs (stored form) captioned with their predicted (and true) classes."""

    def classifier_class(self):
        """The LightningModule class that trains its networks: the shared Classifier, or a subclass where its
        batches differ (graphs: a torch_geometric Batch)."""
        from onn.training.classifier import Classifier

        return Classifier

    def export_network(self, config: ONNConfig, module, run_dir: Path) -> dict[str, Any] | None:
        """Its own export of a trained classifier's network (export/* metrics), or None for the shared one."""
        return None

    # -- shared: onn/modalities/classification.py -------------------------------------------------
    implementation = "onn.modalities.classification"

    def pair_side(self, config: PairSideConfig) -> PairSide:
        """Its network (with `width` outputs) as the encoder, its transform, and read_inputs for the files."""
        return self._implementation("ClassifierSide")(self, config)


class MediaModality(ClassifierModality):
    """A classifier of media decoded from files (audio, video): the READER (onn.data.media.MediaReader) of its
    `dataset` module lists and decodes them, for its datasets, for inference and for task=bench_media."""

    dataset: str = ""  # the module that holds READER

    def reader(self):
        import importlib

        return importlib.import_module(self.dataset).READER

    def reader_version(self) -> int:
        return self.reader().version

    def read_inputs(self, source: Path, inputs: dict[str, Any], config: RunConfig):
        reader = self.reader()
        fit, known = reader.fit(inputs), [str(c) for c in inputs["classes"]]  # known: a lone class folder is that class
        decoded, _ = reader.read(str(source), config.data, fit, key="task.input", allow_unlabelled=True, known=known)
        return decoded
