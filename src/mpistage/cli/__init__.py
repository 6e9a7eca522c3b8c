"""The ``mpistage`` tools: one command-line layer over the library.

Each tool is a module here with ``parser()`` (argparse) and ``main(argv)``,
which calls the library function of the same name with one keyword per
flag (``mpistage pack`` is :func:`mpistage.pack`). :func:`main` is the one
place that turns a :class:`~mpistage.StageError` into the one-line
``mpistage: error: ...`` and exit status 1. The runner and the stager are
not here: they run in every rank and live in :mod:`mpistage.runtime`.
"""

import sys as _sys

from mpistage import COMMANDS, TOOLS


def main(argv):
    """Run the tool named by ``argv[0]`` with the rest; return the exit status."""
    import importlib

    from mpistage import StageError

    name, rest = argv[0], argv[1:]
    try:
        module = importlib.import_module(TOOLS[name])
        return module.main(rest)
    except StageError as exc:
        error(exc)
        return 1
    except KeyboardInterrupt:
        error(f"{name} interrupted")
        return 130
    except BrokenPipeError:
        return closed_stdout()


def closed_stdout():
    """End quietly when the reader of stdout left (``mpistage inspect | head``).

    Python would otherwise print a second traceback when it flushes stdout
    at exit; pointing stdout at /dev/null first keeps that quiet too.
    """
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, _sys.stdout.fileno())
    return 141  # 128 + SIGPIPE, what a shell tool killed by it returns


def argument_parser(**kwargs):
    """An ``argparse.ArgumentParser`` whose usage errors follow the tools' rule.

    The rule, for every tool, the runner and the stager: a usage error (an
    unknown option, a missing or bad argument) prints one ``mpistage:
    error: COMMAND: ...`` line, then the command's usage, and exits with
    status 2; an error in what the command works on exits with status 1.
    argparse alone would print the usage first and ``mpistage run: error:``.
    """
    import argparse

    class Parser(argparse.ArgumentParser):
        def error(self, message):
            command = self.prog.removeprefix("mpistage ")
            error(f"{command}: {message}")
            self.exit(2, self.format_usage())

    return Parser(**kwargs)


def error(message):
    """Print the one-line error of the command line, control characters escaped."""
    from mpistage.bundle.inspect import printable

    print(f"mpistage: error: {printable(message)}", file=_sys.stderr, flush=True)


def unknown(word):
    """Refuse a word that is neither a command nor a script; return 2."""
    error(
        f"unknown command {word!r}; commands: {', '.join(COMMANDS)} "
        "(to run a script, give its path: mpistage ./app.py)"
    )
    return 2
