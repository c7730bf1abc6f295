"""The app layer: the ``clozax`` command line (``cli.py`` and the options of its larger
commands: ``train.py``, ``judge.py`` for the commands that read a run, ``finetune.py``,
``embed.py`` for ``embed`` and ``retrieval``), the demo, the lesson's fixture and the
documentation's generated reference pages. It parses and calls; nothing below imports it."""
