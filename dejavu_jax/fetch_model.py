"""`python -m dejavu_jax.fetch_model`: download SmolLM2-135M once into the cache, offline after."""

import sys

from dejavu_jax.gguf_loader import fetch_smollm2


def main() -> int:
    """Fetch the default model (if needed) and print its path."""
    print(fetch_smollm2())
    return 0


if __name__ == "__main__":
    sys.exit(main())
