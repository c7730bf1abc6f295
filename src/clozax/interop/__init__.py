"""Hugging Face ``transformers`` interop: export a run, import a checkpoint, with logit parity.

``export_run`` writes what ``AutoModelForMaskedLM`` / ``AutoTokenizer`` load offline: post-LN
runs as ``BertForMaskedLM``, pre-LN runs as ``RobertaPreLayerNormForMaskedLM``, runs with the
modern architecture (the ``modern-*`` presets) as ``ModernBertForMaskedLM``;
``import_hf`` reads such a directory (safetensors only, never pickle) into a clozax run;
``hf_parity`` measures the difference against ``transformers``.

One module per model family (``bert``, ``roberta_prelayernorm``: each a ``Family`` of names over
the shared layout in ``family``; ``modernbert``, a layout of its own), registered in
``families``; ``hf_files`` reads ``save_pretrained`` directories. Exported weights are
float32; a ``compute_dtype="bfloat16"`` run then matches in transformers only to bf16
precision.
"""

from clozax.interop.export import export_run
from clozax.interop.imports import import_hf
from clozax.interop.parity import encode_batch, hf_parity

__all__ = ["encode_batch", "export_run", "hf_parity", "import_hf"]
