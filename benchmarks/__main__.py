"""``python -m benchmarks COMMAND [options]``: a command is a module of this package with a
``main(argv)``.  Tables go to stdout, progress to stderr."""

from __future__ import annotations

import importlib
import signal
import sys
from typing import Any

COMMANDS = {
    "comm": "Dask comms side by side: ping-pong, flood, nchains, idle CPU",
    "variants": "lci with one knob switched, against default lci and tcp",
    "dask": "Dask graphs on a LocalCluster per scheme, beside an in-process one",
    "workloads": "users' workloads on one host and across simulated hosts",
    "asap": "ASAP against bsp, bsp-ring and async on simulated hosts",
    "budget": "where a small-message round trip spends its time (py-spy)",
    "report": "a saved run (--json) as a table, a page of the docs or figures",
}


def _interrupt(signum: int, frame: Any) -> None:
    """SIGTERM stops a run as Ctrl-C does: the clusters and simulated hosts it made go too."""
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        print("usage: python -m benchmarks COMMAND [--help | options]\n\ncommands:\n" + "\n".join(
            f"  {name:<10} {what}" for name, what in COMMANDS.items()), file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    command, rest = argv[0], argv[1:]
    module, options = ("comm", {"command": command}) if command == "variants" else (command, {})
    try:
        return int(importlib.import_module(f"benchmarks.{module}").main(rest, **options))
    except KeyboardInterrupt:
        print("interrupted; peer processes were stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _interrupt)
    sys.exit(main(sys.argv[1:]))
