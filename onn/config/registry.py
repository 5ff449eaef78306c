"""The schemas Hydra checks the config against: each config group option's dataclass (SCHEMAS), stored in
Hydra's ConfigStore by `register()`, which run.py calls before Hydra composes (it imports nothing heavy).

Where things live: the types in onn/config/<group>.py (run.py: the root and the blocks every run has), the
values in the YAML files under conf/. A conf option names its schema in its defaults list
(`/schema/data/image@_here_`), so an unknown or misspelt key and a wrong type fail at compose time with
Hydra's own message (`trainer.max_steps=abc`: "Value 'abc' of type 'str' could not be converted to Integer").
app.run turns the composed config into these dataclasses (OmegaConf.to_object) and every layer reads them; a key
Hydra's `+` added that no dataclass has is one sentence there (app.to_config), as OmegaConf would drop it.

Before Hydra composes, run.py expands a leading `~` in the command line's values (expand_home: bash does not in
`data.source=~/x`, and Hydra's parser refuses it), and asks for the mistakes Hydra would report as a traceback or in
its own terms: a YAML file that does not parse or holds a key twice (yaml_problem), a group chosen twice or an
option it does not have (group_problem: `model=lama_small`, naming the closest), a value its key's type refuses, a
sweep's too (value_problem: `-m trainer.max_steps=10,abc`), a misspelt key (`trainer.max_epoch=3`,
naming the closest, or the block that has it: compose_problem, a sweep's too), a key or a whole block given for a
block that is null here, answered with the options that give it (block_owners), and a recipe's task keys under
another task (compose_problem). A recipe's block that the option chosen leaves null is app.to_config's to say
(recipe_group_problem), once the composed config names the key that has no value.

A new key: add the field to its dataclass (type, `MISSING`, a comment saying what it holds), give its value
in the option's YAML, and read it as an attribute.
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass, fields, is_dataclass
from functools import cache
from pathlib import Path
from types import UnionType
from typing import Any, Union, get_args, get_origin, get_type_hints

from omegaconf.errors import ValidationError
from omegaconf.nodes import BooleanNode, FloatNode, IntegerNode

from onn.config import data, export, model, task
from onn.config.run import ONNConfig

CONF = Path(__file__).resolve().parents[2] / "conf"  # the config groups run.py composes from
# a leading `~` or `~user` of a value or of a list's item, followed by a path: `~/shapes`, `"~/r1"`, `a,~/b`
HOME = re.compile(r"(^|[,\[])([\"']?)(~[\w.-]*)(?=/)")

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
# the typed values value_problem checks, by the OmegaConf node that holds each (and checks it as Hydra merges it)
NODES: dict[Any, type] = {int: IntegerNode, float: FloatNode, bool: BooleanNode}
# The config groups whose block's type is the option's schema (SCHEMAS), not the root's field type (ModelConfig, Any)
GROUP_SCHEMAS = {group: tuple(schemas.values()) for group, schemas in SCHEMAS.items()}


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


def register_resolvers() -> None:
    """`${onn.env:NAME,DEFAULT}`: an environment variable, or DEFAULT when it is unset or empty (OmegaConf's
    oc.env takes an empty ONN_CACHE as a folder: the working directory). Registered when onn.config is imported,
    so that every process that resolves a config (a sweep's job processes too) has it."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("onn.env"):
        OmegaConf.register_new_resolver("onn.env", _env_or)


def _env_or(name: str, default: Any = None) -> Any:
    return os.environ.get(name) or default


def expand_home(argv: list[str]) -> list[str]:
    """`key=~/path` with `~` expanded, as a shell expands it in `cd ~/path`: bash leaves it in `data.source=~/x`
    (no variable assignment), and Hydra's parser refuses an unquoted `~` there. A quoted `"~/x"` is expanded too, so
    that the folder Hydra makes for `hydra.run.dir` is the one ONN checks and locks, not one named `~`."""
    out = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and not arg.startswith("-"):
            value = os.path.expanduser(value) if value == "~" else value  # `paths.outputs=~`: the home folder
            arg = f"{key}={HOME.sub(lambda m: m[1] + m[2] + os.path.expanduser(m[3]), value)}"
        out.append(arg)
    return out


def no_recipe(argv: list[str]) -> list[str]:
    """`recipe=null`, conf/config.yaml's own default written out, as Hydra writes "no recipe": `~recipe`. Hydra's
    defaults list took it for an option and raised a bare ValueError ("Config group override must be a string")."""
    nulls = ("recipe=null", "recipe='null'")
    if any(a.lstrip("+").startswith("recipe=") and a.lstrip("+") not in nulls for a in argv) and any(
        a.lstrip("+") in nulls for a in argv
    ):
        return argv  # recipe=null beside a recipe it would silently drop: group_problem says it is given twice
    out = ["~recipe" if arg.lstrip("+") in nulls else arg for arg in argv]
    return [a for i, a in enumerate(out) if a != "~recipe" or "~recipe" not in out[:i]]  # said twice: once


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
    sentence naming its line; Hydra would print its YAML parser's traceback. A key given twice in one mapping is
    refused too, as Hydra's loader (OmegaConf's) refuses it. None when each parses."""
    import yaml
    from omegaconf import OmegaConf

    for arg in argv:
        group, _, names = arg.lstrip("+~").partition("=")
        if not names or "." in group or "/" in group:
            continue  # a key's value, or hydra/launcher=...
        for name in names.split(","):
            path = conf_dir / group / f"{name.strip()}.yaml"
            if not path.is_file():
                continue  # Hydra names the options a misspelt one could be
            try:
                OmegaConf.load(path)  # Hydra's loader: PyYAML's safe_load keeps the last of a duplicate key
            except yaml.YAMLError as e:
                mark = getattr(e, "problem_mark", None)
                where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
                problem = getattr(e, "problem", None) or str(e).splitlines()[0]
                return f"{path.resolve()}{where}: {problem}; fix the YAML there."
            except Exception:  # noqa: BLE001 -- YAML that parses but is no config (a bare number): Hydra says so
                continue
    return None


def group_problem(argv: list[str], conf_dir: Path) -> str | None:
    """A config group the command line chooses twice (`recipe=a recipe=b`: Hydra keeps the last without a word) or
    as a list (`recipe=[a,b]`: Hydra merges both options into one), or an option it does not have, as one sentence;
    so is null for a group (missing_option) or for a block or setting that no schema lets be null (null_problem).
    None when each is chosen once, and is there."""
    groups = {p.name for p in conf_dir.iterdir() if p.is_dir() and p.name != "hydra"}
    chosen: dict[str, str] = {}
    for arg in argv:
        group, _, value = arg.lstrip("+~").partition("=")
        if group not in groups and not arg.startswith("~") and (problem := null_problem(arg, group, value)):
            return problem
        if group not in groups or not value:
            continue
        advice = "copy one and add the other's keys" if group == "recipe" else f"give one {group}"
        if value.lstrip().startswith("["):
            return f"{arg}: a run takes one {group}, not a list; {advice}."
        if problem := missing_option(arg, conf_dir / group, value):
            return problem
        if chosen.setdefault(group, value) != value:
            return f"{group} is given twice ({chosen[group]}, {value}); a run takes one {group}: {advice}."
    return None


def null_problem(arg: str, key: str, value: str) -> str | None:
    """`optim=null` or `trainer.max_steps=null` where every option's schema types the key as not Optional: Hydra's
    answer is five lines ("Error merging override ... is not Optional"); one sentence instead. None for any other
    value, or a key that may be null (Optional, Any) or that no schema types."""
    hints = leaf_hints(key) if value.strip().lower() == "null" else []
    if not hints or any(h is Any or (get_origin(h) in (Union, UnionType) and type(None) in get_args(h)) for h in hints):
        return None
    if all(is_dataclass(h) for h in hints):
        return f"{arg}: every run holds the {key} block of ONN's settings, not null; set its keys ({key}.KEY=VALUE)."
    return f"{arg}: {key} is one of ONN's typed settings, which every run holds, and cannot be null; give it a value."


def missing_option(arg: str, folder: Path, value: str) -> str | None:
    """`model=lama_small` (or one name of a sweep's `model=a,b`) that is no file of the group's folder, naming the
    closest option: Hydra lists every option of the group (40 models) and leaves the one meant to be found."""
    if "(" in value or "$" in value:
        return None  # glob(*), choice(a,b), an interpolation: Hydra's to expand
    options = sorted(p.stem for p in folder.glob("*.yaml"))
    for name in (n.strip().strip("'\"") for n in value.split(",")):
        if name == "null" and folder.name != "recipe":  # Hydra's defaults list raised a bare ValueError for it
            return f"{arg}: every run takes a {folder.name} config, not null; give one of {', '.join(options)}."
        if name == "null" and "," in value:  # (Hydra's bare ValueError too, and an empty sweep folder)
            return f"{arg}: a sweep takes recipes by name, not null; run recipe=null on its own, or leave it out."
        if name in ("", "null") or (folder / f"{name}.yaml").is_file():
            continue  # recipe=null alone is no recipe (no_recipe)
        close = difflib.get_close_matches(name, options, n=1)
        hint = f" (did you mean {folder.name}={close[0]}?)" if close else ""
        return f"{arg}: conf/{folder.name} has no option {name}{hint}; give one of {', '.join(options)}."
    return None


def compose_problem(argv: list[str], conf_dir: Path) -> str | None:
    """Three mistakes Hydra's composition reports in its own terms, as one sentence: a key set under a block that is
    null in this config (`serve.slots=4` with no task=serve to give `serve`, `data.builtin.train_size=32` of
    data=gsm8k: OmegaConf's AssertionError, a 23-line traceback), a recipe's task.* key that the task given on
    the command line lacks (`recipe=bench_chaos task=plan`: "Key 'tracks' not in 'TrainTask'"), and a misspelt key
    (`trainer.max_epoch=3`, named with the closest key). A sweep's (`-m`) are found too, before any job starts: once
    for each option a swept group takes (sweep_lines). It composes only for a command line that could hold one;
    None for anything else (Hydra says it)."""
    from hydra import compose, initialize_config_dir

    if (overrides := parsed_overrides(argv)) is None:
        return None
    if problem := _checkpoint_data_problem(overrides, conf_dir):
        return problem
    optional = {f.name for f in fields(ONNConfig) if f.default is None}  # top-level blocks null by default
    under = [o for o in overrides if not o.is_delete() and _under_block(o.key_or_group, optional, o.value())]
    groups = {p.name for p in conf_dir.iterdir() if p.is_dir()}
    suspects = [o for o in overrides if _unknown_name(o, groups)]  # trainer.max_epoch=3
    named = {o.key_or_group for o in overrides}
    if not under and not suspects and not {"recipe", "task"} <= named:
        return None
    with initialize_config_dir(config_dir=str(conf_dir.resolve()), version_base="1.3"):
        for line in sweep_lines(overrides, [*under, *suspects], groups) or []:
            try:
                cfg = compose("config", overrides=line)
            except Exception as e:  # noqa: BLE001 -- anything but a recipe's task key, Hydra says itself
                return _recipe_task_problem(e, overrides, conf_dir)
            if problem := _key_problem(cfg, suspects, under, conf_dir):
                return problem
    return None


def parsed_overrides(argv: list[str]) -> list | None:
    """The command line's overrides as Hydra parses them; None where Hydra's own options are given (--help, --cfg
    job, -cn NAME, ...) or a line does not parse (Hydra names it)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if any(a.startswith("-") and a not in ("-m", "--multirun") for a in argv):
        return None
    try:
        return OverridesParser.create().parse_overrides([a for a in argv if not a.startswith("-")])
    except Exception:  # noqa: BLE001 -- Hydra names a line it cannot parse
        return None


def parse_problem(argv: list[str]) -> str | None:
    """The first override Hydra's grammar cannot read (`prompt=What's up?`, `prompt=What is (17 + 25)?`), as one
    sentence saying how to quote it: Hydra's own message is its lexer's, which names no fix. None where every one
    parses, or where Hydra's own options are given (parsed_overrides)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if any(a.startswith("-") and a not in ("-m", "--multirun") for a in argv):
        return None
    parser = OverridesParser.create()
    for arg in argv:
        key, equals, value = arg.partition("=")
        if arg.startswith("-") or not equals or not _parses(parser, f"{key}=x"):
            continue  # Hydra's option, or a key it cannot read: its own message names that
        if not _parses(parser, arg):
            # Hydra's quoted form escapes a double quote inside it (and the backslashes before one or before its
            # closing quote); in bash, single quotes keep that form as written, and a value holding an apostrophe
            # needs the shell's double quotes, inside which \\ " $ ` are escaped
            escaped = re.sub(r'(\\*)("|$)', lambda m: m[1] * 2 + "\\" * len(m[2]) + m[2], value)  # Hydra's escapes
            quoted = f'{key}="{escaped}"'
            shell = f"'{quoted}'" if "'" not in value else '"' + re.sub(r'([\\"$`])', r"\\\1", quoted) + '"'
            return (
                f"{arg}: Hydra cannot read this value (a quote, bracket or other character its override grammar "
                f"reserves); quote the value for Hydra inside the shell's quotes, e.g. {shell}."
            )
    return None


def _parses(parser: Any, override: str) -> bool:
    """Whether Hydra's grammar reads `override` (its parse_overrides wraps the lexer's errors as this one)."""
    from hydra.errors import OverrideParseException

    try:
        parser.parse_overrides([override])
    except OverrideParseException:
        return False
    return True


def value_problem(argv: list[str]) -> str | None:
    """A value its key's type refuses (`trainer.max_steps=abc`), or one value of a sweep's (`-m
    trainer.max_steps=10,abc`), as one sentence before anything runs: Hydra's message is five lines, and a sweep's
    comes after its sweep folder is made. Checked only where every option's schema types the key as a whole number,
    a number or true/false, by OmegaConf's own nodes, which Hydra's merge uses; None for anything else. A value
    Hydra's grammar cannot read at all comes first (parse_problem)."""
    from hydra.core.override_parser.types import QuotedString

    if problem := parse_problem(argv):
        return problem
    if (overrides := parsed_overrides(argv)) is None:
        return None
    for o in overrides:
        if o.is_delete() or o.is_hydra_override() or o.package is not None or "/" in o.key_or_group:
            continue
        kinds = leaf_types(o.key_or_group)
        nodes = [NODES[kind] for kind in kinds if kind in NODES]
        if not nodes or len(nodes) != len(kinds):
            continue  # a group, a free-form or text key, or a key typed otherwise in some option
        try:
            values = list(o.sweep_iterator()) if o.is_sweep_override() else [o.value()]
        except Exception:  # noqa: BLE001 -- interval() and glob(): their sweeper's to expand
            continue
        for value in values:
            value = value.text if isinstance(value, QuotedString) else value
            if value is None or (isinstance(value, str) and "${" in value):
                continue  # null: Hydra says whether the key takes it; an interpolation resolves later
            if all(_refuses(node, value) for node in nodes):
                what = {"IntegerNode": "a whole number", "FloatNode": "a number", "BooleanNode": "true or false"}
                return (
                    f"{o.input_line}: {o.key_or_group} takes {what[nodes[0].__name__]}, and {value!r} is not one; "
                    f"fix the value{' (no job of the sweep has run)' if o.is_sweep_override() else ''}."
                )
    return None


def delete_problem(argv: list[str], conf_dir: Path) -> str | None:
    """`~optim.lr` or `~ckpt`: a typed setting of ONN's schema, which a run always holds (Hydra answers "does not
    support deletion" in five lines, or "'ckpt' does not exist"). One sentence saying to set it instead; deleting a
    config group (`~recipe`) or a free-form key (`~model.kwargs.x`) is left to Hydra, which does it."""
    if (overrides := parsed_overrides(argv)) is None:
        return None
    groups = {p.name for p in conf_dir.iterdir() if p.is_dir()}
    for o in overrides:
        key = o.key_or_group
        if not o.is_delete() or o.is_hydra_override() or key in groups or not (hints := leaf_hints(key)):
            continue
        nullable = all(get_origin(h) in (Union, UnionType) and type(None) in get_args(h) for h in hints)
        return (
            f"{o.input_line}: {key} is one of ONN's typed settings, which every run holds, and cannot be deleted; "
            f"set it instead ({key}={'null for none' if nullable else 'VALUE'})."
        )
    return None


def _refuses(node: type, value: object) -> bool:
    """Whether OmegaConf's `node` refuses `value`, as Hydra's merge of the override would."""
    try:
        node(value)
    except ValidationError:
        return True
    return False


def leaf_types(key: str) -> list[Any]:
    """The types every option's schema gives `key` (`trainer.max_steps`: [int]), Optional unwrapped; [] where a part
    is free-form (model.kwargs.x) or no schema has the key."""
    unwrapped = [[a for a in get_args(h) if a is not type(None)] if get_origin(h) in (Union, UnionType) else [h]
                 for h in leaf_hints(key)]  # fmt: skip
    return [options[0] if len(options) == 1 else Any for options in unwrapped]


def leaf_hints(key: str) -> list[Any]:
    """The type hints every option's schema gives `key` as written (`ckpt`: [str | None]); [] as for leaf_types."""
    parts = key.split(".")
    kinds: list[Any] = [ONNConfig]
    for part in parts[:-1]:
        kinds = [below for kind in kinds if is_dataclass(kind) for below in _field_kinds(kind, part)]
    if not kinds or not all(is_dataclass(kind) for kind in kinds):
        return []
    return [get_type_hints(kind)[parts[-1]] for kind in kinds if parts[-1] in {f.name for f in fields(kind)}]


def sweep_lines(overrides: list, skip: list, groups: set[str]) -> list[list[str]] | None:
    """The command lines to compose for the checks, less the keys they check (`skip`) and Hydra's own: the one given,
    or for a sweep one per option of each swept group (the other swept groups at their first), its swept keys left
    out (their names are checked, not their values). None where a swept group's options cannot be listed here (a
    glob, an Optuna interval): Hydra says what is wrong then."""
    fixed, swept = [], []
    for o in overrides:
        if o in skip or o.is_hydra_override():
            continue
        if not o.is_sweep_override():
            fixed.append(o.input_line)
        elif o.key_or_group in groups:
            try:
                swept.append([f"{o.get_key_element()}={value}" for value in o.sweep_string_iterator()])
            except Exception:  # noqa: BLE001 -- glob(*) needs Hydra's config loader; interval() has no list
                return None
    firsts = [options[0] for options in swept]
    lines = [[*fixed, *firsts[:i], option, *firsts[i + 1 :]] for i, options in enumerate(swept) for option in options]
    return lines or [fixed]


def _key_problem(cfg: Any, suspects: list, under: list, conf_dir: Path) -> str | None:
    """The first misspelt key of `suspects`, or key of `under` set in a block that is null in the composed `cfg`."""
    from omegaconf import OmegaConf

    for o in suspects:
        if problem := _misspelt_key_problem(cfg, o):
            return problem
    for o in under:  # applied as Hydra applies them, in order
        if (block := _null_block(cfg, o.key_or_group, isinstance(o.value(), dict))) is not None:
            return _null_block_problem(cfg, o, block, conf_dir)
        if o.is_sweep_override():
            continue  # one value of several: the keys after it are checked in the config without it
        try:
            OmegaConf.update(cfg, o.key_or_group, o.value(), merge=True, force_add=o.is_add() or o.is_force_add())
        except Exception:  # noqa: BLE001 -- a misspelt key or a wrong type: Hydra's message names it
            return None
    return None


def _unknown_name(override: Any, groups: set[str]) -> bool:
    """A plain `key=value` that no option's schema has (`trainer.max_epoch=3`, `trainer.lr=0.1`: optim's key): a
    misspelt key, or one inside a block free-form here but typed in the option chosen, which _misspelt_key_problem
    tells apart on the composed config."""
    key = override.key_or_group
    if override.is_add() or override.is_force_add() or override.is_delete() or override.package is not None:
        return False  # `+`/`++` keys: app.to_config names one no dataclass has; `~key`: Hydra names a missing one
    if key in groups or key.split(".")[0] == "hydra" or "/" in key:
        return False
    return not schema_has(key)


@cache
def schema_has(key: str) -> bool:
    """Whether some option's schema has `key` as a path of fields (`model.small_input`: a network's), or `key` lies
    inside a value that is no dataclass (model.kwargs.widths, optim.betas.0, task.tracks.NAME.overrides)."""
    kinds: list[Any] = [ONNConfig]
    for part in key.split("."):
        if any(not is_dataclass(kind) for kind in kinds):
            return True  # a free-form value (Any, a list, a dict): any key below it may be there
        kinds = [below for kind in kinds for below in _field_kinds(kind, part)]
        if not kinds:
            return False
    return True


def _field_kinds(kind: type, name: str) -> list[Any]:
    """The types field `name` of dataclass `kind` may hold ([]: no such field): a group's schemas for the root's
    groups, the dataclass (or dataclasses) it is typed as, or Any for a value of another type."""
    if kind is ONNConfig and name in GROUP_SCHEMAS:
        return list(GROUP_SCHEMAS[name])
    if name not in {f.name for f in fields(kind)}:
        return []
    hint = get_type_hints(kind)[name]
    options = get_args(hint) if get_origin(hint) in (Union, UnionType) else (hint,)
    kinds = [option for option in options if option is not type(None)]
    return kinds if all(is_dataclass(option) for option in kinds) else [Any]


def _misspelt_key_problem(cfg: Any, override: Any) -> str | None:
    """`trainer.max_epoch=3`, which Hydra answers with "To append to your config use +trainer.max_epoch=3": a key
    nothing reads. One sentence naming the closest key of its block instead; None where the key is there, or inside
    a free-form block (model.kwargs) or a null one (the null-block check's to say)."""
    from omegaconf import DictConfig, OmegaConf

    node, path = cfg, []
    for part in override.key_or_group.split("."):
        kind = OmegaConf.get_type(node) if isinstance(node, DictConfig) and not node._is_none() else None
        if kind is None or not is_dataclass(kind) or node._is_missing():
            return None
        names = [f.name for f in fields(kind)]
        if part not in names:
            close = [".".join([*path, name]) for name in difflib.get_close_matches(part, names, n=1)]
            close = _same_key_elsewhere(cfg, part) or close  # trainer.lr=0.1: optim.lr
            hint = f" (did you mean {close[0]}?)" if close else ""
            return (
                f"{override.input_line}: {override.key_or_group} is not a key of ONN's config{hint}; fix its name "
                "(docs/config.md lists the groups' keys)."
            )
        node, path = node._get_node(part), [*path, part]
    return None


def _same_key_elsewhere(cfg: Any, name: str) -> list[str]:
    """The keys of that name in the config's top-level blocks (`lr`: optim.lr), for a key given under another."""
    from omegaconf import DictConfig

    blocks = [(block, cfg._get_node(block)) for block in cfg]
    return [
        f"{block}.{name}"
        for block, node in blocks
        if isinstance(node, DictConfig) and not node._is_none() and not node._is_missing() and name in node
    ]


def _checkpoint_data_problem(overrides: list, conf_dir: Path) -> str | None:
    """`ckpt=RUN data.KEY=...` without data=NAME: Hydra checks data.KEY against the data config the defaults list
    chooses (conf/config.yaml's data=math, text) before the checkpoint's own data config is read, so a key of an
    image checkpoint's data (`data.test_source`) was refused as "Key 'test_source' not in 'TextData'"."""
    from hydra import compose, initialize_config_dir

    named = {o.key_or_group for o in overrides}
    ckpt = next((o for o in overrides if o.key_or_group == "ckpt"), None)
    data_keys = [o for o in overrides if o.key_or_group.startswith("data.")]
    if ckpt is None or ckpt.value() in (None, "null") or "data" in named or not data_keys:
        return None
    rest = [o.input_line for o in overrides if o not in data_keys and not o.key_or_group.startswith("hydra")]
    with initialize_config_dir(config_dir=str(conf_dir.resolve()), version_base="1.3"):
        try:
            cfg = compose("config", overrides=rest)
        except Exception:  # noqa: BLE001 -- another mistake: Hydra says it
            return None
    for o in data_keys:
        key = o.key_or_group.split(".")[1]
        if key not in cfg.data:
            given = o.input_line.lstrip("+")
            return (
                f"{given}: with ckpt= and no data=NAME, Hydra checks data keys against the default data="
                f"{cfg.data.name} ({cfg.data.modality} data, no {key}) before the checkpoint's own data config is "
                f"read; name the checkpoint's data config too (data=NAME data.source=PATH, as its run's config.yaml "
                f"says), then {given}."
            )
    return None


def _under_block(key: str, optional: set[str], value: object) -> bool:
    """A key inside a block that can be null: two levels down (data.builtin.train_size), or in a top-level block
    that is null unless its task sets it (serve.slots); or a block given whole (`strategy.lora={r: 4}`), which
    OmegaConf cannot merge into a null one."""
    parts = key.split(".")
    if parts[0] == "hydra":
        return False
    if isinstance(value, dict) and (len(parts) > 1 or parts[0] in optional):
        return True
    return len(parts) > 2 or (len(parts) == 2 and parts[0] in optional)


def _null_block(cfg, key: str, whole: bool) -> str | None:
    """The first block on the way to `key` that is null in cfg (`key` itself when a block is given `whole`): the
    block OmegaConf cannot set a key in (its AssertionError) nor merge a dict into (its AttributeError)."""
    from omegaconf import DictConfig

    parts, node = key.split("."), cfg
    for depth, part in enumerate(parts, start=1):
        if not isinstance(node, DictConfig) or part not in node:
            return None  # a misspelt key: Hydra's message names it
        node = node._get_node(part)
        last = depth == len(parts)
        if node._is_none() and (not last or (whole and isinstance(node, DictConfig))):
            return ".".join(parts[:depth])
    return None


def _null_block_problem(cfg, override, block: str, conf_dir: Path) -> str:
    """`serve.slots=4: serve is null in this config ...`, naming the options that give the block (task=serve): a block
    left null cannot be given on the command line, neither key by key nor whole."""
    from omegaconf import OmegaConf

    given, key, value = override.input_line.lstrip("+"), override.key_or_group, override.value()
    group = block.split(".")[0]
    schema = OmegaConf.get_type(cfg[group]) if "." in block else None  # data.builtin: of the data schema in use
    owners = block_owners(block, conf_dir, schema)
    if isinstance(value, dict):
        sets = " ".join(_leaves(key, value))
    else:  # a sweep's values as given (`strategy.lora.r=4,8`), which Hydra cannot write as one value
        sets = given if override.is_sweep_override() else f"{key}={override.get_value_element_as_str()}"
    what = "cannot be given whole on the command line" if key == block else f"has no {key[len(block) + 1 :]} to set"
    if not owners:
        return f"{given}: {block} is null in this config, so it {what}, and no config option gives it; drop {given}."
    named = ", ".join(owners[:4]) + (f" or {len(owners) - 4} more" if len(owners) > 4 else "")
    return (
        f"{given}: {block} is null in this config, so it {what}; choose an option that gives {block} ({named}), "
        f"then set {sets}."
    )


def _leaves(key: str, value: object) -> list[str]:
    """`strategy.lora={r: 4, alpha: 8}` as the keys it sets: strategy.lora.r=4 strategy.lora.alpha=8."""
    if not isinstance(value, dict):
        return [f"{key}={value}"]
    return [leaf for k, v in value.items() for leaf in _leaves(f"{key}.{k}", v)]


def block_owners(block: str, conf_dir: Path, schema: type | None = None) -> list[str]:
    """The config options that give `block` a value (`strategy.lora`: strategy=lora, strategy=qlora, ...;
    `serve`: task=serve, task=bench_serve), read from their YAML files; for a block inside a group, only the
    options of that group whose schema is `schema` (data.builtin of text data: data=math, not data=mesh)."""
    parts, owners = block.split("."), []
    for folder in sorted(p for p in conf_dir.iterdir() if p.is_dir() and p.name not in ("hydra", "recipe")):
        for path in sorted(folder.glob("*.yaml")):
            values, kind, depth = option_values(path)
            top = path.read_text().lstrip().startswith("# @package _global_")
            if not top and (parts[0] != folder.name or (schema is not None and kind not in (None, schema))):
                continue
            if _lookup(values, parts if top else parts[1:]) is not None:
                owners.append((depth, f"{folder.name}={path.stem}"))
    return [name for _, name in sorted(owners)]  # the options built on no other first (data=image before data=mnist)


def option_values(path: Path) -> tuple[dict, type | None, int]:
    """A config option's values (its YAML over the option of its own group its defaults name: lora over full), the
    schema its defaults name (`/schema/data/text@_here_`; None: its group's root type), and how many options of its
    group it is built on."""
    import yaml

    own = yaml.safe_load(path.read_text()) or {}
    values, kind, depth = {}, None, 0
    for entry in own.pop("defaults", None) or []:
        if not isinstance(entry, str) or entry == "_self_":
            continue
        if entry.startswith("/schema/"):
            group, _, name = entry.removeprefix("/schema/").partition("@")[0].partition("/")
            kind = SCHEMAS.get(group, {}).get(name)
        elif "/" not in entry and (path.parent / f"{entry}.yaml").is_file():
            values, kind, depth = option_values(path.parent / f"{entry}.yaml")
            depth += 1
    return _merged(values, own), kind, depth


def _merged(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merged(out[key], value) if both else value
    return out


def _lookup(values: object, parts: list[str]) -> object:
    """values[parts[0]][parts[1]]...; None where a part is missing or null."""
    for part in parts:
        if not isinstance(values, dict):
            return None
        values = values.get(part)
    return values


def recipe_group_problem(key: str, choices: dict[str, str], conf_dir: Path) -> str | None:
    """A key with no value under a block the chosen option leaves null, which the recipe gave:
    `recipe=phi4_math_sparse_lora strategy=full` merges the recipe's strategy.lora (r, alpha) into full's null lora,
    and its target_modules has no value. One sentence naming the recipe and the option; None for any other key."""
    import yaml

    group, recipe = key.split(".")[0], choices.get("recipe")
    option = conf_dir / group / f"{choices.get(group)}.yaml"
    if not recipe or "." not in key or not option.is_file():
        return None
    values, parts = option_values(option)[0], key.split(".")[1:]
    depth = next((i for i in range(1, len(parts)) if _is_null(values, parts[:i])), None)
    if depth is None:
        return None
    block = ".".join([group, *parts[:depth]])
    defaults = (yaml.safe_load((conf_dir / "recipe" / f"{recipe}.yaml").read_text()) or {}).get("defaults") or []
    own = next((d[f"override /{group}"] for d in defaults if isinstance(d, dict) and f"override /{group}" in d), None)
    whose = f"its own {group} ({group}={own})" if own else f"a {group} that gives {block}"
    return (
        f"recipe={recipe} sets {block}, which {group}={choices[group]} leaves null, so {key} has no value; run the "
        f"recipe with {whose}, or copy the recipe and drop its {block} keys."
    )


def _is_null(values: dict, parts: list[str]) -> bool:
    """values holds parts (a.b) and it is null there."""
    parent = _lookup(values, parts[:-1]) if len(parts) > 1 else values
    return isinstance(parent, dict) and parts[-1] in parent and parent[parts[-1]] is None


def _recipe_task_problem(error: Exception, overrides: list, conf_dir: Path) -> str | None:
    """`recipe=bench_chaos task=plan`: the recipe's task keys are its own task's; None for any other error."""
    import yaml
    from omegaconf.errors import ConfigKeyError

    recipe = next((str(o.value()) for o in overrides if o.key_or_group == "recipe"), None)
    cause = error.__cause__ or error.__context__  # Hydra raises its own error while handling OmegaConf's
    key = str(getattr(cause, "full_key", ""))
    if not isinstance(cause, ConfigKeyError) or not key.startswith("task.") or recipe is None:
        return None
    if f"'recipe/{recipe}'" not in str(error):
        return None  # the command line's own task.* key: Hydra's "Could not override" names it
    given = next((o for o in overrides if o.key_or_group == "task"), None)
    if given is None or given.is_sweep_override():
        return None  # `task=plan,train`: Hydra names the job's task
    defaults = (yaml.safe_load((conf_dir / "recipe" / f"{recipe}.yaml").read_text()) or {}).get("defaults") or []
    own = next((d["override /task"] for d in defaults if isinstance(d, dict) and "override /task" in d), None)
    whose = f"task={own} (the task the recipe names)" if own else "another task"
    return (
        f"recipe={recipe} sets {key}, a key of {whose}, and task={given.value()} has no such key; run the recipe "
        "with its own task, or copy the recipe and drop its task.* keys."
    )


register_resolvers()  # at import: see register_resolvers
