"""Fine-tuning, ``clozax finetune``: the protocol (``protocol.py``: a learning-rate ×
layer-decay grid over seeds on the trained encoder and its random-init control, the setting
chosen on validation, the test metric and its intervals), its jobs (``jobs.py``) and their
choice (``select.py``), the task heads and metrics (``heads.py``), task files and GLUE
(``tasks.py``, ``glue.py``), the fine-tuned model on disk (``saved.py``: written by the
protocol, read by ``predict.py`` and by ``clozax export``)."""
