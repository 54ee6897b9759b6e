"""``python -m omni_trio``: the ``omni-trio`` command."""

from .cli.main import run

if __name__ == "__main__":
    run()
