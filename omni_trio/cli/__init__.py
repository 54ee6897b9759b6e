"""The ``omni-trio`` command line (``python -m omni_trio``).

- :mod:`~omni_trio.cli.main`: dispatch and exit codes (``run``, the console script's entry);
- :mod:`~omni_trio.cli.args`: the grammar (the parser, the CONFIG argument, usage errors);
  :mod:`~omni_trio.cli.model_dir`: ``--model DIR`` (a pipeline's model swapped for a
  checkpoint directory);
- :mod:`~omni_trio.cli.commands`: the one-shot commands (``demo``, ``run``, ``validate``,
  ``schema``, ``bench``); :mod:`~omni_trio.cli.serve`: ``serve`` until SIGINT or SIGTERM;
- :mod:`~omni_trio.cli.runner`: running prompts through an engine (stream text, save audio,
  time stages);
- :mod:`~omni_trio.cli.console`: the terminal (third-party chatter into a log file, a quick
  clean exit); :mod:`~omni_trio.cli.progress`: live start-up progress.

The only part of the package that imports :mod:`omni_trio.server`.
"""
