"""The schemas Hydra checks the config against: each config group option's dataclass (SCHEMAS), stored in
Hydra's ConfigStore by `register()`, which run.py calls before Hydra composes (it imports nothing heavy).

Where things live: the types in onn/config/<group>.py (run.py: the root and the blocks every run has), the
values in the YAML files under conf/. A conf option names its schema in its defaults list
(`/schema/data/image@_here_`), so an unknown or misspelt key and a wrong type fail at compose time with
Hydra's own message (`trainer.max_steps=abc`: "Value 'abc' of type 'str' could not be converted to Integer").
app.run turns the composed config into these dataclasses (OmegaConf.to_object) and every layer reads them; a key
Hydra's `+` added that no dataclass has is one sentence there (app.to_config), as OmegaConf would drop it.

A new key: add the field to its dataclass (type, `MISSING`, a comment saying what it holds), give its value
in the option's YAML, and read it as an attribute.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from onn.config import data, export, model, task
from onn.config.run import ONNConfig

# The schemas each conf option names in its defaults list: /schema/<group>/<name>
SCHEMAS: dict[str, dict[str, type]] = {
    "data": {"image": data.ImageData, "audio": data.AudioData, "video": data.VideoData,
             "mesh": data.MeshData, "text": data.TextData, "pairs": data.PairsData, "graph": data.GraphData},
    "model": {"language": model.LanguageModelConfig, "network": model.NetworkConfig,
              "dual_encoder": model.DualEncoderConfig, "graph_network": model.GraphNetworkConfig,
              "denoiser": model.DenoiserConfig},
    "task": {"train": task.TrainTask, "eval": task.EvalTask, "infer": task.InferTask,
             "bench": task.BenchTask, "bench_giant": task.BenchGiantTask, "bench_gpu": task.BenchGpuTask,
             "bench_overhead": task.BenchOverheadTask, "bench_vision": task.BenchVisionTask,
             "bench_serve": task.BenchServeTask, "bench_shard_plan": task.BenchShardPlanTask,
             "bench_omny": task.BenchOmnyTask,
             "bench_chaos": task.BenchChaosTask,
             "bench_streaming": task.BenchStreamingTask,
             "bench_streamed_arch": task.BenchStreamedArchTask},
    "export": {"none": export.ExportConfig, "safetensors": export.SafetensorsExport, "onnx": export.OnnxExport,
               "omny": export.OmnyExport},
}  # fmt: skip


def register() -> None:
    """Give Hydra the root schema (conf/config.yaml's defaults list names `onn_schema`), each option's schema
    under /schema/<group>/<name>, and ONN's `hydra/launcher=submitit_local` (see register_local_launcher)."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(name="onn_schema", node=ONNConfig)
    for group, schemas in SCHEMAS.items():
        for name, schema in schemas.items():
            store.store(group=f"schema/{group}", name=name, node=schema)
    register_local_launcher()


def register_local_launcher() -> None:
    """`hydra/launcher=submitit_local` with a cap on the jobs running at once (hydra_plugins/onn_launcher).

    The plugin registers its own `submitit_local` when Hydra scans its plugins, and a YAML file of that name
    would be merged into the plugin's schema, which has no `array_parallelism`. So the scan runs here, once
    (Hydra would run it a moment later anyway), and this entry replaces the plugin's."""
    from hydra.core.config_store import ConfigStore
    from hydra.core.plugins import Plugins

    Plugins.instance()
    try:
        from hydra_plugins.hydra_submitit_launcher.config import LocalQueueConf
    except ImportError:  # hydra-submitit-launcher not installed: sweeps run one job after another
        return

    @dataclass
    class ThrottledLocalConf(LocalQueueConf):
        _target_: str = "hydra_plugins.onn_launcher.ThrottledLocalLauncher"
        array_parallelism: int = 2  # jobs running at once, in groups (the next group starts when one ends)
        timeout_min: int = 1440  # a job still running after this is killed (submitit's default is 60)
        # One folder for every job's logs and results (named by job id), not a folder per job (`%j`): submitit's
        # local controller opens its log in the job's folder before the submitting process has made it, and on
        # a busy machine it loses that race (FileNotFoundError, the job never runs).
        submitit_folder: str = "${hydra.sweep.dir}/.submitit"

    ConfigStore.instance().store(group="hydra/launcher", name="submitit_local", node=ThrottledLocalConf, provider="onn")


def yaml_problem(argv: list[str], conf_dir: Path) -> str | None:
    """The first YAML file the command line picks (`recipe=NAME`, `model=a,b`, ...) that does not parse, as one
    sentence naming its line; Hydra would print its YAML parser's traceback. None when each parses."""
    import yaml

    for arg in argv:
        group, _, names = arg.lstrip("+~").partition("=")
        if not names or "." in group or "/" in group:
            continue  # a key's value, or hydra/launcher=...
        for name in names.split(","):
            path = conf_dir / group / f"{name.strip()}.yaml"
            if not path.is_file():
                continue  # Hydra names the options a misspelt one could be
            try:
                yaml.safe_load(path.read_text())
            except yaml.YAMLError as e:
                mark = getattr(e, "problem_mark", None)
                where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
                problem = getattr(e, "problem", None) or str(e).splitlines()[0]
                return f"{path.resolve()}{where}: {problem}; fix the YAML there."
    return None
