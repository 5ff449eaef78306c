"""A new user's walkthrough: data.val_split outside (0, 1) refused by the plan, before any data is read (it was said
once every image was decoded), and an export=omny run's metrics name the .omny as export/omny alone (export/onnx
named the .omny file too)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_export_onnx import CLASSIFIERS, classifier

from onn.errors import UserError


@pytest.mark.parametrize(("modality", "value"), [("image", "1.5"), ("image", "2"), ("audio", "-0.1")])
def test_a_classifiers_plan_refuses_a_val_split_outside_0_1(tmp_path, modality, value):
    """The plan refuses it in the data module's sentence, with data.source a folder that does not exist: nothing is
    read (the old plan passed, and the run refused it only once the data was decoded)."""
    from conftest import compose

    from onn.hardware.profile import resolve
    from onn.modalities.registry import get

    given = [*CLASSIFIERS[modality][0], f"data.source={tmp_path / 'unread'}", "hardware=cpu_16gb"]
    config = compose(*given, f"paths.cache={tmp_path / 'cache'}", f"data.val_split={value}")
    hardware = resolve(config.hardware, tmp_path / "cache", tmp_path)
    with pytest.raises(UserError, match=r"^data\.val_split must be between 0 and 1 \(got .*\): it is the fraction"):
        get(config.data.modality).plan(config, hardware)
    for fine in ("0.3", "0"):  # a fraction plans as before; 0 waits for the data (a val/ folder of its own may set it)
        config = compose(*given, f"paths.cache={tmp_path / 'cache'}", f"data.val_split={fine}")
        assert get(config.data.modality).plan(config, hardware)[0].strategy == "full"


@pytest.mark.slow  # torch.onnx's trace and the .omny's plans: about 10 s on a small CPU
def test_an_omny_exports_metrics_name_the_omny_file_as_export_omny_alone(tmp_path):
    """export=omny's metrics had export/onnx naming the .omny file beside export/omny (export/onnx is the .onnx file
    of export=onnx); the classifier's class names are still written into the .omny."""
    import onnx

    from onn.modalities.classification import export_module

    m, config, module = classifier(tmp_path, "image", "export=omny")
    metrics = export_module(m, config, module.eval(), tmp_path / "run")
    assert "export/onnx" not in metrics
    written = Path(metrics["export/omny"])
    assert written.suffix == ".omny" and written.is_file()
    props = {p.key: p.value for p in onnx.load(str(written), load_external_data=False).metadata_props}
    assert json.loads(props["onn.classes"]) == [str(c) for c in m.planned_inputs(config)["classes"]]
