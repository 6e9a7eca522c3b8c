"""Entry point for ``python -m mpistage``."""

from mpistage.cli import main

if __name__ == "__main__":
    main()
