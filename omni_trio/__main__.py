"""``python -m omni_trio``: the ``omni-trio`` command."""

from .cli import run

if __name__ == "__main__":
    run()
