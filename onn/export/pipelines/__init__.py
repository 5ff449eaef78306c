"""Models exported as pipelines of .omny pieces (registry.py): SAM2 (sam2.py), Grounding DINO and Grounded SAM2
(grounding_dino.py), TrOCR (ocr.py). Each module registers its pipeline on import."""

from onn.export.pipelines import grounding_dino, ocr, sam2  # noqa: F401  (each registers its pipeline)
from onn.export.pipelines.export import export_pipeline
from onn.export.pipelines.registry import PIPELINES, for_model
from onn.export.pipelines.run import run_pipeline, validate_pipeline
from onn.export.pipelines.runtime import Request

__all__ = ["PIPELINES", "Request", "export_pipeline", "for_model", "run_pipeline", "validate_pipeline"]
