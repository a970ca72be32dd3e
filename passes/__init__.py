"""fxfuse's rewrite passes, one module each; passes/pipeline.py lists them in order."""
from .pipeline import PIPELINE, run_pipeline

__all__ = ["PIPELINE", "run_pipeline"]
